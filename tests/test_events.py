"""Event logs (``replay/events.py``): what a log says by hand, the step-by-step comparison
by hand, reading and refusing files, and a CPU replay's logs compared end to end with the
simulator's."""

from __future__ import annotations

import csv
import math
import tarfile

import numpy as np
import pytest

from fmoesim.engine.backend import TransferRecord
from fmoesim.errors import FmoesimError
from replay import campaign as C
from replay import events as E
from tests.test_campaign import TINY_GRID


def _xfer(key, reason, submit, start, end, release=None, **flags):
    r = TransferRecord(key, 0, 100, reason, 0.0, submit)
    r.start_s, r.end_s = start, end
    if release is not None:
        r.release_s = release
    for k, v in flags.items():
        setattr(r, k, v)
    return r


def _log(layers, tokens, gates, accesses, transfers, name="hand", **totals):
    rec = E.EventRecorder()
    rec.layers, rec.tokens, rec.gates_s = list(layers), list(tokens), list(gates)
    for t in E.TOTALS:
        rec.totals[t] = list(totals.get(t, [math.nan] * len(gates)))
    for step, key, outcome in accesses:
        rec.acc_step.append(step)
        rec.acc_key.append(key)
        rec.acc_outcome.append(outcome)
    return E.EventLog(rec.arrays(transfers), {"format": E.FORMAT}, name)


def _hand_log():
    """Gates at 0 (a prefill step of 4 tokens), 1 and 3 (one token each).  Prefetches: a
    submitted at 0.5 (step 0) starts at 0.7, before the next gate, and is used; b,
    submitted at 0.6, starts at 1.5, after it; c, submitted at 0.6, is cancelled; d is
    submitted at 1.1 (step 1) with a release at 1.4 and starts at 1.6.  An on-demand load
    e, submitted at 1.0, the gate of step 1 (as the simulator submits one), starts at
    1.3.  Copies last 0.2 s, e's is paused once."""
    xfers = [
        _xfer(1, "prefetch", 0.5, 0.7, 0.9, used=True),
        _xfer(2, "prefetch", 0.6, 1.5, 1.7),
        _xfer(3, "prefetch", 0.6, 0.6, 0.6, cancelled=True),
        _xfer(4, "prefetch", 1.1, 1.6, 1.8, release=1.4, used=True),
        _xfer(5, "on_demand", 1.0, 1.3, 1.5, used=True, preemptions=1),
    ]
    accesses = [(0, 1, 0), (0, 7, 2), (1, 5, 2), (1, 4, 1), (2, 2, 0), (2, 9, 0)]
    # the GPU busy 0.4 s of the first step and 0.6 s of the second; the hooks 0.1 and 0.3
    totals = {"gpu_busy_s": [0.0, 0.4, 1.0], "policy_s": [0.0, 0.1, 0.4]}
    return _log([0, 1, 0], [4, 1, 1], [0.0, 1.0, 3.0], accesses, xfers, **totals)


def test_a_one_token_steps_fixed_cost_and_a_copys_by_hand():
    """Gates at 0, 1, 2, 4, 7 and 8: a prefill step (a copy starts in it, it does not
    count), then one-token steps of 1, 2, 3 and 1 s with 0, 1, 2 and 0 copies started in
    them (a cancelled transfer in the last does not count).  With no copy a one-token
    step lasts 1 s, and each copy adds 1 s (the line through the four is exact).  Red if
    the prefill's steps or a cancelled transfer enter, or a copy is counted in the step
    of its submission instead of its start."""
    xfers = [
        _xfer(1, "prefetch", 0.2, 0.5, 0.7),
        _xfer(2, "on_demand", 1.9, 2.2, 2.4),  # submitted in step 1, starts in step 2
        _xfer(3, "on_demand", 4.0, 4.1, 4.3),
        _xfer(4, "on_demand", 4.0, 4.5, 4.7),
        _xfer(5, "prefetch", 7.2, 7.2, 7.2, cancelled=True),
    ]
    log = _log([0, 1, 0, 1, 0, 1], [4, 1, 1, 1, 1, 1], [0.0, 1.0, 2.0, 4.0, 7.0, 8.0], [],
               xfers)  # fmt: skip
    s = E.summarize(log)
    assert s["step_ms_one_idle"] == pytest.approx(1000.0)  # steps 1 and 4
    assert s["step_ms_one_per_copy"] == pytest.approx(1000.0)
    flat = E.summarize(_log([0, 1, 0], [1, 1, 1], [0.0, 1.0, 3.0], [], []))
    assert math.isnan(flat["step_ms_one_per_copy"])  # the count never varies
    assert flat["step_ms_one_idle"] == pytest.approx(1500.0)


