"""Bad inputs that could crash or mislead: each is refused with one line (exit 2) before
anything is written, or handled quietly (Ctrl-C: 130, a closed stdout: 141), and a
hit-rate-only run reports its times as missing, not as zeros."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fmoesim.atomic import HOST, STALE_AGE_S, clean_stale_temps
from fmoesim.engine.metrics import LIST_TIME_COLUMNS, TIME_COLUMNS
from fmoesim.errors import ConfigError, FmoesimError
from fmoesim.results.store import ResultsStore, load_results
from fmoesim.workload.synthetic import read_azure_csv
from tests.test_cli import ROOT, ROUTES, fmoesim, model_overrides, run, write_sequence_trace
from tests.tiny import TINY, small_model

BUDGET_GB = 2 * TINY.expert_size_bytes / 1e9  # two experts: 5/12 hits on ROUTES


def tiny(tmp: Path, *extra: str) -> list[str]:
    """Overrides of a run of the tiny sequence trace, writing under ``tmp``."""
    trace = tmp / "seq"
    if not trace.exists():
        write_sequence_trace(trace, ROUTES)
    return [
        f"workload.path={trace}",
        f"output.dir={tmp}/runs",
        f"store.dir={tmp}/store",
        "progress=false",
        *model_overrides(TINY),
        f"cache.budget_gb={BUDGET_GB}",
        *extra,
    ]


def assert_refused(p: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit status 2 and one line on stderr holding every needle."""
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("fmoesim: error: "), lines[0]
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def temps(d: Path) -> list[Path]:
    """Temporary entries (atomic writes) left in ``d``."""
    return [p for p in d.iterdir() if ".tmp-" in p.name] if d.exists() else []


def assert_nothing_written(tmp: Path) -> None:
    """No run directory, no store row, no temporary."""
    for sub in ("runs", "store"):
        d = tmp / sub
        assert not d.exists() or not any(d.iterdir()), sorted(d.iterdir())


# -- 1. hit-rate-only runs: times are missing values, not zeros ---------------------------
def test_hit_rate_only_run_has_missing_times_everywhere(tmp_path):
    p = fmoesim(*tiny(tmp_path, "engine.timing=false", "policy=lfu", "output.name=hr"))
    assert p.returncode == 0, p.stderr
    assert "n/a (hit-rate-only)" in p.stdout and " ms" not in p.stdout
    run_dir = tmp_path / "runs" / "hr"
    row = pd.read_parquet(run_dir / "summary.parquet").iloc[0]
    stored = ResultsStore(tmp_path / "store").get(row["config_hash"])
    for r in (row, stored):
        assert r["timing"] is False or r["timing"] == np.False_
        assert r["hit_rate"] == pytest.approx(5 / 12)  # still measured
        for col in TIME_COLUMNS:
            assert math.isnan(r[col]), col
        for col in LIST_TIME_COLUMNS:
            # one request; one entry per layer, as the measured per-layer hit rates
            n = len(r["layer_hit_rate"]) if col.startswith("layer_") else 1
            assert len(r[col]) == n and np.isnan(np.asarray(r[col], float)).all(), col  # null
    assert pd.read_parquet(run_dir / "layers.parquet")["stall_s"].isna().all()
    transfers = pd.read_parquet(run_dir / "transfers.parquet")
    assert len(transfers) and transfers[["submit_s", "start_s", "end_s"]].isna().all().all()
    # a timed run of the same point: finite times, timing true
    p = fmoesim(*tiny(tmp_path, "policy=lfu", "output.name=timed"))
    assert p.returncode == 0, p.stderr
    row = pd.read_parquet(tmp_path / "runs" / "timed" / "summary.parquet").iloc[0]
    assert row["timing"] and row["tpot_mean_s"] > 0 and row["simulated_s"] > 0
    # the per-layer list columns are the run's layer table (red when a list is another
    # layer's, or the stall is not the per-layer one)
    layers = pd.read_parquet(tmp_path / "runs" / "timed" / "layers.parquet")
    np.testing.assert_allclose(row["layer_hit_rate"], layers["hit_rate"])
    np.testing.assert_allclose(row["layer_stall_s"], layers["stall_s"])
    assert sum(row["layer_stall_s"]) == pytest.approx(row["stall_s"])
    assert len(row["layer_spec_recall"]) == len(layers)


def test_pivot_over_timed_and_untimed_runs_averages_only_timed(tmp_path):
    for extra in ("engine.timing=true", "engine.timing=false"):
        p = fmoesim(*tiny(tmp_path, extra, "output.write=false"))
        assert p.returncode == 0, p.stderr
    df = load_results(tmp_path / "store")
    assert sorted(df["timing"]) == [False, True] and df["timing"].dtype == bool
    timed = float(df.loc[df.timing, "tpot_mean_s"].iloc[0])
    assert timed > 0
    table = df.pivot_table(
        index="budget_gb", columns="policy", values="tpot_mean_s", aggfunc="mean"
    )
    assert float(table.iloc[0, 0]) == pytest.approx(timed)  # not (timed + 0) / 2


def test_load_results_derives_timing_of_rows_stored_without_it(tmp_path):
    store = ResultsStore(tmp_path)
    old = {"hit_rate": 0.5, "tpot_mean_s": 0.0, "stall_s": 0.0, "request_tpot_s": [0.0, 0.0]}
    store.add({**old, "config_hash": "a", "config_json": json.dumps({"engine": {"timing": False}})})
    store.add({**old, "config_hash": "b", "tpot_mean_s": 0.2, "config_json": json.dumps({})})
    df = load_results(tmp_path).set_index("config_hash")
    assert df.loc["a", "timing"] == False  # noqa: E712 - numpy bool
    assert df.loc["b", "timing"] == True  # noqa: E712 - numpy bool
    assert math.isnan(df.loc["a", "tpot_mean_s"]) and math.isnan(df.loc["a", "stall_s"])
    assert np.isnan(df.loc["a", "request_tpot_s"]).all()
    assert df.loc["b", "tpot_mean_s"] == 0.2
    assert math.isnan(store.get("a")["tpot_mean_s"]) and not store.get("a")["timing"]


# -- 2. arrival CSVs: date-times or seconds, refused with file, row and rule -------------
def csv(tmp: Path, times: list[str], name: str = "a.csv") -> Path:
    p = tmp / name
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "".join(f"{t},8,4\n" for t in times))
    return p


def test_numeric_timestamps_are_seconds(tmp_path):
    got = read_azure_csv(csv(tmp_path, ["0", "10.5", "20", "30"])).arrival_s
    assert got.tolist() == [0.0, 10.5, 20.0, 30.0]
    got = read_azure_csv(csv(tmp_path, ["100", "110.5", "2e2"], "b.csv")).arrival_s
    assert got.tolist() == [0.0, 10.5, 100.0]  # relative to the first row


def test_datetime_timestamps_give_their_gaps(tmp_path):
    times = ["2023-11-16 18:17:03.9799600", "2023-11-16 18:17:04", "2023-11-16T18:17:10.5"]
    got = read_azure_csv(csv(tmp_path, times)).arrival_s
    np.testing.assert_allclose(got, [0.0, 0.02004, 6.52004], atol=1e-9)


@pytest.mark.parametrize(
    ("times", "expected"),
    [
        (["0", "-1"], "row 2: TIMESTAMP '-1' is negative"),
        (["-1", "0"], "row 1: TIMESTAMP '-1' is negative"),
        (["0", "20", "10"], "row 3: TIMESTAMP goes backwards (rule: rows sorted by time)"),
        (["0", "inf"], "row 2: TIMESTAMP 'inf' is not a finite number"),
        (["0", "2023-11-16 18:17:03"], "row 2: TIMESTAMP '2023-11-16 18:17:03' mixes numbers"),
        (["2023-11-16 18:17:03", "5"], "row 2: TIMESTAMP '5' mixes numbers and date-times"),
        (["2023-11-16 18:17:03", "2023-11-16 18:17:01"], "row 2: TIMESTAMP goes backwards"),
    ],
    ids=["negative", "negative_first", "unsorted", "inf", "mixed", "mixed_dt", "unsorted_dt"],
)
def test_bad_timestamps_refused_with_file_row_rule(tmp_path, times, expected):
    p = csv(tmp_path, times)
    with pytest.raises(FmoesimError) as info:
        read_azure_csv(p)
    assert str(info.value).startswith(f"{p} {expected}"), str(info.value)


