"""The simulator-vs-replay grid (``fmoesim-validate-grid``): its runs, the hooks' timer,
the scoring arithmetic by hand, a CPU replay scored end to end, and the pieces of the
replay it relies on (compute repeats, shared host weights, the multi-model profile)."""

from __future__ import annotations

import csv
import time
from dataclasses import replace
from pathlib import Path

import pytest

from fmoesim.errors import FmoesimError
from replay import campaign as C


def test_the_default_grid_has_every_run_once_most_important_first():
    """Red if a crossover run at factor 1 duplicates the grid's batch-1 run, if a run
    loses its policy, budget or mode override, or if the order changes (batch 1 first:
    a replay cut short by its deadline keeps the batch-1 runs)."""
    runs = C.grid_runs()
    keys = [r.key() for r in runs]
    assert len(keys) == len(set(keys))
    per_model = 2 * 2 * len(C.POLICIES) + (len(C.CROSSOVER_FACTORS) - 1) * 4
    assert len(runs) == 2 * per_model == 96
    first = runs[: 2 * len(C.POLICIES)]
    assert {r.mode for r in first} == {"batch1"} and {r.model for r in first} == {"olmoe-1b-7b"}
    for r in runs:
        o = set(r.overrides)
        assert {f"policy={r.policy}", f"cache.budget_gb={r.budget_gb}", f"model={r.model}"} <= o
        assert set(C.MODES[r.mode]) <= o
    assert {r.compute_repeat for r in runs if r.compute_repeat > 1} == {2, 4, 8}
    assert all(r.mode == "batch1" for r in runs if r.compute_repeat > 1)


def test_time_calls_adds_up_the_hooks_host_time_and_keeps_their_results():
    """Red if a wrapped hook drops its return value, or its time or calls go uncounted,
    or if ``into`` does not gather every hook into one total; red too if a call's own
    time keeps the timed calls made inside it, or the shared stack is left non-empty."""

    class Slow:
        def on_gate(self, layer, gate):
            time.sleep(0.01)
            return ("actions", layer)

        def victim(self, candidates, incoming):
            return min(candidates)

    p = Slow()
    acc = C.time_calls(p, C.HOOKS, into="hooks")
    assert p.on_gate(3, None) == ("actions", 3)
    assert p.victim([5, 2], 9) == 2
    assert list(acc) == ["hooks"] and acc["hooks"][1] == 2 and acc["hooks"][0] >= 0.01
    q = Slow()
    each = C.time_calls(q, ("on_gate", "victim", "absent"), prefix="p_")
    q.victim([1], 2)
    assert sorted(each) == ["p_on_gate", "p_victim"]  # a missing name is skipped
    assert each["p_on_gate"] == [0.0, 0, 0.0] and each["p_victim"][1] == 1
    # nested timed calls sharing a stack: the outer one's own time leaves the inner out
    nest: list[list[float]] = []

    class Outer:
        def __init__(self, inner):
            self.inner = inner

        def run(self):
            time.sleep(0.01)
            return self.inner.wait()

    class Inner:
        def wait(self):
            time.sleep(0.03)
            return 7

    inner = Inner()
    outer = Outer(inner)
    ti = C.time_calls(inner, ("wait",), stack=nest)
    to = C.time_calls(outer, ("run",), stack=nest)
    assert outer.run() == 7 and nest == []
    assert to["run"][0] >= 0.04 and 0.01 <= to["run"][2] < 0.03
    assert ti["wait"][2] == ti["wait"][0] >= 0.03
    # ``within``: the calls made inside another timed one add up apart too, at any depth
    nest2: list[list[object]] = []
    a, b = Inner(), Inner()
    wrapper = Outer(a)
    tw = C.time_calls(a, ("wait",), prefix="a_", stack=nest2, within={"a_wait": "run"})
    C.time_calls(wrapper, ("run",), stack=nest2)
    C.time_calls(b, ("wait",), prefix="b_", stack=nest2, within={"b_wait": "run"})
    assert wrapper.run() == 7 and a.wait() == 7 and b.wait() == 7
    assert tw["a_wait"][1] == 2 and tw["a_wait_in_run"][1] == 1  # one of two inside run
    assert 0.03 <= tw["a_wait_in_run"][0] < tw["a_wait"][0]


def _row(policy, sim_tpot, rep_tpot, sim_hit, rep_hit, n=1, model="m", budget=1.0):
    r = {"model": model, "budget_gb": budget, "mode": "batch1", "policy": policy,
         "compute_repeat": n, "sim_tpot_mean_s": sim_tpot, "replay_tpot_mean_s": rep_tpot,
         "sim_ttft_mean_s": 1.0, "replay_ttft_mean_s": 2.0}  # fmt: skip
    r["err_tpot_mean_s"] = (sim_tpot - rep_tpot) / rep_tpot
    r["err_ttft_mean_s"] = -0.5
    r["err_hit_rate"] = sim_hit - rep_hit
    return r


def test_per_policy_errors_and_the_crossover_ratios_by_hand():
    """Mean |TPOT error| of +10% and -30% is 20%; the hit gap is the largest one; a
    factor-2 run is left out of the means.  The crossover divides each policy's TPOT by
    LRU's at the same factor, separately for simulator and replay.  Red on a signed mean,
    on a mean over the crossover runs, or on a ratio against the wrong LRU run."""
    rows = [
        _row("lru", 1.1, 1.0, 0.50, 0.50),
        _row("lru", 0.7, 1.0, 0.40, 0.42),
        _row("lru", 9.0, 1.0, 0.0, 0.5, n=2),
        _row("promoe", 0.9, 1.2, 0.6, 0.6),
        _row("promoe", 8.0, 0.5, 0.0, 0.0, n=2),
    ]
    got = {p["policy"]: p for p in C.per_policy(rows)}
    assert got["lru"]["runs"] == 2
    assert got["lru"]["tpot_err"] == pytest.approx(0.2)
    assert got["lru"]["ttft_err"] == pytest.approx(0.5)
    assert got["lru"]["hit_gap_points"] == pytest.approx(2.0)
    assert not got["lru"]["met"]
    (model, pol, ratios), *_ = list(C.crossover_ratios(rows))
    assert (model, pol) == ("m", "promoe")
    # factor 1: the last LRU row of the key wins (0.7 / 1.0), as in read_replays
    assert ratios[1] == pytest.approx((0.9 / 0.7, 1.2 / 1.0))
    assert ratios[2] == pytest.approx((8.0 / 9.0, 0.5 / 1.0))


def test_read_replays_names_a_missing_column_and_averages_repeats(tmp_path):
    """Two files holding the same run are two repeats: TPOT 1.0 and 2.0 ms give a mean of
    1.5, min 1, max 2 and a CV of 0.7071 / 1.5 = 0.4714 (TTFT 3 and 5: 1.414 / 4); a run
    replayed once keeps its
    number and a NaN CV.  Red if a later file replaces an earlier one (2.0), if repeats
    of one run are summed, or if another run's row joins the mean."""
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    header = [*C.KEY, "overrides", "replay_tpot_mean_s", "replay_hit_rate", "replay_ttft_mean_s"]
    rest = ["replay_stall_s", "replay_pcie_bytes", "replay_late_rate", "replay_miss_rate"]
    for path, tpot, hit in ((a, 1.0, 0.5), (b, 2.0, 0.6)):
        with path.open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow([*header, *rest])
            w.writerow(["m", 1.0, "batch1", "lru", 1, "x=1", tpot, hit, 2 * tpot + 1, 0, 0, 0, 0])
            if path == a:
                w.writerow(["m", 1.0, "batch1", "fmoe", 1, "x=1", 7.0, 0.9, 1.0, 0, 0, 0, 0])
    rows = {r["policy"]: r for r in C.read_replays([a, b])}
    assert len(rows) == 2
    lru = rows["lru"]
    assert lru["replay_tpot_mean_s"] == pytest.approx(1.5)
    assert lru["replay_hit_rate"] == pytest.approx(0.55)
    assert lru["replay_repeats"] == 2
    assert (lru["replay_tpot_min_s"], lru["replay_tpot_max_s"]) == (1.0, 2.0)
    assert lru["replay_tpot_cv"] == pytest.approx(0.5**0.5 / 1.5)
    assert lru["replay_ttft_cv"] == pytest.approx(2**0.5 / 4)  # TTFT 3 and 5
    assert rows["fmoe"]["replay_tpot_mean_s"] == 7.0 and rows["fmoe"]["replay_repeats"] == 1
    assert rows["fmoe"]["replay_tpot_cv"] != rows["fmoe"]["replay_tpot_cv"]  # NaN
    bad = tmp_path / "bad.csv"
    bad.write_text("model,policy\nm,lru\n")
    with pytest.raises(FmoesimError, match="budget_gb"):
        C.read_replays([bad])
    with pytest.raises(FmoesimError, match="no replay.csv"):
        C.read_replays([tmp_path / "nowhere"])


def _order_row(policy, rep_ms, sim_ms, n=4, cv=0.1, **extra):
    """A scored row of one policy in the group (m, 1 GB, batch1), its TPOT and TTFT alike."""
    row = {"model": "m", "budget_gb": 1.0, "mode": "batch1", "compute_repeat": 1,
           "policy": policy, "replay_repeats": n, "replay_tpot_cv": cv}  # fmt: skip
    for k in ("tpot", "ttft"):
        row[f"replay_{k}_mean_s"], row[f"sim_{k}_mean_s"] = rep_ms / 1e3, sim_ms / 1e3
    row.update(extra)
    return row


