"""The notebooks run top to bottom; their cells assert on what they compute."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat", reason="needs the dev extra (nbformat)")
nbclient = pytest.importorskip("nbclient", reason="needs the dev extra (nbclient)")

ROOT = Path(__file__).resolve().parents[1]


def execute(name: str, env: dict[str, str]) -> object:
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        client = nbclient.NotebookClient(
            nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
        )
        client.execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return nb


def images(nb: object) -> int:
    return sum(
        "image/png" in out.get("data", {})
        for cell in nb.cells  # type: ignore[attr-defined]
        if cell.cell_type == "code"
        for out in cell.get("outputs", [])
    )


def test_policy_comparison_runs_on_an_empty_store(tmp_path):
    nb = execute("policy_comparison.ipynb", {"FMOESIM_NOTEBOOK_STORE": str(tmp_path / "store")})
    assert len(list((tmp_path / "store").glob("*.parquet"))) == 6  # its own small sweep
    assert images(nb) == 1  # the trade-off plot
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "mean TPOT (ms)" in text and "moe-infinity" in text


def test_trace_analysis_runs_on_the_bundled_trace():
    nb = execute("trace_analysis.ipynb", {})
    assert images(nb) == 3  # entropy, reuse, co-activation
