"""``fmoesim-validate-grid``: the simulator against the GPU replay over a grid of runs.

The grid's runs cover models, budgets, serving modes and policies, in two steps.

1. ``replay`` (on the GPU): every run of the grid is replayed
   (:class:`replay.backend.GpuBackend`); each finished run appends one row to
   ``<out>/replay.csv`` at once, so a run cut short keeps what it measured and a second
   call resumes it (runs already in the file are skipped; ``--repeats`` replays every
   run several times, in rounds).  Beside the run's summary, a row keeps the host's time
   inside the policy's hooks (``policy_host_s``, measured around the hooks, never inside
   the policy), the compute repeat factor of the crossover runs, and the host's state
   during the run (:class:`HostWatch`, :func:`host_probe_s`): the replay is host-bound,
   and its host's speed drifts.
2. ``score`` (anywhere, no GPU): the simulator runs every row's configuration with a
   measured hardware profile (``--hardware measured/<name>``; a crossover row's compute
   times scaled by its factor, :func:`fmoesim.plots.crossover.scale_hardware`) and
   ``report.md``, ``validation.csv`` and ``validation.png`` / ``.pdf`` compare the two:
   TTFT, TPOT, stall, PCIe bytes and hit / late / miss per run, relative errors, the mean
   |error| per policy against the targets, and the crossover's two curves.

3. ``host-fit`` (anywhere): the host costs of :mod:`fmoesim.engine.host` from stored
   replays (:func:`fit_host`), written as a new profile.

``render`` writes a report's ``report.md`` anew from its ``validation.csv`` without
simulating (:func:`render`): the numbers as scored, written as the report writes them
today (:mod:`fmoesim.validation.numbers`).

Replaying is the scarce step (a GPU); scoring takes minutes on a laptop, so a change of
the simulator's model is re-scored against the same measured runs.

The grid (:data:`GRID`): two models (OLMoE-1B-7B, 16 layers x 64 experts; Qwen3-30B-A3B,
48 x 128), two budgets each (a quarter and a half of the experts), batch 1 and online
serving with batching, nine policies, short synthetic requests (the replay runs in real
time); the crossover lengthens compute by running every operator n times.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import datetime as dt
import math
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from fmoesim.atomic import unwritable
from fmoesim.errors import ArgumentParser, FmoesimError, names_of, run_or_exit
from fmoesim.validation import numbers
from replay.events import EventLog, EventRecorder, log_name, save_log

PROG = "fmoesim-validate-grid"

#: the policies replayed, one preset each (every policy family of the simulator)
POLICIES = (
    "lru", "lfu", "lcp", "mixtral-offloading", "promoe", "brainstorm", "moe-infinity",
    "fmoe", "moepic",
)  # fmt: skip
#: prefetching policies of the crossover, and the on-demand baseline they must beat
CROSSOVER_POLICIES = ("lru", "promoe", "fmoe", "moe-infinity")
CROSSOVER_FACTORS = (1, 2, 4, 8)

#: the requests of every run: short prompts and outputs (the replay runs in real time)
LENGTHS = (
    "workload.synthetic.prompt_tokens_median=32",
    "workload.synthetic.prompt_tokens_max=96",
    "workload.synthetic.output_tokens_median=24",
    "workload.synthetic.output_tokens_max=48",
)
#: serving modes: batch 1, and online arrivals (Poisson) batched up to 4 requests
MODES = {
    "batch1": ("serving.mode=static", "serving.batch_size=1"),
    "online": (
        "serving.mode=online",
        "serving.arrivals=poisson",
        "serving.rate_rps=4",
        "serving.max_batch_size=4",
    ),
}


@dataclasses.dataclass(frozen=True)
class ModelGrid:
    """One model's part of the grid: its workload, budgets and request counts."""

    model: str
    workload: str
    budgets_gb: tuple[float, ...]
    requests: dict[str, int]  # mode -> requests
    crossover_budget_gb: float
    extra: tuple[str, ...] = ()  # further overrides (a shrunken shape in tests)


#: the grid: budgets are about a quarter and a half of the routed experts' bytes
#: (OLMoE: 16 x 64 x 12.58 MB = 12.9 GB; Qwen3-30B-A3B: 48 x 128 x 9.44 MB = 58.0 GB)
GRID = (
    ModelGrid("olmoe-1b-7b", "synthetic", (3.2, 6.4), {"batch1": 6, "online": 8}, 3.2),
    ModelGrid(
        "qwen3-30b-a3b", "routing-qwen3-30b-a3b", (14.5, 29.0), {"batch1": 4, "online": 6}, 14.5
    ),
)

