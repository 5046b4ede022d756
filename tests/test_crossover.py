"""The crossover study (:mod:`fmoesim.plots.crossover`): exact compute scaling, ratios
that are TPOT(policy) / TPOT(LRU) of direct runs, the boundary and cell logic, and the
four files with their caption."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pandas as pd
import pytest
from hydra.utils import instantiate

from fmoesim.config.build import load_preset
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.simulate import simulate
from fmoesim.plots import crossover as xo
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec

MODEL = "olmoe-1b-7b"


@pytest.mark.parametrize("hw_name", ["rtx3090-pcie4", "fmoe-testbed"])
@pytest.mark.parametrize("model_name", ["mixtral-8x7b", "deepseek-v2-lite"])
def test_compute_scaling_is_exact(hw_name: str, model_name: str) -> None:
    """Red when one compute coefficient (roofline or ``measured``) does not scale by
    exactly ``s``, or when the PCIe bandwidth is not multiplied by ``b``."""
    model = load_preset("model", model_name, ModelSpec)
    hw = load_preset("hardware", hw_name, HardwareSpec)
    base = ComputeModel.from_specs(model, hw)
    for s in (0.25, 3.0, 32.0):
        scaled_hw = xo.scale_hardware(hw, s, 4.0)
        assert scaled_hw.pcie_gbps == pytest.approx(hw.pcie_gbps * 4.0, rel=1e-12)
        scaled = ComputeModel.from_specs(model, scaled_hw)
        for f in fields(ComputeModel):
            want = getattr(base, f.name) * s
            assert getattr(scaled, f.name) == pytest.approx(want, rel=1e-12, abs=0.0), f.name


def test_grid_ratio_is_direct_tpot_ratio() -> None:
    """Red when a table's ratio is not TPOT(policy) / TPOT(LRU) of separate direct runs
    at the same scaled hardware and budget (a wrong baseline, cell or factor)."""
    pols = ["fmoe", "mixtral-offloading"]
    table = xo.run_grid([MODEL], pols, [0.5, 8.0], [1.0, 4.0], requests=2, jobs=1)
    assert len(table) == 2 * 2 * 2
    assert set(table["policy"]) == set(pols)
    cfg, spec = xo._spec(MODEL, "lru", 2, xo.HARDWARE, xo.OUTPUT_TOKENS_MAX)
    from fmoesim.config.schema import PROJECT_ROOT
    from fmoesim.trace.reader import read_trace

    trace = read_trace(PROJECT_ROOT / table["trace"].iloc[0])
    budget = xo.budget_experts(spec.model) * spec.model.expert_size_bytes
    assert xo.budget_experts(spec.model) == -(-spec.model.num_layers * spec.model.num_experts // 4)

    def tpot(policy: str, s: float, b: float) -> float:
        c, sp = xo._spec(MODEL, policy, 2, xo.HARDWARE, xo.OUTPUT_TOKENS_MAX)
        hw = xo.scale_hardware(sp.hardware, s, b)
        res = simulate(trace, sp.model, hw, instantiate(c.policy), budget, serving=sp.serving)
        return float(res.summary["tpot_mean_s"])

    for r in table.itertuples():
        lru = tpot("lru", r.compute_factor, r.bandwidth_factor)
        pol = tpot(r.policy, r.compute_factor, r.bandwidth_factor)
        assert r.lru_tpot_s == pytest.approx(lru, rel=1e-12)
        assert r.ratio == pytest.approx(pol / lru, rel=1e-12)
        assert r.requests == 2


def _hand_table() -> pd.DataFrame:
    # ratios over compute factors 1, 2, 4, 8 at bandwidth x1 and x2
    ratios = {
        ("a", 1.0): [1.2, 0.9, 1.1, 0.8],  # beats LRU at x2 and x8: from x8 on
        ("a", 2.0): [1.2, 0.99, 0.98, 0.97],  # from x2
        ("b", 1.0): [1.1, 1.05, 1.01, 1.0],  # never (1.0 ties)
        ("b", 2.0): [0.9, 0.9, 1.01, 1.0 - 1e-12],  # rounding below 1 is a tie: never
        ("c", 1.0): [1.2, 0.9, 1.0, 1.0 + 1e-12],  # ties at the end: from x2
    }
    rows = []
    for (p, b), rs in ratios.items():
        for c, r in zip([1.0, 2.0, 4.0, 8.0], rs, strict=True):
            rows.append({"model": "m", "policy": p, "compute_factor": c, "bandwidth_factor": b,
                         "ratio": r})  # fmt: skip
    return pd.DataFrame(rows)


def test_boundary_and_cells_on_a_hand_made_table() -> None:
    """Red when a cell counts as beating LRU at ratio >= 1 (or at a rounding-sized dip
    below it), or the crossover ignores a later loss or reports the first win instead of
    where the run of wins to the largest factor starts (ties there not ending it)."""
    t = _hand_table()
    win = xo.beats(t)
    assert win.tolist() == [r < 1.0 - 1e-6 for r in t["ratio"]]
    assert not win[(t["policy"] == "b") & (t["ratio"] == 1.0)].any()
    start = xo.crossover_compute(t)
    assert start == {
        ("m", "a", 1.0): 8.0,
        ("m", "a", 2.0): 2.0,
        ("m", "b", 1.0): None,
        ("m", "b", 2.0): None,
        ("m", "c", 1.0): 2.0,
    }


def test_render_writes_four_files_with_caption(tmp_path: Path) -> None:
    """Red when render misses one of png/pdf/md/csv, or the caption does not name the
    trace, the requests served and whether the routing is synthetic or real."""
    t = _hand_table()
    n = len(t)
    t = t.assign(
        tpot_s=0.1, lru_tpot_s=0.1, compute_to_transfer=t["compute_factor"] * 0.1,
        layer_compute_s=1e-3, expert_transfer_s=1e-2, trace="traces/default",
        trace_source="synthetic", requests=[2] * n, trace_requests=[32] * n,
        budget_experts=64, hardware="rtx3090-pcie4",
    )  # fmt: skip
    t.attrs["skipped"] = {"m/moepic": "budget too small"}
    paths = xo.render(t, tmp_path / "figs", command="fmoesim-plot crossover --requests 2")
    assert sorted(p.name for p in paths) == sorted(
        f"crossover.{e}" for e in ("png", "pdf", "md", "csv")
    )
    assert all(p.stat().st_size > 0 for p in paths)
    md = (tmp_path / "figs" / "crossover.md").read_text()
    assert "traces/default" in md
    assert "2 of 32 requests served" in md
    assert "synthetic routing" in md
    assert "skipped: m/moepic: budget too small" in md
    assert "- regenerate: `fmoesim-plot crossover --requests 2`" in md
    assert "| x1 | 1.200 | 0.900 | 1.100 | 0.800 | x8 |" in md
    back = pd.read_csv(tmp_path / "figs" / "crossover.csv")
    assert back["ratio"].tolist() == pytest.approx(t["ratio"].tolist())
    assert not list((tmp_path / "figs").glob(".*"))  # no temporaries left


def test_cli_crossover_not_in_all_and_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """Red when ``crossover`` mixes with the store figures, or a bad option or preset
    does not give one line and exit status 2."""
    from fmoesim.cli.plot_cli import main

    said = {  # red if LRU alone runs its whole grid before the empty table is found, or
        # --name writes its four files into a subfolder
        "lru": "--policies lru: no policy to set against lru",
        "a/b": "--name a/b: not a file name",
        "fmoe-fig11": "give it alone",
    }
    for argv in (
        ["crossover", "--models", "no-such-model", "--requests", "1"],
        ["crossover", "--requests", "0"],
        ["fmoe-fig11", "crossover"],
        ["crossover", "--policies", "lru", "--requests", "1"],
        ["crossover", "--name", "a/b", "--requests", "1"],
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and "error" in err, err
        for key, text in said.items():
            if key in argv:
                assert text in err, err


def test_the_regenerate_line_is_the_command_that_ran() -> None:
    """Red when a narrowed grid's page says ``fmoesim-plot crossover`` alone (following it
    starts the full grid of every model, policy and factor), or writes a factor or a
    folder that does not read back as the one that ran (1/128 as 0, a path's space)."""
    import argparse

    args = argparse.Namespace(
        models=["olmoe-1b-7b"], policies=list(xo.POLICIES), compute=[0.25, 1.0, 32.0],
        bandwidth=list(xo.BANDWIDTH_FACTORS), requests=1, hardware=xo.HARDWARE, jobs=1,
        out="out/figures", name=xo.NAME,
    )  # fmt: skip
    assert xo.command_line(args) == (
        "fmoesim-plot crossover --models olmoe-1b-7b --compute 1/4,1,32 --requests 1 "
        "--out out/figures"
    )
    default = argparse.Namespace(
        models=list(xo.MODELS), policies=list(xo.POLICIES), compute=list(xo.COMPUTE_FACTORS),
        bandwidth=list(xo.BANDWIDTH_FACTORS), requests=xo.REQUESTS, hardware=xo.HARDWARE,
        jobs=2, out="results/figures", name=xo.NAME,
    )  # fmt: skip
    assert xo.command_line(default) == "fmoesim-plot crossover"
    # factors no short fraction gives exactly, and a folder with a space, read back as given
    odd = argparse.Namespace(**{**vars(default), "compute": [1 / 128, 0.01], "out": "my figs"})
    line = xo.command_line(odd)
    assert line == "fmoesim-plot crossover --compute 0.0078125,0.01 --out 'my figs'"
    assert xo._factors("0.0078125,0.01") == [1 / 128, 0.01]
