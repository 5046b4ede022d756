"""``fmoesim-min-budget`` (MoEpic §4.3 Fig. 8): bisection against a linear scan."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fmoesim.cli.min_budget import min_budget
from fmoesim.engine.simulate import simulate
from fmoesim.trace import read_trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.lru import LRU
from tests.test_cli import tiny_overrides
from tests.tiny import TINY, TINY_HW

ROOT = Path(__file__).resolve().parents[1]


def test_bisection_finds_the_first_budget_under_the_target():
    calls: list[int] = []

    def tpot(n: int) -> float:
        calls.append(n)
        return max(10.0 - n, 3.0)

    a = min_budget(tpot, 1, 64, 4.0)
    assert (a.experts, a.tpot_s) == (6, 4.0)
    assert len(calls) <= 8  # log2(64) + 2
    assert min_budget(tpot, 1, 64, 2.0).experts is None
    assert min_budget(tpot, 1, 64, 9.5).experts == 1


def test_bisection_equals_a_linear_scan_over_real_runs(tmp_path):
    path = tmp_path / "t"
    generate(TINY, SyntheticConfig(num_requests=3, embedding_dim=0, seed=4), path)
    tr = read_trace(path)
    size = TINY.expert_size_bytes

    def tpot(n: int) -> float:
        return simulate(tr, TINY, TINY_HW, LRU(), n * size).summary["tpot_mean_s"]

    scan = {n: tpot(n) for n in range(1, 9)}
    assert all(scan[n + 1] <= scan[n] for n in range(1, 8))  # LRU is a stack algorithm
    for target in sorted(set(scan.values())):
        want = min(n for n, t in scan.items() if t <= target)
        assert min_budget(tpot, 1, 8, target).experts == want


def test_cli_prints_the_table_and_refuses_bad_targets(tmp_path):
    path = tmp_path / "t"
    generate(TINY, SyntheticConfig(num_requests=2, embedding_dim=0, seed=4), path)
    cmd = [sys.executable, "-m", "fmoesim.cli.min_budget"]
    over = [o for o in tiny_overrides(path, tmp_path / "out") if not o.startswith("cache.")]
    p = subprocess.run(
        [*cmd, "--target-tpot-ms", "1000", *over], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0, p.stderr
    assert "| 1000 | 1 |" in p.stdout  # one expert is enough for a 1 s target
    p = subprocess.run(
        [*cmd, "--target-tpot-ms", "1000,1000", *over], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 0 and p.stdout.count("| 1000 | 1 |") == 1  # a target once
    p = subprocess.run(
        [*cmd, "--target-tpot-ms", "-5", *over], capture_output=True, text=True, cwd=ROOT
    )
    assert p.returncode == 2 and "--target-tpot-ms" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("bad", [(5, 4)])
def test_empty_range_is_refused(bad):
    with pytest.raises(ValueError, match="empty budget range"):
        min_budget(lambda n: 0.0, *bad, 1.0)
