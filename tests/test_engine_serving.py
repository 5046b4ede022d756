"""Serving schedules against hand-computed batch compositions and latencies.

Online mode (arrivals, FCFS, continuous batching), static batching, the errors of the
arrival sources, and the result files the CLI writes.  Times are closed forms of the
ComputeModel terms and ``t_x = overhead + size / bandwidth`` (see
tests/test_engine_timing.py).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fmoesim.engine import ServingConfig, simulate
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.serving import arrival_times_s
from fmoesim.errors import ConfigError
from policies.lru import LRU
from tests._engine_helpers import (
    TRANSFER_COLUMNS,
    Recording,
    Req,
    pre_gate_s,
    transfer_s,
    write_trace,
)
from tests.test_cli import tiny_overrides
from tests.tiny import TINY, TINY_HW, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]
SIZE = TINY.expert_size_bytes
C = ComputeModel.from_specs(TINY, TINY_HW)
T_X = transfer_s(TINY_HW, TINY)
L = TINY.num_layers
BUDGET = 4 * SIZE
SAME = [[0], [3]]  # a route of one iteration: expert 0 in layer 0, expert 3 in layer 1


def online(**kw) -> ServingConfig:
    """An online-mode serving config."""
    return ServingConfig(mode="online", **kw)


def iteration_s(batch: list[tuple[int, int]], misses_per_layer: int = 0) -> float:
    """One iteration of requests that all route to the same expert per layer.

    ``batch`` holds ``(prompt_tokens, iteration)`` per request; the layer's expert gets
    every token of the batch; ``misses_per_layer`` on-demand loads stall each layer.
    """
    tokens = sum(p if j == 0 else 1 for p, j in batch)
    per_layer = pre_gate_s(C, batch) + C.expert_s(tokens) + misses_per_layer * T_X
    return L * per_layer + C.lm_head_s(len(batch))


# -- 5. online serving --------------------------------------------------------------------
def test_idle_server_jumps_to_a_late_arrival(tmp_path):
    p, a = 2, 5.0
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [SAME, SAME], arrival_s=a)])
    r = simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=online())
    req = r.metrics.request_table()
    ttft = iteration_s([(p, 0)], misses_per_layer=1)
    tpot = iteration_s([(p, 1)])
    assert r.metrics.request_start_s[0] == a
    assert req["ttft_s"][0] == pytest.approx(ttft, rel=1e-9)  # not counting the 5 s idle
    assert req["tpot_s"][0] == pytest.approx(tpot, rel=1e-9)
    assert req["e2e_s"][0] == pytest.approx(ttft + tpot, rel=1e-9)
    assert r.summary["simulated_s"] == pytest.approx(a + ttft + tpot, rel=1e-12)
    assert r.summary["gpu_busy_s"] == pytest.approx(ttft + tpot - L * T_X, rel=1e-9)


def test_ttft_includes_queueing_behind_a_busy_server(tmp_path):
    p, a1 = 2, 1e-4
    reqs = [Req(0, p, [SAME] * 3, arrival_s=0.0), Req(1, p, [SAME] * 3, arrival_s=a1)]
    tr = write_trace(tmp_path / "t", TINY, reqs)
    pol = Recording()
    r = simulate(tr, TINY, TINY_HW, pol, BUDGET, serving=online(max_batch_size=1))
    req = r.metrics.request_table()
    e2e0 = iteration_s([(p, 0)], 1) + iteration_s([(p, 1)]) + iteration_s([(p, 2)])
    assert a1 < iteration_s([(p, 0)], 1)  # request 1 arrives while request 0 is served
    assert req["e2e_s"][0] == pytest.approx(e2e0, rel=1e-9)
    # request 1 waits for all of request 0, then its prefill hits the warm cache
    assert req["ttft_s"][1] == pytest.approx(e2e0 - a1 + iteration_s([(p, 0)]), rel=1e-9)
    assert r.metrics.request_start_s[1] == a1
    assert [b[0] for b in pol.batches] == [(0,)] * 3 + [(1,)] * 3


def test_fcfs_by_arrival_not_request_id(tmp_path):
    arr = {0: 0.5, 1: 0.0, 2: 0.25, 3: 0.25}  # 2 and 3 tie: trace order
    tr = write_trace(tmp_path / "t", TINY, [Req(i, 1, [SAME] * 2, a) for i, a in arr.items()])
    pol = Recording()
    r = simulate(tr, TINY, TINY_HW, pol, BUDGET, serving=online(max_batch_size=1))
    prefills = [b[0] for b in pol.batches if b[2]]
    assert prefills == [(1,), (2,), (3,), (0,)]
    assert r.metrics.request_start_s == {0: 0.5, 1: 0.0, 2: 0.25, 3: 0.25}


def test_continuous_batching_respects_max_batch_size(tmp_path):
    outs = [2, 4, 3]  # all arrive at 0
    reqs = [Req(i, 1, [SAME] * n, arrival_s=0.0) for i, n in enumerate(outs)]
    tr = write_trace(tmp_path / "t", TINY, reqs)
    pol = Recording()
    r = simulate(tr, TINY, TINY_HW, pol, BUDGET, serving=online(max_batch_size=2))
    # prefill {0,1}; decode {0,1} (0 done); prefill {2} joins; decode {1,2} twice
    assert pol.batches == [
        ((0, 1), (0, 0), True),
        ((0, 1), (1, 1), False),
        ((2,), (0,), True),
        ((1, 2), (2, 1), False),
        ((1, 2), (3, 2), False),
    ]
    assert r.summary["iterations"] == 5
    assert max(len(b[0]) for b in pol.batches) <= 2
    # request 2 waited for request 0's two iterations before its own prefill
    it = [
        iteration_s([(1, 0), (1, 0)], 1),
        iteration_s([(1, 1), (1, 1)]),
        iteration_s([(1, 0)]),
        iteration_s([(1, 2), (1, 1)]),
        iteration_s([(1, 3), (1, 2)]),
    ]
    req = r.metrics.request_table()
    np.testing.assert_allclose(req["ttft_s"], [it[0], it[0], it[0] + it[1] + it[2]], rtol=1e-9)
    np.testing.assert_allclose(req["e2e_s"], [sum(it[:2]), sum(it), sum(it)], rtol=1e-9)


def test_decode_batch_needs_union_of_experts(tmp_path):
    # iteration 1: both requests route layer 0 to expert 1 (one access), layer 1 to 3 / 2
    r0 = Req(0, 1, [[[0], [3]], [[1], [3]]], arrival_s=0.0)
    r1 = Req(1, 1, [[[2], [3]], [[1], [2]]], arrival_s=0.0)
    tr = write_trace(tmp_path / "t", TINY, [r0, r1])
    pol = Recording()
    r = simulate(tr, TINY, TINY_HW, pol, BUDGET, serving=online(), access_log=True)
    log = r.accesses
    assert pol.batches == [((0, 1), (0, 0), True), ((0, 1), (1, 1), False)]
    dec = log["iteration"] == 1
    np.testing.assert_array_equal(log["layer"][dec], [0, 1, 1])
    np.testing.assert_array_equal(log["expert"][dec], [1, 2, 3])
    pre = log["iteration"] == 0
    np.testing.assert_array_equal(log["expert"][pre], [0, 2, 3])  # layer 1: 3 once
    assert r.summary["accesses"] == 6
    gates = {(it, layer): counts for it, layer, counts in pol.gates}
    np.testing.assert_array_equal(gates[1, 0], [0, 2, 0, 0])  # tokens summed over the batch
    np.testing.assert_array_equal(gates[1, 1], [0, 0, 1, 1])


def test_poisson_arrivals_deterministic_with_mean_gap():
    n, rate = 20_000, 4.0
    cfg = online(arrivals="poisson", rate_rps=rate)
    nan = np.full(n, np.nan)
    a = arrival_times_s(cfg, nan, n, np.random.default_rng(7))
    b = arrival_times_s(cfg, nan, n, np.random.default_rng(7))
    c = arrival_times_s(cfg, nan, n, np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert a[0] == 0.0 and (np.diff(a) > 0).all()
    # mean of n - 1 exponential gaps: sd = (1 / rate) / sqrt(n - 1) ~ 0.7 % of the mean
    assert np.diff(a).mean() == pytest.approx(1 / rate, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 1.0, 4.0])
def test_gamma_arrivals_have_the_rate_and_the_burstiness_asked_for(cv):
    """Red if the gamma's shape and scale are mixed up (the mean gap would be off by a
    factor cv**2) or the CV is not the one asked for: 40,000 gaps give back the mean
    within 5% and the coefficient of variation within 10%."""
    n, rate = 40_000, 4.0
    cfg = online(arrivals="gamma", rate_rps=rate, arrival_cv=cv).validate()
    nan = np.full(n, np.nan)
    a = arrival_times_s(cfg, nan, n, np.random.default_rng(7))
    np.testing.assert_array_equal(a, arrival_times_s(cfg, nan, n, np.random.default_rng(7)))
    gaps = np.diff(a)
    assert a[0] == 0.0 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.1)


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"arrivals": "gamma", "arrival_cv": 0.0}, "'serving.arrival_cv' = 0.0: must be > 0"),
        ({"arrivals": "gamma", "arrival_cv": float("inf")}, "arrival_cv' = inf: must be a finite"),
        ({"arrivals": "gamma", "rate_rps": 0.0}, "'serving.rate_rps' = 0.0: must be > 0"),
        ({"arrivals": "poisson", "arrival_cv": 2.0}, "arrival_cv' = 2.0: is read with gamma"),
        ({"arrivals": "bursty"}, "must be 'trace', 'poisson', 'gamma' or 'csv'"),
    ],
    ids=["zero_cv", "inf_cv", "zero_rate", "cv_without_gamma", "unknown"],
)
def test_gamma_arrivals_refuse_a_bad_knob(kw, message):
    """Red if a CV that is not a positive number is drawn from (numpy would fail or
    return NaN gaps), or a CV set without gamma arrivals is silently not read."""
    with pytest.raises(ConfigError, match=re.escape(message)):
        online(**kw).validate()
    with pytest.raises(ConfigError, match="arrival_cv' = 3.0: is read with gamma"):
        ServingConfig(arrival_cv=3.0).validate()  # static batches read no arrivals


def test_poisson_run_is_deterministic_for_a_seed(tmp_path):
    reqs = [Req(i, 1, [SAME] * 2) for i in range(4)]  # no arrival_s in the trace
    tr = write_trace(tmp_path / "t", TINY, reqs)
    cfg = online(arrivals="poisson", rate_rps=50.0)

    def starts(seed: int) -> list[float]:
        r = simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=cfg, seed=seed)
        return [r.metrics.request_start_s[i] for i in range(4)]

    s5 = starts(5)
    assert s5 == starts(5)
    assert s5 != starts(6)
    assert s5[0] == 0.0 and s5 == sorted(s5) and len(set(s5)) == 4


def write_azure_csv(path: Path, offsets_s: list[float]) -> Path:
    """An Azure LLM inference trace CSV whose rows arrive at ``offsets_s``."""
    t0 = pd.Timestamp("2023-11-16 18:15:46")
    rows = [
        f"{(t0 + pd.Timedelta(seconds=o)).strftime('%Y-%m-%d %H:%M:%S.%f')},{100 + i},{10 + i}"
        for i, o in enumerate(offsets_s)
    ]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


def test_csv_arrivals_use_timestamps_since_first_row(tmp_path):
    p = 2
    tr = write_trace(tmp_path / "t", TINY, [Req(i, p, [SAME] * 2) for i in range(3)])
    csv = write_azure_csv(tmp_path / "azure.csv", [0.0, 0.5, 2.0, 9.0])  # one row spare
    cfg = online(arrivals="csv", arrivals_csv=str(csv))
    r = simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=cfg)
    starts = [r.metrics.request_start_s[i] for i in range(3)]
    assert starts == pytest.approx([0.0, 0.5, 2.0], abs=1e-6)
    # each request finds the server idle and the cache warm after the first
    req = r.metrics.request_table()
    np.testing.assert_allclose(
        req["ttft_s"],
        [iteration_s([(p, 0)], 1), iteration_s([(p, 0)]), iteration_s([(p, 0)])],
        rtol=1e-9,
    )


def test_trace_arrivals_with_a_null_are_refused(tmp_path):
    reqs = [Req(0, 1, [SAME], arrival_s=0.0), Req(1, 1, [SAME], arrival_s=None)]
    tr = write_trace(tmp_path / "t", TINY, reqs)
    with pytest.raises(ConfigError, match=r"serving\.arrivals.*requests\.parquet row 1 "):
        simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=online(arrivals="trace"))
    # serving only the first request never reads the null
    cfg = online(arrivals="trace", max_requests=1)
    assert simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=cfg).summary["requests"] == 1


def test_csv_with_fewer_rows_than_requests_is_refused(tmp_path):
    tr = write_trace(tmp_path / "t", TINY, [Req(i, 1, [SAME]) for i in range(3)])
    csv = write_azure_csv(tmp_path / "short.csv", [0.0, 1.0])
    cfg = online(arrivals="csv", arrivals_csv=str(csv))
    with pytest.raises(ConfigError, match=r"serving\.arrivals_csv.*has 2 rows but 3 requests"):
        simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=cfg)


def test_online_needs_the_timed_backend(tmp_path):
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [SAME], arrival_s=0.0)])
    with pytest.raises(ConfigError, match=r"engine\.timing"):
        simulate(tr, TINY, TINY_HW, LRU(), BUDGET, serving=online(), timing=False)


# -- 6. static batching -------------------------------------------------------------------
def test_static_batch_runs_until_its_longest_request_ends(tmp_path):
    p0, p1, p2 = 2, 3, 1
    route = [[0], [1]]
    reqs = [Req(0, p0, [route] * 2), Req(1, p1, [route] * 4), Req(2, p2, [route] * 2)]
    tr = write_trace(tmp_path / "t", TINY, reqs)
    pol = Recording()
    r = simulate(tr, TINY, TINY_HW, pol, 2 * SIZE, serving=ServingConfig(batch_size=2))
    assert pol.batches == [
        ((0, 1), (0, 0), True),
        ((0, 1), (1, 1), False),
        ((1,), (2,), False),  # request 0 finished; request 2 waits for the next batch
        ((1,), (3,), False),
        ((2,), (0,), True),
        ((2,), (1,), False),
    ]
    prefill = iteration_s([(p0, 0), (p1, 0)], misses_per_layer=1)  # the only cold misses
    d1 = iteration_s([(p0, 1), (p1, 1)])
    d2, d3 = iteration_s([(p1, 2)]), iteration_s([(p1, 3)])
    ttft2, tpot2 = iteration_s([(p2, 0)]), iteration_s([(p2, 1)])
    req = r.metrics.request_table()
    np.testing.assert_array_equal(req["request_id"], [0, 1, 2])
    np.testing.assert_allclose(req["ttft_s"], [prefill, prefill, ttft2], rtol=1e-9)
    np.testing.assert_allclose(req["tpot_s"], [d1, (d1 + d2 + d3) / 3, tpot2], rtol=1e-9)
    np.testing.assert_allclose(
        req["e2e_s"], [prefill + d1, prefill + d1 + d2 + d3, ttft2 + tpot2], rtol=1e-9
    )
    # the second batch starts when the first one's longest request ends
    assert r.metrics.request_start_s[2] == pytest.approx(prefill + d1 + d2 + d3, rel=1e-9)
    assert r.summary["simulated_s"] == pytest.approx(
        prefill + d1 + d2 + d3 + ttft2 + tpot2, rel=1e-9
    )
    assert r.summary["misses"] == L


# -- 10. the CLI's result files -------------------------------------------------------------
ROUTES = [[0, 3], [1, 3], [0, 3], [2, 3], [1, 3], [0, 3]]  # LRU on 2 experts: 5 hits / 12


def test_cli_writes_layer_transfer_and_access_tables(tmp_path):
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    out = tmp_path / "out"
    args = [
        *tiny_overrides(trace, out),
        "output.name=run",
        "output.plot=false",
        "output.access_log=true",
        "serving.max_requests=2",
    ]
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    run = out / "run"
    summary = pd.read_parquet(run / "summary.parquet").iloc[0]
    layers = pd.read_parquet(run / "layers.parquet")
    transfers = pd.read_parquet(run / "transfers.parquet")
    accesses = pd.read_parquet(run / "accesses.parquet")
    assert not (run / "hit_rate.png").exists()
    # layer 0 always misses, layer 1 misses once (see tests/test_engine_lru.py)
    assert layers["layer"].tolist() == [0, 1]
    assert layers["hits"].tolist() == [0, 5] and layers["misses"].tolist() == [6, 1]
    assert layers["late"].tolist() == [0, 0]
    assert (summary["hits"], summary["misses"]) == (5, 7)
    assert set(transfers.columns) == TRANSFER_COLUMNS
    assert len(transfers) == summary["transfers"] == 7
    assert (transfers["reason"] == "on_demand").all() and transfers["used"].all()
    assert (transfers["start_s"] <= transfers["end_s"]).all()
    assert set(accesses.columns) == {
        "step", "iteration", "layer", "expert", "gpu", "outcome", "time_s",
    }  # fmt: skip
    assert len(accesses) == summary["accesses"] == 12
    assert accesses["expert"].tolist() == [e for route in ROUTES for e in route]
    assert np.bincount(accesses["outcome"], minlength=3).tolist() == [5, 0, 7]


def test_readme_s_burstiness_example_holds():
    """Red if README.md's online-serving example no longer says what the simulator gives:
    on the bundled trace at 0.01 requests/s, LRU's mean TTFT with gamma gaps of CV 1 and
    of CV 4 (3.2 s and 120 s)."""
    from fmoesim.cli.main import compose_config, run_config

    ttft = {}
    for cv in (1, 4):
        row = run_config(
            compose_config(
                ["serving.mode=online", "serving.arrivals=gamma", "serving.rate_rps=0.01",
                 f"serving.arrival_cv={cv}", "serving.max_batch_size=4", "output.write=false",
                 "store.enabled=false", "progress=false", "output.verbose=false"]
            )
        )  # fmt: skip
        ttft[cv] = row["ttft_mean_s"]
    assert (round(ttft[1], 1), round(ttft[4])) == (3.2, 120), ttft
    assert "from 3.2 s to 120 s" in " ".join((ROOT / "README.md").read_text().split())
