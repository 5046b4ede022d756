"""``fmoesim-model from-config``: a model preset from a Hugging Face config.json, one
family at a time, on configs written here (the numbers of the real models' files)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from fmoesim.errors import FmoesimError
from fmoesim.specs import ModelSpec
from fmoesim.specs.from_config import model_from_config, preset_yaml

ROOT = Path(__file__).resolve().parents[1]
BASE = {"hidden_size": 1024, "num_attention_heads": 16, "num_key_value_heads": 4,
        "vocab_size": 1000, "num_hidden_layers": 6}  # fmt: skip

# model_type -> (its MoE keys, the fields expected: layers, experts, top-k, expert
# intermediate size, shared experts, shared size, dense layers)
CASES = {
    "mixtral": ({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 3584},
                (6, 8, 2, 3584, 0, 0, 0)),
    "phimoe": ({"num_local_experts": 16, "num_experts_per_tok": 2, "intermediate_size": 640},
               (6, 16, 2, 640, 0, 0, 0)),
    "granitemoe": ({"num_local_experts": 32, "num_experts_per_tok": 8, "intermediate_size": 512},
                   (6, 32, 8, 512, 0, 0, 0)),
    "gpt_oss": ({"num_local_experts": 32, "experts_per_token": 4, "intermediate_size": 2880},
                (6, 32, 4, 2880, 0, 0, 0)),
    "qwen2_moe": ({"num_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                   "shared_expert_intermediate_size": 5632, "decoder_sparse_step": 1,
                   "mlp_only_layers": []}, (6, 60, 4, 1408, 1, 5632, 0)),
    "qwen3_moe": ({"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                   "decoder_sparse_step": 1, "mlp_only_layers": []}, (6, 128, 8, 768, 0, 0, 0)),
    "olmoe": ({"num_experts": 64, "num_experts_per_tok": 8, "intermediate_size": 1024},
              (6, 64, 8, 1024, 0, 0, 0)),
    "deepseek_v2": ({"n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
                     "moe_intermediate_size": 1408, "first_k_dense_replace": 1,
                     "intermediate_size": 10944, "v_head_dim": 128, "q_lora_rank": None,
                     "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64},
                    (5, 64, 6, 1408, 2, 2816, 1)),
    "deepseek_v3": ({"n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
                     "moe_intermediate_size": 2048, "first_k_dense_replace": 3,
                     "intermediate_size": 18432, "v_head_dim": 128, "q_lora_rank": 1536,
                     "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64},
                    (3, 256, 8, 2048, 1, 2048, 3)),
}  # fmt: skip


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family(family: str, tmp_path: Path) -> None:
    """Red if a family's experts, top-k, sizes, shared experts or leading dense layers
    come from the wrong key, or the written preset does not load back to the same shape."""
    keys, want = CASES[family]
    cfg = {**BASE, **keys, "model_type": family}
    spec, used = model_from_config(cfg, "m")
    got = (
        spec.num_layers, spec.num_experts, spec.top_k, spec.expert_intermediate_size,
        spec.num_shared_experts, spec.shared_expert_intermediate_size, spec.dense_layers,
    )  # fmt: skip
    assert got == want
    assert spec.num_kv_heads == 4 and spec.head_dim == (128 if "v_head_dim" in keys else 64)
    mla = (spec.q_lora_rank, spec.kv_lora_rank, spec.qk_nope_head_dim, spec.qk_rope_head_dim)
    assert mla == ((keys.get("q_lora_rank") or 0, 512, 128, 64) if "kv_lora_rank" in keys
                   else (0, 0, 0, 0))  # fmt: skip
    text = preset_yaml(spec, used)
    raw = OmegaConf.load(_write(tmp_path / "m.yaml", text))
    del raw["defaults"]
    back = ModelSpec(**OmegaConf.to_container(raw))  # type: ignore[arg-type]
    assert back == spec
    assert f"# {used['num_experts']}" in text


def test_modules_left_unconverted_keep_the_config_width(tmp_path: Path) -> None:
    """GPT-OSS's config.json quantizes the experts to MXFP4 and lists attention, the
    routers, the embedding and the LM head in ``modules_to_not_convert``: they stay at
    ``torch_dtype``.  Red if the preset reads them at the experts' width (its resident
    weights a quarter of the real ones), if the widths do not reach the written preset,
    or if a config without the list gets widths of its own."""
    keep = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens",
            "lm_head"]  # fmt: skip
    quant = {"modules_to_not_convert": keep, "quant_method": "mxfp4"}
    cfg = {**BASE, **CASES["gpt_oss"][0], "model_type": "gpt_oss", "torch_dtype": "bfloat16",
           "quantization_config": quant}  # fmt: skip
    spec, used = model_from_config(cfg, "oss", "mxfp4")
    widths = (spec.dtype, spec.attention_dtype, spec.embedding_dtype)
    assert widths == ("mxfp4", "bfloat16", "bfloat16")
    assert spec.resident_weight_bytes == 2 * spec.resident_params
    raw = OmegaConf.load(_write(tmp_path / "oss.yaml", preset_yaml(spec, used)))
    del raw["defaults"]
    assert ModelSpec(**OmegaConf.to_container(raw)) == spec  # type: ignore[arg-type]
    del cfg["quantization_config"]
    bare, _ = model_from_config(cfg, "oss", "mxfp4")
    assert (bare.attention_dtype, bare.embedding_dtype) == ("", "")


def test_llama4_reads_its_text_config() -> None:
    """Red if Llama 4's nested text_config is not read, or its shared expert is lost."""
    text = {**BASE, "num_local_experts": 16, "num_experts_per_tok": 1,
            "intermediate_size": 8192, "head_dim": 128, "interleave_moe_layer_step": 1}  # fmt: skip
    spec, _ = model_from_config({"model_type": "llama4", "text_config": text}, "scout")
    assert (spec.num_experts, spec.top_k, spec.num_shared_experts) == (16, 1, 1)
    assert spec.shared_expert_intermediate_size == 8192 and spec.head_dim == 128
    with pytest.raises(FmoesimError, match="interleave_moe_layer_step = 2"):
        bad = {**text, "interleave_moe_layer_step": 2}
        model_from_config({"model_type": "llama4", "text_config": bad}, "m")


