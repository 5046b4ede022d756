"""``fmoesim-plot``: the papers' figures and tables from the results store.

Examples::

    fmoesim-plot --list                      # the figures and the sweeps they read
    fmoesim-plot all --run --jobs 2          # run every sweep missing from the store, then plot
    fmoesim-plot fmoe-fig11 moepic-tab1      # plot from what the store holds
    fmoesim-plot crossover --models olmoe-1b-7b   # the crossover study (its own runs)

``--run`` runs ``fmoesim -m experiment=<name>`` for each figure's sweep (runs already
in the store are skipped, so an interrupted ``--run`` resumes), with the joblib
launcher on ``--jobs`` local cores when more than one.  Figures go to
``results/figures/<name>.png``, ``.pdf`` and ``.md`` (caption and numbers).  Exit status
2 and one line on stderr for bad input.  ``crossover`` is not a store figure: it runs
its own grid, alone (:mod:`fmoesim.plots.crossover`; ``fmoesim-plot crossover --help``).
"""

from __future__ import annotations

import argparse
import importlib.util
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fmoesim.errors import FmoesimError, run_or_exit

PROG = "fmoesim-plot"
AZURE_CSV = "traces/.cache/azure-synthetic.csv"


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
    """Write the generated input an experiment reads when it is missing: fmoe-fig10's
    synthetic Azure-format arrivals (:data:`AZURE_CSV`, :func:`write_azure_synthetic`)."""
    if experiment == "fmoe-fig10" and not (root / AZURE_CSV).is_file():
        write_azure_synthetic(root / AZURE_CSV)


def run_sweep(experiment: str, store: Path, jobs: int, root: Path) -> float:
    """Run one experiment's sweep (done runs skipped); return its wall time."""
    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run

    prepare_inputs(experiment, root)
    # a synthetic trace is generated here, once, not by parallel jobs racing to write it
    _trace_path(build_run(compose_config([f"experiment={experiment}"])))
    cmd = [
        sys.executable, "-m", "fmoesim.cli.main", "-m", f"experiment={experiment}",
        f"store.dir={store}", f"hydra.sweep.dir={store.parent / 'sweeps' / experiment}",
    ]  # fmt: skip
    if jobs > 1 and importlib.util.find_spec("hydra_plugins.hydra_joblib_launcher"):
        cmd += ["hydra/launcher=joblib", f"hydra.launcher.n_jobs={jobs}"]
    t0 = time.perf_counter()
    # the sweep's "[sweep k/N]" lines are passed on as they come (its progress)
    with (
        tempfile.TemporaryFile("w+") as errf,  # a file, not a pipe: it cannot fill and block
        subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=errf, text=True) as p,
    ):
        assert p.stdout is not None
        for line in p.stdout:
            if line.startswith(("[sweep", "sweep")):
                print(line.rstrip(), flush=True)
        p.wait()
        errf.seek(0)
        err = errf.read()
    if p.returncode != 0:
        last = (err.strip().splitlines() or ["(no output)"])[-1]
        raise FmoesimError(f"sweep experiment={experiment} failed: {last}")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["crossover"]:
        from fmoesim.plots.crossover import main as crossover_main

        crossover_main(argv[1:], PROG)
        return
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", default=["all"], help="figure names, or all")
    ap.add_argument("--store", default="results/store", help="results store (%(default)s)")
    ap.add_argument("--out", default="results/figures", help="figure directory (%(default)s)")
    ap.add_argument("--run", action="store_true", help="run the sweeps missing from the store")
    ap.add_argument("--jobs", type=int, default=2, help="local cores for --run (%(default)s)")
    ap.add_argument("--list", action="store_true", help="list the figures and exit")
    args = ap.parse_args(argv)
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    from fmoesim.config.schema import PROJECT_ROOT
    from fmoesim.plots.figures import FIGURES, render
    from fmoesim.results.store import load_results

    if args.list:
        for name, f in FIGURES.items():
            print(f"{name:<22} experiment={f.experiment:<22} {f.title}")
        print(f"{'crossover':<22} {'(its own runs, alone)':<33} Where prefetching beats LRU")
        return
    names = list(FIGURES) if args.names in (["all"], []) else args.names
    if "crossover" in names:
        raise FmoesimError("figure 'crossover': give it alone: fmoesim-plot crossover [options]")
    unknown = [n for n in names if n not in FIGURES]
    if unknown:
        raise FmoesimError(f"figure {unknown[0]!r}: unknown; valid: all, {', '.join(FIGURES)}")
    if args.jobs < 1:
        raise FmoesimError(f"--jobs {args.jobs}: must be >= 1")
    store = Path(args.store).resolve()
    if args.run:
        total = 0.0
        for exp in dict.fromkeys(FIGURES[n].experiment for n in names):
            dt = run_sweep(exp, store, args.jobs, PROJECT_ROOT)
            total += dt
            print(f"experiment {exp}: {dt:.0f} s", flush=True)
        print(f"all sweeps: {total / 60:.1f} min", flush=True)
    results = load_results(store)
    out = Path(args.out)
    for n in names:
        paths = render(n, results, out)
        print(f"{n:<22} {paths[0]}  (+ .pdf, .md)")


if __name__ == "__main__":
    main()