def test_the_order_of_the_policies_by_hand():
    """Four policies, replayed TPOT 10, 20, 13 and 13.5 ms over 4 repeats at a CV of 0.1
    (standard errors 0.5, 1.0, 0.65, 0.675 ms), simulated 11, 9, 30, 31 ms.  Pairs in the
    same order: (a, c), (a, d), (c, d); reversed: (a, b), (b, c), (b, d): 3 of 6, tau 0.
    The replay tells apart every pair but (c, d) (0.5 ms against 2 x 0.94), and of those
    five the simulator orders two alike.  Fastest: a in the replay, b simulated.  TTFT
    carries no CV, so its resolved pairs are unknown.  Red if the standard error is not
    over the square root of the repeats ((a, c) would be unresolved), if a reversed pair
    counts as alike (or a tie does), if a crossover row (factor 2) or a lone policy's
    group joins, or if unmerged repeats are not averaged, the replay's or the
    simulator's (their spread gives the error)."""
    rows = [_order_row("a", 10, 11), _order_row("b", 20, 9), _order_row("c", 13, 30),
            _order_row("d", 13.5, 31),
            {**_order_row("a", 1, 100), "compute_repeat": 2},
            {**_order_row("a", 1, 100), "mode": "online"}]  # fmt: skip
    tpot, ttft = C.policy_order(rows)
    assert tpot == {
        "model": "m", "budget_gb": 1.0, "mode": "batch1", "metric": "TPOT", "policies": 4,
        "pairs": 6, "alike": 3, "resolved": 5, "alike_resolved": 2, "kendall_tau": 0.0,
        "fastest_replay": "a", "fastest_sim": "b",
    }  # fmt: skip
    assert ttft["metric"] == "TTFT" and ttft["alike"] == 3
    assert ttft["resolved"] != ttft["resolved"]  # NaN: no TTFT spread recorded
    # a tie in the replay is no pair in the same order, nor a reversed one
    tie = [{**_order_row(p, 10, s), "mode": "x"} for p, s in (("a", 9), ("b", 11))]
    (t, _) = C.policy_order(tie)
    assert (t["pairs"], t["alike"], t["kendall_tau"]) == (1, 0, 0.0)
    # ...and both are the replay's fastest: a tie shown as one, not the first listed
    assert (t["fastest_replay"], t["fastest_sim"]) == ("a=b", "a")
    # unmerged repeats: a's 9 and 11 ms (mean 10, standard error 1.0), simulated 8 and
    # 12 (mean 10, above b's 9: reversed); b's one row carries no spread of its own, so
    # no pair is resolved
    plain = [{k: v for k, v in _order_row("a", t, s).items() if k != "replay_repeats"}
             for t, s in ((9, 8), (11, 12))]  # fmt: skip
    plain.append({k: v for k, v in _order_row("b", 20, 9).items() if k != "replay_repeats"})
    (u, _) = C.policy_order(plain)
    assert (u["pairs"], u["alike"], u["kendall_tau"]) == (1, 0, -1.0)
    assert u["resolved"] != u["resolved"]
    assert C._replay_mean_se(plain[:2], "tpot") == pytest.approx((0.010, 0.001))
    # the report carries the section, under each profile where there are several
    full = []
    for r in rows:
        f = dict(r)
        for key, *_ in C.METRICS:
            for side in ("sim", "replay", "err"):
                f.setdefault(f"{side}_{key}", 0.0)
        f.update({k: 1.0 for k in ("replay_layer_steps", "replay_wall_s", "replay_gpu_busy_s",
                                   "replay_policy_host_s", "sim_gpu_busy_s",
                                   "replay_tpot_min_s", "replay_tpot_max_s")})  # fmt: skip
        for side in ("sim", "replay"):  # the first request's TTFT apart (next test)
            f[f"{side}_ttft_first_s"] = f[f"{side}_ttft_rest_mean_s"] = 0.1
        full.append(f)
    text = C.report_markdown(full, {"device": "d"})
    assert "## Order of the policies" in text
    assert "## TTFT: the first request and the others" in text
    assert "| m | 1 GB | batch1 | TPOT | 4 | 3/6 | 2/5 | +0.00 | a / b |" in text
    assert "| m | 1 GB | batch1 | TTFT | 4 | 3/6 | n/a | +0.00 | a / b |" in text
    two = C.report_markdown(full, {"device": "d"}, {"p1": full, "p2": full})
    assert "| m | 1 GB | batch1 | `p2` | TPOT | 4 | 3/6 | 2/5 | +0.00 | a / b |" in two


class _Requests:
    """Stands in for :class:`fmoesim.engine.metrics.Metrics`: three requests, the second
    and third starting first (a tie, broken by id)."""

    request_start_s = {0: 5.0, 1: 1.0, 2: 1.0}

    def request_table(self):
        import numpy as np

        return {"request_id": np.array([0, 1, 2]), "ttft_s": np.array([0.3, 0.1, 0.2])}


def test_the_first_requests_ttft_apart_by_hand():
    """The first request is the earliest to start (ids 1 and 2 tie at 1.0 s: id 1): its
    TTFT 0.1 s, the others' mean (0.3 + 0.2) / 2 = 0.25 s; the report tables both, and
    leaves the section out where no replay recorded the split.  Red if the first request
    is taken by position (0.3) or the latest start, or if the rest's mean keeps it."""
    assert C.first_request_ttft(_Requests()) == pytest.approx(
        {"ttft_first_s": 0.1, "ttft_rest_mean_s": 0.25}
    )
    row = {"model": "m", "budget_gb": 1.0, "mode": "batch1", "compute_repeat": 1,
           "policy": "lru", "replay_repeats": 2, "replay_ttft_first_s": 0.2,
           "sim_ttft_first_s": 0.1, "replay_ttft_rest_mean_s": 0.1,
           "sim_ttft_rest_mean_s": 0.11}  # fmt: skip
    text = "\n".join(C._first_request_table([row]))
    want = "| m | 1 GB | batch1 | lru | 100 ms / 200 ms (-50.0%) | 110 ms / 100 ms (+10.0%) |"
    assert want in text
    assert "the first request 50.0%, the others 10.0%" in text
    old = {k: v for k, v in row.items() if "first" not in k and "rest" not in k}
    assert C._first_request_table([old]) == []


def _csv_rows(path):
    """The rows of a CSV file, the file closed."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


#: a tiny OLMoE-shaped grid whose runs replay on a CPU in about a second
TINY_GRID = C.ModelGrid(
    "olmoe-1b-7b", "synthetic", (0.05,), {"batch1": 1}, 0.05,
    extra=("model.num_layers=3", "model.num_experts=8", "model.top_k=2",
           "model.hidden_size=256", "model.expert_intermediate_size=128",
           "workload.synthetic.output_tokens_max=6",
           "workload.synthetic.prompt_tokens_max=8"),
)  # fmt: skip


def test_a_grid_that_lost_runs_does_not_end_quietly(tmp_path, monkeypatch):
    """One policy's runs fail, the other's are replayed: the replayed rows are kept and
    the call ends in one error line counting the failures.  Red if the grid returns as
    if complete (``fmoesim-validate-grid replay`` and ``gpu_validation.sh`` would exit 0
    with runs missing, named only in run.log)."""
    pytest.importorskip("torch", reason="the replay needs torch")
    runs = C.grid_runs([TINY_GRID], ["lru", "lfu"], ["batch1"], crossover=False)
    real = C.replay_one

    def lfu_fails(run, *a, **k):
        if run.policy == "lfu" and k.get("repeat") is not None:
            raise RuntimeError("out of memory")
        return real(run, *a, **k)

    monkeypatch.setattr(C, "replay_one", lfu_fails)
    out = tmp_path / "rep"
    with pytest.raises(FmoesimError, match=r"^1 of the 2 runs tried failed \(1 added to "):
        C.run_replays(runs, "cpu", out, log=lambda line: None)
    assert [r["policy"] for r in _csv_rows(out / "replay.csv")] == ["lru"]


def test_repeats_run_in_rounds_and_resume_by_count(tmp_path):
    """``repeats``: every run once, then every run again (rows numbered by ``repeat``);
    a later call with more repeats replays only the missing rounds, and scoring reads
    the rows of one run as its repeats; a repeat missing from the middle (its round
    failed) is replayed once.  Every row carries the host's record (probe, CPU seconds,
    the collector's pauses; none with the collector off).  Red if repeats are run back to
    back, counted wrongly on resume (a second repeat 2 instead of the missing 0), or the
    host's record is missing."""
    pytest.importorskip("torch", reason="the replay needs torch")
    runs = C.grid_runs([TINY_GRID], ["lru", "lfu"], ["batch1"], crossover=False)
    logs: list[str] = []
    out = tmp_path / "rep"
    assert C.run_replays(runs, "cpu", out, log=logs.append, repeats=2, gc_off=True) == 4
    rows = _csv_rows(out / "replay.csv")
    assert [(r["policy"], r["repeat"]) for r in rows] == [
        ("lru", "0"), ("lfu", "0"), ("lru", "1"), ("lfu", "1"),
    ]  # fmt: skip
    for r in rows:
        assert float(r["replay_probe_s"]) > 0 and float(r["replay_cpu_s"]) > 0
        assert r["replay_gc_off"] == "1" and r["replay_gc_collections"] == "0"
    assert C.run_replays(runs, "cpu", out, log=logs.append, repeats=3) == 2
    rows = _csv_rows(out / "replay.csv")
    assert [(r["policy"], r["repeat"], r["replay_gc_off"]) for r in rows[4:]] == [
        ("lru", "2", "0"), ("lfu", "2", "0"),
    ]  # fmt: skip
    assert C.run_replays(runs, "cpu", out, log=logs.append, repeats=3) == 0
    # lfu's round 0 failed (no row): a rerun replays that repeat, once, not a second 2
    lines = (out / "replay.csv").read_text().splitlines(True)
    gone = [i for i, r in enumerate(rows, start=1) if (r["policy"], r["repeat"]) == ("lfu", "0")]
    (out / "replay.csv").write_text("".join(ln for i, ln in enumerate(lines) if i not in gone))
    assert C.run_replays(runs, "cpu", out, log=logs.append, repeats=3) == 1
    lfu = [r["repeat"] for r in _csv_rows(out / "replay.csv") if r["policy"] == "lfu"]
    assert sorted(lfu) == ["0", "1", "2"]
    merged = C.read_replays([out])
    assert {r["policy"]: r["replay_repeats"] for r in merged} == {"lru": 3, "lfu": 3}
    for r in merged:  # the host probe's spread over the repeats
        assert 0 < r["replay_probe_min_s"] <= r["replay_probe_s"] <= r["replay_probe_max_s"]
    with pytest.raises(FmoesimError, match="--repeats 0: must be >= 1"):
        C.run_replays(runs, "cpu", out, repeats=0)
    # a replay.csv without the host's record is refused before any run
    old = tmp_path / "old"
    old.mkdir()
    (old / "replay.csv").write_text("model,budget_gb,mode,policy,compute_repeat\n")
    with pytest.raises(FmoesimError, match="old/replay.csv: no column repeat"):
        C.run_replays(runs, "cpu", old, log=logs.append)
    assert (old / "replay.csv").read_text().count("\n") == 1
    # one made before the policies' fingerprints (it would fail at the first append,
    # after a whole replay), likewise
    plain = "model,budget_gb,mode,policy,compute_repeat,repeat,replay_probe_s\n"
    (old / "replay.csv").write_text(plain)
    with pytest.raises(FmoesimError, match="old/replay.csv: no column policy_code"):
        C.run_replays(runs, "cpu", old, log=logs.append)
    # a timed one of the kind before the multi-token steps' link columns, likewise
    timed = "model,budget_gb,mode,policy,compute_repeat,repeat,replay_probe_s,policy_code,"
    (old / "replay.csv").write_text(timed + "replay_host_link_pump_self_s\n")
    with pytest.raises(FmoesimError, match="no column replay_link_multi_gap_s"):
        C.run_replays(runs, "cpu", old, log=logs.append, host_timers=True)
    assert (old / "replay.csv").read_text().count("\n") == 1
    # every repeat as its own row, each with its run's one simulation
    reps = C.repeat_rows([out], "h100-pcie5")
    assert sorted((r["policy"], r["repeat"]) for r in reps) == [
        ("lfu", 0), ("lfu", 1), ("lfu", 2), ("lru", 0), ("lru", 1), ("lru", 2),
    ]  # fmt: skip
    for r in reps:
        assert r["sim_hits"] == r["replay_hits"] > 0  # demand-only: the same decisions


