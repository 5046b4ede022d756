"""``fmoesim-plot``: the papers' figures and tables from the results store.

Examples::

    fmoesim-plot --list                      # the figures and the sweeps they read
    fmoesim-plot all --run --jobs 2          # run every sweep missing from the store, then plot
    fmoesim-plot fmoe-fig11 moepic-tab1      # plot from what the store holds
    fmoesim-plot crossover --models olmoe-1b-7b   # the crossover study (its own runs)

``--run`` runs every point of the figures' sweeps (as ``fmoesim -m
experiment=<name>`` would; runs already in the store are skipped, so an interrupted
``--run`` resumes), all points in one queue on ``--jobs`` local processes.  Figures go to
``results/figures/<name>.png``, ``.pdf`` and ``.md`` (caption and numbers).  Exit status
2 and one line on stderr for bad input: a ``--store`` that is no folder (without
``--run``, which makes it), a store file that is not a run's row, or a store without
runs of a figure's experiment (checked for every figure before any is written).
``crossover`` is not a store figure: it runs its own grid, alone
(:mod:`fmoesim.plots.crossover`; ``fmoesim-plot crossover --help``).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from fmoesim.errors import ArgumentParser, FmoesimError, counted, run_or_exit

PROG = "fmoesim-plot"
STORE = "results/store"  # the default --store
OUT = "results/figures"  # the default --out
AZURE_CSV = "traces/.cache/azure-conv-sample.csv"


def write_azure_synthetic(path: Path, num_requests: int = 64, seed: int = 0) -> Path:
    """A synthetic arrival trace in the Azure LLM inference format
    (``TIMESTAMP,ContextTokens,GeneratedTokens``): bursty gaps (gamma, shape 0.5, mean
    15 s; coefficient of variation 1.4), lognormal lengths.  Not real data: pass the real
    Azure trace with ``serving.arrivals_csv=`` to use it instead.  Written atomically."""
    import numpy as np
    import pandas as pd

    from fmoesim.atomic import atomic_file

    rng = np.random.default_rng(seed)
    gaps = rng.gamma(0.5, 30.0, size=num_requests)
    gaps[0] = 0.0
    t0 = pd.Timestamp("2024-01-01 00:00:00")
    df = pd.DataFrame(
        {
            "TIMESTAMP": [
                (t0 + pd.Timedelta(seconds=float(s))).strftime("%Y-%m-%d %H:%M:%S.%f")
                for s in np.cumsum(gaps)
            ],
            "ContextTokens": np.clip(rng.lognormal(np.log(128), 0.8, num_requests), 1, 1024).astype(
                int
            ),
            "GeneratedTokens": np.clip(rng.lognormal(np.log(64), 0.5, num_requests), 1, 256).astype(
                int
            ),
        }
    )
    with atomic_file(path) as tmp:
        df.to_csv(tmp, index=False)
    return path


def prepare_inputs(experiment: str, root: Path) -> None:
    """Write the generated input an experiment reads, where it is missing or holds other
    bytes: fmoe-fig10's arrival log, 64 requests as fMoE §6.3 samples them from Azure's
    conversation trace (:data:`AZURE_CSV`,
    :func:`fmoesim.workload.arrival_samples.write_azure_conv_sample`)."""
    if experiment == "fmoe-fig10":
        from fmoesim.workload.arrival_samples import write_azure_conv_sample

        write_azure_conv_sample(root / AZURE_CSV, num_requests=64, seed=0)


def _run_point(point: list[str]) -> tuple[str, bool]:
    """Run one point of a sweep (:func:`fmoesim.cli.main.run_config` as a sweep job:
    skipped if the store holds it, quiet); return its one-line result and whether it
    was in the store already."""
    from fmoesim.cli.main import compose_config, format_line, run_config

    row = run_config(compose_config(point), multirun=True)
    return format_line(row), bool(row.get("done_already"))


def _prepare_traces(points: list[list[str]]) -> None:
    """Generate each synthetic trace the points read, once, here: parallel workers must
    not race to write the same trace.  Points that differ only in overrides outside
    ``model`` and ``workload`` (the policy, the budget...) read the same trace."""
    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run

    seen: set[tuple[str, ...]] = set()
    for point in points:
        sig = tuple(o for o in point if o.lstrip("+~").split("=")[0].split(".")[0]
                    in ("experiment", "model", "workload"))  # fmt: skip
        if sig not in seen:
            seen.add(sig)
            _trace_path(build_run(compose_config(list(sig))))


def run_experiments(experiments: list[str], store: Path, jobs: int, root: Path) -> float:
    """Run every point of the experiments' sweeps into ``store`` (points the store holds
    are skipped, so an interrupted run resumes) and return the wall time.

    The points of all the experiments form one queue for ``jobs`` worker processes, so a
    core never waits for an experiment's slowest run before the next experiment starts;
    a point runs as ``fmoesim experiment=<name> <point>`` would, and its store row is the
    same.  One progress line per point as it finishes; the first failing point stops
    the rest, with one line naming it."""
    from fmoesim.cli.main import experiment_points
    from fmoesim.cli.workers import run_queue

    t0 = time.perf_counter()
    points: list[list[str]] = []
    for exp in experiments:
        prepare_inputs(exp, root)
        pts = experiment_points(exp)
        _prepare_traces(pts)
        points += pts
    into = f"store.dir={store}"  # each run's store row goes there
    n = len(points)
    exps, procs = counted(len(experiments), "experiment"), counted(jobs, "process", "processes")
    print(f"runs: {counted(n, 'point')} of {exps} on {procs}", flush=True)
    done = [0]

    def report(k: int, out: tuple[str, bool]) -> None:
        done[0] += 1
        note = " (in the store)" if out[1] else ""
        print(f"[run {done[0]}/{n}] {' '.join(points[k])}: {out[0]}{note}", flush=True)

    def failed(k: int, exc: BaseException) -> FmoesimError:
        from fmoesim.config.build import one_line

        return FmoesimError(f"run {' '.join(points[k])} failed: {one_line(exc)}")

    run_queue(_run_point, [[*pt, into] for pt in points], jobs, report, failed)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["crossover"]:
        from fmoesim.plots.crossover import main as crossover_main

        crossover_main(argv[1:], PROG)
        return
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["all"], help="figure names (--list), or all; "
                    "crossover alone, with its own options (crossover --help)")  # fmt: skip
    ap.add_argument("--store", default=STORE, help="results store (%(default)s)")
    ap.add_argument("--out", default=OUT, help="figure directory (%(default)s)")
    ap.add_argument("--run", action="store_true", help="run the sweeps missing from the store")
    ap.add_argument("--jobs", type=int, default=2, help="local cores for --run (%(default)s)")
    ap.add_argument("--list", action="store_true", help="list the figures and exit")
    args = ap.parse_intermixed_args(argv)  # names may follow options: --run fig9 --jobs 1 fig10
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    from fmoesim.atomic import unwritable
    from fmoesim.config.schema import PROJECT_ROOT
    from fmoesim.errors import AmbiguousRunsError
    from fmoesim.plots.figures import (
        FIGURES,
        experiment_rows,
        missing_runs,
        render,
        without_run_hint,
    )
    from fmoesim.results.store import check_store_dir, load_results

    if args.list:
        w = max(len(n) for n in FIGURES)
        x = max(len(f"experiment={f.experiment}") for f in FIGURES.values())
        for name, f in FIGURES.items():
            print(f"{name:<{w}} {'experiment=' + f.experiment:<{x}} {f.title}")
        print(f"{'crossover':<{w}} {'(its own runs, alone)':<{x}} Where prefetching beats LRU")
        return
    names = list(FIGURES) if args.names in (["all"], []) else args.names
    if "crossover" in names:
        raise FmoesimError("figure 'crossover': give it alone: fmoesim-plot crossover [options]")
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise FmoesimError(
            f"figure {unknown[0]!r}: unknown; valid: all, {', '.join(FIGURES)}; crossover alone"
        )
    if args.jobs < 1:
        raise FmoesimError(f"--jobs {args.jobs}: must be >= 1")
    check_store_dir(args.store, f"{PROG} --run makes it and runs the figures' sweeps", args.run)
    if (why := unwritable(args.out)) is not None:  # before the sweeps of --run
        raise FmoesimError(f"--out {args.out}: {why} (rule: a folder to write the figures into)")
    store = Path(args.store).resolve()
    if args.run:
        exps = list(dict.fromkeys(FIGURES[n].experiment for n in names))
        dt = run_experiments(exps, store, args.jobs, PROJECT_ROOT)
        print(f"all sweeps: {dt / 60:.1f} min", flush=True)
    results = load_results(store, columns=("experiment",))
    short: list[tuple[str, str]] = []  # (figure, what its store lacks)
    for n in names:  # every figure's runs, before any figure is written
        f = FIGURES[n]
        try:
            df, _ = experiment_rows(results, f.experiment, timed=f.timed, what=f"figure {n}")
        except AmbiguousRunsError:
            raise
        except FmoesimError as exc:  # none of the preset's runs (of this code, timed)
            short.append((n, without_run_hint(str(exc)).removeprefix(f"figure {n}: ")))
            continue
        gone = missing_runs(df, f.experiment)
        if gone:
            more = f" and {len(gone) - 1} more" if len(gone) > 1 else ""
            short.append((n, f"the store lacks the run at {gone[0]}{more}"))
    if short:
        first, why = short[0]
        others = f"; and {counted(len(short) - 1, 'figure')} more" if len(short) > 1 else ""
        figs = " ".join(n for n, _ in short)
        raise FmoesimError(
            f"figure {first}: {why} (--store {args.store}{others}) (rule: a figure is drawn "
            f"from every run of its preset; run: {PROG} {figs} --run --store {args.store})"
        )
    out = Path(args.out)
    where = "".join(
        f" {flag} {shlex.quote(value)}"
        for flag, value, default in (("--store", args.store, STORE), ("--out", args.out, OUT))
        if value != default
    )
    for n in names:
        paths = render(n, results, out, f"{PROG} {n} --run{where}")
        print(f"{n:<22} {paths[0]}  (+ .pdf, .md)")


if __name__ == "__main__":
    main()
