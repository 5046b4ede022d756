"""The paper-testbed hardware presets reproduce the numbers they were calibrated on.

Each expected value is arithmetic from the number the preset's YAML cites (paper and
section); the roofline presets stay as they were.
"""

from __future__ import annotations

import dataclasses

import pytest

from fmoesim.cli.main import compose_config
from fmoesim.config.build import build_run, load_preset, preset_names
from fmoesim.engine.compute import ComputeModel
from fmoesim.specs import HardwareSpec, ModelSpec

TESTBEDS = ("fmoe-testbed", "moe-infinity-testbed", "moepic-testbed")
MIXTRAL_EXPERT_BYTES = 3 * 4096 * 14336 * 2  # 352,321,536


def hw(name: str) -> HardwareSpec:
    return load_preset("hardware", name, HardwareSpec)


def model(name: str) -> ModelSpec:
    return load_preset("model", name, ModelSpec)


def decode_step_s(c: ComputeModel, m: ModelSpec) -> float:
    """One decoding token with every expert resident and an empty KV cache: every MoE
    layer's attention, router, shared experts and top-k experts, then the LM head."""
    layer = c.attention_s(1, 0, 0) + c.router_s(1) + c.shared_s(1) + m.top_k * c.expert_s(1)
    return m.num_layers * layer + c.lm_head_s(1)


@pytest.mark.parametrize("name", TESTBEDS)
def test_testbed_loads_validates_and_composes(name):
    """Red when a testbed's ``measured`` names a model without a preset or a coefficient
    ComputeModel does not have (both are silently ignored by ComputeModel.from_specs), or
    when the preset does not load, validate or compose with the CLI."""
    h = hw(name).validate()
    assert h.name == name
    fields = {f.name for f in dataclasses.fields(ComputeModel)}
    for model_name, coeffs in h.measured.items():
        assert model_name in preset_names("model"), model_name
        assert set(coeffs) <= fields, set(coeffs) - fields
    run = build_run(compose_config([f"hardware={name}"]))
    assert run.hardware == h


def test_fmoe_testbed_expert_times():
    """Red when an fMoE-testbed expert does not cost MoE-Infinity §7.2's 10 ms for a Mixtral
    expert (plus the roofline's per-token slope), scaled by expert bytes for Qwen1.5-MoE and
    Phi-3.5-MoE, or when the testbed is not six GPUs."""
    h = hw("fmoe-testbed")
    assert h.num_gpus == 6  # fMoE §6.1
    assert h.pcie_gbps == 32.0  # fMoE §6.1
    roof = hw("rtx3090-pcie4")
    for name in ("mixtral-8x7b", "qwen1.5-moe-a2.7b", "phi-3.5-moe"):
        m = model(name)
        c, r = ComputeModel.from_specs(m, h), ComputeModel.from_specs(m, roof)
        want_a = 0.010 * m.expert_size_bytes / MIXTRAL_EXPERT_BYTES
        assert c.expert_a_s == pytest.approx(want_a, rel=1e-4), name
        assert c.expert_s(1) == pytest.approx(want_a + r.expert_b_s, rel=1e-4), name
        assert c.attention_s(1, 0, 0) == r.attention_s(1, 0, 0)  # no paper number: roofline
    mixtral = ComputeModel.from_specs(model("mixtral-8x7b"), h)
    assert mixtral.expert_s(1) == pytest.approx(0.010, rel=1e-3)  # "10ms", MoE-Infinity §7.2


