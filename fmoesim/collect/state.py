"""The state of a stopped collection: ``<out>.parts/state.json`` beside its parts.

It holds the arguments that decide the trace's content (the prompts' hash and count,
``max_new_tokens``, ``embedding_dim``, ``projection_seed``), the torch and transformers
versions, and a fingerprint of the model: a hash of its config (without its path), a
hash of its parameter and buffer names, shapes and dtypes, a hash of its router weights
(``weight``, ``bias``, ``e_score_correction_bias``), its end-of-sequence and padding
token ids.  A resume with other arguments, versions or another model is refused in one
line; ``--force`` (``overwrite``) discards such a collection instead.  ``batch_size``
and ``tokens`` are free to change between runs: neither changes a request's parts.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_file
from fmoesim.errors import FmoesimError

STATE_NAME = "state.json"
STATE_FORMAT = 1
#: config keys that name where a model was loaded from, not what it is
CONFIG_KEYS_IGNORED = ("_name_or_path", "_commit_hash", "transformers_version")


def _sha256(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def prompts_sha256(prompts: Sequence[Sequence[int]]) -> str:
    """Hash of the prompts' token ids, in order."""
    return _sha256(json.dumps([[int(t) for t in p] for p in prompts]))


def collection_arguments(
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    embedding_dim: int | None,
    projection_seed: int,
) -> dict[str, Any]:
    """The arguments a resumed collection must repeat."""
    return {
        "num_prompts": len(prompts),
        "prompts_sha256": prompts_sha256(prompts),
        "max_new_tokens": int(max_new_tokens),
        "embedding_dim": None if embedding_dim is None else int(embedding_dim),
        "projection_seed": int(projection_seed),
    }


def library_versions() -> dict[str, str]:
    """Versions of the libraries that compute the routing (torch, transformers)."""
    import torch

    out = {"torch": str(torch.__version__)}
    try:
        import transformers

        out["transformers"] = str(transformers.__version__)
    except ImportError:  # pragma: no cover - the collector needs transformers anyway
        pass
    return out


def _tensor_bytes(t: Any) -> bytes:
    import torch

    t = t.detach()
    if t.device.type == "meta":  # offloaded without data: its shape stands for it
        return repr(tuple(t.shape)).encode()
    return t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def model_fingerprint(model: Any, routers: Sequence[Any]) -> dict[str, Any]:
    """Fingerprint of ``model`` (module docstring); ``routers`` are its router modules."""
    cfg = model.config.to_dict() if hasattr(model.config, "to_dict") else vars(model.config)
    cfg = {k: v for k, v in cfg.items() if k not in CONFIG_KEYS_IGNORED}
    shapes = [
        f"{name}:{tuple(t.shape)}:{t.dtype}"
        for name, t in [*model.named_parameters(), *model.named_buffers()]
    ]
    h = hashlib.sha256()
    for r in routers:
        for name in ("weight", "bias", "e_score_correction_bias"):
            t = getattr(r, name, None)
            if t is not None:
                h.update(name.encode())
                h.update(_tensor_bytes(t))
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None)
    eos_ids = sorted(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return {
        "config_sha256": _sha256(json.dumps(cfg, sort_keys=True, default=str)),
        "weight_shapes_sha256": _sha256("\n".join(shapes)),
        "router_weights_sha256": h.hexdigest(),
        "eos_token_ids": [int(t) for t in eos_ids],
        "pad_token_id": getattr(model.config, "pad_token_id", None),
    }


def _differences(was: dict[str, Any], now: dict[str, Any]) -> list[str]:
    return [
        f"{k} {was.get(k)!r} there, {now.get(k)!r} now"
        for k in sorted(set(was) | set(now))
        if was.get(k) != now.get(k)
    ]


def check_resume(
    parts: Path,
    arguments: dict[str, Any],
    versions: dict[str, str],
    model: dict[str, Any] | None,
    overwrite: bool,
) -> None:
    """Check a stopped collection in ``parts`` against this run; ``model`` None skips the
    fingerprint (before the model loads).  A mismatch is refused in one line, or, with
    ``overwrite``, the stopped collection is removed."""
    if not parts.exists():
        return
    state_path = parts / STATE_NAME
    problem = ""
    try:
        state = json.loads(state_path.read_text())
        if not isinstance(state, dict) or state.get("format") != STATE_FORMAT:
            problem = f"its {STATE_NAME} is not format {STATE_FORMAT}"
    except FileNotFoundError:
        problem = f"it holds no {STATE_NAME}"
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        problem = f"its {STATE_NAME} is unreadable ({str(exc).splitlines()[0]})"
    if not problem:
        diff = _differences(state.get("arguments", {}), arguments)
        diff += _differences(state.get("versions", {}), versions)
        if diff:
            problem = "it was made with other arguments (" + "; ".join(diff) + ")"
        elif model is not None:
            was = state.get("model", {})
            diff = [k for k in sorted(set(was) | set(model)) if was.get(k) != model.get(k)]
            if diff:
                problem = "it was made with another model (" + ", ".join(diff) + " differ)"
    if not problem:
        return
    if overwrite:
        shutil.rmtree(parts)
        return
    raise FmoesimError(
        f"{parts}: a stopped collection that cannot be resumed: {problem}; rerun with its "
        "arguments and model to resume it, or pass --force to discard it"
    )


def write_state(
    parts: Path, arguments: dict[str, Any], versions: dict[str, str], model: dict[str, Any]
) -> None:
    """Write ``parts/state.json`` atomically."""
    state = {"format": STATE_FORMAT, "arguments": arguments, "versions": versions, "model": model}
    with atomic_file(parts / STATE_NAME) as tmp:
        tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
