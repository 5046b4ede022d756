"""The timed replay backend on the CPU: the copy stream is a worker thread,
compute is synchronous, the scheduling and measuring code is the GPU path's.  Demand-only
policies make timing-independent decisions, so their hits and misses equal the
simulator's exactly; the measured metrics are consistent with each other."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replay backend needs torch")

from fmoesim.engine.serving import ServingConfig  # noqa: E402
from fmoesim.engine.simulate import simulate  # noqa: E402
from policies.lcp import LCP  # noqa: E402
from policies.lfu import LFU  # noqa: E402
from policies.lru import LRU  # noqa: E402
from policies.moe_infinity import MoEInfinity  # noqa: E402
from policies.moepic import MoEpic  # noqa: E402
from replay.backend import GpuBackend, replay_backend  # noqa: E402
from tests._baseline_helpers import write_one_token_trace  # noqa: E402
from tests.test_policy_contract import MODEL  # noqa: E402
from tests.tiny import TINY_HW  # noqa: E402

HW = replace(TINY_HW, chunk_bytes=1 << 20)  # several chunks per expert (6.3 MB in fp32)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):  # type: ignore[no-untyped-def]
    return write_one_token_trace(tmp_path_factory.mktemp("rt") / "t", MODEL, 4, 6, 8, seed=3)


@pytest.mark.parametrize("make", [LRU, LFU, LCP], ids=["lru", "lfu", "lcp"])
def test_demand_only_decisions_equal_the_simulators(trace, make):
    budget = 12 * MODEL.expert_size_bytes
    sim = simulate(trace, MODEL, HW, make(), budget, timing=True)
    rep = simulate(trace, MODEL, HW, make(), budget, make_backend=replay_backend(MODEL, HW, "cpu"))
    np.testing.assert_array_equal(rep.metrics.acc, sim.metrics.acc)
    s = rep.summary
    assert s["pcie_bytes"] == sim.summary["pcie_bytes"]
    assert s["misses"] > 0 and s["late"] == 0
    # measured, and consistent: every transfer moved, in issue order (one FIFO stream)
    ends = [t.end_s for t in rep.transfers]
    assert all(t.start_s <= t.end_s for t in rep.transfers)
    assert ends == sorted(ends)
    assert 0 < s["stall_s"] < s["simulated_s"]
    assert 0 < s["link_busy_s"] < s["simulated_s"]
    assert 0 < s["gpu_busy_s"] < s["simulated_s"]
    assert s["tpot_mean_s"] > 0 and s["ttft_mean_s"] > 0


def test_prefetchers_and_segments_run_on_the_timed_path(trace):
    budget = 12 * MODEL.expert_size_bytes
    makers = (MoEInfinity, lambda: MoEpic(configurator=False, warm_start=False))
    for make in makers:
        serving = ServingConfig(held_in_fraction=0.5)
        rep = simulate(
            trace,
            MODEL,
            HW,
            make(),
            budget,
            serving=serving,
            make_backend=replay_backend(MODEL, HW, "cpu"),
        )
        sim = simulate(trace, MODEL, HW, make(), budget, serving=serving)
        s = rep.summary
        assert s["accesses"] == sim.summary["accesses"]
        assert s["hits"] + s["late"] + s["misses"] == s["accesses"]
        assert s["prefetch_bytes"] > 0
        assert all(t.cancelled or t.end_s >= t.start_s for t in rep.transfers)
        # MoEpic's aborted guesses count the chunks they issued: at least one, not all
        assert s["pcie_bytes"] == sum(t.moved_bytes for t in rep.transfers)
        assert all(0 < t.moved_bytes < t.size_bytes for t in rep.transfers if t.aborted)
        assert s["aborted_bytes"] == sum(t.moved_bytes for t in rep.transfers if t.aborted)


def test_segment_copies_hold_their_rows(trace):
    seen = {}

    class Spy(GpuBackend):
        def _landed(self, rec):  # type: ignore[no-untyped-def]
            lo, hi = self._range[rec.key]
            super()._landed(rec)
            seen[rec.key] = (lo, hi, self._dev[rec.key].clone())

    pol = MoEpic(split_ratio=0.25, prefetch="none", configurator=False, warm_start=False)
    holder: list[Spy] = []
    simulate(
        trace,
        MODEL,
        HW,
        pol,
        12 * MODEL.expert_size_bytes,
        make_backend=lambda c: holder.append(Spy(MODEL, HW, c, "cpu")) or holder[0],
    )
    n, f = 32, MODEL.expert_intermediate_size
    assert any(n <= k < 2 * n for k in seen) and any(k >= 2 * n for k in seen)
    for k, (lo, hi, w) in seen.items():
        assert (lo, hi) == ((0, f // 4) if k < 2 * n else (f // 4, f))
        torch.testing.assert_close(w, holder[0].host.tensor(k)[lo:hi])  # chunked copy intact


@pytest.mark.parametrize(
    ("change", "rows"),
    [
        (
            dict(expert_size_bytes_by_layer=[3145728, 1572864, 786432, 2359296]),
            [1024, 512, 256, 768],
        ),
        (dict(dtype="q4_k"), [288] * 4),
    ],
    ids=["per-layer-sizes", "q4_k"],
)
def test_layer_sizes_and_quantized_experts_replay_their_own_bytes(trace, change, rows):
    """Hand-computed rows: a row of this model is 3 x 512 bf16 = 3,072 bytes, so experts
    of 3.1 / 1.6 / 0.8 / 2.4 MB by layer are 1,024 / 512 / 256 / 768 rows, and a Q4_K
    expert (1,572,864 weights x 144 / 256 bytes = 884,736) is 288 rows computed in bf16.
    Every landed device copy has its layer's rows; LRU's hits and misses and the link's
    bytes equal the simulator's.  Red if the replay copies full experts (the rows), the
    cache counts one size for every layer (the hits), or quantized models are refused."""
    from replay.weights import expert_rows, torch_dtype

    model = replace(MODEL, **change)
    assert expert_rows(model) == rows
    assert torch_dtype(torch, model, "cuda:0") == torch.bfloat16
    landed: dict[int, int] = {}

    class Spy(GpuBackend):
        def _landed(self, rec):  # type: ignore[no-untyped-def]
            super()._landed(rec)
            landed[rec.key] = self._dev[rec.key].shape[0]

    budget = 12 * max(model.layer_expert_bytes)
    sim = simulate(trace, model, HW, LRU(), budget, timing=True)
    holder: list[Spy] = []
    rep = simulate(
        trace,
        model,
        HW,
        LRU(),
        budget,
        make_backend=lambda c: holder.append(Spy(model, HW, c, "cpu")) or holder[0],
    )
    np.testing.assert_array_equal(rep.metrics.acc, sim.metrics.acc)
    assert rep.summary["pcie_bytes"] == sim.summary["pcie_bytes"]
    E = model.num_experts
    assert landed and all(n == rows[k // E] for k, n in landed.items())
