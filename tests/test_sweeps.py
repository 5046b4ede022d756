"""Sweeps and the results store: one row per run keyed by its config hash,
reruns skip what is done, an interrupted sweep resumes with nothing lost or duplicated,
the joblib launcher gives the same rows, the loader returns a tidy DataFrame."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fmoesim.cli.sweep import sweep_size
from fmoesim.results.store import ResultsStore, config_key, load_results
from tests.test_cli import ROOT, ROUTES, tiny_overrides, write_sequence_trace

SWEEP = ["policy=lru,lfu", "cache.budget_gb=0.012,0.024"]  # 1 and 2 experts of 12 MB
# hand-traced on ROUTES (tests/test_engine_lru.py): 5/12 hits with one expert, 8/12 with two
EXPECTED = {("lru", 0.012): 5 / 12, ("lru", 0.024): 8 / 12}


def sweep(tmp: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    trace = tmp / "seq"
    if not trace.exists():
        write_sequence_trace(trace, ROUTES)
    ov = [o for o in tiny_overrides(trace, tmp / "out") if not o.startswith("cache.")]
    return subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", "-m", *ov, *SWEEP, "output.write=false",
         f"hydra.sweep.dir={tmp}/sweep", *extra],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip


def test_config_key_ignores_where_results_go():
    a = {"policy": {"_target_": "x"}, "cache": {"budget_gb": 12}, "progress": True,
         "output": {"dir": "a"}, "store": {"dir": "s"}}  # fmt: skip
    b = {**a, "progress": False, "output": {"dir": "b"}, "store": {"dir": "t"}}
    c = {**a, "cache": {"budget_gb": 24}}
    assert config_key(a)[0] == config_key(b)[0]
    assert config_key(a)[0] != config_key(c)[0]
    assert len(config_key(a)[0]) == 16
    # another code version or other input files: another run
    assert config_key(a, {"code_version": "x"})[0] != config_key(a, {"code_version": "y"})[0]
    assert config_key(a, {"code_version": "x"})[1] == config_key(a)[1]


def test_input_digest_follows_the_files(tmp_path):
    from fmoesim.results.store import input_digest

    f = tmp_path / "arrivals.csv"
    f.write_text("a")
    d1 = input_digest([f, None])
    f.write_text("b")
    assert input_digest([f, None]) != d1
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    d2 = input_digest([trace])
    assert input_digest([trace]) == d2
    (trace / "trace.json").write_text((trace / "trace.json").read_text() + " ")
    assert input_digest([trace]) != d2


def test_a_swept_boolean_is_echoed_as_it_is_typed():
    """Red if a job's line shows the sweeper's Python spelling (engine.timing=False),
    which is not what the user typed nor what the config holds."""
    from fmoesim.cli.sweep import _as_typed

    assert _as_typed("engine.timing=False") == "engine.timing=false"
    assert _as_typed("policy.semantic=True") == "policy.semantic=true"
    assert _as_typed("policy=lru") == "policy=lru" and _as_typed("name=Falsey") == "name=Falsey"


def test_sweep_size():
    assert sweep_size(["policy=lru,lfu,lcp", "cache.budget_gb=6,12", "seed=0"]) == 6
    assert sweep_size(["seed=range(0,4)"]) == 4
    assert sweep_size([]) == 1


def test_sweep_store_skip_and_resume(tmp_path):
    p = sweep(tmp_path)
    assert p.returncode == 0, p.stderr
    assert "sweep: 4 runs" in p.stdout and "[sweep 4/4]" in p.stdout
    assert f"results store {tmp_path / 'out' / 'store'}" in p.stdout
    store = tmp_path / "out" / "store"
    files = sorted(store.glob("*.parquet"))
    assert len(files) == 4
    df = load_results(store)
    assert len(df) == 4 and df["config_hash"].is_unique
    assert {"policy", "budget_gb", "hit_rate", "tpot_mean_s", "seed", "config_json",
            "fmoesim_version", "python"} <= set(df.columns)  # fmt: skip
    for (pol, gb), want in EXPECTED.items():
        got = df[(df.policy == pol) & (df.budget_gb.round(3) == gb)].hit_rate
        assert list(got) == [pytest.approx(want)]
    before = {f.name: f.stat().st_mtime_ns for f in files}

    # an interrupted sweep: one run's row never written, a half-written temp file left
    files[0].unlink()
    (store / f".{files[1].stem}.abc.parquet").write_bytes(b"half")
    p = sweep(tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.count("done already") == 3
    after = sorted(f.name for f in store.glob("*.parquet") if not f.name.startswith("."))
    assert after == sorted(before)  # the missing row is back, nothing duplicated
    for f in files[1:]:
        assert f.stat().st_mtime_ns == before[f.name]  # done runs were not rerun
    pd.testing.assert_frame_equal(
        load_results(store).drop(columns=["wall_s", "speedup_vs_real"]),
        df.drop(columns=["wall_s", "speedup_vs_real"]),
    )


def _installed(module: str) -> bool:
    """Whether ``module`` can be imported; False also where its parent package is absent
    (``find_spec`` of a submodule raises then, which would fail this file's collection)."""
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


@pytest.mark.skipif(
    not _installed("hydra_plugins.hydra_joblib_launcher"),
    reason="hydra-joblib-launcher is not installed (pip install -e '.[sweep]')",
)
def test_joblib_launcher_gives_the_same_rows(tmp_path):
    p = sweep(tmp_path, "hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert p.returncode == 0, p.stderr
    df = load_results(tmp_path / "out" / "store")
    assert len(df) == 4
    for (pol, gb), want in EXPECTED.items():
        got = df[(df.policy == pol) & (df.budget_gb.round(3) == gb)].hit_rate
        assert list(got) == [pytest.approx(want)]


@pytest.mark.skipif(
    not _installed("hydra_plugins.hydra_ray_launcher") or not _installed("ray"),
    reason="Ray and hydra-ray-launcher are not installed (pip install -e '.[ray]')",
)
def test_ray_launcher_on_a_local_ray_instance(tmp_path):
    p = sweep(tmp_path, "hydra/launcher=ray", "+hydra.launcher.ray.init.num_cpus=2")
    assert p.returncode == 0, p.stderr
    assert len(load_results(tmp_path / "out" / "store")) == 4


def test_store_add_is_atomic_and_replaces_its_own_row(tmp_path):
    s = ResultsStore(tmp_path / "st")
    s.add({"config_hash": "abc", "hit_rate": 0.5})
    s.add({"config_hash": "abc", "hit_rate": 0.25})
    assert [p.name for p in (tmp_path / "st").iterdir()] == ["abc.parquet"]
    assert s.get("abc")["hit_rate"] == 0.25
    assert load_results(tmp_path / "empty").empty


def test_code_version_covers_the_simulator_not_the_reporting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A changed engine or policy source changes :func:`code_version`; a changed figure
    or scoreboard module does not (their stored runs stay current).  Red when the
    reporting modules are hashed, or when the exclusion swallows a simulator module."""
    import fmoesim.config.schema as schema
    from fmoesim.results import store

    for rel in (
        "fmoesim/engine/runner.py",
        "fmoesim/plots/figures.py",
        "fmoesim/reproduce/score.py",
        "fmoesim/cli/plot_cli.py",
        "fmoesim/cli/main.py",
        "policies/lru.py",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# v1\n")
    monkeypatch.setattr(schema, "PROJECT_ROOT", tmp_path)

    def version() -> str:
        store.code_version.cache_clear()
        return store.code_version()

    try:
        base = version()
        for rel, counts in (
            ("fmoesim/plots/figures.py", False),
            ("fmoesim/reproduce/score.py", False),
            ("fmoesim/cli/plot_cli.py", False),
            ("fmoesim/engine/runner.py", True),
            ("fmoesim/cli/main.py", True),
            ("policies/lru.py", True),
        ):
            (tmp_path / rel).write_text("# v2\n")
            now = version()
            assert (now != base) is counts, rel
            base = now
    finally:
        store.code_version.cache_clear()


def _external_policy(folder: Path, body: str = "") -> Path:
    """A policy package kept outside the repository (``mypol``, an LFU under another
    name) and its preset in ``folder/conf/policy/my-lfu.yaml``; returns the conf folder."""
    pkg = folder / "src" / "mypol"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "mine.py").write_text(
        "from policies.lfu import LFU\n\n\nclass MyLFU(LFU):\n    name = 'my-lfu'\n" + body
    )
    conf = folder / "conf" / "policy"
    conf.mkdir(parents=True, exist_ok=True)
    (conf / "my-lfu.yaml").write_text("_target_: mypol.mine.MyLFU\n")
    return folder / "conf"


def test_policy_code_version_covers_a_policy_kept_outside(tmp_path, monkeypatch):
    """Red if the project's own policies get a digest of their own (every stored hash
    would change), or an outside policy's digest misses an edit or depends on where
    the package lies."""
    from fmoesim.results.store import policy_code_version

    assert policy_code_version("policies.lfu.LFU") is None
    assert policy_code_version("fmoesim.engine.runner.Runner") is None
    assert policy_code_version("nosuchpackage.x.Y") is None
    _external_policy(tmp_path / "a")
    _external_policy(tmp_path / "b")
    monkeypatch.syspath_prepend(str(tmp_path / "a" / "src"))
    first = policy_code_version("mypol.mine.MyLFU")
    assert first is not None and len(first) == 12
    monkeypatch.syspath_prepend(str(tmp_path / "b" / "src"))  # the same code elsewhere
    assert policy_code_version("mypol.mine.MyLFU") == first
    _external_policy(tmp_path / "b", body="    # an edit\n")
    assert policy_code_version("mypol.mine.MyLFU") != first


def test_a_sweep_reruns_an_outside_policy_after_its_code_changed(tmp_path):
    """Red if a policy kept outside the repository (docs/development.md) is left out of
    a run's hash: after an edit of its module, a sweep would answer "done already" with
    the results of the old code."""
    import os

    conf = _external_policy(tmp_path)
    trace = tmp_path / "seq"
    write_sequence_trace(trace, ROUTES)
    args = [
        sys.executable, "-m", "fmoesim.cli.main", *tiny_overrides(trace, tmp_path / "out"),
        f"hydra.searchpath=[file://{conf}]", "policy=my-lfu", "output.write=false",
        "store.skip_done=true",
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "src")}

    def go() -> str:
        p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
        assert p.returncode == 0, p.stderr
        return p.stdout

    assert "done already" not in go()
    assert "done already" in go()  # the same code: skipped
    _external_policy(tmp_path, body="    # an edit\n")
    assert "done already" not in go()
    rows = load_results(tmp_path / "out" / "store")
    assert len(rows) == 2 and rows["policy_code_version"].nunique() == 2
