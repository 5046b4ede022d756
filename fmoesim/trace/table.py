"""Route tables from any logger, and routed-expert arrays, as fmoesim traces.

:func:`import_table` reads a CSV, TSV, JSON-lines (``.jsonl``, ``.json``), Parquet or
JSON-array (a ``.json`` file of one array of records) table of router decisions in
either of two shapes:

- *wide*: one row per (token, layer) with a list of experts (and optionally a list of
  weights): ``experts: [3, 7]``;
- *long*: one row per (token, layer, expert): ``expert: 3`` (and optionally ``weight``
  and the router's ``rank`` / ``slot``).

Columns are found by their usual names (:data:`COLUMNS`) or named with ``mapping``
(``{"position": "tok"}``); a column serves one key.  Lines starting with ``#`` are
skipped (CSV/TSV), except that a comment holding ``layer=N`` and ``expert_bytes=B`` (a
llama.cpp-style logger's header; B a positive integer) gives layer N's expert size; a
``size_bytes`` column does the same per row.  Sizes, when given for every layer, go into
the trace (``source.expert_bytes_by_layer``) and from there to a run's model.  Which rows
are one token, in order:

- a request is the value of the request column (``request_id``, ``request``, ``req_id``,
  ``problem_id``, ``turn``; one request without it: a ``seq_id`` may be a reused engine
  slot, so it is read only when mapped) within its ``dataset`` (a column, or the file's
  name when ``src`` is a directory of tables), in order of first appearance;
- inside a request, rows are read in file order, and a token is a (step, position) pair.
  **The restart rule:** a row whose (position, layer) pair, or (position, layer, rank)
  in the long shape, was already seen in the current step starts a new step, because the
  logger's position counter restarted (a log of per-step batches whose decode position is
  0 every step); a new step goes back to an earlier layer than the row before it, so a
  repeat at the same layer or a later one (a row logged twice) is refused, not read as a
  step; tokens are ordered by step, then position;
- the prompt is the first ``prompt_tokens`` tokens when that is given, else the tokens
  whose ``phase`` is prefill (:data:`PREFILL`; the others' is decode, :data:`DECODE`)
  when there is a phase column, else the first token (every token an iteration of its
  own, as a cache sees a log token by token; ``prompt_tokens=1`` also gives an engine's
  token-by-token prefill).

Every token has ``top_k`` distinct experts at each layer it was logged at (the model's,
or ``top_k`` given for a run made with fewer), a rank is in ``[0, top_k)``, weights are
finite numbers >= 0.  A token the log lacks at some layer is kept: it routes nothing there
(the trace's ``layer_gaps``), and the import reports how many (token, layer) pairs that
is.  A log whose last routed layer is below the model's last is refused (the log of a
model with fewer layers).  No routed row is dropped; a table with weights keeps them in
``tokens.parquet``, where a (token, layer) pair the log lacks is a null row.

:func:`from_arrays` writes a trace from per-request ``(tokens, layers, top_k)`` arrays of
expert ids (and optional weights), the shape vLLM's routed-experts output and most
loggers reduce to; :func:`import_routed_experts` reads such arrays from ``.npy``, ``.npz``
or JSON files.  Bad input is refused with one line naming the file, the row (1-based data
rows; a JSON-lines file's line; a JSON array's record; an array's request, token and
layer) and the broken rule;
the trace is written into a temporary directory, read back as a reader would, and renamed
into place.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from zipfile import BadZipFile

import numpy as np

from fmoesim.errors import FmoesimError, counted, spans
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.schema import TraceManifest, TraceModel, check_prompt_tokens, is_json_int
from fmoesim.trace.writer import TraceWriter, check_destination

#: canonical key -> the column names recognised without a map, first match wins
COLUMNS: dict[str, tuple[str, ...]] = {
    "request": ("request_id", "request", "req_id", "problem_id", "turn"),
    "position": ("token_idx", "token_pos", "position", "step"),
    "layer": ("layer", "layer_id", "layer_idx"),
    "experts": ("experts", "topk_ids", "expert", "expert_id"),
    "weights": ("gating_probs", "topk_weights", "weight", "weights"),
    "rank": ("slot", "rank"),
    "phase": ("phase",),
    "size": ("size_bytes", "expert_size_bytes"),
    "dataset": ("dataset",),
}
#: ``--map KEY=-``: the key has no column (where its usual name means something else)
NO_COLUMN = "-"
#: phase values of a prompt token, and of a generated one (any other phase is refused)
PREFILL = {"0", "prefill", "p", "prompt"}
DECODE = {"1", "decode", "d", "generate", "generation"}
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
    #: positions inside a step's range that no row logs (a token missing from every layer)
    position_holes: int = 0
    columns: dict[str, str] = dataclasses.field(default_factory=dict)
    #: bytes of one expert per layer, from a size column (None without one)
    layer_bytes: list[int] | None = None

    def lines(self) -> list[str]:
        """One line per fact."""
        cols = ", ".join(f"{k}={v}" for k, v in self.columns.items())
        out = [
            f"columns: {cols}",
            f"{counted(self.rows, 'row')} -> {counted(self.requests, 'request')}, "
            f"{counted(self.tokens, 'token')}",
        ]
        if self.layer_bytes is not None:
            sizes = sorted(set(self.layer_bytes))
            out.append(f"expert sizes per layer: {', '.join(map(str, sizes))} bytes")
        if self.steps_restarted:
            out.append(
                f"{self.steps_restarted} position restarts read as new steps"
                if "position" in self.columns
                else f"{self.steps_restarted} returns to an earlier layer read as new tokens "
                "(no position column)"
            )
            if "request" not in self.columns:
                out.append(
                    "no request column: every row is one request (--map request=COL names "
                    "the column of a log of several)"
                )
        if self.position_holes:
            out.append(
                f"{counted(self.position_holes, 'position')} within a step's range logged at "
                "no layer: no token there in the trace (the step's other tokens keep their order)"
            )
        if self.missing_pairs:
            out.append(
                f"{self.missing_pairs} (token, layer) pairs without rows: kept, routing "
                "nothing at that layer (layer_gaps)"
                + ("; null rows in tokens.parquet" if "weights" in self.columns else "")
            )
        return out


class TableError(FmoesimError):
    """A route table breaks a rule: file, row (1-based, as a reader counts data rows; a
    JSON-lines file's line number, with ``unit="line"``; a JSON array's record number,
    with ``unit="record"``) and rule."""

    def __init__(
        self, path: Path, row: int | None, rule: str, detail: str = "", unit: str = "row"
    ) -> None:
        where = f" {unit} {row}" if row is not None else ""
        super().__init__(f"{path}{where}: {rule}" + (f" ({detail})" if detail else ""))


@dataclass
class _Origin:
    """Where each row of a read table comes from: its file and its number there (a data
    row, 1-based, or a JSON-lines file's line)."""

    files: list[Path]
    units: list[str]  # per file: "row", "line" or "record"
    file: np.ndarray  # (rows,) index into files
    number: np.ndarray  # (rows,) row or line number in that file

    def where(self, i: int, near: int) -> str:
        """Row ``i`` as row ``near``'s error names it: its number, and its file when
        that is another."""
        f = int(self.file[i])
        other = f" of {self.files[f]}" if f != int(self.file[near]) else ""
        return f"{self.units[f]} {int(self.number[i])}{other}"

    def error(self, i: int, rule: str, detail: str = "") -> TableError:
        """The error of row ``i`` (0-based over the whole table)."""
        f = int(self.file[i])
        return TableError(self.files[f], int(self.number[i]), rule, detail, self.units[f])


def _json_kind(v: Any) -> str:
    """What a parsed JSON value is, in JSON's words."""
    if isinstance(v, list):
        return "an array"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, bool):
        return "true/false"
    return "null" if v is None else "a number"


