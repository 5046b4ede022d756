"""Route tables from any logger, and routed-expert arrays, as fmoesim traces.

:func:`import_table` reads a CSV, TSV, JSON-lines or Parquet table of router decisions in
either of two shapes:

- *wide*: one row per (token, layer) with a list of experts (and optionally a list of
  weights): ``experts: [3, 7]``;
- *long*: one row per (token, layer, expert): ``expert: 3`` (and optionally ``weight``
  and the router's ``rank`` / ``slot``).

Columns are found by their usual names (:data:`COLUMNS`) or named with ``mapping``
(``{"position": "tok"}``).  Lines starting with ``#`` are skipped (CSV/TSV), except that
a comment holding ``layer=N`` and ``expert_bytes=B`` (a llama.cpp-style logger's header)
gives layer N's expert size; a ``size_bytes`` column does the same per row.  Sizes, when
given for every layer, go into the trace (``source.expert_bytes_by_layer``) and from there
to a run's model.  Which
rows are one token, in order:

- a request is the value of the request column (``request_id``, ``req_id``,
  ``problem_id``, ``turn``; one request without it) within its ``dataset`` (a column, or
  the file's name when ``src`` is a directory of tables), in order of first appearance;
- inside a request, rows are read in file order, and a token is a (step, position) pair.
  **The restart rule:** a row whose (position, layer) pair, or (position, layer, rank)
  in the long shape, was already seen in the current step starts a new step, because the
  logger's position counter restarted (a log of per-step batches whose decode position is
  0 every step); tokens are ordered by step, then position;
- the prompt is the first ``prompt_tokens`` tokens when that is given, else the tokens
  whose ``phase`` is prefill (``0``, ``prefill``, ``p``) when there is a phase column,
  else the first token (every token an iteration of its own, as a cache sees a log token
  by token; ``prompt_tokens=1`` also gives an engine's token-by-token prefill).

Every token has ``top_k`` experts at each layer it was logged at (the model's, or
``top_k`` given for a run made with fewer).  A token the log lacks at some layer is kept:
it routes nothing there (the trace's ``layer_gaps``), and the import reports how many
(token, layer) pairs that is.  Nothing is dropped.

:func:`from_arrays` writes a trace from per-request ``(tokens, layers, top_k)`` arrays of
expert ids (and optional weights), the shape vLLM's routed-experts output and most
loggers reduce to; :func:`import_routed_experts` reads such arrays from ``.npy``, ``.npz``
or JSON files.  Bad input is refused with one line naming the file, the row and the
broken rule; the trace is written into a temporary directory and renamed into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.errors import FmoesimError
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.schema import TraceManifest, TraceModel
from fmoesim.trace.writer import TraceWriter

#: canonical key -> the column names recognised without a map, first match wins
COLUMNS: dict[str, tuple[str, ...]] = {
    "request": ("request_id", "req_id", "problem_id", "turn"),
    "position": ("token_idx", "token_pos", "position", "step"),
    "layer": ("layer", "layer_id", "layer_idx"),
    "experts": ("experts", "topk_ids", "expert", "expert_id"),
    "weights": ("gating_probs", "topk_weights", "weight", "weights"),
    "rank": ("slot", "rank"),
    "phase": ("phase",),
    "size": ("size_bytes", "expert_size_bytes"),
    "dataset": ("dataset",),
}
PREFILL = {"0", "prefill", "p", "prompt"}
SUFFIXES = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}


@dataclass
class ImportReport:
    """What an import did, in counts (printed by the command line)."""

    path: Path
    requests: int = 0
    tokens: int = 0
    rows: int = 0
    steps_restarted: int = 0
    missing_pairs: int = 0
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    #: bytes of one expert per layer, from a size column (None without one)
    layer_bytes: list[int] | None = None

    def lines(self) -> list[str]:
        """One line per fact."""
        cols = ", ".join(f"{k}={v}" for k, v in self.columns.items())
        out = [
            f"columns: {cols}",
            f"{self.rows} rows -> {self.requests} requests, {self.tokens} tokens",
        ]
        if self.layer_bytes is not None:
            sizes = sorted(set(self.layer_bytes))
            out.append(f"expert sizes per layer: {', '.join(map(str, sizes))} bytes")
        if self.steps_restarted:
            out.append(f"{self.steps_restarted} position restarts read as new steps")
        if self.missing_pairs:
            out.append(
                f"{self.missing_pairs} (token, layer) pairs without rows: kept, routing "
                "nothing at that layer (layer_gaps)"
            )
        return out


class TableError(FmoesimError):
    """A route table breaks a rule: file, row (1-based, as a reader counts data rows)
    and rule."""

    def __init__(self, path: Path, row: int | None, rule: str, detail: str = "") -> None:
        where = f" row {row}" if row is not None else ""
        super().__init__(f"{path}{where}: {rule}" + (f" ({detail})" if detail else ""))


def _read(path: Path) -> Any:
    """The table as a pandas DataFrame; a directory's tables (every file with a known
    suffix, in name order) one after the other, with their file names as a ``dataset``
    column where they have none."""
    import pandas as pd

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES)
        if not files:
            raise FmoesimError(f"{path}: no route tables ({', '.join(SUFFIXES)}) in this directory")
        parts = []
        for f in files:
            df = _read(f)
            if "dataset" not in df.columns:
                df["dataset"] = f.stem
            parts.append(df)
        return pd.concat(parts, ignore_index=True)
    if not path.is_file():
        raise FmoesimError(f"{path}: no such file or directory")
    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise TableError(path, None, f"a route table ends in one of {sorted(SUFFIXES)}")
    try:
        if kind in ("csv", "tsv"):
            return pd.read_csv(path, sep="\t" if kind == "tsv" else ",", comment="#")
        if kind == "jsonl":
            return pd.read_json(path, lines=True)
        return pd.read_parquet(path)
    except (ValueError, OSError) as exc:  # pandas' parse errors are ValueErrors
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TableError(path, None, f"readable as {kind}", msg) from None


def _header_sizes(path: Path) -> dict[int, int]:
    """Layer -> expert bytes from ``# ... layer=N ... expert_bytes=B`` comment lines."""
    import re

    out: dict[int, int] = {}
    if SUFFIXES.get(path.suffix.lower()) not in ("csv", "tsv"):
        return out
    pat_l, pat_b = re.compile(r"\blayer=(\d+)\b"), re.compile(r"\bexpert_bytes=(\d+)\b")
    with path.open() as f:
        for line in f:
            if not line.startswith("#"):
                continue
            lm, bm = pat_l.search(line), pat_b.search(line)
            if lm and bm:
                out[int(lm.group(1))] = int(bm.group(1))
    return out