def test_what_a_log_says_by_hand():
    """Step times, outcome shares, each prefetch's fate, queue waits, copies and the
    link's busy share of :func:`summarize`, computed by hand on :func:`_hand_log`.
    Red if a running total's growth is taken over the wrong steps, if the first forward
    pass does not end where the layers start over, if a transfer is
    placed in the wrong step (the gate at its submission counts),
    if a prefetch that starts after the next gate counts as started in its step, if the
    wait runs from the submission of a delayed prefetch instead of its release, if a
    cancelled transfer counts as started or as link time, or if a paused copy's length
    enters the copy time."""
    s = E.summarize(_hand_log())
    assert s["steps"] == 3 and s["multi_steps"] == 1
    assert s["step_ms_multi"] == pytest.approx(1000.0)  # 0 -> 1
    assert s["step_ms_one"] == pytest.approx(2000.0)  # 1 -> 3; the last step has no end
    assert s["step_ms_first"] == pytest.approx(1500.0)  # layers 0, 1; then layer 0 again
    assert math.isnan(s["step_ms_multi_later"])  # the only multi-token step is the first
    two = E.summarize(_log([0, 1, 0, 1], [4, 4, 3, 1], [0.0, 1.0, 3.0, 4.0], [], []))
    assert two["step_ms_first"] == pytest.approx(1500.0)  # steps 0 and 1
    assert two["step_ms_multi_later"] == pytest.approx(1000.0)  # step 2: 3 -> 4
    assert (s["gpu_ms_multi"], s["gpu_ms_one"]) == pytest.approx((400.0, 600.0))
    assert (s["policy_ms_multi"], s["policy_ms_one"]) == pytest.approx((100.0, 300.0))
    assert math.isnan(s["host_ms_multi"]) and math.isnan(s["host_ms_one"])  # not recorded
    assert (s["hit"], s["late"], s["miss"]) == pytest.approx((3 / 6, 1 / 6, 2 / 6))
    assert s["prefetch_submitted"] == pytest.approx(4 / 3)
    # a: in its step (0.7 < 1); b: later (1.5 > 1); c: cancelled; d: in its step (1.6 < 3)
    assert s["prefetch_started_in_step"] == pytest.approx(2 / 4)
    assert s["prefetch_started_later"] == pytest.approx(1 / 4)
    assert s["prefetch_cancelled"] == pytest.approx(1 / 4)
    assert s["prefetch_used"] == pytest.approx(2 / 4)
    # waits: a 0.2, b 0.9, d 0.2 (from its release at 1.4, not its submission at 1.1)
    assert s["prefetch_wait_ms"] == pytest.approx(1e3 * (0.2 + 0.9 + 0.2) / 3)
    assert s["prefetch_wait_ms_multi"] == pytest.approx(1e3 * (0.2 + 0.9) / 2)  # a, b
    assert s["prefetch_wait_ms_one"] == pytest.approx(200.0)  # d
    assert s["prefetch_copy_ms"] == pytest.approx(200.0)
    assert s["on_demand_submitted"] == pytest.approx(1 / 3)
    assert s["on_demand_wait_ms"] == pytest.approx(300.0)
    assert math.isnan(s["on_demand_copy_ms"])  # paused: not a whole copy
    assert s["on_demand_started_in_step"] == 1.0
    # four copies of 0.2 s over the span from the first gate (0) to the last gate (3)
    assert s["link_busy"] == pytest.approx(0.8 / 3.0)