def _read_jsonl(path: Path) -> tuple[Any, np.ndarray]:
    """A JSON-lines file as a DataFrame (one row per non-blank line) and each row's line."""
    import pandas as pd

    records: list[dict[str, Any]] = []
    lines: list[int] = []
    rule = "each line is a JSON object"
    with path.open("rb") as f:
        for n, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw.rstrip())
            except json.JSONDecodeError as exc:
                at = "" if exc.msg.endswith(" at") else " at"  # "...string starting at"
                detail = f"{exc.msg}{at} column {exc.colno}"
                raise TableError(path, n, rule, detail, "line") from None
            except (ValueError, RecursionError) as exc:  # not UTF-8 text, nested too deep
                raise TableError(path, n, rule, str(exc).splitlines()[0], "line") from None
            if not isinstance(rec, dict):
                raise TableError(path, n, rule, f"got {_json_kind(rec)}", "line")
            records.append(rec)
            lines.append(n)
    return pd.DataFrame.from_records(records), np.array(lines, dtype=np.int64)


def _starts_array(path: Path) -> bool:
    """Whether the file's first character that is not white space is ``[``."""
    with path.open("rb") as f:
        while chunk := f.read(4096):
            text = chunk.lstrip()
            if text:
                return text[:1] == b"["
    return False


def _read_json_array(path: Path) -> tuple[Any, np.ndarray]:
    """A ``.json`` file of one array of objects as a DataFrame (one row per object) and
    each row's record number (1-based)."""
    import pandas as pd

    try:
        data = json.loads(path.read_bytes())
    except json.JSONDecodeError as exc:
        detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}"
        raise TableError(path, None, "a .json table is JSON", detail) from None
    except (ValueError, RecursionError) as exc:  # not UTF-8 text, nested too deep
        raise TableError(path, None, "a .json table is JSON", str(exc).splitlines()[0]) from None
    rule = "a .json table is an array of JSON objects (or JSON lines)"
    for n, rec in enumerate(data, start=1):
        if not isinstance(rec, dict):
            raise TableError(path, n, rule, f"got {_json_kind(rec)}", "record")
    return pd.DataFrame.from_records(data), np.arange(1, len(data) + 1, dtype=np.int64)