def test_host_watch_records_the_collector_and_cpu_time():
    """A block that allocates many containers triggers collections that HostWatch
    counts and times; with ``gc_off`` it counts none and the collector is on again
    afterwards (and stays off where the caller had turned it off); CPU seconds cover a
    busy loop.  Red if the callback is not removed, the collector is left in another
    state than it was found, or the counts come from outside the block."""
    import gc

    with C.HostWatch() as on:
        junk = [[i] for i in range(300_000)]
    assert on.result["gc_collections"] > 0 and on.result["gc_s"] > 0
    assert on.result["gc_off"] == 0
    with C.HostWatch(gc_off=True) as off:
        junk = [[i] for i in range(300_000)]
        C.host_probe_s(loops=100_000, times=1)
    del junk
    assert off.result["gc_collections"] == 0 and off.result["gc_off"] == 1
    assert gc.isenabled() and off._on_gc not in gc.callbacks
    assert off.result["cpu_s"] > 0
    gc.disable()  # a collector the caller turned off stays off
    try:
        with C.HostWatch(gc_off=True):
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_cpu_replay_is_scored_against_the_simulator_end_to_end(tmp_path):
    """Two tiny runs replayed on the CPU (a copy thread stands in for the copy stream),
    then scored: LRU's hits, misses and PCIe bytes are the simulator's exactly (a
    demand-only policy decides alike whatever the timing), and the report and CSV hold
    every run.  Red if scoring simulates another configuration than the replay ran (other
    budget, trace or model shape), or if a run's row loses its metrics."""
    pytest.importorskip("torch", reason="the replay needs torch")
    pytest.importorskip("matplotlib", reason="the report draws a figure")
    runs = C.grid_runs([TINY_GRID], ["lru"], ["batch1"], crossover=True, factors=(1, 2))
    # the crossover adds its prefetching policies at factor 1 too, then factor 2
    assert [(r.policy, r.compute_repeat) for r in runs] == [
        ("lru", 1), ("promoe", 1), ("fmoe", 1), ("moe-infinity", 1),
        ("lru", 2), ("promoe", 2), ("fmoe", 2), ("moe-infinity", 2),
    ]  # fmt: skip
    two = [runs[0], runs[4]]
    logs: list[str] = []
    assert C.run_replays(two, "cpu", tmp_path / "rep", log=logs.append) == 2
    # a second call resumes: both runs are done
    assert C.run_replays(two, "cpu", tmp_path / "rep", log=logs.append) == 0
    out = C.score([tmp_path / "rep"], "h100-pcie5", tmp_path / "report", {"device": "cpu"})
    rows = list(csv.DictReader((out / "validation.csv").open()))
    assert len(rows) == 2
    lru = next(r for r in rows if r["compute_repeat"] == "1")
    for k in ("hits", "misses", "accesses", "pcie_bytes"):
        assert float(lru[f"sim_{k}"]) == float(lru[f"replay_{k}"]) > 0, k
    assert float(lru["err_hit_rate"]) == 0.0
    text = (out / "report.md").read_text()
    assert "## Targets per policy" in text and "## Where the replay's time goes" in text
    assert (out / "validation.png").is_file() and (out / "validation.pdf").is_file()
    assert "- policies replayed: the policies scored, code and presets alike" in text
    # a policy changed since its replay (another fingerprint recorded) is named in the
    # report: re-scoring old replays compared today's policy with the replayed one, unsaid
    f = tmp_path / "rep" / "replay.csv"
    code = next(csv.DictReader(f.open()))["policy_code"]
    assert len(code) == 12 and code == C.policy_code({"_target_": "policies.lru.LRU"}), (
        "the lru preset's resolved config is its _target_ alone"
    )
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "replay.csv").write_text(f.read_text().replace(code, "0123456789ab"))
    out = C.score([tmp_path / "old"], "h100-pcie5", tmp_path / "r2", {"device": "cpu"})
    assert (
        "- policies replayed: **lru changed since their replay**" in (out / "report.md").read_text()
    )
    # host timers: LRU submits each of its transfers once, and every submission pumps
    # the link scheduler, which issues each one-chunk transfer once and lands it once
    with pytest.raises(FmoesimError, match="has no host-timer columns"):
        C.run_replays(two[:1], "cpu", tmp_path / "rep", log=logs.append, host_timers=True)
    assert C.run_replays(two[:1], "cpu", tmp_path / "t", log=logs.append, host_timers=True) == 1
    (t,) = csv.DictReader((tmp_path / "t" / "replay.csv").open())
    n = int(t["replay_transfers"])
    assert n > 0 and int(t["replay_host_submit_calls"]) == n
    assert int(t["replay_host_link_issue_calls"]) == int(t["replay_host_link_on_done_calls"]) == n
    assert int(t["replay_host_link_pump_calls"]) >= n
    assert int(t["replay_host_reprioritize_calls"]) == 0  # LRU re-ranks nothing
    assert 0 < float(t["replay_host_submit_s"]) < float(t["replay_wall_s"])
    # the prefill's layer steps apart: one request of a multi-token prompt, 3 MoE layers
    # (its prompt is one iteration; a decode step carries one token)
    # one request: it is the first, and no other is left for the rest's mean
    assert float(t["replay_ttft_first_s"]) == float(t["replay_ttft_mean_s"]) > 0
    assert t["replay_ttft_rest_mean_s"] in ("", "nan")
    assert int(t["replay_host_steps_multi_calls"]) == 3
    assert int(t["replay_host_pre_gate_multi_calls"]) == 3
    assert int(t["replay_host_pre_gate_calls"]) == int(t["replay_layer_steps"])
    # the launch-time speed measure reads the columns the replay writes
    launch = C.launch_s({k: float(v) for k, v in t.items() if k.startswith("replay_host_")})
    assert 0 < launch < float(t["replay_host_expert_s"]) / int(t["replay_host_expert_calls"])
    assert 0 < float(t["replay_host_steps_multi_s"]) < float(t["replay_wall_s"])
    assert int(t["replay_host_submit_multi_calls"]) <= int(t["replay_host_submit_calls"])
    # self time: a submission without the pump it calls, a pump without its copies and
    # landings, a copy's start without allocating its tensor and launching the copy
    # (each once per one-chunk transfer) and freeing evicted copies (there, and at each
    # gate), which time nothing inside
    assert 0 < float(t["replay_host_submit_self_s"]) < float(t["replay_host_submit_s"])
    assert 0 < float(t["replay_host_link_pump_self_s"]) < float(t["replay_host_link_pump_s"])
    steps = int(t["replay_layer_steps"])
    calls = {"free_evicted": n + steps, "alloc": n, "copier_copy": n}
    for part, want in calls.items():
        assert int(t[f"replay_host_{part}_calls"]) == want, part
        assert float(t[f"replay_host_{part}_self_s"]) == float(t[f"replay_host_{part}_s"]) > 0
    inner = float(t["replay_host_alloc_s"]) + float(t["replay_host_copier_copy_s"])
    issue, own = float(t["replay_host_link_issue_s"]), float(t["replay_host_link_issue_self_s"])
    assert 0 < own < issue - inner
    # the copies started (and landed) inside submissions: some of them, within their time
    for part in ("issue", "on_done"):
        k = f"replay_host_link_{part}"
        assert 0 <= int(t[f"{k}_in_submit_calls"]) <= int(t[f"{k}_calls"])
        assert 0 <= float(t[f"{k}_in_submit_s"]) <= float(t[f"{k}_s"])
    assert int(t["replay_host_link_issue_in_submit_calls"]) > 0  # an idle link starts one
    started = sum(float(t[f"replay_host_link_{p}_in_submit_s"]) for p in ("issue", "on_done"))
    assert started < float(t["replay_host_submit_s"])
    # the link and the GPU in the prefill's steps: LRU moves every transfer whole, and
    # the prefill (an empty cache) loads some of them; its compute is part of the GPU's
    f = {k: float(v) for k, v in t.items() if k.startswith(("replay_link_", "replay_comp"))}
    assert f["replay_link_multi_copies"] + f["replay_link_one_copies"] == n
    assert f["replay_link_multi_copies"] > 0 and f["replay_link_one_copies"] > 0
    assert f["replay_link_multi_bytes"] > 0 and f["replay_link_multi_copy_s"] > 0
    assert f["replay_link_multi_gap_s"] >= 0 and f["replay_link_one_gap_s"] >= 0
    assert 0 < f["replay_compute_multi_s"] < float(t["replay_gpu_busy_s"])
    rep = C.score([tmp_path / "t"], "h100-pcie5", tmp_path / "tr", {"device": "cpu"})
    text = (rep / "report.md").read_text()
    assert "## The replay's host calls" in text and "more than one token" in text
    assert "The link and the GPU in those steps" in text
    # the copies' rate: the prefill's / the decode's / the simulator's, all measured
    (vrow,) = csv.DictReader((rep / "validation.csv").open())
    assert float(vrow["sim_link_bytes"]) == float(vrow["replay_pcie_bytes"]) > 0
    assert float(vrow["sim_ttft_first_s"]) == float(vrow["sim_ttft_mean_s"]) > 0
    table = text[text.index("The link and the GPU in those steps") :]
    rates = table.split("\n")[4].split(" | ")[7].split(" / ")
    assert len(rates) == 3 and "n/a" not in rates, rates