def test_online_arrivals_from_a_numeric_csv(tmp_path):
    from fmoesim.engine.serving import ServingConfig, arrival_times_s

    p = csv(tmp_path, ["0", "10.5", "20", "30"])
    cfg = ServingConfig(mode="online", arrivals="csv", arrivals_csv=str(p)).validate()
    got = arrival_times_s(cfg, np.zeros(3), 3, np.random.default_rng(0))
    assert got.tolist() == [0.0, 10.5, 20.0]
    bad = csv(tmp_path, ["0", "-1"], "bad.csv")
    out = tmp_path / "synth"
    p = run("fmoesim.cli.trace_cli", "synth", "--requests", "2", "--arrivals", str(bad), str(out))
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"fmoesim-trace: error: {bad} row 2: TIMESTAMP '-1' is negative "
        "(rule: a numeric TIMESTAMP is seconds, finite and >= 0)"
    ]
    assert not out.exists()


# -- 3-6. overrides, output names, budgets, policy files: one line before the run ---------
BAD = [
    (["+cache.budjet_gb=12"], "config key 'cache.budjet_gb': unknown key 'budjet_gb' under"),
    (["++cache.budjet_gb=12"], "config key 'cache.budjet_gb': unknown key 'budjet_gb' under"),
    (["+budjet=1"], "config key 'budjet': unknown key 'budjet' under '<root>'"),
    (["++serving.mod=online"], "unknown key 'mod' under 'serving'"),
    (["+policy.foo=1"], "LRU() takes no arguments"),
    (["output.name=../../x"], "config key 'output.name' = '../../x': must be one directory"),
    (["output.name=a/b"], "config key 'output.name' = 'a/b'"),
    (["output.name=.hidden"], "config key 'output.name' = '.hidden'"),
    (["cache.budget_gb=nan"], "config key 'cache.budget_gb' = nan: must be a finite number"),
    (["cache.budget_gb=inf"], "config key 'cache.budget_gb' = inf: must be a finite number"),
    (["cache.budget_gb=1e30"], "must be at most 9.22e+09 GB (bytes are counted in int64)"),
    (["cache.experts_per_layer=-1"], "'cache.experts_per_layer' = -1: must be in [1, 4]"),
    (["cache.experts_per_layer=0"], "'cache.experts_per_layer' = 0: must be in [1, 4]"),
    (["cache.experts_per_layer=99999999999999999999"], "must be in [1, 4]"),
    (
        ["policy=moe-infinity", "policy.eamc_path=/no/such.npz"],
        "config key 'policy.eamc_path' = '/no/such.npz': file not found",
    ),
    # arrivals are online serving's: a static run that names them would ignore them
    (["serving.arrivals=poisson"], "'serving.arrivals' = 'poisson': is read in online serving"),
    (["serving.arrivals_csv=a.csv"], "'serving.arrivals_csv' = 'a.csv': is read in online"),
    # the model's name names the run folder: '../..' wrote the run outside output.dir
    (["model.name=../../x"], "config key 'model.name' = '../../x': must be a plain name"),
    (["model.name="], "config key 'model.name' = '': must be a plain name"),
    # more key/value heads than attention heads: a KV cache larger than the model's
    (
        ["model.num_kv_heads=64"],
        "config key 'model.num_kv_heads' = 64: must be <= num_attention_heads (32)",
    ),
    # numpy's ValueError and OverflowError tracebacks
    (["seed=-1"], "config key 'seed' = -1: must be an integer in [0, 2**63)"),
    (["seed=99999999999999999999999"], "must be an integer in [0, 2**63)"),
    # an optional group: Hydra skipped the unknown preset and ran the defaults (exit 0)
    (["experiment=nosuch"], "experiment=nosuch: unknown experiment; valid: fmoe-fig10"),
    # a workload fitted to another model ran its knobs on this one, unsaid
    (
        ["workload=routing-qwen3-30b-a3b"],
        "config key 'workload.fitted_to' = ['qwen3-30b-a3b']: "
        "the workload's knobs are fitted to these models, not to model 'tiny' (rule: model= one",
    ),
    # Hydra's own groups: a miss was Hydra's message over 8 lines, checked inside hydra.main
    (["hydra/launcher=nosuch"], "hydra/launcher=nosuch: unknown hydra/launcher; valid: basic"),
    (["-m", "hydra/job_logging=nosuch"], "unknown hydra/job_logging; valid: default, disabled"),
    # int("abc") named no key; bool("maybe") ran fMoE without its semantic search
    (
        ["policy=fmoe", "policy.prefetch_distance=abc"],
        "config key 'policy.prefetch_distance' = 'abc': must be an integer",
    ),
    (
        ["policy=fmoe", "policy.semantic=maybe"],
        "config key 'policy.semantic' = 'maybe': must be true or false",
    ),
    (["policy=fmoe", "policy.label=1"], "config key 'policy.label' = 1: must be a string or null"),
    # deletions: a message of its own for each kind of key, "unknown key (typo?)" for a
    # valid one, or (~workload) a run that ignored it
    (["~model"], "override '~model': a run keeps every key (rule: ~ removes only experiment"),
    (["~serving"], "override '~serving': a run keeps every key"),
    (["~cache.budget_gb"], "override '~cache.budget_gb': a run keeps every key"),
    (["~workload"], "override '~workload': a run keeps every key"),
    # OmegaConf's tracebacks (33 to 79 lines)
    (["cache.budget_gb=${nosuch.key}"], "Interpolation key 'nosuch.key' not found"),
    (["-m", "seed=0,1", "cache.budget_gb=${nosuch.key}"], "Interpolation key 'nosuch.key'"),
]