def test_a_config_saved_by_the_installed_transformers_converts() -> None:
    """transformers saves a Qwen3-MoE config's expert count as ``num_local_experts``
    (its attribute map's name for ``num_experts``).  Red if such a config.json is refused
    as lacking ``num_experts``, so a tiny Qwen3 model built the way the tests build a tiny
    Mixtral could get no preset."""
    saved = {**BASE, **CASES["qwen3_moe"][0], "model_type": "qwen3_moe"}
    saved["num_local_experts"] = saved.pop("num_experts")
    spec, used = model_from_config(saved, "tiny-qwen3")
    assert (spec.num_experts, used["num_experts"]) == (saved["num_local_experts"],
                                                       "num_local_experts")  # fmt: skip
    transformers = pytest.importorskip("transformers")  # as the installed version saves it
    cfg = transformers.Qwen3MoeConfig(num_experts=16, num_experts_per_tok=4).to_dict()
    spec, used = model_from_config(cfg, "tiny-qwen3")
    assert (spec.num_experts, spec.top_k) == (16, 4)


def test_bad_configs_name_the_file_and_key(tmp_path: Path) -> None:
    """Red if an unknown family, a missing key, interleaved dense layers or a broken file
    pass, or fail without one line naming the file and the key, or leave a file."""
    with pytest.raises(FmoesimError, match="config.json: model_type = 'llama'"):
        model_from_config({**BASE, "model_type": "llama"}, "m")
    with pytest.raises(FmoesimError, match="lacks key 'num_local_experts'"):
        model_from_config({**BASE, "model_type": "mixtral", "num_experts_per_tok": 2,
                           "intermediate_size": 8}, "m")  # fmt: skip
    with pytest.raises(FmoesimError, match="decoder_sparse_step = 2"):
        model_from_config({**BASE, **CASES["qwen2_moe"][0], "model_type": "qwen2_moe",
                           "decoder_sparse_step": 2}, "m")  # fmt: skip
    bad = _write(tmp_path / "config.json", "{not json")
    out = tmp_path / "m.yaml"
    p = _command(bad, out)
    assert p.returncode == 2 and "config.json: not JSON (" in p.stderr and not out.exists()


