"""What a policy sees at each gate: counts, probabilities and speculative predictions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.trace import read_trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.base import NO_ACTIONS, Actions, GateRows, GateView
from policies.lru import LRU
from tests.test_policy_contract import MODEL
from tests.tiny import TINY_HW


class Recording(LRU):
    """LRU that records every gate it is shown."""

    uses_probs = True
    uses_spec = True

    def reset(self, ctx):  # type: ignore[no-untyped-def]
        super().reset(ctx)
        self.gates: list[tuple[int, int, np.ndarray, np.ndarray | None, np.ndarray | None]] = []

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        # the lists first (a policy may read only them), then the arrays: the same values
        counts_list, spec_list = gate.counts_list, gate.spec_list
        spec = None if gate.spec_next is None else gate.spec_next.copy()
        probs = None if gate.probs is None else gate.probs.copy()
        self.gates.append((gate.step, layer, gate.counts.copy(), probs, spec))
        assert counts_list == gate.counts.tolist() and type(counts_list[0]) is int
        assert spec_list == (None if spec is None else spec.tolist())
        return NO_ACTIONS


def test_gate_views_match_the_trace(tmp_path: Path) -> None:
    path = tmp_path / "t"
    cfg = SyntheticConfig(num_requests=3, embedding_dim=4, output_tokens_median=6, seed=1)
    generate(MODEL, cfg, path, overwrite=True)
    tr = read_trace(path)
    assert tr.spec_probs is not None and tr.spec_valid is not None and tr.probs is not None
    pol = Recording()
    simulate(tr, MODEL, TINY_HW, pol, 12 * MODEL.expert_size_bytes, serving=ServingConfig())
    L = MODEL.num_layers
    rows = [int(tr.iter_start[r]) + j for r in range(3) for j in range(int(tr.output_tokens[r]))]
    assert len(pol.gates) == len(rows) * L
    last_of_request = {int(tr.iter_start[r] + tr.output_tokens[r] - 1) for r in range(3)}
    for i, (step, layer, counts, probs, spec) in enumerate(pol.gates):
        row = rows[i // L]
        assert step == i and layer == i % L
        np.testing.assert_array_equal(counts, tr.counts[row, layer])
        np.testing.assert_allclose(probs, tr.probs[row, layer].astype(np.float32), rtol=1e-6)
        if layer + 1 < L:  # the prediction of the next layer, made one layer early
            nxt = (row, layer + 1)
        elif row not in last_of_request:  # layer 0 of the same request's next iteration
            nxt = (row + 1, 0)
        else:
            assert spec is None  # the request ends: nothing to predict
            continue
        if tr.spec_valid[nxt]:
            np.testing.assert_allclose(spec, tr.spec_probs[nxt].astype(np.float32), rtol=1e-6)
        else:
            assert spec is None


def test_batched_gates_lists_match_their_arrays(tmp_path: Path) -> None:
    """Batches of 3 (summed counts, weighted predictions): every gate's lists equal its
    arrays (checked in ``Recording``)."""
    path = tmp_path / "t"
    generate(MODEL, SyntheticConfig(num_requests=5, output_tokens_median=6, seed=2), path)
    tr = read_trace(path)
    pol = Recording()
    serving = ServingConfig(batch_size=3)
    simulate(tr, MODEL, TINY_HW, pol, 12 * MODEL.expert_size_bytes, serving=serving)
    assert any(g[4] is not None for g in pol.gates)
    assert any(int(g[2].max()) > 1 for g in pol.gates)  # an expert with several tokens


def test_a_gate_takes_its_counts_or_the_iterations_rows() -> None:
    rows = GateRows(np.array([[0, 2], [1, 0]]))
    g = GateView(1, None, 1, count_rows=rows)
    assert g.counts.tolist() == g.counts_list == [1, 0] and g.spec_next is None
    with pytest.raises(ValueError, match="counts or the iteration's count rows"):
        GateView(0, np.zeros(2), 1, count_rows=rows)
    with pytest.raises(ValueError, match="counts or the iteration's count rows"):
        GateView(0, None, 1)


def test_cancelling_a_key_the_layer_is_loading_does_nothing(tmp_path: Path) -> None:
    """A policy that cancels the expert its own layer is waiting for (an on-demand load
    still queued behind another) must not abort it: the run completes and the load is
    not marked cancelled."""
    from policies.base import Prefetch
    from tests.tiny import TINY, write_sequence_trace

    class CancelEverything(LRU):
        def on_gate(self, layer: int, gate: GateView) -> Actions:
            base = layer * TINY.num_experts
            keys = list(range(base, base + TINY.num_experts))
            return Actions(prefetch=[Prefetch(k) for k in keys[:1]], cancel=keys)

    tr = read_trace(write_sequence_trace(tmp_path / "t", [[1, 2], [3, 1], [2, 3]]))
    r = simulate(tr, TINY, TINY_HW, CancelEverything(), 3 * TINY.expert_size_bytes)
    assert not any(t.cancelled for t in r.transfers if t.reason == "on_demand")
    assert r.summary["misses"] >= 3


@pytest.mark.parametrize(
    ("timing", "landing"), [(True, "link"), (False, "link"), (False, "next_step")]
)
def test_a_deferred_miss_the_gate_then_prefetches_is_waited_for(
    tmp_path: Path, timing: bool, landing: str
) -> None:
    """Budget one expert, held by a delayed prefetch of key 1 that never started: layer
    0's miss of key 0 finds no room and waits; the gate's actions then cancel key 1 and
    prefetch key 0 itself. Red if the waiting miss, retried, admits key 0 a second time
    (ValueError: already cached or in flight) instead of waiting for that prefetch."""
    from policies.base import BatchInfo, Prefetch
    from tests.tiny import TINY, write_sequence_trace

    class FreeThenFetch(LRU):
        def on_iteration_start(self, batch: BatchInfo) -> Actions:
            if batch.iteration == 0:
                return Actions(prefetch=[Prefetch(1, 0.5)], delay_s=1.0)
            return NO_ACTIONS

        def on_gate(self, layer: int, gate: GateView) -> Actions:
            if layer == 0 and gate.step == 0:
                return Actions(cancel=[1], prefetch=[Prefetch(0, 0.5)])
            return NO_ACTIONS

    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0, 0], [0, 0]]))
    size = TINY.expert_size_bytes
    r = simulate(tr, TINY, TINY_HW, FreeThenFetch(), size, timing=timing, landing=landing)
    landed = [t.key for t in r.transfers if not t.cancelled]
    assert landed.count(0) == 2 and landed.count(4) == 2  # each layer's expert once a token
    if landing == "link":  # with next_step the delayed prefetch has landed by the gate
        assert [t.key for t in r.transfers if t.cancelled] == [1]


@pytest.mark.parametrize(
    ("timing", "landing"), [(True, "link"), (False, "link"), (False, "next_step")]
)
def test_aborting_keys_the_layer_is_loading_does_nothing(
    tmp_path: Path, timing: bool, landing: str
) -> None:
    """A policy that aborts every expert of its layer, the ones the layer waits for
    included, on every backend: the run completes, no on-demand load is stopped, and
    every hit or miss is counted.  Red if an abort dropped a load an access is pinned
    to (the GPU would wait for a transfer that never lands)."""
    from policies.base import Prefetch
    from tests.tiny import TINY, write_sequence_trace

    class AbortEverything(LRU):
        def on_gate(self, layer: int, gate: GateView) -> Actions:
            base = layer * TINY.num_experts
            keys = list(range(base, base + TINY.num_experts))
            nxt = ((layer + 1) % TINY.num_layers) * TINY.num_experts
            return Actions(prefetch=[Prefetch(nxt)], abort=keys)

    tr = read_trace(write_sequence_trace(tmp_path / "t", [[1, 2], [3, 1], [2, 3]]))
    r = simulate(
        tr, TINY, TINY_HW, AbortEverything(), 3 * TINY.expert_size_bytes,
        timing=timing, landing=landing,
    )  # fmt: skip
    assert not any(t.aborted or t.cancelled for t in r.transfers if t.reason == "on_demand")
    assert r.summary["accesses"] == 3 * TINY.num_layers * TINY.top_k


def test_a_link_step_backend_aborts_a_started_prefetch(tmp_path: Path) -> None:
    """Hit-rate-only with ``landing=link``: a prefetch issued at layer 0's gate has moved
    part of its bytes by layer 1's gate, where the policy aborts it: it leaves the link
    with the share moved so far (its link time is the fixed cost plus bytes over
    bandwidth), never lands, and its entry is gone; a cancel would have left it alone.
    Red if the hit-rate-only link kept a started prefetch the policy aborted."""
    from policies.base import Prefetch
    from tests.tiny import TINY, write_sequence_trace

    E = TINY.num_experts
    target = 1 * E + 0  # layer 1, expert 0: never routed

    class PrefetchThenStop(LRU):
        def __init__(self, how: str) -> None:
            self.how = how

        def on_gate(self, layer: int, gate: GateView) -> Actions:
            if gate.step == 2 and layer == 0:  # the decode step's first gate
                return Actions(prefetch=[Prefetch(target)])
            if gate.step == 3 and layer == 1:
                return Actions(**{self.how: [target]})  # type: ignore[arg-type]
            return NO_ACTIONS

    tr = read_trace(write_sequence_trace(tmp_path / "t", [[1, 2], [3, 1]]))
    budget = 4 * TINY.expert_size_bytes
    hw = replace(TINY_HW, transfer_overhead_s=0.0)  # bytes move from the first instant
    out = {}
    for how in ("abort", "cancel"):
        r = simulate(tr, TINY, hw, PrefetchThenStop(how), budget, timing=False)
        out[how] = [t for t in r.transfers if t.key == target]
        assert len(out[how]) == 1
    stopped, kept = out["abort"][0], out["cancel"][0]
    assert stopped.aborted and not stopped.cancelled
    assert 0 < stopped.moved_bytes < TINY.expert_size_bytes
    assert not kept.aborted and not kept.cancelled
    assert kept.moved_bytes == TINY.expert_size_bytes


def test_batched_gates_are_token_weighted_by_hand(tmp_path: Path) -> None:
    """A static batch of two prefills of different lengths, A (3 tokens) and B (1 token),
    then their decodes (1 token each), with hand-set probabilities (exact in float16).

    GateView documents ``probs`` as the token-weighted mean, and the Runner weights the
    speculative rows the same way: at a prefill gate the batch sees ``(3 p_A + 1 p_B) / 4``
    (and ``(3 s_A + 1 s_B) / 4`` for the next layer's prediction); at the last layer the
    prediction of the next iteration's layer 0 weighs each continuing request by its next
    iteration's tokens (1 each: ``(s_A + s_B) / 2``); at a decode gate both weigh 1/2; at
    the last decode nobody continues, so there is no prediction.  Counts are summed.
    Red when: the batch's probs (or its speculative rows) are averaged without weighting
    by each request's tokens (``(p_A + p_B) / 2`` at the prefill)."""
    from fmoesim.trace import TraceManifest, TraceModel, TraceWriter
    from tests.tiny import small_model

    model = small_model(2, 4, 2)
    nan = [np.nan] * 4
    # (request, iteration, tokens, counts, probs, spec_probs), each (L=2, E=4)
    rows = [
        (0, 0, 3, [[3, 3, 0, 0], [0, 3, 3, 0]],
         [[0.5, 0.25, 0.125, 0.125], [0.25, 0.25, 0.25, 0.25]],
         [nan, [0.5, 0.5, 0.0, 0.0]]),
        (0, 1, 1, [[1, 1, 0, 0], [0, 0, 1, 1]],
         [[0.125, 0.125, 0.25, 0.5], [0.5, 0.0, 0.5, 0.0]],
         [[0.25, 0.25, 0.5, 0.0], [0.0, 0.25, 0.25, 0.5]]),
        (1, 0, 1, [[0, 1, 1, 0], [1, 0, 0, 1]],
         [[0.0, 0.25, 0.25, 0.5], [1.0, 0.0, 0.0, 0.0]],
         [nan, [0.0, 0.0, 0.5, 0.5]]),
        (1, 1, 1, [[0, 0, 1, 1], [1, 1, 0, 0]],
         [[0.5, 0.25, 0.25, 0.0], [0.0, 0.5, 0.0, 0.5]],
         [[0.75, 0.25, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]),
    ]  # fmt: skip
    man = TraceManifest(
        model=TraceModel(model.name, 2, 4, 2, model.hidden_size),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/test_engine_gate.py"},
        has_probs=True,
        has_spec_probs=True,
    )
    with TraceWriter(tmp_path / "t", man) as w:
        w.add_request(0, 3, 2)
        w.add_request(1, 1, 2)
        for rid, it, n, counts, probs, spec in rows:
            w.add_iteration(rid, it, n, None, np.array(counts), np.array(probs), np.array(spec))
    tr = read_trace(tmp_path / "t")
    pol = Recording()
    serving = ServingConfig(batch_size=2)
    simulate(tr, model, TINY_HW, pol, 8 * model.expert_size_bytes, serving=serving)
    # (step, layer, counts, probs, spec_next), worked out by hand from the rows above
    want = [
        # prefill: weights 3/4 (A), 1/4 (B)
        (0, 0, [3, 4, 1, 0],
         [(3 * 0.5 + 0.0) / 4, (3 * 0.25 + 0.25) / 4, (3 * 0.125 + 0.25) / 4,
          (3 * 0.125 + 0.5) / 4],  # [0.375, 0.25, 0.15625, 0.21875]
         [(3 * 0.5 + 0.0) / 4, (3 * 0.5 + 0.0) / 4, (0.0 + 0.5) / 4, (0.0 + 0.5) / 4]),
        (1, 1, [1, 3, 3, 1],
         [(3 * 0.25 + 1.0) / 4, 3 * 0.25 / 4, 3 * 0.25 / 4, 3 * 0.25 / 4],
         # layer 0 of the decodes (1 token each): (s_A + s_B) / 2
         [(0.25 + 0.75) / 2, (0.25 + 0.25) / 2, (0.5 + 0.0) / 2, 0.0]),
        # decode: weights 1/2, 1/2
        (2, 0, [1, 1, 1, 1],
         [(0.125 + 0.5) / 2, (0.125 + 0.25) / 2, (0.25 + 0.25) / 2, (0.5 + 0.0) / 2],
         [(0.0 + 0.5) / 2, (0.25 + 0.5) / 2, (0.25 + 0.0) / 2, (0.5 + 0.0) / 2]),
        (3, 1, [1, 1, 1, 1], [0.25, 0.25, 0.25, 0.25], None),
    ]  # fmt: skip
    assert len(pol.gates) == len(want)
    for (step, layer, counts, probs, spec), (w_step, w_layer, w_counts, w_probs, w_spec) in zip(
        pol.gates, want, strict=True
    ):
        assert (step, layer, counts.tolist()) == (w_step, w_layer, w_counts)
        assert probs is not None
        np.testing.assert_allclose(probs, w_probs, rtol=1e-6, atol=1e-7)
        if w_spec is None:
            assert spec is None
        else:
            assert spec is not None
            np.testing.assert_allclose(spec, w_spec, rtol=1e-6, atol=1e-7)