def _read_file(path: Path) -> tuple[Any, str, np.ndarray]:
    """One table file: the DataFrame, how its rows are counted (``row``, ``line`` or
    ``record``) and each row's number.  A file without data rows is refused."""
    import pandas as pd

    kind = SUFFIXES.get(path.suffix.lower())
    if kind is None:
        raise TableError(path, None, f"a route table ends in one of {sorted(SUFFIXES)}")
    empty = TableError(path, None, "a route table has at least one row", "the file has none")
    if kind == "jsonl" and path.suffix.lower() == ".json" and _starts_array(path):
        df, records = _read_json_array(path)
        if not len(df):
            raise empty
        return df, "record", records
    if kind == "jsonl":
        df, lines = _read_jsonl(path)
        if not len(df):
            raise empty
        return df, "line", lines
    try:
        if kind in ("csv", "tsv"):
            df = pd.read_csv(path, sep="\t" if kind == "tsv" else ",", comment="#")
        else:
            df = pd.read_parquet(path)
    except pd.errors.EmptyDataError:
        raise empty from None
    except (ValueError, OSError) as exc:  # pandas' parse errors are ValueErrors
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TableError(path, None, f"readable as {kind}", msg) from None
    if not len(df):
        raise empty
    return df, "row", np.arange(1, len(df) + 1, dtype=np.int64)


def _read(path: Path) -> tuple[Any, _Origin]:
    """The table as a pandas DataFrame and where each row comes from; a directory's
    tables (every file with a known suffix, in name order) one after the other, with
    their file names as a ``dataset`` column where they have none."""
    import pandas as pd

    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.suffix.lower() in SUFFIXES and p.is_file())
        if not files:
            raise FmoesimError(f"{path}: no route tables ({', '.join(SUFFIXES)}) in this directory")
    elif path.is_file():
        files = [path]
    else:
        raise FmoesimError(f"{path}: no such file or directory")
    parts, units, file_of, numbers = [], [], [], []
    for i, f in enumerate(files):
        df, unit, num = _read_file(f)
        if path.is_dir() and "dataset" not in df.columns:
            df["dataset"] = f.stem
        parts.append(df)
        units.append(unit)
        file_of.append(np.full(len(df), i, dtype=np.int64))
        numbers.append(num)
    df = parts[0] if len(parts) == 1 else pd.concat(parts, ignore_index=True)
    return df, _Origin(files, units, np.concatenate(file_of), np.concatenate(numbers))


#: a comment giving a layer's expert size: ``# ... layer=N ... expert_bytes=B ...``
_SIZE_LAYER, _SIZE_BYTES = re.compile(r"\blayer=(\S*)"), re.compile(r"\bexpert_bytes=(\S*)")


#: a llama.cpp-style header's shape keys, each with what it is of the model
_HEADER_SHAPE = {"n_layer": "layers", "n_expert": "experts", "n_expert_used": "top_k"}
_HEADER_KEY = re.compile(r"\b(n_layer|n_expert|n_expert_used)=(\S*)")


def _header_sizes(
    path: Path, num_layers: int, out: dict[int, int], shape: dict[str, set[int]] | None = None
) -> None:
    """Add layer -> expert bytes from ``# ... layer=N ... expert_bytes=B`` comment lines
    of a CSV/TSV file to ``out``, refusing a comment whose size is not a positive
    integer, whose layer is not in ``[0, num_layers)``, or that gives a layer a second
    size; and refusing a header whose ``n_layer``, ``n_expert`` or ``n_expert_used``
    (llama.cpp's names) is not one of ``shape``'s ``layers``, ``experts`` or ``top_k``
    (the layers with or without the dense blocks): the log of another model than
    ``--model``."""
    if SUFFIXES.get(path.suffix.lower()) not in ("csv", "tsv"):
        return
    with path.open(errors="replace") as f:
        for n, line in enumerate(f, start=1):
            if not line.startswith("#"):
                continue
            for key, got in _HEADER_KEY.findall(line) if shape else ():
                want = shape[_HEADER_SHAPE[key]]  # type: ignore[index]
                if got not in {str(w) for w in want}:
                    shown = " or ".join(str(w) for w in sorted(want))
                    raise TableError(
                        path, n, f"the header's {key} is the model's {_HEADER_SHAPE[key]}, "
                        f"{shown} (the log of another model? --model, --top-k)",
                        f"got {got!r}", "line",
                    )  # fmt: skip
            bm = _SIZE_BYTES.search(line)
            if bm is None:
                continue
            lm = _SIZE_LAYER.search(line)
            if lm is None:
                raise TableError(path, n, "a comment with expert_bytes=B has layer=N", "", "line")
            b, layer = bm.group(1), lm.group(1)
            if not b.isdigit() or int(b) <= 0:
                raise TableError(
                    path, n, "expert_bytes in a comment is a positive integer", f"got {b!r}",
                    "line",
                )  # fmt: skip
            if not layer.isdigit() or int(layer) >= num_layers:
                raise TableError(
                    path, n, f"layer in a comment is in [0, {num_layers})", f"got {layer!r}",
                    "line",
                )  # fmt: skip
            if out.setdefault(int(layer), int(b)) != int(b):
                raise TableError(
                    path, n, "one expert size per layer",
                    f"layer {layer}: {b} after {out[int(layer)]}", "line",
                )  # fmt: skip


