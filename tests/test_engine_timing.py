"""The simulator's timing model against closed forms (DESIGN.md "Timing model", "Metrics").

Every expectation is derived by hand from the model and hardware parameters: an expert
over an idle link takes ``t_x = overhead + size / bandwidth``; compute times are the
:class:`ComputeModel` terms (``a + b * tokens``) of the operators the Runner runs.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoesim.engine import sim as sim_engine
from fmoesim.engine import simulate
from fmoesim.engine.backend import ON_DEMAND, TransferRecord
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.sim import SimLink
from fmoesim.errors import ConfigError
from fmoesim.trace import read_trace
from policies.base import NO_ACTIONS, Actions, GateView, Outcome, Prefetch, PrefetchBatch
from policies.lru import LRU
from tests._engine_helpers import (
    TRANSFER_COLUMNS,
    Req,
    ScheduledPrefetch,
    pre_gate_s,
    transfer_s,
    write_trace,
)
from tests.tiny import TINY, TINY_HW, small_model, write_sequence_trace

SIZE = TINY.expert_size_bytes  # 6 MB
C = ComputeModel.from_specs(TINY, TINY_HW)
T_X = transfer_s(TINY_HW, TINY)  # 1e-4 + 6e6 / 1e10 = 7e-4 s
L = TINY.num_layers
#: TINY with two experts per token (layer 0 of an iteration may hold a HIT and a MISS)
TINY2 = replace(TINY, top_k=2)


def test_hand_constants():
    # the numbers every closed form below relies on
    assert SIZE == 6_000_000
    assert T_X == pytest.approx(7e-4, rel=1e-12)
    assert TINY_HW.chunk_bytes > SIZE  # the default chunk holds a whole expert


# -- 1. every layer misses: stall = t_x per layer, time = compute + misses * t_x ----------
CYCLE = [[i % 4, (i + 1) % 4] for i in range(6)]  # a key recurs only 8 accesses later


def decode_compute_s(c: ComputeModel, p: int, j: int) -> float:
    """Compute of decode iteration ``j`` of one request of prompt ``p`` (batch 1)."""
    return L * (pre_gate_s(c, [(p, j)]) + c.expert_s(1)) + c.lm_head_s(1)


def prefill_compute_s(c: ComputeModel, p: int) -> float:
    """Compute of the prefill of one request of prompt ``p``."""
    return L * (pre_gate_s(c, [(p, 0)]) + c.expert_s(p)) + c.lm_head_s(1)


@pytest.mark.parametrize("chunk_bytes", [TINY_HW.chunk_bytes, SIZE, 1_000_000, 4096])
def test_every_layer_misses_one_expert(tmp_path, chunk_bytes):
    p = 3
    hw = replace(TINY_HW, chunk_bytes=chunk_bytes)  # no prefetch: chunking changes nothing
    tr = read_trace(write_sequence_trace(tmp_path / "t", CYCLE, prompt_tokens=p))
    r = simulate(tr, TINY, hw, LRU(), 2 * SIZE)
    s = r.summary
    n = len(CYCLE)
    assert (s["hits"], s["late"], s["misses"]) == (0, 0, n * L)
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [n * T_X] * L, rtol=1e-12)
    compute = prefill_compute_s(C, p) + sum(decode_compute_s(C, p, j) for j in range(1, n))
    assert s["gpu_busy_s"] == pytest.approx(compute, rel=1e-12)
    assert s["stall_s"] == pytest.approx(n * L * T_X, rel=1e-12)
    assert s["simulated_s"] == pytest.approx(compute + n * L * T_X, rel=1e-12)
    req = r.metrics.request_table()
    assert req["ttft_s"][0] == pytest.approx(prefill_compute_s(C, p) + L * T_X, rel=1e-12)
    # the prefill's p tokens over its compute and its L stalls (decode iterations excluded)
    assert s["prefill_tokens_per_s"] == pytest.approx(
        p / (prefill_compute_s(C, p) + L * T_X), rel=1e-12
    )
    assert s["preemptions"] == 0
    for t in r.transfers:  # each on-demand load runs alone on an idle link
        assert t.end_s - t.start_s == pytest.approx(T_X, rel=1e-9)
        assert t.start_s == t.submit_s


def test_a_hit_costs_no_stall(tmp_path):
    p, n = 2, 5
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [[[0], [3]]] * n)])
    r = simulate(tr, TINY, TINY_HW, LRU(), 2 * SIZE)
    s = r.summary
    assert (s["hits"], s["misses"]) == ((n - 1) * L, L)  # only the prefill is cold
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X] * L, rtol=1e-12)
    decode = [decode_compute_s(C, p, j) for j in range(1, n)]
    req = r.metrics.request_table()
    # decode steps hit everything: their time is compute alone
    assert req["tpot_s"][0] == pytest.approx(sum(decode) / (n - 1), rel=1e-12)
    assert s["simulated_s"] == pytest.approx(
        prefill_compute_s(C, p) + L * T_X + sum(decode), rel=1e-12
    )


def test_whole_layer_fetch_waits_for_the_layer_and_ranks_unused_experts_first(tmp_path):
    # DeepSpeed-Inference fetches every expert of a layer when it runs (fMoE §6.1,
    # MoE-Infinity §2).  TINY: 2 layers x 4 experts, top-1; every token routes layer 0 to
    # expert 1 and layer 1 to expert 2 (keys 1 and 6); the budget holds 5 experts.
    # Iteration 0, layer 0 loads keys 0-3 in expert order and waits for the fourth: 4 t_x.
    # Layer 1 loads 4-7: 4 fits, then 5, 6, 7 evict the never-used 0, 2, 3 (oldest fetch
    # first), so the used key 1 stays, and from then on each routed expert hits while the
    # layer's three others load: 3 t_x a layer.  Ranked by admission (plain LRU order),
    # 5, 6, 7 would evict 0, 1, 2 and every access would miss; loading only the routed
    # experts (the other reading) gives one load in all after the cold start.
    from policies.deepspeed import DeepSpeedInference

    p, n = 2, 4
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [[[1], [2]]] * n)])
    r = simulate(tr, TINY, TINY_HW, DeepSpeedInference(), 5 * SIZE)
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == ((n - 1) * L, 0, L)
    assert s["transfers"] == 4 * L + 3 * L * (n - 1)
    assert s["on_demand_bytes"] == s["pcie_bytes"] == s["transfers"] * SIZE
    assert [t.key for t in r.transfers[:8]] == list(range(8))
    assert [t.key for t in r.transfers[8:14]] == [0, 2, 3, 4, 5, 7]
    compute = sum(L * pre_gate_s(C, [(p, j)]) + C.lm_head_s(1) for j in range(n))
    assert s["simulated_s"] == pytest.approx(
        compute + 4 * L * T_X + 3 * L * (n - 1) * T_X, rel=1e-9
    )  # the routed experts compute while the layer's other loads run (23 us < t_x)
    assert list(r.caches[0].entries) == [1, 6, 4, 5, 7]  # layer 1's unused fetches last
    exact = simulate(tr, TINY, TINY_HW, DeepSpeedInference(whole_layer=False), 5 * SIZE)
    assert exact.summary["transfers"] == L  # the routed experts only: LRU's decisions
    assert exact.summary["hits"] == (n - 1) * L

    class Split(DeepSpeedInference):
        uses_segments = True

    with pytest.raises(ValueError, match="cannot split"):
        simulate(tr, TINY, TINY_HW, Split(), 5 * SIZE)


# -- 2. SimLink ---------------------------------------------------------------------------
MB = 1_000_000
BW = 1e9  # 1 GB/s: 1 MB takes 1 ms
OV = 1e-3  # fixed cost per transfer


class Link:
    """A SimLink with the completions it reported, driven at explicit times; requests
    name a key and go to the record last submitted for it (the link is addressed by
    record, as SimBackend does through its cache entries)."""

    def __init__(self, chunk: int = 4 * MB, preempt: bool = True, fifo: bool = False) -> None:
        self.done: list[int] = []
        self.link = SimLink(BW, OV, chunk, preempt, self.done.append, fifo=fifo)
        self.records: dict[int, TransferRecord] = {}

    def live(self) -> list[TransferRecord]:
        """The records the link still holds: queued, delayed or running."""
        gone = (sim_engine._DONE, sim_engine._CANCELLED)
        return [r for r in self.records.values() if r.state not in gone]

    # a key never submitted has no record: nothing to do (as SimBackend does)
    def cancel(self, key: int) -> bool:
        return key in self.records and self.link.cancel(self.records[key])

    def abort(self, key: int, t: float) -> bool:
        self.link.advance(t)
        return key in self.records and self.link.abort(self.records[key], t)

    def escalate(self, key: int, t: float) -> None:
        if key in self.records:
            self.link.escalate(self.records[key], t)

    def reprioritize(self, key: int, prio: float) -> None:
        if key in self.records:
            self.link.reprioritize(self.records[key], prio)

    def submit(
        self, key: int, size: int, t: float, prio: float = 1.0, release: float | None = None
    ) -> TransferRecord:
        reason = "on_demand" if prio == ON_DEMAND else "prefetch"
        rec = TransferRecord(key, 0, size, reason, prio, t)
        if release is not None:
            rec.release_s = release
        self.link.advance(t)
        self.link.submit(rec, t)
        self.records[key] = rec
        return rec

    def finish(self) -> None:
        self.link.advance(float("inf"))


def test_link_fifo_among_equal_priorities():
    lk = Link()
    a = lk.submit(1, 1 * MB, 0.0)
    b = lk.submit(2, 1 * MB, 0.0)
    c = lk.submit(3, 1 * MB, 0.0)
    lk.finish()
    assert lk.done == [1, 2, 3]
    # each pays its fixed cost when it starts: 2 ms apiece
    assert (a.start_s, b.start_s, c.start_s) == pytest.approx((0.0, 2e-3, 4e-3))
    assert (a.end_s, b.end_s, c.end_s) == pytest.approx((2e-3, 4e-3, 6e-3))


def test_link_lower_priority_value_first_among_queued():
    lk = Link()
    lk.submit(1, 1 * MB, 0.0, prio=5.0)  # running: not reordered
    lk.submit(2, 1 * MB, 0.0, prio=2.0)
    lk.submit(3, 1 * MB, 0.0, prio=1.0)
    lk.submit(4, 1 * MB, 0.0, prio=1.0)
    lk.submit(5, 1 * MB, 0.0, prio=0.5)
    lk.finish()
    assert lk.done == [1, 5, 3, 4, 2]


def test_link_on_demand_pauses_prefetch_at_next_chunk_boundary():
    lk = Link(chunk=4 * MB)
    pf = lk.submit(1, 10 * MB, 0.0)  # data moves from 1 ms, 1 MB per ms
    t_od = OV + 5 * MB / BW  # 5 MB moved: the next boundary is 8 MB, at 9 ms
    od = lk.submit(2, 2 * MB, t_od, prio=ON_DEMAND)
    lk.link.advance(8.9e-3)
    assert lk.done == [] and pf.preemptions == 0  # still moving its 8th MB
    lk.finish()
    assert lk.done == [2, 1]
    assert od.start_s == pytest.approx(9e-3)
    assert od.end_s == pytest.approx(9e-3 + OV + 2e-3)  # on-demand pays its fixed cost
    # the prefetch resumes at 12 ms with 2 MB left and no second fixed cost
    assert pf.start_s == 0.0
    assert pf.end_s == pytest.approx(12e-3 + 2e-3)
    assert pf.preemptions == 1
    assert lk.link.busy_s == pytest.approx(14e-3)  # no idle time: 9 + 3 + 2 ms


def test_link_on_demand_during_fixed_cost_pauses_before_any_byte():
    lk = Link(chunk=4 * MB)
    pf = lk.submit(1, 10 * MB, 0.0)
    od = lk.submit(2, 2 * MB, 0.5e-3, prio=ON_DEMAND)
    lk.finish()
    assert od.start_s == pytest.approx(OV)  # the prefetch's fixed cost is not interrupted
    assert od.end_s == pytest.approx(OV + OV + 2e-3)
    assert pf.end_s == pytest.approx(4e-3 + 10e-3)  # all 10 MB after, no second fixed cost
    assert pf.preemptions == 1


def test_link_last_chunk_is_not_paused():
    lk = Link(chunk=4 * MB)
    pf = lk.submit(1, 10 * MB, 0.0)
    lk.submit(2, 2 * MB, OV + 5e-3, prio=ON_DEMAND)  # pauses pf at 8 MB (9 ms) -> 12 ms
    # pf resumes at 12 ms with its last 2 MB (8..10 MB): no boundary left before its end
    od2 = lk.submit(3, 1 * MB, 12.5e-3, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [2, 1, 3]
    assert pf.end_s == pytest.approx(14e-3) and pf.preemptions == 1
    assert od2.start_s == pytest.approx(14e-3)
    assert od2.end_s == pytest.approx(14e-3 + OV + 1e-3)


def test_link_without_preemption_keeps_prefetch_running():
    lk = Link(chunk=4 * MB, preempt=False)
    pf = lk.submit(1, 10 * MB, 0.0)
    od = lk.submit(2, 2 * MB, OV + 5e-3, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [1, 2]
    assert pf.end_s == pytest.approx(OV + 10e-3) and pf.preemptions == 0
    assert (od.start_s, od.end_s) == pytest.approx((11e-3, 11e-3 + OV + 2e-3))


@pytest.mark.parametrize("chunk", [10 * MB, 16 * MB])
def test_link_chunk_not_smaller_than_transfer_never_pauses(chunk):
    lk = Link(chunk=chunk)
    pf = lk.submit(1, 10 * MB, 0.0)
    od = lk.submit(2, 2 * MB, OV + 5e-3, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [1, 2]
    assert pf.preemptions == 0 and pf.end_s == pytest.approx(11e-3)
    assert od.start_s == pytest.approx(11e-3)


def test_link_cancel_only_queued_never_started():
    lk = Link(chunk=4 * MB)
    run = lk.submit(1, 10 * MB, 0.0)
    queued = lk.submit(2, 1 * MB, 0.0)
    od = lk.submit(3, 2 * MB, OV + 5e-3, prio=ON_DEMAND)  # pauses key 1 at 9 ms
    assert not lk.cancel(1)  # running
    assert lk.cancel(2)  # queued, never started
    assert not lk.cancel(2)  # already cancelled
    lk.link.advance(10e-3)  # key 1 paused after moving 8 MB, key 3 running
    assert run.preemptions == 1
    assert not lk.cancel(1)  # paused after it started: not cancellable
    lk.finish()
    assert not lk.cancel(3)  # finished
    assert lk.done == [3, 1]
    assert queued.start_s != queued.start_s  # NaN: never started
    assert run.end_s == pytest.approx(14e-3)
    assert od.end_s == pytest.approx(12e-3)
    assert lk.link.busy_s == pytest.approx(14e-3)  # the cancelled one moved nothing


def test_link_abort_stops_a_running_prefetch_at_its_next_chunk_boundary():
    """10 MB in 4 MB chunks, data from 1 ms at 1 MB/ms.  Aborted at 6 ms (5 MB moved),
    it stops at the 8 MB boundary (9 ms) for good: the next prefetch starts then, and
    the aborted one never lands, with 8 MB moved and 2 MB left.  Red if the abort
    stopped it at once (5 MB, the next one at 6 ms), let it finish, or re-queued it."""
    lk = Link(chunk=4 * MB)
    pf = lk.submit(1, 10 * MB, 0.0)
    nxt = lk.submit(2, 1 * MB, 0.0)
    assert lk.abort(1, OV + 5e-3)
    lk.finish()
    assert lk.done == [2]
    assert pf.aborted and not pf.cancelled and pf.state == sim_engine._CANCELLED
    assert pf.end_s == pytest.approx(9e-3) and pf.left_bytes == 2 * MB
    assert pf.moved_bytes == 8 * MB and pf.preemptions == 0
    assert (nxt.start_s, nxt.end_s) == pytest.approx((9e-3, 11e-3))
    assert lk.link.busy_s == pytest.approx(11e-3)  # 9 ms of the aborted one, 2 of the next


def test_link_abort_of_what_cannot_stop_or_never_started():
    """A transfer in its last chunk, one of a single chunk, and an escalated one are not
    stopped (False, and each lands); a queued one that never started is cancelled (not
    aborted: it never moved).  Red if an abort cut a last chunk short or dropped a
    transfer someone waits for."""
    lk = Link(chunk=4 * MB)
    last = lk.submit(1, 10 * MB, 0.0)
    queued = lk.submit(2, 1 * MB, 0.0)
    assert not lk.abort(1, OV + 9e-3)  # 9 MB moved: the next boundary is its end
    assert lk.abort(2, OV + 9e-3)
    assert queued.state == sim_engine._CANCELLED and not queued.aborted
    assert queued.start_s != queued.start_s  # NaN: never started
    one = lk.submit(3, 4 * MB, 12e-3)
    assert not lk.abort(3, 13e-3)  # one chunk
    esc = lk.submit(4, 10 * MB, 16e-3)
    lk.escalate(4, 16e-3)
    assert not lk.abort(4, 17e-3)
    lk.finish()
    assert lk.done == [1, 3, 4]
    assert not (last.aborted or one.aborted or esc.aborted)
    assert last.moved_bytes == 10 * MB


def test_link_abort_of_a_paused_prefetch_and_of_one_pausing():
    """An on-demand load pauses a prefetch at its 8 MB boundary (9 ms).  Aborted while
    it pauses (at 7 ms), it stops there and is not resumed; aborted once paused (a
    second prefetch, paused at 4 MB behind another load), it leaves the queue with the
    bytes it moved.  Red if a pausing job resumed after an abort, or a paused one
    stayed in the queue."""
    lk = Link(chunk=4 * MB)
    a = lk.submit(1, 10 * MB, 0.0)
    lk.submit(2, 2 * MB, OV + 5e-3, prio=ON_DEMAND)  # a pauses at 9 ms
    assert lk.abort(1, 7e-3)
    lk.link.advance(12e-3)  # the load ran 9..12 ms
    b = lk.submit(3, 10 * MB, 12e-3)  # data from 13 ms
    lk.submit(4, 1 * MB, 14e-3, prio=ON_DEMAND)  # b pauses at its 4 MB boundary, 17 ms
    lk.link.advance(18e-3)
    assert b.state == sim_engine._QUEUED and b.preemptions == 1  # paused at 17 ms
    lk.link.advance(20e-3)  # the load ran 17..19 ms; b resumed at 19 ms
    c = lk.submit(5, 10 * MB, 20e-3)
    lk.submit(6, 1 * MB, 20.5e-3, prio=ON_DEMAND)  # b pauses at 8 MB, 23 ms
    lk.link.advance(23.5e-3)
    assert b.state == sim_engine._QUEUED and b.preemptions == 2
    assert lk.abort(3, 23.5e-3)
    lk.finish()
    assert a.aborted and a.end_s == pytest.approx(9e-3) and a.moved_bytes == 8 * MB
    assert a.preemptions == 0  # stopped, not paused
    assert b.aborted and b.moved_bytes == 8 * MB and b.end_s == pytest.approx(23e-3)
    assert lk.done == [2, 4, 6, 5] and not lk.link._queue
    assert c.start_s == pytest.approx(25e-3)  # after the second load (23..25 ms)


def test_link_escalate_moves_queued_prefetch_ahead():
    lk = Link(chunk=16 * MB)  # no pausing: only the queue order changes
    a = lk.submit(1, 1 * MB, 0.0)
    b = lk.submit(2, 1 * MB, 0.0)
    c = lk.submit(3, 1 * MB, 0.0)
    lk.escalate(3, 0.5e-3)
    lk.finish()
    assert lk.done == [1, 3, 2]
    assert c.escalated and not b.escalated and not a.escalated
    assert c.priority == 1.0  # the record keeps the priority it was submitted with
    assert (c.start_s, b.start_s) == pytest.approx((2e-3, 4e-3))


def test_link_escalate_pauses_running_prefetch_at_chunk_boundary():
    lk = Link(chunk=4 * MB)
    a = lk.submit(1, 10 * MB, 0.0)
    b = lk.submit(2, 1 * MB, 0.0)
    c = lk.submit(3, 1 * MB, 0.0)
    lk.escalate(3, OV + 5e-3)  # a pauses at 8 MB (9 ms)
    lk.finish()
    assert lk.done == [3, 1, 2]  # a resumes before b: same priority, submitted first
    assert (c.start_s, c.end_s) == pytest.approx((9e-3, 11e-3))
    assert a.end_s == pytest.approx(13e-3) and a.preemptions == 1
    assert (b.start_s, b.end_s) == pytest.approx((13e-3, 15e-3))


def test_link_escalated_running_transfer_is_not_paused():
    lk = Link(chunk=4 * MB)
    a = lk.submit(1, 10 * MB, 0.0)
    lk.escalate(1, 2e-3)  # an access waits for it now: it is on-demand
    od = lk.submit(2, 2 * MB, OV + 5e-3, prio=ON_DEMAND)
    lk.finish()
    assert a.escalated and a.preemptions == 0
    assert a.end_s == pytest.approx(11e-3)
    assert od.start_s == pytest.approx(11e-3)


def test_link_busy_time_is_sum_of_busy_intervals():
    lk = Link(chunk=4 * MB)
    lk.submit(1, 1 * MB, 0.0)  # 0 .. 2 ms
    lk.submit(2, 3 * MB, 5e-3)  # idle 2 .. 5 ms, then 5 .. 9 ms
    lk.submit(3, 1 * MB, 5e-3)  # 9 .. 11 ms
    lk.submit(4, 1 * MB, 5e-3)
    assert lk.cancel(4)
    lk.finish()
    assert lk.link.busy_s == pytest.approx(2e-3 + 4e-3 + 2e-3)
    assert lk.link.idle()


def test_link_delayed_prefetch_waits_for_its_release_on_an_idle_link():
    lk = Link()
    a = lk.submit(1, 1 * MB, 0.0, release=3e-3)
    assert lk.link.cur_end_s == pytest.approx(3e-3)  # the release is the next event
    lk.link.advance(2e-3)
    assert lk.done == [] and a.start_s != a.start_s  # not started yet
    lk.finish()
    assert (a.start_s, a.end_s) == pytest.approx((3e-3, 5e-3))
    assert lk.link.busy_s == pytest.approx(2e-3)


def test_link_released_prefetch_does_not_jump_a_busy_link_and_others_pass_it():
    lk = Link()
    a = lk.submit(1, 2 * MB, 0.0)  # 0 .. 3 ms
    b = lk.submit(2, 1 * MB, 0.0, prio=0.1, release=4e-3)  # most urgent, but held back
    c = lk.submit(3, 1 * MB, 0.0, prio=0.9)  # least urgent
    d = lk.submit(4, 1 * MB, 0.0, prio=0.5)  # free to go at 3 ms: passes the held-back b
    lk.finish()
    assert lk.done == [1, 4, 2, 3]
    assert (a.end_s, d.start_s) == pytest.approx((3e-3, 3e-3))
    # at 5 ms d ends; b (released at 4 ms, priority 0.1) goes before c (0.9)
    assert (b.start_s, c.start_s) == pytest.approx((5e-3, 7e-3))


def test_link_escalated_delayed_prefetch_starts_at_once():
    lk = Link()
    a = lk.submit(1, 1 * MB, 0.0, release=10e-3)
    lk.link.advance(1e-3)
    lk.escalate(1, 1e-3)
    lk.finish()
    assert a.escalated and (a.start_s, a.end_s) == pytest.approx((1e-3, 3e-3))


def test_link_cancel_and_reprioritize_a_delayed_prefetch():
    lk = Link()
    a = lk.submit(1, 1 * MB, 0.0, prio=0.9, release=2e-3)
    b = lk.submit(2, 1 * MB, 0.0, prio=0.5, release=2e-3)
    c = lk.submit(3, 1 * MB, 0.0, prio=0.1, release=1e-3)
    assert lk.cancel(3)
    lk.reprioritize(1, 0.1)  # still held back until 2 ms, then ahead of b
    lk.link.advance(1.5e-3)
    assert a.start_s != a.start_s and c.start_s != c.start_s
    lk.finish()
    assert lk.done == [1, 2]
    assert (a.start_s, b.start_s) == pytest.approx((2e-3, 4e-3))
    assert lk.link.idle() and lk.link.cur_end_s == float("inf")


@pytest.mark.parametrize("lanes", [False, True])
def test_an_idle_link_s_next_event_skips_a_cancelled_release(lanes: bool) -> None:
    """An idle link holding two delayed prefetches (released at 1 and 2 ms): cancelling
    the first makes the second's release its next event, cancelling both leaves none, so
    the backend sees the link idle at once.  Red if a cancelled release stays the next
    event (the link looks busy, and demand-only layer steps leave their closed form,
    until the link passes it)."""
    lk = Link()
    if lanes:
        lk.link = sim_engine.LaneLink(BW, OV, 2, 2, lk.done.append)
    lk.submit(1, 1 * MB, 0.0, release=1e-3)
    lk.submit(2, 1 * MB, 0.0, release=2e-3)
    assert lk.link.cur is None and lk.link.cur_end_s == pytest.approx(1e-3)
    assert lk.cancel(1) and lk.link.cur_end_s == pytest.approx(2e-3)
    assert lk.cancel(2) and lk.link.cur_end_s == float("inf")
    lk.finish()
    assert lk.done == []


# -- the first-come-first-served link (engine.link_order=fifo) -------------------------------
def test_fifo_link_runs_every_transfer_in_arrival_order_and_never_pauses():
    # the priority link: the on-demand load pauses the prefetch at its 4 MB boundary
    # (5 ms), runs, and the queued prefetches follow by priority (3 before 2)
    lk = Link(chunk=4 * MB)
    lk.submit(1, 10 * MB, 0.0, prio=5.0)
    lk.submit(2, 1 * MB, 1e-3, prio=5.0)
    lk.submit(3, 1 * MB, 1e-3, prio=0.5)
    od = lk.submit(4, 1 * MB, 2e-3, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [4, 3, 1, 2] and od.start_s == pytest.approx(5e-3)
    # first come, first served: 1 runs whole (0..11 ms), then 2, 3 and the load, 2 ms each
    lk = Link(chunk=4 * MB, fifo=True)
    a = lk.submit(1, 10 * MB, 0.0, prio=5.0)
    lk.submit(2, 1 * MB, 1e-3, prio=5.0)
    lk.submit(3, 1 * MB, 1e-3, prio=0.5)
    od = lk.submit(4, 1 * MB, 2e-3, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [1, 2, 3, 4] and a.preemptions == 0
    assert (a.end_s, od.start_s, od.end_s) == pytest.approx((11e-3, 15e-3, 17e-3))
    assert lk.link.busy_s == pytest.approx(17e-3)


def test_fifo_link_escalation_and_reranking_change_no_order():
    lk = Link(chunk=1 * MB, fifo=True)
    lk.submit(1, 4 * MB, 0.0)  # running 0 .. 5 ms
    b = lk.submit(2, 1 * MB, 0.0, prio=0.9)
    c = lk.submit(3, 1 * MB, 0.0, prio=0.8)
    lk.escalate(3, 1e-3)  # needed now: on-demand priority, same place in the queue
    assert c.escalated and not lk.abort(3, 1e-3)  # an escalated transfer is never stopped
    lk.reprioritize(2, 0.95)
    lk.reprioritize(3, 0.1)
    lk.finish()
    assert lk.done == [1, 2, 3]
    assert (b.start_s, c.start_s) == pytest.approx((5e-3, 7e-3))


def test_fifo_link_queues_a_delayed_prefetch_at_its_release():
    # the priority link: b (released at 4 ms, priority 0.1) goes before c (0.9), queued
    # at 0 ms; first come, first served: b reached the queue after c, so it goes last
    lk = Link(fifo=True)
    lk.submit(1, 5 * MB, 0.0)  # 0 .. 6 ms
    b = lk.submit(2, 1 * MB, 0.0, prio=0.1, release=4e-3)
    c = lk.submit(3, 1 * MB, 1e-3, prio=0.9)
    lk.finish()
    assert lk.done == [1, 3, 2]
    assert (c.start_s, b.start_s) == pytest.approx((6e-3, 8e-3))
    # escalated before its release, a delayed prefetch reaches the queue at that moment
    lk = Link(fifo=True)
    lk.submit(1, 5 * MB, 0.0)
    d = lk.submit(2, 1 * MB, 0.0, release=9e-3)
    e = lk.submit(3, 1 * MB, 2e-3)
    lk.link.advance(3e-3)
    lk.escalate(2, 3e-3)
    lk.finish()
    assert lk.done == [1, 3, 2] and (e.start_s, d.start_s) == pytest.approx((6e-3, 8e-3))
    # escalated at 4 ms, after its release at 2 ms on a busy link: queued once, at 2 ms
    lk = Link(fifo=True)
    lk.submit(1, 5 * MB, 0.0)
    b = lk.submit(2, 1 * MB, 0.0, release=2e-3)
    lk.submit(3, 1 * MB, 1e-3)
    lk.link.advance(4e-3)
    lk.escalate(2, 4e-3)
    assert lk.link._queue.count(b) == 1
    lk.finish()
    assert lk.done == [1, 3, 2] and b.escalated
    # released at 2 ms while the link is busy, a prefetch is ahead of one submitted at 4 ms
    lk = Link(fifo=True)
    lk.submit(1, 5 * MB, 0.0)
    lk.submit(2, 1 * MB, 0.0, release=2e-3)
    lk.submit(3, 1 * MB, 4e-3)
    lk.finish()
    assert lk.done == [1, 2, 3]


def test_fifo_link_order_is_refused_where_no_timed_link_runs():
    from fmoesim.engine.simulate import check_link_order

    check_link_order("fifo", timing=True)
    with pytest.raises(ConfigError, match="engine.link_order.*must be one of priority, fifo"):
        check_link_order("lifo", timing=True)
    with pytest.raises(ConfigError, match="needs the timed simulator"):
        check_link_order("fifo", timing=False)
    with pytest.raises(ConfigError, match="the replay keeps its scheduler's order"):
        check_link_order("fifo", timing=True, replay=True)


def _queued_in_order(lk: Link) -> list[TransferRecord]:
    """Brute force: the link's queued jobs, the next to start last (``_queue``'s order)."""
    queued = [j for j in lk.live() if j.state == sim_engine._QUEUED]
    return sorted(queued, key=lambda j: (j.link_priority, j.seq), reverse=True)


def _queue_as_read(link: SimLink) -> list[TransferRecord]:
    """The link's queue in the order its next read sees: as kept, or, after re-rankings
    (``_dirty``), as sorted when next read."""
    if not link._dirty:
        return list(link._queue)
    return sorted(link._queue, key=lambda j: (j.link_priority, j.seq), reverse=True)


#: requests to a link: (kind, key, arg), see :func:`_request`
LINK_OPS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 15), st.integers(0, 5)), min_size=50, max_size=300
)


def _request(lk: Link, kind: int, key: int, arg: int, t: float) -> None:
    """At ``t``: submit a prefetch of priority ``arg`` (kind 0) / submit on demand (1) /
    cancel (2) / reprioritize to ``arg`` (3) / escalate (4) / abort (5), 2 MB each, one
    transfer per key at a time."""
    lk.link.advance(t)
    if kind <= 1 and all(r.key != key for r in lk.live()):
        lk.submit(key, 2 * MB, t, prio=float(arg) if kind == 0 else ON_DEMAND)
    elif kind == 2:
        lk.cancel(key)
    elif kind == 3:
        lk.reprioritize(key, float(arg))
    elif kind == 4:
        lk.escalate(key, t)
    elif kind == 5:
        lk.abort(key, t)


@settings(max_examples=100, deadline=None)
@given(LINK_OPS)
def test_link_queue_is_its_queued_jobs_by_priority(ops: list[tuple[int, int, int]]) -> None:
    """After every request, the queue holds exactly the queued jobs (no cancelled or
    re-prioritised leftovers), ordered by (priority, submission): ops (kind, key, arg)
    = submit a prefetch of priority ``arg`` / submit on demand / cancel / reprioritize
    to ``arg`` / escalate / abort, each 0.5 ms after the last, on a preempting 2-chunk
    link."""
    lk = Link(chunk=1 * MB)
    t = 0.0
    for kind, key, arg in ops:
        t += 0.5e-3
        _request(lk, kind, key, arg, t)
        assert _queue_as_read(lk.link) == _queued_in_order(lk)
    lk.finish()
    assert not lk.link._queue and not lk.live()


@settings(max_examples=100, deadline=None)
@given(LINK_OPS)
def test_a_lazily_sorted_queue_runs_as_one_kept_in_order(ops: list[tuple[int, int, int]]) -> None:
    """The same requests (as in the test above, with several re-rankings between two
    link events) reach two links; one puts its queue back in order after every request,
    the other only when the queue is next read: both start, pause and finish the same
    transfers at the same times.  Red if a read of a re-ranked queue (the next job to
    start, an insertion, a removal) skipped the sort."""
    lazy, eager = Link(chunk=1 * MB), Link(chunk=1 * MB)
    t = 0.0
    for i, (kind, key, arg) in enumerate(ops):
        if i % 4 == 0:  # re-rankings and submissions in bursts, as a policy's gate sends them
            t += 0.5e-3
        for lk in (lazy, eager):
            _request(lk, kind, key, arg, t)
        if eager.link._dirty:
            eager.link._sort()
    for lk in (lazy, eager):
        lk.finish()
    assert lazy.done == eager.done
    times = [
        [(r.key, r.start_s, r.end_s, r.state) for r in lk.records.values()] for lk in (lazy, eager)
    ]
    # NaN-aware: a never-started record's times are NaN, equal here only by identity in
    # the pure build (the compiled one boxes each float anew)
    np.testing.assert_equal(times[0], times[1])


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 15), st.integers(0, 5)),
                min_size=50, max_size=300))  # fmt: skip
def test_fifo_link_starts_every_transfer_in_arrival_order(ops: list[tuple[int, int, int]]) -> None:
    """The first-come-first-served link under the requests above plus delayed prefetches
    (kind 6, released ``arg`` ms later): after every request its queue holds each queued
    job once, in arrival order; transfers start in arrival order and none pauses.  Red if
    a released or escalated job is queued twice, or its place follows its priority."""
    lk = Link(chunk=1 * MB, fifo=True)
    submitted: list[TransferRecord] = []
    t = 0.0
    for kind, key, arg in ops:
        t += 0.5e-3
        if kind in (0, 1, 6):
            lk.link.advance(t)
            if all(r.key != key for r in lk.live()):
                prio = ON_DEMAND if kind == 1 else float(arg)
                release = t + arg * 1e-3 if kind == 6 else None
                submitted.append(lk.submit(key, 2 * MB, t, prio=prio, release=release))
        else:
            _request(lk, kind, key, arg, t)
        queue = lk.link._queue
        if lk.link._dirty:
            queue = sorted(queue, key=lambda j: j.seq, reverse=True)
        queued = [j for j in lk.live() if j.state == sim_engine._QUEUED]
        assert [j.seq for j in queue] == sorted((j.seq for j in queued), reverse=True)
        assert len({id(j) for j in queue}) == len(queue)
    lk.finish()
    started = sorted((r for r in submitted if r.start_s == r.start_s), key=lambda r: r.start_s)
    assert [r.seq for r in started] == sorted(r.seq for r in started)
    assert all(r.preemptions == 0 for r in submitted)


def test_cancelled_prefetches_leave_the_queue() -> None:
    """A link busy with one long transfer while 1,000 prefetches are queued and
    cancelled: none stays queued, and only the long transfer runs."""
    lk = Link()
    lk.submit(10_000, 1000 * MB, 0.0)  # busy for a second
    for k in range(1000):
        lk.submit(k, 1 * MB, 1e-6 * k)
        assert lk.cancel(k)
    assert lk.link._queue == [] and [r.key for r in lk.live()] == [10_000]
    lk.finish()
    assert lk.done == [10_000]


def _batch(keys: list[int], prios: list[float], form: str) -> Any:
    """``keys`` and ``priorities`` as a :class:`PrefetchBatch` of lists or of arrays, or
    as :class:`Prefetch` objects (``form``)."""
    if form == "lists":
        return PrefetchBatch(keys, prios)
    if form == "arrays":
        return PrefetchBatch(np.array(keys), np.array(prios))
    return [Prefetch(k, p) for k, p in zip(keys, prios, strict=True)]


def test_a_batch_of_arrays_reads_as_python_numbers():
    """Iterating, indexing and slicing a :class:`PrefetchBatch` of arrays gives the
    Prefetch objects a batch of lists gives, of Python ints and floats.  Red if numpy
    scalars leak out (a compiled Prefetch refuses them, and the engine's dicts and logs
    would hold numpy ints)."""
    for batch in (
        PrefetchBatch(np.array([3, 5]), np.array([0.5, 0.25])),
        _batch([3, 5], [0.5, 0.25], "lists"),
    ):
        for got in (list(batch), [batch[0], batch[1]], batch[0:2], list(reversed(batch))[::-1]):
            assert [(x.key, x.priority) for x in got] == [(3, 0.5), (5, 0.25)]
            assert {(type(x.key), type(x.priority)) for x in got} == {(int, float)}


class _Rerank(LRU):
    """LRU that prefetches keys 9, 10, 11 at step 0 (priorities 0.1 < 0.2 < 0.3, so 9
    first) and gives 10 and 11 new priorities (0.5 and 0.05) at step 1, with key 0,
    resident by then, ahead of them, in the form ``batch`` (:func:`_batch`)."""

    name = "rerank"

    def __init__(self, batch: str, rerank: bool) -> None:
        super().__init__()
        self.batch, self.rerank = batch, rerank

    def on_gate(self, layer, gate):
        if gate.step == 0:
            keys, prios = [9, 10, 11], [0.1, 0.2, 0.3]
        elif gate.step == 1 and self.rerank:
            keys, prios = [0, 10, 11], [0.9, 0.5, 0.05]
        else:
            return NO_ACTIONS
        return Actions(prefetch=_batch(keys, prios, self.batch))


@pytest.mark.parametrize("batch", ["lists", "arrays", "objects"])
@pytest.mark.parametrize("rerank", [True, False])
def test_a_queued_prefetch_takes_its_new_priority_at_the_next_gate(tmp_path, batch, rerank):
    """Three prefetches queue on a link 100x slower than a layer's compute: 9 starts, 10
    and 11 wait.  Re-ranked at the next gate (11 before 10; resident key 0 first), they
    start in the new order on each of the runner's paths (a batch of lists or of arrays,
    Prefetch objects); without it, in the old one.  Red if the runner's re-ranking is
    dropped or goes to the wrong transfer on any path, or if the arrays' pass over the
    resident keys drops the others (the queue order stays 10, 11)."""
    model = small_model(4, 4, 1)
    hw = replace(TINY_HW, pcie_gbps=0.1)  # 60 ms a 6 MB expert
    tr = write_trace(tmp_path / "t", model, [Req(0, 1, [[[0], [0], [0], [0]]])])
    r = simulate(tr, model, hw, _Rerank(batch, rerank), 16 * SIZE)
    starts = {t.key: t.start_s for t in r.transfers if t.reason == "prefetch"}
    assert set(starts) == {9, 10, 11}
    assert starts[9] < min(starts[10], starts[11])
    assert (starts[11] < starts[10]) == rerank


class _EvictsALaterKey(LRU):
    """LRU that, at step 1, asks for key 9 (absent) and then key 0 (resident) in one
    batch, in the form ``batch`` (:func:`_batch`)."""

    name = "evicts-a-later-key"

    def __init__(self, batch: str) -> None:
        super().__init__()
        self.batch = batch

    def on_gate(self, layer, gate):
        if gate.step != 1:
            return NO_ACTIONS
        return Actions(prefetch=_batch([9, 0], [0.1, 0.2], self.batch))


@pytest.mark.parametrize("batch", ["lists", "arrays", "objects"])
def test_a_batch_key_evicted_by_an_earlier_load_is_loaded_at_its_turn(tmp_path, batch):
    """Room for two experts: at layer 1's gate key 0 is resident and key 4 on its way;
    loading key 9 evicts key 0 (the least recent), so key 0 comes up absent at its turn
    and is asked for again, and dropped, as nothing else can leave.  The same on every
    path.  Red if a batch of arrays passes over key 0 because it was resident when the
    batch arrived (no drop)."""
    model = small_model(4, 4, 1)
    tr = write_trace(tmp_path / "t", model, [Req(0, 1, [[[0], [0], [0], [0]]])])
    r = simulate(tr, model, TINY_HW, _EvictsALaterKey(batch), 2 * SIZE)
    assert [(t.key, t.reason) for t in r.transfers][:3] == [
        (0, "on_demand"),
        (4, "on_demand"),
        (9, "prefetch"),
    ]
    assert r.summary["prefetch_dropped"] == 1


def test_a_backend_without_records_of_its_own_reranks_by_key():
    """A backend that moves transfers by key (the replay's) gets a re-ranking of a cache
    entry's record as :meth:`Backend.reprioritize` of that record's key, directly or
    through :meth:`Backend.reprioritizer` (the runner's batch path); an entry with no
    record (None) moves nothing.  Red if the default drops re-rankings (the replay's
    queue would keep every prefetch at its first priority) or passes the wrong key or
    GPU."""
    moved: list[tuple[int, int, float]] = []

    class ByKey(sim_engine.InstantBackend):
        def reprioritize(self, gpu: int, key: int, priority: float) -> None:
            moved.append((gpu, key, priority))

    be = ByKey([])
    be.reprioritize_record(1, TransferRecord(7, 1, SIZE, "prefetch", 0.3, 0.0), 0.05)
    be.reprioritize_record(0, None, 0.5)
    be.reprioritizer(2)(TransferRecord(9, 2, SIZE, "prefetch", 0.3, 0.0), 0.7)
    assert moved == [(1, 7, 0.05), (2, 9, 0.7)]


# -- 3. a prefetch for the next layer overlaps compute -------------------------------------
@pytest.mark.parametrize("factor", [0.5, 0.9, 1.5, 3.0])
def test_prefetch_for_next_layer_overlaps_compute(tmp_path, factor):
    """Layer 0 of iteration 1 hits and prefetches layer 1's expert 1 (key 5).

    Between the prefetch's issue (after layer 0's router) and its use (after layer 1's
    router) the GPU computes layer 0's expert and layer 1's attention + router: ``gap``.
    A transfer of ``factor * gap`` is a HIT with no stall if shorter, else LATE with a
    stall of exactly ``t_x - gap``.
    """
    p = 1
    gap = C.expert_s(1) + pre_gate_s(C, [(p, 1)])
    ov = 1e-5
    t_x = factor * gap
    hw = replace(TINY_HW, transfer_overhead_s=ov, pcie_gbps=SIZE / (t_x - ov) / 1e9)
    assert transfer_s(hw, TINY) == pytest.approx(t_x, rel=1e-12)
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [[[0], [0]], [[0], [1]]])])
    key = 1 * TINY.num_experts + 1
    r = simulate(tr, TINY, hw, ScheduledPrefetch({2: [key]}), 4 * SIZE, access_log=True)
    s = r.summary
    late = factor > 1
    # iteration 0: two cold misses; iteration 1: layer 0 hits, layer 1 finds the prefetch
    assert (s["hits"], s["late"], s["misses"]) == (1 + (not late), int(late), 2)
    assert r.accesses["outcome"][-1] == (Outcome.LATE if late else Outcome.HIT)
    extra = max(0.0, t_x - gap)
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [t_x, t_x + extra], rtol=1e-9)
    pf = next(t for t in r.transfers if t.reason == "prefetch")
    assert pf.key == key and pf.used and pf.escalated == late
    assert pf.end_s - pf.start_s == pytest.approx(t_x, rel=1e-9)
    compute = prefill_compute_s(C, p) + decode_compute_s(C, p, 1)
    assert s["simulated_s"] == pytest.approx(compute + 2 * t_x + extra, rel=1e-12)


class _SyncPrefetch(ScheduledPrefetch):
    """:class:`ScheduledPrefetch` whose prefetching is synchronous."""

    def waits_for_prefetches(self) -> bool:
        return True


@pytest.mark.parametrize("factor", [0.5, 1.5])
def test_synchronous_prefetch_blocks_the_layer_until_it_lands(tmp_path, factor):
    """The setting of test_prefetch_for_next_layer_overlaps_compute, prefetching
    synchronously (:meth:`Policy.waits_for_prefetches`): layer 0 computes its hit only
    after the prefetch of layer 1's expert has landed, so the whole transfer ``t_x`` is
    layer 0's stall, whatever its length against the compute that would have hidden it,
    and layer 1 finds the expert resident (HIT, no stall).  Red when the wait is skipped
    (stall ``max(0, t_x - gap)`` at layer 1, LATE when ``t_x > gap``) or taken after the
    layer's compute (a stall of ``t_x - expert_s``)."""
    p = 1
    gap = C.expert_s(1) + pre_gate_s(C, [(p, 1)])
    ov = 1e-5
    t_x = factor * gap
    hw = replace(TINY_HW, transfer_overhead_s=ov, pcie_gbps=SIZE / (t_x - ov) / 1e9)
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [[[0], [0]], [[0], [1]]])])
    key = 1 * TINY.num_experts + 1
    r = simulate(tr, TINY, hw, _SyncPrefetch({2: [key]}), 4 * SIZE, access_log=True)
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == (2, 0, 2)
    assert r.accesses["outcome"][-1] == Outcome.HIT
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [2 * t_x, t_x], rtol=1e-9)
    compute = prefill_compute_s(C, p) + decode_compute_s(C, p, 1)
    assert s["simulated_s"] == pytest.approx(compute + 3 * t_x, rel=1e-12)
    pf = next(t for t in r.transfers if t.reason == "prefetch")
    assert pf.used and not pf.escalated