def test_moe_infinity_testbed_expert_time():
    """Red when a Mixtral expert on MoE-Infinity's testbed does not cost §7.2's 10 ms, or
    the uncalibrated operators differ from the a5000-pcie4 roofline."""
    h = hw("moe-infinity-testbed")
    m = model("mixtral-8x7b")
    c, r = ComputeModel.from_specs(m, h), ComputeModel.from_specs(m, hw("a5000-pcie4"))
    assert c.expert_s(1) == pytest.approx(0.010, rel=1e-3)  # §7.2 "10ms ... Mixtral"
    # the calibrated cost beyond the roofline's read of the weights is fixed per call: a
    # segment pays it whole (ComputeModel.segment_s)
    read_s = r.expert_a_s - r.expert_launch_s
    assert c == dataclasses.replace(r, expert_a_s=0.010, expert_launch_s=0.010 - read_s)
    assert h.num_gpus == 1  # §7.4 "a single GPU"
    # §7.2's 10 ms fetch agrees with the §7.1 link: 352,321,536 B / 32 GB/s = 11.0 ms
    assert h.transfer_time_s(m.expert_size_bytes) == pytest.approx(0.011, rel=0.01)


def test_moepic_testbed_qwen_compute_and_loading():
    """Red when Qwen1.5-MoE on MoEpic's testbed does not decode a token in 57 ms with every
    expert resident (MoEpic §1, §2.2, §4.3) or does not load its 24 x 4 activated experts in
    165 ms (§1, §2.2)."""
    h = hw("moepic-testbed")
    m = model("qwen1.5-moe-a2.7b")
    c = ComputeModel.from_specs(m, h)
    assert decode_step_s(c, m) == pytest.approx(0.057, rel=1e-4)
    loads = m.num_layers * m.top_k  # 96
    assert loads * h.transfer_time_s(m.expert_size_bytes) == pytest.approx(0.165, rel=1e-4)
    # a growing KV cache adds little: 512 cached tokens add under 1% to the step
    kv = m.num_layers * (c.attn_kv_s * 512 + c.attn_pair_s * 513)
    assert kv < 0.01 * 0.057


def test_moepic_2bit_mixtral():
    """Red when the 2-bit Mixtral preset's experts are not 2-bit HQQ with its scales and
    zeros (MoEpic §4.1; Mixtral-Offloading's group of 16: 3.015625 bits a weight) or its
    routing shape differs from mixtral-8x7b's (its traces must fit)."""
    q, m = model("mixtral-8x7b-2bit").validate(), model("mixtral-8x7b")
    assert q.expert_size_bytes == MIXTRAL_EXPERT_BYTES // 16 * 3.015625 == 66_404_352
    for key in ("num_layers", "num_experts", "top_k", "hidden_size"):
        assert getattr(q, key) == getattr(m, key)
    # no number of its own: it runs on the testbed's calibrated kernel cost
    c = ComputeModel.from_specs(q, hw("moepic-testbed"))
    assert c.expert_a_s == pytest.approx(3 * 9.3022e-5 + q.expert_size_bytes / (768e9 * 0.8))


def test_moepic_2bit_mixtral_weights_by_width():
    """MoEpic §4.1 quantizes attention to 4 bits and the experts to 2; Mixtral-Offloading,
    whose configuration the preset takes, keeps the embedding, the LM head and the routers
    at float16 (4-bit attention in groups of 64, scales quantized per 256).  By hand: the
    embedding, the LM head and 32 routers are 2 x 32,000 x 4,096 + 32 x 4,096 x 8 =
    263,192,576 weights at 2 bytes; attention is 32 x 41,943,040 weights at 4.251953125
    bits; so 526,385,152 + 713,359,360 = 1,239,744,512 resident bytes.  Red when one width
    sizes every weight (the experts' 2-bit one: 0.61 GB), or when the compute model reads
    attention, the LM head or the KV cache at the experts' width."""
    q = model("mixtral-8x7b-2bit").validate()
    assert q.resident_params_by_width == (263_192_576, 1_342_177_280, 0)
    assert q.resident_params == model("mixtral-8x7b").resident_params
    assert q.resident_weight_bytes == 526_385_152 + 713_359_360 == 1_239_744_512
    h = hw("moepic-testbed")
    mem = 768e9 * 0.8  # the testbed's achieved memory bandwidth, bytes/s
    c = ComputeModel.from_specs(q, h)
    assert c.attn_a_s == pytest.approx(6 * 9.3022e-5 + 41_943_040 * 4.251953125 / 8 / mem)
    assert c.lm_head_a_s == pytest.approx(9.3022e-5 + 32_000 * 4_096 * 2 / mem)
    assert c.router_a_s == pytest.approx(9.3022e-5 + 4_096 * 8 * 2 / mem)
    assert c.attn_kv_s == pytest.approx(2 * 8 * 128 * 2 / mem)  # float16 keys and values


