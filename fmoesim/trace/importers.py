"""Importers: traces users already have, converted into fmoesim's trace format.

- :func:`import_vllm_routes` — vLLM-style route logs: JSON lines with ``layer``,
  ``token_idx``, top-k ``experts`` and their ``gating_probs`` (optionally ``dataset`` and
  ``problem_id`` naming the request), keeping only the tokens logged at every layer: the
  complete-token view :mod:`fmoesim.workload.calibrate` measures statistics on.  The
  command line's ``import vllm-routes`` reads such logs with the route-table importer
  instead (:func:`fmoesim.trace.table.import_table`), which keeps every row.
- :func:`import_eamc` — MoE-Infinity's EAMC array (``.npy``, ``(capacity, layers,
  experts)`` request-level token counts).

Both sources are top-k only, so the traces have ``probs = null`` and no embeddings;
policies that need full probabilities say what they do without them (fMoE uses the
routed-token shares as its maps).  Bad input is refused with one line naming the file,
the line or row, and the broken rule; the trace is written to a temporary directory and
renamed into place, so nothing half-written is left.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.errors import FmoesimError, spans
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.schema import (
    MAX_TOKENS,
    TraceManifest,
    TraceModel,
    check_prompt_tokens,
    is_json_int,
)
from fmoesim.trace.writer import TraceWriter, check_destination

FORMATS = ("vllm-routes", "eamc")


class ImportError_(FmoesimError):  # noqa: N801 - the builtin name is taken
    """A source file breaks a rule of its format."""

    def __init__(self, path: Path, where: str, rule: str, detail: str = "") -> None:
        msg = f"{path} {where}: {rule}" + (f" ({detail})" if detail else "")
        super().__init__(msg)


def _manifest(model: ModelSpec, fmt: str, original: list[str], **extra: Any) -> TraceManifest:
    return TraceManifest(
        model=TraceModel.decoder_only(model, f"the {fmt} importer"),
        embedding_dim=0,
        source={"kind": "importer", "format": fmt, "original": original, **extra},
        has_probs=False,
        has_spec_probs=False,
    )


def _jsonl_files(src: Path) -> list[Path]:
    if src.is_dir():
        files = sorted(p for p in src.iterdir() if p.suffix == ".jsonl")
        if not files:
            raise FmoesimError(f"{src}: no .jsonl files in this directory")
        return files
    if not src.is_file():
        raise FmoesimError(f"{src}: no such file or directory")
    return [src]


Routes = dict[tuple[str, int], dict[int, dict[int, tuple[list[int], list[float] | None]]]]


def read_vllm_routes(src: str | os.PathLike[str], model: ModelSpec) -> tuple[Routes, list[str]]:
    """Parse route logs: ``{(source, request): {layer: {token: (experts, weights)}}}``
    and the file names.  Every row is checked against ``model`` (layer, expert ids,
    top-k)."""
    L, E, K = model.num_layers, model.num_experts, model.top_k
    out: Routes = defaultdict(lambda: defaultdict(dict))
    files = _jsonl_files(Path(src))
    for path in files:
        with path.open() as f:
            for n, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"line {n}"
                try:
                    row = json.loads(line)
                except (ValueError, RecursionError) as exc:  # nested too deep: RecursionError
                    raise ImportError_(
                        path, where, "each line is a JSON object", str(exc).splitlines()[0]
                    ) from None
                if not isinstance(row, dict):
                    raise ImportError_(path, where, "each line is a JSON object")
                for key in ("layer", "token_idx", "experts"):
                    if key not in row:
                        raise ImportError_(path, where, f"has key '{key}'")
                layer, tok, experts = row["layer"], row["token_idx"], row["experts"]
                if not is_json_int(layer) or not 0 <= layer < L:
                    raise ImportError_(path, where, f"layer in [0, {L})", f"got {layer!r}")
                if not is_json_int(tok) or tok < 0:
                    raise ImportError_(path, where, "token_idx >= 0", f"got {tok!r}")
                if (
                    not isinstance(experts, list)
                    or len(experts) != K
                    or len(set(experts)) != K
                    or not all(is_json_int(e) and 0 <= e < E for e in experts)
                ):
                    raise ImportError_(
                        path,
                        where,
                        f"experts holds {K} distinct ids in [0, {E})",
                        f"got {experts!r}",
                    )
                probs = row.get("gating_probs")
                if probs is not None and (
                    not isinstance(probs, list)
                    or len(probs) != K
                    or not all(
                        isinstance(p, (int, float))
                        and not isinstance(p, bool)
                        and math.isfinite(p)
                        and p >= 0
                        for p in probs
                    )
                ):
                    raise ImportError_(
                        path, where, f"gating_probs holds {K} numbers >= 0, finite",
                        f"got {probs!r}",
                    )  # fmt: skip
                req = row.get("problem_id", 0)
                if not is_json_int(req):
                    raise ImportError_(path, where, "problem_id is an integer", f"got {req!r}")
                name = str(row.get("dataset", path.stem))
                per_token = out[(name, req)][layer]
                if tok in per_token:
                    raise ImportError_(
                        path, where, "one row per (request, layer, token)", f"token {tok} again"
                    )
                per_token[tok] = (experts, probs)
    return out, [p.name for p in files]


def import_vllm_routes(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    prompt_tokens: int = 1,
    overwrite: bool = False,
) -> tuple[Path, int]:
    """Convert route logs into a trace; returns the path and the number of token rows
    dropped.

    A request is a ``(dataset, problem_id)`` pair (the file name and request 0 without
    them).  Its tokens are those present in *every* layer (logs may end a layer one or
    two tokens early or late; the others are dropped and counted), in ``token_idx``
    order.  The first ``prompt_tokens`` form the prefill iteration (logs do not say where
    the prompt ends; the default 1 makes every token an iteration of its own, the
    decode-like view a cache sees token by token); each later token is one decode
    iteration.  ``counts`` are the routed top-k; ``probs`` are null.
    """
    check_destination(dst, overwrite)
    check_prompt_tokens(prompt_tokens)
    routes, files = read_vllm_routes(src, model)
    if not routes:
        raise FmoesimError(f"{src}: no routing rows")
    from fmoesim.trace.table import write_routed

    L, K = model.num_layers, model.top_k
    dropped = 0
    with_weights = True
    arrays = []
    for key in sorted(routes):
        layers = routes[key]
        if len(layers) != L:
            missing = set(range(L)) - set(layers)
            raise FmoesimError(
                f"{src}: request {key} has no rows for layer(s) {spans(missing)} "
                f"(rule: every layer of every token)"
            )
        common = set.intersection(*(set(t) for t in layers.values()))
        dropped += sum(len(t) for t in layers.values()) - L * len(common)
        tokens = sorted(common)
        if len(tokens) < prompt_tokens:
            raise FmoesimError(
                f"{src}: request {key} has {len(tokens)} complete tokens, fewer than "
                f"--prompt-tokens {prompt_tokens}"
            )
        ids = np.zeros((len(tokens), L, K), dtype=np.int64)
        wts = np.zeros((len(tokens), L, K), dtype=np.float64)
        for layer, per_token in layers.items():
            for i, t in enumerate(tokens):
                experts, probs = per_token[t]
                ids[i, layer] = experts
                if probs is None:
                    with_weights = False
                else:
                    wts[i, layer] = probs
        arrays.append((f"{key[0]}/{key[1]}", ids, wts, prompt_tokens))
    write_routed(
        dst, model, arrays, with_weights, "vllm-routes", files, overwrite,
        datasets=[k[0] for k in sorted(routes)], dropped_token_rows=dropped,
    )  # fmt: skip
    return Path(dst), dropped


def import_eamc(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    overwrite: bool = False,
) -> Path:
    """Convert an EAMC array ``(C, L, E)`` of request-level token counts into a trace of
    ``C`` one-iteration requests (an EAM keeps no per-iteration detail): request ``c``
    routes ``counts[c]`` over ``sum(counts[c, l]) / top_k`` tokens.  All-zero EAMs
    (unused slots) are skipped.  Every matrix is checked before anything is written:
    counts non-negative integers, every layer routing the same number of tokens times
    ``top_k``, no expert getting more tokens than the matrix routes."""
    check_destination(dst, overwrite)
    path = Path(src)
    try:
        arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise FmoesimError(f"{path}: not a readable .npy array ({str(exc) or 'empty'})") from None
    if not isinstance(arr, np.ndarray):  # an .npz archive
        arr.close()
        raise FmoesimError(f"{path}: not a .npy array (rule: an EAMC is one .npy array)")
    L, E, K = model.num_layers, model.num_experts, model.top_k
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise ImportError_(path, "dtype", "counts are numbers", f"got {arr.dtype}")
    if arr.ndim != 3 or arr.shape[1:] != (L, E):
        raise ImportError_(path, "shape", f"(capacity, {L}, {E})", f"got {arr.shape}")
    if not np.isfinite(arr).all():
        bad = int(np.flatnonzero(~np.isfinite(arr).all(axis=(1, 2)))[0])
        raise ImportError_(path, f"row {bad}", "counts are finite")
    huge = np.flatnonzero((np.abs(arr) > MAX_TOKENS).any(axis=(1, 2)))
    if len(huge):  # a count is a number of tokens (int32); int64 cannot hold 1e30
        raise ImportError_(path, f"row {int(huge[0])}", f"counts are at most {MAX_TOKENS}")
    counts = np.rint(arr).astype(np.int64)
    bad_rows = np.flatnonzero(
        (counts < 0).any(axis=(1, 2)) | (np.abs(arr - counts) > 1e-6).any(axis=(1, 2))
    )
    if len(bad_rows):
        raise ImportError_(path, f"row {int(bad_rows[0])}", "counts are non-negative integers")
    rows = []
    for c in range(len(counts)):
        per_layer = counts[c].sum(axis=1)  # (L,)
        if not per_layer.any():
            continue
        if (per_layer != per_layer[0]).any() or per_layer[0] % K:
            raise ImportError_(
                path,
                f"row {c}",
                f"every layer routes the same number of tokens x top_k ({K})",
                f"per-layer sums {sorted(set(per_layer.tolist()))[:4]}",
            )
        tokens = int(per_layer[0] // K)
        if tokens > MAX_TOKENS:
            raise ImportError_(
                path, f"row {c}", f"a matrix routes at most {MAX_TOKENS} tokens (int32)",
                f"{tokens} tokens",
            )  # fmt: skip
        over = np.argwhere(counts[c] > tokens)
        if len(over):
            layer, e = (int(x) for x in over[0])
            raise ImportError_(
                path,
                f"row {c}",
                "no expert gets more tokens than the matrix routes (per-layer sum / top_k)",
                f"layer {layer}, expert {e}: {int(counts[c, layer, e])} of {tokens} tokens",
            )
        rows.append((c, counts[c].astype(np.int32), tokens))
    if not rows:
        raise FmoesimError(f"{path}: every EAM is empty")
    man = _manifest(model, "eamc", [path.name], slots=[c for c, _, _ in rows])
    with TraceWriter(dst, man, overwrite=overwrite, check=True) as w:
        for rid, (_, eam, tokens) in enumerate(rows):
            w.add_request(rid, prompt_tokens=tokens, output_tokens=1, dataset="eamc")
            w.add_iteration(rid, 0, tokens, None, eam)
    return Path(dst)