# -- 4. ready-first: the hit computes while the miss loads ---------------------------------
@pytest.mark.parametrize(
    "hw",
    [TINY_HW, replace(TINY_HW, pcie_gbps=1000.0, transfer_overhead_s=0.0)],
    ids=["slow-link", "fast-link"],
)
def test_ready_expert_computes_while_missing_one_loads(tmp_path, hw):
    p = 2
    c = ComputeModel.from_specs(TINY2, hw)
    t_x = transfer_s(hw, TINY2)
    # iteration 0 loads {0,1} in both layers; iteration 1 layer 0 needs {0 (HIT), 2 (MISS)}
    routes = [[[0, 1], [0, 1]], [[0, 2], [0, 1]]]
    tr = write_trace(tmp_path / "t", TINY2, [Req(0, p, routes)])
    r = simulate(tr, TINY2, hw, LRU(), 8 * SIZE)
    s = r.summary
    assert (s["hits"], s["misses"]) == (3, 5)
    # cold prefill layer: two loads back to back on one link; the first to land computes
    # (p tokens) while the second is still moving
    cold = t_x + max(0.0, t_x - c.expert_s(p))
    warm = max(0.0, t_x - c.expert_s(1))  # the hit's compute hides part of the load
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [cold + warm, cold], rtol=1e-9)
    compute = (
        L * (pre_gate_s(c, [(p, 0)]) + 2 * c.expert_s(p))
        + L * (pre_gate_s(c, [(p, 1)]) + 2 * c.expert_s(1))
        + 2 * c.lm_head_s(1)
    )
    assert s["simulated_s"] == pytest.approx(compute + 2 * cold + warm, rel=1e-12)