#: replay.csv's key columns: one run
KEY = ("model", "budget_gb", "mode", "policy", "compute_repeat")
#: the compared metrics: (summary key, label, kind of quantity); the kinds are
#: :data:`fmoesim.validation.numbers.KINDS`: a share's error is a difference in points,
#: the others' relative
METRICS = (
    ("ttft_mean_s", "TTFT", "s"),
    ("tpot_mean_s", "TPOT", "s"),
    ("stall_s", "stall", "s"),
    ("pcie_bytes", "PCIe", "bytes"),
    ("hit_rate", "hit", "share"),
    ("late_rate", "late", "share"),
    ("miss_rate", "miss", "share"),
)
#: targets per policy: mean |relative error| of TPOT and TTFT, hit-rate gap in points
TARGETS = {"tpot": 0.05, "ttft": 0.10, "hit_points": 1.0}
#: the files ``score`` writes (and may replace)
REPORT_FILES = ("report.md", "validation.csv", "validation.png", "validation.pdf")
#: the hooks a policy may implement (timed from outside in the replay, :func:`time_calls`)
HOOKS = (
    "on_request_start", "on_iteration_start", "on_gate", "on_access", "on_insert",
    "on_evict", "victim", "on_iteration_end", "on_request_end",
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Run:
    """One run of the grid."""

    model: str
    budget_gb: float
    mode: str
    policy: str
    compute_repeat: int
    overrides: tuple[str, ...]

    def key(self) -> tuple[str, ...]:
        """The run's identity in replay.csv (as strings, as a CSV reads back)."""
        return tuple(str(getattr(self, k)) for k in KEY)


def grid_runs(
    grid: Sequence[ModelGrid] = GRID,
    policies: Sequence[str] = POLICIES,
    modes: Sequence[str] = tuple(MODES),
    crossover: bool = True,
    factors: Sequence[int] = CROSSOVER_FACTORS,
    hardware: str = "h100-pcie5",
    budgets_gb: Sequence[float] | None = None,
) -> list[Run]:
    """Every run, most important first: per model, batch 1 at every budget, then online,
    then the crossover (batch 1, the smaller budget, each compute factor).  ``budgets_gb``
    keeps only those of each model's budgets (None: all)."""
    runs: list[Run] = []
    if budgets_gb is not None:
        keep = set(budgets_gb)
        grid = [
            dataclasses.replace(g, budgets_gb=tuple(b for b in g.budgets_gb if b in keep))
            for g in grid
        ]
    for g in grid:
        base = (f"model={g.model}", f"workload={g.workload}", f"hardware={hardware}", *LENGTHS,
                *g.extra)  # fmt: skip
        for mode in modes:
            for budget in g.budgets_gb:
                for pol in policies:
                    o = (*base, f"cache.budget_gb={budget}", *MODES[mode],
                         f"workload.synthetic.num_requests={g.requests[mode]}")  # fmt: skip
                    runs.append(Run(g.model, budget, mode, pol, 1, (*o, f"policy={pol}")))
        if crossover:
            for n in factors:
                for pol in CROSSOVER_POLICIES:
                    o = (*base, f"cache.budget_gb={g.crossover_budget_gb}", *MODES["batch1"],
                         f"workload.synthetic.num_requests={g.requests['batch1']}")  # fmt: skip
                    runs.append(
                        Run(g.model, g.crossover_budget_gb, "batch1", pol, n, (*o, f"policy={pol}"))
                    )
    # a crossover run at factor 1 is the grid's own batch-1 run
    seen: set[tuple[str, ...]] = set()
    out = []
    for r in runs:
        if r.key() not in seen:
            seen.add(r.key())
            out.append(r)
    return out


#: the replay's host-side calls ``replay --host-timers`` times (inclusive: a submission's
#: time holds the pump it calls, a pump's the copies it issues and the landings it sees)
HOST_TIMERS = {
    "backend": (
        "pre_gate",
        "submit",
        "wait_any",
        "expert",
        "escalate",
        "reprioritize",
        "abort",
        "cancel",
        "_free_evicted",
        "_alloc",
    ),
    "link": ("pump", "_issue", "_on_done"),
    "copier": ("copy",),
}


def time_calls(
    obj: Any,
    names: Sequence[str],
    prefix: str = "",
    into: str | None = None,
    multi: Callable[[], bool] | None = None,
    stack: list[list[Any]] | None = None,
    within: dict[str, str] | None = None,
) -> dict[str, list[float]]:
    """Wrap ``obj``'s callables ``names`` (instance attributes shadowing them) so each
    one's host seconds and calls add up in the returned ``{prefix + name: [s, calls,
    self_s]}`` (all of them in ``{into: ...}`` when ``into`` is given); with ``multi``,
    the calls made while it returns True also add up in ``{prefix + name + "_multi":
    ...}``.  ``self_s`` leaves out the time spent in timed calls made from inside (those
    wrapped by any :func:`time_calls` sharing ``stack``, a list that starts empty).
    ``within`` maps a timer's name to another's: the calls made inside one of those
    (at any depth, on the same ``stack``) also add up in ``{name + "_in_" + other:
    ...}``.  The wrapped object itself reads no clock."""
    acc: dict[str, list[float]] = {}
    nest: list[list[Any]] = [] if stack is None else stack  # [inner seconds, name]
    for name in names:
        fn = getattr(obj, name, None)
        if not callable(fn):
            continue
        key = into or prefix + name.lstrip("_")
        cell = acc.setdefault(key, [0.0, 0, 0.0])
        part = acc.setdefault(key + "_multi", [0.0, 0, 0.0]) if multi is not None else cell
        parent = (within or {}).get(key)
        inside = acc.setdefault(f"{key}_in_{parent}", [0.0, 0, 0.0]) if parent else cell

        def timed(
            *args: Any, _fn: Any = fn, _cell: list[float] = cell, _part: list[float] = part,
            _key: str = key, _parent: str | None = parent, _inside: list[float] = inside,
            **kwargs: Any,
        ) -> Any:  # fmt: skip
            inner: list[Any] = [0.0, _key]  # seconds in timed calls made from this one
            nest.append(inner)
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                d = time.perf_counter() - t0
                nest.pop()
                if nest:
                    nest[-1][0] += d
                own = d - inner[0]
                _cell[0] += d
                _cell[1] += 1
                _cell[2] += own
                if multi is not None and multi():
                    _part[0] += d
                    _part[1] += 1
                    _part[2] += own
                if _parent is not None and any(e[1] == _parent for e in nest):
                    _inside[0] += d
                    _inside[1] += 1
                    _inside[2] += own

        setattr(obj, name, timed)
    return acc


class StepPhase:
    """The wall seconds and number of the layer steps that carry more than one token (at
    batch 1: the prefill's), as the backend tells them (``multi_step``, set by its
    ``pre_gate`` from its ``tokens``): :meth:`wrap` it first, then time the backend's
    calls with ``multi=phase.multi``.  ``steps_multi`` adds up each such step from its
    gate to the next layer's gate (or to :meth:`close`)."""

    def __init__(self) -> None:
        self.backend: Any = None  # the wrapped backend
        self._t: float | None = None
        self.steps_multi = [0.0, 0]

    def multi(self) -> bool:
        """Whether the current layer step carries more than one token."""
        return self.backend is not None and bool(self.backend.multi_step)

    def _tick(self) -> None:
        now = time.perf_counter()
        if self._t is not None and self.multi():
            self.steps_multi[0] += now - self._t
        self._t = now

    def wrap(self, backend: Any) -> None:
        """Shadow ``backend.pre_gate`` so each layer step is timed from its gate on."""
        self.backend = backend
        fn = backend.pre_gate

        def pre_gate(layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
            self._tick()  # the step before ends: its phase is still the backend's
            fn(layer, tokens, kv_tokens, pairs)
            self.steps_multi[1] += self.multi()

        backend.pre_gate = pre_gate

    def close(self) -> None:
        """End the last layer step (the run is over)."""
        self._tick()


def link_phases(transfers: Sequence[Any], multi: set[int]) -> dict[str, float]:
    """The link in the layer steps of more than one token and in the others: for the
    transfers submitted in each (``multi``: the ``id`` of those submitted in a
    multi-token step; prefixes ``multi_`` and ``one_``), the copies that moved whole
    without a pause (``copies``), their ``bytes`` and their summed start-to-end seconds
    (``copy_s``; bytes over seconds is the link's rate), and ``gap_s``: the link's idle
    seconds before a transfer started that could have started earlier, its
    submission (or release) and the previous copy's end both behind it.  In the
    simulator that gap is zero; in a replay it is the host issuing the copy late.
    Cancelled transfers moved nothing and count nowhere."""
    fields = ("copies", "bytes", "copy_s", "gap_s")
    out = {f"{p}_{k}": 0.0 for p in ("multi", "one") for k in fields}
    started = sorted(
        (r for r in transfers if not r.cancelled and r.start_s == r.start_s),
        key=lambda r: r.start_s,
    )
    link_free_s = -math.inf  # when the link finished every copy started so far
    for r in started:
        p = "multi_" if id(r) in multi else "one_"
        ready = max(r.submit_s, r.release_s, link_free_s)
        if r.start_s > ready:
            out[p + "gap_s"] += r.start_s - ready
        if not r.aborted and not r.preemptions:
            out[p + "copies"] += 1
            out[p + "bytes"] += r.size_bytes
            out[p + "copy_s"] += r.end_s - r.start_s
        link_free_s = max(link_free_s, r.end_s)
    return out


#: the pure-Python work :func:`host_probe_s` times (a fixed loop of about 10 ms)
PROBE_LOOPS = 200_000


def host_probe_s(loops: int = PROBE_LOOPS, times: int = 3) -> float:
    """The host's speed at Python now: the median seconds of ``times`` runs of a fixed
    loop of integer arithmetic (no allocation beyond small ints, no I/O).  Its spread
    across a replay's rows is the spread of the host itself."""
    out = []
    for _ in range(times):
        t0 = time.perf_counter()
        acc = 0
        for i in range(loops):
            acc = (acc + i * i) & 0xFFFF
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def _proc_stat_steal_s() -> float:
    """The machine's stolen CPU seconds so far, summed over its CPUs (``/proc/stat``;
    NaN where that file or its steal field is missing)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


class HostWatch:
    """What the host did during a block: ``result`` holds ``cpu_s`` (this process's
    user + system CPU seconds), ``steal_s`` (the machine's stolen CPU seconds, all CPUs:
    a virtual machine's CPUs that the hypervisor gave to others), ``vcsw`` and ``ivcsw``
    (voluntary and involuntary context switches), ``gc_s`` and ``gc_collections`` (the
    garbage collector's pauses and collections) and ``gc_off`` (1 when the collector was
    disabled for the block: ``gc_off=True`` collects once before, disables it, and leaves
    it as it found it)."""

    def __init__(self, gc_off: bool = False) -> None:
        self.gc_off = gc_off
        self.result: dict[str, float] = {}
        self._gc = [0.0, 0, 0.0]  # pause seconds, collections, start of the current one

    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc[2] = time.perf_counter()
        else:
            self._gc[0] += time.perf_counter() - self._gc[2]
            self._gc[1] += 1

    def __enter__(self) -> HostWatch:
        import gc
        import resource

        self._was_enabled = gc.isenabled()
        if self.gc_off:
            gc.collect()
            gc.disable()
        gc.callbacks.append(self._on_gc)
        self._ru = resource.getrusage(resource.RUSAGE_SELF)
        self._cpu = time.process_time()
        self._steal = _proc_stat_steal_s()
        return self

    def __exit__(self, *exc: object) -> None:
        import gc
        import resource

        cpu = time.process_time() - self._cpu
        steal = _proc_stat_steal_s() - self._steal
        ru = resource.getrusage(resource.RUSAGE_SELF)
        gc.callbacks.remove(self._on_gc)
        if self.gc_off and self._was_enabled:
            gc.enable()
        self.result = {
            "cpu_s": cpu,
            "steal_s": steal,
            "vcsw": ru.ru_nvcsw - self._ru.ru_nvcsw,
            "ivcsw": ru.ru_nivcsw - self._ru.ru_nivcsw,
            "gc_s": self._gc[0],
            "gc_collections": self._gc[1],
            "gc_off": int(self.gc_off),
        }


def _summary_row(s: dict[str, Any], prefix: str) -> dict[str, Any]:
    row = {f"{prefix}{k}": s.get(k, float("nan")) for k, *_ in METRICS if k != "miss_rate"}
    acc = s.get("accesses") or 0
    row[f"{prefix}miss_rate"] = s["misses"] / acc if acc else float("nan")
    for k in ("accesses", "hits", "late", "misses", "transfers", "tpot_p50_s", "tpot_p99_s",
              "e2e_mean_s", "gpu_busy_s", "link_busy_s", "wall_s", "requests", "iterations",
              "layer_steps", "prefetch_bytes", "on_demand_bytes", "simulated_s",
              "cancelled_transfers"):  # fmt: skip
        row[f"{prefix}{k}"] = s.get(k, float("nan"))
    return row


def first_request_ttft(metrics: Any) -> dict[str, float]:
    """A timed run's TTFT split at its first request (the earliest to start, ties by id):
    ``ttft_first_s``, that request's, and ``ttft_rest_mean_s``, the mean over the others
    (NaN where there is none, or no timing).  A replay's first request can run cold, so
    the two tell a run's start from its steady state."""
    import numpy as np

    req = metrics.request_table()
    ttft = req["ttft_s"]  # (requests,)
    if not len(ttft):
        return {"ttft_first_s": math.nan, "ttft_rest_mean_s": math.nan}
    ids = req["request_id"].tolist()
    first = min(range(len(ids)), key=lambda i: (metrics.request_start_s[ids[i]], ids[i]))
    rest = np.delete(ttft, first)
    rest = rest[~np.isnan(rest)]
    return {"ttft_first_s": float(ttft[first]),
            "ttft_rest_mean_s": float(rest.mean()) if len(rest) else math.nan}  # fmt: skip


def policy_code(node: Any) -> str:
    """A fingerprint of the policy a run's config ``node`` (its ``policy`` node) makes:
    the first 12 hex digits of the SHA-256 of its resolved config (JSON, keys sorted) and
    of the source of every module of the ``policies`` package its class's module reaches
    through its bases and what it imports from that package (MoEpic's
    ``policies.moepic_config``, the protocol in ``policies.base``).  Two runs of one
    preset name with another knob or other code differ in it."""
    import hashlib
    import json

    from hydra.utils import get_class
    from omegaconf import OmegaConf

    from fmoesim.config.build import module_source

    conf: Any = OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node
    h = hashlib.sha256(json.dumps(conf, sort_keys=True, default=str).encode())
    for name in policy_modules(get_class(str(conf["_target_"]))):
        h.update(name.encode() + module_source(name).read_bytes())
    return h.hexdigest()[:12]


def policy_modules(cls: type) -> list[str]:
    """The modules of the ``policies`` package that policy class ``cls`` runs: its own and
    its bases', and those they import names or modules from, transitively (sorted)."""
    import inspect
    import sys

    todo = [c.__module__ for c in cls.__mro__]
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name.split(".")[0] != "policies" or name in seen or name not in sys.modules:
            continue
        seen.add(name)
        for v in vars(sys.modules[name]).values():  # what it imports: modules, names
            todo.append(v.__name__ if inspect.ismodule(v) else getattr(v, "__module__", ""))
    return sorted(seen)


def replay_one(
    run: Run,
    device: str,
    depth: int = 2,
    host_timers: bool = False,
    gc_off: bool = False,
    repeat: int = 0,
    events_dir: Path | None = None,
) -> dict[str, Any]:
    """Replay one run; its replay.csv row (``repeat``: which repeat of the run it is).

    Every row says how the host fared during the run (:class:`HostWatch`: process CPU
    seconds, the machine's steal time, context switches, the garbage collector's pauses)
    and ``replay_probe_s``, :func:`host_probe_s` before and after the run (their mean): the
    replay is host-bound, so these tell a slow host from a slow policy.  ``gc_off``
    disables Python's garbage collector during the run.  ``host_timers`` adds the host's
    seconds and calls in the backend's and the link scheduler's entry points
    (:data:`HOST_TIMERS`; columns ``replay_host_<name>_s`` and ``replay_host_<name>_calls``),
    at a cost of a timer around each call, and the link and the GPU in the layer steps of
    more than one token against the others (:func:`link_phases`: ``replay_link_multi_*``
    and ``replay_link_one_*``; ``replay_compute_multi_s``, the GPU's measured compute in
    those steps).  ``events_dir`` writes the run's event log there
    (:mod:`replay.events`, :func:`replay.events.log_name`)."""
    from hydra.utils import instantiate

    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run, simulate_spec
    from fmoesim.trace.reader import read_trace
    from replay.backend import replay_backend

    cfg = compose_config([*run.overrides, "progress=false"])
    spec = build_run(cfg)
    trace = read_trace(_trace_path(spec))
    policy = instantiate(cfg.policy)
    hooks = time_calls(policy, HOOKS, into="hooks").get("hooks", [0.0, 0])
    # the event recorder wraps outside the timers: its work is in no timed call
    rec = EventRecorder() if events_dir is not None else None
    if rec is not None:
        rec.wrap_policy(policy)
    make = replay_backend(
        spec.model, spec.hardware, device, seed=spec.seed, depth=depth,
        compute_repeat=run.compute_repeat,
    )  # fmt: skip
    timers: dict[str, list[float]] = {}
    phase = StepPhase()

    def make_timed(caches: list[Any]) -> Any:
        backend = make(caches)
        if host_timers:
            phase.wrap(backend)
            nest: list[list[Any]] = []  # backend and link timers nest in one another
            timers.update(
                time_calls(backend, HOST_TIMERS["backend"], multi=phase.multi, stack=nest)
            )
            # the copies a submission starts and lands on its way apart (link_*_in_submit):
            # a submission's own cost is its time less theirs
            timers.update(
                time_calls(
                    backend.link,
                    HOST_TIMERS["link"],
                    "link_",
                    multi=phase.multi,
                    stack=nest,
                    within={"link_issue": "submit", "link_on_done": "submit"},
                )  # fmt: skip
            )
            # a copy's start apart: freeing evicted copies, allocating its tensor, and
            # launching the copy between its timing events (inside link_issue)
            timers.update(
                time_calls(
                    backend.copier,
                    HOST_TIMERS["copier"],
                    "copier_",
                    multi=phase.multi,
                    stack=nest,
                )  # fmt: skip
            )
        if rec is not None:  # the host's clock: the backend's now() waits for the GPU
            totals = {"gpu_busy_s": lambda: backend.busy_compute_s, "policy_s": lambda: hooks[0]}
            rec.wrap_backend(backend, clock=backend._host_s, totals=totals)
        return backend

    probe_before_s = host_probe_s()
    with HostWatch(gc_off=gc_off) as watch:
        t0 = time.perf_counter()
        res = simulate_spec(
            spec,
            trace,
            policy=policy,
            timing=True,
            access_log=False,
            progress=False,
            make_backend=make_timed if host_timers or rec is not None else make,
        )
        run_s = time.perf_counter() - t0
    if rec is not None and events_dir is not None:
        meta = {"source": "replay", "device": device, "repeat": repeat}
        meta.update({k: str(getattr(run, k)) for k in KEY})
        meta["overrides"] = " ".join(run.overrides)
        save_log(events_dir / log_name(run.key(), repeat), rec.arrays(res.transfers), meta)
    phases: dict[str, float] = {}  # the link and the GPU in the multi-token layer steps
    if host_timers:
        phase.close()
        timers["steps_multi"] = phase.steps_multi
        be = phase.backend
        multi = {id(r) for r in be.multi_transfers}
        phases = {f"link_{k}": v for k, v in link_phases(be.transfers, multi).items()}
        phases["compute_multi_s"] = be.busy_compute_multi_s
    row: dict[str, Any] = {k: getattr(run, k) for k in KEY}
    row["repeat"] = repeat
    row.update(_summary_row(res.summary, "replay_"))
    row.update({f"replay_{k}": v for k, v in first_request_ttft(res.metrics).items()})
    row["replay_policy_host_s"] = hooks[0]
    row["replay_policy_calls"] = int(hooks[1])
    row["replay_run_s"] = run_s
    row["replay_probe_s"] = 0.5 * (probe_before_s + host_probe_s())
    row.update({f"replay_{k}": v for k, v in watch.result.items()})
    row.update({f"replay_{k}": v for k, v in phases.items()})
    for name, (secs, calls, *own) in timers.items():
        row[f"replay_host_{name}_s"] = secs
        row[f"replay_host_{name}_calls"] = int(calls)
        if own:
            row[f"replay_host_{name}_self_s"] = own[0]
    row["policy_code"] = policy_code(cfg.policy)
    row["overrides"] = " ".join(run.overrides)
    return row


def _free_device(device: str) -> None:
    """Collect the last run's objects: their device memory returns to torch's caching
    allocator, which the next run reuses (as a serving engine keeps its expert slab; an
    emptied cache would make the next run pay a cudaMalloc per new block)."""
    import gc

    gc.collect()


def _done_repeats(path: Path) -> dict[tuple[str, ...], set[int]]:
    """The repeats of each run that ``path`` holds (none when it does not exist): a
    repeat that failed in its round is run again, and one that is there is not."""
    done: dict[tuple[str, ...], set[int]] = {}
    if path.exists():
        with path.open(newline="") as f:
            for r in csv.DictReader(f):
                k = tuple(r[k] for k in KEY)
                done.setdefault(k, set()).add(int(float(r["repeat"])))
    return done


def _header(path: Path) -> list[str]:
    """The column names of an existing CSV file."""
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


def _append(path: Path, row: dict[str, Any]) -> None:
    """Append one row (a header first when the file is new), flushed to disk; a file
    whose header has other columns is refused (a replay with ``--host-timers`` and one
    without go to different directories)."""
    new = not path.exists()
    if new:
        path.parent.mkdir(parents=True, exist_ok=True)
    else:
        header = _header(path)
        if header != list(row):
            other = sorted(set(header) ^ set(row)) or ["(their order)"]
            raise FmoesimError(
                f"{path}: its columns differ from this run's at {other[0]} "
                "(rule: one replay.csv holds runs of one kind; pick another --out)"
            )
    with path.open("a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(row))
        if new:
            w.writeheader()
        w.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def run_replays(
    runs: Sequence[Run],
    device: str,
    out: Path,
    deadline_s: float = math.inf,
    skip_done: bool = True,
    log: Callable[[str], None] = print,
    host_timers: bool = False,
    repeats: int = 1,
    gc_off: bool = False,
    event_logs: bool = False,
) -> int:
    """Replay ``runs`` ``repeats`` times each, appending to ``out/replay.csv``: in rounds
    (every run once, then every run again), so a drift of the host's speed spreads over
    all runs alike.  A run the file already holds ``repeats`` times is skipped (a second
    call resumes).  Stop starting new runs once ``deadline_s`` seconds have passed (a run's
    measured length, the longest so far, must fit before it).  ``gc_off`` disables
    Python's garbage collector during each run.  ``event_logs`` writes each run's first
    repeat's event log to ``out/events/`` (:mod:`replay.events`).  ``out`` is made with
    the first row.  Returns the number of runs replayed; a failed run is one line to
    ``log`` and the grid goes on, and at the end the first failure is raised as one
    :class:`FmoesimError` line with the count (the runs that succeeded are in the file),
    so that a command that lost runs does not exit 0."""
    if repeats < 1:
        raise FmoesimError(f"--repeats {repeats}: must be >= 1")
    path = out / "replay.csv"
    if path.exists():
        header = _header(path)
        timed = any(c.startswith("replay_host_") for c in header)
        if timed != host_timers:
            have, want = ("has", "has none") if timed else ("has no", "has")
            raise FmoesimError(
                f"{path}: {have} host-timer columns, this replay {want} (pick another --out)"
            )
        timed_need = ("replay_host_link_pump_self_s", "replay_link_multi_gap_s")
        need = ("repeat", "replay_probe_s", "policy_code", *(timed_need if timed else ()))
        missing = next((c for c in need if c not in header), None)
        if missing is not None:
            raise FmoesimError(
                f"{path}: no column {missing} (rule: one replay.csv holds runs of one kind; "
                "pick another --out)"
            )
    done = _done_repeats(path) if skip_done else {}
    todo = [(run, i) for i in range(repeats) for run in runs if i not in done.get(run.key(), ())]
    t_start = time.perf_counter()
    longest = 0.0
    n = 0
    failed: list[str] = []
    warm: set[str] = set()
    for run, i in todo:
        if run.model not in warm:
            # a first run pays CUDA's and cuBLAS's lazy start, the allocator's growth and
            # the host weights: replayed once and not recorded
            warm.add(run.model)
            try:
                replay_one(run, device, host_timers=host_timers, gc_off=gc_off)
            except Exception as exc:  # noqa: BLE001 - reported by the run itself below
                log(f"warm-up {run.model}: {type(exc).__name__}: {exc}")
            _free_device(device)
        elapsed = time.perf_counter() - t_start
        if elapsed + longest > deadline_s:
            log(f"deadline: {len(todo) - n} runs left")
            break
        try:
            events_dir = out / "events" if event_logs and i == 0 else None
            row = replay_one(run, device, host_timers=host_timers, gc_off=gc_off, repeat=i,
                             events_dir=events_dir)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - one failed run must not end the grid
            failed.append(f"{' '.join(run.key())}: {type(exc).__name__}: {exc}")
            log(f"{' '.join(run.key())}: failed: {type(exc).__name__}: {exc}")
            continue
        finally:
            _free_device(device)
        longest = max(longest, row["replay_run_s"])
        _append(path, row)
        n += 1
        log(
            f"{run.model} {run.budget_gb:g} GB {run.mode} x{run.compute_repeat} {run.policy}"
            f"{f' #{i}' if repeats > 1 else ''}: TPOT {1e3 * row['replay_tpot_mean_s']:.2f} ms, "
            f"hit {100 * row['replay_hit_rate']:.1f}% ({row['replay_run_s']:.1f} s; probe "
            f"{1e3 * row['replay_probe_s']:.1f} ms, steal {row['replay_steal_s']:.2f} s, "
            f"gc {1e3 * row['replay_gc_s']:.0f} ms)"
        )
    if failed:
        first = " ".join(failed[0].split())
        if n == 0:
            raise FmoesimError(f"every run tried failed ({len(failed)}), none added to {path}; "
                               f"the first: {first}")  # fmt: skip
        raise FmoesimError(f"{len(failed)} of the {n + len(failed)} runs tried failed ({n} "
                           f"added to {path}); the first: {first}")  # fmt: skip
    return n


# -- scoring -------------------------------------------------------------------------------
#: the columns every replay.csv holds: a run's key, its overrides, the compared metrics
REPLAY_COLUMNS = (*KEY, "overrides", *(f"replay_{m[0]}" for m in METRICS))
#: the compared metrics that are measured latencies (positive where a run was replayed)
LATENCIES = ("replay_ttft_mean_s", "replay_tpot_mean_s")


def read_replay_csv(f: Path) -> Any:
    """One replay.csv as a DataFrame, checked against the rules of the file ``replay``
    writes: UTF-8 CSV text, a header and at least one row, every row as many fields as
    the header and a line break at its end (a row cut short by an interrupted write is
    refused), the columns of :data:`REPLAY_COLUMNS`, the key's cells not empty,
    ``overrides`` space-separated ``key=value`` overrides, ``budget_gb`` a positive
    number, ``compute_repeat`` an integer >= 1 (``repeat``, where present, an integer >=
    0), every ``replay_*`` cell a number or empty, and the compared metrics finite: the
    latencies (:data:`LATENCIES`) > 0, the others >= 0 (the rates at most 1); every other
    ``replay_*`` number >= 0 (``replay_probe_s`` > 0); a column once in the header; the
    model, policy and budget the same as the row's overrides say; a run's ``repeat`` once
    in the file.  A broken rule is one line naming the file, the row (counted from 1, the
    header not counted) and the column."""
    import io

    import pandas as pd

    try:
        with f.open(newline="", encoding="utf-8-sig") as fh:  # a spreadsheet's BOM is no name
            text = fh.read()
    except UnicodeDecodeError:
        raise FmoesimError(f"{f}: not UTF-8 text (rule: a CSV file, as '{PROG} replay' "
                           "writes it)") from None  # fmt: skip
    reader = csv.reader(io.StringIO(text, newline=""), strict=True)
    try:
        rows = [r for r in reader if r]
    except csv.Error as exc:
        raise FmoesimError(f"{f} line {reader.line_num}: not CSV: {exc} (rule: a CSV file, "
                           f"as '{PROG} replay' writes it)") from None  # fmt: skip
    if not rows:
        raise FmoesimError(f"{f}: empty (rule: a header and a row per replayed run)")
    header, body = rows[0], rows[1:]
    twice = next((c for i, c in enumerate(header) if c in header[:i]), None)
    if twice is not None:
        raise FmoesimError(f"{f}: column {twice!r} twice in the header (rule: a column each)")
    missing = [c for c in REPLAY_COLUMNS if c not in header]
    if missing:
        raise FmoesimError(f"{f}: column {missing[0]!r} is missing (rule: a replay.csv has "
                           f"the columns {', '.join(REPLAY_COLUMNS)})")  # fmt: skip
    for i, r in enumerate(body):
        if len(r) != len(header):
            raise FmoesimError(f"{f} row {i + 1}: {len(r)} fields, the header {len(header)} (rule: "
                               "a field per column; a row cut short by an interrupted "
                               "replay?)")  # fmt: skip
    if not body:
        raise FmoesimError(f"{f}: no row (rule: a header and a row per replayed run)")
    if not text.endswith(("\n", "\r")):
        raise FmoesimError(f"{f} row {len(body)}: no line break at its end (rule: every "
                           "row ends with one; a row cut short by an interrupted "
                           "replay?)")  # fmt: skip
    df = pd.read_csv(io.StringIO(text), dtype={"policy_code": str})  # hex, never a number
    col = {c: j for j, c in enumerate(header)}

    def refuse(name: str, bad: Any, rule: str) -> None:
        where = [i for i, b in enumerate(bad) if b]
        if where:
            i = where[0]
            raise FmoesimError(f"{f} row {i + 1}: {name} = {body[i][col[name]]!r} (rule: {rule})")

    for name in (*KEY, "overrides"):
        if name not in ("budget_gb", "compute_repeat"):
            refuse(name, [not str(v).strip() for v in df[name].fillna("")], "not empty")
    refuse("overrides", [any("=" not in o for o in str(v).split()) for v in df["overrides"]],
           "space-separated key=value overrides")  # fmt: skip
    numbers = {
        c: pd.to_numeric(df[c], errors="coerce")
        for c in df.columns
        if c in ("budget_gb", "compute_repeat", "repeat") or c.startswith("replay_")
    }
    for name, v in numbers.items():
        refuse(name, (v.isna() & df[name].notna()).to_list(), "a number")
    finite = numbers["budget_gb"].abs() < math.inf
    refuse("budget_gb", (~((numbers["budget_gb"] > 0) & finite)).to_list(), "a number > 0")
    for name, least in (("compute_repeat", 1), ("repeat", 0)):
        if name in numbers:
            v = numbers[name]
            whole = (v >= least) & (v == v.round())
            refuse(name, (~whole).to_list(), f"an integer >= {least}")
    for key, *_ in METRICS:
        name = f"replay_{key}"
        v = numbers[name]
        if name in LATENCIES:
            ok, rule = (v > 0) & (v < math.inf), "a measured latency: a finite number > 0"
        else:
            ok, rule = (v >= 0) & (v < math.inf), "a finite number >= 0"
        refuse(name, (~ok).to_list(), rule)
    for name, v in numbers.items():  # the other measures: counts, seconds, shares
        if name == "replay_probe_s":  # scales the host costs: a time taken, > 0
            ok, rule = v.isna() | ((v > 0) & (v < math.inf)), "empty or a finite number > 0"
        else:
            ok, rule = v.isna() | ((v >= 0) & (v < math.inf)), "empty or a finite number >= 0"
        refuse(name, (~ok).to_list(), rule)
    for key in ("replay_hit_rate", "replay_late_rate", "replay_miss_rate"):
        refuse(key, (numbers[key] > 1).to_list(), "a share of the accesses, at most 1")
    given = [dict(o.split("=", 1) for o in str(v).split()) for v in df["overrides"]]
    for name in ("model", "policy"):
        refuse(name, [g.get(name, c) != c for g, c in zip(given, df[name], strict=True)],
               f"the {name}= of the row's overrides")  # fmt: skip
    budgets = [g.get("cache.budget_gb") for g in given]
    refuse("budget_gb", [b is not None and _float_or_nan(b) != v
                         for b, v in zip(budgets, numbers["budget_gb"], strict=True)],
           "the cache.budget_gb= of the row's overrides")  # fmt: skip
    if "repeat" in df.columns:
        seen: dict[tuple[Any, ...], int] = {}
        for i, r in enumerate(df[[*KEY, "repeat"]].itertuples(index=False)):
            k = tuple(str(x) for x in r)
            if k in seen:
                raise FmoesimError(
                    f"{f} row {i + 1}: run {' '.join(k[:-1])} repeat {k[-1]} again (row "
                    f"{seen[k] + 1} has it; rule: a repeat of a run once)"
                )
            seen[k] = i
    return df


def _float_or_nan(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def read_replays(paths: Sequence[Path], merge: bool = True) -> list[dict[str, Any]]:
    """The runs of one or more replay.csv files (numbers parsed), one row per run.

    Rows with the same key are repeats of one run: its ``replay_*`` numbers are their
    means, ``replay_repeats`` counts them, and ``replay_tpot_min_s``, ``replay_tpot_max_s``
    and ``replay_tpot_cv`` (sample standard deviation over mean; NaN for one repeat) give
    the spread of TPOT, ``replay_ttft_cv`` that of TTFT (``replay_probe_min_s`` and
    ``replay_probe_max_s`` that of the host probe).  The other columns come from the
    first repeat.  ``merge=False`` keeps every repeat as its own row instead.  Runs come
    in the grid's order: model, mode, budget, compute factor, policy (names the grid does
    not know after the ones it does, in the order they were read).  Each file is checked
    first (:func:`read_replay_csv`)."""
    import pandas as pd

    frames = []
    read: set[Path] = set()
    for p in paths:
        f = p / "replay.csv" if p.is_dir() else p
        if not f.is_file():
            raise FmoesimError(f"{f}: no replay.csv (run '{PROG} replay' on a GPU first)")
        if f.resolve() in read:  # its runs would count twice as repeats
            raise FmoesimError(f"{f}: given twice (rule: each replay.csv once)")
        read.add(f.resolve())
        frames.append(read_replay_csv(f))
    df = pd.concat(frames, ignore_index=True)
    if merge:
        means = [c for c in df.columns
                 if c.startswith("replay_") and pd.api.types.is_numeric_dtype(df[c])]  # fmt: skip
        g = df.groupby(list(KEY), sort=False)
        first = g.first()
        extra = {"replay_repeats": g.size()}
        if "replay_tpot_mean_s" in df.columns:
            tpot = g["replay_tpot_mean_s"]
            extra["replay_tpot_min_s"], extra["replay_tpot_max_s"] = tpot.min(), tpot.max()
            extra["replay_tpot_cv"] = tpot.std(ddof=1) / tpot.mean()
        if "replay_ttft_mean_s" in df.columns:
            ttft = g["replay_ttft_mean_s"]
            extra["replay_ttft_cv"] = ttft.std(ddof=1) / ttft.mean()
        if "replay_probe_s" in df.columns:
            probe = g["replay_probe_s"]
            extra["replay_probe_min_s"], extra["replay_probe_max_s"] = probe.min(), probe.max()
        # one concatenation, not a column at a time (a frame of many columns fragments)
        out = pd.concat([first.drop(columns=means), g[means].mean(), pd.DataFrame(extra)],
                        axis=1)[[*first.columns, *extra]].copy()  # fmt: skip
        records = out.reset_index().to_dict("records")
    else:
        records = df.to_dict("records")
    names = {"model": [g.model for g in GRID], "mode": list(MODES), "policy": list(POLICIES)}
    order = {k: {v: i for i, v in enumerate(vs)} for k, vs in names.items()}

    def rank(r: dict[str, Any]) -> tuple[Any, ...]:
        return (order["model"].get(r["model"], len(GRID)), order["mode"].get(r["mode"], len(MODES)),
                float(r["budget_gb"]), int(r["compute_repeat"]),
                order["policy"].get(r["policy"], len(POLICIES)))  # fmt: skip

    return sorted(records, key=rank)  # stable: unknown names keep the order read


#: a host profile's key: the median host probe (:func:`host_probe_s`) of the runs its
#: host costs were fitted on; scoring scales them by each run's own probe
HOST_PROBE_KEY = "host_probe_s"
#: a host profile's key: how the host costs follow the probe, ``cost ~ probe **
#: exponent`` (1 where absent); :func:`probe_exponent` measures it from the host timers
HOST_PROBE_EXPONENT_KEY = "host_probe_exponent"


#: a host profile's key, in place of :data:`HOST_PROBE_KEY`: the median seconds per FFN
#: launch (:func:`launch_s`) of the runs its host costs were fitted on; scoring scales
#: them by each run's own launch time
HOST_LAUNCH_KEY = "host_launch_s"
#: what ``--host-speed`` measures a run's host speed by (:func:`run_speed_s`)
SPEED_MEASURES = ("probe", "launch")


def launch_s(row: dict[str, Any]) -> float:
    """Seconds the replay's host spent launching one expert FFN in ``row``'s run: the
    backend's ``expert`` calls' own time over their count (``replay --host-timers``), the
    link's pumps within them left out (they grow with the copies a run makes); NaN where
    the run was not timed or its timers predate the calls' own time."""
    calls = row.get("replay_host_expert_calls", math.nan)
    own = row.get("replay_host_expert_self_s", math.nan)
    return float(own) / float(calls) if calls == calls and calls > 0 and own == own else math.nan


def run_speed_s(row: dict[str, Any], measure: str = "probe") -> float:
    """The host-speed measure of ``row``'s run: its host probe (``probe``,
    :func:`host_probe_s`) or its time per FFN launch (``launch``, :func:`launch_s`), in
    seconds; NaN where the run has none."""
    if measure == "launch":
        return launch_s(row)
    return float(row.get("replay_probe_s", math.nan))


def _speed_rule(measure: str) -> str:
    """What a run must record for ``measure`` (for error messages)."""
    if measure == "launch":
        return ("no FFN launch timers (rule: replay --host-timers; columns "
                "replay_host_expert_self_s and replay_host_expert_calls)")  # fmt: skip
    return "no host probe (rule: every replay named has the column replay_probe_s)"


def reference_probe_s(
    rows: Sequence[dict[str, Any]],
    fit_model: str,
    modes: Sequence[str] = ("batch1",),
    measure: str = "probe",
) -> float:
    """The median host-speed measure (:func:`run_speed_s`: the probe by default) of
    ``fit_model``'s rows in ``modes`` at compute factor 1 (:func:`fit_host` passes the
    runs it fits the engine's costs on)."""
    import numpy as np

    probes = [run_speed_s(r, measure) for r in rows
              if r["model"] == fit_model and r["mode"] in modes
              and int(r["compute_repeat"]) == 1]  # fmt: skip
    probes = [p for p in probes if p == p]
    if not probes:
        raise FmoesimError(f"--host-speed: the {fit_model} {'/'.join(modes)} runs record "
                           f"{_speed_rule(measure)}")  # fmt: skip
    return float(np.median(probes))


def host_speed_hardware(hw: Any, probe_s: float, launch: float = math.nan) -> Any:
    """``hw`` with every model's host costs (engine and decisions) scaled by the run's
    host-speed measure over the profile's reference: ``launch`` (seconds per FFN launch,
    :func:`launch_s`) where the profile records :data:`HOST_LAUNCH_KEY`, else ``probe_s``
    over :data:`HOST_PROBE_KEY`, to the power of its probe exponent (1 where it records
    none): the host ran that much slower (or faster) than when the costs were measured.
    Unchanged where the profile has no reference or the run no measure (NaN)."""
    from fmoesim.engine.host import HOST_COST_KEYS

    measured = {}
    changed = False
    for model, coeffs in (hw.measured or {}).items():
        if not isinstance(coeffs, dict):
            measured[model] = coeffs
            continue
        if coeffs.get(HOST_LAUNCH_KEY):
            ref, run, power = coeffs[HOST_LAUNCH_KEY], launch, 1.0
        else:
            ref, run = coeffs.get(HOST_PROBE_KEY), probe_s
            power = float(coeffs.get(HOST_PROBE_EXPONENT_KEY, 1.0))
        if not ref or not (run == run and run > 0):
            measured[model] = coeffs
            continue
        changed = True
        f = (run / float(ref)) ** power
        c = {k: float(v) * f if k in HOST_COST_KEYS else v for k, v in coeffs.items()}
        decisions = coeffs.get("host_decision_s") or {}
        c["host_decision_s"] = {p: float(v) * f for p, v in decisions.items()}
        measured[model] = c
    return dataclasses.replace(hw, measured=measured) if changed else hw


def run_hardware(hw: Any, row: dict[str, Any]) -> Any:
    """``hw`` at the host speed of ``row``'s run (:func:`host_speed_hardware`, by its
    probe or its time per FFN launch, whichever reference the profile records).  A
    profile that scales by launch time refuses a run without launch timers."""
    launch = launch_s(row)
    if launch != launch and any(isinstance(c, dict) and c.get(HOST_LAUNCH_KEY)
                                for c in (hw.measured or {}).values()):  # fmt: skip
        raise FmoesimError(
            f"{hw.name}: scales host costs by each run's FFN launch time ({HOST_LAUNCH_KEY}); "
            f"the {row['model']} {row['policy']} run records {_speed_rule('launch')}"
        )
    return host_speed_hardware(hw, run_speed_s(row, "probe"), launch)


def row_spec(row: dict[str, Any], hardware: str, spec_hw: Any = None) -> tuple[Any, Any]:
    """The run spec and trace of one replayed run's configuration on ``hardware`` (a
    preset's name; ``spec_hw``, a :class:`fmoesim.specs.HardwareSpec`, replaces its
    numbers where given), compute scaled by the run's factor and host costs by its
    host-speed measure (:func:`host_speed_hardware`; a profile that scales by FFN launch
    time refuses a run without launch timers)."""
    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run
    from fmoesim.engine.simulate import check_shapes
    from fmoesim.plots.crossover import scale_hardware
    from fmoesim.trace.reader import read_trace

    overrides = [o for o in str(row["overrides"]).split() if not o.startswith("hardware=")]
    with _naming_run(row):
        cfg = compose_config([*overrides, f"hardware={hardware}", "progress=false"])
        spec = build_run(cfg)
    if spec_hw is not None:
        spec = dataclasses.replace(spec, hardware=spec_hw)
    n = int(row["compute_repeat"])
    if n != 1:
        spec = dataclasses.replace(spec, hardware=scale_hardware(spec.hardware, n, 1.0))
    spec = dataclasses.replace(spec, hardware=run_hardware(spec.hardware, row))
    with _naming_run(row):
        trace = read_trace(_trace_path(spec))
        check_shapes(trace, spec.model)
    return spec, trace


@contextlib.contextmanager
def _naming_run(row: dict[str, Any]) -> Iterator[None]:
    """An error of a replay.csv row's configuration (its overrides, its trace) names the
    row's run: it did not come from the command line."""
    try:
        yield
    except FmoesimError as exc:
        run = " ".join(str(row[k]) for k in KEY)
        raise FmoesimError(f"the replayed run {run}: its configuration: {exc}") from None


def simulate_row(row: dict[str, Any], hardware: str, spec_hw: Any = None) -> dict[str, Any]:
    """The simulator's summary of one replayed run's configuration (:func:`row_spec`)."""
    from fmoesim.config.build import simulate_spec

    spec, trace = row_spec(row, hardware, spec_hw)
    res = simulate_spec(spec, trace, timing=True, access_log=False, progress=False)
    row = _summary_row(res.summary, "sim_")
    row.update({f"sim_{k}": v for k, v in first_request_ttft(res.metrics).items()})
    link = link_phases(res.transfers, set())  # every copy in "one_"
    row["sim_link_bytes"], row["sim_link_copy_s"] = link["one_bytes"], link["one_copy_s"]
    return row


def simulate_events(
    row: dict[str, Any], hardware: str, spec_hw: Any = None
) -> tuple[EventLog, dict[str, Any]]:
    """The simulator's event log of one replayed run's configuration (:func:`row_spec`),
    every layer step through its gate (no closed-form steps: the same decisions and
    times, :func:`fmoesim.engine.simulate.simulate`'s ``fast=False``), and the run's
    summary."""
    from fmoesim.config.build import simulate_spec
    from fmoesim.engine.simulate import model_for_trace, sim_backend

    spec, trace = row_spec(row, hardware, spec_hw)
    rec = EventRecorder()
    rec.wrap_policy(spec.policy)
    model = model_for_trace(spec.model, trace)

    def make(caches: list[Any]) -> Any:
        be = sim_backend(spec.hardware, model, spec.policy.name, caches,
                         preempt=spec.engine.preempt)  # fmt: skip
        totals = {"gpu_busy_s": lambda: be.busy_compute_s}
        if hasattr(be, "host_s"):  # the host-bound backend: the host time it charged
            totals["host_s"] = lambda: be.host_s
        return rec.wrap_backend(be, totals=totals)

    res = simulate_spec(spec, trace, timing=True, access_log=False, progress=False, fast=False,
                        make_backend=make)  # fmt: skip
    meta = {"source": "simulator", "hardware": hardware,
            **{k: str(row[k]) for k in KEY}}  # fmt: skip
    log = EventLog(rec.arrays(res.transfers), meta, f"simulated {' '.join(meta.values())}")
    return log, res.summary


#: the files ``events`` writes besides the timelines (``timeline-<run>.png``)
EVENT_FILES = ("events.md", "events.csv")


def events_report(
    replays: Sequence[Path],
    logs_source: Path | None,
    hardware: str,
    out: Path,
    meta: dict[str, str],
    window_steps: int = 32,
    policies: Sequence[str] | None = None,
    fit: dict[str, Any] | None = None,
) -> Path:
    """Compare each replayed run's event log (``logs_source``: the replay's ``events/``
    or ``events.tar``) with the simulator's on ``hardware`` (:mod:`replay.events`); write
    ``out``: events.md, events.csv (one row per run) and, unless ``window_steps`` is 0, a
    timeline per run.  Without ``logs_source`` every repeat of every run is simulated
    and set beside its replay.csv numbers.  ``policies`` keeps only those runs.  ``fit``
    (:func:`fit_host`'s ``fit_model``, ``host_speed``, ``modes``, ``exponent`` and
    ``measure``, ``link_depth``, and ``launch`` as :func:`cross_check`'s) first refits
    ``hardware``'s host costs on the replays without each run's policy
    (:func:`fit_without`, whose keyword arguments they are, ``launch`` aside), as
    :func:`cross_check` does, so each run is simulated out of sample."""
    import pandas as pd

    from fmoesim.atomic import atomic_dir
    from replay.events import csv_summary, open_logs, report_markdown, timeline

    if out.exists():
        names = (p.name for p in out.iterdir())
        other = sorted(n for n in names if n not in EVENT_FILES and not n.startswith("timeline-"))
        if other:
            raise FmoesimError(f"--out {out}: holds {other[0]}, not an events report (pick "
                               "another)")  # fmt: skip
    logs = open_logs(logs_source) if logs_source is not None else None
    chosen = [r for r in read_replays(replays, merge=False)
              if policies is None or r["policy"] in policies]  # fmt: skip
    if logs is not None:
        chosen = [r for r in chosen if _log_of(r) in logs]
    if not chosen:
        where = f"--logs {logs_source}: no event log matches" if logs is not None else "no"
        raise FmoesimError(f"{where} run of the replays named"
                           f"{'' if policies is None else ' among --policies'} (rule: files "
                           f"named as '{PROG} replay --event-logs' writes them)")  # fmt: skip
    profiles: dict[str, Any] = {}  # policy -> its out-of-sample hardware
    if fit is not None:
        fit = dict(fit)
        base_hw = base_profile(hardware, fit["fit_model"], fit.pop("launch", False))
        rows = repeat_rows(replays, hardware, base_hw)
        for p in dict.fromkeys(r["policy"] for r in chosen):
            _, profiles[p] = fit_without(rows, hardware, p, **fit, base_hw=base_hw)
    runs = []
    for r in chosen:
        name = _log_of(r)
        sim, s = simulate_events(r, hardware, profiles.get(r["policy"]))
        totals = {k: (1e3 * float(r[f"replay_{k}_mean_s"]), 1e3 * float(s[f"{k}_mean_s"]))
                  for k in ("ttft", "tpot")}  # fmt: skip
        replayed = logs[name] if logs is not None else csv_summary(r)
        runs.append((name.removesuffix(".npz"), replayed, sim, totals))
    if fit is not None:
        meta = {**meta, "host costs": "fitted without each run's policy (out of sample)"}
    text, table = report_markdown(runs, {"hardware profile": hardware, **meta})
    with atomic_dir(out, replace=True) as tmp:
        (tmp / "events.md").write_text(text)
        pd.DataFrame(table).to_csv(tmp / "events.csv", index=False)
        if window_steps > 0:
            timeline(runs, tmp / "timeline", window_steps)
    return out


def _log_of(row: dict[str, Any]) -> str:
    """The event log's file name of a replay.csv row (:func:`replay.events.log_name`)."""
    return log_name(tuple(str(row[k]) for k in KEY), int(row.get("repeat", 0)))


def score_rows(
    rows: Sequence[dict[str, Any]], hardware: str, spec_hw: Any = None
) -> list[dict[str, Any]]:
    """Each replay row with the simulator's numbers (:func:`simulate_row`) and the errors
    added, exact: relative (NaN where the replay measured 0, as a replay's stall often
    is) or, for rates, the difference.  The report writes them by
    :func:`fmoesim.validation.numbers.error`."""
    from replay.validate import rel_err

    out = []
    for r in rows:
        row = dict(r)
        row.update(simulate_row(r, hardware, spec_hw))
        for key, _, kind in METRICS:
            s, g = row[f"sim_{key}"], row[f"replay_{key}"]
            row[f"err_{key}"] = s - g if kind == "share" else rel_err(s, g)
        out.append(row)
    return out


def per_policy(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Mean |TPOT| and |TTFT| relative error and the largest hit-rate gap (points) per
    policy over the grid's runs (compute factor 1), whether the targets are met, and the
    replay's own TPOT spread: the mean coefficient of variation over the runs replayed
    more than once (NaN where none was)."""
    import numpy as np

    out = []
    for pol in dict.fromkeys(r["policy"] for r in rows):
        rs = [r for r in rows if r["policy"] == pol and int(r["compute_repeat"]) == 1]
        tpot = float(np.nanmean([abs(r["err_tpot_mean_s"]) for r in rs]))
        ttft = float(np.nanmean([abs(r["err_ttft_mean_s"]) for r in rs]))
        hit = float(np.nanmax([100 * abs(r["err_hit_rate"]) for r in rs]))
        cvs = [r.get("replay_tpot_cv", math.nan) for r in rs]
        cv = float(np.nanmean(cvs)) if any(c == c for c in cvs) else math.nan
        out.append({
            "policy": pol, "runs": len(rs), "tpot_err": tpot, "ttft_err": ttft,
            "hit_gap_points": hit, "tpot_cv": cv,
            "met": tpot <= TARGETS["tpot"] and ttft <= TARGETS["ttft"]
            and hit <= TARGETS["hit_points"],
        })  # fmt: skip
    return out


#: the latencies whose order of the policies :func:`policy_order` compares
ORDERED = (("tpot", "TPOT"), ("ttft", "TTFT"))
#: a pair of policies counts as told apart by the replay where their means differ by
#: more than this many standard errors of the difference
RESOLVED_SE = 2.0


def _replay_mean_se(rs: Sequence[dict[str, Any]], metric: str) -> tuple[float, float]:
    """One policy's replayed ``metric`` (``tpot`` or ``ttft``) over its rows ``rs``: the
    mean and its standard error.  Merged rows (:func:`read_replays`) carry their repeats'
    mean, count and CV; unmerged rows are the repeats themselves.  The error is NaN where
    the run was replayed once."""
    import numpy as np

    key = f"replay_{metric}_mean_s"
    if len(rs) == 1 and "replay_repeats" in rs[0]:
        r = rs[0]
        n, mean = int(r["replay_repeats"]), float(r[key])
        cv = float(r.get(f"replay_{metric}_cv", math.nan))
        return mean, cv * mean / math.sqrt(n) if n > 1 else math.nan
    vals = np.array([float(r[key]) for r in rs])  # (repeats,)
    se = float(vals.std(ddof=1) / math.sqrt(len(vals))) if len(vals) > 1 else math.nan
    return float(vals.mean()), se


def policy_order(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """How the simulator orders the policies against the replay, for each group of runs
    that differ only in their policy (model, budget, mode; compute factor 1) and each
    latency of :data:`ORDERED`: of every pair of policies, how many both put in the same
    order (``alike`` of ``pairs``); of the pairs the replay tells apart (their means more
    than :data:`RESOLVED_SE` standard errors of the difference apart; ``resolved``, NaN
    where a run was replayed once), how many (``alike_resolved``); Kendall's tau (pairs
    alike less pairs reversed, over pairs); and each side's fastest policy (tied ones
    joined by ``=``).  Repeats of
    a policy's run (unmerged rows) are averaged, the simulator's too."""
    import itertools

    out = []
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for r in rows:
        if int(r["compute_repeat"]) == 1:
            groups.setdefault((r["model"], float(r["budget_gb"]), r["mode"]), []).append(r)
    for (model, budget, mode), rs in groups.items():
        by_pol: dict[str, list[dict[str, Any]]] = {}
        for r in rs:
            by_pol.setdefault(r["policy"], []).append(r)
        if len(by_pol) < 2:
            continue
        for metric, label in ORDERED:
            rep = {p: _replay_mean_se(v, metric) for p, v in by_pol.items()}
            sim = {p: sum(float(r[f"sim_{metric}_mean_s"]) for r in v) / len(v)
                   for p, v in by_pol.items()}  # fmt: skip
            pairs = alike = reversed_ = resolved = alike_resolved = 0
            unknown = False
            for a, b in itertools.combinations(by_pol, 2):
                d_rep, d_sim = rep[a][0] - rep[b][0], sim[a] - sim[b]
                same = d_rep * d_sim > 0 or d_rep == d_sim == 0
                pairs += 1
                alike += same
                reversed_ += d_rep * d_sim < 0
                se = math.hypot(rep[a][1], rep[b][1])
                if se != se:
                    unknown = True
                elif abs(d_rep) > RESOLVED_SE * se:
                    resolved += 1
                    alike_resolved += same
            out.append({
                "model": model, "budget_gb": budget, "mode": mode, "metric": label,
                "policies": len(by_pol), "pairs": pairs, "alike": alike,
                "resolved": math.nan if unknown else resolved,
                "alike_resolved": math.nan if unknown else alike_resolved,
                "kendall_tau": (alike - reversed_) / pairs,
                "fastest_replay": _fastest({p: m for p, (m, _) in rep.items()}),
                "fastest_sim": _fastest(sim),
            })  # fmt: skip
    return out


def _fastest(values: dict[str, float]) -> str:
    """The policy with the lowest value; policies tied at it joined by ``=``."""
    best = min(values.values())
    return "=".join(p for p, v in values.items() if v == best)


def _order_table(
    rows: Sequence[dict[str, Any]], by_profile: dict[str, list[dict[str, Any]]] | None = None
) -> list[str]:
    """The report's section on :func:`policy_order`, under each profile of
    ``by_profile`` (in order) where given, else under ``rows``' profile."""
    profiles = by_profile if by_profile is not None else {"": rows}
    body = []
    for hw, rs in profiles.items():
        for o in policy_order(rs):
            res = ("n/a" if o["resolved"] != o["resolved"]
                   else f"{o['alike_resolved']}/{o['resolved']}")  # fmt: skip
            cells = [o["model"], f"{o['budget_gb']:g} GB", o["mode"],
                     *([f"`{hw}`"] if by_profile is not None else []), o["metric"],
                     str(o["policies"]), f"{o['alike']}/{o['pairs']}", res,
                     f"{o['kendall_tau']:+.2f}",
                     f"{o['fastest_replay']} / {o['fastest_sim']}"]  # fmt: skip
            body.append("| " + " | ".join(cells) + " |")
    if not body:
        return []
    head = ("| model | budget | mode | " + ("profile | " if by_profile is not None else "")
            + "latency | policies | pairs in the same order | of those the replay tells "
            "apart | Kendall's tau | fastest: replay / simulator |")  # fmt: skip
    return ["## Order of the policies", "",
            "Which policy is faster, the question the simulator is for: of every pair of "
            "policies in the same setting, how many the simulator puts in the replay's "
            "order; of the pairs whose replayed means differ by more than "
            f"{RESOLVED_SE:g} standard errors of the difference (n/a where a run was "
            "replayed once), how many; Kendall's tau (pairs in the same order less pairs "
            "reversed, over all pairs: 1 is the same order); and the fastest policy on "
            "each side.", "", head, "|" + "---|" * (head.count(" | ") + 1), *body,
            ""]  # fmt: skip


def _targets_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    lines = ["| policy | runs | mean abs TPOT error | mean abs TTFT error | "
             "largest hit-rate gap | met | replay's TPOT CV |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in per_policy(rows):
        cv = "n/a" if p["tpot_cv"] != p["tpot_cv"] else f"{100 * p['tpot_cv']:.1f}%"
        gap = numbers.points(p["hit_gap_points"] / 100, signed=False)
        lines.append(
            f"| {p['policy']} | {p['runs']} | {100 * p['tpot_err']:.1f}% | "
            f"{100 * p['ttft_err']:.1f}% | {gap} | {'yes' if p['met'] else 'no'} | {cv} |"
        )
    return lines


def _first_request_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The runs whose replay split TTFT at its first request (:func:`first_request_ttft`):
    the first request's TTFT and the others' mean, replay and simulator, and the mean
    |error| of each over those runs (none where no replay recorded the split)."""
    import numpy as np

    from replay.validate import rel_err

    def split(r: dict[str, Any]) -> bool:  # recorded, and not NaN
        return r.get("replay_ttft_rest_mean_s", math.nan) == r.get("replay_ttft_rest_mean_s")

    rs = [r for r in rows if int(r["compute_repeat"]) == 1 and split(r)]
    if not rs:
        return []
    lines = ["", "## TTFT: the first request and the others", "",
             "A run's first request against the mean of the others: simulator / replay, "
             "relative error in brackets.  Where only the first is far off, the gap is "
             "the run's start (a replay's first request can run cold), not its steady "
             "state.", "",
             "| model | budget | mode | policy | first request | the others |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    errs: dict[str, list[float]] = {"first": [], "rest": []}
    for r in rs:
        cells = [r["model"], f"{r['budget_gb']:g} GB", r["mode"], _run_policy(r)]
        for part, key in (("first", "ttft_first_s"), ("rest", "ttft_rest_mean_s")):
            errs[part].append(abs(rel_err(r[f"sim_{key}"], r[f"replay_{key}"])))
            cells.append("{} / {} ({})".format(*numbers.pair(r, key, "s")))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", f"Mean |error|: the first request {100 * np.nanmean(errs['first']):.1f}%, "
              f"the others {100 * np.nanmean(errs['rest']):.1f}%."]  # fmt: skip
    return lines


def _host_timers_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The runs replayed with ``--host-timers``: each timed call's host microseconds per
    MoE layer step, and the calls per step; then the same over the layer steps of more
    than one token alone (at batch 1, the prefill), where the runs split them."""
    timed = [r for r in rows if r.get("replay_host_link_pump_s", math.nan) >= 0.0]  # NaN: not timed
    if not timed:
        return []
    # the timers' names as replay_one wrote their columns: replay_host_<name>_s
    cols = [c[len("replay_host_") : -len("_s")] for c in timed[0]
            if c.startswith("replay_host_") and c.endswith("_s")]  # fmt: skip
    names = [n for n in cols if not n.endswith(("_multi", "_self"))]
    lines = ["", "## The replay's host calls", "",
             "Runs replayed with `--host-timers`: host microseconds per MoE layer step in "
             "each call (inclusive: a submission holds the pump it calls, a pump the copies "
             "it issues and the landings it sees), then, where recorded, the same without "
             "the timed calls made inside it (after the slash); calls per step in "
             "brackets.", ""]  # fmt: skip
    lines += _timers_rows(timed, names, "", "replay_layer_steps")
    split = [r for r in timed if r.get("replay_host_steps_multi_calls", 0) > 0]
    if split:
        note = ("The same over the layer steps of more than one token (at batch 1, the "
                "prefill), each step's wall from its gate to the next gate first:")  # fmt: skip
        lines += ["", note, ""]
        lines += _timers_rows(split, ["steps", *names], "_multi", "replay_host_steps_multi_calls")
        lines += _phases_table(split)
    return lines


def _phases_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Per multi-token layer step, of the runs that record it (:func:`link_phases`): the
    step's wall, the copies moved whole and their rate there and in the one-token steps,
    the link's idle time while a copy could have started, and the GPU's compute."""
    rows = [r for r in rows if r.get("replay_link_multi_gap_s", math.nan) >= 0.0]
    if not rows:
        return []

    def rate(r: dict[str, Any], k: str) -> str:
        s = r.get(f"{k}_copy_s", math.nan)
        return "n/a" if not s > 0 else f"{r[f'{k}_bytes'] / s / 1e9:.1f}"

    lines = ["", "The link and the GPU in those steps, per step: its wall, the copies moved "
             "whole without a pause and their rate (GB/s, there / in the one-token steps / "
             "the simulator's, all steps), the link's idle time while a submitted copy "
             "could have started (the host issuing it late; zero in the simulator), and "
             "the GPU's measured compute:", "",
             "| model | budget | mode | n | policy | wall ms | copies | GB/s | link idle ms "
             "| GPU compute ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        steps = r["replay_host_steps_multi_calls"]
        lines.append(
            f"| {r['model']} | {r['budget_gb']:g} GB | {r['mode']} | "
            f"{int(r['compute_repeat'])} | {r['policy']} | "
            f"{1e3 * r['replay_host_steps_multi_s'] / steps:.2f} | "
            f"{r['replay_link_multi_copies'] / steps:.1f} | "
            f"{rate(r, 'replay_link_multi')} / {rate(r, 'replay_link_one')} / "
            f"{rate(r, 'sim_link')} | "
            f"{1e3 * r['replay_link_multi_gap_s'] / steps:.2f} | "
            f"{1e3 * r['replay_compute_multi_s'] / steps:.2f} |"
        )
    return lines


def _timers_rows(
    rows: Sequence[dict[str, Any]], names: Sequence[str], suffix: str, steps_key: str
) -> list[str]:
    """A table of timers ``replay_host_<name><suffix>_s`` per step (``rows[steps_key]``)."""
    lines = ["| model | budget | mode | n | policy | " + " | ".join(names) + " |",
             "|---|---|---|---|---|" + "---|" * len(names)]  # fmt: skip
    for r in rows:
        steps = r[steps_key]
        cells = [r["model"], f"{r['budget_gb']:g} GB", r["mode"], str(int(r["compute_repeat"])),
                 r["policy"]]  # fmt: skip
        for n in names:
            sec = r.get(f"replay_host_{n}{suffix}_s", math.nan)
            own = r.get(f"replay_host_{n}{suffix}_self_s", math.nan)
            calls = r.get(f"replay_host_{n}{suffix}_calls", math.nan)
            mine = "" if own != own else f" / {1e6 * own / steps:.0f}"
            cells.append(
                "n/a" if sec != sec else f"{1e6 * sec / steps:.0f}{mine} ({calls / steps:.2f})"
            )
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _repeats_table(rows: Sequence[dict[str, Any]]) -> list[str]:
    """The runs replayed more than once: their TPOT's mean, range and CV, and the range of
    their host probes (n/a for replays that record none)."""
    rep = [r for r in rows if r.get("replay_repeats", 1) > 1]
    if not rep:
        return []
    lines = ["", "## Repeatability of the replay", "",
             "Runs replayed more than once (in rounds within a process, or in fresh "
             "processes): their TPOT's mean, range and coefficient of variation (sample "
             "standard deviation over mean), and the range of the host probe around them "
             "(the host's speed: a fixed Python loop, longer on a slower host); the errors "
             "above are against the mean.", "",
             "| model | budget | mode | n | policy | repeats | TPOT mean | min | max | CV "
             "| probe |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rep:
        lo, hi = r.get("replay_probe_min_s", math.nan), r.get("replay_probe_max_s", math.nan)
        probe = "n/a" if lo != lo else f"{1e3 * lo:.1f}-{1e3 * hi:.1f} ms"
        lines.append(
            f"| {r['model']} | {r['budget_gb']:g} GB | {r['mode']} | {int(r['compute_repeat'])} "
            f"| {r['policy']} | {int(r['replay_repeats'])} | "
            f"{numbers.quantity(r['replay_tpot_mean_s'], 's')} | "
            f"{numbers.quantity(r['replay_tpot_min_s'], 's')} | "
            f"{numbers.quantity(r['replay_tpot_max_s'], 's')} | {100 * r['replay_tpot_cv']:.1f}% | "
            f"{probe} |"
        )
    return lines


def _run_policy(r: dict[str, Any]) -> str:
    """A report row's policy, with its repeat (``lru #2``) where the row is one repeat of
    a run (:func:`read_replays` with ``merge=False``) rather than the repeats' mean."""
    if "replay_repeats" not in r and "repeat" in r:
        return f"{r['policy']} #{int(r['repeat'])}"
    return str(r["policy"])


def report_markdown(
    rows: Sequence[dict[str, Any]],
    meta: dict[str, str],
    by_profile: dict[str, list[dict[str, Any]]] | None = None,
) -> str:
    """The report: meta, targets per policy (under each profile of ``by_profile``, in
    order, when given; under ``rows``' profile also per serving mode where there are
    several), the order of the policies (:func:`policy_order`, under each profile), every
    run under ``rows``' profile, TPOT per run under each profile, the first request's TTFT
    apart (:func:`first_request_ttft`, where the replay recorded it), where the replay's
    time goes, the repeats' spread, the crossover."""
    lines = [f"# Simulator vs replay on {meta['device']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k != "device"]
    target = (f"Mean |relative error| over the grid's runs: TPOT <= {TARGETS['tpot']:.0%}, "
              f"TTFT <= {TARGETS['ttft']:.0%}; hit rate within {TARGETS['hit_points']:g} "
              "point.")  # fmt: skip
    lines += ["", "## Targets per policy", "", target, ""]
    if by_profile is None:
        lines += [*_targets_table(rows), ""]
    else:
        for i, (hw, rs) in enumerate(by_profile.items()):
            when = "before" if i == 0 else "after" if i == len(by_profile) - 1 else "then"
            lines += [f"### {when}: `{hw}`", "", *_targets_table(rs), ""]
    modes = list(dict.fromkeys(r["mode"] for r in rows))
    if len(modes) > 1:
        for mode in modes:
            rs = [r for r in rows if r["mode"] == mode]
            lines += [f"### {mode} runs only{'' if by_profile is None else ' (the last profile)'}",
                      "", *_targets_table(rs), ""]  # fmt: skip
    lines += _order_table(rows, by_profile)
    if by_profile is not None:
        lines += ["## TPOT per run under each profile", "",
                  "Replayed TPOT, then each profile's simulated TPOT (relative error) and "
                  "hit-rate gap in points.", "",
                  "| model | budget | mode | policy | replay | "
                  + " | ".join(f"`{hw}`" for hw in by_profile) + " |",
                  "|---|---|---|---|---|" + "---|" * len(by_profile)]  # fmt: skip
        for i, r in enumerate(rows):
            if int(r["compute_repeat"]) != 1:
                continue
            cells = [r["model"], f"{r['budget_gb']:g} GB", r["mode"], r["policy"],
                     numbers.quantity(r["replay_tpot_mean_s"], "s")]  # fmt: skip
            for rs in by_profile.values():
                x = rs[i]
                sim, _, err = numbers.pair(x, "tpot_mean_s", "s")
                cells.append(f"{sim} ({err}, hit {numbers.pair(x, 'hit_rate', 'share')[2]})")
            lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Every run", "",
              "Simulator / replay, each time in s, ms, us or ns and each size in B to TB by "
              "its size, to 3 significant figures; in brackets the relative error, "
              "(simulator - replay) / replay, or the difference, simulator - replay, where "
              "the replay's value is 0 or a stall of at most "
              f"{numbers.NEGLIGIBLE_STALL_SHARE:.1%} of the replay's wall time (a ratio to "
              "it says nothing) and for hit, late and miss (in percentage points, pt).",
              ""]  # fmt: skip
    head = "| model | budget | mode | policy | " + " | ".join(m[1] for m in METRICS) + " |"
    lines += [head, "|---|---|---|---|" + "---|" * len(METRICS)]
    for r in rows:
        if int(r["compute_repeat"]) != 1:
            continue
        cells = [r["model"], f"{r['budget_gb']:g} GB", r["mode"], _run_policy(r)]
        for key, _, kind in METRICS:
            cells.append("{} / {} ({})".format(*numbers.pair(r, key, kind)))
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Where the replay's time goes", "",
              "Per MoE layer step (microseconds): the replay's wall time, its compute "
              "operators' event spans (launch gaps included), the host's time inside the "
              "policy's hooks, and the rest (the runner, the cache, the link scheduler, the "
              "gate's synchronisation); the simulator's modelled compute beside them.", "",
              "| model | budget | mode | policy | replay wall | replay compute | policy hooks "
              "| rest | simulated compute |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if int(r["compute_repeat"]) != 1:
            continue
        n = r["replay_layer_steps"]
        wall, comp = r["replay_wall_s"] / n * 1e6, r["replay_gpu_busy_s"] / n * 1e6
        hooks = r["replay_policy_host_s"] / n * 1e6
        lines.append(
            f"| {r['model']} | {r['budget_gb']:g} GB | {r['mode']} | {_run_policy(r)} | "
            f"{wall:.0f} | {comp:.0f} | {hooks:.0f} | {wall - comp - hooks:.0f} | "
            f"{r['sim_gpu_busy_s'] / n * 1e6:.0f} |"
        )
    lines += _first_request_table(rows)
    lines += _host_timers_table(rows)
    lines += _repeats_table(rows)
    cross = [r for r in rows if r["mode"] == "batch1" and r["policy"] in CROSSOVER_POLICIES]
    factors = sorted({int(r["compute_repeat"]) for r in rows})
    if len(factors) > 1:
        lines += ["", "## Crossover", "",
                  "TPOT of each prefetching policy over on-demand LRU's, as every compute "
                  "operator runs n times (replay: really n times; simulator: every compute "
                  "time times n).  Below 1: the policy beats LRU.", ""]  # fmt: skip
        lines += ["| model | policy | " + " | ".join(f"n={n}" for n in factors) + " |",
                  "|---|---|" + "---|" * len(factors)]  # fmt: skip
        for model, pol, ratios in crossover_ratios(cross):
            cells = [model, pol]
            for n in factors:
                s, g = ratios.get(n, (float("nan"), float("nan")))
                cells.append("n/a" if s != s or g != g else f"{s:.3f} / {g:.3f}")
            lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    return "\n".join(lines)


def crossover_ratios(
    rows: Sequence[dict[str, Any]],
) -> Iterator[tuple[str, str, dict[int, tuple[float, float]]]]:
    """Per (model, prefetching policy): factor -> (simulated, replayed) TPOT / LRU's TPOT
    at the crossover budget."""
    by = {(r["model"], r["policy"], int(r["compute_repeat"]), float(r["budget_gb"])): r
          for r in rows}  # fmt: skip
    for model in dict.fromkeys(r["model"] for r in rows):
        budgets = {k[3] for k in by if k[0] == model and k[2] != 1}
        if not budgets:
            continue
        budget = min(budgets)
        for pol in CROSSOVER_POLICIES[1:]:
            ratios: dict[int, tuple[float, float]] = {}
            for (m, p, n, b), r in by.items():
                if (m, p, b) != (model, pol, budget):
                    continue
                lru = by.get((model, "lru", n, budget))
                if lru is not None:
                    ratios[n] = (
                        r["sim_tpot_mean_s"] / lru["sim_tpot_mean_s"],
                        r["replay_tpot_mean_s"] / lru["replay_tpot_mean_s"],
                    )
            if ratios:
                yield model, pol, dict(sorted(ratios.items()))


def plot(rows: Sequence[dict[str, Any]], title: str, stem: Path) -> None:
    """Simulated against replayed TPOT, TTFT and hit rate, one point per run (the
    diagonal is perfect agreement), and the crossover's two curves; PNG and PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter

    from fmoesim.plots.style import legend_outside, policy_color, policy_marks

    base = [r for r in rows if int(r["compute_repeat"]) == 1]
    cross = list(crossover_ratios(
        [r for r in rows if r["mode"] == "batch1" and r["policy"] in CROSSOVER_POLICIES]
    ))  # fmt: skip
    panels = [("tpot_mean_s", "TPOT (ms)", 1e3), ("ttft_mean_s", "TTFT (ms)", 1e3),
              ("hit_rate", "hit rate (%)", 100.0)]  # fmt: skip
    ncols = len(panels) + (1 if cross else 0)
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 4.0))
    for ax, (key, lab, scale) in zip(axes, panels, strict=False):
        lo, hi = math.inf, 0.0
        for pol in dict.fromkeys(r["policy"] for r in base):
            rs = [r for r in base if r["policy"] == pol]
            pairs = [(scale * r[f"replay_{key}"], scale * r[f"sim_{key}"]) for r in rs]
            pairs = [(x, y) for x, y in pairs if x > 0 and y > 0]  # NaN and 0 drop out
            if not pairs:
                continue
            xs, ys = [p[0] for p in pairs], [p[1] for p in pairs]
            ax.scatter(xs, ys, marker=policy_marks(pol)[0], color=policy_color(pol), s=22,
                       label=pol, alpha=0.85)  # fmt: skip
            lo, hi = min(lo, *xs, *ys), max(hi, *xs, *ys)
        if hi > 0:
            ax.plot([lo, hi], [lo, hi], color="0.5", lw=0.8, ls="--")
        if key != "hit_rate" and hi > 0:
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(f"replay {lab}")
        ax.set_ylabel(f"simulator {lab}")
        ax.grid(alpha=0.3)
    if cross:
        ax = axes[-1]
        for model, pol, ratios in cross:
            ns = list(ratios)
            mk, col = policy_marks(pol)[0], policy_color(pol)
            ax.plot(ns, [ratios[n][1] for n in ns], marker=mk, color=col,
                    label=f"{pol}, replay ({model})")  # fmt: skip
            ax.plot(ns, [ratios[n][0] for n in ns], marker=mk, color=col, ls=":", mfc="none",
                    label=f"{pol}, simulator")  # fmt: skip
        ax.axhline(1.0, color="0.4", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("compute repeat factor n")
        ax.set_ylabel("TPOT / LRU's TPOT")
        ax.grid(alpha=0.3)
        legend_outside(ax, fontsize=6)
    legend_outside(axes[len(panels) - 1], fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{ext}"), dpi=130, bbox_inches="tight")
    plt.close(fig)


def score(
    replays: Sequence[Path], hardware: str | Sequence[str], out: Path, meta: dict[str, str]
) -> Path:
    """Score stored replays against the simulator on each hardware profile in turn (the
    first is "before", the last "after" where there are several); write ``out``:
    report.md (targets per profile, every run under the last one, TPOT and hit rate per
    run under each), validation.csv (one row per run and profile) and the figure (the
    last profile)."""
    import pandas as pd

    profiles = [hardware] if isinstance(hardware, str) else list(hardware)
    _refuse_foreign_out(out)
    replayed = read_replays(replays)
    scored = {hw: score_rows(replayed, hw) for hw in profiles}
    last = profiles[-1]
    meta = {"hardware profile": ", ".join(profiles), **meta}
    meta["policies replayed"] = changed_policies(replayed)
    text = report_markdown(scored[last], meta, scored if len(profiles) > 1 else None)
    frames = [pd.DataFrame(rows).assign(hardware=hw) for hw, rows in scored.items()]
    _write_report(out, text, pd.concat(frames, ignore_index=True), scored[last],
                  f"simulator ({last}) vs replay on {meta['device']}")  # fmt: skip
    return out


def changed_policies(rows: Sequence[dict[str, Any]]) -> str:
    """Whether the replayed policies are the ones scored: each row's ``policy_code``
    (:func:`policy_code`, recorded by the replay) against today's for its overrides.  A
    policy whose code or preset changed since its replay is scored as today's policy
    against the replayed one, and its errors say so little of the simulator."""
    from fmoesim.cli.main import compose_config

    if not rows or any(not isinstance(r.get("policy_code"), str) for r in rows):
        return (
            "not recorded by these replays (files made before it was): a policy changed "
            "since its replay is not detected"
        )
    now: dict[str, str] = {}
    changed: list[str] = []
    for r in rows:
        overrides = [o for o in str(r["overrides"]).split() if not o.startswith("hardware=")]
        key = " ".join(overrides)
        if key not in now:
            with _naming_run(r):
                now[key] = policy_code(compose_config([*overrides, "progress=false"]).policy)
        if now[key] != str(r["policy_code"]) and r["policy"] not in changed:
            changed.append(str(r["policy"]))
    if not changed:
        return "the policies scored, code and presets alike"
    return (
        f"**{', '.join(changed)} changed since their replay** (code or preset): their rows "
        "compare today's policy with the replayed one"
    )


def _refuse_foreign_out(out: Path) -> None:
    """Refuse a report directory ``out`` that holds anything but a report's files."""
    if out.exists():
        other = sorted(p.name for p in out.iterdir() if p.name not in REPORT_FILES)
        if other:
            raise FmoesimError(f"--out {out}: holds {other[0]}, not a report (pick another)")


def _write_report(
    out: Path, text: str, table: Any, rows: Sequence[dict[str, Any]], title: str
) -> None:
    """Write a report to ``out`` at once: ``text`` as report.md, ``table`` (a frame) as
    validation.csv, and the figure of ``rows``."""
    from fmoesim.atomic import atomic_dir

    with atomic_dir(out, replace=True) as tmp:
        (tmp / "report.md").write_text(text)
        table.to_csv(tmp / "validation.csv", index=False)
        plot(rows, title, tmp / "validation")


def _submissions(r: dict[str, Any]) -> float:
    """Transfers a replayed run queued: its submit calls (``--host-timers``), else the
    transfers it moved plus those it cancelled; NaN where the row records neither."""
    calls = r.get("replay_host_submit_calls", math.nan)
    if calls == calls:
        return float(calls)
    cancelled = r.get("replay_cancelled_transfers", math.nan)
    return float(r["replay_transfers"] + cancelled)


def repeat_rows(paths: Sequence[Path], hardware: str, spec_hw: Any = None) -> list[dict[str, Any]]:
    """Every repeat of the replayed runs in ``paths`` as its own row, with the
    simulator's numbers on ``hardware`` (``spec_hw`` in its place where given; ``sim_*``,
    one simulation per run: the simulator is deterministic)."""
    scored = score_rows(read_replays(paths), hardware, spec_hw)
    sim = {
        tuple(str(r[k]) for k in KEY): {k: v for k, v in r.items() if k.startswith("sim_")}
        for r in scored
    }
    return [{**r, **sim[tuple(str(r[k]) for k in KEY)]} for r in read_replays(paths, merge=False)]


def probe_exponent(rows: Sequence[dict[str, Any]]) -> float:
    """How the host's own costs follow its probe, measured on the runs timed with
    ``--host-timers``: the slope of log cost on log probe, within each (policy, mode)
    and each of two timed costs (a copy's issue and landing per transfer started, an
    expert's launch per call), so that policies and modes of different costs do not
    confound it.  ``cost ~ probe ** slope``; 1 would mean the probe's loop and the
    host's serving work slow down alike.  Raises where fewer than two timed runs of one
    (policy, mode) differ in probe."""
    import numpy as np

    groups: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for r in rows:
        probe = r.get("replay_probe_s", math.nan)
        if not probe > 0:
            continue
        moved = r.get("replay_transfers", 0)
        issue = r.get("replay_host_link_issue_s", math.nan) + r.get(
            "replay_host_link_on_done_s", math.nan
        )
        if moved > 0 and issue > 0:
            key = ("issue", r["policy"], r["mode"])
            groups.setdefault(key, []).append((math.log(probe), math.log(issue / moved)))
        calls = r.get("replay_host_expert_calls", 0)
        launch = r.get("replay_host_expert_s", math.nan)
        if calls > 0 and launch > 0:
            key = ("launch", r["policy"], r["mode"])
            groups.setdefault(key, []).append((math.log(probe), math.log(launch / calls)))
    sxx = sxy = 0.0
    for pts in groups.values():
        a = np.array(pts)  # (runs, 2): log probe, log cost
        dx, dy = a[:, 0] - a[:, 0].mean(), a[:, 1] - a[:, 1].mean()
        sxx += float(dx @ dx)
        sxy += float(dx @ dy)
    if not sxx > 0:
        raise FmoesimError("--probe-exponent: no two timed runs of one policy differ in "
                           "their host probe (rule: replay --host-timers --repeats 2 or "
                           "more)")  # fmt: skip
    return sxy / sxx


def fit_host(
    rows: Sequence[dict[str, Any]],
    fit_model: str,
    host_speed: bool = False,
    modes: Sequence[str] = ("batch1",),
    leave_out: Sequence[str] = (),
    exponent: bool = False,
    measure: str = "probe",
    fit_transfer: bool = False,
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The host model of :mod:`fmoesim.engine.host` from scored replays (scored on a
    profile without host costs).

    Engine costs: least squares over ``fit_model``'s runs in ``modes`` (batch 1 by
    default), less the policies named in ``leave_out`` (whose runs then check the fit
    out of sample), of the time no
    measured component explains, per MoE layer step, ``(replay wall - policy hooks -
    simulated compute) / layer steps = host_layer_s + host_access_s * accesses / steps +
    host_submit_s * queued / steps + host_transfer_s * transfers / steps`` (queued: every
    transfer submitted, cancelled ones too; transfers: those the link started).

    - Where the runs carry the link scheduler's host timers (``replay --host-timers``),
      ``host_transfer_s`` is measured, not fitted: the seconds the host spent issuing
      copies (every chunk of them) and landing them, over the transfers moved; the fit
      takes the rest.  (A fit of it is biased: a slower host both stretches a run and
      lets more prefetches start before they are cancelled.)  The fit takes every
      started copy's cost off the wall, the simulator charges none for a copy it starts
      while the GPU waits: the replay's waits are short (its measured stall is near 0).
    - Where some runs count their queued transfers, the others stay out of the fit.
    - Where none does (no column ``replay_cancelled_transfers`` or
      ``replay_host_submit_calls``), or where no run cancels any and none is timed (a
      submission and a start then cannot be told apart), every moved transfer stands for
      one submission: ``host_submit_s`` is fitted per moved transfer and
      ``host_transfer_s`` is 0.

    Batch-1 runs of one trace all make the same accesses per step, so they cannot tell
    ``host_layer_s`` from ``host_access_s`` apart (least squares splits their sum by its
    minimum norm); runs of another batch size (``modes`` with ``online``) can.

    Decision costs: each (model, policy)'s hooks' measured seconds per layer step,
    averaged over its runs (left-out policies too: they are measured, not fitted).
    ``host_speed``: every run's host seconds are first brought to the reference speed
    (times :func:`reference_probe_s` over the run's own probe; to the power of the
    fitted runs' :func:`probe_exponent` with ``exponent``, recorded as
    ``host_probe_exponent``), and the engine costs hold that reference as
    ``host_probe_s``.  ``measure="launch"`` measures each run's speed by its time per FFN
    launch instead (:func:`launch_s`, from ``--host-timers``), and the costs hold the
    reference as ``host_launch_s``.  ``fit_transfer`` fits ``host_transfer_s`` with the
    other costs even where the runs are timed.  Returns (engine costs,
    model -> policy -> decision seconds)."""
    import numpy as np

    from replay.profile import fit_linear

    runs = [r for r in rows if r["model"] == fit_model and r["mode"] in modes
            and r["policy"] not in leave_out and int(r["compute_repeat"]) == 1]  # fmt: skip
    base = [r for r in runs if _submissions(r) == _submissions(r)]
    counted = bool(base)
    if not counted:
        # no run counts its queued transfers: every moved transfer stands for one
        # submission, and the per-transfer cost is charged there (host_submit_s)
        base = runs
    if len(base) < 3 + counted:
        raise FmoesimError(
            f"--fit-model {fit_model}: {len(base)} runs in {', '.join(modes)}"
            + (f" outside {', '.join(leave_out)}" if leave_out else "")
            + f", need {3 + counted} or more"
            + (" that count their queued transfers" if counted else "")
        )
    timed = [r for r in base if r.get("replay_host_link_issue_calls", math.nan) > 0]
    if counted and not timed and all(_submissions(r) == r["replay_transfers"] for r in base):
        counted = False  # queued = started in every run: one cost, at submission
    X = np.array([(r["replay_accesses"] / r["replay_layer_steps"],
                   (_submissions(r) if counted else r["replay_transfers"])
                   / r["replay_layer_steps"],
                   r["replay_transfers"] / r["replay_layer_steps"]) for r in base])  # fmt: skip
    if measure not in SPEED_MEASURES:
        raise FmoesimError(f"--host-speed-from {measure}: unknown (valid: "
                           f"{', '.join(SPEED_MEASURES)})")  # fmt: skip
    if exponent and measure != "probe":
        raise FmoesimError("--probe-exponent: scales by the probe, not with "
                           f"--host-speed-from {measure}")  # fmt: skip
    ref = reference_probe_s(base, fit_model, modes, measure) if host_speed else math.nan
    power = probe_exponent(base) if host_speed and exponent else 1.0

    def speed(r: dict[str, Any]) -> float:
        """The factor that brings ``r``'s host seconds to the reference speed."""
        if not host_speed:
            return 1.0
        probe = run_speed_s(r, measure)
        if not probe > 0:
            raise FmoesimError(
                f"--host-speed: the {r['model']} {r['policy']} run records {_speed_rule(measure)}"
            )
        return (ref / probe) ** power

    y = np.array([
        (r["replay_wall_s"] - r["replay_policy_host_s"] - r["sim_gpu_busy_s"]) * speed(r)
        / r["replay_layer_steps"]
        for r in base
    ])  # fmt: skip
    issue = [((r["replay_host_link_issue_s"] + r["replay_host_link_on_done_s"]) * speed(r),
              r["replay_transfers"]) for r in timed if not fit_transfer]  # fmt: skip
    if not counted:
        layer, access, submit = fit_linear(X[:, :2], y)
        transfer = 0.0
    elif issue:
        transfer = sum(s for s, _ in issue) / sum(n for _, n in issue)
        layer, access, submit = fit_linear(X[:, :2], y - transfer * X[:, 2])
    else:
        layer, access, submit, transfer = fit_linear(X, y)
    engine = {"host_layer_s": layer, "host_access_s": access, "host_submit_s": submit,
              "host_transfer_s": transfer}  # fmt: skip
    if host_speed:
        engine[HOST_LAUNCH_KEY if measure == "launch" else HOST_PROBE_KEY] = ref
        if exponent:
            engine[HOST_PROBE_EXPONENT_KEY] = power
    decisions: dict[str, dict[str, list[float]]] = {}
    for r in rows:
        if int(r["compute_repeat"]) != 1:
            continue
        per = r["replay_policy_host_s"] * speed(r) / r["replay_layer_steps"]
        decisions.setdefault(r["model"], {}).setdefault(r["policy"], []).append(per)
    means = {m: {p: float(np.mean(v)) for p, v in d.items()} for m, d in decisions.items()}
    return engine, means


def host_costs_of(
    preset: str, fit_model: str
) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """The host costs a profile holds, as :func:`fit_host` returns them: the engine's
    from ``fit_model``'s entry, the decisions per model."""
    from fmoesim.config.build import load_preset
    from fmoesim.engine.host import HOST_KEYS, HOST_LINK_DEPTH_KEY, HOST_SUBMIT_KEY
    from fmoesim.specs import HardwareSpec

    measured = load_preset("hardware", preset, HardwareSpec).measured or {}
    m = measured.get(fit_model) or {}
    if not all(k in m for k in HOST_KEYS):
        raise FmoesimError(f"--host-from {preset}: no host costs for {fit_model} "
                           f"(rule: {', '.join(HOST_KEYS)})")  # fmt: skip
    engine = {k: float(m[k]) for k in HOST_KEYS}
    if HOST_SUBMIT_KEY in m:
        engine[HOST_SUBMIT_KEY] = float(m[HOST_SUBMIT_KEY])
    if HOST_LINK_DEPTH_KEY in m:
        engine[HOST_LINK_DEPTH_KEY] = int(m[HOST_LINK_DEPTH_KEY])
    decisions = {model: {p: float(v) for p, v in (c.get("host_decision_s") or {}).items()}
                 for model, c in measured.items() if model != "link"}  # fmt: skip
    return engine, decisions


def launch_in_host(hw: Any, fit_model: str) -> Any:
    """``hw`` with each model's FFN launch share (``expert_launch_s``, which
    ``fmoesim-profile`` measures) taken out of its expert cost (``expert_a_s``): the host
    model's access cost, fitted on the replays, then carries the launch, and with a
    host-speed measure it follows each run's speed as the rest of the host's work does.
    Refuses a profile that measured no launch share for ``fit_model``."""
    share = ((hw.measured or {}).get(fit_model) or {}).get("expert_launch_s")
    if not share:
        raise FmoesimError(
            f"--launch-in-host: {hw.name} measured no FFN launch share for {fit_model} "
            "(rule: expert_launch_s, which fmoesim-profile measures)"
        )
    measured: dict[str, Any] = {}
    for model, coeffs in hw.measured.items():
        if isinstance(coeffs, dict) and coeffs.get("expert_launch_s"):
            c = dict(coeffs)
            c["expert_a_s"] = max(0.0, float(c["expert_a_s"]) - float(c["expert_launch_s"]))
            c["expert_launch_s"] = 0.0
            coeffs = c
        measured[model] = coeffs
    return dataclasses.replace(hw, measured=measured)


def base_profile(base: str, fit_model: str, launch: bool) -> Any:
    """The hardware preset ``base`` as the host fit starts from: with its FFN launch share
    in the host model where ``launch`` (:func:`launch_in_host`), else None (the preset as
    it is)."""
    if not launch:
        return None
    from fmoesim.config.build import load_preset
    from fmoesim.specs import HardwareSpec

    return launch_in_host(load_preset("hardware", base, HardwareSpec), fit_model)


def host_profile(
    base: str,
    engine: dict[str, float],
    decisions: dict[str, dict[str, float]],
    name: str,
    note: str,
    spec: Any = None,
) -> Any:
    """``base`` (a hardware preset; ``spec``, a :class:`fmoesim.specs.HardwareSpec`, in
    its place where given) with the host costs added to every model it measured: a
    :class:`fmoesim.specs.HardwareSpec` named ``name``."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs import HardwareSpec

    if spec is None:
        spec = load_preset("hardware", base, HardwareSpec)
    measured = {k: dict(v) for k, v in spec.measured.items()}
    for model, coeffs in measured.items():
        if model == "link":
            continue
        coeffs.update(engine)
        coeffs["host_decision_s"] = dict(decisions.get(model, {}))
    return dataclasses.replace(spec, name=name, measured=measured, source=f"{spec.source}; {note}")


def write_host_profile(
    base: str,
    engine: dict[str, float],
    decisions: dict[str, dict[str, float]],
    path: Path,
    note: str,
    spec: Any = None,
) -> Path:
    """:func:`host_profile`, written as a new preset at ``path``."""
    from replay.profile import write_profile

    return write_profile(host_profile(base, engine, decisions, path.stem, note, spec), path)


def with_link_depth(engine: dict[str, float], depth: int) -> dict[str, float]:
    """``engine`` (host costs) with the link issued by the host, ``depth`` transfers at a
    time (``host_link_depth``, :mod:`fmoesim.engine.host`); unchanged for 0.  The replay
    keeps 2 (``LinkScheduler``'s default depth)."""
    from fmoesim.engine.host import HOST_LINK_DEPTH_KEY

    if depth < 0:
        raise FmoesimError(f"--link-depth {depth}: must be 0 (off) or more")
    return {**engine, HOST_LINK_DEPTH_KEY: depth} if depth else dict(engine)


def fit_without(
    rows: Sequence[dict[str, Any]],
    base: str,
    policy: str,
    fit_model: str,
    host_speed: bool,
    modes: Sequence[str],
    link_depth: int,
    exponent: bool,
    measure: str = "probe",
    base_hw: Any = None,
    fit_transfer: bool = False,
) -> tuple[dict[str, float], Any]:
    """The engine's host costs fitted (:func:`fit_host`, its host speed by ``measure``) on
    ``rows`` without ``policy``'s runs, the link depth added (:func:`with_link_depth`), and
    ``base`` with them: the profile that simulates ``policy`` out of sample (its own
    decision cost is measured, not fitted, so it stays); ``base_hw`` replaces ``base``'s
    numbers where given (:func:`base_profile`); ``fit_transfer`` as :func:`fit_host`'s."""
    engine, decisions = fit_host(rows, fit_model, host_speed, modes, [policy], exponent,
                                 measure, fit_transfer)  # fmt: skip
    engine = with_link_depth(engine, link_depth)
    name, note = f"{base}-without-{policy}", f"fitted without {policy}"
    return engine, host_profile(base, engine, decisions, name, note, base_hw)


#: the engine costs of :func:`fits_markdown`'s columns, with their headers
FIT_COLUMNS = (
    ("host_layer_s", "a layer step"),
    ("host_access_s", "an access"),
    ("host_submit_s", "a submission"),
    ("host_transfer_s", "a started copy"),
)


def fits_markdown(fits: dict[str, dict[str, float]]) -> str:
    """The host costs of each out-of-sample fit (:func:`cross_check`), a row per left-out
    policy in microseconds, and their spread: where one row departs from the others, the
    left-out policy's runs steer every other fit."""
    head = " | ".join(f"{h}, us" for _, h in FIT_COLUMNS)
    lines = ["## Host costs of each fit", "",
             "Each policy is scored with the host costs fitted on the other policies' "
             "runs. A row that departs from the others names the policy whose runs "
             "steer every other fit; the spread is how far the runs leave the costs "
             "undetermined.", "",
             f"| fitted without | {head} |", "|---" * (len(FIT_COLUMNS) + 1) + "|"]  # fmt: skip
    for policy, engine in fits.items():
        cells = " | ".join(f"{1e6 * engine.get(k, 0.0):.1f}" for k, _ in FIT_COLUMNS)
        lines.append(f"| {policy} | {cells} |")
    if fits:
        spread = []
        for k, _ in FIT_COLUMNS:
            v = [e.get(k, 0.0) for e in fits.values()]
            spread.append(f"{1e6 * (max(v) - min(v)):.1f}")
        lines.append(f"| spread (largest - smallest) | {' | '.join(spread)} |")
    return "\n".join(lines) + "\n"


def cross_check(
    replays: Sequence[Path],
    base: str,
    fit_model: str,
    out: Path,
    meta: dict[str, str],
    host_speed: bool = False,
    modes: Sequence[str] = ("batch1",),
    link_depth: int = 0,
    exponent: bool = False,
    measure: str = "probe",
    each_repeat: bool = False,
    launch: bool = False,
    fit_transfer: bool = False,
) -> tuple[Path, dict[str, dict[str, float]]]:
    """Score each replayed policy out of sample: the engine's host costs fitted
    (:func:`fit_host`) on every other policy's runs, then that policy's runs simulated with
    them (its own decision cost is measured, not fitted, so it stays); ``link_depth`` as
    :func:`with_link_depth`, ``exponent`` and ``measure`` as :func:`fit_host`'s;
    ``each_repeat`` scores every repeat of a run as a run of its own (at its own host
    speed), not their mean; ``launch`` fits and scores with the FFN's launch share in
    the host model (:func:`launch_in_host`); ``fit_transfer`` as :func:`fit_host`'s.
    Writes the report of :func:`score` to ``out``, each fit's costs after it
    (:func:`fits_markdown`); returns it and each policy's fitted engine costs."""
    import pandas as pd

    _refuse_foreign_out(out)
    base_hw = base_profile(base, fit_model, launch)
    rows = repeat_rows(replays, base, base_hw)
    merged = read_replays(replays, merge=not each_repeat)
    policies = list(dict.fromkeys(r["policy"] for r in merged))
    by_run: dict[int, dict[str, Any]] = {}  # index in merged -> scored row
    fits: dict[str, dict[str, float]] = {}
    for p in policies:
        fits[p], hw = fit_without(rows, base, p, fit_model, host_speed, modes, link_depth,
                                  exponent, measure, base_hw, fit_transfer)  # fmt: skip
        idx = [i for i, r in enumerate(merged) if r["policy"] == p]
        by_run.update(zip(idx, score_rows([merged[i] for i in idx], base, hw), strict=True))
    scored = [by_run[i] for i in range(len(merged))]  # the replays' order
    fitted = _modes_text(modes)
    meta = {"hardware profile": f"{base}, with host costs fitted on {fit_model}'s {fitted} "
            "runs of every other policy (each policy out of sample)"
            + (", the FFN's launch share in the host model" if launch else "")
            + (", a started copy's cost fitted" if fit_transfer else ""),
            **meta}  # fmt: skip
    title = f"simulator (host costs out of sample) vs replay on {meta['device']}"
    table = pd.DataFrame(scored).assign(hardware=base)
    text = report_markdown(scored, meta) + "\n" + fits_markdown(fits)
    _write_report(out, text, table, scored, title)
    return out, fits


#: a report's title line, before the device (:func:`report_markdown`)
TITLE = "# Simulator vs replay on "
#: the heading of a cross-check report's last section, each fit's host costs
#: (:func:`fits_markdown`), which its validation.csv does not hold
FITS_HEADING = "## Host costs of each fit"


def render(out: Path) -> Path:
    """Write ``out/report.md`` anew from ``out/validation.csv``, as :func:`score` or
    :func:`cross_check` writes it, without simulating: every number is the CSV's, as it
    was scored.  What the CSV does not hold is kept from the report as it is: its header
    lines (the device, the profiles, the date scored) and a cross-check's host costs of
    each fit.  The figure is left as it is.  Rows of several profiles (the CSV's
    ``hardware``, in the order they appear) give the report of each profile in turn."""
    import itertools

    import pandas as pd

    from fmoesim.atomic import atomic_file

    report, table = out / "report.md", out / "validation.csv"
    for f in (report, table):
        if not f.is_file():
            raise FmoesimError(f"{out}: no {f.name} (rule: a report directory of '{PROG} "
                               "score' or 'cross-check')")  # fmt: skip
    old = report.read_text(encoding="utf-8")
    lines = old.split("\n")
    if not lines[0].startswith(TITLE):
        raise FmoesimError(f"{report}: its first line is not {TITLE.strip()!r}... (rule: a "
                           f"report of '{PROG} score' or 'cross-check')")  # fmt: skip
    meta = {"device": lines[0].removeprefix(TITLE)}
    for line in itertools.takewhile(lambda x: x.startswith("- "), lines[2:]):
        key, _, value = line[2:].partition(": ")
        meta[key] = value
    rule = f"rule: the validation.csv of '{PROG} score' or 'cross-check'"
    if not table.read_bytes().endswith(b"\n"):  # the writer ends every row with one
        raise FmoesimError(f"{table}: ends inside a row, cut short ({rule})")
    try:
        df = pd.read_csv(table, dtype={"policy_code": str})
    except (ValueError, UnicodeDecodeError) as exc:  # pandas' parser and empty-data errors
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FmoesimError(f"{table}: not readable as CSV ({said}; {rule})") from None
    compared = [f"{side}_{m[0]}" for m in METRICS for side in ("sim", "replay")]
    missing = [c for c in ("hardware", *KEY, *compared) if c not in df.columns]
    if missing:
        raise FmoesimError(f"{table}: column {missing[0]!r} is missing ({rule})")
    for c in compared:  # a hand edit: a number that is not one
        bad = pd.to_numeric(df[c], errors="coerce").isna() & df[c].notna()
        if bad.any():
            i = int(bad.to_numpy().argmax())
            raise FmoesimError(f"{table}: row {i + 1}: {c} = {df[c].iloc[i]!r} (rule: a number)")
    rows = df.to_dict("records")
    by_profile = {hw: [r for r in rows if r["hardware"] == hw]
                  for hw in dict.fromkeys(r["hardware"] for r in rows)}  # fmt: skip
    last = list(by_profile.values())[-1]
    text = report_markdown(last, meta, by_profile if len(by_profile) > 1 else None)
    fits = old.find(f"\n{FITS_HEADING}\n")
    if fits >= 0:
        text += old[fits:]
    with atomic_file(report) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return report


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    rp = sub.add_parser("replay", help="replay the grid's runs (a GPU)")
    rp.add_argument("--device", default="cuda")
    rp.add_argument("--out", required=True, help="directory of replay.csv")
    rp.add_argument("--models", default=",".join(g.model for g in GRID))
    rp.add_argument("--policies", default=",".join(POLICIES))
    rp.add_argument("--modes", default=",".join(MODES))
    rp.add_argument("--budgets", default=None,
                    help="comma-separated budgets in GB to keep (default: all)")  # fmt: skip
    rp.add_argument("--no-crossover", action="store_true")
    rp.add_argument("--hardware", default="h100-pcie5",
                    help="hardware preset whose chunk size the replay uses")  # fmt: skip
    rp.add_argument("--host-timers", action="store_true",
                    help="time the backend's and link scheduler's host calls (columns "
                    "replay_host_*; a timer around each call)")  # fmt: skip
    rp.add_argument("--deadline-s", type=float, default=math.inf,
                    help="start no run that would end after this many seconds")  # fmt: skip
    rp.add_argument("--repeats", type=int, default=1,
                    help="replay each run this many times, in rounds (default 1)")  # fmt: skip
    rp.add_argument("--no-gc", action="store_true",
                    help="disable Python's garbage collector during each run")  # fmt: skip
    rp.add_argument("--event-logs", action="store_true",
                    help="write each run's event log (its first repeat) to OUT/events/ "
                    "(every transfer, access and layer step; compare with 'events')")  # fmt: skip
    sp = sub.add_parser("score", help="score stored replays against the simulator")
    sp.add_argument("replays", nargs="+", help="replay.csv files or their directories")
    sp.add_argument("--hardware", required=True, help="hardware presets, comma-separated "
                    "(before, ..., after), e.g. measured/h100")  # fmt: skip
    sp.add_argument("--out", required=True, help="report directory")
    sp.add_argument("--device", default=None, help="the GPU the replays ran on (for titles)")
    hp = sub.add_parser("host-fit", help="measure the host model from stored replays")
    hp.add_argument("replays", nargs="*", help="replay.csv files or their directories "
                    "(none with --host-from)")  # fmt: skip
    hp.add_argument("--base", required=True, help="measured profile without host costs")
    hp.add_argument("--fit-model", required=True, help="model whose batch-1 runs fit the "
                    "engine's costs (the other models' runs stay out of the fit)")  # fmt: skip
    hp.add_argument("--out", required=True, help="the new profile's YAML path")
    hp.add_argument("--host-from", default=None,
                    help="take the host costs of this profile (another machine's) instead "
                    "of fitting them: an out-of-sample check")  # fmt: skip
    hp.add_argument("--fit-modes", default="batch1",
                    help="comma-separated modes whose runs fit the engine's costs (default "
                    "batch1; add online to tell the cost per layer step from the cost per "
                    "access)")  # fmt: skip
    hp.add_argument("--link-depth", type=int, default=0,
                    help="the host issues every transfer, this many at a time (the "
                    "replay's 2; default 0: the link starts each the moment it frees)")  # fmt: skip
    hp.add_argument("--probe-exponent", action="store_true",
                    help="with --host-speed: scale the host costs by the probe to the power "
                    "the host timers measure (cost ~ probe ** exponent), not 1")  # fmt: skip
    hp.add_argument("--host-speed", action="store_true",
                    help="record the fitted runs' median host probe (host_probe_s), so "
                    "scoring scales the host costs by each replayed run's own probe")  # fmt: skip
    _host_model_options(hp, full=True)
    cp = sub.add_parser("cross-check", help="score each policy with host costs fitted on "
                        "the other policies' runs (out of sample)")  # fmt: skip
    cp.add_argument("replays", nargs="+", help="replay.csv files or their directories")
    cp.add_argument("--base", required=True, help="measured profile without host costs")
    cp.add_argument("--fit-model", required=True, help="model whose runs fit the engine's "
                    "costs")  # fmt: skip
    cp.add_argument("--fit-modes", default="batch1", help="as host-fit's")
    cp.add_argument("--host-speed", action="store_true", help="as host-fit's")
    _host_model_options(cp, full=False)
    cp.add_argument("--each-repeat", action="store_true",
                    help="score every repeat of a run as a run of its own (at its own host "
                    "speed), not the repeats' mean")  # fmt: skip
    cp.add_argument("--link-depth", type=int, default=0, help="as host-fit's")
    cp.add_argument("--probe-exponent", action="store_true", help="as host-fit's")
    cp.add_argument("--out", required=True, help="report directory")
    cp.add_argument("--device", default=None, help="the GPU the replays ran on (for titles)")
    ep = sub.add_parser("events", help="compare the replay's event logs with the simulator's, "
                        "step by step")  # fmt: skip
    ep.add_argument("replays", nargs="+", help="replay.csv files or their directories")
    ep.add_argument("--logs", default=None, help="the replay's event logs: its events/ "
                    "directory or events.tar (default: none; every repeat of every run is "
                    "simulated beside its replay.csv numbers)")  # fmt: skip
    ep.add_argument("--hardware", required=True, help="one hardware profile, e.g. "
                    "measured/h100-2-host-link")  # fmt: skip
    ep.add_argument("--out", required=True, help="report directory")
    ep.add_argument("--policies", default=None, help="comma-separated policies to keep")
    ep.add_argument("--window-steps", type=int, default=32,
                    help="layer steps per timeline figure (0: no figures)")  # fmt: skip
    ep.add_argument("--device", default=None, help="the GPU the replays ran on (for titles)")
    ep.add_argument("--fit-model", default=None, help="refit --hardware's host costs on the "
                    "replays without each run's policy, on this model's runs (as "
                    "cross-check; --hardware is then the profile without host costs)")  # fmt: skip
    ep.add_argument("--fit-modes", default="batch1", help="as host-fit's")
    ep.add_argument("--host-speed", action="store_true", help="as host-fit's")
    _host_model_options(ep, full=False)
    ep.add_argument("--link-depth", type=int, default=0, help="as host-fit's")
    ep.add_argument("--probe-exponent", action="store_true", help="as host-fit's")
    wp = sub.add_parser("render", help="write a report's report.md anew from its "
                        "validation.csv, without simulating")  # fmt: skip
    wp.add_argument("reports", nargs="+", help="report directories of score or cross-check")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _host_model_options(parser: argparse.ArgumentParser, full: bool) -> None:
    """The host model's fit options (``host-fit``'s help in full, the others' "as
    host-fit's"): the host-speed measure, the FFN's launch in the host model, the started
    copy's cost fitted."""
    same = "as host-fit's"
    parser.add_argument("--host-speed-from", choices=SPEED_MEASURES, default="probe",
                        help="with --host-speed: measure each run's host speed by its probe "
                        "(default) or by its time per FFN launch (launch: the --host-timers "
                        "columns; recorded as host_launch_s)" if full else same)  # fmt: skip
    parser.add_argument("--launch-in-host", action="store_true",
                        help="take the FFN's launch share (expert_launch_s) out of the "
                        "profile's expert cost: the fitted access cost carries it"
                        if full else same)  # fmt: skip
    parser.add_argument("--fit-transfer", action="store_true",
                        help="fit the cost of a started copy (host_transfer_s) with the "
                        "others, not from the timers" if full else same)  # fmt: skip


def _modes_text(modes: Sequence[str]) -> str:
    """``modes`` in a profile's note: "batch-1 and online"."""
    return " and ".join("batch-1" if m == "batch1" else m for m in modes)


def _costs_text(engine: dict[str, float]) -> str:
    """Host costs for the terminal: seconds in microseconds, counts as they are."""
    return ", ".join(f"{k} {1e6 * v:.1f} us" if k.endswith("_s") else f"{k} {v:g}"
                     for k, v in engine.items())  # fmt: skip


def _fit_modes(arg: str) -> list[str]:
    """``--fit-modes``, checked against the grid's modes."""
    modes = names_of("--fit-modes", arg, empty_ok=True)
    for m in modes:
        if m not in MODES:
            raise FmoesimError(f"--fit-modes {m}: unknown (valid: {', '.join(MODES)})")
    return modes


def _check_replay_args(policies: Sequence[str], args: argparse.Namespace) -> None:
    """``replay``'s policies, hardware, numbers and device, checked before any run (one
    line naming the option; nothing is made)."""
    from fmoesim.config.build import check_preset_names, valid_presets
    from fmoesim.config.schema import CONF_DIR

    check_preset_names("policy", list(policies), "--policies")
    if not (CONF_DIR / "hardware" / f"{args.hardware}.yaml").is_file():
        raise FmoesimError(f"--hardware {args.hardware}: unknown hardware; valid: "
                           f"{valid_presets('hardware')}")  # fmt: skip
    if not args.deadline_s > 0:
        raise FmoesimError(f"--deadline-s {args.deadline_s:g}: must be > 0 (default: no deadline)")
    from replay.backend import check_device

    check_device(args.device)


def _run(args: argparse.Namespace) -> None:
    if args.cmd == "render":
        for d in args.reports:
            print(f"report     {render(Path(d))}")
        return
    if args.cmd == "replay":
        models = names_of("--models", args.models)
        grid = [g for g in GRID if g.model in models]
        unknown = set(models) - {g.model for g in GRID}
        if unknown:
            known = ", ".join(g.model for g in GRID)
            raise FmoesimError(f"--models {sorted(unknown)[0]}: not in the grid ({known})")
        modes = names_of("--modes", args.modes)
        for m in modes:
            if m not in MODES:
                raise FmoesimError(f"--modes {m}: unknown (valid: {', '.join(MODES)})")
        budgets = None
        if args.budgets is not None:
            try:
                budgets = [float(b) for b in names_of("--budgets", args.budgets)]
            except ValueError:
                msg = f"--budgets {args.budgets}: not comma-separated numbers"
                raise FmoesimError(msg) from None
            known_b = sorted({b for g in grid for b in g.budgets_gb})
            for b in budgets:
                if b not in known_b:
                    known = ", ".join(f"{k:g}" for k in known_b)
                    raise FmoesimError(f"--budgets {b:g}: not in the grid's budgets ({known})")
        policies = names_of("--policies", args.policies)
        _check_replay_args(policies, args)
        runs = grid_runs(grid, policies, modes, not args.no_crossover, hardware=args.hardware,
                         budgets_gb=budgets)  # fmt: skip
        if not runs:
            raise FmoesimError("--models, --modes, --policies: they select no run of the grid")
        if (why := unwritable(args.out)) is not None:  # before the device's warm-up
            raise FmoesimError(f"--out {args.out}: {why} (rule: a folder for replay.csv)")
        n = run_replays(runs, args.device, Path(args.out), args.deadline_s,
                        host_timers=args.host_timers, repeats=args.repeats,
                        gc_off=args.no_gc, event_logs=args.event_logs)  # fmt: skip
        path = Path(args.out) / "replay.csv"
        print(f"replayed {n} runs -> {path}" if path.is_file() else
              f"replayed 0 runs; {path} not written")  # fmt: skip
        return
    if args.cmd == "events" and args.fit_model is None:
        opts = (("--host-speed", args.host_speed), ("--link-depth", args.link_depth),
                ("--probe-exponent", args.probe_exponent),
                ("--host-speed-from", args.host_speed_from != "probe"),
                ("--launch-in-host", args.launch_in_host),
                ("--fit-transfer", args.fit_transfer))  # fmt: skip
        given = next((f for f, on in opts if on), None)
        if given is not None:
            raise FmoesimError(f"{given}: needs --fit-model (it shapes the refitted host costs)")
    if (
        args.cmd in ("host-fit", "cross-check", "events")
        and args.probe_exponent
        and not args.host_speed
    ):
        raise FmoesimError("--probe-exponent: needs --host-speed (it scales by the probe)")
    if (
        args.cmd in ("host-fit", "cross-check", "events")
        and args.host_speed_from != "probe"
        and not args.host_speed
    ):
        raise FmoesimError(f"--host-speed-from {args.host_speed_from}: needs --host-speed")
    if args.cmd == "host-fit":
        from fmoesim.atomic import check_file_destination

        # a refit replaces its profile (seconds of work); a folder or an unwritable place
        # is refused before the fit
        check_file_destination("--out", Path(args.out), force=True)
        if args.host_speed and args.host_from is not None:
            raise FmoesimError("--host-speed: needs replays to take the probe from, not "
                               "--host-from")  # fmt: skip
        base_hw = base_profile(args.base, args.fit_model, args.launch_in_host)
        if args.host_from is not None:
            engine, decisions = host_costs_of(args.host_from, args.fit_model)
            note = f"host costs of {args.host_from} (measured on another machine)"
        elif not args.replays:
            raise FmoesimError("host-fit: no replay.csv named (or --host-from PROFILE)")
        else:
            modes = _fit_modes(args.fit_modes)
            rows = repeat_rows([Path(p) for p in args.replays], args.base, base_hw)
            engine, decisions = fit_host(rows, args.fit_model, args.host_speed, modes,
                                         exponent=args.probe_exponent,
                                         measure=args.host_speed_from,
                                         fit_transfer=args.fit_transfer)  # fmt: skip
            fitted = _modes_text(modes)
            note = (f"host costs fitted by {PROG} host-fit on {args.fit_model}'s {fitted} "
                    f"replays, every repeat a point (engine), and every run's policy-hook "
                    f"timers (decisions)")  # fmt: skip
            if args.host_speed and args.host_speed_from == "launch":
                note += (", at the runs' median time per FFN launch; scoring scales them by "
                         "each run's own launch time")  # fmt: skip
            elif args.host_speed:
                note += (", at the runs' median host probe; scoring scales them by each "
                         "run's own probe")  # fmt: skip
                if args.probe_exponent:
                    note += " to the power the host timers measure"
        if args.link_depth:
            note += f"; the host issues every transfer, {args.link_depth} at a time"
        if args.launch_in_host:
            note += "; the FFN's launch share moved from the expert cost to the access cost"
        if args.fit_transfer:
            note += "; a started copy's cost fitted, not timed"
        engine = with_link_depth(engine, args.link_depth)
        path = write_host_profile(args.base, engine, decisions, Path(args.out), note, base_hw)
        print(_costs_text(engine))
        print(f"wrote {path}")
        return
    if (why := unwritable(args.out)) is not None:  # before the simulations
        raise FmoesimError(f"--out {args.out}: {why} (rule: a folder for the report)")
    device = args.device or "the replay's GPU"
    meta = {"device": device, "scored": dt.date.today().isoformat()}
    if args.cmd == "cross-check":
        modes = _fit_modes(args.fit_modes)
        path, fits = cross_check([Path(p) for p in args.replays], args.base, args.fit_model,
                                 Path(args.out), meta, args.host_speed, modes,
                                 args.link_depth, args.probe_exponent,
                                 args.host_speed_from, args.each_repeat,
                                 args.launch_in_host, args.fit_transfer)  # fmt: skip
        for p, engine in fits.items():
            print(f"without {p}: {_costs_text(engine)}")
        print(f"report     {path / 'report.md'}")
        return
    if args.cmd == "events":
        if "," in args.hardware:
            rule = "rule: events simulates on one; score compares several"
            raise FmoesimError(f"--hardware {args.hardware}: one hardware profile ({rule})")
        if args.window_steps < 0:
            raise FmoesimError(f"--window-steps {args.window_steps}: must be 0 (none) or more")
        pols = None if args.policies is None else names_of("--policies", args.policies)
        fit = None
        if args.fit_model is not None:
            fit = {"fit_model": args.fit_model, "host_speed": args.host_speed,
                   "modes": _fit_modes(args.fit_modes), "exponent": args.probe_exponent,
                   "link_depth": args.link_depth, "measure": args.host_speed_from,
                   "launch": args.launch_in_host, "fit_transfer": args.fit_transfer}  # fmt: skip
        logs = None if args.logs is None else Path(args.logs)
        path = events_report([Path(p) for p in args.replays], logs, args.hardware,
                             Path(args.out), meta, args.window_steps, pols, fit)  # fmt: skip
        print(f"report     {path / 'events.md'}")
        return
    hardware = names_of("--hardware", args.hardware)
    path = score([Path(p) for p in args.replays], hardware, Path(args.out), meta)
    print(f"report     {path / 'report.md'}")


if __name__ == "__main__":
    main()