def _columns(path: Path, names: Sequence[str], mapping: dict[str, str]) -> dict[str, str]:
    """Canonical key -> column name, from ``mapping`` then :data:`COLUMNS`."""
    unknown = sorted(set(mapping) - set(COLUMNS))
    if unknown:
        raise FmoesimError(f"--map: unknown key(s) {unknown}; valid: {sorted(COLUMNS)}")
    out: dict[str, str] = {}
    for key, candidates in COLUMNS.items():
        if key in mapping:
            if mapping[key] not in names:
                raise TableError(path, None, f"has column '{mapping[key]}' (--map {key}=...)")
            out[key] = mapping[key]
            continue
        for c in candidates:
            if c in names and c not in out.values():
                out[key] = c
                break
    for key in ("layer", "experts"):
        if key not in out:
            raise TableError(
                path, None, f"has a {key} column ({' / '.join(COLUMNS[key])}, or --map {key}=...)"
            )
    return out


def _as_list(v: Any) -> list[Any] | None:
    """A list-valued cell (a list, an array, or JSON text of a list), else None."""
    if isinstance(v, (list, tuple, np.ndarray)):
        return list(v)
    if isinstance(v, str) and v.strip().startswith("["):
        try:
            out = json.loads(v)
        except json.JSONDecodeError:
            return None
        return out if isinstance(out, list) else None
    return None


