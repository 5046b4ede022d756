"""End-to-end simulator runs on hand-made traces with hand-computed expectations."""

from __future__ import annotations

import numpy as np
import pytest

from fmoesim.engine import simulate
from fmoesim.errors import ConfigError
from fmoesim.trace import read_trace
from policies.lru import LRU
from tests.tiny import TINY, TINY_HW, write_sequence_trace

# Layer 0 routes a, b, a, c, b, a (experts 0 1 0 2 1 0); layer 1 always expert 3.
ROUTES = [[0, 3], [1, 3], [0, 3], [2, 3], [1, 3], [0, 3]]


@pytest.fixture
def seq_trace(tmp_path):
    return read_trace(write_sequence_trace(tmp_path / "seq", ROUTES))


def test_lru_hit_rate_matches_hand_trace(seq_trace):
    # Accesses interleave layers: a d b d a d c d b d a d (d = layer 1 expert 3).
    # Global LRU holding 2 experts: every layer-0 access misses (each evicts the
    # other layer-0 expert), every layer-1 access after the first hits: 5 / 12.
    budget = 2 * TINY.expert_size_bytes
    r = simulate(seq_trace, TINY, TINY_HW, LRU(), budget)
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == (5, 0, 7)
    assert s["hit_rate"] == pytest.approx(5 / 12)
    np.testing.assert_allclose(r.hit_rate_per_layer, [0.0, 5 / 6])
    assert s["evictions"] == 5
    assert s["pcie_bytes"] == 7 * TINY.expert_size_bytes
    assert s["peak_expert_bytes"] == budget


def test_lru_with_room_for_all_misses_only_cold(seq_trace):
    r = simulate(seq_trace, TINY, TINY_HW, LRU(), 4 * TINY.expert_size_bytes)
    assert r.summary["misses"] == 4  # a, d, b, c once each
    assert r.summary["evictions"] == 0


def test_one_miss_per_layer_costs_transfer_time_of_stall(seq_trace):
    # One expert of budget and layers alternating: all 12 accesses miss, and each stalls
    # the GPU for exactly fixed cost + bytes / bandwidth (the link is idle each time).
    r = simulate(seq_trace, TINY, TINY_HW, LRU(), TINY.expert_size_bytes)
    s = r.summary
    assert s["misses"] == 12
    per_miss = TINY_HW.transfer_overhead_s + TINY.expert_size_bytes / (TINY_HW.pcie_gbps * 1e9)
    assert s["stall_s"] == pytest.approx(12 * per_miss, rel=1e-12)
    # on-demand only: the run is compute plus stall, nothing overlaps
    assert s["simulated_s"] == pytest.approx(s["gpu_busy_s"] + s["stall_s"], rel=1e-12)


def test_ttft_and_tpot_follow_the_clock(seq_trace):
    r = simulate(seq_trace, TINY, TINY_HW, LRU(), 4 * TINY.expert_size_bytes)
    req = r.metrics.request_table()
    s = r.summary
    assert req["e2e_s"][0] == pytest.approx(s["simulated_s"])
    assert req["ttft_s"][0] + 5 * req["tpot_s"][0] == pytest.approx(req["e2e_s"][0])
    # prefill had 2 cold misses, so the first token is slower than a decode step
    assert req["ttft_s"][0] > req["tpot_s"][0]


def test_budget_below_one_layer_topk_is_refused(seq_trace):
    with pytest.raises(ConfigError, match="cache.budget_gb.*top-1"):
        simulate(seq_trace, TINY, TINY_HW, LRU(), TINY.expert_size_bytes - 1)


def test_trace_model_mismatch_is_refused(seq_trace):
    from dataclasses import replace

    other = replace(TINY, num_experts=8)
    with pytest.raises(ConfigError, match="model.num_experts"):
        simulate(seq_trace, other, TINY_HW, LRU(), 4 * other.expert_size_bytes)


def test_same_seed_same_results(seq_trace):
    a = simulate(seq_trace, TINY, TINY_HW, LRU(), 2 * TINY.expert_size_bytes, seed=3).summary
    b = simulate(seq_trace, TINY, TINY_HW, LRU(), 2 * TINY.expert_size_bytes, seed=3).summary
    drop = {"wall_s", "speedup_vs_real"}
    assert {k: v for k, v in a.items() if k not in drop} == {
        k: v for k, v in b.items() if k not in drop
    }


def test_batched_decode_needs_union_of_experts(tmp_path):
    # Two identical requests batched: each layer needs one expert, counted once per batch.
    from fmoesim.engine.serving import ServingConfig
    from fmoesim.trace import TraceManifest, TraceModel, TraceWriter

    man = TraceManifest(
        model=TraceModel("tiny", 2, 4, 1, 1000),
        embedding_dim=0,
        source={"kind": "synthetic"},
        has_probs=False,
        has_spec_probs=False,
    )
    with TraceWriter(tmp_path / "b", man) as w:
        for rid, route in ((0, [0, 1]), (1, [2, 1])):
            w.add_request(rid, 1, 2)
            for i in range(2):
                c = np.zeros((2, 4), np.int32)
                c[[0, 1], route] = 1
                w.add_iteration(rid, i, 1, None, c)
    tr = read_trace(tmp_path / "b")
    r = simulate(
        tr, TINY, TINY_HW, LRU(), 4 * TINY.expert_size_bytes, serving=ServingConfig(batch_size=2)
    )
    # per iteration: layer 0 needs {0, 2}, layer 1 needs {1}: 3 accesses x 2 iterations
    assert r.summary["accesses"] == 6
    assert r.summary["misses"] == 3
