"""Paper figures: every figure draws from store rows shaped like its experiment's sweep
(built from the preset's own sweep parameters, so presets and drawers cannot drift
apart), writes PNG, PDF and a caption naming the trace, the requests served of it and
whether its routing is real or synthetic; one colour, marker and dash pattern per policy;
equal series stay visible and are named; legends never cover data; latency figures read
timed runs only; bad names are one line."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from fmoesim.config.build import preset_names
from fmoesim.config.schema import CONF_DIR
from fmoesim.plots.figures import (
    FIGURES,
    draw_figure,
    experiment_rows,
    min_budgets,
    render,
    sweep_params,
)
from fmoesim.plots.run import draw_run, plot_run, run_caption
from fmoesim.plots.style import POLICY_COLORS, POLICY_MARKS, policy_color, policy_marks


def _number_or_text(val: str) -> object:
    """A swept value as a config holds it: an int, a float, or text (``speculative``)."""
    for kind in (int, float):
        try:
            return kind(val)
        except ValueError:
            pass
    return val


def fake_rows(experiment: str) -> list[dict]:
    """One row per job of the experiment's sweep, with made-up but well-formed metrics."""
    cfg = yaml.safe_load((CONF_DIR / "experiment" / f"{experiment}.yaml").read_text())
    swept = cfg["hydra"]["sweeper"]["params"]
    # the preset's model (a figure may read the paper's numbers for it)
    model = next((d["override /model"] for d in cfg.get("defaults", [])
                  if isinstance(d, dict) and "override /model" in d), "mixtral-8x7b")  # fmt: skip
    params = {k.lstrip("+"): str(v).split(",") for k, v in swept.items()}
    rng = np.random.default_rng(0)
    rows = []
    for combo in itertools.product(*params.values()):
        conf: dict = {"policy": {}, "serving": {"batch_size": 1}, "cache": {},
                      "model": {"name": model, "top_k": 4}}  # fmt: skip
        row = {"experiment": experiment, "model": model, "hardware": "rtx3090-pcie4",
               "trace": "traces/default", "trace_source": "synthetic", "budget_gb": 24.0,
               "experts_per_layer": 0, "requests": 16}  # fmt: skip
        for key, val in zip(params, combo, strict=True):
            if key == "policy":
                row["policy"] = val
                continue
            if key == "model":  # a config group: rows name it, configs hold its preset
                row["model"] = val
                conf["model"] = {"name": val, "top_k": 4}
                continue
            node = conf
            *parents, leaf = key.split(".")
            for p in parents:
                node = node.setdefault(p, {})
            node[leaf] = _number_or_text(val)
            if key == "cache.budget_gb":
                row["budget_gb"] = float(val)
            if key == "cache.experts_per_layer":
                row["experts_per_layer"] = int(val)
        e2e = rng.uniform(1, 10, 8)
        row.update(
            config_json=json.dumps(conf), hit_rate=rng.uniform(0.2, 0.9),
            late_rate=rng.uniform(0, 0.3),
            ttft_mean_s=rng.uniform(0.5, 2), tpot_mean_s=rng.uniform(0.1, 0.4),
            stall_s=rng.uniform(1, 100), pcie_bytes=rng.uniform(1e9, 1e11),
            e2e_mean_s=float(e2e.mean()), e2e_p50_s=float(np.median(e2e)),
            e2e_p99_s=float(e2e.max()), request_e2e_s=list(e2e),
            policy_mean_semantic_score=rng.uniform(0.5, 1),
            policy_mean_trajectory_score=rng.uniform(0.5, 1),
            policy_mean_configurations=float(rng.integers(0, 4)),
            policy_mean_split_ratio=rng.uniform(0.3, 0.7),
            policy_mean_store_mb=rng.uniform(1, 200),
            prefill_tokens_per_s=rng.uniform(50, 2000),
            request_tpot_s=list(rng.uniform(0.1, 0.4, 24)),
            shift_recovery_requests=float(rng.integers(0, 10)),
            vram_footprint_bytes=(row["budget_gb"] + rng.uniform(1, 4)) * 1e9,
            layer_hit_rate=list(rng.uniform(0.2, 0.9, 24)),
            layer_stall_s=list(rng.uniform(0, 1, 24)),
            layer_spec_recall=list(rng.uniform(0.3, 0.9, 24)),
        )  # fmt: skip
        rows.append(row)
    return rows


