"""Model presets from a Hugging Face ``config.json``.

:func:`model_from_config` reads the MoE shape of a ``config.json`` by its ``model_type``
(:data:`FAMILIES`); :func:`preset_yaml` writes it as a ``conf/model/`` preset whose
every number names the config key it came from.  ``fmoesim-model from-config
config.json [--name N] [--dtype D] [--out PATH]`` does both.

What each family's keys mean here:

- ``mixtral``, ``phimoe``, ``granitemoe``, ``gpt_oss``: ``num_local_experts`` routed
  experts of ``intermediate_size``, ``num_experts_per_tok`` (GPT-OSS: also
  ``experts_per_token``) per token, every layer MoE.
- ``qwen2_moe``, ``qwen3_moe``, ``olmoe``: ``num_experts`` of ``moe_intermediate_size``
  (OLMoE: ``intermediate_size``); Qwen2-MoE's ``shared_expert_intermediate_size`` is one
  shared expert.  A ``decoder_sparse_step`` above 1 or ``mlp_only_layers`` (dense layers
  between MoE ones) is refused: fmoesim's dense layers lead the stack.
- ``deepseek_v2``, ``deepseek_v3``: ``n_routed_experts`` of ``moe_intermediate_size``,
  ``n_shared_experts`` shared ones of the same size, the first ``first_k_dense_replace``
  layers dense with ``intermediate_size``; MLA attention from ``q_lora_rank`` (null:
  a direct query projection), ``kv_lora_rank``, ``qk_nope_head_dim``,
  ``qk_rope_head_dim`` and ``v_head_dim``.
- ``llama4`` (its ``text_config``): ``num_local_experts`` of ``intermediate_size`` plus one
  shared expert of the same size; ``interleave_moe_layer_step`` above 1 is refused.

Widths: ``--dtype`` is the experts'.  A ``quantization_config`` whose
``modules_to_not_convert`` names attention (``self_attn``) or the embedding or LM head
(``embed_tokens``, ``lm_head``) leaves those at the config's ``torch_dtype`` (GPT-OSS:
MXFP4 experts, bfloat16 attention, routers, embedding and LM head), which the preset
writes as ``attention_dtype`` and ``embedding_dtype``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_file
from fmoesim.errors import ArgumentParser, ConfigError, FmoesimError, run_or_exit
from fmoesim.specs.model import DTYPE_BYTES, FLOAT_DTYPES, ModelSpec
from fmoesim.trace.schema import is_json_int

PROG = "fmoesim-model"
FAMILIES = (
    "mixtral", "phimoe", "granitemoe", "gpt_oss", "qwen2_moe", "qwen3_moe", "olmoe",
    "deepseek_v2", "deepseek_v3", "llama4",
)  # fmt: skip


class _Keys:
    """A config's keys, read with the name of each key used kept for the comments."""

    def __init__(self, path: str, raw: dict[str, Any]) -> None:
        self.path, self.raw = path, raw
        self.used: dict[str, str] = {}  # ModelSpec field -> the expression it came from

    def get(self, field: str, *keys: str, default: Any = None, note: str = "") -> Any:
        """The first of ``keys`` present (recorded as ``field``'s source); ``default``
        when none is and a default is given, else a one-line refusal."""
        for k in keys:
            if k in self.raw and self.raw[k] is not None:
                if not is_json_int(self.raw[k]):  # every field read here counts something
                    raise self.refuse(k, "an integer")
                self.used[field] = k + (f" {note}" if note else "")
                return self.raw[k]
        if default is not None:
            self.used[field] = f"default ({' / '.join(keys)} absent)"
            return default
        raise FmoesimError(
            f"{self.path}: lacks key '{keys[0]}' (rule: a {self.family} config has it)"
        )

    @property
    def family(self) -> str:
        return str(self.raw.get("model_type", "?"))

    def optional_int(self, key: str, default: int) -> int:
        """An integer key that may be absent or null (``default`` then)."""
        v = self.raw.get(key)
        if v is None:
            return default
        if not is_json_int(v):
            raise self.refuse(key, "an integer")
        return int(v)

    def refuse(self, key: str, rule: str) -> FmoesimError:
        return FmoesimError(f"{self.path}: {key} = {self.raw.get(key)!r} (rule: {rule})")