# -- 7. expert parallelism ----------------------------------------------------------------
def test_expert_parallel_gpus_have_own_link_and_cache(tmp_path):
    p = 1
    hw2 = replace(TINY_HW, num_gpus=2)
    e = C.expert_s(p)
    assert T_X > e
    # prefill only: layer 0 needs experts {0, 1} (GPUs 0, 1); layer 1 needs {0, 2} (GPU 0)
    tr = write_trace(tmp_path / "t", TINY2, [Req(0, p, [[[0, 1], [0, 2]]])])
    budget = 2 * SIZE
    r = simulate(tr, TINY2, hw2, LRU(), budget, access_log=True)
    # layer 0: one load per link, in parallel; layer 1: two loads on GPU 0's link, the
    # first computes while the second moves
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X, T_X + (T_X - e)], rtol=1e-9)
    pre = pre_gate_s(C, [(p, 0)])
    expected = (pre + T_X + e) + (pre + 2 * T_X + e) + C.lm_head_s(1)
    assert r.summary["simulated_s"] == pytest.approx(expected, rel=1e-12)
    assert [(t.key, t.gpu) for t in r.transfers] == [(0, 0), (1, 1), (4, 0), (6, 0)]
    for t in r.transfers:
        assert t.end_s - t.start_s == pytest.approx(T_X, rel=1e-9)
    assert r.transfers[0].start_s == r.transfers[1].start_s  # two links, same instant
    np.testing.assert_array_equal(r.accesses["expert"], [0, 1, 0, 2])
    np.testing.assert_array_equal(r.accesses["gpu"], [0, 1, 0, 0])
    assert len(r.caches) == 2
    assert [c.budget_bytes for c in r.caches] == [budget, budget]
    assert [c.gpu for c in r.caches] == [0, 1]
    # GPU 0 holds 2 experts of budget: loading key 6 evicted key 0; GPU 1 has only key 1
    assert set(r.caches[0].entries) == {4, 6} and r.caches[0].evictions == 1
    assert set(r.caches[1].entries) == {1} and r.caches[1].evictions == 0
    assert r.summary["peak_expert_bytes"] == budget

    # the same run on one GPU: every load shares the link
    r1 = simulate(tr, TINY2, TINY_HW, LRU(), 4 * SIZE)
    np.testing.assert_allclose(r1.metrics.stall_per_layer_s, [2 * T_X - e, 2 * T_X - e], rtol=1e-9)


