"""The default install is the simulator alone: ``pip install .`` (what ``make run``
installs) brings no torch, transformers, matplotlib or scipy, and the simulator runs,
writes its results and its store row without them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
#: what the simulator may need at run time; anything heavier goes into an extra
SIMULATOR_DEPS = {"numpy", "pandas", "pyarrow", "hydra-core", "tqdm", "mypy-extensions"}
HEAVY = ("torch", "transformers", "matplotlib", "scipy")

_BLOCKED_RUN = """
import sys
for name in {heavy!r}:
    sys.modules[name] = None  # import raises ImportError, find_spec gives None: not installed
from fmoesim.config.build import load_preset
from fmoesim.specs import ModelSpec
from fmoesim.workload.synthetic import SyntheticConfig, generate
generate(load_preset("model", "olmoe-1b-7b", ModelSpec), SyntheticConfig(num_requests=2), "syn")
from fmoesim.cli.main import main
main({argv!r})
"""


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def test_default_dependencies_are_the_simulators() -> None:
    """Red when torch, matplotlib or scipy goes back into ``[project] dependencies``."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {_name(r) for r in meta["dependencies"]} <= SIMULATOR_DEPS
    extras = meta["optional-dependencies"]
    assert "matplotlib" in {_name(r) for r in extras["plot"]}
    assert {"torch", "transformers"} <= {_name(r) for r in extras["collect"]}


def test_simulator_runs_without_the_heavy_packages(tmp_path: Path) -> None:
    """A synthetic trace and a timed run with torch, transformers, matplotlib and scipy
    made unimportable: the trace is generated; the run simulates, writes its results (all
    but the plot, which it says it skipped) and its store row.  Red when a module on the
    simulator's path imports one of them (e.g. ``scipy.signal`` in the workload model,
    ``matplotlib`` in the run's plot) or when a missing plotting library fails the run."""
    argv = [
        "cache.budget_gb=12",
        f"output.dir={tmp_path / 'runs'}",
        "output.name=slim",
        f"store.dir={tmp_path / 'store'}",
        "progress=false",
    ]
    code = _BLOCKED_RUN.format(heavy=HEAVY, argv=argv)
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "syn" / "trace.json").is_file()
    assert "Traceback" not in proc.stderr
    run = tmp_path / "runs" / "slim"
    assert (run / "summary.parquet").is_file() and (run / "transfers.parquet").is_file()
    assert not (run / "hit_rate.png").exists()
    assert "matplotlib" in proc.stdout + proc.stderr  # the skipped plot is explained
    assert len(list((tmp_path / "store").glob("*.parquet"))) == 1