@pytest.fixture(scope="module")
def store_df() -> pd.DataFrame:
    exps = dict.fromkeys(f.experiment for f in FIGURES.values())
    return pd.DataFrame([r for e in exps for r in fake_rows(e)])


@pytest.mark.parametrize("name", list(FIGURES))
def test_every_figure_renders_with_a_synthetic_caption(tmp_path, store_df, name):
    paths = render(name, store_df, tmp_path)
    assert [p.suffix for p in paths] == [".png", ".pdf", ".md"]
    assert paths[0].stat().st_size > 5000 and paths[1].stat().st_size > 1000
    md = paths[2].read_text()
    assert "traces/default (synthetic routing from fmoesim's workload model, not real; " in md
    assert "16 of 32 requests served" in md
    assert f"fmoesim-plot {name} --run" in md
    assert md.count("|") > 6  # the numbers as a table
    assert not list(tmp_path.glob(".*"))  # no temp file left


def test_rows_and_caption_follow_the_presets_model_order(store_df):
    """Red when a figure's rows or its caption list the models in the store's order (its
    files' hashes, which move with every code change) instead of the preset's sweep
    order: the committed figures would change at each redraw."""
    rows = store_df[store_df["experiment"] == "fmoe-fig16"]
    swept = sweep_params("fmoe-fig16")["model"]
    for shuffled in (rows, rows.iloc[::-1], rows.sample(frac=1.0, random_state=3)):
        df, _ = experiment_rows(shuffled, "fmoe-fig16", timed=False)
        assert list(dict.fromkeys(df["model"])) == swept
        assert draw_figure("fmoe-fig16", shuffled).setting.startswith(", ".join(swept) + " on ")


def test_every_preset_policy_has_its_own_colour():
    presets = preset_names("policy")
    assert set(presets) <= set(POLICY_COLORS)
    assert len(set(POLICY_COLORS.values())) == len(POLICY_COLORS)
    assert policy_color("lru") == POLICY_COLORS["lru"]
    assert policy_color("unknown-x") not in POLICY_COLORS.values()
    assert set(presets) <= set(POLICY_MARKS)
    assert len(set(POLICY_MARKS.values())) == len(POLICY_MARKS)  # no two policies alike
    assert policy_marks("lru") == POLICY_MARKS["lru"]


def test_ambiguous_stale_or_incomplete_rows_are_refused(tmp_path, store_df):
    from fmoesim.errors import FmoesimError
    from fmoesim.results.store import code_version

    fig11 = store_df[store_df.experiment == "fmoe-fig11"]
    twice = pd.concat([store_df, fig11.iloc[[3]]], ignore_index=True)
    with pytest.raises(
        FmoesimError, match=r"2 runs for the point policy=\S+ model=mixtral-8x7b cache.budget_gb="
    ):
        render("fmoe-fig11", twice, tmp_path)
    stale = store_df.assign(code_version="0123456789ab")
    with pytest.raises(FmoesimError, match="runs are from other code versions"):
        render("fmoe-fig11", stale, tmp_path)
    current = store_df.assign(code_version=code_version())
    assert render("fmoe-fig11", current, tmp_path)[0].is_file()
    lacking = store_df.drop(columns=["policy_mean_semantic_score"])
    with pytest.raises(FmoesimError, match="fmoe-fig14a: the store's rows lack"):
        render("fmoe-fig14a", lacking, tmp_path)


def test_min_budget_by_hand():
    df = pd.DataFrame(
        {
            "policy": ["a"] * 3 + ["b"] * 3,
            "budget_gb": [2, 4, 8] * 2,
            "tpot_mean_s": [0.5, 0.3, 0.2, 0.6, 0.5, 0.25],
        }  # fmt: skip
    )
    m = min_budgets(df, [0.3, 0.22])
    assert m["a"] == [4.0, 8.0]
    assert m["b"][0] == 8.0 and np.isnan(m["b"][1])
    # the footprint of the run at that budget, not its budget (red when it reads the
    # largest meeting run's, or the budget column)
    m = min_budgets(df.assign(vram=[10, 11, 12, 20, 21, 22]), [0.3], "vram")
    assert m == {"a": [11.0], "b": [22.0]}