# -- 8. shared experts: resident, outside the budget, compute every layer ------------------
def test_shared_experts_cost_compute_not_budget(tmp_path):
    p, n = 2, 5
    shared = replace(TINY, num_shared_experts=1, shared_expert_intermediate_size=500)
    cs = ComputeModel.from_specs(shared, TINY_HW)
    assert cs.shared_s(1) > 0
    # the prefill's two on-demand loads are longer than the shared experts they overlap
    assert cs.shared_s(p) < T_X
    tr = write_trace(tmp_path / "t", TINY, [Req(0, p, [[[0], [3]]] * n)])
    base = simulate(tr, TINY, TINY_HW, LRU(), 4 * SIZE)
    sh = simulate(tr, shared, TINY_HW, LRU(), 4 * SIZE)
    assert sh.summary["peak_expert_bytes"] == base.summary["peak_expert_bytes"] == 2 * SIZE
    assert sh.summary["pcie_bytes"] == base.summary["pcie_bytes"] == 2 * SIZE
    rb, rs = base.metrics.request_table(), sh.metrics.request_table()
    # batch-1 decode (all hits): every layer of every decode iteration adds shared_s(1)
    decode_b = rb["e2e_s"][0] - rb["ttft_s"][0]
    decode_s = rs["e2e_s"][0] - rs["ttft_s"][0]
    assert decode_s - decode_b == pytest.approx(L * (n - 1) * cs.shared_s(1), rel=1e-9)
    # prefill: the shared experts run while the missing expert loads
    assert rs["ttft_s"][0] == pytest.approx(rb["ttft_s"][0], rel=1e-12)
    assert sh.summary["stall_s"] == pytest.approx(
        base.summary["stall_s"] - L * cs.shared_s(p), rel=1e-9
    )
    assert sh.summary["simulated_s"] - base.summary["simulated_s"] == pytest.approx(
        L * (n - 1) * cs.shared_s(1), rel=1e-9
    )
    assert sh.summary["gpu_busy_s"] - base.summary["gpu_busy_s"] == pytest.approx(
        L * (cs.shared_s(p) + (n - 1) * cs.shared_s(1)), rel=1e-9
    )