@dataclass
class _Request:
    name: str
    # token key (step, position) -> layer -> list of (rank, expert, weight)
    tokens: dict[tuple[int, int], dict[int, list[tuple[int, int, float | None]]]]
    prefill: set[tuple[int, int]]


def read_table(
    src: str | os.PathLike[str],
    model: ModelSpec,
    mapping: dict[str, str] | None = None,
) -> tuple[list[_Request], ImportReport]:
    """Parse a route table into requests of tokens (module docstring), checking every
    row against ``model`` (layer and expert ids)."""
    path = Path(src)
    df = _read(path)
    cols = _columns(path, list(df.columns), dict(mapping or {}))
    rep = ImportReport(path=path, rows=len(df), columns=cols)
    if not len(df):
        raise TableError(path, None, "a route table has at least one row")
    L, E = model.num_layers, model.num_experts
    get = {k: df[c].tolist() for k, c in cols.items()}
    n = len(df)
    reqs = get.get("request", [0] * n)
    if "dataset" in get:
        reqs = [f"{d}/{r}" for d, r in zip(get["dataset"], reqs, strict=True)]
    pos = get.get("position")
    ranks = get.get("rank")
    phase = get.get("phase")
    weights = get.get("weights")
    size_col = get.get("size")
    layer_size: dict[int, int] = _header_sizes(path)
    wide = _as_list(get["experts"][0]) is not None
    out: dict[str, _Request] = {}
    seen: dict[str, set[tuple[int, ...]]] = {}
    step: dict[str, int] = {}
    for i in range(n):
        row = i + 1
        name = str(reqs[i])
        r = out.get(name)
        if r is None:
            r = out[name] = _Request(name, {}, set())
            seen[name], step[name] = set(), 0
        layer = _int(path, row, "layer", get["layer"][i])
        if not 0 <= layer < L:
            raise TableError(path, row, f"layer in [0, {L})", f"got {layer}")
        if size_col is not None:
            b = _int(path, row, "expert_bytes", size_col[i])
            if b <= 0 or layer_size.setdefault(layer, b) != b:
                raise TableError(
                    path, row, "one expert size (> 0) per layer",
                    f"layer {layer}: {b} after {layer_size[layer]}",
                )  # fmt: skip
        # without a position column every token is at 0: the restart rule steps per token
        p = _int(path, row, "position", pos[i]) if pos is not None else 0
        if p < 0:
            raise TableError(path, row, "position >= 0", f"got {p}")
        if wide:
            experts = _as_list(get["experts"][i])
            if experts is None:
                raise TableError(path, row, "experts holds a list of expert ids")
            ws = _as_list(weights[i]) if weights is not None else None
            if weights is not None and (ws is None or len(ws) != len(experts)):
                raise TableError(path, row, "weights holds one number per expert")
            items = [
                (j, _int(path, row, "experts", e), None if ws is None else float(ws[j]))
                for j, e in enumerate(experts)
            ]
            key: tuple[int, ...] = (p, layer)
        else:
            e = _int(path, row, "expert", get["experts"][i])
            rank = _int(path, row, "rank", ranks[i]) if ranks is not None else -1
            w = None if weights is None else float(weights[i])
            items = [(rank, e, w)]
            key = (p, layer, rank if ranks is not None else e)
        for _, e, w in items:
            if not 0 <= e < E:
                raise TableError(path, row, f"expert ids in [0, {E})", f"got {e}")
            if w is not None and not (np.isfinite(w) and w >= 0):
                raise TableError(path, row, "weights are finite and >= 0", f"got {w}")
        if key in seen[name]:  # the restart rule
            step[name] += 1
            seen[name] = set()
            rep.steps_restarted += 1
        seen[name].add(key)
        tok = (step[name], p)
        lay = r.tokens.setdefault(tok, {}).setdefault(layer, [])
        lay.extend(items)
        if phase is not None and str(phase[i]).strip().lower() in PREFILL:
            r.prefill.add(tok)
    rep.requests = len(out)
    rep.tokens = sum(len(r.tokens) for r in out.values())
    if size_col is not None or layer_size:
        if len(layer_size) != L or any(b <= 0 for b in layer_size.values()):
            missing = sorted(set(range(L)) - set(layer_size))
            raise TableError(path, None, "expert sizes for every layer", f"none for {missing[:5]}")
        rep.layer_bytes = [layer_size[i] for i in range(L)]
    return list(out.values()), rep