def test_missing_runs_and_bad_names_are_one_line(tmp_path):
    def plot(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "fmoesim.cli.plot_cli", *args],
                              capture_output=True, text=True, timeout=120)  # fmt: skip

    p = plot("nosuch", "--store", str(tmp_path))
    assert p.returncode == 2 and p.stderr.count("\n") == 1
    assert "figure 'nosuch': unknown; valid: all, fmoe-fig4" in p.stderr
    p = plot("fmoe-fig11", "fmoe-fig9", "--store", str(tmp_path), "--out", str(tmp_path / "f"))
    assert p.returncode == 2
    assert p.stderr.strip() == (
        "fmoesim-plot: error: figure fmoe-fig11: no runs of experiment fmoe-fig11 in the "
        f"store (--store {tmp_path}; and 1 figure more) (rule: a figure is drawn from every "
        f"run of its preset; run: fmoesim-plot fmoe-fig11 fmoe-fig9 --run --store {tmp_path})"
    )
    # every run but one: refused naming it (red if drawn without it, as a partial store
    # was: a bar or a point silently missing)
    from fmoesim.results.store import code_version

    store = tmp_path / "store"
    store.mkdir()
    rows = fake_rows("moe-infinity-tab5")
    for i, row in enumerate(rows[:-1]):
        pd.DataFrame([{**row, "code_version": code_version(), "timing": True}]).to_parquet(
            store / f"{i}.parquet"
        )
    p = plot("moe-infinity-tab5", "--store", str(store), "--out", str(tmp_path / "f"))
    assert p.returncode == 2 and not (tmp_path / "f").exists(), p.stderr
    assert p.stderr.strip().startswith(
        "fmoesim-plot: error: figure moe-infinity-tab5: the store lacks the run at "
        f"policy={rows[-1]['policy']} (--store {store}) (rule: a figure is drawn from every run"
    ), p.stderr


@pytest.mark.parametrize("exp", preset_names("experiment"))
def test_experiment_presets_take_effect(exp):
    """An experiment's settings beat conf/config.yaml's (it comes after _self_) and every
    preset feeds a figure or is a scoreboard claim's floor (every expert resident)."""
    from fmoesim.cli.main import compose_config
    from fmoesim.reproduce.claims import PAPERS, load_catalog

    raw = yaml.safe_load((CONF_DIR / "experiment" / f"{exp}.yaml").read_text())
    c = compose_config([f"experiment={exp}"])
    assert c.experiment_name == exp and c.progress is False
    for section in ("serving", "engine", "output"):
        for key, value in (raw.get(section) or {}).items():
            assert c[section][key] == value, f"{exp}: {section}.{key}"
    floors = {c.floor for paper in PAPERS for c in load_catalog(paper) if c.floor}
    assert exp in {f.experiment for f in FIGURES.values()} | floors


def test_experiment_points_are_the_presets_sweep():
    """--run's points are the preset's sweep in Hydra's order (a bug that dropped the
    preset's ``hydra.sweeper.params`` would give one point, the default policy)."""
    from fmoesim.cli.main import experiment_points

    pts = experiment_points("moepic-fig8")
    assert len(pts) == 4 * 14 and all(p[0] == "experiment=moepic-fig8" for p in pts)
    assert pts[0][1:] == ["policy=mixtral-offloading", "cache.budget_gb=2"]
    assert pts[-1][1:] == ["policy=moepic", "cache.budget_gb=26"]