# -- 9. transfer log and access log --------------------------------------------------------


@pytest.mark.parametrize("chunk_bytes", [TINY_HW.chunk_bytes, 1_000_000])
def test_transfer_and_access_logs(tmp_path, chunk_bytes):
    """Step 0 prefetches key 6 (layer 1, expert 2), which is never accessed.

    A gate's prefetches are issued after the layer's on-demand loads, so at ``t0`` (after
    layer 0's router) the load of key 0 starts on the idle link, ``[t0, t0 + t_x]``, and
    the prefetch follows, ``t0 + t_x`` on.  Layer 1's router is done ``g`` (one expert +
    one attention and router) after that, and its miss of key 7 is submitted while the
    prefetch is in its fixed cost (``g < overhead``).  With a whole-expert chunk it waits
    for the prefetch: ``[t0 + 2 t_x, t0 + 3 t_x]``, stall ``2 t_x - g``.  With 1 MB chunks
    the prefetch pauses at the end of its fixed cost (no byte moved yet) and the load
    runs ``[t0 + t_x + overhead, t0 + 2 t_x + overhead]``, stall ``t_x + overhead - g``;
    the prefetch then moves its 6 MB without a second fixed cost and ends at
    ``t0 + 3 t_x``.  Either way the link never idles from ``t0`` on: busy ``3 t_x``.
    """
    hw = replace(TINY_HW, chunk_bytes=chunk_bytes)
    ov = hw.transfer_overhead_s
    gap = C.expert_s(1) + pre_gate_s(C, [(1, 0)])
    assert gap < ov
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [3]]] * 3)])
    r = simulate(tr, TINY, hw, ScheduledPrefetch({0: [6]}), 4 * SIZE, access_log=True)
    s = r.summary
    table = r.transfer_table()
    assert set(table) == TRANSFER_COLUMNS
    assert all(len(v) == len(r.transfers) == 3 for v in table.values())
    np.testing.assert_array_equal(table["key"], [0, 6, 7])
    np.testing.assert_array_equal(table["reason"], ["on_demand", "prefetch", "on_demand"])
    np.testing.assert_array_equal(table["used"], [True, False, True])
    np.testing.assert_array_equal(table["size_bytes"], [SIZE] * 3)
    np.testing.assert_array_equal(table["gpu"], [0, 0, 0])
    np.testing.assert_array_equal(table["cancelled"], [False] * 3)
    assert (table["start_s"] <= table["end_s"]).all()
    assert (table["submit_s"] <= table["start_s"]).all()
    od0, pf, od7 = r.transfers
    assert pf.priority == 1.0 and od0.priority == od7.priority == ON_DEMAND
    t0 = od0.submit_s
    assert pf.submit_s == t0
    assert (od0.start_s, od0.end_s) == pytest.approx((t0, t0 + T_X))
    assert pf.start_s == pytest.approx(t0 + T_X)
    assert od7.submit_s == pytest.approx(t0 + T_X + gap)
    preempt = chunk_bytes < SIZE
    if preempt:
        assert pf.preemptions == 1
        assert od7.start_s == pytest.approx(t0 + T_X + ov)
        assert pf.end_s == pytest.approx(t0 + 3 * T_X)
        stall1 = T_X + ov - gap
    else:
        assert pf.preemptions == 0
        assert pf.end_s == pytest.approx(t0 + 2 * T_X)
        assert od7.start_s == pytest.approx(t0 + 2 * T_X)
        stall1 = 2 * T_X - gap
    for t in (od0, od7):  # never preempted: fixed cost + size / bandwidth
        assert t.end_s - t.start_s == pytest.approx(T_X, rel=1e-9)
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X, stall1], rtol=1e-9)
    assert s["unused_prefetch_bytes"] == SIZE and s["prefetch_bytes"] == SIZE
    assert s["on_demand_bytes"] == 2 * SIZE
    assert s["preemptions"] == int(preempt)
    assert s["link_busy_s"] == pytest.approx(3 * T_X, rel=1e-9)
    log = r.accesses
    assert set(log) == {"step", "iteration", "layer", "expert", "gpu", "outcome", "time_s"}
    counts = np.bincount(log["outcome"], minlength=3)
    assert tuple(counts) == (s["hits"], s["late"], s["misses"]) == (4, 0, 2)
    np.testing.assert_array_equal(log["outcome"], [Outcome.MISS] * 2 + [Outcome.HIT] * 4)
    np.testing.assert_array_equal(log["step"], np.arange(6))
    np.testing.assert_array_equal(log["layer"], [0, 1] * 3)
    np.testing.assert_array_equal(log["expert"], [0, 3] * 3)
    np.testing.assert_array_equal(log["iteration"], [0, 0, 1, 1, 2, 2])
    assert log["time_s"][0] == pytest.approx(t0) and log["time_s"][1] == pytest.approx(od7.submit_s)


