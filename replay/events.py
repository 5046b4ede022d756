"""Event logs of a run, replayed or simulated, and their comparison step by step.

A run's aggregate numbers (TPOT, hit rate, PCIe bytes) say *that* the simulator and the
replay differ; its event log says *where*. An event log holds three tables:

- the layer steps: each MoE layer step's ``layer``, ``tokens`` and ``gate_s``, the clock
  once its gate is known (after attention and the router: in the replay the host's clock
  right after it synchronised with the router, in the simulator the modelled clock), and
  three running totals read at the same moment (NaN where a run does not keep one):
  ``gpu_busy_s``, the GPU's compute so far; ``policy_s``, the host's seconds inside the
  policy's hooks so far (the replay times them); ``host_s``, the host seconds the
  simulator's host model has charged so far;
- the expert accesses: each access's ``step`` (an index into the steps), ``key`` and
  ``outcome`` (HIT 0, LATE 1, MISS 2), as the policy is told them (``on_access``);
- the transfers: the backend's transfer log (:class:`fmoesim.engine.backend.TransferRecord`:
  reason, priority, submission, release, start and end times, and whether it was used,
  escalated, paused, cancelled or aborted).

:class:`EventRecorder` records the first two by wrapping the backend's ``pre_gate`` and the
policy's ``on_access`` from outside, as the replay's host timers do: the run itself is
unchanged, and the replay reads one more host clock per layer step. (The runner's own
access log is no substitute in a replay: it reads the backend's clock at every access,
which there waits for the GPU.)

``fmoesim-validate-grid replay --event-logs`` writes one log per run (its first repeat)
to ``<out>/events/`` (:func:`log_name`); ``fmoesim-validate-grid events`` simulates the
same runs with the same recorder and compares the two (:func:`summarize`,
:func:`compare`): the time of a layer step, the link's traffic per step by reason and by
fate (started before the next gate, started later, cancelled), the queue waits, and, for
runs whose layer steps line up (the same layers and token counts in the same order, as
static batching gives), the step-by-step time difference and how often an access found
the same thing in both.
"""

from __future__ import annotations

import io
import json
import math
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from zipfile import BadZipFile

import numpy as np

from fmoesim.errors import FmoesimError, one_line
from fmoesim.validation import numbers

#: the format of an event log file (``meta["format"]``)
FORMAT = 1
#: transfer reasons, by the code an event log stores
REASONS = ("on_demand", "prefetch", "configure")
#: what an access found, by code (:class:`policies.base.Outcome`)
OUTCOMES = ("hit", "late", "miss")
#: the arrays of an event log file, each with its dtype
COLUMNS = {
    "step_layer": np.int32,
    "step_tokens": np.int32,
    "step_gate_s": np.float64,
    "step_gpu_busy_s": np.float64,
    "step_policy_s": np.float64,
    "step_host_s": np.float64,
    "access_step": np.int32,
    "access_key": np.int64,
    "access_outcome": np.int8,
    "xfer_key": np.int64,
    "xfer_reason": np.int8,
    "xfer_size_bytes": np.int64,
    "xfer_priority": np.float64,
    "xfer_submit_s": np.float64,
    "xfer_release_s": np.float64,
    "xfer_start_s": np.float64,
    "xfer_end_s": np.float64,
    "xfer_used": np.bool_,
    "xfer_escalated": np.bool_,
    "xfer_preemptions": np.int32,
    "xfer_cancelled": np.bool_,
    "xfer_aborted": np.bool_,
}


#: the running totals a layer step records (``step_<name>``)
TOTALS = ("gpu_busy_s", "policy_s", "host_s")