def test_run_experiments_reports_the_failing_point_and_stops(tmp_path, monkeypatch, capsys):
    """One queue over every experiment's points; a failing point stops the rest with one
    line naming it (a bug that swallowed the failure, or ran on past it, turns this red)."""
    from fmoesim.cli import plot_cli
    from fmoesim.errors import FmoesimError

    ran: list[list[str]] = []

    def fake(point: list[str]) -> tuple[str, bool]:
        ran.append(point)
        if "policy=dependency" in point:
            raise ValueError("boom\nsecond line")
        return "hit rate 1.00%, TPOT 2.0 ms", len(ran) == 1

    monkeypatch.setattr(plot_cli, "_run_point", fake)
    monkeypatch.setattr(plot_cli, "_prepare_traces", lambda points: None)
    exps = ["moe-infinity-tab5", "moe-infinity-tab2-3"]
    with pytest.raises(FmoesimError) as err:
        plot_cli.run_experiments(exps, tmp_path / "store", 1, tmp_path)
    assert str(err.value) == (
        "run experiment=moe-infinity-tab2-3 policy=dependency failed: boom second line"
    )
    assert [p[0] for p in ran] == ["experiment=moe-infinity-tab5"] * 4 + [
        "experiment=moe-infinity-tab2-3"
    ] * 2
    assert all(p[-1] == f"store.dir={tmp_path / 'store'}" for p in ran)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "runs: 8 points of 2 experiments on 1 process"
    assert out[1].startswith("[run 1/8] experiment=moe-infinity-tab5 policy=")
    assert out[1].endswith(": hit rate 1.00%, TPOT 2.0 ms (in the store)")
    assert len(out) == 1 + 5


def test_synthetic_azure_arrivals_read_back(tmp_path):
    from fmoesim.cli.plot_cli import write_azure_synthetic
    from fmoesim.workload.synthetic import read_azure_csv

    lengths = read_azure_csv(write_azure_synthetic(tmp_path / "a.csv", num_requests=64))
    assert len(lengths.arrival_s) == 64 and lengths.arrival_s[0] == 0.0
    gaps = np.diff(lengths.arrival_s)
    assert (gaps >= 0).all()
    assert 10 < gaps.mean() < 22 and gaps.std() / gaps.mean() > 1.1  # mean 15 s, bursty


def test_moepic_ablation_run_is_long_enough_for_the_configurator() -> None:
    """Table 3's "w/o CCA" only differs from MoEpic if the configurator runs: the tokens
    the experiment's requests process must exceed its τ (at the paper's 5,000 they did
    not, and the two rows were identical)."""
    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run
    from fmoesim.trace import read_trace

    cfg = compose_config(["experiment=moepic-tab3"])
    tr = read_trace(_trace_path(build_run(cfg)))
    n = cfg.serving.max_requests
    tokens = int(tr.prompt_tokens[:n].sum() + tr.output_tokens[:n].sum() - n)
    assert cfg.policy.tau_tokens < tokens, (cfg.policy.tau_tokens, tokens)


@pytest.fixture(autouse=True)
def _close_figures():
    import matplotlib.pyplot as plt

    yield
    plt.close("all")


def _fig11_rows(**extra: object) -> pd.DataFrame:
    """Fig. 11's rows of one model (the preset sweeps three; the figure draws one)."""
    df = pd.DataFrame(fake_rows("fmoe-fig11"))
    return df[df.model == "mixtral-8x7b"].reset_index(drop=True).assign(**extra)


def test_identical_series_stay_distinct_and_are_named(tmp_path):
    """DeepSpeed's and ProMoE's TPOT lines made equal: both stay visible (their own
    marker and dash pattern, the earlier line drawn wider) and the caption says they
    coincide."""
    df = _fig11_rows()
    ds = df.policy == "deepspeed"
    for col in ("tpot_mean_s", "hit_rate"):
        df.loc[df.policy == "promoe", col] = df.loc[ds, col].to_numpy()
    drawing = draw_figure("fmoe-fig11", df)
    lines = {ln.get_label(): ln for ln in drawing.fig.axes[0].get_lines()}
    a, b = lines["deepspeed"], lines["promoe"]
    assert np.array_equal(a.get_ydata(), b.get_ydata())
    assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
    assert a.get_linewidth() > b.get_linewidth() and a.get_markersize() > b.get_markersize()
    assert drawing.notes == ["deepspeed and promoe coincide (identical values) in mean TPOT (ms)"]
    assert "deepspeed and promoe coincide" in drawing.fig.texts[-1].get_text().replace("\n", " ")
    md = render("fmoe-fig11", df, tmp_path)[2].read_text()
    assert "- note: deepspeed and promoe coincide (identical values) in mean TPOT (ms)" in md
    md = render("fmoe-fig11", _fig11_rows(), tmp_path)[2].read_text()
    assert "coincide" not in md