def test_the_comparison_matches_accesses_by_step_and_key_by_hand():
    """:func:`compare`: the mean step difference per kind of step and the outcome matrix,
    by hand, with the simulator's accesses logged in another order within a step and
    one access only the replay made.  Red if accesses are matched by position, if the
    matrix's rows and columns are swapped, or if logs whose steps differ are compared
    step by step."""
    rep = _hand_log()
    # the simulator: steps of 1.5 s and 1 s (replay: 1 s and 2 s); its accesses found
    # (step 0) key 7 hit, key 1 hit; (step 1) key 4 hit, key 5 miss; (step 2) key 2 hit
    accesses = [(0, 7, 0), (0, 1, 0), (1, 4, 0), (1, 5, 2), (2, 2, 0)]
    sim = _log([0, 1, 0], [4, 1, 1], [0.0, 1.5, 2.5], accesses, [])
    c = E.compare(rep, sim)
    assert c["aligned"]
    assert c["step_diff_ms_multi"] == pytest.approx(500.0)
    assert c["step_diff_ms_one"] == pytest.approx(-1000.0)
    want = np.zeros((3, 3), dtype=int)
    want[0, 0] = 2  # key 1 (step 0) and key 2 (step 2): hit in both
    want[2, 0] = 1  # key 7: a miss in the replay, a hit in the simulator
    want[2, 2] = 1  # key 5: missed in both
    want[1, 0] = 1  # key 4: late in the replay, a hit in the simulator
    assert np.array_equal(c["outcomes"], want)
    assert c["agree"] == pytest.approx(3 / 5)
    other = _log([0, 1], [4, 1], [0.0, 1.0], [], [])
    assert E.compare(rep, other) == {"aligned": False}


