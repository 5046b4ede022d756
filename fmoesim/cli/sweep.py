"""Sweep progress: a Hydra callback that numbers each job of a ``--multirun`` sweep
against the sweep's size and, at the end, says where the results are.

A sweep prints a start line, one line per job (``[sweep k/N] overrides: hit rate ...,
TPOT ...``) and an end line; every run's full summary table only with ``fmoesim -v``
(``output.verbose=true``).  Hydra's own log lines (``Launching N jobs``, ``#k : ...``)
are off at level WARNING (``conf/config.yaml``) unless ``-v`` turns them on.

Registered in ``conf/config.yaml`` (``hydra.callbacks.sweep_progress``).  Job-level
callbacks run where the job runs (in the worker process under joblib, SLURM or Ray),
so the count uses Hydra's job number, not a counter of this process.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback

from fmoesim.errors import exit_stdout_closed


def sweep_size(overrides: list[str]) -> int:
    """Number of jobs a basic sweep over ``overrides`` makes (the product of the
    lengths of its comma lists and ranges; 1 without any), as
    :func:`fmoesim.cli.main.sweep_points` expands them."""
    from fmoesim.cli.main import sweep_points

    return len(sweep_points(overrides, {}))


#: overrides not worth repeating on every job's line
_QUIET = ("output.", "store.", "progress", "workload.path", "hydra", "model.")


def _total(hydra_cfg: Any) -> int:
    """Jobs of the sweep: command-line sweeps plus ``hydra.sweeper.params`` (an
    experiment preset's), a command-line value replacing a preset's for the same key."""
    from fmoesim.cli.main import sweep_points

    params = hydra_cfg.sweeper.get("params") or {}
    return len(sweep_points(list(hydra_cfg.overrides.task), dict(params)))


def _as_typed(override: str) -> str:
    """``override`` as a command line spells it: the sweeper hands a boolean back as
    Python's ``True`` / ``False``, the config's ``true`` / ``false``."""
    key, eq, value = override.partition("=")
    return f"{key}={value.lower()}" if eq and value in ("True", "False") else override


def _say(line: str) -> None:
    """Print ``line`` now, with its newline in the same write: the joblib launcher's
    workers share one stdout, and ``print`` writes the text and the newline apart, two
    writes on an unbuffered stdout (``PYTHONUNBUFFERED``), so two workers' lines could
    run together.  A closed stdout ends the sweep quietly (Hydra would only warn about a
    callback's error and go on)."""
    try:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()
    except BrokenPipeError:
        exit_stdout_closed()


class SweepProgress(Callback):
    """Prints ``[sweep k/N] overrides: hit rate ..., TPOT ...`` per job and where the
    results are."""

    def __init__(self) -> None:
        self.total = 0

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        """Count the jobs."""
        self.total = _total(config.hydra)
        _say(f"sweep: {self.total} runs -> {config.hydra.sweep.dir}")

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """One line per finished job."""
        hc = config.hydra
        if hc.mode is None or str(hc.mode) != "RunMode.MULTIRUN":
            return
        total = self.total or _total(hc)
        from fmoesim.cli.main import format_line

        status = "failed"
        try:
            row = job_return.return_value
            status = format_line(row) + (" (done already)" if row.get("done_already") else "")
        except Exception:  # noqa: BLE001 - a failed job has no row; its error is Hydra's
            pass
        swept = " ".join(
            _as_typed(o)
            for o in job_return.overrides
            if not o.split("=")[0].startswith(_QUIET) and len(o) <= 60
        )
        _say(f"[sweep {int(hc.job.num) + 1}/{total}] {swept}: {status}")

    def on_multirun_end(self, config: Any, **kwargs: Any) -> None:
        """Where the results are."""
        store = config.store.dir if config.store.enabled else None
        where = f"results store {store} (fmoesim.results.load_results({store!r}))"
        _say(
            f"sweep done: {self.total} runs; "
            + (where if store else "store disabled")
            + f"; Hydra's record {config.hydra.sweep.dir}"
        )


__all__ = ["SweepProgress", "sweep_size"]