def _legend_clear_of_data(fig) -> list:
    """The legends of ``fig`` after drawing, each checked to lie inside the figure and
    outside every axes' data area."""
    fig.canvas.draw()
    legends = [*fig.legends, *(ax.get_legend() for ax in fig.axes if ax.get_legend())]
    for leg in legends:
        box = leg.get_window_extent()
        for ax in fig.axes:
            assert not box.overlaps(ax.get_window_extent()), (leg, ax.get_ylabel())
        assert fig.bbox.contains(box.x0, box.y0) and fig.bbox.contains(box.x1, box.y1)
    return legends


#: the figures with a legend (the others name their series on the x axis)
WITH_LEGEND = {"fmoe-fig4", "fmoe-fig10", "fmoe-fig11", "fmoe-fig13", "fmoe-fig14a",
               "fmoe-fig14b", "fmoe-fig16", "moe-infinity-fig9", "moe-infinity-fig9-gpu-rich",
               "moe-infinity-fig11", "moe-infinity-fig11-nllb", "moe-infinity-fig12",
               "moe-infinity-tab7", "moe-infinity-tab7-nllb", "moe-infinity-tab7-arctic",
               "moe-infinity-tab5", "moe-infinity-tab5-switch", "moe-infinity-tab5-nllb",
               "moe-infinity-fig9-switch", "moe-infinity-fig9-nllb", "moe-infinity-fig12-nllb",
               "moe-infinity-tab5-arctic", "moepic-fig2b", "moepic-fig4", "moepic-fig7",
               "moepic-tab1", "moepic-fig8", "moepic-fig8-mixtral", "moepic-fig7-qwen"}  # fmt: skip


@pytest.mark.parametrize("name", list(FIGURES))
def test_legends_never_cover_data(store_df, name):
    legends = _legend_clear_of_data(draw_figure(name, store_df).fig)
    assert len(legends) == (name in WITH_LEGEND)


def test_run_figure_legend_is_above_the_bars(tmp_path):
    """The per-run plot: the legend of the 32-layer stacked bars sits outside both axes
    and clear of the title; the caption names the trace, the requests served and the
    routing."""
    acc = np.tile([90, 5, 5], (32, 1))
    fig = draw_run(acc, np.ones(32), "lru · mixtral-8x7b · 24 GB", "trace: x")
    (legend,) = _legend_clear_of_data(fig)
    assert not legend.get_window_extent().overlaps(fig._suptitle.get_window_extent())
    cap = run_caption("traces/default", "synthetic", requests_served=12)
    assert cap == (
        "trace: traces/default (synthetic routing from fmoesim's workload model, not real; "
        "12 of 32 requests served)"
    )
    assert run_caption("traces/default", "synthetic", 12, timed=False) == (
        cap + "; hit-rate-only: no stall"
    )
    assert "16 others held in" in run_caption("traces/default", "synthetic", 16,
                                              held_in_fraction=0.5)  # fmt: skip
    plot_run(acc, np.ones(32), "t", tmp_path / "a.png", trace="traces/default",
             trace_source="synthetic", requests_served=12)  # fmt: skip
    plot_run(acc, np.ones(32), "t", tmp_path / "b.png", "trace: as given")
    assert (tmp_path / "a.png").stat().st_size > 5000 and (tmp_path / "b.png").is_file()


def test_caption_gives_requests_served_and_real_or_synthetic(tmp_path):
    """A 12-of-32 sweep says so and says synthetic; an imported trace says real; runs
    that hold requests in say how many."""
    drawing = draw_figure("fmoe-fig11", _fig11_rows(requests=12))
    text = drawing.fig.texts[-1].get_text().replace("\n", " ")
    for part in ("traces/default", "12 of 32 requests served", "synthetic routing", "not real"):
        assert part in text and part in drawing.trace
    md = render("fmoe-fig11", _fig11_rows(requests=12), tmp_path)[2].read_text()
    assert "traces/default (synthetic routing from fmoesim's workload model, not real; " in md
    assert "12 of 32 requests served" in md

    real = tmp_path / "imported"
    real.mkdir()
    (real / "trace.json").write_text(json.dumps({"num_requests": 40}))
    drawing = draw_figure("fmoe-fig11", _fig11_rows(trace=str(real), trace_source="importer",
                                                    requests=40))  # fmt: skip
    assert f"{real} (real routing, imported from a published trace; all 40 requests " in (
        drawing.trace
    )
    assert "synthetic" not in drawing.trace

    rows = pd.DataFrame(fake_rows("fmoe-fig14a"))
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"serving": {"held_in_fraction": 0.5}}) for c in rows.config_json
    ]
    drawing = draw_figure("fmoe-fig14a", rows)
    assert "16 of 32 requests served, 16 others held in for the policy to learn from" in (
        drawing.trace
    )


