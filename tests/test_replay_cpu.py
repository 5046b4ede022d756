"""The replay's untimed CPU path: real weights, copies and FFNs, the policy's
own decisions, and the hit rates of the hit-rate-only simulator exactly; memory checks;
weights from a local safetensors checkpoint."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replay backend needs torch")

from fmoesim.config.build import load_preset  # noqa: E402
from fmoesim.engine.serving import ServingConfig  # noqa: E402
from fmoesim.engine.simulate import simulate  # noqa: E402
from fmoesim.errors import FmoesimError  # noqa: E402
from fmoesim.specs.model import ModelSpec  # noqa: E402
from policies.fmoe import FMoE  # noqa: E402
from policies.lcp import LCP  # noqa: E402
from policies.lfu import LFU  # noqa: E402
from policies.lru import LRU  # noqa: E402
from policies.moe_infinity import MoEInfinity  # noqa: E402
from policies.moepic import MoEpic  # noqa: E402
from replay.backend import GpuBackend, InstantReplayBackend, replay_backend  # noqa: E402
from replay.weights import HostExperts, check_host_memory  # noqa: E402
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
    # the untimed CPU path lands every copy at the next layer step
    kw = dict(timing=False, landing="next_step", serving=serving)
    sim = simulate(trace, MODEL, TINY_HW, make(), budget, **kw)
    rep = simulate(
        trace,
        MODEL,
        TINY_HW,
        make(),
        budget,
        **kw,
        make_backend=replay_backend(MODEL, TINY_HW, "cpu", timed=False),
    )
    np.testing.assert_array_equal(rep.metrics.acc, sim.metrics.acc)
    assert rep.summary["pcie_bytes"] == sim.summary["pcie_bytes"]
    assert rep.summary["gpu_busy_s"] > 0  # the FFNs really ran


def test_segments_are_real_slices_of_the_weights(trace):
    captured = {}

    class Spy(InstantReplayBackend):
        def _land(self, rec):  # type: ignore[no-untyped-def]
            super()._land(rec)
            captured[rec.key] = self._dev[rec.key]

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
    n, f, h = MODEL.num_layers * MODEL.num_experts, MODEL.expert_intermediate_size, 512
    tops = [k for k in captured if n <= k < 2 * n]
    bottoms = [k for k in captured if k >= 2 * n]
    assert tops and bottoms
    for k in tops:
        host = backend[0].host.tensor(k)
        assert captured[k].shape == (f // 4, 3, h)
        torch.testing.assert_close(captured[k], host[: f // 4])
    for k in bottoms:
        host = backend[0].host.tensor(k)
        assert captured[k].shape == (f - f // 4, 3, h)
        torch.testing.assert_close(captured[k], host[f // 4 :])
    # the three matrices of one row really are that row of w1, w3 and column of w2
    w = backend[0].host.tensor(0)
    x = torch.randn(3, h)
    F = torch.nn.functional
    ref = (F.silu(x @ w[:, 0].T) * (x @ w[:, 1].T)) @ w[:, 2]
    got = backend[0].exe.F.linear(F.silu(F.linear(x, w[:, 0])) * F.linear(x, w[:, 1]), w[:, 2].T)
    torch.testing.assert_close(got, ref)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_is_refused():
    with pytest.raises(FmoesimError, match="CUDA is not available"):
        GpuBackend(MODEL, TINY_HW, [object()], device="cuda")  # type: ignore[list-item]
    with pytest.raises(FmoesimError, match="CPU path only"):
        replay_backend(MODEL, TINY_HW, "cuda", timed=False)


def test_one_gpu_only():
    with pytest.raises(FmoesimError, match="num_gpus=2"):
        InstantReplayBackend(MODEL, [object(), object()])  # type: ignore[list-item]


def test_host_memory_check_names_the_numbers():
    with pytest.raises(FmoesimError, match=r"4 layers x 8 experts x 6\.3 MB = 0\.2 GB.* 0\.1 GB"):
        check_host_memory(MODEL, 4, have_bytes=100_000_000)
    assert check_host_memory(MODEL, 4, have_bytes=10**12) == 32 * 3 * 512 * 1024 * 4


def test_default_shapes_fit_a_128_gb_host():
    """A Qwen1.5-MoE-shaped model fits whole in 128 GB of pinned host memory."""
    qwen = load_preset("model", "qwen1.5-moe-a2.7b", ModelSpec)
    need = check_host_memory(qwen, 2, have_bytes=128 * 10**9)
    assert need == qwen.num_layers * qwen.num_experts * qwen.expert_size_bytes
    assert need < 30e9  # 24 x 60 experts of 17.3 MB


def _tiny_moe(tmp_path, family):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers", reason="needs the collect extra")
    common = dict(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        vocab_size=50, head_dim=8, num_experts_per_tok=2,
    )  # fmt: skip
    if family == "mixtral":
        cfg = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, **common)
        m = transformers.MixtralForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2MoeConfig(
            moe_intermediate_size=24, shared_expert_intermediate_size=32, num_experts=4,
            intermediate_size=32, **common,
        )  # fmt: skip
        m = transformers.Qwen2MoeForCausalLM(cfg)
    m.save_pretrained(tmp_path)
    spec = ModelSpec(
        name=family, num_layers=2, num_experts=4, top_k=2, hidden_size=16,
        expert_intermediate_size=24, num_attention_heads=2, num_kv_heads=1, head_dim=8,
        vocab_size=50, dtype="float32",
    )  # fmt: skip
    return spec


@pytest.mark.parametrize(
    "family,names",
    [
        ("mixtral", ("block_sparse_moe.experts.{e}.w1", "block_sparse_moe.experts.{e}.w3",
                     "block_sparse_moe.experts.{e}.w2")),
        ("qwen2_moe", ("mlp.experts.{e}.gate_proj", "mlp.experts.{e}.up_proj",
                       "mlp.experts.{e}.down_proj")),
    ],
)  # fmt: skip
def test_weights_from_a_saved_checkpoint(tmp_path, family, names):
    from safetensors import safe_open

    spec = _tiny_moe(tmp_path, family)
    host = HostExperts(spec, "cpu", checkpoint=tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for layer, e in [(0, 0), (1, 3)]:
            pre = f"model.layers.{layer}."
            w1, w3, w2 = (f.get_tensor(pre + n.format(e=e) + ".weight") for n in names)
            w = host.tensor(layer * 4 + e)
            torch.testing.assert_close(w[:, 0], w1)
            torch.testing.assert_close(w[:, 1], w3)
            torch.testing.assert_close(w[:, 2], w2.T)


def test_weights_from_fused_tensors_and_bad_checkpoints(tmp_path):
    from safetensors.torch import save_file

    spec = ModelSpec(
        name="fused", num_layers=1, num_experts=2, top_k=1, hidden_size=4,
        expert_intermediate_size=3, num_attention_heads=1, num_kv_heads=1, head_dim=4,
        vocab_size=8, dtype="float32",
    )  # fmt: skip
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    down = -torch.arange(2 * 4 * 3, dtype=torch.float32).reshape(2, 4, 3)
    save_file(
        {"model.layers.0.mlp.experts.gate_up_proj": gate_up,
         "model.layers.0.mlp.experts.down_proj": down},
        str(tmp_path / "model.safetensors"),
    )  # fmt: skip
    w = HostExperts(spec, "cpu", checkpoint=tmp_path).tensor(1)
    torch.testing.assert_close(w[:, 0], gate_up[1, :3])
    torch.testing.assert_close(w[:, 1], gate_up[1, 3:])
    torch.testing.assert_close(w[:, 2], down[1].T)
    wrong = ModelSpec(**{**spec.__dict__, "expert_intermediate_size": 2})
    msg = r"expert 0 mlp.experts.gate_up_proj has shape \(6, 4\), model fused says \(4, 4\)"
    with pytest.raises(FmoesimError, match=msg):
        HostExperts(wrong, "cpu", checkpoint=tmp_path)
    two = ModelSpec(**{**spec.__dict__, "num_layers": 2})
    with pytest.raises(FmoesimError, match="no expert 0 of layer 1 under any known name"):
        HostExperts(two, "cpu", checkpoint=tmp_path)
    (tmp_path / "bad").mkdir()
    with pytest.raises(FmoesimError, match=r"bad: no \*\.safetensors file"):
        HostExperts(spec, "cpu", checkpoint=tmp_path / "bad")
