"""End-to-end simulator runs on hand-made traces with hand-computed expectations."""

from __future__ import annotations

from pathlib import Path

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
    # resident weights: embedding and LM head 2 x 1000 x 1000, attention 2 layers x 4 x
    # 1000 x 1000, routers 2 x 4 x 1000: 10,008,000 bf16 parameters (red when a part is
    # left out or the footprint is not resident + peak)
    assert s["vram_footprint_bytes"] == 2 * 10_008_000 + budget


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
    # NaN (a metric the run has no value for) equals NaN here, as in a stored row
    key = {k: "nan" if v != v else v for k, v in a.items() if k not in drop}
    assert key == {k: "nan" if v != v else v for k, v in b.items() if k not in drop}


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


@pytest.mark.parametrize("timing", [True, False])
@pytest.mark.parametrize("fast", [True, False])
def test_caching_off_releases_every_expert_after_use(seq_trace, timing, fast):
    """``release_after_use`` (MoE-Infinity §7.2: "experts are released from the buffer
    immediately after being used"): with room for all four experts, LRU still misses all
    12 accesses, evicts each expert as soon as it has computed (12 evictions), never holds
    more than one, and, timed, stalls 12 whole transfers.  Red if the demand closed form
    or the LRU fast path keeps what it loads, or a pinned miss is not released."""
    S = TINY.expert_size_bytes
    r = simulate(
        seq_trace, TINY, TINY_HW, LRU(), 4 * S, timing=timing, fast=fast, release_after_use=True
    )
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == (0, 0, 12)
    assert s["evictions"] == 12 and s["pcie_bytes"] == 12 * S
    assert s["peak_expert_bytes"] == S
    if timing:
        per_miss = TINY_HW.transfer_overhead_s + S / (TINY_HW.pcie_gbps * 1e9)
        assert s["stall_s"] == pytest.approx(12 * per_miss, rel=1e-12)


@pytest.mark.parametrize(("timing", "landing"), [(False, "next_step"), (True, "link")])
def test_caching_off_keeps_prefetches_until_used(seq_trace, timing, landing):
    """Dependency prefetching with caching off and a buffer of five experts: each layer-0
    gate prefetches layer 1's four experts; layer 1 always routes to expert 3, which is
    found (a hit with instant landing, late on the timed link, where a 6 MB transfer
    outlasts the tiny model's compute) and then released, so it is fetched again every
    iteration, while the three never-used ones stay.  Layer 0 always misses (nothing
    prefetches it).  Traffic: 6 layer-0 misses + 6 fetches of layer 1's expert 3 + 3 others
    once = 15 experts.  Red if a prefetch is released before its use, or a used one kept."""
    from policies.dependency import DependencyPrefetch

    S = TINY.expert_size_bytes
    s = simulate(
        seq_trace, TINY, TINY_HW, DependencyPrefetch(), 5 * S, timing=timing, landing=landing,
        release_after_use=True,
    ).summary  # fmt: skip
    found = (6, 0) if not timing else (0, 6)
    assert (s["hits"], s["late"]) == found and s["misses"] == 6
    assert s["pcie_bytes"] == 15 * S and s["evictions"] == 12


def test_caching_off_is_a_config_key():
    """``cache.release_after_use`` reaches the run (red if the key is dropped between the
    config and :func:`simulate`)."""
    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run, simulate_spec

    spec = build_run(compose_config(["cache.release_after_use=true", "serving.max_requests=1"]))
    assert spec.release_after_use
    trace = read_trace(Path(__file__).resolve().parents[1] / "traces" / "default")
    s = simulate_spec(spec, trace).summary
    assert s["hits"] == 0 and s["evictions"] > 0


