"""The contract every registered policy (every ``conf/policy/*.yaml``) must keep.

Each policy runs on one small synthetic trace (with gate probabilities and speculative
probabilities, so prefetching policies act) in five settings: timed static batching,
hit-rate-only, online serving, two GPUs, and a link of several lanes with sliced
transfers.  Invariants checked on every run:

- the budget is never exceeded (peak bytes per GPU <= budget);
- pinned or in-flight entries are never evicted (the cache raises if a policy names
  one; a deliberately broken policy below shows that it does);
- ``victim`` has no side effects (asked twice in a row, it answers the same);
- hits + late + misses = the accesses the trace implies (counted independently here);
- bytes are conserved: per GPU, bytes moved = bytes evicted + bytes still cached, and
  the summary's PCIe bytes = the transfer log's;
- identical config and seed give identical results;
- an admission-ordered policy's order holds exactly the cached keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path

import numpy as np
import pytest

from fmoesim.config.build import policy_from_preset, preset_names
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import RunResult, simulate
from fmoesim.errors import ConfigError
from fmoesim.trace import read_trace
from fmoesim.trace.reader import Trace
from policies.base import Policy
from policies.lru import LRU
from tests._engine_helpers import SMALL_MOE, small_synthetic_trace
from tests.tiny import TINY_HW

MODEL = SMALL_MOE
SIZE = MODEL.expert_size_bytes
BUDGET = 12 * SIZE  # 12 of 32 experts
POLICIES = preset_names("policy")
SETTINGS = {
    "static": dict(serving=ServingConfig(mode="static", batch_size=2)),
    "hits-only": dict(serving=ServingConfig(mode="static", batch_size=1), timing=False),
    "online": dict(serving=ServingConfig(mode="online", max_batch_size=3)),
    "two-gpus": dict(serving=ServingConfig(mode="static", batch_size=1), num_gpus=2),
    # a link of 3 lanes moving each transfer as 2 slices (fmoesim.engine.sim.LaneLink)
    "lanes": dict(serving=ServingConfig(mode="static", batch_size=2), lanes=3, slices=2),
    # prefetches reserve their bytes when their copy starts (engine.reserve=start)
    "reserve-start": dict(serving=ServingConfig(mode="static", batch_size=2), reserve="start"),
}


def r_policy_segments(r: RunResult) -> bool:
    """Whether the run's transfers include expert segments (keys beyond L * E)."""
    n = MODEL.num_layers * MODEL.num_experts
    return any(t.key >= n for t in r.transfers)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return small_synthetic_trace(tmp_path_factory.mktemp("contract") / "trace", MODEL, seed=3)


def make_policy(name: str) -> Policy:
    policy = policy_from_preset(name)
    assert isinstance(policy, Policy)
    return policy


def run(trace: Trace, policy: Policy, setting: str, seed: int = 0) -> RunResult:
    kw = dict(SETTINGS[setting])
    hw = dataclasses.replace(
        TINY_HW,
        num_gpus=int(kw.pop("num_gpus", 1)),
        link_lanes=int(kw.pop("lanes", 1)),
        transfer_slices=int(kw.pop("slices", 1)),
    )
    # the default path (closed-form demand layers included), except the LRU hit-only
    # kernel, which keeps no caches or transfers to check
    fast = setting != "hits-only"
    return simulate(trace, MODEL, hw, policy, BUDGET, seed=seed, fast=fast, **kw)  # type: ignore[arg-type]


def expected_accesses(trace: Trace, result: RunResult, setting: str) -> int:
    """Accesses implied by the trace: per iteration and layer, the union of the batch's
    experts.  Batches are read back from the access log's (step -> iteration) mapping
    for online serving; static batching is recomputed here."""
    if setting == "online":
        return -1  # checked through the access log below
    b = SETTINGS[setting]["serving"].batch_size  # type: ignore[attr-defined]
    total = 0
    n = trace.num_requests
    for start in range(0, n, b):
        batch = range(start, min(start + b, n))
        for j in range(max(int(trace.output_tokens[r]) for r in batch)):
            rows = [int(trace.iter_start[r]) + j for r in batch if trace.output_tokens[r] > j]
            total += int(np.count_nonzero(trace.counts[rows].sum(axis=0)))
    return total


