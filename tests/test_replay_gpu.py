"""The replay's CUDA path.  Marked ``gpu``: skipped with a reason without a
CUDA GPU, run with ``pytest -m gpu`` on one."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the replay needs torch")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU on this machine"),
]


def test_cuda_replay_of_demand_only_policies_equals_the_simulator(tmp_path):
    from dataclasses import replace

    from fmoesim.engine.simulate import simulate
    from policies.lfu import LFU
    from policies.lru import LRU
    from replay.backend import replay_backend
    from tests._baseline_helpers import write_one_token_trace
    from tests.test_policy_contract import MODEL
    from tests.tiny import TINY_HW

    hw = replace(TINY_HW, chunk_bytes=1 << 20)
    trace = write_one_token_trace(tmp_path / "t", MODEL, 4, 8, 8, seed=5)
    budget = 12 * MODEL.expert_size_bytes
    for make in (LRU, LFU):
        sim = simulate(trace, MODEL, hw, make(), budget)
        rep = simulate(
            trace, MODEL, hw, make(), budget, make_backend=replay_backend(MODEL, hw, "cuda")
        )
        np.testing.assert_array_equal(rep.metrics.acc, sim.metrics.acc)
        s = rep.summary
        assert 0 < s["link_busy_s"] < s["simulated_s"]
        assert 0 <= s["stall_s"] < s["simulated_s"]
        assert all(t.start_s <= t.end_s for t in rep.transfers)


def test_profiler_on_the_gpu(tmp_path):
    from replay.profile import profile
    from tests.test_policy_contract import MODEL

    spec = profile(MODEL, "cuda", repeats=3)
    assert spec.pcie_gbps > 1 and spec.gpu != "cpu"
    m = spec.measured[MODEL.name]
    assert m["expert_a_s"] + m["expert_b_s"] > 0


def test_cuda_event_logs_share_the_hosts_clock(tmp_path):
    """A CUDA replay with event logs (``replay --event-logs``): the log holds every layer
    step, access and transfer the run counted, and its copy times (CUDA events) and host
    times (submissions, gates) are on one clock: no copy starts before it was queued,
    none ends before it starts, and every copy ends within the run.  Red if the CUDA
    events' origin drifts from the host clock's, or the recorder misses a step."""
    from replay import campaign as C
    from replay import events as E
    from tests.test_campaign import TINY_GRID

    runs = C.grid_runs([TINY_GRID], ["lru", "fmoe"], ["batch1"], crossover=False)
    out = tmp_path / "rep"
    assert C.run_replays(runs, "cuda", out, log=lambda _: None, event_logs=True) == 2
    logs = E.open_logs(out / "events")
    for row in C.read_replays([out], merge=False):
        a = logs[C._log_of(row)].a
        assert len(a["step_layer"]) == row["replay_layer_steps"]
        assert len(a["access_key"]) == row["replay_accesses"]
        moved = ~a["xfer_cancelled"]
        assert int(moved.sum()) == row["replay_transfers"] > 0
        start, end = a["xfer_start_s"][moved], a["xfer_end_s"][moved]
        assert (start >= a["xfer_submit_s"][moved] - 1e-3).all()
        assert (end >= start).all()
        assert end.max() <= row["replay_simulated_s"] + 1e-3