def _int(path: Path, row: int, what: str, v: Any) -> int:
    """An integer cell (an integral float from a CSV with gaps counts)."""
    if isinstance(v, (bool, np.bool_)):
        raise TableError(path, row, f"{what} is an integer", f"got {v!r}")
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise TableError(path, row, f"{what} is an integer", f"got {v!r}")


def import_table(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    mapping: dict[str, str] | None = None,
    prompt_tokens: int | None = None,
    top_k: int | None = None,
    overwrite: bool = False,
    fmt: str = "table",
) -> tuple[Path, ImportReport]:
    """Convert a route table into a trace (module docstring); returns its path and what
    the import did.  ``top_k`` replaces the model's experts per token (a run made with
    fewer); ``prompt_tokens``, when given, sets the prompt length whatever the table's
    phase column says."""
    if prompt_tokens is not None and prompt_tokens < 1:
        raise FmoesimError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")
    if top_k is not None:
        if not 1 <= top_k <= model.num_experts:
            raise FmoesimError(f"--top-k must be in [1, {model.num_experts}], got {top_k}")
        model = dataclasses.replace(model, top_k=top_k)
    requests, rep = read_table(src, model, mapping)
    path = Path(src)
    L, K = model.num_layers, model.top_k
    arrays = []
    for r in requests:
        toks = sorted(r.tokens)
        ids = np.full((len(toks), L, K), -1, dtype=np.int64)
        wts = np.zeros((len(toks), L, K), dtype=np.float64)
        for t, key in enumerate(toks):
            for layer, items in r.tokens[key].items():
                got = sorted(items)  # by rank (file order within a wide row)
                es = [e for _, e, _ in got]
                if len(es) != K or len(set(es)) != K:
                    raise TableError(
                        path,
                        None,
                        f"every token has {K} distinct experts at a layer it is logged at "
                        "(--top-k for a run made with fewer)",
                        f"request {r.name}, token {t} (step {key[0]}, position {key[1]}), "
                        f"layer {layer}: {es}",
                    )
                ids[t, layer] = es
                wts[t, layer] = [0.0 if w is None else w for _, _, w in got]
        prefill = [t for t, key in enumerate(toks) if key in r.prefill]
        if r.prefill and prompt_tokens is None:
            if prefill != list(range(len(prefill))):
                raise TableError(
                    path, None, "prefill tokens come before decode tokens", f"request {r.name}"
                )
            p = len(prefill)
        else:
            p = prompt_tokens or 1
        if len(toks) < p:
            raise TableError(
                path, None, f"a request has at least --prompt-tokens {p} tokens",
                f"request {r.name} has {len(toks)}",
            )  # fmt: skip
        arrays.append((r.name, ids, wts, p))
    extra: dict[str, Any] = {"columns": rep.columns, "steps_restarted": rep.steps_restarted}
    if rep.layer_bytes is not None:
        extra["expert_bytes_by_layer"] = rep.layer_bytes
    out = write_routed(
        dst, model, arrays, "weights" in rep.columns, fmt, [path.name], overwrite, **extra
    )
    rep.missing_pairs = out
    return Path(dst), rep