class _SideEffectProbe:
    """Wraps ``policy.victim`` so that each call is made twice and must agree."""

    def __init__(self, policy: Policy) -> None:
        self.inner = policy.victim
        self.calls = 0

    def __call__(self, candidates: Collection[int], incoming: int) -> int:
        first = self.inner(candidates, incoming)
        second = self.inner(candidates, incoming)
        assert first == second, f"victim() answered {first} then {second}: it has side effects"
        self.calls += 1
        return first


def _refused_online(trace: Trace, policy: Policy, setting: str) -> bool:
    """An oracle policy needs a known future: the simulator must refuse online serving
    with a one-line ConfigError (checked here); True when that was the case."""
    if not (policy.uses_future and setting == "online"):
        return False
    with pytest.raises(ConfigError, match="needs static batching"):
        run(trace, policy, setting)
    return True


def _refused_reserve(trace: Trace, policy: Policy, setting: str) -> bool:
    """``engine.reserve=start`` does not model split experts (budget groups) or a policy
    whose layers wait for their prefetches: the simulator must refuse those with a
    one-line ConfigError (checked here); True when that was the case."""
    if setting != "reserve-start" or not (policy.uses_segments or policy.waits_for_prefetches()):
        return False
    with pytest.raises(ConfigError, match="engine.reserve"):
        run(trace, policy, setting)
    return True


@pytest.mark.parametrize("setting", list(SETTINGS))
@pytest.mark.parametrize("name", POLICIES)
def test_invariants(trace: Trace, name: str, setting: str) -> None:
    policy = make_policy(name)
    if _refused_online(trace, policy, setting) or _refused_reserve(trace, policy, setting):
        return
    probe = _SideEffectProbe(policy)
    policy.victim = probe  # type: ignore[method-assign]
    r = run(trace, policy, setting)
    s = r.summary
    # budget
    for c in r.caches:
        assert c.peak_bytes <= BUDGET
        assert c.used_bytes == sum(e.size_bytes for e in c.entries.values())
        assert all(e.pins == 0 for e in c.entries.values()), "pins leaked past the run"
    # accesses
    assert s["hits"] + s["late"] + s["misses"] == s["accesses"]
    exp = expected_accesses(trace, r, setting)
    if exp >= 0:
        assert s["accesses"] == exp
    # bytes
    moved = [t for t in r.transfers if not t.cancelled]
    assert s["pcie_bytes"] == sum(t.moved_bytes for t in moved)
    assert s["aborted_bytes"] == sum(t.moved_bytes for t in moved if t.aborted)
    assert all(0 <= t.moved_bytes < t.size_bytes for t in moved if t.aborted)
    for c in r.caches:  # an aborted transfer's entry left the books without landing
        landed_g = sum(t.size_bytes for t in moved if t.gpu == c.gpu and not t.aborted)
        assert landed_g == c.evicted_bytes + c.used_bytes
    assert s["transfers"] == len(moved)
    if s["misses"]:
        # every miss is loaded (a split expert's miss may load only its bottom segment)
        per_miss = 1 if r_policy_segments(r) else SIZE
        assert s["on_demand_bytes"] >= s["misses"] * per_miss
    # every transfer landed (the run lets in-flight prefetches finish)
    for c in r.caches:
        assert all(e.resident for e in c.entries.values())
        # the residency array a batch of arrays turns on follows the entries, and no
        # eviction log is left on
        if c.resident_mask is not None:
            assert set(np.flatnonzero(c.resident_mask).tolist()) == set(c.entries)
        assert c.evicted_log is None
    # an admission order (LRU, FIFO and the prefetchers built on them) holds exactly the
    # cached keys: its on_insert relies on never being told of a key it already holds
    # (DeepSpeed-Inference keeps the fetched, never-used experts of its whole-layer
    # fetches in a second order, before every used one)
    order = getattr(policy, "_order", None)
    if isinstance(order, dict):
        unused = set(getattr(policy, "_unused", {}))
        assert not unused & set(order)
        assert set(order) | unused == {k for c in r.caches for k in c.entries}