def _columns(path: Path, names: Sequence[str], mapping: dict[str, str]) -> dict[str, str]:
    """Canonical key -> column name, from ``mapping`` then :data:`COLUMNS`; a column
    serves one key only, and a key mapped to :data:`NO_COLUMN` reads none."""
    unknown = sorted(set(mapping) - set(COLUMNS))
    if unknown:
        raise FmoesimError(f"--map: unknown key(s) {unknown}; valid: {sorted(COLUMNS)}")
    rule = "each key reads a column of its own"
    out: dict[str, str] = {}
    for key in COLUMNS:
        if key not in mapping or mapping[key] == NO_COLUMN:
            continue
        col = mapping[key]
        if col not in names:
            raise TableError(path, None, f"has column '{col}' (--map {key}=...)")
        other = next((k for k, c in out.items() if c == col), None)
        if other is not None:
            raise TableError(path, None, rule, f"--map {other}={col} and --map {key}={col}")
        out[key] = col
    mapped = {c: k for k, c in out.items()}
    for key, candidates in COLUMNS.items():
        if key in out or mapping.get(key) == NO_COLUMN:
            continue
        present = [c for c in candidates if c in names]
        free = [c for c in present if c not in mapped]
        if free:
            out[key] = free[0]
        elif present:
            c = present[0]
            raise TableError(
                path, None, rule,
                f"--map {mapped[c]}={c} takes the {key} column '{c}'; --map {key}=... "
                f"another column, or --map {key}={NO_COLUMN} for none",
            )  # fmt: skip
    for key in ("layer", "experts"):
        if key not in out:
            raise TableError(
                path,
                None,
                f"has {'an' if key[0] in 'aeiou' else 'a'} {key} column "
                f"({' / '.join(COLUMNS[key])}, or --map {key}=...)",
            )
    return {k: out[k] for k in COLUMNS if k in out}


def _missing(v: Any) -> bool:
    """An empty cell: None, NaN (pandas' empty CSV cell, JSON null) or blank text."""
    return v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and not v.strip())


def _as_list(v: Any) -> list[Any] | None:
    """A list-valued cell (a list, an array, or JSON text of a list), else None."""
    if isinstance(v, (list, tuple, np.ndarray)):
        return list(v)
    if isinstance(v, str) and v.strip().startswith("["):
        try:
            out = json.loads(v)
        except (ValueError, RecursionError):  # not JSON, or nested too deep
            return None
        return out if isinstance(out, list) else None
    return None


@dataclass
class _Request:
    name: str
    # token key (step, position) -> layer -> list of (rank, expert, weight)
    tokens: dict[tuple[int, int], dict[int, list[tuple[int, int, float | None]]]]
    prefill: set[tuple[int, int]]
    origin: _Origin  # where the table's rows come from
    # (token key, layer) -> the table row (0-based over the table) that first logged it
    rows: dict[tuple[tuple[int, int], int], int] = dataclasses.field(default_factory=dict)


def _phase(v: Any) -> str | None:
    """A phase cell as one of :data:`PREFILL` or :data:`DECODE`, else None."""
    if isinstance(v, (bool, np.bool_)):
        return None
    if isinstance(v, (int, np.integer)) or (
        isinstance(v, (float, np.floating)) and float(v).is_integer()
    ):
        s = str(int(v))
    elif isinstance(v, str):
        s = v.strip().lower()
    else:
        return None
    return s if s in PREFILL or s in DECODE else None