def test_link_phases_splits_copies_and_the_links_idle_time_by_hand():
    """:func:`link_phases` by hand: a copy queued while the link was busy and started
    0.25 s after it freed counts 0.25 s of idle link; a delayed prefetch is ready at its
    release, not its submission; cancelled transfers count nowhere; aborted or paused
    ones count their wait but not in the rate; each goes to the phase it was submitted
    in.  Red if the transfers are not taken in start order, the release is ignored, a
    gap goes to the wrong phase or a cancelled transfer is counted."""
    from fmoesim.engine.backend import TransferRecord

    def rec(submit, start, end, size=100, **kw):
        r = TransferRecord(0, 0, size, "on_demand", 0.0, submit)
        r.start_s, r.end_s = start, end
        for k, v in kw.items():
            setattr(r, k, v)
        return r

    m1 = rec(0.0, 0.0, 1.0)  # multi: starts at once
    m2 = rec(0.5, 1.25, 2.25)  # multi: queued at 0.5, the link free at 1.0: 0.25 idle
    o1 = rec(3.0, 3.1, 3.6, size=50)  # one: submitted at 3.0 on an idle link: 0.1
    gone = rec(3.2, 3.2, 3.2, cancelled=True)
    o2 = rec(3.3, 4.0, 4.5, size=50, release_s=4.0)  # a delayed prefetch: no idle time
    m3 = rec(4.4, 4.5, 4.7, aborted=True)  # waits nothing, moved part: not in the rate
    o3 = rec(4.6, 5.0, 6.0, preemptions=1)  # 0.3 idle after m3; paused: not in the rate
    got = C.link_phases([o3, m2, gone, o1, m3, m1, o2], {id(m1), id(m2), id(m3)})
    want = {
        "multi_copies": 2, "multi_bytes": 200, "multi_copy_s": 2.0, "multi_gap_s": 0.25,
        "one_copies": 2, "one_bytes": 100, "one_copy_s": 1.0, "one_gap_s": 0.4,
    }  # fmt: skip
    assert got == pytest.approx(want)


def test_the_simulators_link_never_idles_while_a_copy_waits():
    """The report says the link's idle time is zero in the simulator: over a timed run
    with prefetches queued, re-ranked, cancelled and paused by on-demand loads
    (MoE-Infinity, 2 requests of the bundled trace), :func:`link_phases` finds none.
    Red if the simulated link leaves a queued or released transfer waiting after the
    previous copy ends."""
    from hydra.utils import instantiate

    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run, simulate_spec
    from fmoesim.trace.reader import read_trace

    cfg = compose_config(["policy=moe-infinity", "serving.max_requests=2", "progress=false"])
    spec = build_run(cfg)
    res = simulate_spec(
        spec, read_trace(_trace_path(spec)), policy=instantiate(cfg.policy), timing=True,
        access_log=False, progress=False,
    )  # fmt: skip
    link = C.link_phases(res.transfers, set())
    assert link["one_copies"] > 100 and res.summary["cancelled_transfers"] > 0
    assert any(r.preemptions for r in res.transfers)
    assert link["one_gap_s"] == 0.0


def test_compute_repeat_runs_every_compute_operator_n_times(monkeypatch):
    """Red if the replay's crossover factor is ignored for expert FFNs or stand-ins."""
    pytest.importorskip("torch", reason="the replay needs torch")
    from fmoesim.engine.cache import ExpertCache
    from policies.lru import LRU
    from replay.backend import GpuBackend
    from replay.weights import Executor
    from tests.test_policy_contract import MODEL
    from tests.tiny import TINY_HW

    calls = {"ffn": 0, "attention": 0}
    ffn, attention = Executor.ffn, Executor.attention

    def count_ffn(self, w, tokens):
        calls["ffn"] += 1
        return ffn(self, w, tokens)

    def count_attention(self, tokens, pairs):
        calls["attention"] += 1
        return attention(self, tokens, pairs)

    monkeypatch.setattr(Executor, "ffn", count_ffn)
    monkeypatch.setattr(Executor, "attention", count_attention)
    cache = ExpertCache(4 * MODEL.expert_size_bytes, LRU())
    be = GpuBackend(MODEL, TINY_HW, [cache], "cpu", compute_repeat=3)
    try:
        be.pre_gate(0, 1, 4, 5)
        assert calls["attention"] == 3
        be._dev[0] = be.host.tensor(0).clone()
        be.expert(0, 0, 1)
        assert calls["ffn"] == 3
    finally:
        be.close()
    with pytest.raises(FmoesimError, match="compute_repeat"):
        GpuBackend(MODEL, TINY_HW, [cache], "cpu", compute_repeat=0)


def test_host_weights_are_built_once_per_model():
    """Red if every replay of a sweep rebuilds (and on a GPU re-pins) the host weights,
    or if a different model gets the previous model's weights."""
    pytest.importorskip("torch", reason="the replay needs torch")
    from replay.weights import shared_host_experts
    from tests.test_policy_contract import MODEL

    a = shared_host_experts(MODEL, "cpu", 0)
    assert shared_host_experts(MODEL, "cpu", 0) is a
    other = replace(MODEL, name="other", num_experts=MODEL.num_experts + 1)
    b = shared_host_experts(other, "cpu", 0)
    assert b is not a and b.n == other.num_layers * other.num_experts
    assert shared_host_experts(MODEL, "cpu", 1) is not b


def test_a_profile_of_several_models_keeps_the_base_preset_and_each_models_terms():
    """Red if a second model overwrites the first's coefficients, if --base's unmeasured
    roofline terms are lost, or if a model may take the link table's name."""
    pytest.importorskip("torch", reason="the profiler needs torch")
    from fmoesim.specs import HardwareSpec
    from replay.profile import profile
    from tests.tiny import TINY

    other = replace(TINY, name="tiny-wide", expert_intermediate_size=2000)
    base = HardwareSpec(name="base", peak_tflops=123.0, hbm_gbps=456.0, chunk_bytes=1 << 20)
    kw = dict(repeats=1, sizes_bytes=(1 << 16, 1 << 18), tokens=(1, 4),
              attention_points=((1, 9), (2, 20), (4, 40)))  # fmt: skip
    spec = profile([TINY, other], "cpu", base=base, **kw)
    assert set(spec.measured) == {"tiny", "tiny-wide", "link"}
    assert (spec.peak_tflops, spec.hbm_gbps, spec.chunk_bytes) == (123.0, 456.0, 1 << 20)
    assert spec.name == "measured-cpu" and "base" in spec.source
    with pytest.raises(FmoesimError, match="reserved"):
        profile(replace(TINY, name="link"), "cpu", **kw)