def test_weight_widths_default_to_dtype_and_kv_to_16_bits():
    """Red when an empty ``attention_dtype`` / ``embedding_dtype`` does not fall back to
    ``dtype`` (a bf16 model's bytes would change), when a weight-only format (MXFP4) puts
    the KV cache at its width instead of 16 bits, when a float format (FP8) does not keep
    its own, when an explicit ``kv_cache_dtype`` is ignored, or when GPT-OSS's attention,
    routers, embedding and LM head (config.json's ``modules_to_not_convert``) are read at
    MXFP4."""
    m = model("mixtral-8x7b")
    assert m.resident_weight_bytes == 2 * m.resident_params
    assert (m.attention_dtype_bytes, m.embedding_dtype_bytes, m.kv_cache_dtype_bytes) == (2, 2, 2)
    assert model("deepseek-v3").kv_cache_dtype_bytes == 1
    oss = model("gpt-oss-20b").validate()
    assert oss.kv_cache_dtype_bytes == 2 and oss.attention_dtype_bytes == 2
    assert oss.resident_weight_bytes == 2 * oss.resident_params
    bare = dataclasses.replace(oss, attention_dtype="", embedding_dtype="")
    assert bare.kv_cache_dtype_bytes == 2 and bare.resident_weight_bytes == int(
        oss.resident_params * 4.25 / 8
    )
    assert dataclasses.replace(oss, kv_cache_dtype="float8").kv_cache_dtype_bytes == 1


@pytest.mark.parametrize("key", ["attention_dtype", "embedding_dtype", "kv_cache_dtype"])
def test_weight_width_names_the_bad_key(key):
    """Red when a misspelt width passes validation (the run would fail later, on a
    KeyError naming no key) or the message does not name the key."""
    from fmoesim.errors import ConfigError

    bad = dataclasses.replace(model("mixtral-8x7b"), **{key: "bf16"})
    with pytest.raises(ConfigError, match=f"model.{key}"):
        bad.validate()


# A Mixtral expert at one token and a one-token decode step (empty KV cache) on the roofline
# presets, e.g. rtx3090-pcie4's expert: 3 x 5 us + 352,321,536 B / (936e9 x 0.8)
# + 352,321,536 FLOP / (71e12 x 0.6) = 0.4938 ms.
ROOFLINE_PINS = {
    "rtx3090-pcie4": (0.0004937853303864211, 0.03673423837403636),
    "a5000-pcie4": (0.0005937253515751576, 0.043966802526492654),
    "a6000-pcie4": (0.0005922332981912145, 0.043858824044099916),
}


@pytest.mark.parametrize("name", sorted(ROOFLINE_PINS))
def test_roofline_presets_unchanged(name):
    """Red when a roofline preset's compute changes (its YAML gains ``measured`` or its
    roofline knobs move): they model a tuned engine and must stay as they were."""
    h = hw(name)
    assert h.measured == {}
    m = model("mixtral-8x7b")
    c = ComputeModel.from_specs(m, h)
    expert, step = ROOFLINE_PINS[name]
    assert c.expert_s(1) == pytest.approx(expert, rel=1e-12)
    assert decode_step_s(c, m) == pytest.approx(step, rel=1e-12)


#: total parameters from each model card (Hugging Face), in billions (DeepSeek-V3's
#: 671B leave out its multi-token-prediction module, as the preset does)
MODEL_CARD_PARAMS_B = {
    "qwen1.5-moe-a2.7b": 14.3,
    "mixtral-8x7b": 46.7,
    "qwen3-30b-a3b": 30.5,
    "olmoe-1b-7b": 6.9,
    "deepseek-v2-lite": 15.7,
    "deepseek-v3": 671,
}


