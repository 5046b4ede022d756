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


def text_of(nb: object) -> str:
    return "".join(
        o.get("text", "")
        for c in nb.cells  # type: ignore[attr-defined]
        if c.cell_type == "code"
        for o in c.outputs
    )


def test_policy_comparison_runs_on_an_empty_store(tmp_path):
    """Red if the notebook fails on an empty store, or writes its sample sweep into the
    store it reads (where it would mix with the user's runs)."""
    env = {"FMOESIM_NOTEBOOK_STORE": str(tmp_path / "store"),
           "FMOESIM_NOTEBOOK_SAMPLE_STORE": str(tmp_path / "sample")}  # fmt: skip
    nb = execute("policy_comparison.ipynb", env)
    assert len(list((tmp_path / "sample").glob("*.parquet"))) == 6  # its own small sweep
    assert not (tmp_path / "store").exists()
    assert images(nb) == 1  # the trade-off plot
    text = text_of(nb)
    assert "mean TPOT (ms)" in text and "moe-infinity" in text


def test_policy_comparison_shows_the_users_runs(tmp_path):
    """The notebook on an empty store (its sample sweep), then the user's own runs (two
    policies, one budget) and the notebook again: it compares the user's runs and runs
    no sample sweep.  Red if the sample sweep was kept in the user's store, where its
    setting (more runs) is then shown instead of the user's."""
    import subprocess
    import sys

    store = tmp_path / "store"
    env = {"FMOESIM_NOTEBOOK_STORE": str(store),
           "FMOESIM_NOTEBOOK_SAMPLE_STORE": str(tmp_path / "sample")}  # fmt: skip
    execute("policy_comparison.ipynb", env)  # the sample sweep
    for policy in ("lru", "lfu"):
        p = subprocess.run(
            [sys.executable, "-m", "fmoesim.cli.main", f"policy={policy}", "cache.budget_gb=12",
             "serving.max_requests=1", "output.write=false", "progress=false",
             f"store.dir={store}"],
            capture_output=True, text=True, cwd=ROOT,
        )  # fmt: skip
        assert p.returncode == 0, p.stderr
    text = text_of(execute("policy_comparison.ipynb", env))
    assert "2 runs of ['lfu', 'lru']" in text and "the sample sweep" not in text


def test_trace_analysis_runs_on_the_bundled_trace():
    nb = execute("trace_analysis.ipynb", {})
    assert images(nb) == 3  # entropy, reuse, co-activation
    # top-2 of 8 experts with the lift's random baseline taken out: a layer's strongest
    # pair lifts above 1 (red if the raw lift, below 1 by construction, is shown)
    line = next(t for t in text_of(nb).splitlines() if t.startswith("strongest pair"))
    assert "[" in line and min(float(x) for x in line.split("[")[1].split()[:4]) > 1


def test_trace_analysis_on_top_1_routing_has_no_pairs(tmp_path):
    """Red if the co-activation cell divides by the random baseline of a top-1 model
    (zero: k - 1 = 0) instead of saying that there are no pairs."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs import ModelSpec
    from fmoesim.workload.synthetic import SyntheticConfig, generate

    model = load_preset("model", "llama-4-scout", ModelSpec)
    assert model.top_k == 1
    cfg = SyntheticConfig(num_requests=2, output_tokens_median=4, prompt_tokens_median=8)
    generate(model, cfg, tmp_path / "t")
    nb = execute("trace_analysis.ipynb", {"FMOESIM_NOTEBOOK_TRACE": str(tmp_path / "t")})
    assert "top-1 routing: a token picks one expert a layer" in text_of(nb)
    assert images(nb) == 2