def test_a_trace_unreadable_by_an_old_pyarrow_says_which_version_reads_it(tmp_path, monkeypatch):
    """pyarrow < 26 cannot read a null row of a fixed-size list (the traces' absent
    probabilities).  Red if that failure is reported as a corrupt file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from fmoesim.errors import TraceError
    from fmoesim.trace import reader

    path = tmp_path / "routing.parquet"
    pq.write_table(pa.table({"x": [1]}), path)

    def old_read(p, *a, **k):
        raise pa.ArrowInvalid("Expected all lists to be of size=64 but index 1 had size=0")

    monkeypatch.setattr(reader.pq, "read_table", old_read)
    with pytest.raises(TraceError, match="pyarrow >= 26") as exc:
        reader._read_table(Path(path), pa.schema([("x", pa.int64())]))
    assert "corrupt" not in str(exc.value)


def test_fit_host_recovers_the_engine_costs_and_averages_the_decisions(tmp_path):
    """Rows built from known costs (12 us a step, 110 us an access, 9 us a queued
    transfer, 108 us a started one): the fit returns them, uses only the fit model's
    batch-1 runs that count their queued transfers (an online row with other costs, or
    a row without the count, would bias it), and each policy's decision cost is its
    hooks' mean time per step.  Red on a fit over the wrong rows, a forgotten hooks'
    subtraction, cancelled transfers left out of the queued ones, or decisions per run
    instead of per policy."""
    layer, access, submit, transfer = 12e-6, 110e-6, 9e-6, 108e-6

    def row(policy, acc, xfer, cancelled, hooks_per_step, mode="batch1", model="m",
            steps=1000):  # fmt: skip
        per = layer + access * acc + submit * (xfer + cancelled) + transfer * xfer
        sim = 5e-4 * steps
        return {"model": model, "mode": mode, "policy": policy, "compute_repeat": 1,
                "replay_layer_steps": steps, "replay_accesses": acc * steps,
                "replay_transfers": xfer * steps,
                "replay_cancelled_transfers": cancelled * steps,
                "replay_policy_host_s": hooks_per_step * steps, "sim_gpu_busy_s": sim,
                "replay_wall_s": sim + hooks_per_step * steps + per * steps}  # fmt: skip

    rows = [row("lru", 8, 1, 0, 20e-6), row("lru", 9, 3, 0, 40e-6),
            row("brainstorm", 10, 20, 40, 300e-6), row("fmoe", 12, 5, 2, 100e-6),
            row("fmoe", 11, 4, 7, 100e-6),
            row("lru", 30, 30, 0, 0.0, mode="online"),
            row("lru", 8, 1, 0, 1e-3, model="other")]  # fmt: skip
    rows[5]["replay_wall_s"] *= 3  # the online run is no part of the fit
    no_count = row("lru", 8, 2, 0, 0.0)
    del no_count["replay_cancelled_transfers"]
    no_count["replay_wall_s"] *= 3  # a row that cannot be fitted stays out
    rows.append(no_count)
    engine, decisions = C.fit_host(rows, "m")
    assert engine["host_layer_s"] == pytest.approx(layer, rel=1e-6)
    assert engine["host_access_s"] == pytest.approx(access, rel=1e-6)
    assert engine["host_submit_s"] == pytest.approx(submit, rel=1e-6)
    assert engine["host_transfer_s"] == pytest.approx(transfer, rel=1e-6)
    assert decisions["m"]["fmoe"] == pytest.approx(100e-6)
    assert decisions["m"]["lru"] == pytest.approx((20e-6 + 40e-6 + 0.0 + 0.0) / 4)
    assert decisions["other"] == {"lru": pytest.approx(1e-3)}
    # host-timed rows count their queued transfers by their submit calls
    timed = [dict(r, replay_host_submit_calls=r["replay_transfers"]
                  + r.pop("replay_cancelled_transfers")) for r in rows[:5]]  # fmt: skip
    assert C.fit_host(timed, "m")[0]["host_submit_s"] == pytest.approx(submit, rel=1e-6)
    # the link's host timers measure the issue cost: it is taken, not fitted (here 2x
    # what the walls imply, so a fit would not return it), and the rest is fitted
    for r in timed:  # three chunks a transfer: the cost is per transfer, not per chunk
        r["replay_host_link_issue_calls"] = 3 * r["replay_transfers"]
        r["replay_host_link_issue_s"] = 1.5 * transfer * r["replay_transfers"]
        r["replay_host_link_on_done_s"] = 0.5 * transfer * r["replay_transfers"]
    measured = C.fit_host(timed, "m")[0]
    assert measured["host_transfer_s"] == pytest.approx(2 * transfer, rel=1e-9)
    assert measured["host_submit_s"] != pytest.approx(submit, rel=1e-3)
    # counted, untimed, and no run cancels: a submission and a start cannot be told apart
    same = [row("lru", 8, 1, 0, 0.0), row("lru", 9, 3, 0, 0.0), row("lfu", 10, 2, 0, 0.0),
            row("lcp", 12, 5, 0, 0.0)]  # fmt: skip
    one = C.fit_host(same, "m")[0]
    assert one["host_submit_s"] == pytest.approx(submit + transfer, rel=1e-6)
    assert one["host_transfer_s"] == 0.0
    with pytest.raises(FmoesimError, match="need 4 or more that count their queued"):
        C.fit_host(rows, "other")
    # replays that count no queued transfers: the per-transfer cost is a submission's
    old = [row("lru", 8, 1, 0, 20e-6), row("lru", 9, 3, 0, 40e-6), row("lfu", 10, 2, 0, 0.0)]
    for r in old:
        del r["replay_cancelled_transfers"]
    legacy = C.fit_host(old, "m")[0]
    assert legacy["host_submit_s"] == pytest.approx(submit + transfer, rel=1e-6)
    assert legacy["host_transfer_s"] == 0.0
    assert legacy["host_layer_s"] == pytest.approx(layer, rel=1e-6)


def test_a_host_profile_keeps_the_base_and_adds_every_models_costs(tmp_path, monkeypatch):
    """Red if the link table gets host keys, a model loses its measured coefficients, or
    the written preset does not turn the host model on for its models."""
    from fmoesim.config import build
    from fmoesim.engine.host import HostModel
    from fmoesim.specs import HardwareSpec
    from replay.profile import write_profile
    from tests.tiny import TINY

    conf = tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    base = HardwareSpec(name="b", measured={"tiny": {"expert_a_s": 1e-4}, "link": {"h2d_1_s": 1.0}})
    write_profile(base, conf / "hardware" / "b.yaml")
    monkeypatch.setattr(build, "CONF_DIR", conf)
    engine = {"host_layer_s": 1e-5, "host_access_s": 2e-5, "host_transfer_s": 3e-5}
    path = C.write_host_profile(
        "b", engine, {"tiny": {"lru": 4e-5}}, conf / "hardware" / "b-host.yaml", "fitted"
    )
    spec = build.load_preset("hardware", "b-host", HardwareSpec)
    assert path.stem == spec.name == "b-host" and spec.source.endswith("; fitted")
    assert spec.measured["link"] == {"h2d_1_s": 1.0}
    assert spec.measured["tiny"]["expert_a_s"] == 1e-4
    assert HostModel.from_specs(TINY, spec, "lru") == HostModel(1e-5, 2e-5, 3e-5, 4e-5)


def test_batch1_runs_of_one_trace_cannot_split_the_step_cost_and_online_runs_can():
    """Batch-1 runs of one trace make the same accesses per step: a fit on them alone
    returns the right per-step total but not its split into ``host_layer_s`` and
    ``host_access_s``; with ``modes`` adding the online runs (another batch size) both
    come back.  Red if ``modes`` is ignored or the online runs are not fitted."""
    layer, access, submit, transfer = 300e-6, 110e-6, 9e-6, 108e-6

    def row(policy, acc, xfer, cancelled, mode):
        per = layer + access * acc + submit * (xfer + cancelled) + transfer * xfer
        return {"model": "m", "mode": mode, "policy": policy, "compute_repeat": 1,
                "replay_layer_steps": 100, "replay_accesses": acc * 100,
                "replay_transfers": xfer * 100, "replay_cancelled_transfers": cancelled * 100,
                "replay_policy_host_s": 0.0, "sim_gpu_busy_s": 0.05,
                "replay_wall_s": 0.05 + per * 100}  # fmt: skip

    rows = [row("lru", 9, 3, 0, "batch1"), row("lfu", 9, 4, 1, "batch1"),
            row("fmoe", 9, 5, 3, "batch1"), row("brainstorm", 9, 20, 40, "batch1"),
            row("lru", 19, 15, 0, "online"), row("fmoe", 19, 9, 4, "online")]  # fmt: skip
    one = C.fit_host(rows, "m")[0]
    total = one["host_layer_s"] + 9 * one["host_access_s"]
    assert total == pytest.approx(layer + 9 * access, rel=1e-6)
    assert one["host_layer_s"] != pytest.approx(layer, rel=1e-2)
    both = C.fit_host(rows, "m", modes=("batch1", "online"))[0]
    assert both["host_layer_s"] == pytest.approx(layer, rel=1e-6)
    assert both["host_access_s"] == pytest.approx(access, rel=1e-6)
    with pytest.raises(FmoesimError, match="2 runs in online, need 4 or more"):
        C.fit_host(rows, "m", modes=("online",))


def test_cross_check_scores_each_policy_with_costs_fitted_without_its_runs(tmp_path, monkeypatch):
    """Four policies' runs built from known host costs, except that "odd"'s walls are
    doubled: the fit that leaves "odd" out returns the costs exactly, every other fit
    (which holds "odd") does not, and each policy's runs are simulated with the costs
    fitted without them, their own decision cost kept, and the report lists the runs in
    the replays' order, then each fit's costs in microseconds and their spread; with
    ``each_repeat`` the replays are scored unmerged, and with ``launch`` the fit's runs and
    the scoring simulate the expert without its launch share.  Red if the scored
    policy's runs stay in its fit, a policy is scored with another's fit, the runs come
    out grouped by fit, a fit's row shows another fit's costs, ``each_repeat`` still
    merges, or the launch share stays in the expert's cost on either side."""
    from fmoesim.config import build
    from fmoesim.engine.host import HostModel
    from fmoesim.specs import HardwareSpec
    from replay.profile import write_profile
    from tests.tiny import TINY

    conf = tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    write_profile(HardwareSpec(name="b", measured={"tiny": {"expert_a_s": 1e-4,
                                                             "expert_launch_s": 4e-5}}),
                  conf / "hardware" / "b.yaml")  # fmt: skip
    monkeypatch.setattr(build, "CONF_DIR", conf)
    layer, access, submit, transfer = 12e-6, 110e-6, 9e-6, 108e-6

    def row(policy, acc, xfer, cancelled, hooks, mode="batch1"):
        per = layer + access * acc + submit * (xfer + cancelled) + transfer * xfer
        return {"model": "tiny", "mode": mode, "policy": policy, "compute_repeat": 1,
                "replay_layer_steps": 100, "replay_accesses": acc * 100,
                "replay_transfers": xfer * 100, "replay_cancelled_transfers": cancelled * 100,
                "replay_policy_host_s": hooks * 100, "sim_gpu_busy_s": 0.05,
                "replay_wall_s": 0.05 + (hooks + per) * 100}  # fmt: skip

    rows = [row("lru", 8, 1, 0, 2e-5), row("lru", 9, 3, 0, 2e-5),
            row("lfu", 10, 2, 1, 3e-5), row("lfu", 13, 6, 2, 3e-5),
            row("fmoe", 12, 5, 2, 9e-5), row("fmoe", 11, 4, 7, 9e-5),
            row("odd", 9, 2, 5, 5e-5), row("odd", 14, 8, 1, 5e-5)]  # fmt: skip
    for r in rows[6:]:
        r["replay_wall_s"] *= 2
    policies = ["lru", "lfu", "fmoe", "odd"]
    merged = [{"policy": p, "mode": m} for m in ("batch1", "online") for p in policies]
    scored_with = {}

    def score_rows(rs, hardware, spec_hw=None):
        assert hardware == "b" and [r["mode"] for r in rs] == ["batch1", "online"]
        scored_with[rs[0]["policy"]] = spec_hw
        return [dict(r) for r in rs]

    simulated_on = []

    def repeat_rows(paths, base, spec_hw=None):
        simulated_on.append(spec_hw)
        return rows

    monkeypatch.setattr(C, "repeat_rows", repeat_rows)
    merges = []

    def read_replays(paths, merge=True):
        merges.append(merge)
        return merged

    monkeypatch.setattr(C, "read_replays", read_replays)
    monkeypatch.setattr(C, "score_rows", score_rows)

    def names(rs):
        return " ".join(f"{r['policy']}/{r['mode']}" for r in rs)

    monkeypatch.setattr(C, "report_markdown", lambda rs, meta: names(rs))
    monkeypatch.setattr(C, "plot", lambda rs, title, path: None)
    out, fits = C.cross_check([tmp_path], "b", "tiny", tmp_path / "cc", {"device": "x"})
    # the report keeps the replays' order (mode, then policy), not the fits' order
    text = (out / "report.md").read_text()
    assert text.startswith(names(merged) + "\n## Host costs of each fit")
    assert list(fits) == policies
    exact = {"host_layer_s": layer, "host_access_s": access, "host_submit_s": submit,
             "host_transfer_s": transfer}  # fmt: skip
    assert fits["odd"] == pytest.approx(exact, rel=1e-6)
    # each fit's row, in microseconds: "odd"'s is the costs the runs were built from
    rows_md = {line.split(" | ")[0][2:]: line for line in text.splitlines()[3:]
               if line.startswith("| ")}  # fmt: skip
    assert rows_md["odd"] == "| odd | 12.0 | 110.0 | 9.0 | 108.0 |"
    assert [k for k in rows_md if k != "fitted without"][:4] == policies
    spread = [float(c) for c in rows_md["spread (largest - smallest)"].strip("| ").split(" | ")[1:]]
    assert spread == [round(1e6 * (max(f[k] for f in fits.values())
                                   - min(f[k] for f in fits.values())), 1)
                      for k, _ in C.FIT_COLUMNS]  # fmt: skip
    assert spread[1] > 1.0  # "odd" steers the other fits' access cost
    for p in ("lru", "lfu", "fmoe"):
        assert fits[p]["host_access_s"] != pytest.approx(access, rel=1e-2), p
    # each repeat scored as a run of its own: the replays are read unmerged
    assert merges == [True]
    C.cross_check([tmp_path], "b", "tiny", tmp_path / "cc2", {"device": "x"}, each_repeat=True)
    assert merges == [True, False]
    # the launch share in the host model: the fit's runs and the scoring both simulate the
    # expert without its launch (1e-4 - 4e-5), the rest of the profile as it was
    assert simulated_on == [None, None]
    for p in policies:
        assert scored_with[p].measured["tiny"]["expert_a_s"] == 1e-4
    C.cross_check([tmp_path], "b", "tiny", tmp_path / "cc3", {"device": "x"}, launch=True)
    assert simulated_on[-1].measured["tiny"] == {"expert_a_s": pytest.approx(6e-5),
                                                 "expert_launch_s": 0.0}  # fmt: skip
    for p in policies:
        tiny = scored_with[p].measured["tiny"]
        assert tiny["expert_a_s"] == pytest.approx(6e-5) and tiny["expert_launch_s"] == 0.0
        assert tiny["host_access_s"] == pytest.approx(fits[p]["host_access_s"])
    for p in policies:
        host = HostModel.from_specs(TINY, scored_with[p], p)
        assert host.access_s == pytest.approx(fits[p]["host_access_s"]), p
        assert host.decision_s == pytest.approx({"lru": 2e-5, "lfu": 3e-5, "fmoe": 9e-5,
                                                 "odd": 5e-5}[p]), p  # fmt: skip