def test_latency_figures_read_timed_runs_only(tmp_path):
    """Hit-rate-only reruns of a latency figure's sweep (latencies NaN) in the same
    store are left out, by the ``timing`` column or, without it, by the config; a figure
    of hit rates keeps them; a store of untimed runs only is refused."""
    from fmoesim.errors import FmoesimError

    timed = _fig11_rows()
    untimed = timed.assign(tpot_mean_s=np.nan, ttft_mean_s=np.nan, hit_rate=0.0)
    mixed = pd.concat([timed.assign(timing=True), untimed.assign(timing=False)])
    md = render("fmoe-fig11", mixed, tmp_path)[2].read_text()
    assert "nan" not in md and "25 runs" in md and "25 hit-rate-only runs left out" in md
    assert md == render("fmoe-fig11", timed, tmp_path)[2].read_text().replace(
        "(experiment=fmoe-fig11)", "(experiment=fmoe-fig11), timed runs only "
        "(25 hit-rate-only runs left out)")  # fmt: skip
    by_config = untimed.assign(
        config_json=[json.dumps(json.loads(c) | {"engine": {"timing": False}})
                     for c in untimed.config_json]
    )  # fmt: skip
    assert "nan" not in render("fmoe-fig11", pd.concat([timed, by_config]), tmp_path)[2].read_text()
    with pytest.raises(FmoesimError, match="fmoe-fig11: plots latencies, but .* hit-rate-only"):
        render("fmoe-fig11", untimed.assign(timing=False), tmp_path)
    tab1 = pd.DataFrame(fake_rows("moepic-tab1")).assign(timing=False, tpot_mean_s=np.nan)
    assert "20 runs" in render("moepic-tab1", tab1, tmp_path)[2].read_text()


def test_online_figure_names_its_arrivals():
    """Fig. 10 serves online: its caption says where the arrival times came from. Red if
    the caption of a synthetic trace made from an arrival log says only "the trace's
    times" (hiding the log), names the log for a recorded trace, or leaves out gamma
    arrivals' rate or burstiness."""
    rows = pd.DataFrame(fake_rows("fmoe-fig10"))
    online = {"mode": "online", "arrivals": "csv", "arrivals_csv": "traces/.cache/az.csv"}
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"serving": online}) for c in rows.config_json
    ]
    drawing = draw_figure("fmoe-fig10", rows)
    assert drawing.setting.endswith(", online serving, arrivals from traces/.cache/az.csv")
    assert "online" not in draw_figure("fmoe-fig11", _fig11_rows()).setting
    # the preset's own setting: a synthetic trace takes lengths and times from a log
    online = {"mode": "online", "arrivals": "trace"}
    workload = {"kind": "synthetic", "synthetic": {"arrivals_csv": "traces/.cache/a.csv"}}
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"serving": online, "workload": workload})
        for c in rows.config_json
    ]
    drawing = draw_figure("fmoe-fig10", rows)
    assert drawing.setting.endswith(
        ", online serving, lengths and arrivals from traces/.cache/a.csv"
    )
    # gamma arrivals: the rate and the burstiness
    online = {"mode": "online", "arrivals": "gamma", "rate_rps": 0.5, "arrival_cv": 4.0}
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"serving": online}) for c in rows.config_json
    ]
    assert draw_figure("fmoe-fig10", rows).setting.endswith(
        ", online serving, gamma arrivals at 0.5 requests/s (gaps' CV 4.0)"
    )
    online = {"mode": "online", "arrivals": "trace"}
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"serving": online}) for c in rows.config_json
    ]
    # a recorded trace's own times say so (no log named)
    workload = {"kind": "trace", "synthetic": {"arrivals_csv": "traces/.cache/a.csv"}}
    rows["config_json"] = [
        json.dumps(json.loads(c) | {"workload": workload}) for c in rows.config_json
    ]
    assert draw_figure("fmoe-fig10", rows).setting.endswith(
        ", online serving, arrivals at the trace's times"
    )


