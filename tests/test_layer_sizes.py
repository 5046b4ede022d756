"""Experts whose size differs by layer (quantized models): the cache and the link account
each layer's own size, and a real engine's cache log is reproduced access by access."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.simulate import model_for_trace, simulate
from fmoesim.errors import ConfigError, FmoesimError
from fmoesim.specs.model import DTYPE_BYTES
from fmoesim.trace import read_trace
from policies.base import Outcome
from policies.lru import LRU
from tests.tiny import TINY_HW, small_model, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]
EDGE = ROOT.parent / "shared" / "data" / "routing" / "bigmoeonedge-qwen3-30b-a3b"
M = dataclasses.replace(small_model(2, 4, 1), expert_size_bytes_by_layer=[100, 300])


def test_model_sizes_by_layer() -> None:
    """Red if the per-layer sizes are not what the budget checks and totals use."""
    assert M.layer_expert_bytes == [100, 300] and M.expert_size_bytes == 200
    assert M.total_expert_bytes == 4 * 400 and M.layer_topk_bytes == 300
    assert not M.uniform_experts and small_model(2, 4, 1).uniform_experts
    with pytest.raises(ConfigError, match="2 positive integers"):
        dataclasses.replace(M, expert_size_bytes_by_layer=[100]).validate()
    # the GGUF block formats: 144 bytes per 256 weights (Q4_K), 210 (Q6_K), 34 per 32 (Q8_0)
    assert DTYPE_BYTES["q4_k"] * 8 == 4.5 and DTYPE_BYTES["q6_k"] * 8 == 6.5625
    assert DTYPE_BYTES["q8_0"] * 8 == 8.5
    # HQQ as Mixtral-Offloading runs it: 2 bits + an 8-bit scale and zero per 16 weights +
    # fp16 scale and zero per 128 scales = 3.015625 bits; 4 bits in groups of 64: 4.25390625
    assert DTYPE_BYTES["hqq-2bit-g16"] * 8 == 3.015625
    assert DTYPE_BYTES["hqq-4bit-g64"] * 8 == 4.25390625
    # its attention's scales quantized per 256 (scale_quant_params group_size = 256)
    assert DTYPE_BYTES["hqq-4bit-g64-s256"] * 8 == 4.251953125


@pytest.mark.parametrize("timing", [False, True])
def test_lru_counts_each_layers_bytes(tmp_path: Path, timing: bool) -> None:
    """Red if a layer's expert takes another layer's size in the cache (the budget of 400
    bytes holds layer 0's e0 and layer 1's e0, 100 + 300, and nothing more) or on the
    link, or if the LRU fast path (which counts experts) runs for such a model.

    Tokens route (layer 0, layer 1): (0, 0) (1, 0) (0, 0).  Token 2's layer-0 expert 1
    (100 bytes) evicts the least recent, L0e0 (100): L1e0 stays and hits; token 3's L0e0
    evicts L0e1 and L1e0 hits again: MISS MISS / MISS HIT / MISS HIT."""
    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0, 0], [1, 0], [0, 0]], M))
    res = simulate(tr, M, TINY_HW, LRU(), 400, timing=timing, access_log=True)
    acc = res.accesses
    assert acc is not None
    assert np.asarray(acc["outcome"]).tolist() == [
        int(o) for o in (Outcome.MISS, Outcome.MISS, Outcome.MISS, Outcome.HIT,
                         Outcome.MISS, Outcome.HIT)
    ]  # fmt: skip
    assert res.summary["pcie_bytes"] == 100 + 300 + 100 + 100
    if timing:
        sizes = res.transfer_table()["size_bytes"].tolist()
        assert sizes == [100, 300, 100, 100]
    else:
        # without the access log the LRU fast path would run, were it allowed: it counts
        # the budget in experts of the mean size (500 // 200 = 2), where 500 bytes hold
        # L1e0 and both layer-0 experts: layer 0 alternating e0, e1 then hits from token 3
        tr2 = read_trace(write_sequence_trace(tmp_path / "t2", [[0, 0], [1, 0]] * 2, M))
        fast = simulate(tr2, M, TINY_HW, LRU(), 500, timing=False)
        assert (fast.summary["hits"], fast.summary["accesses"]) == (5, 8)


def test_trace_sizes_reach_the_model(tmp_path: Path) -> None:
    """Red if a trace that records per-layer sizes does not pass them to a model preset
    without them, or overrides a model that gives its own."""
    path = write_sequence_trace(tmp_path / "t", [[0, 0]], small_model(2, 4, 1))
    man = path / "trace.json"
    raw = man.read_text().replace('"kind": "synthetic"', '"expert_bytes_by_layer": [7, 9],\n'
                                  '    "kind": "synthetic"')  # fmt: skip
    man.write_text(raw)
    tr = read_trace(path)
    assert model_for_trace(small_model(2, 4, 1), tr).layer_expert_bytes == [7, 9]
    assert model_for_trace(M, tr).layer_expert_bytes == [100, 300]


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_real_engine_cache_log_is_reproduced() -> None:
    """A real on-device engine's cache (LRU over 4000 MiB, Qwen3-30B-A3B Q4_K_M with two
    expert sizes, 6 experts per token): in decode the simulator's hit or miss is the
    engine's on at least 99% of the 36,864 accesses, and its hit rate within 0.5 point
    of the engine's 80.29%.  Red if per-layer sizes are lost, the prompt is not one
    batched prefill (token-by-token prefill leaves another cache: 98.8%), or the importer
    shifts a step."""
    from fmoesim.validation.engine_log import compare

    res = {r.phase: r for r in compare(EDGE / "qwen.route.csv")}
    dec = res["decode"]
    assert dec.logged_accesses == dec.simulated_accesses == 36864
    assert dec.agreement is not None and dec.agreement >= 0.99
    assert abs(dec.simulated_hit_rate - dec.logged_hit_rate) <= 0.005
    assert abs(dec.logged_hit_rate - 0.8029) < 5e-5


def _edge_log(tmp_path: Path, expert_bytes: int, io_ms: float) -> tuple[Path, Path]:
    """A Qwen3-shaped route log with one expert per token: the prompt routes to expert 1,
    decode step 1 to expert 0 in every layer (48 misses), step 2 to expert 0 again (48
    hits); and its metrics, with step 1 reading 48 experts in ``io_ms`` of lane time."""
    head = ["# route_trace v1"]
    head += [f"# layer={i} expert_bytes={expert_bytes} dense_bytes=1000000" for i in range(48)]
    rows = ["turn,phase,step,layer,slot,expert,weight,residency"]
    for phase, step, expert in ((0, 0, 1), (1, 1, 0), (1, 2, 0)):
        rows += [f"0,{phase},{step},{i},0,{expert},1.0,{int(step == 2)}" for i in range(48)]
    log = tmp_path / "route.csv"
    log.write_text("\n".join(head + rows) + "\n")
    metrics = tmp_path / "route.metrics"
    metrics.write_text(
        "step,steps,wall_ms,io_ms,compute_ms,read_bytes,cache_hit_pct,stall_ms,mgmt_ms\n"
        f"1,2,0,{io_ms},50.0,{48 * expert_bytes},0,0,0\n"
        "2,2,0,0.0,70.0,0,50,0,0\n"
    )
    return log, metrics


def test_storage_timing_of_an_engine_log_by_hand(tmp_path: Path) -> None:
    """Hand-computed: 48 reads of 3,000,000 bytes in 480 ms of lane time over 4 lanes are
    0.3 GB/s a lane and 1.2 GB/s in all; the compute (the median of 50 and 70 ms, 60 ms)
    splits by weight bytes; with one expert per token nothing hides a read, and an expert
    is read as 3 slices of 1 MB on 3 of the 4 lanes, so step 1 stalls 48 x 1 MB / 0.3 GB/s
    = 160 ms (one server at 1.2 GB/s: 120 ms, a quarter of the lane time) and step 2, all
    hits, 0.  Red if io_ms is read as wall time (480 ms), the lanes or the slices are
    dropped, the metrics rows shift by a step, or the compute is split by anything but
    bytes."""
    from fmoesim.validation.engine_log import calibrate_storage, compare_timing

    log, metrics = _edge_log(tmp_path, 3_000_000, 480.0)
    cal = calibrate_storage(log, metrics, top_k=1, lanes=4)
    assert cal.pcie_gbps == pytest.approx(1.2) and (cal.lanes, cal.slices) == (4, 3)
    assert cal.compute_s == pytest.approx(0.060)
    head = 151936 * 2048 * 210 / 256
    per_token = 48 * (1_000_000 + 3_000_000) + round(head)
    m = cal.measured()
    assert m["expert_a_s"] == pytest.approx(0.060 * 3_000_000 / per_token)
    assert m["attn_a_s"] == pytest.approx(0.060 * 1_000_000 / per_token)
    assert m["lm_head_a_s"] == pytest.approx(0.060 * round(head) / per_token)
    res = compare_timing(log, metrics, cal.hardware("qwen3-30b-a3b"), top_k=1)
    t = res.tokens
    assert t["sim_stall_ms"].tolist() == pytest.approx([160.0, 0.0])
    assert t["sim_read_bytes"].tolist() == [48 * 3_000_000, 0]
    assert t["sim_compute_ms"].tolist() == pytest.approx([60.0, 60.0])
    one = dataclasses.replace(cal.hardware("qwen3-30b-a3b"), link_lanes=1, transfer_slices=1)
    t = compare_timing(log, metrics, one, top_k=1).tokens
    assert t["sim_stall_ms"].tolist() == pytest.approx([120.0, 0.0])


def test_engine_metrics_errors_name_file_row_and_rule(tmp_path: Path) -> None:
    """Red if a negative time, a step that goes back or a missing column passes silently."""
    from fmoesim.validation.engine_log import read_metrics

    cases = {
        "step,io_ms,compute_ms,read_bytes,stall_ms\n1,1,1,1,1\n": "has a 'mgmt_ms' column",
        "step,io_ms,compute_ms,read_bytes,stall_ms,mgmt_ms\n1,1,1,1,-2,0\n": "row 1: 'stall_ms'",
        "step,io_ms,compute_ms,read_bytes,stall_ms,mgmt_ms\n2,1,1,1,1,0\n1,1,1,1,1,0\n": (
            "row 2: 'step' (rule: increases row by row)"
        ),
    }
    for i, (text, message) in enumerate(cases.items()):
        p = tmp_path / f"m{i}.csv"
        p.write_text(text)
        with pytest.raises(FmoesimError, match=re.escape(f"{p}: {message}")):
            read_metrics(p)


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_device_preset_is_derived_from_the_engine_metrics() -> None:
    """``conf/hardware/oneplus-15r-flash.yaml`` holds what :func:`calibrate_storage`
    derives from the log (3.156 GB/s over 4 lanes, an expert read as 3 slices; 91.28 ms
    per token split by bytes).
    Red if the preset is edited by hand (a knob fitted to the stall it is checked
    against) or the derivation changes without it."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs import HardwareSpec
    from fmoesim.validation.engine_log import calibrate_storage

    cal = calibrate_storage(EDGE / "qwen.route.csv", EDGE / "qwen.metrics")
    hw = load_preset("hardware", "oneplus-15r-flash", HardwareSpec)
    assert hw.pcie_gbps == pytest.approx(cal.pcie_gbps, rel=1e-12)
    assert hw.pcie_gbps == pytest.approx(3.1564, rel=1e-4)
    assert hw.transfer_overhead_s == 0.0
    assert (hw.link_lanes, hw.transfer_slices) == (cal.lanes, cal.slices) == (4, 3)
    measured = hw.measured["qwen3-30b-a3b"]
    for key, value in cal.measured().items():
        assert measured[key] == pytest.approx(value, rel=1e-12, abs=0.0), key


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_real_engine_stall_is_compared_token_by_token() -> None:
    """The measured comparison of docs/validation.md: the simulator reads what the engine
    read (within 0.5%), its compute is the calibrated median, and its per-token stall
    follows the engine's (correlation 0.99) at 0.98 of it, on the engine's 4 reader lanes
    with an expert read as 3 slices.  Red if the per-layer sizes are lost on the link, the
    metrics rows are shifted against the decode steps (the correlation falls), the preset's
    lanes or slices do not reach the link (0.65 again), or a change moves the stall ratio
    out of [0.93, 1.03]."""
    from fmoesim.validation.engine_log import compare_timing

    s = compare_timing(EDGE / "qwen.route.csv", EDGE / "qwen.metrics").summary()
    assert s["tokens"] == 128
    assert abs(s["sim_read_mib"] / s["logged_read_mib"] - 1) < 0.005
    assert s["sim_compute_ms_median"] == pytest.approx(s["logged_compute_ms_median"])
    assert s["stall_corr"] >= 0.99
    assert 0.93 <= s["stall_ratio"] <= 1.03
    assert s["stall_mae_ms"] < 8.0