# -- an on-demand load finds the budget held by prefetches in flight -----------------------
#: Two GPUs: GPU 0 holds experts 0 and 2 of each layer, GPU 1 experts 1 and 3.
HW2 = replace(TINY_HW, num_gpus=2)
#: Decode iteration 1 of a 1-token prompt: layer 0's expert (a HIT) and layer 1's
#: attention + router run between a prefetch issued at layer 0's gate and layer 1's gate.
GAP1 = C.expert_s(1) + pre_gate_s(C, [(1, 1)])


def test_on_demand_waits_for_a_running_prefetch_holding_the_budget(tmp_path):
    """One expert of budget per GPU; iteration 1's layer 0 hits key 0 (GPU 0) and its
    gate prefetches key 7 (layer 1, expert 3: GPU 1) at ``T0``, evicting key 5.

    Layer 1 then needs key 5: GPU 1's budget is held by the in-flight prefetch, which
    has started and cannot be cancelled, so the load waits for it to land
    (``T0 + t_x``), evicts it unused and loads: stall ``2 t_x - GAP1``.
    """
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [1]], [[0], [1]]])])
    r = simulate(tr, TINY, HW2, ScheduledPrefetch({2: [7]}), SIZE, access_log=True)
    s = r.summary
    assert [(t.key, t.gpu, t.reason, t.used) for t in r.transfers] == [
        (0, 0, "on_demand", True),
        (5, 1, "on_demand", True),
        (7, 1, "prefetch", False),
        (5, 1, "on_demand", True),
    ]
    pf, od = r.transfers[2], r.transfers[3]
    assert (pf.start_s, pf.end_s) == pytest.approx((pf.submit_s, pf.submit_s + T_X))
    assert od.submit_s == pytest.approx(pf.end_s) and od.start_s == pytest.approx(pf.end_s)
    np.testing.assert_array_equal(
        r.accesses["outcome"], [Outcome.MISS, Outcome.MISS, Outcome.HIT, Outcome.MISS]
    )
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X, T_X + 2 * T_X - GAP1], rtol=1e-9)
    assert s["wasted_bytes"] == SIZE and s["cancelled_transfers"] == 0
    assert s["peak_expert_bytes"] == SIZE