def test_host_costs_of_another_profile_round_trip_and_a_profile_without_them_is_refused(
    tmp_path, monkeypatch
):
    """The out-of-sample profile takes another machine's host costs as they are: written
    by write_host_profile, read back by host_costs_of, written again onto a second base.
    Red if an engine key is dropped or renamed (the link's depth too), if the decisions of
    one model land on another, or if a profile with no host costs passes silently."""
    from fmoesim.config import build
    from fmoesim.specs import HardwareSpec
    from replay.profile import write_profile

    conf = tmp_path / "conf"
    (conf / "hardware").mkdir(parents=True)
    for name in ("a", "b"):
        spec = HardwareSpec(name=name, measured={"tiny": {"expert_a_s": 1e-4}, "other": {}})
        write_profile(spec, conf / "hardware" / f"{name}.yaml")
    monkeypatch.setattr(build, "CONF_DIR", conf)
    engine = {"host_layer_s": 1e-5, "host_access_s": 2e-5, "host_transfer_s": 3e-5}
    decisions = {"tiny": {"lru": 4e-5}, "other": {"fmoe": 5e-5}}
    C.write_host_profile("a", engine, decisions, conf / "hardware" / "a-host.yaml", "fitted")
    got_engine, got_decisions = C.host_costs_of("a-host", "tiny")
    assert got_engine == engine
    assert got_decisions == decisions
    C.write_host_profile("b", got_engine, got_decisions, conf / "hardware" / "b-a.yaml", "x")
    b = build.load_preset("hardware", "b-a", HardwareSpec)
    assert b.measured["other"]["host_decision_s"] == {"fmoe": 5e-5}
    assert b.measured["tiny"]["host_transfer_s"] == 3e-5
    with pytest.raises(FmoesimError, match="--host-from a: no host costs for tiny"):
        C.host_costs_of("a", "tiny")
    # the host-issued link's depth travels with the costs, and is read as the model's
    from fmoesim.engine.host import HostModel
    from tests.tiny import TINY

    deep = C.with_link_depth(engine, 2)
    assert deep == {**engine, "host_link_depth": 2} and C.with_link_depth(engine, 0) == engine
    with pytest.raises(FmoesimError, match="--link-depth -1: must be 0"):
        C.with_link_depth(engine, -1)
    C.write_host_profile("a", deep, decisions, conf / "hardware" / "a-deep.yaml", "fitted")
    assert C.host_costs_of("a-deep", "tiny")[0] == deep
    spec = build.load_preset("hardware", "a-deep", HardwareSpec)
    assert HostModel.from_specs(TINY, spec, "lru").link_depth == 2


def test_budgets_keep_only_those_runs_and_an_unknown_budget_is_refused(tmp_path):
    """--budgets 6.4 keeps the grid's 6.4 GB runs; the crossover stays at its own budget
    (3.2 GB) with its factor-1 baseline.  Red if --budgets drops the crossover, keeps the
    grid's other budget, or accepts a budget the grid does not have."""
    runs = C.grid_runs(C.GRID[:1], ("lru", "fmoe"), ("batch1",), True, budgets_gb=[6.4])
    assert [(r.budget_gb, r.policy) for r in runs if r.budget_gb == 6.4] == [
        (6.4, "lru"), (6.4, "fmoe")]  # fmt: skip
    assert {(r.compute_repeat, r.policy) for r in runs if r.budget_gb == 3.2} == {
        (n, p) for n in C.CROSSOVER_FACTORS for p in C.CROSSOVER_POLICIES}  # fmt: skip
    with pytest.raises(SystemExit):
        C.main(["replay", "--device", "cpu", "--out", str(tmp_path / "o"),
                "--models", "olmoe-1b-7b", "--budgets", "5"])  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_the_replays_own_spread_is_averaged_over_repeated_runs_only():
    """A policy's TPOT CV is the mean over its runs replayed more than once (0.1 and 0.3
    give 0.2; a single replay's NaN stays out); a policy never repeated shows n/a; the
    repeatability table lists the repeated runs alone.  Red if a single replay's NaN
    poisons the mean, if a CV is shown where no run was repeated, or if a run replayed
    once is listed as repeated."""
    rows = [_row("lru", 1.0, 1.0, 0.5, 0.5, budget=b) for b in (1.0, 2.0, 3.0)]
    rows.append(_row("promoe", 1.0, 1.0, 0.5, 0.5))
    for r, (n, cv) in zip(rows[:3], ((3, 0.1), (2, 0.3), (1, float("nan"))), strict=True):
        r.update(replay_repeats=n, replay_tpot_cv=cv, replay_tpot_min_s=0.9,
                 replay_tpot_max_s=1.1)  # fmt: skip
    got = {p["policy"]: p for p in C.per_policy(rows)}
    assert got["lru"]["tpot_cv"] == pytest.approx(0.2)
    assert got["promoe"]["tpot_cv"] != got["promoe"]["tpot_cv"]  # NaN
    table = C._targets_table(rows)
    assert table[2].endswith("| 20.0% |") and table[3].endswith("| n/a |")
    rep = [line for line in C._repeats_table(rows) if line.startswith("| m |")]
    assert [line.split(" | ")[5] for line in rep] == ["3", "2"]