def model_from_config(
    cfg: dict[str, Any], name: str, dtype: str = "bfloat16", path: str = "config.json"
) -> tuple[ModelSpec, dict[str, str]]:
    """The :class:`ModelSpec` of a Hugging Face config (module docstring) and, per field,
    the config key it came from."""
    mt = cfg.get("model_type")
    if mt == "llama4" and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg["text_config"], "model_type": "llama4"}
    elif mt == "llama4_text":  # the text model's own config
        mt = "llama4"
    if mt not in FAMILIES:
        raise FmoesimError(f"{path}: model_type = {mt!r} (rule: one of {', '.join(FAMILIES)})")
    k = _Keys(path, cfg)
    L = int(k.get("num_layers", "num_hidden_layers"))
    out: dict[str, Any] = {"name": name, "dtype": dtype}
    dense = 0
    if mt in ("mixtral", "phimoe", "granitemoe", "gpt_oss", "llama4"):
        out["num_experts"] = k.get("num_experts", "num_local_experts")
        out["top_k"] = k.get("top_k", "num_experts_per_tok", "experts_per_token")
        out["expert_intermediate_size"] = k.get("expert_intermediate_size", "intermediate_size")
        if mt == "llama4":
            if k.optional_int("interleave_moe_layer_step", 1) != 1:
                raise k.refuse("interleave_moe_layer_step", "1: every layer MoE")
            out["num_shared_experts"] = 1
            out["shared_expert_intermediate_size"] = k.get(
                "shared_expert_intermediate_size", "intermediate_size", note="(one shared expert)"
            )
    elif mt in ("qwen2_moe", "qwen3_moe", "olmoe"):
        if k.optional_int("decoder_sparse_step", 1) != 1:
            raise k.refuse("decoder_sparse_step", "1: every layer MoE")
        if cfg.get("mlp_only_layers"):
            raise k.refuse("mlp_only_layers", "empty: every layer MoE")
        # transformers may save num_experts under its attribute_map's num_local_experts
        out["num_experts"] = k.get("num_experts", "num_experts", "num_local_experts")
        out["top_k"] = k.get("top_k", "num_experts_per_tok")
        inter_key = "intermediate_size" if mt == "olmoe" else "moe_intermediate_size"
        out["expert_intermediate_size"] = k.get("expert_intermediate_size", inter_key)
        shared = cfg.get("shared_expert_intermediate_size") if mt == "qwen2_moe" else None
        if shared:
            out["num_shared_experts"] = 1
            out["shared_expert_intermediate_size"] = k.get(
                "shared_expert_intermediate_size", "shared_expert_intermediate_size"
            )
    else:  # deepseek_v2, deepseek_v3
        if k.optional_int("moe_layer_freq", 1) != 1:
            raise k.refuse("moe_layer_freq", "1: every layer after the dense ones MoE")
        out["num_experts"] = k.get("num_experts", "n_routed_experts")
        out["top_k"] = k.get("top_k", "num_experts_per_tok")
        inter = int(k.get("expert_intermediate_size", "moe_intermediate_size"))
        out["expert_intermediate_size"] = inter
        n_shared = k.optional_int("n_shared_experts", 0)
        if n_shared:
            out["num_shared_experts"] = n_shared
            out["shared_expert_intermediate_size"] = n_shared * inter
            k.used["num_shared_experts"] = "n_shared_experts"
            k.used["shared_expert_intermediate_size"] = "n_shared_experts x moe_intermediate_size"
        dense = int(k.get("dense_layers", "first_k_dense_replace", default=0))
        if dense:
            out["dense_layers"] = dense
            out["dense_intermediate_size"] = k.get("dense_intermediate_size", "intermediate_size")
    out["num_layers"] = L - dense
    k.used["num_layers"] = "num_hidden_layers" + (
        f" {L} - first_k_dense_replace {dense}" if dense else ""
    )
    hidden = int(k.get("hidden_size", "hidden_size"))
    heads = int(k.get("num_attention_heads", "num_attention_heads"))
    if heads < 1:  # head_dim defaults to hidden_size / heads below
        raise k.refuse("num_attention_heads", ">= 1")
    out["hidden_size"] = hidden
    out["num_attention_heads"] = heads
    out["num_kv_heads"] = k.get("num_kv_heads", "num_key_value_heads", default=heads)
    head_keys = ("v_head_dim", "head_dim") if mt.startswith("deepseek") else ("head_dim",)
    out["head_dim"] = k.get("head_dim", *head_keys, default=hidden // heads)
    if mt.startswith("deepseek"):  # multi-head latent attention
        q_rank = k.optional_int("q_lora_rank", 0)
        out["q_lora_rank"] = q_rank
        k.used["q_lora_rank"] = "q_lora_rank" + ("" if q_rank else " null: a direct projection")
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim"):
            out[name] = int(k.get(name, name))
    out["vocab_size"] = k.get("vocab_size", "vocab_size")
    out.update(_unconverted_widths(cfg, k))
    hf_id = cfg.get("_name_or_path") or ""
    spec = ModelSpec(**out, hf_model_id=str(hf_id), source=f"{path} (model_type {mt})")
    try:
        spec.validate()
    except ConfigError as exc:  # named by the config.json key the field came from
        field = exc.key.removeprefix("model.")
        src = k.used.get(field, "").split(" ")[0]
        if src and src in cfg:
            raise FmoesimError(f"{path}: {src} = {exc.value!r} (rule: {exc.rule})") from None
        raise FmoesimError(f"{path}: {exc}") from None
    return spec, k.used


#: module-name parts of ``modules_to_not_convert`` and the width field each keeps
_UNCONVERTED = (("self_attn", "attention_dtype"), ("embed_tokens", "embedding_dtype"),
                ("lm_head", "embedding_dtype"))  # fmt: skip


def _unconverted_widths(cfg: dict[str, Any], k: _Keys) -> dict[str, str]:
    """``attention_dtype`` / ``embedding_dtype`` for the modules a ``quantization_config``
    leaves unconverted, at the config's ``torch_dtype`` (or ``dtype``); none when the
    config has no such list or names no float format of :data:`DTYPE_BYTES`."""
    quant = cfg.get("quantization_config")
    keep = quant.get("modules_to_not_convert") if isinstance(quant, dict) else None
    width = cfg.get("torch_dtype") or cfg.get("dtype")
    if not isinstance(keep, list) or width not in FLOAT_DTYPES:
        return {}
    out: dict[str, str] = {}
    for part, field in _UNCONVERTED:
        if any(isinstance(m, str) and part in m for m in keep):
            out[field] = str(width)
            k.used[field] = "quantization_config.modules_to_not_convert, torch_dtype"
    return out


def _yaml_item(key: str, text: str) -> str:
    """``key: text`` with ``text`` quoted where YAML would read it otherwise (a colon, a
    leading bracket, ``true``, a number)."""
    import yaml

    return str(yaml.safe_dump({key: text}, default_flow_style=False, width=10**6)).strip()


def preset_yaml(spec: ModelSpec, used: dict[str, str]) -> str:
    """A ``conf/model/`` preset: every field with the config key it came from."""
    fields = [
        "num_layers", "num_experts", "top_k", "num_shared_experts",
        "shared_expert_intermediate_size", "dense_layers", "dense_intermediate_size",
        "hidden_size", "expert_intermediate_size", "num_attention_heads", "num_kv_heads",
        "head_dim", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
        "vocab_size",
    ]  # fmt: skip
    lines = [
        "defaults:",
        "  - model_schema",
        "  - _self_",
        "",
        f"# From {spec.source}, by `fmoesim-model from-config`:",
        f"# {spec.num_layers} MoE layers x {spec.num_experts} experts, top-{spec.top_k}; an "
        f"expert of {spec.expert_size_bytes:,} bytes in {spec.dtype}.",
        _yaml_item("name", spec.name),
    ]
    if spec.hf_model_id:
        lines.append(_yaml_item("hf_model_id", spec.hf_model_id))
    for f in fields:
        v = getattr(spec, f)
        if f in used or v:
            lines.append(f"{f + ':':<34}{v}".rstrip() + (f"  # {used[f]}" if f in used else ""))
    lines.append(f"dtype: {spec.dtype}")
    for f in ("attention_dtype", "embedding_dtype"):
        if getattr(spec, f):
            lines.append(f"{f}: {getattr(spec, f)}" + (f"  # {used[f]}" if f in used else ""))
    lines += [_yaml_item("source", spec.source), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``fmoesim-model``."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    fc = sub.add_parser("from-config", help="a conf/model/ preset from a config.json")
    fc.add_argument("config", help="a Hugging Face config.json")
    fc.add_argument("--name", default=None, help="preset name (default: the file's folder)")
    fc.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPE_BYTES))
    fc.add_argument("--out", default=None, help="write here (default: print the YAML)")
    fc.add_argument("--force", action="store_true", help="replace an existing file")
    args = ap.parse_args(argv)

    def run() -> None:
        path = Path(args.config)
        if not path.is_file():
            raise FmoesimError(f"{path}: no such file")
        try:
            raw = json.loads(path.read_text())
        except (ValueError, RecursionError) as exc:  # not JSON, not UTF-8, nested too deep
            raise FmoesimError(f"{path}: not JSON ({exc}; rule: a config.json)") from None
        if not isinstance(raw, dict):
            raise FmoesimError(f"{path}: {type(raw).__name__} (rule: a JSON object)")
        name = args.name or path.resolve().parent.name.lower()
        spec, used = model_from_config(raw, name, args.dtype, str(path))
        text = preset_yaml(spec, used)
        if args.out is None:
            print(text, end="")
            return
        out = Path(args.out)
        if out.exists() and not args.force:
            raise FmoesimError(f"{out}: exists (--force to replace it)")
        if out.is_dir():
            raise FmoesimError(f"{out}: a folder (rule: --out names the preset's file)")
        with atomic_file(out) as tmp:
            tmp.write_text(text)
        print(f"wrote {out}: {spec.num_layers} MoE layers x {spec.num_experts} experts, "
              f"top-{spec.top_k}")  # fmt: skip

    run_or_exit(PROG, run)


if __name__ == "__main__":
    main()