def test_on_demand_cancels_only_as_many_queued_prefetches_as_it_needs(tmp_path):
    """Three experts of budget per GPU; iteration 0 puts keys 0 and 4 on GPU 0.

    Iteration 1's layer 0 hits key 0 and its gate prefetches keys 5, 1, 3 (all GPU 1)
    with priorities 1, 2, 3 at ``T0``: key 5 starts at once, 1 and 3 are queued and
    never started, and GPU 1's budget is full.  Layer 1 misses key 7 (GPU 1): cancelling
    the least urgent queued prefetch (key 3) frees the room it needs, so key 1 must stay
    queued.  The load runs after the running key 5 (a whole-expert chunk cannot pause),
    ``[T0 + t_x, T0 + 2 t_x]``: stall ``2 t_x - GAP1``; key 1 follows and lands at
    ``T0 + 3 t_x``.
    """
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [0]], [[0], [3]]])])
    pol = ScheduledPrefetch({2: [(5, 1.0), (1, 2.0), (3, 3.0)]})
    r = simulate(tr, TINY, HW2, pol, 3 * SIZE)
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == (1, 0, 3)
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X, T_X + 2 * T_X - GAP1], rtol=1e-9)
    by_key = {t.key: t for t in r.transfers if t.reason == "prefetch"}
    assert all(t.gpu == 1 for t in by_key.values())
    t_0 = by_key[5].submit_s
    assert by_key[3].cancelled  # the least urgent
    assert not by_key[5].cancelled and by_key[5].end_s == pytest.approx(t_0 + T_X)
    assert not by_key[1].cancelled, "cancelled a queued prefetch that was not in the way"
    assert by_key[1].end_s == pytest.approx(t_0 + 3 * T_X)
    assert s["cancelled_transfers"] == 1


@pytest.mark.parametrize(
    ("schedule", "cancelled", "kept"),
    [
        # equal priorities: the later submission is the one the link would serve last
        ({2: [(5, 1.0), (3, 3.0), (1, 3.0)]}, 1, 3),
        # key 1 re-ranked at layer 1's gate (step 3) to 4.0, below key 3's 3.0 in the queue
        ({2: [(5, 1.0), (1, 2.0), (3, 3.0)], 3: [(1, 4.0)]}, 1, 3),
    ],
)
def test_on_demand_cancels_the_prefetch_the_link_would_serve_last(
    tmp_path, schedule, cancelled, kept
):
    """As above (three experts of budget per GPU, keys 5, 1, 3 prefetched to GPU 1 at
    ``T0``, layer 1 missing key 7): the queued prefetch cancelled for room is the one
    the link would start last, by its current queue priority and then the latest
    submission, and the other still lands at ``T0 + 3 t_x``.  Red if the ranking reads
    the priority a prefetch was submitted with (a re-ranking ignored) or breaks a tie
    for the earliest submission."""
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [0]], [[0], [3]]])])
    r = simulate(tr, TINY, HW2, ScheduledPrefetch(schedule), 3 * SIZE)
    first = {}
    for t in r.transfers:
        if t.reason == "prefetch":
            first.setdefault(t.key, t)
    t_0 = first[5].submit_s
    assert [k for k, t in first.items() if t.cancelled] == [cancelled]
    assert first[kept].end_s == pytest.approx(t_0 + 3 * T_X)
    np.testing.assert_allclose(r.metrics.stall_per_layer_s, [T_X, T_X + 2 * T_X - GAP1], rtol=1e-9)