@pytest.mark.parametrize(("args", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_refused_before_the_run_one_line(tmp_path, args, expected):
    """Red if any of BAD runs (exit 0, a run folder written, possibly outside output.dir)
    or ends in a traceback instead of one line naming the key and the rule."""
    assert_refused(fmoesim(*tiny(tmp_path, *args)), expected)
    assert_nothing_written(tmp_path)
    assert not (tmp_path.parent / "x").exists()


def test_plus_typo_reads_like_a_plain_typo(tmp_path):
    plain = assert_refused(fmoesim(*tiny(tmp_path, "cache.budjet_gb=12")))
    for prefix in ("+", "++"):
        assert assert_refused(fmoesim(*tiny(tmp_path, f"{prefix}cache.budjet_gb=12"))) == plain


def test_check_added_keys_leaves_policy_groups_and_hydra_alone():
    from fmoesim.cli.main import _preflight_sweep, check_added_keys

    check_added_keys(
        ["++policy.prefetch_distance=2", "+experiment=fmoe-fig4", "++cache.budget_gb=3",
         "+hydra.launcher.n_jobs=2", "++model.num_layers=4", "+workload.synthetic.skew=2"]
    )  # fmt: skip
    with pytest.raises(FmoesimError, match="unknown key 'x' under 'model'"):
        check_added_keys(["+model.x=1"])
    assert _preflight_sweep(["experiment=fmoe-fig4"]) == 30  # its ++policy.* sweep is fine
    with pytest.raises(FmoesimError, match="experiment=nosuch: unknown experiment"):
        check_added_keys(["experiment=fmoe-fig4,nosuch"])  # each value of a sweep
    check_added_keys(["hardware=measured/h100-3", "policy=lru,lfu"])  # presets that exist
    # what ~ may remove: the optional experiment, a policy keyword, Hydra's settings
    check_added_keys(["~experiment", "~policy.prefetch_distance", "~hydra/launcher"])


def test_a_hydra_group_option_on_the_search_path_runs(tmp_path):
    """Red if a logging (or launcher) config kept in a folder of ``hydra.searchpath`` is
    refused as unknown: only Hydra's own folders were searched for it."""
    own = tmp_path / "myconf" / "hydra" / "job_logging"
    own.mkdir(parents=True)
    (own / "quiet.yaml").write_text("version: 1\nroot:\n  level: WARNING\n")
    p = fmoesim(*tiny(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'myconf'}]",
                      "hydra/job_logging=quiet", "output.write=false"))  # fmt: skip
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("sweep", [False, True])
def test_a_policy_preset_on_the_search_path_runs(tmp_path, sweep):
    """Red if a policy YAML kept outside ``conf/``, in a folder given as
    ``hydra.searchpath``, is refused as an unknown policy: the preflight (of one run, or
    of every point of a sweep, which left the ``hydra.*`` overrides out) only looked in
    ``conf/policy/``; or if a search path turns the check off, so that a mistyped
    experiment runs the defaults."""
    own = tmp_path / "myconf" / "policy"
    own.mkdir(parents=True)
    (own / "my-lfu.yaml").write_text("_target_: policies.lfu.LFU\n")
    chosen = ["-m", "policy=my-lfu,lru"] if sweep else ["policy=my-lfu"]
    p = fmoesim(*tiny(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", *chosen))
    assert p.returncode == 0, p.stderr
    assert set(load_results(tmp_path / "store")["policy"]) == ({"lfu", "lru"} if sweep else {"lfu"})
    assert_refused(  # a name in neither place is still one line
        fmoesim(*tiny(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "policy=no")),
        "policy=no: unknown policy; valid: adapmoe",
    )
    # an optional group (experiment): Hydra would skip the unknown name and run the defaults
    from fmoesim.cli.main import check_added_keys

    with pytest.raises(FmoesimError, match="experiment=nosuch: unknown experiment"):
        check_added_keys([f"hydra.searchpath=[file://{tmp_path / 'myconf'}]", "experiment=nosuch"])


def test_a_launcher_of_an_extra_names_the_extra(tmp_path):
    """Red if choosing the SLURM launcher without its plugin gives Hydra's "Could not
    find" over several lines, or a line that does not say which extra installs it."""
    import importlib.util

    if importlib.util.find_spec("hydra_plugins.hydra_submitit_launcher") is not None:
        pytest.skip("the submitit launcher is installed here")
    assert_refused(
        fmoesim(*tiny(tmp_path, "-m", "hydra/launcher=submitit_slurm")),
        "hydra/launcher=submitit_slurm: unknown hydra/launcher (pip install -e '.[slurm]' "
        "installs it); valid: basic",
    )
    assert_nothing_written(tmp_path)


def test_a_budget_above_every_expert_runs(tmp_path):
    p = fmoesim(*tiny(tmp_path, "cache.budget_gb=1e9", "engine.timing=false", "output.name=big"))
    assert p.returncode == 0, p.stderr
    row = pd.read_parquet(tmp_path / "runs" / "big" / "summary.parquet").iloc[0]
    assert row["budget_experts"] == int(1e18 // TINY.expert_size_bytes)
    assert row["hit_rate"] == pytest.approx(8 / 12)  # every expert fits: 4 cold misses


def test_budget_checks_in_the_library():
    from fmoesim.engine.simulate import check_budget

    with pytest.raises(ConfigError, match="finite"):
        check_budget(TINY, float("nan"))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="int64"):
        check_budget(TINY, 10**30)


# -- 4. output.name of another config is refused, never deleted --------------------------
def test_output_name_of_another_config_is_refused_not_deleted(tmp_path):
    first = fmoesim(*tiny(tmp_path, "engine.timing=false", "output.name=r"))
    assert first.returncode == 0, first.stderr
    summary = tmp_path / "runs" / "r" / "summary.parquet"
    before = summary.read_bytes()
    p = fmoesim(*tiny(tmp_path, "engine.timing=false", "output.name=r", "cache.budget_gb=0.024"))
    assert_refused(p, "config key 'output.name' = 'r'", "holds a run of another config",
                   "pick another output.name")  # fmt: skip
    assert summary.read_bytes() == before
    assert len(list((tmp_path / "store").glob("*.parquet"))) == 1  # the refused run: no row
    assert not temps(tmp_path / "runs")
    # the same config again replaces its own directory
    p = fmoesim(*tiny(tmp_path, "engine.timing=false", "output.name=r", "output.verbose=false"))
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("lru at 0.012 GB: hit rate ")  # one line that names the run
    assert summary.read_bytes() != before
    # a directory that holds no run is not ours either
    (tmp_path / "runs" / "mine").mkdir()
    (tmp_path / "runs" / "mine" / "notes.txt").write_text("keep")
    assert_refused(fmoesim(*tiny(tmp_path, "output.name=mine")), "does not hold a fmoesim run")
    assert (tmp_path / "runs" / "mine" / "notes.txt").read_text() == "keep"


# -- 7. where results go is checked first; a run directory never lacks its store row -------
def test_store_dir_that_is_a_file_is_refused_before_the_run(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    p = fmoesim(*tiny(tmp_path, f"store.dir={f}"))
    assert_refused(p, f"config key 'store.dir' = '{f}': is not a folder")
    p = fmoesim(*tiny(tmp_path, f"output.dir={f}/runs"))
    assert_refused(p, f"config key 'output.dir' = '{f}/runs': cannot be made: {f} is a file")
    assert not (tmp_path / "runs").exists() and not (tmp_path / "store").exists()


def test_unwritable_names_the_folder_in_the_way(tmp_path: Path) -> None:
    """The words every writing command puts after the path it cannot write. Red if a
    path that is itself a file reads "cannot be made: <it> is a file", if the ancestor in
    the way is not the one named, or if a file's own name (``file=True``) is taken for
    the folder to write into."""
    from fmoesim.atomic import unwritable

    plain = tmp_path / "plain"
    plain.write_text("x")
    assert unwritable(tmp_path / "new" / "deeper") is None
    assert unwritable(plain) == "is not a folder"
    assert unwritable(plain / "a" / "b") == f"cannot be made: {plain} is a file"
    assert unwritable(plain, file=True) is None  # a file replaced in a writable folder
    assert unwritable(plain / "t.yaml", file=True) == f"cannot be made: {plain} is a file"
    assert unwritable("/proc/fmoesim-x") == "cannot be made: /proc is not writable"


def test_run_dir_and_store_row_are_written_together(tmp_path, monkeypatch):
    from fmoesim.cli.main import compose_config, run_config

    cfg = compose_config(
        tiny(tmp_path, "engine.timing=false", "output.name=r", "output.plot=false")
    )

    def broken_add(self, row):  # noqa: ANN001 - a store whose write fails
        raise OSError(28, "No space left on device", str(self.root / "x.parquet"))

    monkeypatch.setattr(ResultsStore, "add", broken_add)
    with pytest.raises(FmoesimError, match="cannot write results \\(No space left on device"):
        run_config(cfg)
    assert not (tmp_path / "runs" / "r").exists() and not temps(tmp_path / "runs")
    monkeypatch.undo()
    run_config(cfg)
    assert (tmp_path / "runs" / "r" / "summary.parquet").is_file()
    assert len(list((tmp_path / "store").glob("*.parquet"))) == 1


# -- 8. every point of a sweep is checked before its first run ---------------------------
def test_unknown_policy_in_a_sweep_list_is_refused_before_any_job(tmp_path):
    p = fmoesim("-m", *tiny(tmp_path, "policy=lru,nosuch", f"hydra.sweep.dir={tmp_path}/sw"))
    assert_refused(p, "policy=nosuch: unknown policy; valid: ", "(sweep run 2/2: policy=nosuch)")
    assert p.stdout == ""  # not even the sweep's first line
    assert_nothing_written(tmp_path)
    p = fmoesim("-m", *tiny(tmp_path, "cache.budget_gb=0.012,nan", f"hydra.sweep.dir={tmp_path}/s"))
    assert_refused(p, "'cache.budget_gb' = nan: must be a finite number", "sweep run 2/2")
    p = fmoesim("-m", *tiny(tmp_path, "policy=lru,lfu", "output.name=same"))
    assert_refused(p, "'output.name' = 'same': the same for 2 runs of the sweep")
    assert_nothing_written(tmp_path)


# -- 9. Ctrl-C: one line, 130, nothing half-written --------------------------------------
def _default_sigint() -> None:
    """In the child before it starts Python: Ctrl-C's default action.  A test run started
    in the background of a non-interactive shell inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: the sweep would never see the signal."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_a_sweep_one_line_exit_130_nothing_half_written(tmp_path):
    args = tiny(tmp_path, "engine.timing=false", "output.plot=false", "seed=range(0,200)",
                f"hydra.sweep.dir={tmp_path}/sw")  # fmt: skip
    p = subprocess.Popen(
        [sys.executable, "-m", "fmoesim.cli.main", "-m", *args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        preexec_fn=_default_sigint,
    )  # fmt: skip
    try:
        assert p.stdout is not None
        deadline = time.monotonic() + 120
        for line in p.stdout:
            if line.startswith("[sweep 1/200]"):
                p.send_signal(signal.SIGINT)
                break
            assert time.monotonic() < deadline
        out, err = p.communicate(timeout=60)
    finally:
        p.kill()
    assert p.returncode == 130, err
    assert err.strip() == "fmoesim: interrupted"
    assert "[sweep 200/200]" not in out
    runs, store = tmp_path / "runs", tmp_path / "store"
    assert not temps(runs) and not temps(store)
    dirs = {pd.read_parquet(d / "summary.parquet").config_hash[0] for d in runs.iterdir()}
    rows = {f.stem for f in store.glob("*.parquet")}
    assert dirs == rows and len(rows) >= 1  # every run directory has its store row


# -- 10. a closed stdout ends quietly ----------------------------------------------------
@pytest.mark.parametrize("cmd", ["trace", "run"])
def test_closed_stdout_exits_141_quietly(tmp_path, cmd):
    if cmd == "trace":
        argv = ["fmoesim.cli.trace_cli", "inspect", "traces/default"]
    else:
        argv = ["fmoesim.cli.main", *tiny(tmp_path, "engine.timing=false")]
    p = subprocess.Popen(
        [sys.executable, "-m", *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=ROOT
    )
    assert p.stdout is not None and p.stderr is not None
    p.stdout.close()  # the reader is gone before anything is written (as `| head -0`)
    err = p.stderr.read().decode()
    assert p.wait(timeout=120) == 141, err
    assert err == ""
    if cmd == "run":  # the results were saved before anything was printed
        assert len(list((tmp_path / "store").glob("*.parquet"))) == 1


# -- 11. temporaries of killed writers are removed by the next run ------------------------
KILLED_WRITER = """
import sys, time
from fmoesim.atomic import atomic_dir
writer = atomic_dir(sys.argv[1])  # kept referenced: collecting it would clean up
tmp = writer.__enter__()
(tmp / "summary.parquet").write_text("half")
print(tmp, flush=True)
time.sleep(300)
"""


def _kill_a_writer(script: str, dest: Path) -> tuple[Path, int]:
    """Run ``script`` (it prints its temporary's path, then sleeps) writing ``dest``, kill
    it with SIGKILL (no cleanup runs) and return that temporary and the dead pid."""
    p = subprocess.Popen(
        [sys.executable, "-c", script, str(dest)], stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    assert p.stdout is not None
    killed = Path(p.stdout.readline().strip())
    p.kill()
    p.wait()
    return killed, p.pid


def test_stale_temporaries_of_killed_writers_are_removed(tmp_path):
    runs, store = tmp_path / "runs", tmp_path / "store"
    runs.mkdir()
    store.mkdir()
    killed, pid = _kill_a_writer(KILLED_WRITER, runs / "victim")
    assert killed.is_dir() and killed.parent == runs
    dead_file = store / f".abc.tmp-{HOST}-{pid}-xyz.parquet"
    dead_file.write_text("half")
    live = runs / f".other.tmp-{HOST}-{os.getpid()}-live"  # this test's own: alive
    live.mkdir()
    elsewhere = runs / f".other.tmp-otherhost-{pid}-far"  # another host: unknown
    elsewhere.mkdir()
    keep = runs / ".keepme"
    keep.write_text("not ours")
    r = fmoesim(*tiny(tmp_path, "engine.timing=false", "output.name=next"))
    assert r.returncode == 0, r.stderr
    assert not killed.exists() and not dead_file.exists()
    assert live.exists() and elsewhere.exists() and keep.exists()
    # one older than a day is abandoned wherever it was made
    old = time.time() - STALE_AGE_S - 60
    os.utime(elsewhere, (old, old))
    assert clean_stale_temps(runs) == [elsewhere]
    assert live.exists()


# -- 12. a sweep prints one line per job; the summaries with -v --------------------------
def test_sweep_prints_one_line_per_job_and_summaries_with_verbose(tmp_path):
    args = tiny(tmp_path, "engine.timing=false", "output.write=false", "policy=lru,lfu",
                "cache.budget_gb=0.012,0.024", f"hydra.sweep.dir={tmp_path}/sw")  # fmt: skip
    p = fmoesim("-m", *args)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 6, p.stdout
    assert lines[0].startswith("sweep: 4 runs") and lines[-1].startswith("sweep done: 4 runs")
    for k, line in enumerate(lines[1:5], 1):
        assert line.startswith(f"[sweep {k}/4] cache.budget_gb=") and " policy=" in line
        assert line.endswith("TPOT n/a (hit-rate-only)")
    p = fmoesim("-v", "-m", *args, "store.skip_done=false")
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("expert hit rate") == 4  # every run's table
    assert p.stdout.count("[HYDRA] \t#") == 4  # Hydra's own job lines
    assert p.stdout.count("[sweep ") == 4


def test_a_sweep_reads_every_points_inputs_before_its_first_run(tmp_path):
    """Red if a sweep runs (and stores) its first point before finding that a later
    point's trace is missing, has another model's shape, or its arrivals CSV is broken."""
    other = tmp_path / "other"
    three = small_model(3, TINY.num_experts, TINY.top_k)  # TINY's experts, 3 layers
    write_sequence_trace(other, [[0, 1, 0]] * 2, three)
    bad_csv = tmp_path / "bad.csv"
    bad_csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,2\n-1,4,2\n")
    good_csv = tmp_path / "good.csv"
    good_csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,2\n1,4,2\n")
    base = tiny(tmp_path)
    seq = base[0].split("=", 1)[1]
    online = ["serving.mode=online", "serving.arrivals=csv"]
    for sweep, needle in (
        ([f"workload.path={seq},{tmp_path / 'none'}"], "trace directory not found (sweep run 2/2"),
        ([f"workload.path={seq},{other}"], "has num_layers = 3"),
        ([*online, f"serving.arrivals_csv={good_csv},{bad_csv}"], "bad.csv row 2: TIMESTAMP"),
        (["policy=lru,"], "override 'policy=lru,': mismatched input"),  # a stray comma
    ):
        assert_refused(fmoesim("-m", *base[1:], base[0], *sweep), needle)
        assert_nothing_written(tmp_path)


def test_a_sweep_reads_a_synthetic_traces_arrivals_as_far_as_its_requests(tmp_path):
    """Red if a sweep refuses an arrivals CSV for a bad row past the requests the
    synthetic trace reads (a single run takes it), or misses one within them."""
    from fmoesim.cli.main import _preflight_sweep

    csv = tmp_path / "a.csv"
    csv.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,2\n1,4,2\n2,0,2\n")
    base = ["workload=synthetic", f"workload.synthetic.arrivals_csv={csv}", "seed=0,1",
            f"output.dir={tmp_path}/runs", f"store.dir={tmp_path}/store"]  # fmt: skip
    assert _preflight_sweep([*base, "workload.synthetic.num_requests=2"]) == 2
    with pytest.raises(FmoesimError, match=r"a\.csv row 3: ContextTokens = 0"):
        _preflight_sweep([*base, "workload.synthetic.num_requests=3"])


def test_an_unreadable_config_is_one_line_in_every_command(capsys):
    """Red if run_or_exit (fmoesim-min-budget, fmoesim-plot, ...) lets OmegaConf's
    errors out as tracebacks, or swallows an error that is not OmegaConf's."""
    from omegaconf import OmegaConf

    from fmoesim.errors import run_or_exit

    cfg = OmegaConf.create({"cache": {"budget_gb": "${nosuch.key}"}})
    with pytest.raises(SystemExit) as exc:
        run_or_exit("prog", lambda: cfg.cache.budget_gb)
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "prog: error: config key 'cache.budget_gb': Interpolation key 'nosuch.key' not found"
    ]
    with pytest.raises(ZeroDivisionError):
        run_or_exit("prog", lambda: 1 / 0)


def test_an_output_path_under_a_plain_file_is_one_line(tmp_path, capsys):
    """An operating-system error on a path the user named (here an output folder under a
    plain file) is one line naming the path, exit 2, not a traceback; an OSError with no
    path is a bug and propagates (red if run_or_exit swallows every OSError, or none)."""
    from fmoesim.errors import run_or_exit

    (tmp_path / "plain").write_text("x")
    with pytest.raises(SystemExit) as exc:
        run_or_exit("prog", lambda: (tmp_path / "plain" / "sub").mkdir(parents=True))
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    plain = tmp_path / "plain"
    assert err == [
        f"prog: error: {plain / 'sub'}: cannot be made as a directory: {plain} is a file"
    ]
    with pytest.raises(SystemExit):
        run_or_exit("prog", lambda: plain.mkdir(parents=True, exist_ok=True))
    assert (
        capsys.readouterr()
        .err.strip()
        .endswith(f"{plain}: cannot be made as a directory: is a file")
    )
    with pytest.raises(SystemExit) as exc:
        run_or_exit("prog", lambda: open(tmp_path / "none.csv"))
    assert exc.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"prog: error: {tmp_path / 'none.csv'}: No such file or directory"
    )

    def unnamed() -> None:
        raise OSError("no path")

    with pytest.raises(OSError, match="no path"):
        run_or_exit("prog", unnamed)
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.trace_cli", "import", "vllm-routes",
         str(ROOT / "examples" / "vllm-routes.jsonl"), str(tmp_path / "plain" / "out"),
         "--model", "mixtral-8x7b"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 2 and p.stderr.count("\n") == 1, p.stderr
    assert "plain: cannot be made as a directory: is a file" in p.stderr


def test_a_bad_arrivals_file_of_a_synthetic_trace_is_one_line(tmp_path):
    """A synthetic workload's arrivals CSV is read before the progress line that says a
    trace is being generated, so a bad file is the only line (red if the file is first
    read inside the generation, after that line)."""
    bad = tmp_path / "bad.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,x,5\n")
    p = fmoesim(
        "workload.kind=synthetic", f"workload.synthetic.arrivals_csv={bad}",
        "workload.synthetic.num_requests=2", f"output.dir={tmp_path}/runs",
        f"store.dir={tmp_path}/store", "engine.timing=false",
    )  # fmt: skip
    assert_refused(p, f"{bad} row 1: ContextTokens = 'x'")
    assert_nothing_written(tmp_path)


def test_a_preset_that_is_not_yaml_is_one_config_error(tmp_path, monkeypatch):
    """Red if a preset file of garbage bytes raises yaml's ReaderError (a traceback in
    fmoesim-profile --base) instead of one line naming the file."""
    import fmoesim.config.build as build
    from fmoesim.errors import ConfigError
    from fmoesim.specs import HardwareSpec

    (tmp_path / "hardware").mkdir()
    (tmp_path / "hardware" / "junk.yaml").write_bytes(b"\x00\x01garbage")
    monkeypatch.setattr(build, "CONF_DIR", tmp_path)
    with pytest.raises(ConfigError, match=r"'hardware/junk\.yaml' = '': is not YAML: "):
        build.load_preset("hardware", "junk", HardwareSpec)


@pytest.mark.parametrize(
    ("measured", "rule"),
    [({"m": {"expert_a_s": "abc"}}, "'hardware.measured.m.expert_a_s' = 'abc': must be a finite"),
     ({"m": 3}, "'hardware.measured.m' = 3: must be a mapping of coefficients"),
     ({"m": {"expert_a_s": -1.0}}, "= -1.0: must be >= 0 (a time in seconds)"),
     ({"m": {"host_decision_s": {"lru": float("nan")}}}, "host_decision_s.lru' = nan: must be"),
     ({"m": {"host_decision_s": {"lru": -1e-6}}}, "host_decision_s.lru' = -1e-06: must be >= 0"),
     ({"link": {"h2d_65536_s": True}}, "h2d_65536_s' = True: must be a finite number"),
     ({"m": {"expert_as": 1e-4}}, "'hardware.measured.m.expert_as' = 0.0001: not a coefficient "
      "the simulator reads (a typo?"),
     ({"link": {"h2d_64k_s": 1e-5}}, "'hardware.measured.link.h2d_64k_s' = 1e-05: a link "
      "table's keys are h2d_<bytes>_s"),
     ({"m": {"host_decision_s": 1e-5}}, "host_decision_s' = 1e-05: must be a mapping: policy")],
)  # fmt: skip
def test_a_measured_profile_of_the_wrong_kind_is_refused(measured, rule):
    """Red if ``measured`` coefficients that are text, negative times (a policy's time
    in ``host_decision_s`` too), NaN or a number where a model's table belongs reach the
    compute model (a ValueError or AttributeError traceback in fmoesim-validate-grid
    score); or if a misspelt coefficient (``expert_as``) is accepted, the run silently
    taking the roofline's value for the one it meant."""
    from fmoesim.errors import ConfigError
    from fmoesim.specs import HardwareSpec

    with pytest.raises(ConfigError) as info:
        HardwareSpec(name="h", measured=measured).validate()
    assert rule in str(info.value)


@pytest.mark.parametrize(
    ("module", "argv", "line"),
    [("fmoesim.cli.min_budget", ["--target-tpot-ms", "abc"],
      "fmoesim-min-budget: error: argument --target-tpot-ms: not a comma-separated list"),
     ("fmoesim.results.regress", ["--tolerance-points", "abc"],
      "fmoesim-regress: error: argument --tolerance-points: invalid float value: 'abc'"),
     ("fmoesim.cli.trace_cli", ["import", "nosuch", "a", "b"],
      "fmoesim-trace import: error: argument format: invalid choice: 'nosuch'"),
     ("fmoesim.cli.trace_cli", ["import", "table", "log.csv", "out"],  # no default model
      "fmoesim-trace import: error: the following arguments are required: --model"),
     ("fmoesim.specs.from_config", ["from-config", "c.json", "--dtype", "float7"],
      "fmoesim-model from-config: error: argument --dtype: invalid choice: 'float7'")],
    ids=["min-budget", "regress", "trace-subcommand", "trace-model", "model"],
)  # fmt: skip
def test_a_bad_argument_is_one_line(capsys, module, argv, line):
    """Red if argparse prints its usage text before the error (two to five lines)."""
    import importlib

    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(line) and err[0].endswith(" (see --help)"), err


@pytest.mark.skipif(not Path("/proc/self").exists(), reason="needs Linux's /proc")
def test_a_store_that_cannot_be_made_fails_before_the_run(tmp_path):
    """Red if a store folder that cannot be made (in /proc, writable by its mode bits for
    root) is found only when the finished run is saved: after the whole simulation, an
    empty output folder left behind."""
    p = fmoesim(*tiny(tmp_path, "store.dir=/proc/fmoesim-store"))
    assert_refused(p, "config key 'store.dir' = '/proc/fmoesim-store': cannot be made: /proc "
                   "is not writable")  # fmt: skip
    assert not (tmp_path / "runs").exists()


def test_a_glob_sweep_is_refused_in_words_and_version_is_fmoesims(tmp_path):
    """Red if ``policy=glob(l*)`` is answered "ConfigLoader is not set", or ``--version``
    prints Hydra's version instead of fmoesim's."""
    p = fmoesim("-m", "policy=glob(l*)", *tiny(tmp_path))
    assert_refused(p, "policy=glob(l*): a glob() sweep is not supported (rule: list the values")
    assert_nothing_written(tmp_path)
    p = fmoesim("--version")
    assert p.returncode == 0 and p.stdout.startswith("fmoesim ") and "Hydra" not in p.stdout


def test_a_trace_of_another_shape_names_the_fix():
    """Red if a trace whose model is no preset (an imported log with its own top-k) is
    refused with "pick the matching model= preset", a preset that does not exist, instead
    of the overrides that fit it (every key that differs, and the model's name, else its
    results are stored under the name of the preset whose shape was changed); if a trace
    of a preset's model does not name that preset; or if a preset's name is offered for a
    trace of another shape that only shares the name (made with model.num_layers=...)."""
    import dataclasses
    from types import SimpleNamespace

    from fmoesim.config.build import load_preset
    from fmoesim.engine.simulate import check_manifest_shape
    from fmoesim.errors import ConfigError
    from fmoesim.specs import ModelSpec

    def refusal(trace_model: ModelSpec, run_model: ModelSpec) -> str:
        with pytest.raises(ConfigError) as info:
            check_manifest_shape(SimpleNamespace(model=trace_model), "t", run_model)
        return str(info.value)

    qwen = dataclasses.replace(TINY, name="qwen-edge", top_k=6, num_layers=5)
    assert refusal(qwen, TINY).endswith(
        "has num_layers = 5 (model 'qwen-edge'); pick a model= preset of its shape, or set "
        "model.name=qwen-edge model.num_layers=5 model.top_k=6"  # the trace's model's name
    )
    olmoe = load_preset("model", "olmoe-1b-7b", ModelSpec)
    assert refusal(olmoe, TINY).endswith("; model=olmoe-1b-7b matches it")
    cut = dataclasses.replace(olmoe, num_layers=4)  # a preset's name, another shape
    assert refusal(cut, TINY).endswith(
        "or set model.num_layers=4 model.num_experts=64 model.top_k=8"
    )


def test_spans_names_every_value_in_runs():
    """Red if a message's list of layers is cut (the first five, with no mark that more
    follow) or a run is split or merged across a gap."""
    from fmoesim.errors import spans

    assert spans([9, 1, 2, 3, 7, 10, 3]) == "1-3, 7, 9-10"
    assert spans(range(1, 32)) == "1-31"
    assert spans([4]) == "4" and spans([]) == ""


def test_counted_is_singular_for_one():
    """Red if a message counts one thing in the plural ("1 requests") or many in the
    singular."""
    from fmoesim.errors import counted

    assert counted(1, "request") == "1 request"
    assert counted(0, "row") == "0 rows" and counted(18668, "row") == "18668 rows"
    assert counted(2, "process", "processes") == "2 processes"
    assert counted(1, "process", "processes") == "1 process"


@pytest.mark.parametrize(
    ("policy", "said"),
    [(["policy=fmoe", "policy.prefetch_distance=3"],
      "config key 'policy.prefetch_distance' = 3: must be at most the model's 2 MoE layers"),
     (["policy=promoe", "policy.stride=3"],
      "config key 'policy.stride' = 3: must be at most the model's 2 MoE layers"),
     (["policy=moepic", "policy.buffer_experts=2"],
      "config key 'cache.budget_gb' = 0.012: 2.0 experts leave nothing beside MoEpic's "
      "buffer of 2 experts (policy.buffer_experts)"),
     (["policy=fmoe", "policy.prefetch_distance=-1"],
      "config key 'policy.prefetch_distance' = -1: prefetch_distance must be >= 1, got -1")],
    ids=["fmoe", "promoe", "moepic", "constructor"],
)  # fmt: skip
def test_a_policy_knob_the_model_cannot_take_is_one_line(tmp_path, policy, said):
    """Red if a policy that finds its knob out of range only when it meets the model (a
    prefetch distance or stride beyond the model's layers, a buffer that fills MoEpic's
    budget) ends the run with Hydra's traceback and exit status 1 (``fmoesim-validate``
    replayed the other policies first), not one line naming the key; or if a
    constructor's own check of a knob is blamed on the whole ``policy`` group."""
    p = fmoesim(*tiny(tmp_path, *policy))
    assert_refused(p, said)
    assert_nothing_written(tmp_path)


def test_every_coefficient_the_engine_reads_is_a_known_measured_key():
    """Red if a coefficient that the compute model, the host model or host-fit's scaling
    reads is missing from ``MEASURED_MODEL_KEYS``: a profile holding it would be refused
    as a typo."""
    import dataclasses

    from fmoesim.engine.compute import ComputeModel
    from fmoesim.engine.host import HOST_COST_KEYS, HOST_LINK_DEPTH_KEY
    from fmoesim.specs.hardware import MEASURED_MODEL_KEYS
    from replay.campaign import HOST_LAUNCH_KEY, HOST_PROBE_EXPONENT_KEY, HOST_PROBE_KEY

    read = {f.name for f in dataclasses.fields(ComputeModel)} | set(HOST_COST_KEYS)
    read |= {HOST_LINK_DEPTH_KEY, HOST_LAUNCH_KEY, HOST_PROBE_KEY, HOST_PROBE_EXPONENT_KEY}
    assert read | {"host_decision_s"} == set(MEASURED_MODEL_KEYS)


def test_a_profile_measured_on_other_models_says_so():
    """Red if a run on a measured profile that holds no coefficients of the run's model
    (``hardware=measured/h100-2``, OLMoE's only, with ``model=qwen3-30b-a3b``) prints no
    note: its compute is then the roofline's, and the run reads as a measured one."""
    from types import SimpleNamespace

    from fmoesim.cli.main import unmeasured_note
    from fmoesim.specs import HardwareSpec

    hw = HardwareSpec(name="h", measured={"olmoe-1b-7b": {"expert_a_s": 1e-4}, "link": {}})
    timed = SimpleNamespace(timing=True)
    assert unmeasured_note(SimpleNamespace(hardware=hw, model=TINY, engine=timed)) == (
        "hardware h holds measured coefficients of olmoe-1b-7b, none of tiny: its compute is "
        "the roofline's estimate"
    )
    olmoe = SimpleNamespace(hardware=hw, model=SimpleNamespace(name="olmoe-1b-7b"), engine=timed)
    assert unmeasured_note(olmoe) is None
    plain = SimpleNamespace(hardware=HardwareSpec(), model=TINY, engine=timed)
    assert unmeasured_note(plain) is None
    untimed = SimpleNamespace(hardware=hw, model=TINY, engine=SimpleNamespace(timing=False))
    assert unmeasured_note(untimed) is None  # a hit-rate-only run computes nothing


def test_a_policy_that_reads_what_a_top_k_trace_lacks_says_so():
    """Red if fMoE (gate probabilities, embeddings) or MoEpic (speculative predictions)
    runs on a top-k log without a note: it then silently runs a weaker variant of
    itself (routed-token shares, no semantic search, no speculation)."""
    from types import SimpleNamespace

    import numpy as np

    from fmoesim.cli.main import missing_inputs_note
    from policies.lru import LRU
    from policies.moepic import MoEpic

    top_k = SimpleNamespace(path="t", probs=None, spec_probs=None, embedding=np.zeros((3, 0)))
    full = SimpleNamespace(path="t", probs=np.zeros(1), spec_probs=np.zeros(1),
                           embedding=np.zeros((3, 8)))  # fmt: skip
    fmoe = SimpleNamespace(name="fmoe", uses_probs=True, uses_spec=False, semantic=True)
    assert missing_inputs_note(fmoe, top_k) == (
        "policy fmoe reads gate probabilities and embeddings, which trace t lacks: it runs "
        "without them (docs/policies.md says how)"
    )
    assert "reads speculative gate predictions, which" in missing_inputs_note(MoEpic(), top_k)
    assert missing_inputs_note(fmoe, full) is None
    assert missing_inputs_note(LRU(), top_k) is None


def test_a_policy_s_argument_types_are_read_from_its_source_too():
    """Red if the argument types read from a policy's source (what the check of a
    knob's type uses in the compiled build, whose ``__init__`` keeps no annotations)
    differ from the interpreted class's: there ``policy.prefetch_distance=abc`` failed
    as "int object expected; got str" naming no key."""
    from fmoesim.config.build import _source_hints
    from policies.fmoe import FMoE
    from policies.moepic import MoEpic

    fmoe, moepic = _source_hints(FMoE), _source_hints(MoEpic)
    assert (fmoe["prefetch_distance"], fmoe["semantic"], fmoe["label"]) == (int, bool, str | None)
    assert (moepic["split_ratio"], moepic["buffer_experts"]) == (float, int | None)


def test_names_of_refuses_an_empty_item():
    """Red if a stray comma is dropped (``--policies ,`` read as "every policy",
    ``--hardware ,`` as no profile at all) instead of refused naming the option."""
    from fmoesim.errors import names_of

    assert names_of("--p", "lru, lfu") == ["lru", "lfu"]
    assert names_of("--p", "", empty_ok=True) == []
    for text in (",", "lru,", "lru,,lfu", ""):
        with pytest.raises(FmoesimError, match=r"^--p '.*': an empty item"):
            names_of("--p", text)


@pytest.mark.parametrize(
    ("module", "argv", "said"),
    [
        ("replay.campaign", ["score", "{rp}", "--hardware", ",", "--out", "{tmp}/x"],
         "--hardware ',': an empty item (rule: comma-separated names)"),
        ("replay.campaign", ["events", "{rp}", "--hardware", "rtx3090,a100", "--out", "{tmp}/y"],
         "--hardware rtx3090,a100: one hardware profile"),
        ("fmoesim.results.regress", ["--policies", ",", "--golden", "{tmp}/g.csv"],
         "--policies ',': an empty item"),
    ],
)  # fmt: skip
def test_a_stray_comma_in_a_list_option_is_refused(
    module: str, argv: list[str], said: str, tmp_path: Path
) -> None:
    """One line naming the option, exit 2, nothing written.  Red if ``validate-grid
    score --hardware ,`` ends in a traceback (an IndexError on no profiles), if events
    blames a replayed row for a comma-separated --hardware, or if ``fmoesim-regress
    --policies ,`` recomputes every policy."""
    rp = tmp_path / "rp.csv"
    src = ROOT / "results" / "validation" / "h100-measured" / "replay-qwen3-30b-a3b-2.csv"
    rp.write_text("".join(src.read_text().splitlines(keepends=True)[:2]))
    args = [a.format(rp=rp, tmp=tmp_path) for a in argv]
    p = run(module, *args)
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert len(p.stderr.strip().splitlines()) == 1 and said in p.stderr, p.stderr
    assert sorted(x.name for x in tmp_path.iterdir()) == ["rp.csv"]


@pytest.mark.parametrize(
    ("group", "preset", "drop", "said"),
    [("hardware", "rtx3090-pcie4", "pcie_gbps", "sets no pcie_gbps (rule: a hardware preset"),
     ("model", "mixtral-8x7b", "expert_intermediate_size",
      "sets no expert_intermediate_size (rule: a model preset sets its shape")],
)  # fmt: skip
def test_a_preset_that_leaves_out_a_field_is_refused(
    group: str, preset: str, drop: str, said: str, tmp_path: Path
) -> None:
    """A model or hardware preset without one of its numbers, chosen from a searchpath
    folder: one line naming the file and the field, exit 2, nothing written.  Red if the
    run goes ahead on the schema's default (32 GB/s, Mixtral's 14336) under the preset's
    name."""
    conf = tmp_path / "conf" / group
    conf.mkdir(parents=True)
    text = (ROOT / "conf" / group / f"{preset}.yaml").read_text()
    kept = [line for line in text.splitlines() if not line.startswith(f"{drop}:")]
    assert len(kept) == len(text.splitlines()) - 1
    (conf / "mine.yaml").write_text("\n".join(kept) + "\n")
    p = fmoesim(f"hydra.searchpath=[file://{tmp_path / 'conf'}]", f"{group}=mine",
                "serving.max_requests=1", f"output.dir={tmp_path}/runs",
                f"store.dir={tmp_path}/store", cwd=tmp_path)  # fmt: skip
    assert_refused(p, f"{conf / 'mine.yaml'}: {said}")
    assert sorted(x.name for x in tmp_path.iterdir()) == ["conf"]


def test_every_model_and_hardware_preset_sets_its_own_fields() -> None:
    """Red if a committed preset leans on a schema default for a model's shape or a
    machine's number (or if the check refuses a complete preset)."""
    from fmoesim.config.build import PRESET_FIELDS, check_preset_fields
    from fmoesim.config.schema import CONF_DIR

    for group in PRESET_FIELDS:
        files = sorted((CONF_DIR / group).rglob("*.yaml"))
        assert len(files) >= 10, group
        for path in files:
            check_preset_fields(group, path)


def test_a_write_that_fails_names_the_file_asked_for(tmp_path: Path, monkeypatch) -> None:
    """A folder that takes no new file: the error names the file the user asked for and
    the rule, not the temporary beside it (``.g.tmp-host-pid-xyz.csv``).  Red if the
    temporary's name reaches the user."""
    import errno
    import tempfile

    from fmoesim.atomic import atomic_dir, atomic_file
    from fmoesim.errors import os_error_line

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / ".g.tmp-x"))

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    for writer, name in ((atomic_file, "g.csv"), (atomic_dir, "run")):
        with pytest.raises(PermissionError) as got, writer(tmp_path / name):
            pass  # pragma: no cover - the temporary is never made
        assert os_error_line(got.value) == (
            f"{tmp_path / name}: Permission denied (rule: {tmp_path} takes new files)"
        )