def read_table(
    src: str | os.PathLike[str],
    model: ModelSpec,
    mapping: dict[str, str] | None = None,
) -> tuple[list[_Request], ImportReport]:
    """Parse a route table into requests of tokens (module docstring), checking every
    row against ``model``: layer and expert ids in range, ``top_k`` distinct experts per
    token and layer (no more, none twice), a rank in ``[0, top_k)``, a known phase,
    weights finite numbers >= 0."""
    path = Path(src)
    df, origin = _read(path)
    cols = _columns(path, list(df.columns), dict(mapping or {}))
    rep = ImportReport(path=path, rows=len(df), columns=cols)
    L, E, K = model.num_layers, model.num_experts, model.top_k
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
    layer_size: dict[int, int] = {}
    for f in origin.files:
        shape = {"layers": {L, L + model.dense_layers}, "experts": {E}, "top_k": {K}}
        _header_sizes(f, L, layer_size, shape)
    wide = _as_list(get["experts"][0]) is not None
    topk_rule = (
        f"every token has {K} distinct experts at a layer it is logged at "
        "(--top-k for a run made with fewer)"
    )
    key_name = (
        "(position, layer)" if wide
        else "(position, layer, rank)" if ranks is not None
        else "(position, layer, expert)"
    )  # fmt: skip
    out: dict[str, _Request] = {}
    # the current step's keys -> (the row, its (rank, expert, weight) items)
    seen: dict[str, dict[tuple[int, ...], tuple[int, list[tuple[int, int, float | None]]]]] = {}
    first: dict[str, tuple[int, int]] = {}  # the current step's first (position, layer)
    step: dict[str, int] = {}
    last: dict[str, int] = {}  # the layer of the request's row before
    request_col = get.get("request")
    for i in range(n):
        if request_col is not None and _missing(request_col[i]):
            raise origin.error(i, f"{cols['request']} is given on every row", "it is empty")
        name = str(reqs[i])
        r = out.get(name)
        if r is None:
            r = out[name] = _Request(name, {}, set(), origin)
            seen[name], step[name] = {}, 0
        layer = _int(origin, i, "layer", get["layer"][i])
        if not 0 <= layer < L:
            raise origin.error(i, f"layer in [0, {L})", f"got {layer}")
        if size_col is not None:
            b = _int(origin, i, "expert_bytes", size_col[i])
            if b <= 0:
                raise origin.error(i, "expert_bytes > 0", f"layer {layer}: got {b}")
            if layer_size.setdefault(layer, b) != b:
                raise origin.error(
                    i, "one expert size per layer", f"layer {layer}: {b} after {layer_size[layer]}"
                )
        # without a position column every token is at 0: the restart rule steps per token
        p = _int(origin, i, "position", pos[i]) if pos is not None else 0
        if p < 0:
            raise origin.error(i, "position >= 0", f"got {p}")
        if wide:
            experts = _as_list(get["experts"][i])
            if experts is None:
                raise origin.error(i, "experts holds a list of expert ids")
            if len(experts) != K:  # the rule the row breaks first, not its weights'
                raise origin.error(i, topk_rule, f"layer {layer}: experts {experts}")
            ws = _as_list(weights[i]) if weights is not None else None
            if weights is not None and (ws is None or len(ws) != len(experts)):
                raise origin.error(i, "weights holds one number per expert")
            items = [
                (
                    j,
                    _int(origin, i, "experts", e),
                    None if ws is None else _number(origin, i, "weights", ws[j]),
                )
                for j, e in enumerate(experts)
            ]
            key: tuple[int, ...] = (p, layer)
        else:
            e = _int(origin, i, "expert", get["experts"][i])
            rank = _int(origin, i, "rank", ranks[i]) if ranks is not None else -1
            if ranks is not None and not 0 <= rank < K:
                raise origin.error(i, f"rank in [0, {K}) (top_k)", f"got {rank}")
            w = None if weights is None else _number(origin, i, "weights", weights[i])
            items = [(rank, e, w)]
            key = (p, layer, rank if ranks is not None else e)
        for _, e, w in items:
            if not 0 <= e < E:
                raise origin.error(i, f"expert ids in [0, {E})", f"got {e}")
            if w is not None and not (np.isfinite(w) and w >= 0):
                raise origin.error(i, "weights are finite numbers >= 0", f"got {w}")
        ph = _phase(phase[i]) if phase is not None else None
        if phase is not None and ph is None:
            raise origin.error(
                i, f"phase is a prefill value ({', '.join(sorted(PREFILL))}) or a decode value "
                f"({', '.join(sorted(DECODE))})",
                f"got {phase[i]!r}",
            )  # fmt: skip
        if key in seen[name]:  # the restart rule
            # a new step goes back to an earlier layer than the row before (a model of
            # one layer has only that one); a repeat at the same layer or later is a row
            # logged twice
            if layer >= last[name] and L > 1:
                raise origin.error(
                    i, f"a {key_name} read again starts the next step only below the "
                    f"layer of the request's row before ({last[name]}): a repeated row?",
                    f"request {r.name}, position {p}, layer {layer}: also "
                    f"{origin.where(seen[name][key][0], i)}",
                )  # fmt: skip
            # a new step starts where the step before started; a row elsewhere in the
            # step that repeats its experts and weights exactly was flushed twice
            if weights is not None and (p, layer) != first[name] and seen[name][key][1] == items:
                raise origin.error(
                    i, f"a {key_name} read again with the same experts and weights, away "
                    "from where the step began, is a row logged twice, not a new step",
                    f"request {r.name}, position {p}, layer {layer}: as "
                    f"{origin.where(seen[name][key][0], i)}",
                )  # fmt: skip
            step[name] += 1
            seen[name] = {}
            rep.steps_restarted += 1
        if not seen[name]:
            first[name] = (p, layer)
        seen[name].setdefault(key, (i, items))
        last[name] = layer
        tok = (step[name], p)
        lay = r.tokens.setdefault(tok, {}).setdefault(layer, [])
        r.rows.setdefault((tok, layer), i)
        lay.extend(items)
        es = [x[1] for x in lay]
        if len(es) > K or len(set(es)) != len(es) or (wide and len(es) != K):
            raise origin.error(
                i, topk_rule,
                f"request {r.name}, position {p}, layer {layer}: experts {sorted(es)}",
            )  # fmt: skip
        if ph in PREFILL:
            r.prefill.add(tok)
    rep.requests = len(out)
    rep.tokens = sum(len(r.tokens) for r in out.values())
    if pos is not None:  # a step's positions run without a gap unless a token was not logged
        for r in out.values():
            steps: dict[int, list[int]] = {}
            for st, q in r.tokens:
                steps.setdefault(st, []).append(q)
            rep.position_holes += sum(max(q) - min(q) + 1 - len(q) for q in steps.values())
    if size_col is not None or layer_size:
        if len(layer_size) != L or any(b <= 0 for b in layer_size.values()):
            missing = set(range(L)) - set(layer_size)
            bad = missing or {i for i, b in layer_size.items() if b <= 0}
            what = "none for layers" if missing else "sizes <= 0 for layers"
            raise TableError(path, None, "expert sizes for every layer", f"{what} {spans(bad)}")
        rep.layer_bytes = [layer_size[i] for i in range(L)]
    return list(out.values()), rep