class EventRecorder:
    """Records a run's layer steps and expert accesses from outside: :meth:`wrap_policy`
    before the run, :meth:`wrap_backend` on its backend (a ``make_backend`` of
    :func:`fmoesim.engine.simulate.simulate`), :meth:`arrays` after it."""

    def __init__(self) -> None:
        self.layers: list[int] = []
        self.tokens: list[int] = []
        self.gates_s: list[float] = []
        self.totals: dict[str, list[float]] = {name: [] for name in TOTALS}
        self.acc_step: list[int] = []
        self.acc_key: list[int] = []
        self.acc_outcome: list[int] = []
        self.backend: Any = None

    def wrap_policy(self, policy: Any) -> None:
        """Shadow ``policy.on_access`` so each access is logged with the current step."""
        fn = policy.on_access
        step, key, outcome, layers = self.acc_step, self.acc_key, self.acc_outcome, self.layers

        def on_access(k: int, out: Any) -> None:
            step.append(len(layers) - 1)
            key.append(k)
            outcome.append(int(out))
            fn(k, out)

        policy.on_access = on_access

    def wrap_backend(
        self,
        backend: Any,
        clock: Callable[[], float] | None = None,
        totals: dict[str, Callable[[], float]] | None = None,
    ) -> Any:
        """Shadow ``backend.pre_gate`` so each layer step is logged once its gate is
        known: ``clock()`` (None: ``backend.now()``) and each of ``totals`` (by a name
        of :data:`TOTALS`; the others are NaN) after ``pre_gate`` returns.  Returns
        ``backend``."""
        fn = backend.pre_gate
        read = backend.now if clock is None else clock
        layers, tokens, gates = self.layers, self.tokens, self.gates_s
        given = totals or {}
        unknown = set(given) - set(TOTALS)
        if unknown:
            raise ValueError(f"totals {sorted(unknown)}: not in {TOTALS}")
        nan: Callable[[], float] = lambda: math.nan  # noqa: E731
        reads = [(self.totals[name], given.get(name, nan)) for name in TOTALS]

        def pre_gate(layer: int, n: int, kv_tokens: int, pairs: int) -> None:
            fn(layer, n, kv_tokens, pairs)
            layers.append(layer)
            tokens.append(n)
            gates.append(read())
            for cells, total in reads:
                cells.append(total())

        backend.pre_gate = pre_gate
        self.backend = backend
        return backend

    def arrays(self, transfers: Sequence[Any] | None = None) -> dict[str, np.ndarray]:
        """The log as the arrays of :data:`COLUMNS` (``transfers``: the backend's log,
        by default that of the wrapped backend)."""
        if transfers is None:
            transfers = self.backend.transfers if self.backend is not None else []
        out = {
            "step_layer": self.layers,
            "step_tokens": self.tokens,
            "step_gate_s": self.gates_s,
            **{f"step_{name}": cells for name, cells in self.totals.items()},
            "access_step": self.acc_step,
            "access_key": self.acc_key,
            "access_outcome": self.acc_outcome,
            **transfer_columns(transfers),
        }
        return {k: np.asarray(out[k], dtype=dt) for k, dt in COLUMNS.items()}


def transfer_columns(transfers: Sequence[Any]) -> dict[str, np.ndarray]:
    """The ``xfer_*`` columns of a transfer log
    (:func:`fmoesim.engine.simulate.transfer_table`, its reasons as codes of
    :data:`REASONS`; a reason it does not know is refused)."""
    from fmoesim.engine.simulate import transfer_table

    table = transfer_table(list(transfers))
    code = {r: i for i, r in enumerate(REASONS)}
    bad = next((r for r in table["reason"].tolist() if r not in code), None)
    if bad is not None:
        raise ValueError(f"transfer reason {bad!r} not in {REASONS}")
    table["reason"] = np.array([code[r] for r in table["reason"].tolist()], dtype=np.int8)
    return {k: table[k.removeprefix("xfer_")] for k in COLUMNS if k.startswith("xfer_")}


def log_name(key: Sequence[str], repeat: int = 0) -> str:
    """The file name of a run's event log: its replay.csv key (model, budget, mode,
    policy, compute factor) and repeat."""
    model, budget, mode, policy, factor = key  # replay.campaign.KEY's order
    return f"{model}_{budget}GB_{mode}_x{factor}_{policy}_r{repeat}.npz"


