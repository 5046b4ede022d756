"""CI regression on hit rates: every policy preset on the bundled trace at the
golden budgets must reproduce ``results/golden/hit_rates.csv`` within the stated
tolerance, unless that file is updated in the same commit (``fmoesim-regress --update``)."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

from fmoesim.config.build import preset_names
from fmoesim.results.regress import (
    GOLDEN,
    TOLERANCE_POINTS,
    compare,
    compute_table,
    format_table,
    read_golden,
)


def test_hit_rates_match_the_golden_file():
    golden = read_golden(GOLDEN)
    assert set(golden.policy) == set(preset_names("policy"))  # every policy is guarded
    m = compare(golden, compute_table())
    moved = m[m.status != "ok"]
    assert moved.empty, (
        f"hit rates moved beyond {TOLERANCE_POINTS} points; if intended run "
        f"`fmoesim-regress --update` and commit {GOLDEN}:\n{format_table(moved)}"
    )


def test_compare_flags_moves_new_and_gone():
    old = pd.DataFrame(
        {"policy": ["a", "a", "b"], "budget_gb": [1.0, 2.0, 1.0], "hit_rate": [0.5, 0.6, 0.7]}
    )
    new = pd.DataFrame(
        {
            "policy": ["a", "a", "c"],
            "budget_gb": [1.0, 2.0, 1.0],
            "hit_rate": [0.5005, 0.61, 0.2],
        }  # fmt: skip
    )
    m = compare(old, new, tolerance_points=0.1)
    assert list(m.status) == ["ok", "MOVED", "GONE", "NEW"]  # +0.05 pt ok, +1 pt moved
    assert m.delta_points[1] == pytest.approx(1.0)
    table = format_table(m)
    assert "| a | 2 | 60.000 | 61.000 | +1.000 | MOVED |" in table


def test_compare_flags_a_golden_row_of_another_setting():
    """Red if a golden row measured on another model, trace, request count or number of
    accesses passes because its hit rate happens to lie within the tolerance."""
    base = {"policy": ["a"], "budget_gb": [1.0], "hit_rate": [0.5], "model": ["m"],
            "trace": ["traces/default"], "requests": [4], "accesses": [100]}  # fmt: skip
    assert list(compare(pd.DataFrame(base), pd.DataFrame(base)).status) == ["ok"]
    for col, other in (("model", "q"), ("trace", "/elsewhere"), ("requests", 8),
                       ("accesses", 101)):  # fmt: skip
        old = pd.DataFrame({**base, col: [other]})
        m = compare(old, pd.DataFrame(base))
        assert list(m.status) == ["SETTING"], col
        # red if the row does not say what it measured differently
        assert f"| SETTING: {col} {other} -> {base[col][0]} |" in format_table(m), col
    # a row on one side only leaves the others as they are (not SETTING: 4 is not 4.0)
    extra = pd.DataFrame({**base, "policy": ["b"]})
    both = compare(pd.DataFrame(base), pd.concat([pd.DataFrame(base), extra]))
    assert list(both.status) == ["ok", "NEW"]
    assert list(compare(pd.concat([pd.DataFrame(base), extra]), pd.DataFrame(base)).status) == [
        "ok", "GONE"]  # fmt: skip
    # a golden file without the setting's columns is compared on its hit rates alone
    old = pd.DataFrame({k: base[k] for k in ("policy", "budget_gb", "hit_rate")})
    assert list(compare(old, pd.DataFrame(base)).status) == ["ok"]


def run(*args: str):  # type: ignore[no-untyped-def]
    return subprocess.run(
        [sys.executable, "-m", "fmoesim.results.regress", *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def test_cli_update_then_check_then_catch_a_move(tmp_path):
    golden = tmp_path / "g.csv"
    p = run("--golden", str(golden), "--policies", "lru,lfu", "--update")
    assert p.returncode == 0, p.stderr
    assert len(pd.read_csv(golden)) == 4
    p = run("--golden", str(golden), "--policies", "lru,lfu")
    assert p.returncode == 0, p.stderr
    assert "all 4 hit rates within 0.1 points" in p.stdout
    df = pd.read_csv(golden)
    df.loc[df.policy == "lfu", "hit_rate"] += 0.01
    df.to_csv(golden, index=False)
    p = run("--golden", str(golden), "--policies", "lru,lfu")
    assert p.returncode == 1
    assert "MOVED" in p.stdout and "-1.000" in p.stdout
    # red if the summary lumps the statuses, or its command updates the default golden
    # file (every policy) instead of this one
    assert (
        "2 of 4 rows differ from the golden file: 2 MOVED beyond 0.1 points (largest "
        "-1.000: lfu at 12 GB)" in p.stderr
    ), p.stderr
    assert f"run `fmoesim-regress --update --policies lfu --golden {golden}`" in p.stderr
    # updating one policy rewrites its rows and keeps the other policy's (a golden file
    # cut down to the named policies, or lfu's row left moved, fails here)
    extra = pd.DataFrame({"policy": ["aaa"], "budget_gb": [12.0], "hit_rate": [0.25]})
    pd.concat([extra, df]).to_csv(golden, index=False)
    gone = pd.DataFrame({"policy": ["lfu"], "budget_gb": [99.0], "hit_rate": [0.5]})
    pd.concat([extra, df, gone]).to_csv(golden, index=False)  # a budget no longer computed
    p = run("--golden", str(golden), "--policies", "lfu", "--update")
    assert p.returncode == 0, p.stderr
    assert "1 row no longer computed dropped (lfu at 99 GB)" in p.stdout  # red if silent
    kept = pd.read_csv(golden)
    assert list(kept.policy) == ["aaa", "lfu", "lfu", "lru", "lru"]
    assert kept.hit_rate[0] == 0.25
    assert run("--golden", str(golden), "--policies", "lru,lfu").returncode == 0


def test_bad_golden_is_one_line(tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("policy,budget_gb,hit_rate\nlru,12,1.5\n")
    p = run("--golden", str(bad), "--policies", "lru")
    assert p.returncode == 2
    assert p.stderr.strip() == f"fmoesim-regress: error: {bad}: row 1: hit_rate must be in [0, 1]"


def test_an_update_that_cannot_write_is_refused_before_the_runs(tmp_path):
    """Red if --update runs every policy and only then finds that its golden file cannot
    be written (under a file here), or says so in more than one line."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    p = run("--golden", str(blocker / "g.csv"), "--policies", "lru", "--update")
    assert p.returncode == 2
    assert p.stderr.strip() == (
        f"fmoesim-regress: error: --golden {blocker}/g.csv: cannot be made: {blocker} is a "
        "file (rule: --update writes it)"
    )
    assert p.stdout == ""  # no run's progress before the refusal