@pytest.mark.parametrize("timing", [True, False])
def test_a_load_waiting_for_room_sees_a_prefetch_landed_while_its_gpu_computed(tmp_path, timing):
    """Three experts of budget, one GPU, a static batch of three one-token requests;
    timed, and hit-rate-only with ``landing=link`` (a prefetch takes its time of the
    compute clock, the same here: no stall comes before it).

    Iteration 0 caches keys 0, 2 (layer 0) and 4 (layer 1).  Iteration 1: layer 0 hits
    key 0 and its gate prefetches key 1 (for a later iteration), held back ``D`` so it
    evicts key 2 and lands half way through layer 1's compute of key 4.  Layer 1 needs
    keys 4 (a hit), 5 and 6: key 5 evicts key 0 and key 6 finds no room (key 4 in use,
    keys 5 and 1 in flight).  Once key 4 has computed, key 1 has landed: LRU evicts it
    (inserted before key 4's use), so key 6 loads and iteration 2's access to key 1 is a
    miss.  Red if the retry looked at the residency the cache knew at the layer's gate
    (key 1 still in flight there): key 4 would be evicted and key 1 be a hit."""
    from fmoesim.engine.serving import ServingConfig

    hw = replace(TINY_HW, pcie_gbps=1000.0, transfer_overhead_s=1e-5)
    c = ComputeModel.from_specs(TINY, hw)
    t_x = transfer_s(hw, TINY)
    gap = c.expert_s(3) + pre_gate_s(c, [(1, 1)] * 3)  # layer 0's gate to layer 1's
    x4 = c.expert_s(1)
    delay = gap + x4 / 2 - t_x  # key 1 lands half way through key 4's compute
    assert 0 < delay < gap

    class PrefetchKey1(LRU):
        def on_gate(self, layer: int, gate: GateView) -> Actions:
            if gate.step == 2:  # iteration 1, layer 0
                return Actions(prefetch=[Prefetch(1)], delay_s=delay)
            return NO_ACTIONS

    routes = [  # (iteration 0, 1, 2) x (layer 0, layer 1) of each request
        [[[0], [0]], [[0], [0]], [[1], [0]]],
        [[[2], [0]], [[0], [1]], [[1], [0]]],
        [[[0], [0]], [[0], [2]], [[1], [0]]],
    ]
    tr = write_trace(tmp_path / "t", TINY, [Req(i, 1, routes[i]) for i in range(3)])
    r = simulate(
        tr, TINY, hw, PrefetchKey1(), 3 * SIZE, access_log=True, timing=timing,
        serving=ServingConfig(mode="static", batch_size=3),
    )  # fmt: skip
    pf = next(t for t in r.transfers if t.reason == "prefetch")
    assert pf.key == 1
    if timing:
        od6 = next(t for t in r.transfers if t.key == 6)
        t_g1 = pf.submit_s + gap
        assert pf.end_s == pytest.approx(t_g1 + x4 / 2)
        assert od6.submit_s == pytest.approx(t_g1 + x4)  # tried again once key 4 computed
    log = r.accesses
    it2 = (log["iteration"] == 2) & (log["layer"] == 0)
    assert list(log["outcome"][it2]) == [Outcome.MISS]  # one access: the batch shares key 1
    assert [t.key for t in r.transfers if t.reason == "on_demand"][-2:] == [1, 4]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["submit", "reprioritize", "escalate", "cancel"]),
            st.integers(0, 40),
            st.sampled_from([0.1, 0.5, 0.5, 0.9, 2.0]),
        ),
        min_size=1,
        max_size=120,
    )
)
def test_the_link_queue_stays_sorted_under_any_requests(ops):
    """The queue holds exactly the queued jobs, ``(link_priority, seq)`` descending (the
    next to start last), whatever mix of submissions, re-rankings, escalations and
    cancellations reaches a busy link: the order the bisection keeps is the one a sort
    gives.  Red if the search key orders priorities or submissions the wrong way, or if
    a re-ranked, escalated or cancelled job is left in the queue or lost from it."""
    lk = Link()
    lk.submit(999, 1000 * MB, 0.0)  # runs for a second: everything else queues behind it
    for op, key, prio in ops:
        if op == "submit" and (key not in lk.records or lk.records[key] not in lk.live()):
            lk.submit(key, MB, 0.0, prio)
        elif op == "reprioritize":
            lk.reprioritize(key, prio)
        elif op == "escalate":
            lk.escalate(key, 0.0)
        elif op == "cancel":
            lk.cancel(key)
        q = lk.link._queue
        queued = [r for r in lk.live() if r.state == sim_engine._QUEUED]
        assert {id(r) for r in q} == {id(r) for r in queued} and len(q) == len(queued)
        if lk.link._dirty:  # re-ranked: sorted when next read
            lk.link._sort()
            q = lk.link._queue
        assert sorted(q, key=lambda r: (r.link_priority, r.seq), reverse=True) == q
        assert lk.link._qkeys == [(-r.link_priority, -r.seq) for r in q]  # the search keys


def test_prefill_throughput_sums_every_prefill_and_no_decode(tmp_path):
    # two static batches of one request: both prefills count, tokens over their seconds;
    # a metric of the last prefill alone, or one that counted decode iterations, differs
    tr = write_trace(
        tmp_path / "t",
        TINY,
        [Req(0, 3, [[[0], [3]]] * 4), Req(1, 5, [[[1], [2]]] * 2)],
    )
    r = simulate(tr, TINY, TINY_HW, LRU(), 2 * SIZE)
    # request 0 misses both layers in its prefill; request 1 misses both in its own (its
    # experts are not cached)
    first = prefill_compute_s(C, 3) + L * T_X
    second = prefill_compute_s(C, 5) + L * T_X
    assert r.summary["prefill_tokens_per_s"] == pytest.approx((3 + 5) / (first + second))
    hit_only = simulate(tr, TINY, TINY_HW, LRU(), 2 * SIZE, timing=False)
    assert np.isnan(hit_only.summary["prefill_tokens_per_s"])


def test_shift_recovery_by_hand():
    # 8 requests at 1.0 before the shift; after it 2, 2, 2, then 1: the windows of 8 from
    # the shift have means 11/8, 10/8, 9/8, then 8/8 <= 1.05 -> 3 requests.  Red on an
    # off-by-one window, another reference than the 8 before, or a NaN TPOT kept in.
    from fmoesim.engine.metrics import RECOVERY_WINDOW, shift_recovery

    assert RECOVERY_WINDOW == 8
    before, after = [1.0] * 8, [2.0, 2.0, 2.0] + [1.0] * 8
    shifted = [False] * 8 + [True] * 11
    assert shift_recovery(before + after, shifted) == 3.0
    # 8.4 / 8 = 1.05 x the reference still counts, 8.5 / 8 does not (and never recovers); a
    # request without TPOT (one output token) drops out
    assert shift_recovery(before + [1.4] + [1.0] * 7, [False] * 8 + [True] * 8) == 0.0
    assert shift_recovery([*before, np.nan, *after], [*shifted[:8], True, *shifted[8:]]) == 3.0
    assert np.isnan(shift_recovery(before + [1.5] + [1.0] * 7, [False] * 8 + [True] * 8))
    assert np.isnan(shift_recovery(before + after, [False] * 19))  # no shift
    assert np.isnan(shift_recovery([1.0] * 7 + after, [False] * 7 + [True] * 11))  # < 8 before
    assert np.isnan(shift_recovery(before + [2.0] * 7, [False] * 8 + [True] * 7))  # < 8 after


def test_shift_recovery_reads_the_runs_dataset_labels(tmp_path):
    # a synthetic trace of TINY's shape with a shift at request 10 of 20, served one at a
    # time: the summary's number is shift_recovery of the per-request TPOTs in serving
    # order, split where the label changes.  Red if the runner does not record the labels
    # (NaN) or orders the requests otherwise.
    from fmoesim.engine.metrics import shift_recovery
    from fmoesim.workload import SyntheticConfig, generate

    cfg = SyntheticConfig(num_requests=20, num_topics=2, shift_at=10, output_tokens_median=4,
                          prompt_tokens_median=4, embedding_dim=0)  # fmt: skip
    tr = read_trace(generate(TINY, cfg, tmp_path / "t"))
    r = simulate(tr, TINY, TINY_HW, LRU(), 2 * SIZE)
    req = r.metrics.request_table()
    assert req["request_id"].tolist() == tr.request_id.tolist()  # static: in trace order
    want = shift_recovery(req["tpot_s"], [d == "synthetic-shifted" for d in tr.dataset])
    assert not np.isnan(want)
    assert r.summary["shift_recovery_requests"] == want
