"""The runs a scoreboard reads, and its regression check: every claim it marks as
holding, rerun at a smaller size, must still hold.

:func:`points` lists the sweep points a claim reads (its policies and filter values, the
preset's values of its swept keys); :func:`plan` turns the claims' points into jobs
(each point once; a minimum-budget side as a chain of ascending budgets that stops at
the first meeting its strictest target); :func:`run_jobs` runs them on worker processes,
at full size into a results store (``fmoesim-reproduce --run``: the scores are those of
running every point of the presets) or with fewer requests (``serving.max_requests``,
and a synthetic trace of fewer requests), writing nothing; :func:`recheck` scores the
claims on small runs with the scoreboard's own rules
(:func:`fmoesim.reproduce.score.score_claim`).  A direction that holds on the full
preset can differ at a smaller size; the size is :data:`SMALL_REQUESTS` unless a caller
asks for another.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fmoesim.reproduce.claims import BOUNDS, Claim, Filter, sides_of
from fmoesim.reproduce.report import read_csv
from fmoesim.reproduce.score import YES, Score, score_claim

#: requests served per run of the small check
SMALL_REQUESTS = 4
#: a synthetic trace of the small check holds this many times the requests it serves
TRACE_FACTOR = 3
#: overrides of every small run: nothing written, no progress bars
QUIET = ("store.enabled=false", "output.write=false", "progress=false")


def _values(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


def _raw_keys(experiment: str) -> dict[str, str]:
    """The preset's swept keys without their ``+``/``++`` prefix, to the key as written
    (an override of a key the preset adds must add it the same way)."""
    import yaml

    from fmoesim.config.schema import CONF_DIR

    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    params = ((yaml.safe_load(path.read_text()).get("hydra") or {}).get("sweeper") or {}).get(
        "params"
    ) or {}
    return {k.lstrip("+"): k for k in params}


def _expand(flt: Filter) -> list[dict[str, Any]]:
    """Every single-valued filter a (possibly list-valued) filter matches."""
    out: list[dict[str, Any]] = [{}]
    for key, want in flt.items():
        out = [{**o, key: v} for o in out for v in _values(want)]
    return out


def points(claim: Claim) -> list[dict[str, Any]]:
    """The sweep points (``{policy or dotted key: value}``) that ``claim`` reads: its
    sides' filters, each swept key a side leaves open at every value the preset sweeps."""

    if claim.experiment is None:
        return []
    sides: list[Filter] = [claim.a]
    if claim.kind == "mean_relative":
        sides += [p.b for p in claim.pairs]
    elif claim.kind in ("most_points", "trend"):
        sides = [{"policy": list(claim.among)}]
    elif claim.kind == "diminishing":
        sides += [*sides_of(claim.b), claim.c]
    elif claim.kind not in BOUNDS:  # a bound reads side A only
        sides += sides_of(claim.b)
    return _side_points(claim.experiment, sides)


def floor_points(claim: Claim) -> list[dict[str, Any]]:
    """The sweep points of a claim's ``floor`` preset (every expert resident): all of
    them, under the policies it sweeps; none without a floor."""
    from fmoesim.plots.figures import sweep_params

    if claim.floor is None:
        return []
    policies = sweep_params(claim.floor).get("policy")
    return _side_points(claim.floor, [{"policy": list(policies)} if policies else {}])


def _side_points(experiment: str, sides: Sequence[Filter]) -> list[dict[str, Any]]:
    """The sweep points of ``experiment`` that filters ``sides`` read, without repeats."""
    from fmoesim.plots.figures import sweep_params

    # a side that leaves a swept key open reads every value of it (``over``, ``per``, or
    # aggregated by a_agg/b_agg), as on the full preset
    for key, values in sweep_params(experiment).items():
        if key != "policy":
            sides = [s if key in s else {**s, key: list(values)} for s in sides]
    out: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in sides:
        for p in _expand(s):  # 32000 from a claim and "32000" from a sweep are one point
            out.setdefault(_point_key(p), p)
    return list(out.values())


#: a stop rule of a chain of runs: (metric, at most); a chain stops after the run that
#: meets every rule of it
Stop = tuple[str, float]
#: one job of a plan: an experiment, its points in the order they run, and the chain's
#: stop rules (none: every point runs)
Job = tuple[str, list[dict[str, Any]], list[Stop]]


def _chain(claim: Claim, side: Filter) -> list[dict[str, Any]] | None:
    """The points of one side of a ``min_budget`` claim in ascending ``over`` order when
    they differ only in ``over`` (the side leaves it open), else None."""
    assert claim.experiment is not None and claim.over is not None
    over = claim.over
    if over in side:
        return None
    pts = _side_points(claim.experiment, [side])
    rest = {_point_key({k: v for k, v in p.items() if k != over}) for p in pts}
    try:
        values = [float(p[over]) for p in pts]
    except (KeyError, TypeError, ValueError):
        return None
    if len(rest) != 1 or len(set(values)) != len(values):
        return None
    return [p for _, p in sorted(zip(values, pts, strict=True), key=lambda vp: vp[0])]