def test_the_figure_list_is_aligned(capsys: pytest.CaptureFixture[str]) -> None:
    """Red when a figure name longer than the column (moe-infinity-tab2-3-arctic) pushes
    its experiment and title out of line with the others."""
    from fmoesim.cli.plot_cli import main

    main(["--list"])
    lines = capsys.readouterr().out.splitlines()
    starts = {ln.index("experiment=") for ln in lines if "experiment=" in ln}
    assert len(lines) > 10 and len(starts) == 1


def test_a_store_with_two_runs_for_a_point_scores_nothing(tmp_path, store_df):
    """A sweep of an experiment with other overrides (a what-if) written into the
    preset's store doubles its points.  Red if the scoreboard turns the claims that read
    those points into "not computed" and writes itself anyway (exit 0, the docs'
    tables emptied), instead of one line naming the point and exit status 2 with
    nothing written; or if the figure's refusal does not count the other points."""
    import subprocess
    import sys

    from fmoesim.errors import AmbiguousRunsError
    from fmoesim.reproduce.claims import load_catalog
    from fmoesim.reproduce.score import score_claim
    from fmoesim.results.store import code_version

    fig11 = store_df[store_df.experiment == "fmoe-fig11"]
    twice = pd.concat([store_df, fig11.iloc[[3, 4]]], ignore_index=True)
    twice = twice.assign(code_version=code_version())
    with pytest.raises(AmbiguousRunsError, match=r"and 1 more points \(rule: one run per point"):
        render("fmoe-fig11", twice, tmp_path)
    claim = next(c for c in load_catalog("fmoe") if c.experiment == "fmoe-fig11")
    with pytest.raises(AmbiguousRunsError):
        score_claim(claim, twice)
    store = tmp_path / "store"
    store.mkdir()
    for i, row in twice.iterrows():
        pd.DataFrame([row]).to_parquet(store / f"{i}.parquet")
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.reproduce_cli", "fmoe", "--store", str(store),
         "--out", str(tmp_path / "out")],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith("fmoesim-reproduce: error: experiment fmoe-fig11: 2 runs for ")
    assert len(p.stderr.splitlines()) == 1 and not (tmp_path / "out").exists()


def test_a_caption_counts_one_request_in_the_singular():
    """Red if a one-request figure's caption reads "all 1 requests served"."""
    from fmoesim.plots.style import _requests_note

    assert _requests_note([1], 1, []) == "the 1 request served"
    assert _requests_note([1], None, []) == "1 request served"
    assert _requests_note([2], 32, []) == "2 of 32 requests served"


def test_the_regenerate_line_names_the_store_and_folder_used(
    tmp_path: Path, store_df: pd.DataFrame, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A figure drawn from another store into another folder says how to draw it again
    there. Red if its caption's "regenerate" line reads the default store (the command
    then runs every sweep again into results/store), or if the defaults are spelled out
    where they were not given."""
    import fmoesim.results.store as store_mod
    from fmoesim.cli.plot_cli import main

    monkeypatch.setattr(store_mod, "load_results", lambda store, columns=(): store_df)
    store = tmp_path / "my store"
    store.mkdir()
    main(["fmoe-fig4", "--store", str(store), "--out", str(tmp_path / "figs")])
    md = (tmp_path / "figs" / "fmoe-fig4.md").read_text()
    want = f"- regenerate: `fmoesim-plot fmoe-fig4 --run --store '{store}' --out {tmp_path}/figs`"
    assert want in md, md
    monkeypatch.chdir(tmp_path)
    (tmp_path / "results" / "store").mkdir(parents=True)
    main(["fmoe-fig4"])
    md = (tmp_path / "results" / "figures" / "fmoe-fig4.md").read_text()
    assert "- regenerate: `fmoesim-plot fmoe-fig4 --run`\n" in md, md