def test_from_config_onto_a_folder_leaves_nothing(tmp_path: Path) -> None:
    """``fmoesim-model from-config ... --out FOLDER --force``: one line naming the
    folder, exit 2, no temporary left beside it.  Red if the preset is written to a
    temporary first and left there when the rename fails."""
    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps({
        "model_type": "mixtral", "num_hidden_layers": 2, "num_local_experts": 4,
        "num_experts_per_tok": 2, "hidden_size": 64, "intermediate_size": 128,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
    }))  # fmt: skip
    (tmp_path / "out").mkdir()
    p = run("fmoesim.specs.from_config", "from-config", str(cfg), "--out", str(tmp_path / "out"),
            "--force")  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.strip().endswith(f"{tmp_path / 'out'}: a folder (rule: --out names the "
                                     "preset's file)")  # fmt: skip
    assert sorted(x.name for x in tmp_path.iterdir()) == ["out", "tiny"]
    assert not any((tmp_path / "out").iterdir())


def test_collect_checks_where_it_writes_before_the_model_loads(tmp_path: Path) -> None:
    """A destination under a plain file: one line naming it, before the prompts are read
    or the model is looked for (the model here does not exist).  Red if the check waits
    until the collection writes its first request (after the model has loaded)."""
    (tmp_path / "file").write_text("x")
    out = tmp_path / "file" / "t"
    p = run("fmoesim.cli.collect_cli", str(tmp_path / "no-model"), str(tmp_path / "none.jsonl"),
            str(out))  # fmt: skip
    assert p.returncode == 2, (p.stdout, p.stderr)
    assert p.stderr.strip() == (
        f"fmoesim-collect: error: {out}: cannot be made: {tmp_path / 'file'} is a file "
        "(rule: the trace's folder can be written)"
    )