def test_engine_log_options_that_would_do_nothing_are_refused(capsys) -> None:
    """Red if ``--lanes`` or ``--slices`` without ``--calibrate`` is taken and ignored (the
    timing printed the preset's stall ratio whatever it said), ``--pcie-gbps`` or
    ``--link-lanes`` without a timing comparison is ignored, a link of 0 slices is
    taken, or a negative budget is reported as a config key the user never gave."""
    from fmoesim.validation.engine_log import main

    for argv, said in (
        (["--lanes", "3"], "--lanes 3: only with --calibrate"),
        (["--slices", "2"], "--slices 2: only with --calibrate"),
        (["--link-lanes", "2"], "--link-lanes 2: only with --metrics, without --calibrate"),
        (["--metrics", "m", "--transfer-slices", "0"], "--transfer-slices 0: must be an integer"),
        (["--pcie-gbps", "1"], "--pcie-gbps 1: only with --metrics, without --calibrate"),
        (["--metrics", "m", "--pcie-gbps", "-1"], "--pcie-gbps -1: must be a number > 0"),
        (["--budget-mib", "-5"], "--budget-mib -5: must be a number > 0"),
    ):
        with pytest.raises(SystemExit) as info:
            main(["log.csv", *argv])
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: {said}" in err[0], err


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_one_server_links_bracket_the_engine(capsys) -> None:
    """docs/validation.md's one-server links: at the 4 readers' whole rate the simulator
    stalls 0.65 times the engine, at one reader's rate (``--pcie-gbps 0.789``) 4.32
    times.  Red if ``--link-lanes`` or ``--transfer-slices`` does not reach the timing's
    link (the preset's 0.98 again), or ``--pcie-gbps`` does not."""
    from fmoesim.validation.engine_log import main

    one = ["--link-lanes", "1", "--transfer-slices", "1"]
    for extra, ratio in (([], "0.65"), (["--pcie-gbps", "0.789"], "4.32")):
        main([str(EDGE / "qwen.route.csv"), "--metrics", str(EDGE / "qwen.metrics"),
              *one, *extra])  # fmt: skip
        assert f"| stall, simulator / engine | | {ratio} |" in capsys.readouterr().out


def test_engine_log_names_a_folder_or_a_missing_file(tmp_path: Path, capsys) -> None:
    """Red if a folder given as LOG fails with "Is a directory" and no rule, or one that
    holds other files is read as some other file's error."""
    from fmoesim.validation.engine_log import main

    (tmp_path / "other.json").write_text("{")
    for argv, said in (
        ([str(tmp_path)], f"LOG {tmp_path}: a folder (rule: one CSV file)"),
        ([str(tmp_path / "none.csv")], f"LOG {tmp_path / 'none.csv'}: no such file"),
    ):
        with pytest.raises(SystemExit) as info:
            main(argv)
        assert info.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"error: {said}" in err[0], err