def write_routed(
    dst: str | os.PathLike[str],
    model: ModelSpec,
    arrays: list[tuple[str, np.ndarray, np.ndarray, int]],
    with_weights: bool,
    fmt: str,
    original: list[str],
    overwrite: bool,
    datasets: Sequence[str] | None = None,
    **extra: Any,
) -> int:
    """Write an importer's trace from requests given as ``(name, ids (T, L, K) with -1
    where a layer was not logged, weights (T, L, K), prompt tokens)``: the first prompt
    tokens one prefill iteration, each later token one decode iteration; per-token top-k
    with weights when ``with_weights`` and no layer is missing.  ``datasets`` names each
    request's dataset (default: its name); ``extra`` goes into ``source``.  Returns the
    (token, layer) pairs without routing."""
    L, E = model.num_layers, model.num_experts
    missing = sum(int((ids[:, :, 0] < 0).sum()) for _, ids, _, _ in arrays)
    man = TraceManifest(
        model=TraceModel.decoder_only(model, "the trace importer"),
        embedding_dim=0,
        source={
            "kind": "importer",
            "format": fmt,
            "original": original,
            "requests": [a[0] for a in arrays],
            "prompt_tokens": [a[3] for a in arrays],
            "missing_token_layers": missing,
            **extra,
        },
        has_probs=False,
        has_spec_probs=False,
        layer_gaps=missing > 0,
    )
    per_token = with_weights and missing == 0
    with TraceWriter(dst, man, overwrite=overwrite) as w:
        for rid, (name, ids, wts, p) in enumerate(arrays):
            T = len(ids)
            one_hot = np.zeros((T, L, E), dtype=np.int32)
            t_idx, l_idx, _ = np.nonzero(ids >= 0)
            np.add.at(one_hot, (t_idx, l_idx, ids[ids >= 0]), 1)
            ds = name if datasets is None else datasets[rid]
            w.add_request(rid, prompt_tokens=p, output_tokens=T - p + 1, dataset=ds)

            def tok(a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
                return (ids[a:b], wts[a:b]) if per_token else None  # noqa: B023

            w.add_iteration(rid, 0, p, None, one_hot[:p].sum(axis=0), tokens=tok(0, p))
            for j in range(1, T - p + 1):
                t = p + j - 1
                w.add_iteration(rid, j, 1, None, one_hot[t], tokens=tok(t, t + 1))
    return missing


def from_arrays(
    experts: np.ndarray | Sequence[np.ndarray],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    weights: np.ndarray | Sequence[np.ndarray] | None = None,
    prompt_tokens: int | Sequence[int] = 1,
    names: Sequence[str] | None = None,
    overwrite: bool = False,
    fmt: str = "arrays",
    original: Sequence[str] = (),
) -> Path:
    """A trace from routed experts: one ``(tokens, layers, top_k)`` integer array per
    request (or one array for a single request), expert ids in ``[0, E)`` and ``-1`` for
    a layer the logger missed; optional weights of the same shapes; the prompt length of
    each request (its first tokens form the prefill iteration).  ``top_k`` is the arrays'
    last dimension (the model's is replaced when it differs)."""
    reqs = [experts] if isinstance(experts, np.ndarray) and np.ndim(experts) == 3 else experts
    reqs = [np.asarray(a) for a in reqs]
    if not reqs:
        raise FmoesimError("from_arrays: no requests")
    if weights is not None:
        ws = [weights] if isinstance(weights, np.ndarray) and np.ndim(weights) == 3 else weights
        ws = [np.asarray(a, dtype=np.float64) for a in ws]
    else:
        ws = [np.zeros(a.shape) for a in reqs]
    K = reqs[0].shape[-1] if reqs[0].ndim == 3 else 0
    if K and K != model.top_k:
        model = dataclasses.replace(model, top_k=K)
    p_all = [prompt_tokens] * len(reqs) if isinstance(prompt_tokens, int) else list(prompt_tokens)
    if len(p_all) != len(reqs) or len(ws) != len(reqs):
        raise FmoesimError("from_arrays: one prompt length and one weight array per request")
    L, E = model.num_layers, model.num_experts
    arrays = []
    for i, (a, w, p) in enumerate(zip(reqs, ws, p_all, strict=True)):
        what = f"from_arrays: request {i}"
        if (
            a.ndim != 3
            or a.shape[1] != L
            or a.shape[2] != K
            or not np.issubdtype(a.dtype, np.integer)
        ):
            raise FmoesimError(f"{what}: experts is an integer array (tokens, {L}, {K}), got "
                               f"{a.dtype} {a.shape}")  # fmt: skip
        if w.shape != a.shape:
            raise FmoesimError(f"{what}: weights have shape {w.shape}, experts {a.shape}")
        gap = a < 0
        if ((a < -1) | (a >= E)).any() or (gap.any(axis=2) != gap.all(axis=2)).any():
            raise FmoesimError(f"{what}: expert ids in [0, {E}), or -1 for a whole layer")
        ok = ~gap[:, :, 0]
        srt = np.sort(a, axis=2)
        if (ok & (np.diff(srt, axis=2) == 0).any(axis=2)).any():
            raise FmoesimError(f"{what}: a token's experts at a layer are distinct")
        if not 1 <= int(p) <= len(a):
            raise FmoesimError(f"{what}: prompt_tokens in [1, {len(a)}], got {p}")
        name = names[i] if names is not None else str(i)
        arrays.append((name, a.astype(np.int64), w, int(p)))
    write_routed(dst, model, arrays, weights is not None, fmt, list(original), overwrite)
    return Path(dst)


def import_routed_experts(
    src: str | os.PathLike[str],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    prompt_tokens: int | None = None,
    overwrite: bool = False,
) -> Path:
    """vLLM's routed experts (``--enable-return-routed-experts``): per request an integer
    array ``(tokens, layers, top_k)``.  ``.npy``: one request; ``.npz``: one request per
    array, in key order (an array ``prompt_tokens`` of lengths, when present, is read
    instead of being a request); ``.json``: an object ``{"routed_experts": [...],
    "prompt_tokens": n}`` or a list of them.  ``prompt_tokens`` given here overrides what
    the file stores (default 1)."""
    path = Path(src)
    if not path.is_file():
        raise FmoesimError(f"{path}: no such file")
    stored: list[int] | None = None
    try:
        if path.suffix == ".npy":
            reqs = [np.load(path, allow_pickle=False)]
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = sorted(k for k in z.files if k != "prompt_tokens")
                reqs = [z[k] for k in keys]
                if "prompt_tokens" in z.files:
                    stored = [int(x) for x in np.atleast_1d(z["prompt_tokens"])]
        elif path.suffix == ".json":
            raw = json.loads(path.read_text())
            items = raw if isinstance(raw, list) else [raw]
            if not all(isinstance(x, dict) and "routed_experts" in x for x in items):
                raise TableError(path, None, "each request is an object with 'routed_experts'")
            reqs = [np.asarray(x["routed_experts"], dtype=np.int64) for x in items]
            if all("prompt_tokens" in x for x in items):
                stored = [int(x["prompt_tokens"]) for x in items]
        else:
            raise TableError(path, None, "routed experts are in a .npy, .npz or .json file")
    except (ValueError, OSError) as exc:
        raise TableError(path, None, "readable", str(exc).splitlines()[0]) from None
    p: int | list[int] = prompt_tokens or (stored if stored is not None else 1)
    try:
        return from_arrays(
            reqs, dst, model, prompt_tokens=p, overwrite=overwrite,
            fmt="vllm-routed-experts", original=[path.name],
        )  # fmt: skip
    except FmoesimError as exc:
        raise FmoesimError(f"{path}: {exc}") from None
