"""``fmoesim-validate`` on the CPU path: the report, its numbers and its warnings."""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("torch", reason="the replay needs torch")

from replay.validate import compare, rel_err, validate  # noqa: E402
from tests._baseline_helpers import write_one_token_trace  # noqa: E402
from tests.test_cli import SHAPE, model_overrides  # noqa: E402
from tests.test_policy_contract import MODEL  # noqa: E402


def overrides(trace: str) -> list[str]:
    attention = ("num_attention_heads", "num_kv_heads", "head_dim", "vocab_size")
    return [
        f"workload.path={trace}",
        "progress=false",
        *model_overrides(MODEL, SHAPE + attention),
        f"cache.budget_gb={12 * MODEL.expert_size_bytes / 1e9}",
    ]


def test_errors_by_hand():
    assert rel_err(1.1, 1.0) == pytest.approx(0.1)
    rows = [
        {"sim_ttft_mean_s": 1.0, "replay_ttft_mean_s": 2.0, "sim_tpot_mean_s": 0.9,
         "replay_tpot_mean_s": 1.0, "sim_hit_rate": 0.5, "replay_hit_rate": 0.49},
        {"sim_ttft_mean_s": 3.0, "replay_ttft_mean_s": 2.0, "sim_tpot_mean_s": 1.2,
         "replay_tpot_mean_s": 1.0, "sim_hit_rate": 0.5, "replay_hit_rate": 0.52},
    ]  # fmt: skip
    agg = compare(rows)
    assert agg["ttft_err"] == pytest.approx(0.5)  # |-0.5| and |+0.5|
    assert agg["tpot_err"] == pytest.approx(0.15)  # 0.1 and 0.2
    assert agg["hit_gap_points"] == pytest.approx(2.0)


def test_cpu_report(tmp_path):
    trace = write_one_token_trace(tmp_path / "t", MODEL, 3, 5, 8, seed=4)
    out = validate(["lru", "lfu"], overrides(str(trace.path)), "cpu", tmp_path / "report")
    md = (out / "report.md").read_text()
    assert "CPU path" in md and "meaningless" in md
    assert "a prefetching policy's hits depend on when its transfers land" in md
    assert "| lru |" in md and "| lfu |" in md
    df = pd.read_csv(out / "validation.csv")
    assert list(df["policy"]) == ["lru", "lfu"]
    # demand-only decisions do not depend on timing: identical hit rates
    assert (df["sim_hit_rate"] == df["replay_hit_rate"]).all()
    assert "largest hit-rate gap 0 pt (target <= 1 pt): met" in md
    # which is faster: one pair, by TPOT and by TTFT, as the CSV's numbers order it
    for lab, key in (("TPOT", "tpot_mean_s"), ("TTFT", "ttft_mean_s")):
        alike = int((df[f"sim_{key}"].diff().iloc[1] * df[f"replay_{key}"].diff().iloc[1]) > 0)
        fast = df.policy[df[f"replay_{key}"].idxmin()]
        want = f"- which policy is faster, by {lab}: the simulator orders {alike} of the 1 pairs"
        assert want in md and f"the fastest is {fast} in the replay" in md
        assert "simulated (meaningless on the CPU)" in md
    assert (df["replay_tpot_mean_s"] > 0).all() and (df["sim_tpot_mean_s"] > 0).all()
    assert "measured coefficients: no" in md  # tiny-hw has no measured entry
    assert (out / "validation.png").stat().st_size > 1000
    assert (out / "validation.pdf").stat().st_size > 1000


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "replay.validate", *args], capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip


def test_bad_input_is_one_line(tmp_path):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    p = run("--device", "cpu", "--out", str(tmp_path / "full"), "--policies", "lru")
    assert p.returncode == 2
    assert p.stderr.strip().splitlines() == [
        f"fmoesim-validate: error: --out {tmp_path / 'full'}: exists and is not empty "
        "(pick another directory)"
    ]
    p = run("--device", "cpu", "--out", str(tmp_path / "o"), "--policies", "nosuch")
    assert p.returncode == 2
    assert "policy=nosuch: unknown policy; valid:" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()
    # a bad second preset, or an --out that cannot be made, before the first replay: the
    # replay of lru (its line on stdout) came first, and its device time was lost
    p = run("--device", "cpu", "--out", str(tmp_path / "o"), "--policies", "lru,nosuch")
    assert p.returncode == 2 and "policy=nosuch: unknown policy" in p.stderr
    assert "lru:" not in p.stdout, p.stdout
    p = run("--device", "cpu", "--out", str(tmp_path / "full" / "x" / "v"), "--policies", "lru")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        f"fmoesim-validate: error: --out {tmp_path / 'full' / 'x' / 'v'}: cannot be made: "
        f"{tmp_path / 'full' / 'x'} is a file"
    ]
    # the simulator's what-if link order has no replay: refused before the first run
    p = run("--device", "cpu", "--out", str(tmp_path / "f"), "--policies", "lru",
            "engine.link_order=fifo")  # fmt: skip
    assert p.returncode == 2 and len(p.stderr.strip().splitlines()) == 1, p.stderr
    assert "'engine.link_order' = 'fifo': is the simulator's what-if" in p.stderr
    assert not (tmp_path / "f").exists()
    # hit-rate-only mode has no times to compare: red if the run went on timed (the
    # override ignored), or the option between the overrides is refused by argparse
    p = run("--device", "cpu", "--out", str(tmp_path / "h"), "engine.timing=false",
            "--policies", "lru", "serving.max_requests=1")  # fmt: skip
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "fmoesim-validate: error: config key 'engine.timing' = False: fmoesim-validate "
        "compares timed runs: drop it"
    ], p.stderr
    assert not (tmp_path / "h").exists()
    # a device the replay cannot use: refused before the synthetic trace is made (14 s,
    # a progress line and a bar on stderr before the error)
    p = run("--device", "tpu", "--out", str(tmp_path / "d"), "--policies", "lru")
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "fmoesim-validate: error: --device tpu: must be 'cpu' or 'cuda[:N]'"
    ]
    assert not (tmp_path / "d").exists()
