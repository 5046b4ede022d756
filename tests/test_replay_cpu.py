"""The replay backend's CPU path (issue 8): real weights, copies and FFNs, the policy's
own decisions, and the hit rates of the hit-rate-only simulator exactly."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replay backend needs torch")

from fmoesim.engine.serving import ServingConfig  # noqa: E402
from fmoesim.engine.simulate import simulate  # noqa: E402
from fmoesim.errors import FmoesimError  # noqa: E402
from policies.fmoe import FMoE  # noqa: E402
from policies.lcp import LCP  # noqa: E402
from policies.lfu import LFU  # noqa: E402
from policies.lru import LRU  # noqa: E402
from policies.moe_infinity import MoEInfinity  # noqa: E402
from policies.moepic import MoEpic  # noqa: E402
from replay.backend import GpuBackend  # noqa: E402
from tests._baseline_helpers import write_one_token_trace  # noqa: E402
from tests.test_policy_contract import MODEL  # noqa: E402
from tests.tiny import TINY_HW  # noqa: E402


@pytest.fixture(scope="module")
def trace(tmp_path_factory):  # type: ignore[no-untyped-def]
    return write_one_token_trace(tmp_path_factory.mktemp("r") / "t", MODEL, 4, 10, 8, seed=2)


POLICIES = {
    "lru": LRU,
    "lfu": LFU,
    "lcp": LCP,
    "moe-infinity": MoEInfinity,
    "fmoe": lambda: FMoE(prefetch_distance=1),
    "moepic": lambda: MoEpic(configurator=False, warm_start=False),
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_cpu_replay_hit_rates_equal_the_simulators(trace, name):
    make = POLICIES[name]
    budget = 12 * MODEL.expert_size_bytes
    serving = ServingConfig(held_in_fraction=0.5) if name in ("fmoe", "moe-infinity") else None
    sim = simulate(trace, MODEL, TINY_HW, make(), budget, timing=False, serving=serving)
    rep = simulate(
        trace,
        MODEL,
        TINY_HW,
        make(),
        budget,
        timing=False,
        serving=serving,
        make_backend=lambda caches: GpuBackend(MODEL, caches),
    )
    np.testing.assert_array_equal(rep.metrics.acc, sim.metrics.acc)
    assert rep.summary["pcie_bytes"] == sim.summary["pcie_bytes"]
    assert rep.summary["gpu_busy_s"] > 0  # the FFNs really ran


def test_segments_are_real_slices_of_the_weights(trace):
    captured = {}

    class Spy(GpuBackend):
        def _land(self, rec):  # type: ignore[no-untyped-def]
            super()._land(rec)
            captured[rec.key] = self._dev[rec.gpu][rec.key]

    pol = MoEpic(split_ratio=0.25, prefetch="none", configurator=False, warm_start=False)
    budget = 12 * MODEL.expert_size_bytes
    backend: list[Spy] = []
    simulate(
        trace,
        MODEL,
        TINY_HW,
        pol,
        budget,
        timing=False,
        make_backend=lambda caches: backend.append(Spy(MODEL, caches)) or backend[0],
    )
    n, f = MODEL.num_layers * MODEL.num_experts, MODEL.expert_intermediate_size
    tops = [k for k in captured if n <= k < 2 * n]
    assert tops
    k = tops[0]
    host = backend[0]._host[k - n]
    assert captured[k].shape == (3, f // 4, MODEL.hidden_size)
    torch.testing.assert_close(captured[k], host[:, : f // 4])
    bottoms = [b for b in captured if b == n + k]  # its bottom, if one was loaded
    for b in bottoms:
        torch.testing.assert_close(captured[b], host[:, f // 4 :])


def test_only_the_cpu_path_exists_yet(trace):
    with pytest.raises(FmoesimError, match="only the CPU path"):
        GpuBackend(MODEL, [], device="cuda")