def _int(origin: _Origin, i: int, what: str, v: Any) -> int:
    """An integer cell of row ``i`` (an integral float from a CSV with gaps counts)."""
    if _missing(v):  # an empty cell, or a JSON line without the key
        raise origin.error(i, f"{what} is given on every row", "it is missing or empty")
    if isinstance(v, (bool, np.bool_)):
        raise origin.error(i, f"{what} is an integer", f"got {v!r}")
    if isinstance(v, (int, np.integer)):
        return int(v)
    if isinstance(v, (float, np.floating)) and float(v).is_integer():
        return int(v)
    if isinstance(v, str) and v.strip().lstrip("-").isdigit():
        return int(v)
    raise origin.error(i, f"{what} is an integer", f"got {v!r}")


def _number(origin: _Origin, i: int, what: str, v: Any) -> float:
    """A number cell of row ``i`` (a number, or text of one)."""
    if isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, (bool, np.bool_)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            pass
    raise origin.error(i, f"{what} are finite numbers >= 0", f"got {v!r}")


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
    check_destination(dst, overwrite)
    check_prompt_tokens(prompt_tokens)
    if top_k is not None:
        if not 1 <= top_k <= model.top_k:
            raise FmoesimError(
                f"--top-k {top_k}: must be in [1, {model.top_k}] (rule: a run made with at "
                f"most the model's top_k, {model.top_k} for {model.name})"
            )
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
                if len(es) != K or len(set(es)) != K:  # fewer: more are refused by row
                    raise r.origin.error(
                        r.rows[(key, layer)],
                        f"every token has {K} distinct experts at a layer it is logged at "
                        "(--top-k for a run made with fewer)",
                        f"request {r.name}, token {t} (step {key[0]}, position {key[1]}), "
                        f"layer {layer}: {es}",
                    )
                ids[t, layer] = es
                wts[t, layer] = [0.0 if w is None else w for _, _, w in got]
        prefill = [t for t, key in enumerate(toks) if key in r.prefill]
        if r.prefill and prompt_tokens is None:
            late = [t for j, t in enumerate(prefill) if t != j]
            if late:
                key = toks[late[0]]
                raise r.origin.error(
                    min(i for (k, _), i in r.rows.items() if k == key),
                    "prefill tokens come before decode tokens",
                    f"request {r.name}: a prefill token after a decode token",
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
    with weights (``tokens.parquet``) when ``with_weights``, a null row where a layer was
    not logged.  ``datasets`` names each request's dataset (default: its name); ``extra``
    goes into ``source``.  Refuses a log whose last routed layer is below the model's last
    (the log of a model with fewer layers); a leading or inner layer no token routes at is
    kept (a block-indexed log's dense blocks).  Returns the (token, layer) pairs without
    routing."""
    L, E = model.num_layers, model.num_experts
    missing = sum(int((ids[:, :, 0] < 0).sum()) for _, ids, _, _ in arrays)
    routed = np.zeros(L, dtype=bool)  # (L,) layers some token routes at
    for _, ids, _, _ in arrays:
        routed |= (ids[:, :, 0] >= 0).any(axis=0)
    last = int(routed.nonzero()[0].max()) if routed.any() else -1
    if last < L - 1:  # leading or inner empty layers may be dense blocks of a block-indexed log
        where = ", ".join(original) or fmt
        raise FmoesimError(
            f"{where}: no token routes at layer(s) {spans(range(last + 1, L))} of "
            f"{model.name}'s {L}, the log's last being {last} (rule: the log reaches the "
            "model's last layer; a log of a model with fewer layers?)"
        )
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
    with TraceWriter(dst, man, overwrite=overwrite, check=True) as w:
        for rid, (name, ids, wts, p) in enumerate(arrays):
            T = len(ids)
            one_hot = np.zeros((T, L, E), dtype=np.int32)
            t_idx, l_idx, _ = np.nonzero(ids >= 0)
            np.add.at(one_hot, (t_idx, l_idx, ids[ids >= 0]), 1)
            ds = name if datasets is None else datasets[rid]
            w.add_request(rid, prompt_tokens=p, output_tokens=T - p + 1, dataset=ds)

            def tok(a: int, b: int) -> tuple[np.ndarray, np.ndarray] | None:
                return (ids[a:b], wts[a:b]) if with_weights else None  # noqa: B023

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
    a layer the logger missed; optional weights of the same shapes, finite and >= 0
    (written to ``tokens.parquet``, a null row where the layer is ``-1``); the prompt
    length of each request (its first tokens form the prefill iteration).
    ``top_k`` is the arrays' last dimension, at most the model's (a run made with fewer
    replaces the model's).  Bad arrays are refused before anything is written, naming
    the request, the token and layer, and the rule."""
    return _from_arrays(
        experts, dst, model, weights=weights, prompt_tokens=prompt_tokens, names=names,
        overwrite=overwrite, fmt=fmt, original=original,
        label=lambda i: f"from_arrays: request {i}",
    )  # fmt: skip


def _from_arrays(
    experts: np.ndarray | Sequence[np.ndarray],
    dst: str | os.PathLike[str],
    model: ModelSpec,
    *,
    weights: np.ndarray | Sequence[np.ndarray] | None,
    prompt_tokens: int | Sequence[int],
    names: Sequence[str] | None,
    overwrite: bool,
    fmt: str,
    original: Sequence[str],
    label: Any,
) -> Path:
    """:func:`from_arrays`, its errors naming request ``i`` as ``label(i)``."""
    check_destination(dst, overwrite)
    reqs = [experts] if isinstance(experts, np.ndarray) and np.ndim(experts) == 3 else experts
    reqs = [np.asarray(a) for a in reqs]
    if not reqs:
        raise FmoesimError("from_arrays: no requests")
    if weights is not None:
        ws = [weights] if isinstance(weights, np.ndarray) and np.ndim(weights) == 3 else weights
        ws = [np.asarray(a, dtype=np.float64) for a in ws]
    else:
        ws = [np.zeros(a.shape) for a in reqs]
    L, E = model.num_layers, model.num_experts
    K = reqs[0].shape[-1] if reqs[0].ndim == 3 else 0
    if K > model.top_k:
        raise FmoesimError(
            f"{label(0)}: experts per token (the arrays' last dimension) at most the model's "
            f"top_k = {model.top_k} ({model.name}; got {K})"
        )
    if K and K != model.top_k:
        model = dataclasses.replace(model, top_k=K)
    p_all = [prompt_tokens] * len(reqs) if isinstance(prompt_tokens, int) else list(prompt_tokens)
    if len(p_all) != len(reqs) or len(ws) != len(reqs):
        raise FmoesimError("from_arrays: one prompt length and one weight array per request")
    arrays = []
    for i, (a, w, p) in enumerate(zip(reqs, ws, p_all, strict=True)):
        what = label(i)
        want = f"(tokens, {L}, {K or 'top_k'})"
        if (
            a.ndim != 3
            or a.shape[1] != L
            or a.shape[2] != (K or -1)
            or not np.issubdtype(a.dtype, np.integer)
        ):
            raise FmoesimError(f"{what}: experts is an integer array {want} (got {a.dtype} "
                               f"{a.shape})")  # fmt: skip
        if len(a) == 0:
            raise FmoesimError(f"{what}: a request has at least one token (got shape {a.shape})")
        if w.shape != a.shape:
            raise FmoesimError(
                f"{what}: weights have the shape of the experts {a.shape} (got {w.shape})"
            )
        gap = a < 0
        bad = ((a < -1) | (a >= E)).any(axis=2) | (gap.any(axis=2) != gap.all(axis=2))
        if bad.any():
            t, layer = np.argwhere(bad)[0]
            raise FmoesimError(
                f"{what}, token {t}, layer {layer}: expert ids in [0, {E}), or -1 for a whole "
                f"layer (got {a[t, layer].tolist()})"
            )
        ok = ~gap[:, :, 0]
        srt = np.sort(a, axis=2)
        bad = ok & (np.diff(srt, axis=2) == 0).any(axis=2)
        if bad.any():
            t, layer = np.argwhere(bad)[0]
            raise FmoesimError(
                f"{what}, token {t}, layer {layer}: a token's experts at a layer are distinct "
                f"(got {a[t, layer].tolist()})"
            )
        bad = ok & ~(np.isfinite(w) & (w >= 0)).all(axis=2)
        if bad.any():
            t, layer = np.argwhere(bad)[0]
            raise FmoesimError(
                f"{what}, token {t}, layer {layer}: weights are finite and >= 0 "
                f"(got {w[t, layer].tolist()})"
            )
        if isinstance(p, (bool, np.bool_)) or not 1 <= int(p) <= len(a):
            raise FmoesimError(f"{what}: prompt_tokens in [1, {len(a)}] (its tokens), got {p}")
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
    array ``(tokens, layers, top_k)``, ``top_k`` at most the model's.  ``.npy``: one
    request; ``.npz``: one request per array, in the order the file stores them (the
    order ``np.savez`` was given them; an array ``prompt_tokens`` of lengths, when
    present, is read instead of being a request); ``.json``: an object
    ``{"routed_experts": [...], "prompt_tokens": n}`` or a list of them, each with
    ``prompt_tokens`` or none.  Expert ids and prompt lengths are integers (a float, a
    string or a boolean is refused).  ``prompt_tokens`` given here overrides what the
    file stores (default 1).  Errors name
    the file, the request (the ``.npz`` array's key, the ``.json`` list's index), the
    token and layer, and the rule."""
    path = Path(src)
    if path.is_dir():
        raise FmoesimError(f"{path}: a .npy, .npz or .json file, not a directory")
    if not path.is_file():
        raise FmoesimError(f"{path}: no such file")
    check_prompt_tokens(prompt_tokens)
    stored: list[int] | None = None
    keys: list[str] | None = None
    try:
        if path.suffix == ".npy":
            reqs = [np.load(path, allow_pickle=False)]
        elif path.suffix == ".npz":
            with np.load(path, allow_pickle=False) as z:
                keys = [k for k in z.files if k != "prompt_tokens"]
                reqs = [z[k] for k in keys]
                if "prompt_tokens" in z.files:
                    lengths = np.atleast_1d(z["prompt_tokens"])
                    if lengths.dtype.kind not in "iu":
                        raise TableError(
                            path, None, "prompt_tokens holds integers", f"got {lengths.dtype}"
                        )
                    stored = [int(x) for x in lengths]
        elif path.suffix == ".json":
            raw = json.loads(path.read_text())
            items = raw if isinstance(raw, list) else [raw]
            if not all(isinstance(x, dict) and "routed_experts" in x for x in items):
                raise TableError(path, None, "each request is an object with 'routed_experts'")
            reqs = []
            for i, x in enumerate(items):
                a = np.asarray(x["routed_experts"])
                if a.dtype.kind not in "iu":  # floats, strings, booleans, ints beyond 64 bits
                    raise TableError(
                        path, None, "routed_experts holds integer expert ids",
                        f"request {i}: got values of type {a.dtype}",
                    )  # fmt: skip
                reqs.append(a)
            given = ["prompt_tokens" in x for x in items]
            if any(given) and not all(given):
                raise TableError(
                    path, None, "every request gives prompt_tokens, or none does",
                    f"request {given.index(False)} has none",
                )  # fmt: skip
            if all(given):
                for i, x in enumerate(items):
                    if not is_json_int(x["prompt_tokens"]):
                        raise TableError(
                            path, None, "prompt_tokens is an integer",
                            f"request {i}: got {x['prompt_tokens']!r}",
                        )  # fmt: skip
                stored = [x["prompt_tokens"] for x in items]
        else:
            raise TableError(path, None, "routed experts are in a .npy, .npz or .json file")
    except (
        ValueError,
        TypeError,
        OSError,
        OverflowError,
        RecursionError,
        BadZipFile,
        EOFError,
    ) as exc:
        said = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise TableError(path, None, "readable", said) from None
    if not reqs:
        raise TableError(path, None, "at least one request (array)")
    if stored is not None and len(stored) != len(reqs):
        raise TableError(
            path, None, "one prompt length per request",
            f"{len(stored)} prompt_tokens for {len(reqs)} requests",
        )  # fmt: skip
    p: int | list[int]
    p = prompt_tokens if prompt_tokens is not None else (stored if stored is not None else 1)

    def label(i: int) -> str:
        if keys is not None:
            return f"{path} array '{keys[i]}'"
        return str(path) if path.suffix == ".npy" else f"{path} request {i}"

    return _from_arrays(
        reqs, dst, model, weights=None, prompt_tokens=p, names=None, overwrite=overwrite,
        fmt="vllm-routed-experts", original=[path.name], label=label,
    )  # fmt: skip