@pytest.mark.parametrize("name", POLICIES)
def test_the_least_budget_on_eight_gpus(trace: Trace, name: str) -> None:
    """Red if the budget check asks every GPU for a whole layer's top-k (a GPU of eight
    computes at most ceil(8 / 8) = 1 of a token's experts a layer), or if a policy breaks
    on one expert a GPU: every preset runs there, batched, with the budget kept and every
    access counted, or refuses with one line (MoEpic, whose buffer needs two)."""
    policy = make_policy(name)
    hw = dataclasses.replace(TINY_HW, num_gpus=MODEL.num_experts)
    serving = ServingConfig(mode="static", batch_size=2)
    if name.startswith("moepic"):
        with pytest.raises(ConfigError, match="leave nothing beside MoEpic's buffer"):
            simulate(trace, MODEL, hw, policy, SIZE, serving=serving)
        return
    r = simulate(trace, MODEL, hw, policy, SIZE, serving=serving)
    s = r.summary
    assert len(r.caches) == MODEL.num_experts
    assert all(c.peak_bytes <= SIZE for c in r.caches)
    assert s["hits"] + s["late"] + s["misses"] == s["accesses"]
    assert s["accesses"] == expected_accesses(trace, r, "static")
    with pytest.raises(ConfigError, match="must hold the 2 experts of contract that one of 4"):
        simulate(trace, MODEL, dataclasses.replace(TINY_HW, num_gpus=4), policy, SIZE)


@pytest.mark.parametrize("setting", ["static", "online"])
@pytest.mark.parametrize("name", POLICIES)
def test_same_seed_same_result(trace: Trace, name: str, setting: str) -> None:
    p1, p2 = make_policy(name), make_policy(name)
    if _refused_online(trace, p1, setting):
        return
    a, b = run(trace, p1, setting, seed=5), run(trace, p2, setting, seed=5)
    drop = {"wall_s", "speedup_vs_real"}
    # NaN (a metric the run has no value for) equals NaN here, as in a stored row
    key = {k: "nan" if v != v else v for k, v in a.summary.items() if k not in drop}
    assert key == {k: "nan" if v != v else v for k, v in b.summary.items() if k not in drop}
    ta, tb = a.transfer_table(), b.transfer_table()
    for col in ta:
        np.testing.assert_array_equal(ta[col], tb[col])


def test_online_accesses_match_the_batches_run(trace: Trace) -> None:
    """In online serving, the accesses equal the union of experts of the batches the
    scheduler actually formed (read back from a recording policy)."""

    class Recording(LRU):
        def reset(self, ctx):  # type: ignore[no-untyped-def]
            super().reset(ctx)
            self.batches: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

        def on_iteration_start(self, batch):  # type: ignore[no-untyped-def]
            self.batches.append((batch.request_ids, batch.request_iterations))

    pol = Recording()
    r = run(trace, pol, "online")
    pos = {int(rid): i for i, rid in enumerate(trace.request_id)}
    total = 0
    for rids, js in pol.batches:
        rows = [int(trace.iter_start[pos[rid]]) + j for rid, j in zip(rids, js, strict=True)]
        total += int(np.count_nonzero(trace.counts[rows].sum(axis=0)))
    assert r.summary["accesses"] == total
    assert max(len(rids) for rids, _ in pol.batches) <= 3


def test_a_policy_that_names_a_pinned_victim_is_refused(tmp_path: Path) -> None:
    """The cache, not the policy, guards pinned and in-flight entries."""
    from tests.tiny import TINY, write_sequence_trace

    class Rogue(LRU):
        def victim(self, candidates, incoming):  # type: ignore[no-untyped-def]
            return incoming - 1 if incoming % TINY.num_experts else incoming + 1

    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0, 1], [1, 2], [2, 3], [3, 0]]))
    with pytest.raises(RuntimeError, match="pinned, in flight, absent"):
        simulate(tr, TINY, TINY_HW, Rogue(), 2 * TINY.expert_size_bytes)


def test_every_preset_is_a_distinct_policy() -> None:
    """Each YAML names a Policy subclass; policy names are unique."""
    names = [make_policy(n).name for n in POLICIES]
    assert len(names) == len(set(names)), names
    assert "lru" in names