def plan(claims: Sequence[Claim], floors: bool = True) -> list[Job]:
    """The jobs that score ``claims``: every point a claim reads, each once, and with
    ``floors`` the points of the claims' ``floor`` presets (:func:`floor_points`).

    A ``min_budget`` claim reads, on each side, the smallest swept value whose metric
    meets its target (else the largest one), so a side that sweeps ``over`` becomes a
    chain: its points in ascending ``over`` order, stopping after the first run that
    meets the strictest target of every claim reading that chain.  The values above it
    are never read, so the scores are those of running every point.  A point that
    another claim reads, or that two chains share, runs on its own instead, and its
    chain goes past it (a row it would stop at is there either way).  Chains come
    first: they are the longest jobs."""
    plain: dict[tuple[str, tuple[tuple[str, str], ...]], tuple[str, dict[str, Any]]] = {}
    chains: dict[tuple[str, tuple[Any, ...]], tuple[list[dict[str, Any]], list[Stop]]] = {}
    for c in claims:
        if c.experiment is None:
            continue
        sides: list[Filter] = [c.a, *sides_of(c.b)] if c.kind == "min_budget" else []
        for side in sides:
            chain = _chain(c, side)
            if chain is None:
                continue
            assert c.metric is not None  # Claim.check
            key = (c.experiment, tuple(_point_key(p) for p in chain))
            stops = chains.setdefault(key, (chain, []))[1]
            if (c.metric, min(c.targets)) not in stops:
                stops.append((c.metric, min(c.targets)))
        chained = {_point_key(p) for s in sides for p in (_chain(c, s) or [])}
        for p in points(c):
            if _point_key(p) not in chained:
                plain.setdefault((c.experiment, _point_key(p)), (c.experiment, p))
        if floors and c.floor is not None:
            for p in floor_points(c):
                plain.setdefault((c.floor, _point_key(p)), (c.floor, p))
    seen: dict[tuple[str, tuple[tuple[str, str], ...]], int] = {}
    for (exp, pkeys), _ in chains.items():
        for k in pkeys:
            seen[(exp, k)] = seen.get((exp, k), 0) + 1
    jobs: list[Job] = []
    for (exp, _), (chain, stops) in chains.items():
        own = []
        for p in chain:
            k = (exp, _point_key(p))
            if k in plain or seen[k] > 1:
                plain.setdefault(k, (exp, p))  # shared: runs on its own
            else:
                own.append(p)
        if own:
            jobs.append((exp, own, stops))
    return jobs + [(exp, [p], []) for exp, p in plain.values()]