class UntypedKnobs:
    """A policy-like class whose knobs have defaults and no annotations."""

    def __init__(self, protect_layers=2, prefetch_next=False, threshold=0.5, label="x", other=None):
        self.args = (protect_layers, prefetch_next, threshold, label, other)


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [("prefetch_next", "no", "must be true or false"),
     ("protect_layers", "abc", "must be a number"),
     ("threshold", True, "must be a number"),
     ("label", 3, "must be a string")],
)  # fmt: skip
def test_a_knob_without_annotation_is_checked_by_its_default(key, value, said) -> None:
    """Red if a knob a policy left unannotated takes any value: ``prefetch_next=no`` ran
    with prefetching on (the string "no" is true), ``protect_layers=abc`` failed deep in
    the policy with a traceback."""
    from omegaconf import OmegaConf

    from fmoesim.config.build import argument_type_error

    node = OmegaConf.create({"_target_": f"{__name__}.UntypedKnobs", key: value})
    err = argument_type_error(node)
    assert err is not None and str(err) == f"config key 'policy.{key}' = {value!r}: {said}"
    fine = {"prefetch_next": True, "protect_layers": 3, "threshold": 1, "label": "y", "other": 5}
    assert (
        argument_type_error(OmegaConf.create({"_target_": f"{__name__}.UntypedKnobs", **fine}))
        is None
    )