@pytest.mark.parametrize("name", MODEL_CARD_PARAMS_B)
def test_resident_plus_expert_params_are_the_model_cards(name):
    """Red when the resident weights leave out a part (the LM head, the attention of the
    dense layers, the shared experts) or count one twice: resident plus routed-expert
    parameters must be the model card's total within 0.5% (its rounding)."""
    m = model(name)
    total_b = (m.resident_params + m.num_layers * m.num_experts * m.expert_params) / 1e9
    assert total_b == pytest.approx(MODEL_CARD_PARAMS_B[name], rel=5e-3)


def test_mla_attention_by_hand():
    """DeepSeek-V3's multi-head latent attention, by hand from its config.json: the query
    down- (7168 x 1536) and up-projection (1536 x 128 heads x (128 + 64)), the key-value
    down-projection with the RoPE key (7168 x (512 + 64)), the key-value up-projection
    (512 x 128 x (128 + 128)) and o (128 x 128 x 7168); the cache holds 512 + 64 per
    token.  MoEpic §1: DeepSeek's "expert parameters typically constitute the vast
    majority (97.45%) of the total model parameters", "only a small fraction (3.13%)"
    per token.  Red when MLA is counted as 128 key/value heads of 128 (95.0%)."""
    m = model("deepseek-v3")
    q = 7168 * 1536 + 1536 * 128 * 192
    kv = 7168 * 576 + 512 * 128 * 256
    assert m.attention_params == q + kv + 128 * 128 * 7168 == 187_105_280
    assert m.kv_cache_elems == 576 and m.pair_flops == 2 * 128 * (192 + 128)
    experts = m.num_layers * m.num_experts * m.expert_params
    assert round(100 * experts / (experts + m.resident_params), 2) == 97.45
    assert 100 * m.top_k / m.num_experts == 3.125  # 8 of 256: the paper rounds it up
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    mem_bytes_per_s = hw.hbm_gbps * 1e9 * hw.memory_efficiency
    c = ComputeModel.from_specs(m, hw)  # FP8: one byte per cached element
    assert c.attn_kv_s == pytest.approx(576 / mem_bytes_per_s, rel=1e-12)


def test_qwen15_footprint_is_moepics_gpu_rich_footprint():
    """MoEpic §4.3: "when the entire Qwen1.5-MoE model is fully placed in VRAM (i.e.,
    GPU-Rich setting), the TPOT is 57ms with a VRAM footprint of 26.67GB" (GiB, as
    14.3B 16-bit weights give).  Red when a run's footprint at a budget holding every
    expert is not the resident weights plus all experts."""
    from fmoesim.engine.simulate import vram_footprint_bytes

    m = model("qwen1.5-moe-a2.7b")
    gib = vram_footprint_bytes(m, m.total_expert_bytes) / 2**30
    assert gib == pytest.approx(26.67, abs=0.01)


def test_moe_infinity_presets_run_its_engine():
    """Every MoE-Infinity experiment preset takes a prefetch's slot when its copy starts
    (``engine.reserve=start``, as MoE-Infinity's engine schedules its copies); fMoE's and
    MoEpic's keep the default, ``submit``.  Red if a MoE-Infinity preset loses the key
    (its scoreboard rows are measured with it), or a preset of the other papers gets it
    (they run policies that wait for their prefetches, or split experts, which the
    option refuses)."""
    names = preset_names("experiment")
    mi = [n for n in names if n.startswith("moe-infinity-")]
    others = [n for n in names if n.startswith(("fmoe-", "moepic-"))]
    assert len(mi) >= 20 and len(others) >= 15
    for name in mi + others:
        want = "start" if name in mi else "submit"
        assert compose_config([f"experiment={name}"]).engine.reserve == want, name