def test_host_speed_scales_a_profiles_host_costs_by_the_runs_probe():
    """A profile with a reference probe: a run whose probe took 1.5x as long gets 1.5x
    every host cost (engine and decisions); a profile without one, or a run without a
    probe, is left alone; the reference is the fit model's batch-1 median.  Red if the
    ratio is inverted, the decisions are not scaled, or other models' rows set it."""
    from fmoesim.specs import HardwareSpec

    costs = {"host_layer_s": 1e-6, "host_access_s": 2e-6, "host_submit_s": 3e-6,
             "host_transfer_s": 4e-6, "host_decision_s": {"lru": 5e-6},
             "expert_a_s": 7e-6}  # fmt: skip
    hw = HardwareSpec(name="x", measured={"m": {**costs, C.HOST_PROBE_KEY: 0.010},
                                          "n": dict(costs)})  # fmt: skip
    fast = C.host_speed_hardware(hw, 0.015).measured
    for k in ("host_layer_s", "host_access_s", "host_submit_s", "host_transfer_s"):
        assert fast["m"][k] == pytest.approx(1.5 * costs[k])
    assert fast["m"]["host_decision_s"] == {"lru": pytest.approx(7.5e-6)}
    assert fast["m"]["expert_a_s"] == 7e-6  # the GPU's costs are not the host's
    assert fast["n"] == costs
    assert C.host_speed_hardware(hw, float("nan")) is hw

    def row(model, mode, probe_s):
        return {"model": model, "mode": mode, "compute_repeat": 1, "replay_probe_s": probe_s}

    rows = [row("m", "batch1", p) for p in (0.01, 0.02, 0.05)]
    rows += [row("o", "batch1", 9.0), row("m", "online", 9.0)]
    assert C.reference_probe_s(rows, "m") == pytest.approx(0.02)
    with pytest.raises(FmoesimError, match="the z batch1 runs record no host probe"):
        C.reference_probe_s(rows, "z")
    launch_rows = [{**r, "model": "z"} for r in rows]  # no timers: the launch rule
    with pytest.raises(FmoesimError, match=r"record no FFN launch timers \(rule: replay --host"):
        C.reference_probe_s(launch_rows, "z", measure="launch")


#: host costs (per layer step, access, submission, started copy) the host-speed tests
#: build their runs from
SPEED_COSTS = (10e-6, 40e-6, 20e-6, 100e-6)


def _speed_row(policy, xfer, cancelled, hooks, f, acc=9):
    """A batch-1 run of model "m" (100 layer steps, ``acc`` accesses, ``xfer`` started
    and ``cancelled`` cancelled transfers a step) whose host ran ``f`` times as long as
    at the reference speed: :data:`SPEED_COSTS` and its hooks' ``hooks`` a step, times
    ``f``."""
    layer, access, submit, transfer = SPEED_COSTS
    per = (layer + access * acc + submit * (xfer + cancelled) + transfer * xfer) * f
    return {"model": "m", "mode": "batch1", "policy": policy, "compute_repeat": 1,
            "replay_layer_steps": 100, "replay_accesses": acc * 100,
            "replay_transfers": xfer * 100, "replay_cancelled_transfers": cancelled * 100,
            "replay_policy_host_s": hooks * f * 100, "sim_gpu_busy_s": 0.05,
            "replay_wall_s": 0.05 + (hooks * f + per) * 100}  # fmt: skip


def test_host_speed_from_launch_time_undoes_each_runs_launch_speed():
    """Runs whose host ran 1x, 2x and 0.5x as long as the median, as their time per FFN
    launch says (the ``--host-timers`` columns) while their probes say nothing (every run
    the same): measured by launch time, the fit brings each run to the median speed and
    returns the costs as set, with the median launch time recorded as ``host_launch_s``;
    measured by the probe, it cannot.  A profile with that key scales a run's host costs
    by its launch time over it, whatever its probe, and refuses a run without launch
    timers in one line.  Red if the launch time is not the one the fit or the scoring
    reads, the ratio is inverted, or an untimed run passes unscaled."""
    from fmoesim.specs import HardwareSpec

    layer, access, submit, transfer = SPEED_COSTS
    ref = 140e-6

    def row(policy, xfer, cancelled, hooks, f, acc=9):
        return {**_speed_row(policy, xfer, cancelled, hooks, f, acc), "replay_probe_s": 0.015,
                "replay_host_expert_calls": acc * 100,
                "replay_host_expert_self_s": ref * f * acc * 100}  # fmt: skip

    rows = [row("lru", 3, 0, 1e-6, 1.0), row("fmoe", 5, 1, 5e-6, 2.0),
            row("brainstorm", 19, 40, 3e-6, 0.5), row("lru", 3, 0, 1e-6, 2.0, acc=12),
            row("fmoe", 5, 1, 5e-6, 1.0, acc=7)]  # fmt: skip
    assert C.launch_s(rows[1]) == pytest.approx(2 * ref)
    engine, decisions = C.fit_host(rows, "m", host_speed=True, measure="launch")
    assert engine[C.HOST_LAUNCH_KEY] == pytest.approx(ref) and C.HOST_PROBE_KEY not in engine
    for k, v in (("host_layer_s", layer), ("host_access_s", access),
                 ("host_submit_s", submit), ("host_transfer_s", transfer)):  # fmt: skip
        assert engine[k] == pytest.approx(v, rel=1e-6), k
    by_probe = C.fit_host(rows, "m", host_speed=True)[0]
    assert by_probe["host_access_s"] != pytest.approx(access, rel=1e-2)
    with pytest.raises(FmoesimError, match="--probe-exponent: scales by the probe"):
        C.fit_host(rows, "m", host_speed=True, exponent=True, measure="launch")
    untimed = [dict(r) for r in rows]
    del untimed[2]["replay_host_expert_calls"]
    with pytest.raises(FmoesimError, match="the m brainstorm run records no FFN launch timers"):
        C.fit_host(untimed, "m", host_speed=True, measure="launch")

    hw = HardwareSpec(name="fit", measured={"m": {"host_access_s": access,
                                                  C.HOST_LAUNCH_KEY: ref}})  # fmt: skip
    slow = C.run_hardware(hw, {**rows[1], "replay_probe_s": 9.0}).measured["m"]
    assert slow["host_access_s"] == pytest.approx(2 * access)
    with pytest.raises(FmoesimError) as exc:
        C.run_hardware(hw, untimed[2])
    msg = str(exc.value)
    assert msg.count("\n") == 0 and msg.startswith("fit: scales host costs by each run's FFN")
    assert "brainstorm run records no FFN launch timers" in msg
    probed = HardwareSpec(name="p", measured={"m": {"host_access_s": access,
                                                    C.HOST_PROBE_KEY: 0.010}})  # fmt: skip
    assert C.run_hardware(probed, untimed[2])  # a probe profile reads the probe only
    assert C.run_hardware(probed, {**untimed[2], "replay_probe_s": 0.02}).measured["m"][
        "host_access_s"] == pytest.approx(2 * access)  # fmt: skip


def test_a_report_row_of_one_repeat_names_its_repeat():
    """Rows scored repeat by repeat (``cross-check --each-repeat``) carry their repeat in
    the report's policy cells; rows of the repeats' mean, and rows of a replay.csv
    without repeats, do not.  Red if the repeats of a run cannot be told apart."""
    assert C._run_policy({"policy": "lru", "repeat": 2}) == "lru #2"
    assert C._run_policy({"policy": "lru", "repeat": 0, "replay_repeats": 4}) == "lru"
    assert C._run_policy({"policy": "lru"}) == "lru"


def test_fit_transfer_fits_a_started_copys_cost_where_the_timers_undercount_it():
    """Timed runs whose walls were built with 225 us a started copy while their link
    timers account for 148 us of it: by default the fit takes 148 from the timers and
    puts the rest elsewhere; with ``fit_transfer`` it returns every cost as built.  Red if
    the option still reads the timers or drops them from the wrong term."""
    layer, access, submit, transfer = 10e-6, 150e-6, 20e-6, 225e-6

    def row(policy, xfer, cancelled, acc=9):
        per = layer + access * acc + submit * (xfer + cancelled) + transfer * xfer
        return {"model": "m", "mode": "batch1", "policy": policy, "compute_repeat": 1,
                "replay_layer_steps": 100, "replay_accesses": acc * 100,
                "replay_transfers": xfer * 100, "replay_cancelled_transfers": cancelled * 100,
                "replay_policy_host_s": 0.0, "sim_gpu_busy_s": 0.05,
                "replay_wall_s": 0.05 + per * 100,
                "replay_host_link_issue_calls": xfer * 100,
                "replay_host_link_issue_s": 135e-6 * xfer * 100,
                "replay_host_link_on_done_s": 13e-6 * xfer * 100}  # fmt: skip

    rows = [row("lru", 3, 0), row("fmoe", 5, 1), row("brainstorm", 19, 40),
            row("lru", 4, 0, acc=12), row("fmoe", 6, 2, acc=7)]  # fmt: skip
    timed = C.fit_host(rows, "m")[0]
    assert timed["host_transfer_s"] == pytest.approx(148e-6)
    assert timed["host_submit_s"] != pytest.approx(submit, rel=1e-2)
    fitted = C.fit_host(rows, "m", fit_transfer=True)[0]
    for k, v in (("host_layer_s", layer), ("host_access_s", access),
                 ("host_submit_s", submit), ("host_transfer_s", transfer)):  # fmt: skip
        assert fitted[k] == pytest.approx(v, rel=1e-6), k