def test_a_residual_mlp_runs_before_the_router_and_hides_no_load(seq_trace):
    """Arctic's residual dense MLP (``residual_intermediate_size``) computes before the
    router, so a demand load issued at the gate cannot overlap it: with one expert of
    budget every access misses and stalls its whole transfer, as without the MLP, and the
    run is longer by the MLP's time in every layer step (12).  The same MLP as a shared
    expert computes after the gate and hides part of each load.  Red if the residual MLP
    is timed after the gate, or not at all."""
    import dataclasses

    from fmoesim.engine.compute import ComputeModel

    S = TINY.expert_size_bytes
    res = dataclasses.replace(TINY, residual_intermediate_size=1000)
    c = ComputeModel.from_specs(res, TINY_HW)
    base = ComputeModel.from_specs(TINY, TINY_HW)
    mlp = c.expert_a_s + c.expert_b_s  # the same shape as an expert (3 x 1000 x 1000)
    assert c.router_s(1) == pytest.approx(base.router_s(1) + mlp, rel=1e-12)
    plain = simulate(seq_trace, TINY, TINY_HW, LRU(), S).summary
    r = simulate(seq_trace, res, TINY_HW, LRU(), S).summary
    per_miss = TINY_HW.transfer_overhead_s + S / (TINY_HW.pcie_gbps * 1e9)
    assert r["stall_s"] == pytest.approx(12 * per_miss, rel=1e-12)
    assert r["simulated_s"] == pytest.approx(plain["simulated_s"] + 12 * mlp, rel=1e-9)
    shared = dataclasses.replace(TINY, num_shared_experts=1, shared_expert_intermediate_size=1000)
    assert simulate(seq_trace, shared, TINY_HW, LRU(), S).summary["stall_s"] < r["stall_s"]


@pytest.mark.parametrize("timing", [True, False])
@pytest.mark.parametrize("fast", [True, False])
def test_preload_is_gpu_rich(seq_trace, timing, fast):
    """``preload`` (a GPU-Rich deployment): with room for all eight experts, every one of
    the 12 accesses hits, nothing crosses the link and the GPU never waits.  Red if the
    LRU fast path or the demand closed form ignore the preloaded experts, or a preloaded
    expert is counted as a transfer."""
    S = TINY.expert_size_bytes
    s = simulate(seq_trace, TINY, TINY_HW, LRU(), 8 * S, timing=timing, fast=fast, preload=True)
    s = s.summary
    assert (s["hits"], s["late"], s["misses"]) == (12, 0, 0)
    assert s["pcie_bytes"] == 0 and s["evictions"] == 0
    if timing:
        assert s["stall_s"] == 0.0


def test_preload_spreads_experts_over_gpus_and_refuses_what_does_not_fit(seq_trace):
    """Two GPUs hold experts round-robin (``e % 2``): two experts of each layer apiece, so
    four experts of budget per GPU hold the model and three do not (one line naming the
    budget and what the GPU needs).  Red if every GPU were loaded with every expert, or a
    budget too small were silently overfilled."""
    from dataclasses import replace

    from fmoesim.errors import ConfigError
    from policies.moepic import MoEpic
    from policies.pregated import PreGated

    S = TINY.expert_size_bytes
    hw2 = replace(TINY_HW, num_gpus=2)
    r = simulate(seq_trace, TINY, hw2, LRU(), 4 * S, preload=True)
    assert r.summary["hits"] == 12 and r.summary["pcie_bytes"] == 0
    assert [sorted(c.entries) for c in r.caches] == [[0, 2, 4, 6], [1, 3, 5, 7]]
    with pytest.raises(ConfigError, match="cache.budget_gb.*needs 0.024 GB on GPU 0"):
        simulate(seq_trace, TINY, hw2, LRU(), 3 * S, preload=True)
    with pytest.raises(ConfigError, match="cache.preload"):
        simulate(seq_trace, TINY, TINY_HW, LRU(), 8 * S, preload=True, release_after_use=True)
    with pytest.raises(ConfigError, match="cache.preload.*splits them"):
        simulate(seq_trace, TINY, TINY_HW, MoEpic(warm_start=False, buffer_experts=1), 8 * S,
                 preload=True)  # fmt: skip
    # Pre-gated MoE keeps no cache: its first gates would evict the preloaded experts and
    # load them again over the link (red if it runs); with its leftovers cached it keeps them
    with pytest.raises(ConfigError, match="cache.preload.*pregated evicts"):
        simulate(seq_trace, TINY, TINY_HW, PreGated(), 8 * S, preload=True)
    r = simulate(seq_trace, TINY, TINY_HW, PreGated(cache_leftovers=True), 8 * S, preload=True)
    assert r.summary["pcie_bytes"] == 0 and r.summary["hits"] == r.summary["accesses"]


def test_preload_is_a_config_key():
    """``cache.preload`` reaches the run (red if the key is dropped between the config and
    :func:`simulate`)."""
    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run, simulate_spec

    spec = build_run(
        compose_config(["cache.preload=true", "cache.budget_gb=100", "serving.max_requests=1"])
    )
    assert spec.preload
    trace = read_trace(Path(__file__).resolve().parents[1] / "traces" / "default")
    s = simulate_spec(spec, trace).summary
    assert s["misses"] == 0 and s["late"] == 0 and s["pcie_bytes"] == 0