def test_a_preset_from_a_searchpath_folder_is_its_own_policy(tmp_path: Path) -> None:
    """A policy preset kept outside the repository (``hydra.searchpath``), run as it is:
    its store row's ``policy_args`` is empty, as for a preset of ``conf/policy/``.  Red
    if only ``conf/policy/`` is read, so that the run is labelled with every key of its
    preset as if it changed them (a sweep's filter on ``policy_args == ""`` drops it)."""
    (tmp_path / "ext" / "policy").mkdir(parents=True)
    (tmp_path / "ext" / "policy" / "my-lru.yaml").write_text(
        "_target_: policies.fmoe.FMoE\nlabel: my-lru\ncache: lru\nprefetch_distance: 1\n"
    )
    p = fmoesim(*tiny(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'ext'}]",
                      "policy=my-lru", "output.write=false"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    rows = load_results(tmp_path / "store")
    assert list(rows.policy) == ["my-lru"] and list(rows.policy_args) == [""]
    p = fmoesim(*tiny(tmp_path, f"hydra.searchpath=[file://{tmp_path / 'ext'}]",
                      "policy=my-lru", "policy.cache=lfu", "output.write=false"))  # fmt: skip
    assert p.returncode == 0, p.stderr
    assert sorted(load_results(tmp_path / "store").policy_args) == ["", "cache=lfu"]


