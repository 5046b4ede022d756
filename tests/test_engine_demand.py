"""The closed-form timing of demand-only layer steps (``Runner._layers_closed_form`` with
``SimBackend.demand_timing`` / ``demand_loads``) equals the event-driven path, to the
last bit.

Every comparison runs the same configuration with ``fast=True`` (the default) and
``fast=False`` (every layer through the link's event loop) and requires identical
summaries, per-layer and per-request tables, transfer logs and access logs.  A hand
computation pins down one layer's closed form.
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoesim.config.build import policy_from_preset
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.sim import SimBackend
from fmoesim.engine.simulate import RunResult, simulate
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace.reader import Trace
from policies.base import Policy
from tests._engine_helpers import (
    SMALL_MOE,
    Req,
    pre_gate_s,
    random_trace,
    small_synthetic_trace,
    transfer_s,
    write_trace,
)
from tests.tiny import TINY_HW, small_model

#: Presets that never prefetch: every layer step of theirs takes the closed form.
DEMAND_ONLY = ["lru", "fifo", "rnd", "lfu", "lcp", "belady"]
#: Presets that load on demand only but never take the closed form: DeepSpeed-Inference
#: fetches every expert of a layer (unrouted ones too), which the closed form does not model.
WHOLE_LAYER = ["deepspeed"]
#: Presets that prefetch on some layers: the run switches between the two paths.
MIXED = ["brainstorm", "dependency", "mixtral-offloading", "pregated", "promoe", "fmoe"]
#: Synchronous presets: a layer's resident experts wait for every transfer in flight, the
#: layer's own loads included, so no step of theirs takes the closed form.
SYNC = ["mixtral-offloading-sync", "moe-infinity-sync"]


def make_policy(name: str) -> Policy:
    policy = policy_from_preset(name)
    assert isinstance(policy, Policy)
    return policy


def assert_same_run(a: RunResult, b: RunResult) -> None:
    """Bit-identical results (wall-clock fields aside)."""
    drop = {"wall_s", "speedup_vs_real"}
    sa = {k: v for k, v in a.summary.items() if k not in drop}
    sb = {k: v for k, v in b.summary.items() if k not in drop}
    assert sa.keys() == sb.keys()
    for k in sa:
        if sa[k] != sb[k] and not (sa[k] != sa[k] and sb[k] != sb[k]):  # NaN == NaN
            raise AssertionError(f"summary[{k!r}]: {sa[k]!r} (fast) != {sb[k]!r} (events)")
    for table in ("layer_table", "request_table"):
        ta, tb = getattr(a.metrics, table)(), getattr(b.metrics, table)()
        for col in ta:
            np.testing.assert_array_equal(ta[col], tb[col], err_msg=f"{table}[{col}]")
    ta, tb = a.transfer_table(), b.transfer_table()
    for col in ta:
        np.testing.assert_array_equal(ta[col], tb[col], err_msg=f"transfers[{col}]")
    if a.accesses is not None or b.accesses is not None:
        assert a.accesses is not None and b.accesses is not None
        for col in a.accesses:
            np.testing.assert_array_equal(a.accesses[col], b.accesses[col], err_msg=col)
    for ca, cb in zip(a.caches, b.caches, strict=True):
        assert list(ca.entries) == list(cb.entries)  # same contents, same admission order
        assert list(dict.keys(ca.evictable)) == list(dict.keys(cb.evictable))
        assert (ca.evictions, ca.peak_bytes) == (cb.evictions, cb.peak_bytes)


def run_both(
    trace: Trace, model: ModelSpec, hw: HardwareSpec, name: str, budget: int, **kw: Any
) -> tuple[RunResult, RunResult, int]:
    """(fast run, event-driven run, layer steps the fast run timed in closed form)."""
    backends: list[SimBackend] = []

    def make(caches: Any) -> SimBackend:
        be = SimBackend(hw, ComputeModel.from_specs(model, hw), caches)
        backends.append(be)
        return be

    fast = simulate(trace, model, hw, make_policy(name), budget, make_backend=make, **kw)
    slow = simulate(trace, model, hw, make_policy(name), budget, fast=False, **kw)
    return fast, slow, backends[0].closed_form_steps


# -- every preset on a synthetic trace with probabilities --------------------------------

MODEL = dataclasses.replace(
    SMALL_MOE,
    name="demand",
    num_shared_experts=1,
    shared_expert_intermediate_size=512,
    dense_layers=1,
)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return small_synthetic_trace(tmp_path_factory.mktemp("demand") / "trace", MODEL, seed=5)


SERVINGS = {
    "batch-1": ServingConfig(mode="static", batch_size=1),
    "batch-3": ServingConfig(mode="static", batch_size=3),
    "online": ServingConfig(mode="online", max_batch_size=3),
}


@pytest.mark.parametrize(
    ("name", "serving"),
    [
        (n, s)
        for n in DEMAND_ONLY + WHOLE_LAYER + MIXED + SYNC
        for s in SERVINGS
        if not (n == "belady" and s == "online")  # Belady needs the future: static only
    ],
)
def test_fast_equals_event_driven(trace: Trace, name: str, serving: str) -> None:
    budget = 10 * MODEL.expert_size_bytes  # 10 of 32 experts
    fast, slow, closed = run_both(
        trace, MODEL, TINY_HW, name, budget, serving=SERVINGS[serving], access_log=True
    )
    assert_same_run(fast, slow)
    assert fast.summary["misses"] > 0 and fast.summary["stall_s"] > 0
    if name in DEMAND_ONLY:  # every layer step: the link is idle and there are no actions
        assert closed == fast.summary["layer_steps"]
    elif name in WHOLE_LAYER + SYNC:  # red for SYNC if its loads overlap its hits
        assert closed == 0
    else:
        assert 0 <= closed < fast.summary["layer_steps"]


@pytest.mark.parametrize("name", DEMAND_ONLY + WHOLE_LAYER + MIXED)
@pytest.mark.parametrize("experts", [2, 10])
def test_hit_only_fast_equals_event_driven(trace: Trace, name: str, experts: int) -> None:
    """Red if a hit-rate-only run of a policy without gate hooks, which takes the timed
    backend's closed form, differs in anything but wall time from the same run event by
    event on the hit-rate-only backend (the link's landing): hits, per-layer counts,
    transfer and access logs, the caches' order; red too if such a policy does not take
    that path, or a policy with gate hooks (they may prefetch) does. Two experts of room
    is less than a batch's misses (deferred loads)."""
    from fmoesim.engine.cache import ExpertCache
    from fmoesim.engine.simulate import _demand_only

    policy = make_policy(name)
    cache = ExpertCache(experts * MODEL.expert_size_bytes, policy)
    assert _demand_only(policy, MODEL, [cache]) == (name in ("lru", "fifo", "rnd", "lfu"))
    serving = ServingConfig(mode="static", batch_size=3)
    kw: dict[str, Any] = dict(serving=serving, timing=False, access_log=True)
    budget = experts * MODEL.expert_size_bytes
    fast = simulate(trace, MODEL, TINY_HW, make_policy(name), budget, **kw)
    slow = simulate(trace, MODEL, TINY_HW, make_policy(name), budget, fast=False, **kw)
    assert_same_run(fast, slow)
    assert fast.summary["misses"] > 0


def test_fast_path_is_off_with_two_gpus(trace: Trace) -> None:
    hw = dataclasses.replace(TINY_HW, num_gpus=2)
    fast, slow, closed = run_both(trace, MODEL, hw, "lru", 6 * MODEL.expert_size_bytes)
    assert closed == 0
    assert_same_run(fast, slow)


# -- random traces, tight budgets ----------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    name=st.sampled_from(DEMAND_ONLY + WHOLE_LAYER),
    L=st.integers(1, 3),
    E=st.integers(2, 6),
    k=st.integers(1, 3),
    extra=st.integers(0, 6),
    lengths=st.lists(st.integers(1, 5), min_size=1, max_size=4),
    prompt=st.integers(1, 3),
    batch=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_random_traces_fast_equals_event_driven(
    name: str,
    L: int,
    E: int,
    k: int,
    extra: int,
    lengths: list[int],
    prompt: int,
    batch: int,
    seed: int,
) -> None:
    """Budgets down to ``top_k`` experts: a batch's union may not fit next to the pinned
    hits, and the layer must then go to the general path (deferred loads)."""
    k = min(k, E)
    model = small_model(L, E, k)
    with tempfile.TemporaryDirectory() as d:
        tr = random_trace(Path(d) / "t", model, lengths, seed, prompt)
    budget = (k + extra) * model.expert_size_bytes
    fast, slow, _ = run_both(
        tr, model, TINY_HW, name, budget, serving=ServingConfig(batch_size=batch), seed=seed
    )
    assert_same_run(fast, slow)


def test_batch_larger_than_the_cache_falls_back_to_the_general_path(tmp_path: Path) -> None:
    """Two requests in a batch, 4 distinct experts needed per layer, room for 2: the
    closed form does not apply (the misses cannot all be admitted at once); the general
    path loads what fits, computes, frees, and loads the rest."""
    model = small_model(1, 4, 2)
    tr = write_trace(
        tmp_path / "t",
        model,
        [Req(0, 1, [[[0, 1]], [[0, 1]]]), Req(1, 1, [[[2, 3]], [[2, 3]]])],
    )
    fast, slow, closed = run_both(
        tr,
        model,
        TINY_HW,
        "lru",
        2 * model.expert_size_bytes,
        serving=ServingConfig(batch_size=2),
    )
    assert_same_run(fast, slow)
    assert closed == 0
    # iteration 0 misses all four; iteration 1 hits 2 and 3, whose pins keep 0 and 1
    # waiting until they have computed
    assert (fast.summary["hits"], fast.summary["misses"]) == (2, 6)


# -- one layer by hand ----------------------------------------------------------------------


def test_closed_form_of_one_layer_by_hand(tmp_path: Path) -> None:
    """One MoE layer, top-3, room for all 4 experts; one token per iteration.
    Iteration 0 misses experts 0, 1, 2; iteration 1 hits 0 and 1 and misses 3.

    With ``T`` = fixed cost + bytes / bandwidth (one load on an idle link) and ``x`` =
    one expert on one token (``a + b``), from the end of attention + router:
    iteration 0 loads three experts back to back, landing at ``T``, ``2T``, ``3T``; each
    computes when it lands (``x < T``), so it waits ``T``, then ``T - x`` twice, and
    ends at ``3T + x``.  Iteration 1 computes its two hits (``2x``) while expert 3
    loads, waits ``T - 2x`` and ends at ``T + x``.
    """
    model = small_model(1, 4, 3)
    hw = TINY_HW
    tr = write_trace(tmp_path / "t", model, [Req(0, 1, [[[0, 1, 2]], [[0, 1, 3]]])])
    fast, slow, closed = run_both(tr, model, hw, "lru", 4 * model.expert_size_bytes)
    assert_same_run(fast, slow)
    assert closed == 2
    c = ComputeModel.from_specs(model, hw)
    T = transfer_s(hw, model)
    x = c.expert_a_s + c.expert_b_s
    assert T > 2 * x  # the loads dominate, as the formulas above assume
    head = c.lm_head_s(1)
    it0 = pre_gate_s(c, [(1, 0)]) + 3 * T + x + head
    it1 = pre_gate_s(c, [(1, 1)]) + T + x + head
    s = fast.summary
    assert (s["hits"], s["misses"]) == (2, 4)
    assert s["simulated_s"] == pytest.approx(it0 + it1, rel=1e-12)
    assert s["stall_s"] == pytest.approx((T + 2 * (T - x)) + (T - 2 * x), rel=1e-12)
    ends = [t.end_s for t in fast.transfers]
    t1 = it0 + pre_gate_s(c, [(1, 1)])
    assert ends == pytest.approx([it0 - x - head - 2 * T + i * T for i in range(3)] + [t1 + T])