def test_logs_round_trip_through_a_directory_and_a_tar_and_bad_files_are_refused(tmp_path):
    """A log saved and read back (from its directory and from a tar of it, as the GPU
    script bundles them) holds the same arrays; a file without an array, with an access
    outside the steps, with gates out of order or that is no log at all is refused in one
    line naming the file, the array or row and the rule.  Red if a column is lost on the
    way or a broken log is read as if whole (or raises a traceback)."""
    log = _hand_log()
    d = tmp_path / "events"
    E.save_log(d / "a_r0.npz", log.a, {"source": "test"})
    with tarfile.open(tmp_path / "events.tar", "w") as tar:
        tar.add(d, arcname="events")
    for src in (d, tmp_path / "events.tar"):
        (got,) = E.open_logs(src).values()
        assert got.meta == {"format": E.FORMAT, "source": "test"}
        for k in E.COLUMNS:
            assert np.array_equal(got.a[k], log.a[k], equal_nan=True), k
    bad = tmp_path / "bad"
    arrays = dict(log.a)
    del arrays["xfer_start_s"]
    E.save_log(bad / "x.npz", arrays, {})
    with pytest.raises(FmoesimError, match=r"x\.npz: no array 'xfer_start_s'"):
        E.open_logs(bad)
    arrays = dict(log.a, access_step=np.array([0, 0, 1, 1, 2, 3], dtype=np.int32))
    E.save_log(bad / "x.npz", arrays, {})
    with pytest.raises(FmoesimError, match=r"x\.npz: access_step row 5 is 3 .*3 layer steps"):
        E.open_logs(bad)
    arrays = dict(log.a, step_gate_s=np.array([0.0, 2.0, 1.0]))
    E.save_log(bad / "x.npz", arrays, {})
    with pytest.raises(FmoesimError, match=r"step_gate_s row 2 is earlier than row 1"):
        E.open_logs(bad)
    (bad / "x.npz").write_text("not a log")
    with pytest.raises(FmoesimError, match=r"x\.npz: not an event log"):
        E.open_logs(bad)
    # a log cut short or empty (BadZipFile, EOFError), a meta that is no object
    # (AttributeError), a column of text (numpy's UFuncNoLoopError), times that are NaN or
    # negative, no layer step at all: each a traceback or a report of n/a before
    whole = (d / "a_r0.npz").read_bytes()
    for data, rule in ((whole[: len(whole) // 2], "not an event log"),
                       (b"", "not an event log")):  # fmt: skip
        (bad / "x.npz").write_bytes(data)
        with pytest.raises(FmoesimError, match=rf"x\.npz: {rule}"):
            E.open_logs(bad)
    np.savez(bad / "x.npz", meta=np.asarray('["1", "2"]'), **log.a)
    with pytest.raises(FmoesimError, match=r"x\.npz: meta is list \(rule: a JSON object\)"):
        E.open_logs(bad)
    no_steps = {k: v[:0] if k.startswith(("step_", "access_")) else v for k, v in log.a.items()}
    for arrays, rule in (
        (dict(log.a, step_gate_s=np.array(["0", "1", "2"])),
         r"step_gate_s is a 1-D array of <U1 \(rule: a 1-D array of float64\)"),
        (dict(log.a, step_layer=log.a["step_layer"].reshape(-1, 1)),
         r"step_layer is a 2-D array"),
        (dict(log.a, step_gate_s=np.array([0.0, np.nan, 2.0])),
         r"step_gate_s row 1 is nan \(rule: a time in seconds, finite and >= 0\)"),
        (dict(log.a, xfer_start_s=-log.a["xfer_start_s"] - 1),
         r"xfer_start_s row 0 is -\d.* \(rule: a time in seconds, >= 0"),
        (no_steps, r"no layer step \(rule: a run's log has one or more\)"),
    ):  # fmt: skip
        E.save_log(bad / "x.npz", arrays, {})
        with pytest.raises(FmoesimError, match=rf"x\.npz: {rule}"):
            E.open_logs(bad)
    cut = tmp_path / "cut.tar"
    tar_bytes = (tmp_path / "events.tar").read_bytes()
    cut.write_bytes(tar_bytes[: len(tar_bytes) // 3])
    with pytest.raises(FmoesimError, match=r"cut\.tar: not a whole tar file"):
        E.open_logs(cut)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FmoesimError, match="holds no event log"):
        E.open_logs(tmp_path / "empty")


def test_a_cpu_replays_event_logs_are_compared_with_the_simulators(tmp_path):
    """LRU and fMoE replayed on the CPU twice with ``--event-logs``: only the first
    repeat writes a log; each log's steps, hits and transfers are the replay's own
    counts; the simulator's log of the same run is LRU's exactly where decisions do not
    depend on timing (every access found the same), and recording it changes nothing
    the simulator reports.  Red if a log is written per repeat, if the recorder drops or
    misplaces a step or an access, if the simulator's logged run differs from its plain
    run (the closed form skipped, a hook wrapped wrongly), or if the report loses a run."""
    pytest.importorskip("torch", reason="the replay needs torch")
    pytest.importorskip("matplotlib", reason="the report draws timelines")
    runs = C.grid_runs([TINY_GRID], ["lru", "fmoe"], ["batch1"], crossover=False)
    out = tmp_path / "rep"
    assert C.run_replays(runs, "cpu", out, log=lambda _: None, repeats=2, event_logs=True) == 4
    names = sorted(p.name for p in (out / "events").iterdir())
    assert names == [
        "olmoe-1b-7b_0.05GB_batch1_x1_fmoe_r0.npz", "olmoe-1b-7b_0.05GB_batch1_x1_lru_r0.npz",
    ]  # fmt: skip
    logs = E.open_logs(out / "events")
    rows = {r["policy"]: r for r in C.read_replays([out], merge=False) if r["repeat"] == 0}
    for pol, row in rows.items():
        log = logs[f"olmoe-1b-7b_0.05GB_batch1_x1_{pol}_r0.npz"]
        a = log.a
        assert len(a["step_layer"]) == row["replay_layer_steps"]
        assert len(a["access_key"]) == row["replay_accesses"]
        assert int((a["access_outcome"] == 0).sum()) == row["replay_hits"]
        moved = int((~a["xfer_cancelled"]).sum())
        assert moved == row["replay_transfers"]
        assert len(a["xfer_key"]) == moved + row["replay_cancelled_transfers"]
        assert log.meta["source"] == "replay" and log.meta["policy"] == pol
        # the GPU's compute and the policy's hooks so far, at each gate: they only grow,
        # and the hooks' total stays within the run's timed hooks
        for t in ("step_gpu_busy_s", "step_policy_s"):
            assert (np.diff(a[t]) >= 0).all() and a[t][-1] > 0, t
        assert a["step_policy_s"][-1] <= row["replay_policy_host_s"]
        assert a["step_gpu_busy_s"][-1] <= row["replay_gpu_busy_s"]
        assert np.isnan(a["step_host_s"]).all()
        sim, summary = C.simulate_events(row, "h100-pcie5")
        plain = C.simulate_row(row, "h100-pcie5")
        for k in ("hits", "late", "misses", "transfers", "tpot_mean_s", "ttft_mean_s"):
            assert summary[k] == plain[f"sim_{k}"], (pol, k)
        assert int((sim.a["access_outcome"] == 0).sum()) == summary["hits"]
        assert E.aligned(log, sim)
        if pol == "lru":
            assert E.compare(log, sim)["agree"] == 1.0
    rep = C.events_report([out], out / "events", "h100-pcie5", tmp_path / "ev", {"device": "cpu"})
    text = (rep / "events.md").read_text()
    assert "## olmoe-1b-7b_0.05GB_batch1_x1_lru_r0" in text and "Steps line up" in text
    assert len(list(csv.DictReader((rep / "events.csv").open()))) == 2
    assert len(list(rep.glob("timeline-*.png"))) == 2
    # a directory of anything else is not overwritten
    with pytest.raises(FmoesimError, match="not an events report"):
        C.events_report([out], out / "events", "h100-pcie5", out, {})
    # without logs: every repeat of every run, its replay column from replay.csv
    rep = C.events_report([out], None, "h100-pcie5", tmp_path / "ev2", {}, window_steps=0)
    table = list(csv.DictReader((rep / "events.csv").open()))
    assert [r["run"] for r in table] == [
        f"olmoe-1b-7b_0.05GB_batch1_x1_{p}_r{i}" for p in ("lru", "fmoe") for i in (0, 1)
    ]
    by_run = {(r["policy"], r["repeat"]): r for r in C.read_replays([out], merge=False)}
    for t in table:
        r = by_run[(t["run"].split("_")[4], int(t["run"][-1]))]
        moved = r["replay_transfers"] / r["replay_layer_steps"]
        assert float(t["replay_moved"]) == pytest.approx(moved)
        assert float(t["replay_hit"]) == pytest.approx(r["replay_hit_rate"])
        assert t["replay_step_ms_one"] == ""  # unknown without a log
    assert not list(rep.glob("timeline-*.png"))


def test_events_refit_the_host_costs_without_each_runs_policy(tmp_path, monkeypatch):
    """``events --fit-model``: each run is simulated on host costs fitted without its own
    policy's runs (as ``cross-check`` does), with the link depth, the host-speed measure
    and the fitted copy cost asked for.  Red if a run's policy stays in its fit, a run is
    simulated on another policy's fit, or the depth, the measure or the copy cost's
    choice is lost."""
    rows = [
        {"model": "m", "budget_gb": 1.0, "mode": "batch1", "policy": p, "compute_repeat": 1,
         "repeat": 0, "replay_layer_steps": 3, "replay_hit_rate": 0.5, "replay_late_rate": 0.0,
         "replay_miss_rate": 0.5, "replay_transfers": 3, "replay_cancelled_transfers": 0,
         "replay_ttft_mean_s": 0.1, "replay_tpot_mean_s": 0.01}
        for p in ("lru", "fmoe")
    ]  # fmt: skip
    left_out, simulated = [], {}

    def fit_host(rs, fit_model, host_speed, modes, leave_out, exponent, measure, fit_transfer):
        left_out.append((fit_model, list(leave_out), measure, fit_transfer))
        return {"host_access_s": 1e-4}, {}

    def simulate_events(row, hardware, spec_hw=None):
        simulated[row["policy"]] = spec_hw
        return _hand_log(), {"ttft_mean_s": 0.1, "tpot_mean_s": 0.01}

    monkeypatch.setattr(C, "read_replays", lambda paths, merge=True: rows)
    monkeypatch.setattr(C, "repeat_rows", lambda paths, hardware, spec_hw=None: rows)
    monkeypatch.setattr(C, "fit_host", fit_host)

    def host_profile(base, engine, decisions, name, note, spec=None):
        return name, engine

    monkeypatch.setattr(C, "host_profile", host_profile)
    monkeypatch.setattr(C, "simulate_events", simulate_events)
    fit = {"fit_model": "m", "host_speed": True, "modes": ["batch1"], "exponent": False,
           "link_depth": 2, "measure": "launch", "fit_transfer": True}  # fmt: skip
    C.events_report([tmp_path], None, "base", tmp_path / "ev", {}, 0, None, fit)
    assert left_out == [("m", ["lru"], "launch", True), ("m", ["fmoe"], "launch", True)]
    for p in ("lru", "fmoe"):
        name, engine = simulated[p]
        assert name == f"base-without-{p}" and engine["host_link_depth"] == 2
    assert "out of sample" in (tmp_path / "ev" / "events.md").read_text()


def test_the_events_command_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    """``fmoesim-validate-grid events``: a negative window, a ``--logs`` that is neither
    a directory nor a tar file or does not exist, a refit option without
    ``--fit-model`` and the probe's exponent or the launch-time speed without
    ``--host-speed`` are refused before
    anything is simulated or written, in one line naming the option, exit status 2.
    Red if one reaches the simulator or leaves a report directory behind."""
    rep = tmp_path / "replay.csv"
    rep.write_text("model,budget_gb,mode,policy,compute_repeat,overrides\n")
    plain = tmp_path / "plain.txt"
    plain.write_text("no logs here")
    cases = [
        (["--logs", str(tmp_path), "--window-steps", "-1"], "--window-steps -1: must be 0"),
        (["--logs", str(plain)], f"--logs {plain}: neither a directory nor a tar file"),
        (["--logs", str(tmp_path / "gone")], "gone: no such file or directory"),
        (["--link-depth", "2"], "--link-depth: needs --fit-model"),
        (["--fit-model", "m", "--probe-exponent"], "--probe-exponent: needs --host-speed"),
        (["--host-speed-from", "launch"], "--host-speed-from: needs --fit-model"),
        (
            ["--fit-model", "m", "--host-speed-from", "launch"],
            "--host-speed-from launch: needs --host-speed",
        ),
    ]
    for extra, msg in cases:
        with pytest.raises(SystemExit) as exc:
            C.main(["events", str(rep), "--hardware", "h100-pcie5", "--out",
                    str(tmp_path / "out"), *extra])  # fmt: skip
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and msg in err, err
        assert not (tmp_path / "out").exists()


def test_the_stored_gpu_logs_read_and_the_simulator_makes_lrus_decisions_step_by_step():
    """The replay's own event logs from an H100 (``results/validation/h100-3-measured``):
    all 18 read and pass their checks, and the simulator, run on LRU's logged batch-1
    configuration with that machine's profile, makes the same layer steps and finds the
    same thing (hit or miss) at every one of the replay's 19,291 accesses.  Red if the
    log format stops reading the stored files, or the runner, the cache or LRU decide
    anything differently from what the GPU replay decided."""
    from pathlib import Path

    here = Path(__file__).resolve().parents[1] / "results" / "validation" / "h100-3-measured"
    logs = E.open_logs(here / "events.tar")
    assert len(logs) == 18
    for log in logs.values():
        log.check()
        assert log.meta["source"] == "replay" and log.meta["device"] == "cuda"
    row = next(r for r in C.read_replays([here / "replay-batch1.csv"], merge=False)
               if r["policy"] == "lru" and int(r["repeat"]) == 0)  # fmt: skip
    sim, _ = C.simulate_events(row, "measured/h100-3")
    cmp = E.compare(logs["olmoe-1b-7b_3.2GB_batch1_x1_lru_r0.npz"], sim)
    assert cmp["aligned"]
    assert cmp["outcomes"].sum() == 19291 and cmp["agree"] == 1.0


def test_a_replay_csv_row_of_an_older_version_summarises_what_it_has():
    """Red if a replay.csv row without the columns a later version added (cancelled
    transfers, layer steps) raises a KeyError in the events command instead of n/a."""
    row = {"replay_hit_rate": 0.5, "replay_late_rate": 0.1, "replay_miss_rate": 0.4,
           "replay_transfers": 10.0}  # fmt: skip
    got = E.csv_summary(row)
    assert (got["hit"], got["late"], got["miss"]) == (0.5, 0.1, 0.4)
    assert math.isnan(got["steps"]) and math.isnan(got["cancelled"]) and math.isnan(got["moved"])
    row.update(replay_layer_steps=5.0, replay_cancelled_transfers=1.0)
    got = E.csv_summary(row)
    assert (got["moved"], got["cancelled"]) == (2.0, 0.2)