def test_a_slurm_sweep_off_a_slurm_machine_is_one_line(monkeypatch) -> None:
    """Red if a SLURM sweep where no ``sbatch`` exists goes on to submitit, which stops
    with a traceback ("Could not detect srun"), instead of one line with the way out."""
    import shutil

    from fmoesim.cli.main import check_launcher_host

    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(FmoesimError, match=r"^hydra/launcher=submitit_slurm: no sbatch on PATH"):
        check_launcher_host(["policy=lru,lfu", "hydra/launcher=submitit_slurm"])
    check_launcher_host(["policy=lru,lfu", "hydra/launcher=submitit_local"])
    monkeypatch.setattr(shutil, "which", lambda name: "/usr/bin/sbatch")
    check_launcher_host(["policy=lru,lfu", "hydra/launcher=submitit_slurm"])


def test_a_preset_is_checked_whoever_chooses_it_and_may_extend_another(tmp_path: Path) -> None:
    """A model preset that extends Mixtral's (``/model/mixtral-8x7b@_here_``, or the
    relative ``mixtral-8x7b@_here_``) and sets only its name runs; one chosen by an
    experiment preset, not on the command line, is checked all the same.  Red if the
    check does not follow Hydra's parent forms (a good preset refused) or looks at the
    command line only (an experiment's incomplete preset runs on the schema's
    defaults)."""
    conf = tmp_path / "conf"
    (conf / "model").mkdir(parents=True)
    (conf / "experiment").mkdir()
    for name, parent in (("here", "/model/mixtral-8x7b"), ("here2", "mixtral-8x7b")):
        (conf / "model" / f"{name}.yaml").write_text(
            f"defaults:\n  - {parent}@_here_\n  - _self_\nname: {name}\n"
        )
    text = (ROOT / "conf" / "model" / "mixtral-8x7b.yaml").read_text()
    (conf / "model" / "broke.yaml").write_text(
        "\n".join(line for line in text.splitlines() if not line.startswith("hidden_size:"))
    )
    (conf / "experiment" / "ex.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: broke\n"
    )
    quick = [f"hydra.searchpath=[file://{conf}]", "serving.max_requests=1", "engine.timing=false",
             "output.write=false", "store.enabled=false"]  # fmt: skip
    for name in ("here", "here2"):
        p = fmoesim(*quick, f"model={name}", cwd=tmp_path)
        assert p.returncode == 0, p.stderr
        assert f"model {name}" in p.stdout
    assert_refused(fmoesim(*quick, "experiment=ex", cwd=tmp_path),
                   f"{conf / 'model' / 'broke.yaml'}: sets no hidden_size")  # fmt: skip