def test_a_shape_the_model_refuses_names_the_config_key() -> None:
    """Red if the error names the preset's field (model.top_k) instead of the key of
    config.json the user can fix (num_experts_per_tok)."""
    cfg = {**BASE, **CASES["mixtral"][0], "model_type": "mixtral", "num_experts_per_tok": 9}
    with pytest.raises(FmoesimError) as info:
        model_from_config(cfg, "m")
    assert str(info.value) == "config.json: num_experts_per_tok = 9 (rule: must be <= " \
        "num_experts (8))"  # fmt: skip


def test_no_attention_heads_is_one_line() -> None:
    """Red if 0 heads reaches the head_dim default, hidden_size / heads: a
    ZeroDivisionError traceback."""
    cfg = {**BASE, **CASES["mixtral"][0], "model_type": "mixtral", "num_attention_heads": 0}
    with pytest.raises(FmoesimError) as info:
        model_from_config(cfg, "m")
    assert str(info.value) == "config.json: num_attention_heads = 0 (rule: >= 1)"


@pytest.mark.parametrize(
    ("key", "value"),
    [("hidden_size", "big"), ("hidden_size", float("nan")), ("num_experts_per_tok", True),
     ("num_local_experts", 1e12), ("q_lora_rank", "x"), ("n_shared_experts", 1.5)],
)  # fmt: skip
def test_a_value_of_the_wrong_type_is_one_line(key: str, value: object) -> None:
    """Red if int() raises a ValueError traceback on a string or NaN, or ``true`` or
    ``1e12`` become a top-k of True or a float count in the written preset."""
    family = "deepseek_v3" if key in ("q_lora_rank", "n_shared_experts") else "mixtral"
    cfg = {**BASE, **CASES[family][0], "model_type": family, key: value}
    with pytest.raises(FmoesimError) as info:
        model_from_config(cfg, "m")
    assert str(info.value) == f"config.json: {key} = {value!r} (rule: an integer)"


def test_names_are_plain_and_quoted_where_yaml_needs_it(tmp_path: Path) -> None:
    """Red if a name with '/' or '..' is accepted (it names run folders), or a name that
    YAML reads as a mapping, a list or a boolean is written unquoted."""
    cfg = {**BASE, **CASES["mixtral"][0], "model_type": "mixtral"}
    for bad in ("a/b", "../evil", ""):
        with pytest.raises(FmoesimError, match="model.name"):
            model_from_config(cfg, bad)
    for name in ("x y: z", "[1]", "true"):
        spec, used = model_from_config(cfg, name)
        raw = OmegaConf.load(_write(tmp_path / "m.yaml", preset_yaml(spec, used)))
        assert raw["name"] == name


def test_command_writes_a_preset_and_keeps_an_existing_one(tmp_path: Path) -> None:
    """Red if the command does not write the preset where asked, named after the
    config's folder, or replaces an existing file without --force."""
    cfg = {**BASE, **CASES["qwen3_moe"][0], "model_type": "qwen3_moe"}
    src = _write(tmp_path / "Qwen3-Tiny" / "config.json", json.dumps(cfg))
    out = tmp_path / "conf" / "qwen3-tiny.yaml"
    p = _command(src, out)
    assert p.returncode == 0, p.stderr
    assert "name: qwen3-tiny" in out.read_text()
    p = _command(src, out)
    assert p.returncode == 2 and "exists" in p.stderr


def _command(src: Path, out: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "fmoesim.specs.from_config", "from-config", str(src)]
    return subprocess.run([*cmd, "--out", str(out)], capture_output=True, text=True, cwd=ROOT)


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path