def test_launch_in_host_takes_the_measured_launch_share_out_of_the_expert_cost():
    """A profile whose FFN costs 168 us fixed, all of it launch by its own measurement,
    and a second model's 100 us of which 30 are launch: the expert keeps only what is not
    launch (0 and 70 us), its per-token cost and every other number as they were; a
    model that measured no share is left alone; a fit model without one is refused in
    one line.  Red if the share is left in, taken twice, or taken from a model that never
    measured it."""
    from fmoesim.specs import HardwareSpec

    hw = HardwareSpec(name="p", measured={
        "m": {"expert_a_s": 168e-6, "expert_launch_s": 168e-6, "expert_b_s": 3e-7,
              "attn_a_s": 2e-4},
        "n": {"expert_a_s": 100e-6, "expert_launch_s": 30e-6},
        "old": {"expert_a_s": 90e-6},
        "link": {"h2d_65536_s": 1e-5}})  # fmt: skip
    out = C.launch_in_host(hw, "m").measured
    assert out["m"] == {"expert_a_s": 0.0, "expert_launch_s": 0.0, "expert_b_s": 3e-7,
                        "attn_a_s": 2e-4}  # fmt: skip
    assert out["n"]["expert_a_s"] == pytest.approx(70e-6) and out["n"]["expert_launch_s"] == 0
    assert out["old"] == {"expert_a_s": 90e-6} and out["link"] == hw.measured["link"]
    assert hw.measured["m"]["expert_a_s"] == 168e-6  # the preset's own numbers untouched
    with pytest.raises(FmoesimError) as exc:
        C.launch_in_host(hw, "old")
    msg = "--launch-in-host: p measured no FFN launch share for old (rule: expert_launch_s"
    assert str(exc.value) == msg + ", which fmoesim-profile measures)"


def test_the_probe_exponent_is_the_within_policy_slope_of_the_timed_costs():
    """Timed runs whose copy issue and expert launch cost ``c * probe ** 0.5``, with a
    different ``c`` per policy and per cost: the exponent comes back as 0.5 (the slope
    within each policy and cost, so the policies' different levels do not bias it); an
    untimed run is ignored; runs whose probes never differ within a policy are refused;
    a profile's exponent scales its costs by the probe ratio to that power.  Red if the
    levels are pooled (the slope across policies is -0.46 here), or the power is ignored."""
    from fmoesim.specs import HardwareSpec

    def row(policy, probe, c):
        return {"policy": policy, "mode": "batch1", "replay_probe_s": probe,
                "replay_transfers": 10, "replay_host_link_issue_s": 6 * c * probe**0.5,
                "replay_host_link_on_done_s": 4 * c * probe**0.5,
                "replay_host_expert_calls": 20,
                "replay_host_expert_s": 20 * 3 * c * probe**0.5}  # fmt: skip

    rows = [row("lru", 0.01, 1.0), row("lru", 0.04, 1.0),
            row("fmoe", 0.02, 1e-4 / 0.02**1.5), row("fmoe", 0.08, 1e-4 / 0.02**1.5)]  # fmt: skip
    rows.append({"policy": "lfu", "mode": "batch1", "replay_probe_s": 9.0,
                 "replay_transfers": 3})  # untimed  # fmt: skip
    assert C.probe_exponent(rows) == pytest.approx(0.5)
    with pytest.raises(FmoesimError, match="no two timed runs of one policy differ"):
        C.probe_exponent([rows[0], rows[2], rows[4]])
    hw = HardwareSpec(name="x", measured={"m": {"host_access_s": 2e-6, C.HOST_PROBE_KEY: 0.01,
                                                C.HOST_PROBE_EXPONENT_KEY: 0.5}})  # fmt: skip
    slow = C.host_speed_hardware(hw, 0.04).measured["m"]
    assert slow["host_access_s"] == pytest.approx(2 * 2e-6)  # (0.04 / 0.01) ** 0.5


def test_fit_host_at_the_reference_speed_undoes_each_runs_probe():
    """Runs whose host ran 1x, 2x and 0.5x as long as the median (their probes say so)
    are brought to the median speed before the fit: the costs come back as set, with the
    median probe recorded; a run with no probe is refused.  Red if the factor is
    inverted or left out (the costs would come out skewed by the slow runs)."""
    layer, access, submit, transfer = SPEED_COSTS
    ref = 0.014

    def row(policy, xfer, cancelled, hooks, f, acc=9):
        return {**_speed_row(policy, xfer, cancelled, hooks, f, acc), "replay_probe_s": ref * f}

    rows = [row("lru", 3, 0, 1e-6, 1.0), row("fmoe", 5, 1, 5e-6, 2.0),
            row("brainstorm", 19, 40, 3e-6, 0.5), row("lru", 3, 0, 1e-6, 2.0, acc=12),
            row("fmoe", 5, 1, 5e-6, 1.0, acc=7)]  # fmt: skip
    engine, decisions = C.fit_host(rows, "m", host_speed=True)
    assert engine[C.HOST_PROBE_KEY] == pytest.approx(ref)
    for k, v in (("host_layer_s", layer), ("host_access_s", access),
                 ("host_submit_s", submit), ("host_transfer_s", transfer)):  # fmt: skip
        assert engine[k] == pytest.approx(v, rel=1e-6), k
    assert decisions["m"] == {"lru": pytest.approx(1e-6), "fmoe": pytest.approx(5e-6),
                              "brainstorm": pytest.approx(3e-6)}  # fmt: skip
    # a host whose costs follow the probe to the power 0.5 (as its timers say): the fit
    # with the exponent undoes that power and records it
    half = [row("lru", 3, 0, 1e-6, 1.0), row("fmoe", 5, 1, 5e-6, 2.0**0.5),
            row("brainstorm", 19, 40, 3e-6, 0.5**0.5), row("lru", 3, 0, 1e-6, 2.0**0.5, acc=12),
            row("fmoe", 5, 1, 5e-6, 1.0, acc=7)]  # fmt: skip
    for r, f in zip(half, (1.0, 2.0, 0.5, 2.0, 1.0), strict=True):
        r["replay_probe_s"] = ref * f
        r["replay_host_link_issue_s"] = 1e-4 * r["replay_transfers"] * f**0.5
        r["replay_host_link_on_done_s"] = 0.0
        r["replay_host_expert_calls"], r["replay_host_expert_s"] = 9, 9e-4 * f**0.5
    engine = C.fit_host(half, "m", host_speed=True, exponent=True)[0]
    assert engine[C.HOST_PROBE_EXPONENT_KEY] == pytest.approx(0.5)
    assert engine["host_access_s"] == pytest.approx(access, rel=1e-6)
    assert C.HOST_PROBE_EXPONENT_KEY not in C.fit_host(half, "m", host_speed=True)[0]
    del rows[1]["replay_probe_s"]
    with pytest.raises(FmoesimError, match="the m fmoe run records no host probe"):
        C.fit_host(rows, "m", host_speed=True)


def test_a_policy_s_fingerprint_covers_the_modules_it_imports_from():
    """Red if a policy's fingerprint reads only its class's bases: MoEpic's cache
    configurator (``policies.moepic_config``, imported, not a base) or fMoE's protocol
    types could change without ``score`` noticing.  Red too if the fingerprint ignores a
    knob (``fmoe`` with another prefetch distance is another policy)."""
    from policies.fmoe import FMoE
    from policies.moepic import MoEpic

    assert C.policy_modules(MoEpic) == [
        "policies.base",
        "policies.moepic",
        "policies.moepic_config",
    ]
    assert "policies.base" in C.policy_modules(FMoE)
    a = C.policy_code({"_target_": "policies.fmoe.FMoE", "prefetch_distance": 3})
    b = C.policy_code({"_target_": "policies.fmoe.FMoE", "prefetch_distance": 2})
    assert (
        a != b
        and len(a) == 12
        and a
        == C.policy_code(
            {"prefetch_distance": 3, "_target_": "policies.fmoe.FMoE"}  # keys in another order
        )
    )


@pytest.mark.parametrize("cmd", ["score", "cross-check", "events"])
def test_a_report_folder_that_cannot_be_made_is_refused_first(tmp_path, capsys, cmd):
    """Red if score, cross-check or events simulates first (tens of seconds on a real
    replay.csv) and only then finds its --out under a file: the refusal must come
    before any work, in one line naming --out."""
    blocker = tmp_path / "afile"
    blocker.write_text("")
    extra = (["--hardware", "h200-pcie5"] if cmd in ("score", "events")
             else ["--base", "h200-pcie5", "--fit-model", "olmoe-1b-7b"])  # fmt: skip
    with pytest.raises(SystemExit) as ex:
        C.main([cmd, "--out", str(blocker / "r"), *extra, str(tmp_path / "no-replay.csv")])
    assert ex.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"fmoesim-validate-grid: error: --out {blocker}/r: cannot be made: {blocker} is a "
        "file (rule: a folder for the report)"
    ]