def test_an_eamc_file_that_does_not_fit_is_one_line(tmp_path):
    """Red if a collection file that exists but is empty, a bare .npy array, or saved
    for another model reaches the run and stops it with Hydra's traceback (EOFError,
    TypeError, the loader's ValueError), instead of one line naming policy.eamc_path."""
    from policies.moe_infinity import EAMC, save_eamcs

    empty, array, other = tmp_path / "empty.npz", tmp_path / "a.npy", tmp_path / "other.npz"
    empty.write_bytes(b"")
    np.save(array, np.zeros((1, 2, 4)))
    save_eamcs(other, {"prefill": EAMC(2, 3, 4), "decode": EAMC(2, 3, 4)})  # 3 layers, not 2
    for path, rule in (
        (empty, "not a readable .npz EAMC file"),
        (array, "a .npy array (rule: an EAMC file is the .npz archive save_eamcs writes)"),
        (other, "key 'prefill_eams' has shape (0, 3, 4), expected (n, 2, 4)"),
    ):
        p = fmoesim(*tiny(tmp_path, "policy=moe-infinity", f"policy.eamc_path={path}"))
        assert_refused(p, f"config key 'policy.eamc_path' = '{path}': {rule}")
        assert_nothing_written(tmp_path)


def test_a_sweep_whose_record_cannot_be_written_is_refused_before_it_runs(tmp_path):
    """Red if a sweep whose Hydra record (hydra.sweep.dir; by default results/sweeps/
    under the working directory, read-only in a container) cannot be made starts its
    jobs and stops with Hydra's traceback, instead of one line before any run."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    p = fmoesim("-m", *tiny(tmp_path, "policy=lru,lfu", f"hydra.sweep.dir={blocker}/sw"))
    assert_refused(p, f"config key 'hydra.sweep.dir' = '{blocker}/sw': cannot be made")
    assert_nothing_written(tmp_path)


KILLED_TRACE_WRITER = """
import sys, time
from fmoesim.trace import TraceWriter
from tests._policy_helpers import _manifest
from tests.tiny import TINY
writer = TraceWriter(sys.argv[1], _manifest(TINY))  # kept referenced until the kill
print(writer._tmp, flush=True)
time.sleep(300)
"""


def test_a_killed_trace_writers_temporary_goes_at_the_next_write(tmp_path):
    """Red if the folder a killed trace import or synth (SIGKILL, or SIGTERM, which runs
    no cleanup) was writing stays beside the traces for good: its name must say which
    process made it, and the next trace written to that folder removes it."""
    killed, pid = _kill_a_writer(KILLED_TRACE_WRITER, tmp_path / "a")
    assert killed.is_dir() and killed.name.startswith(f".a.tmp-{HOST}-{pid}-")
    write_sequence_trace(tmp_path / "b", ROUTES)
    assert not killed.exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["b"]