def _point_key(point: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A point's identity: its keys and values as text, in key order."""
    return tuple(sorted((k, str(v)) for k, v in point.items()))


def overrides(experiment: str, point: dict[str, Any], requests: int | None) -> list[str]:
    """The ``fmoesim`` overrides of one run of ``point``: the preset's own run (the
    sweep's overrides) when ``requests`` is None, else a small one."""
    raw = _raw_keys(experiment)
    out = [f"experiment={experiment}"]
    out += [f"{raw.get(k, k)}={v}" for k, v in point.items()]
    if requests is None:
        return out
    return [*out, f"serving.max_requests={requests}", *QUIET]


#: composed configs of the group overrides (``experiment=``, ``policy=``, ``model=``)
#: seen in this process, to which :func:`compose_point` applies the value overrides
_GROUP_CONFIGS: dict[tuple[str, ...], Any] = {}


def compose_point(overrides: list[str]) -> Any:
    """The config Hydra composes for ``overrides``, at the cost of copying one: the
    group overrides' composition is composed once per process and kept, and the value
    overrides (``cache.budget_gb=6``, ``++policy.rho=0.1``) are applied to a copy of it
    by Hydra's own step for them, as its compose does after the defaults list.  Any
    error in that path recomposes in full, so errors read as
    :func:`fmoesim.cli.main.compose_config`'s."""
    import copy

    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from fmoesim.cli.main import _is_group, check_added_keys, compose_config

    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
        groups = tuple(o.input_line for o in parsed if o.input_line and _is_group(o.key_or_group))
        values = [o for o in parsed if o.input_line not in groups]
        check_added_keys([o.input_line for o in values if o.input_line])
        base = _GROUP_CONFIGS.get(groups)
        if base is None:
            base = _GROUP_CONFIGS[groups] = compose_config(list(groups))
        cfg = copy.deepcopy(base)
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except Exception:  # noqa: BLE001 - the full compose says what is wrong, in one line
        return compose_config(overrides)
    return cfg


def small_config(experiment: str, point: dict[str, Any], requests: int) -> Any:
    """The config of one small run of ``point``: :func:`overrides`, and on a synthetic
    workload a trace of :data:`TRACE_FACTOR` times ``requests`` requests (the rest are
    what an offline preset holds in for the policy to learn from)."""
    cfg = compose_point(overrides(experiment, point, requests))
    if cfg.workload.kind == "synthetic":
        cfg.workload.synthetic.num_requests = TRACE_FACTOR * requests
    return cfg


def _config(experiment: str, point: dict[str, Any], requests: int | None, store: str) -> Any:
    """A run's config: the preset's own run of ``point`` into the store ``store`` (its
    row the one ``fmoesim experiment=<name> <point>`` adds) when ``requests`` is None,
    else :func:`small_config`."""
    if requests is None:
        return compose_point([*overrides(experiment, point, None), f"store.dir={store}"])
    return small_config(experiment, point, requests)


def _trace_keys(point: dict[str, Any]) -> dict[str, Any]:
    """The part of ``point`` that chooses its synthetic trace (model and workload keys);
    points that differ elsewhere (the policy, the budget...) read the same trace."""
    return {k: v for k, v in point.items() if k.split(".")[0] in ("model", "workload")}


def _meets(row: dict[str, Any], stop: Stop) -> bool:
    """Whether ``row`` meets a stop rule (a missing or NaN metric does not)."""
    value = row.get(stop[0])
    return value is not None and float(value) <= stop[1]


def _run_job(
    job: tuple[str, list[dict[str, Any]], list[Stop], int | None, str],
) -> list[dict[str, Any]]:
    """The summary rows of one :data:`Job` (with the requests per run, None for the
    preset's own runs, and the store they go to): its points in order, up to the first
    that meets every stop rule.  A full-size run prints one line as it finishes (a
    point the store holds is not run again); a failing run raises
    :class:`fmoesim.errors.FmoesimError` naming it."""
    from fmoesim.cli.main import format_line, run_config
    from fmoesim.config.build import one_line
    from fmoesim.errors import FmoesimError

    experiment, pts, stops, requests, store = job
    rows = []
    for point in pts:
        ov = " ".join(overrides(experiment, point, None))
        try:
            rows.append(run_config(_config(experiment, point, requests, store), multirun=True))
        except Exception as exc:  # noqa: BLE001 - every failure becomes one line
            raise FmoesimError(f"run {ov} failed: {one_line(exc)}") from None
        if requests is None:
            note = " (in the store)" if rows[-1].get("done_already") else ""
            print(f"[run] {ov}: {format_line(rows[-1])}{note}", flush=True)
        if stops and all(_meets(rows[-1], s) for s in stops):
            break
    return rows


def run_jobs(
    jobs_list: Sequence[Job], requests: int | None, jobs: int, store: Path | None = None
) -> list[dict[str, Any]]:
    """The summary rows of the runs of ``jobs_list`` (:func:`plan`), in its order, on
    ``jobs`` worker processes (in this process when 1): small runs of ``requests``
    requests, writing nothing, or with ``requests=None`` the presets' own runs into the
    results store ``store`` (points it holds are not run again, so an interrupted run
    resumes).  Each experiment's inputs and each synthetic trace are prepared here
    first, once: parallel workers must not race to write the same trace.  The first
    failing run stops the rest (its error names it)."""
    from fmoesim.cli.main import _trace_path
    from fmoesim.cli.plot_cli import prepare_inputs
    from fmoesim.config.build import build_run
    from fmoesim.config.schema import PROJECT_ROOT

    if requests is None and store is None:
        raise ValueError("run_jobs: the presets' own runs need a store")
    into = str(store) if store is not None else ""
    traces: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
    for experiment, pts, _ in jobs_list:
        for point in pts:
            sig = (experiment, _point_key(_trace_keys(point)))
            if sig in traces:
                continue
            if not any(t[0] == experiment for t in traces):
                prepare_inputs(experiment, PROJECT_ROOT)
            traces.add(sig)
            _trace_path(build_run(_config(experiment, _trace_keys(point), requests, into)))
    from fmoesim.cli.workers import run_queue

    work = [(e, pts, stops, requests, into) for e, pts, stops in jobs_list]
    return [row for rows in run_queue(_run_job, work, jobs) for row in rows]


#: at most this many worker processes by default (each holds its own runs' state)
MAX_DEFAULT_JOBS = 8


def default_jobs() -> int:
    """Worker processes for :func:`recheck` by default: the cores this process may use,
    at most :data:`MAX_DEFAULT_JOBS`."""
    import os

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1
    return max(1, min(cores, MAX_DEFAULT_JOBS))


def holding(catalog: Sequence[Claim], csv_path: Path) -> list[Claim]:
    """The claims of ``catalog`` that the scoreboard at ``csv_path`` marks as holding
    (none when the file does not exist)."""
    if not csv_path.is_file():
        return []
    held = {r["id"] for r in read_csv(csv_path) if r["holds"] == YES}
    return [c for c in catalog if c.id in held]


def recheck(claims: Sequence[Claim], requests: int = SMALL_REQUESTS, jobs: int = 1) -> list[Score]:
    """Each claim's :class:`Score` on small runs of the points it reads (:func:`plan`:
    each point run once, shared between claims), on ``jobs`` worker processes (one
    queue for all the experiments' points; the rows, and so the scores, do not depend
    on ``jobs``)."""
    import pandas as pd

    rows = run_jobs(plan(claims, floors=False), requests, jobs)  # the floors hold nothing
    results = pd.DataFrame(rows) if rows else pd.DataFrame()
    return [score_claim(c, results, all_runs=True) for c in claims]