def save_log(path: Path, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> Path:
    """Write an event log (compressed; atomically: a reader never sees half a file)."""
    from fmoesim.atomic import atomic_file

    meta = {"format": FORMAT, **meta}
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez_compressed(f, meta=np.asarray(json.dumps(meta)), **arrays)  # type: ignore[arg-type]
    return path


class EventLog:
    """One run's event log: ``arrays`` (:data:`COLUMNS`) and ``meta`` (its source)."""

    def __init__(self, arrays: dict[str, np.ndarray], meta: dict[str, Any], name: str) -> None:
        self.a = arrays
        self.meta = meta
        self.name = name

    @classmethod
    def read(cls, data: bytes | Path, name: str) -> EventLog:
        """Read a log written by :func:`save_log` (``name`` names it in errors)."""
        try:
            with np.load(io.BytesIO(data) if isinstance(data, bytes) else data) as z:
                files = set(z.files)
                missing = next((k for k in ("meta", *COLUMNS) if k not in files), None)
                if missing is not None:
                    raise FmoesimError(
                        f"{name}: no array {missing!r} (rule: an event log of "
                        "fmoesim-validate-grid replay --event-logs)"
                    )
                meta = json.loads(str(z["meta"]))
                arrays = {k: z[k] for k in COLUMNS}
        except (OSError, ValueError, EOFError, BadZipFile) as exc:  # not an .npz, or cut
            raise FmoesimError(f"{name}: not an event log ({one_line(exc)})") from None
        if not isinstance(meta, dict):
            raise FmoesimError(f"{name}: meta is {type(meta).__name__} (rule: a JSON object)")
        for k, want in COLUMNS.items():
            got = arrays[k]
            kind = np.dtype(want).kind
            ok = got.dtype.kind in ("iu" if kind in "iu" else kind)
            if got.ndim != 1 or not ok:
                raise FmoesimError(
                    f"{name}: {k} is a {got.ndim}-D array of {got.dtype} (rule: a 1-D array "
                    f"of {np.dtype(want).name})"
                )
        if meta.get("format") != FORMAT:
            got = meta.get("format")
            raise FmoesimError(f"{name}: event-log format {got}, this version reads {FORMAT}")
        log = cls(arrays, meta, name)
        log.check()
        return log

    def check(self) -> None:
        """Refuse a log whose tables are inconsistent (one line: the file, the array,
        the row and the rule)."""
        a = self.a
        for table in ("step_", "access_", "xfer_"):
            cols = [k for k in COLUMNS if k.startswith(table)]
            n = len(a[cols[0]])
            bad = next((k for k in cols if len(a[k]) != n), None)
            if bad is not None:
                raise FmoesimError(
                    f"{self.name}: {bad} has {len(a[bad])} rows, {cols[0]} {n} "
                    "(rule: the columns of a table are equally long)"
                )
        steps = len(a["step_layer"])
        if not steps:
            raise FmoesimError(f"{self.name}: no layer step (rule: a run's log has one or more)")
        rows = np.flatnonzero(~(np.isfinite(a["step_gate_s"]) & (a["step_gate_s"] >= 0)))
        if len(rows):
            raise FmoesimError(
                f"{self.name}: step_gate_s row {rows[0]} is {a['step_gate_s'][rows[0]]} (rule: "
                "a time in seconds, finite and >= 0)"
            )
        for k in ("xfer_submit_s", "xfer_release_s", "xfer_start_s", "xfer_end_s"):
            rows = np.flatnonzero(a[k] < 0)  # NaN: a transfer that never started or ended
            if len(rows):
                raise FmoesimError(
                    f"{self.name}: {k} row {rows[0]} is {a[k][rows[0]]} (rule: a time in "
                    "seconds, >= 0, or NaN where the transfer has none)"
                )
        out = np.flatnonzero((a["access_step"] < 0) | (a["access_step"] >= steps))
        if len(out):
            raise FmoesimError(
                f"{self.name}: access_step row {out[0]} is {a['access_step'][out[0]]} "
                f"(rule: an index into the {steps} layer steps)"
            )
        back = np.flatnonzero(np.diff(a["step_gate_s"]) < 0)
        if len(back):
            raise FmoesimError(
                f"{self.name}: step_gate_s row {back[0] + 1} is earlier than row {back[0]} "
                "(rule: the layer steps' gates in time order)"
            )


def open_logs(source: Path) -> dict[str, EventLog]:
    """Every event log of a directory or a tar file of one (``events/`` as the replay
    writes it, or ``events.tar`` as ``replay/gpu_validation.sh`` bundles it), by file
    name."""
    logs: dict[str, EventLog] = {}
    if not source.exists():
        raise FmoesimError(f"--logs {source}: no such file or directory")
    if source.is_dir():
        for p in sorted(source.glob("*.npz")):
            logs[p.name] = EventLog.read(p, str(p))
    elif tarfile.is_tarfile(source):
        try:
            with tarfile.open(source) as tar:
                for m in tar.getmembers():
                    if m.isfile() and m.name.endswith(".npz"):
                        f = tar.extractfile(m)
                        assert f is not None
                        name = Path(m.name).name
                        logs[name] = EventLog.read(f.read(), f"{source}:{m.name}")
        except (tarfile.TarError, EOFError, OSError) as exc:  # a tar file cut short
            raise FmoesimError(f"--logs {source}: not a whole tar file ({one_line(exc)})") from None
    else:
        raise FmoesimError(f"--logs {source}: neither a directory nor a tar file of event logs")
    if not logs:
        raise FmoesimError(f"--logs {source}: holds no event log (*.npz)")
    return logs


# -- what a log says --------------------------------------------------------------------
def step_seconds(log: EventLog) -> np.ndarray:
    """Each layer step's seconds, from its gate to the next step's (NaN for the last)."""
    g = log.a["step_gate_s"]
    out = np.full(len(g), np.nan)
    out[:-1] = np.diff(g)
    return out


def submit_steps(log: EventLog) -> np.ndarray:
    """The layer step each transfer was submitted in: the last step whose gate is at or
    before its submission (-1 before the first gate)."""
    return np.searchsorted(log.a["step_gate_s"], log.a["xfer_submit_s"], side="right") - 1


def _mean(x: np.ndarray) -> float:
    x = x[~np.isnan(x)]
    return float(x.mean()) if len(x) else math.nan


def summarize(log: EventLog) -> dict[str, float]:
    """What one log says, per layer step where it is a count:

    - ``steps``, ``multi_steps`` (steps of more than one token: at batch 1, the
      prefill's), ``step_ms_multi`` and ``step_ms_one`` (mean gate-to-gate time),
      ``step_ms_first`` (of the first forward pass's layer steps: at batch 1 the first
      request's prefill, which runs cold in the replay) and ``step_ms_multi_later`` (of
      the steps of more than one token after that pass), and the same means of each
      running total's growth from gate to gate (``gpu_ms_*``, ``policy_ms_*``,
      ``host_ms_*``; NaN where the log has none);
    - ``hit``, ``late``, ``miss``: shares of the accesses;
    - per reason (``prefetch_``, ``on_demand_``): ``submitted`` per step, and the shares
      ``cancelled``, ``started_in_step`` (started before the gate after its
      submission's), ``started_later``, ``aborted`` and ``used``; ``wait_ms``, the mean
      queue wait of those started (from submission, or release, to start), and
      ``wait_ms_multi`` and ``wait_ms_one`` for those submitted in steps of more than
      one token and of one; ``copy_ms``, the mean copy of those moved whole without a
      pause;
    - ``moved`` and ``cancelled``: transfers a step, all reasons; ``cancelled_multi``,
      the share of the cancelled ones submitted in steps of more than one token;
    - ``link_busy``: the share of the run's span (first gate to last copy's end or last
      gate) in which the link moved a copy;
    - ``step_ms_one_idle``, the mean one-token layer step in which no copy started, and
      ``step_ms_one_per_copy``, how much a one-token step grows with each copy started
      in it (the least-squares slope of its time on that count; NaN where the count never
      varies): a step's fixed cost and a copy's, as the host model splits them.
    """
    a = log.a
    steps = len(a["step_layer"])
    sec = step_seconds(log)
    multi = a["step_tokens"] > 1
    wrap = np.flatnonzero(np.diff(a["step_layer"]) <= 0)  # where the layers start over
    first = np.arange(steps) < (int(wrap[0]) + 1 if len(wrap) else steps)  # (S,)
    out: dict[str, float] = {
        "steps": float(steps),
        "multi_steps": float(multi.sum()),
        "step_ms_multi": 1e3 * _mean(sec[multi]),
        "step_ms_one": 1e3 * _mean(sec[~multi]),
        "step_ms_first": 1e3 * _mean(sec[first]),
        "step_ms_multi_later": 1e3 * _mean(sec[multi & ~first]),
    }
    for name in TOTALS:
        grew = np.full(steps, np.nan)  # (S,) the total's growth to the next gate
        grew[:-1] = np.diff(a[f"step_{name}"])
        short = name.removesuffix("_s").removesuffix("_busy")
        out[f"{short}_ms_multi"] = 1e3 * _mean(grew[multi])
        out[f"{short}_ms_one"] = 1e3 * _mean(grew[~multi])
    n_acc = len(a["access_outcome"])
    for code, name in enumerate(OUTCOMES):
        out[name] = float((a["access_outcome"] == code).sum() / n_acc) if n_acc else math.nan
    gates = a["step_gate_s"]
    sub = submit_steps(log)
    next_gate = np.full(len(sub), np.inf)
    has_next = (sub + 1 < steps) & (sub + 1 >= 0)
    next_gate[has_next] = gates[sub[has_next] + 1]
    start, cancelled = a["xfer_start_s"], a["xfer_cancelled"]
    started = ~cancelled & ~np.isnan(start)
    in_multi = np.zeros(len(sub), dtype=bool)  # (T,) submitted in a multi-token step
    ok = sub >= 0
    in_multi[ok] = multi[sub[ok]]
    for code, reason in enumerate(REASONS[:2]):
        mine = a["xfer_reason"] == code
        n = int(mine.sum())
        out[f"{reason}_submitted"] = n / steps if steps else math.nan
        if not n:
            for k in ("cancelled", "started_in_step", "started_later", "aborted", "used",
                      "wait_ms", "wait_ms_multi", "wait_ms_one", "copy_ms"):  # fmt: skip
                out[f"{reason}_{k}"] = math.nan
            continue
        s = mine & started
        in_step = s & (start < next_gate)
        out[f"{reason}_cancelled"] = float((mine & cancelled).sum() / n)
        out[f"{reason}_started_in_step"] = float(in_step.sum() / n)
        out[f"{reason}_started_later"] = float((s & ~in_step).sum() / n)
        out[f"{reason}_aborted"] = float((mine & a["xfer_aborted"]).sum() / n)
        out[f"{reason}_used"] = float((mine & a["xfer_used"]).sum() / n)
        ready = np.maximum(a["xfer_submit_s"], a["xfer_release_s"])
        wait = start - ready  # (T,)
        out[f"{reason}_wait_ms"] = 1e3 * _mean(wait[s])
        out[f"{reason}_wait_ms_multi"] = 1e3 * _mean(wait[s & in_multi])
        out[f"{reason}_wait_ms_one"] = 1e3 * _mean(wait[s & ~in_multi])
        whole = s & ~a["xfer_aborted"] & (a["xfer_preemptions"] == 0)
        out[f"{reason}_copy_ms"] = 1e3 * _mean((a["xfer_end_s"] - start)[whole])
    out["moved"] = float(started.sum() / steps) if steps else math.nan
    out["cancelled"] = float(cancelled.sum() / steps) if steps else math.nan
    n_cancelled = int(cancelled.sum())
    out["cancelled_multi"] = (
        float((cancelled & in_multi).sum() / n_cancelled) if n_cancelled else math.nan
    )
    one = ~multi & ~np.isnan(sec)  # (S,) one-token steps with an end
    in_step = np.searchsorted(gates, start[started], side="right") - 1  # step of each start
    copies = np.bincount(in_step[in_step >= 0], minlength=steps)[:steps]  # (S,)
    out["step_ms_one_idle"] = 1e3 * _mean(sec[one & (copies == 0)])
    x, y = copies[one].astype(float), sec[one]
    out["step_ms_one_per_copy"] = (
        1e3 * float(np.polyfit(x, y, 1)[0]) if len(np.unique(x)) > 1 else math.nan
    )
    moved = started & ~np.isnan(a["xfer_end_s"])
    busy = float((a["xfer_end_s"] - start)[moved].sum())
    if steps:
        end = max(float(gates[-1]), float(a["xfer_end_s"][moved].max()) if moved.any() else 0.0)
        span = end - float(gates[0])
        out["link_busy"] = busy / span if span > 0 else math.nan
    else:
        out["link_busy"] = math.nan
    return out


def aligned(replay: EventLog, sim: EventLog) -> bool:
    """Whether two logs' layer steps line up: the same layers with the same token counts
    in the same order."""
    a, b = replay.a, sim.a
    return bool(
        np.array_equal(a["step_layer"], b["step_layer"])
        and np.array_equal(a["step_tokens"], b["step_tokens"])
    )


def compare(replay: EventLog, sim: EventLog) -> dict[str, Any]:
    """The simulator's log against the replay's: ``aligned`` (:func:`aligned`), and for
    aligned logs ``step_diff_ms_multi`` and ``step_diff_ms_one`` (the mean of each
    step's simulated minus replayed seconds), ``step_corr`` (the correlation of the two
    series of one-token steps), ``outcomes`` (a 3 x 3 matrix of counts: the replay's
    outcome by row, the simulator's by column, over the accesses both made, matched by
    step and key) and ``agree`` (its diagonal's share)."""
    out: dict[str, Any] = {"aligned": aligned(replay, sim)}
    if not out["aligned"]:
        return out
    d = step_seconds(sim) - step_seconds(replay)
    multi = replay.a["step_tokens"] > 1
    out["step_diff_ms_multi"] = 1e3 * _mean(d[multi])
    out["step_diff_ms_one"] = 1e3 * _mean(d[~multi])
    r, s = step_seconds(replay)[~multi], step_seconds(sim)[~multi]
    ok = ~np.isnan(r) & ~np.isnan(s)
    out["step_corr"] = (
        float(np.corrcoef(r[ok], s[ok])[0, 1])
        if ok.sum() > 2 and r[ok].std() > 0 and s[ok].std() > 0
        else math.nan
    )
    m = np.zeros((3, 3), dtype=np.int64)
    ra, sa = replay.a, sim.a
    scale = int(max(ra["access_key"].max(initial=0), sa["access_key"].max(initial=0))) + 1
    rid = ra["access_step"].astype(np.int64) * scale + ra["access_key"]
    sid = sa["access_step"].astype(np.int64) * scale + sa["access_key"]
    _, ri, si = np.intersect1d(rid, sid, assume_unique=False, return_indices=True)
    np.add.at(m, (ra["access_outcome"][ri], sa["access_outcome"][si]), 1)
    out["outcomes"] = m
    out["agree"] = float(np.trace(m) / m.sum()) if m.sum() else math.nan
    return out


#: the rows of a comparison table: (summary key, label, scale, format: a format string
#: or a function, :func:`fmoesim.validation.numbers.share` for the accesses' outcomes)
TABLE_ROWS = (
    ("step_ms_multi", "layer step of > 1 token, ms", 1.0, "{:.3f}"),
    ("step_ms_one", "layer step of 1 token, ms", 1.0, "{:.3f}"),
    ("step_ms_first", "layer step of the first forward pass, ms", 1.0, "{:.3f}"),
    ("step_ms_multi_later", "layer step of > 1 token after it, ms", 1.0, "{:.3f}"),
    ("step_ms_one_idle", "layer step of 1 token with no copy started in it, ms", 1.0, "{:.3f}"),
    ("step_ms_one_per_copy", "its growth a copy started in it, ms", 1.0, "{:.3f}"),
    ("gpu_ms_multi", "GPU busy a step of > 1 token, ms", 1.0, "{:.3f}"),
    ("gpu_ms_one", "GPU busy a step of 1 token, ms", 1.0, "{:.3f}"),
    ("policy_ms_multi", "policy's hooks a step of > 1 token, ms", 1.0, "{:.3f}"),
    ("policy_ms_one", "policy's hooks a step of 1 token, ms", 1.0, "{:.3f}"),
    ("host_ms_multi", "modelled host a step of > 1 token, ms", 1.0, "{:.3f}"),
    ("host_ms_one", "modelled host a step of 1 token, ms", 1.0, "{:.3f}"),
    ("hit", "hit", 1.0, numbers.share),
    ("late", "late", 1.0, numbers.share),
    ("miss", "miss", 1.0, numbers.share),
    ("on_demand_submitted", "on-demand loads a step", 1.0, "{:.2f}"),
    ("on_demand_wait_ms", "on-demand queue wait, ms", 1.0, "{:.3f}"),
    ("prefetch_submitted", "prefetches a step", 1.0, "{:.2f}"),
    ("prefetch_started_in_step", "prefetch started before the next gate", 100.0, "{:.1f}%"),
    ("prefetch_started_later", "prefetch started later", 100.0, "{:.1f}%"),
    ("prefetch_cancelled", "prefetch cancelled", 100.0, "{:.1f}%"),
    ("prefetch_used", "prefetch used", 100.0, "{:.1f}%"),
    ("prefetch_wait_ms", "prefetch queue wait, ms", 1.0, "{:.3f}"),
    ("prefetch_wait_ms_multi", "of those submitted in steps of > 1 token", 1.0, "{:.3f}"),
    ("prefetch_wait_ms_one", "of those submitted in steps of 1 token", 1.0, "{:.3f}"),
    ("moved", "transfers moved a step", 1.0, "{:.2f}"),
    ("cancelled", "transfers cancelled a step", 1.0, "{:.2f}"),
    ("cancelled_multi", "cancelled in steps of > 1 token", 100.0, "{:.1f}%"),
    ("on_demand_copy_ms", "copy of an on-demand load, ms", 1.0, "{:.3f}"),
    ("link_busy", "link busy", 100.0, "{:.1f}%"),
)


def csv_summary(row: dict[str, Any]) -> dict[str, float]:
    """What a replay.csv row says of :func:`summarize`'s numbers (NaN for the rest):
    a replay without an event log."""
    out = {key: math.nan for key, *_ in TABLE_ROWS}

    def col(name: str) -> float:  # a column a replay.csv of an older version lacks: NaN
        return float(row.get(name, math.nan))

    steps = col("replay_layer_steps")
    out.update(
        steps=steps,
        hit=col("replay_hit_rate"),
        late=col("replay_late_rate"),
        miss=col("replay_miss_rate"),
        moved=col("replay_transfers") / steps,
        cancelled=col("replay_cancelled_transfers") / steps,
    )
    return out


def _fmt(v: float, scale: float, fmt: str | Callable[[float], str]) -> str:
    if v != v:
        return "n/a"
    return fmt(v * scale) if callable(fmt) else fmt.format(v * scale)


#: the overview's columns besides the run and the agreement: (key, scale, format)
OVERVIEW = (
    ("ttft_ms", 1.0, "{:.1f}"),
    ("tpot_ms", 1.0, "{:.1f}"),
    ("moved", 1.0, "{:.2f}"),
    ("cancelled", 1.0, "{:.2f}"),
    ("cancelled_multi", 100.0, "{:.0f}%"),
)


def _pair(rs: dict[str, float], ss: dict[str, float], key: str, scale: float, fmt: str) -> str:
    """``replay / simulator`` of one number."""
    return f"{_fmt(rs[key], scale, fmt)} / {_fmt(ss[key], scale, fmt)}"


#: a run of a report: its name, the replay's log (or, without one, its replay.csv
#: numbers, :func:`csv_summary`), the simulator's log, and the runs' mean TTFT and TPOT
#: in ms (``{"ttft": (replay, simulator), "tpot": (...)}``)
ReportRun = tuple[str, "EventLog | dict[str, float]", "EventLog", dict[str, tuple[float, float]]]


def report_markdown(
    runs: Sequence[ReportRun], meta: dict[str, str]
) -> tuple[str, list[dict[str, Any]]]:
    """``events.md`` for ``runs`` and its rows (one per run: every summary number of
    both, prefixed ``replay_`` / ``sim_``, and the comparison's)."""
    lines = ["# Event logs: the simulator against the replay, step by step", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items()]
    lines += [
        "",
        "Each run's replayed and simulated event logs (`replay/events.py`): the time of a "
        "layer step (gate to gate), what the accesses found, and what the link did with "
        "each transfer. Where the two runs' layer steps line up (static batching), the "
        "mean of each step's simulated minus replayed time and how often an access found "
        "the same thing in both (rows: the replay's hit / late / miss; columns: the "
        "simulator's). A run replayed without an event log has replay.csv's numbers in "
        "its replay column.",
        "",
    ]
    overview = [
        "## Every run",
        "",
        "Replay / simulator. Transfers a step: moved, then cancelled; the last column is the "
        "share of the accesses that found the same in both, where the steps line up.",
        "",
        "| run | TTFT ms | TPOT ms | moved a step | cancelled a step | of those in > 1-token "
        "steps | found the same |",
        "|---|---|---|---|---|---|---|",
    ]
    body: list[str] = []
    rows: list[dict[str, Any]] = []
    for name, rep, sim, totals in runs:
        ss = summarize(sim)
        if isinstance(rep, EventLog):
            rs, c = summarize(rep), compare(rep, sim)
        else:
            rs, c = dict(rep), {"aligned": False, "no_log": True}
        for k, (r_ms, s_ms) in totals.items():
            rs[f"{k}_ms"], ss[f"{k}_ms"] = r_ms, s_ms
        row: dict[str, Any] = {"run": name}
        row.update({f"replay_{k}": v for k, v in rs.items()})
        row.update({f"sim_{k}": v for k, v in ss.items()})
        row.update({k: v for k, v in c.items() if k not in ("outcomes", "no_log")})
        body += [f"## {name}", "", "| | replay | simulator |", "|---|---|---|"]
        for k, (r_ms, s_ms) in totals.items():
            body.append(
                f"| {k.upper()}, ms | {_fmt(r_ms, 1.0, '{:.2f}')} | {_fmt(s_ms, 1.0, '{:.2f}')} |"
            )
        for key, label, scale, fmt in TABLE_ROWS:
            body.append(f"| {label} | {_fmt(rs[key], scale, fmt)} | {_fmt(ss[key], scale, fmt)} |")
        body.append("")
        if c["aligned"]:
            body.append(
                f"Steps line up: simulated minus replayed, "
                f"{_fmt(c['step_diff_ms_multi'], 1.0, '{:+.3f}')} ms a step of more than one "
                f"token, {_fmt(c['step_diff_ms_one'], 1.0, '{:+.3f}')} ms a step of one "
                f"(correlation {_fmt(c['step_corr'], 1.0, '{:.2f}')}); "
                f"{_fmt(c['agree'], 1.0, numbers.share)} of the accesses found the same."
            )
            body += ["", "| replay \\ simulator | hit | late | miss |", "|---|---|---|---|"]
            for i, o in enumerate(OUTCOMES):
                body.append(f"| {o} | " + " | ".join(str(int(v)) for v in c["outcomes"][i]) + " |")
            for i, o in enumerate(OUTCOMES):
                for j, p in enumerate(OUTCOMES):
                    row[f"outcome_{o}_{p}"] = int(c["outcomes"][i, j])
        elif c.get("no_log"):
            body.append("No event log of this replay: its column holds replay.csv's numbers.")
        else:
            body.append("Steps do not line up (batches formed differently): no step by step.")
        body.append("")
        rows.append(row)
        cells = [_pair(rs, ss, k, scale, fmt) for k, scale, fmt in OVERVIEW]
        same = _fmt(c.get("agree", math.nan), 1.0, numbers.share)
        overview.append(f"| {name} | {' | '.join(cells)} | {same} |")
    return "\n".join([*lines, *overview, "", *body]), rows


def timeline(runs: Sequence[ReportRun], stem: Path, window_steps: int = 32) -> None:
    """One figure per run, ``<stem>-<run>.png``: the link's copies (prefetches and
    on-demand loads) and the gates over ``window_steps`` layer steps from the middle of
    the run, the replay above the simulator, each on its own clock from the window's
    first gate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fmoesim.atomic import atomic_file

    colours = {0: "tab:red", 1: "tab:blue", 2: "tab:gray"}
    for name, rep, sim, _ in runs:
        if not isinstance(rep, EventLog):
            continue
        fig, axes = plt.subplots(2, 1, figsize=(11, 4.2), sharex=True)
        for ax, log, label in ((axes[0], rep, "replay"), (axes[1], sim, "simulator")):
            a = log.a
            g = a["step_gate_s"]
            if len(g) < 2:
                continue
            lo = max(0, len(g) // 2 - window_steps // 2)
            hi = min(len(g) - 1, lo + window_steps)
            t0, t1 = g[lo], g[hi]
            for t in g[lo : hi + 1]:
                ax.axvline(1e3 * (t - t0), color="0.8", lw=0.6, zorder=0)
            start, end = a["xfer_start_s"], a["xfer_end_s"]
            show = (~a["xfer_cancelled"]) & (end > t0) & (start < t1)
            for lane, code in ((1.0, 0), (0.0, 1)):
                sel = show & (a["xfer_reason"] == code)
                ax.broken_barh(
                    list(zip(1e3 * (start[sel] - t0), 1e3 * (end[sel] - start[sel]), strict=True)),
                    (lane, 0.8), facecolors=colours[code], edgecolor="white", linewidth=0.3,
                )  # fmt: skip
            gone = a["xfer_cancelled"] & (a["xfer_submit_s"] >= t0) & (a["xfer_submit_s"] < t1)
            ax.plot(1e3 * (a["xfer_submit_s"][gone] - t0), np.full(int(gone.sum()), 2.2), "x",
                    color="tab:blue", ms=3, lw=0)  # fmt: skip
            ax.set_yticks([0.4, 1.4, 2.2], ["prefetch", "on-demand", "cancelled"])
            ax.set_ylim(-0.2, 2.6)
            ax.set_title(f"{label}: steps {lo}-{hi}", fontsize=9, loc="left")
        axes[1].set_xlabel("ms from the window's first gate (grey lines: gates)")
        fig.suptitle(name, fontsize=10)
        fig.tight_layout()
        with atomic_file(Path(f"{stem}-{name}.png")) as tmp:
            fig.savefig(tmp, dpi=110)
        plt.close(fig)
