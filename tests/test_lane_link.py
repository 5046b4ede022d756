"""A link of several lanes with transfers cut into slices (:class:`LaneLink`), by hand.

Every expectation is worked out from the model: ``lanes`` servers at ``bandwidth /
lanes`` each, a transfer cut into ``slices`` jobs of equal size, a free lane taking the
next slice of the first transfer in the queue, a transfer landing with its last slice.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoesim.engine import sim as sim_engine
from fmoesim.engine.backend import ON_DEMAND, TransferRecord
from fmoesim.engine.simulate import simulate
from fmoesim.errors import ConfigError
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.trace import read_trace
from policies.lru import LRU
from tests.tiny import TINY, TINY_HW, write_sequence_trace

MB = 1_000_000
MS = 1e-3
SIZE = TINY.expert_size_bytes  # 6 MB
CYCLE = [[i % 4, (i + 1) % 4] for i in range(6)]  # a key recurs only 8 accesses later


class Lanes:
    """A link driven at explicit times, with the keys it landed, in order."""

    def __init__(self, lanes: int, slices: int, bw: float, ov: float = 0.0, fifo: bool = False):
        self.done: list[int] = []
        self.link = sim_engine.LaneLink(bw, ov, lanes, slices, self.done.append, fifo=fifo)
        self.records: dict[int, TransferRecord] = {}

    def submit(self, key: int, size: int, t: float, prio: float = 1.0) -> TransferRecord:
        rec = TransferRecord(key, 0, size, "prefetch" if prio != ON_DEMAND else "on_demand",
                             prio, t)  # fmt: skip
        self.link.advance(t)
        self.link.submit(rec, t)
        self.records[key] = rec
        return rec

    def at(self, t: float) -> sim_engine.LaneLink:
        self.link.advance(t)
        return self.link

    def finish(self) -> None:
        self.link.advance(float("inf"))


def test_one_transfer_runs_its_slices_side_by_side() -> None:
    """4 lanes of 1 GB/s, 3 slices: 3 MB land after 1 ms (three 1 MB slices at once), each
    slice paying the fixed cost.  Red if the slices run one after another (3 ms), if the
    transfer moves at the whole link's rate (0.75 ms), or if the fixed cost is paid once."""
    lk = Lanes(4, 3, 4e9)
    a = lk.submit(1, 3 * MB, 0.0)
    lk.finish()
    assert lk.done == [1] and a.start_s == 0.0 and a.end_s == pytest.approx(1 * MS)
    assert lk.link.busy_s == pytest.approx(3 * MS / 4)  # three lanes busy for 1 ms of four
    ov = Lanes(4, 3, 4e9, ov=0.5 * MS)
    b = ov.submit(1, 3 * MB, 0.0)
    ov.finish()
    assert b.end_s == pytest.approx(1.5 * MS)


def test_the_next_transfer_fills_the_lanes_left_idle() -> None:
    """Two 3 MB transfers on 4 lanes of 1 GB/s, 3 slices each: A's three slices and B's
    first run in [0, 1] ms, B's other two in [1, 2] ms; A lands at 1 ms, B at 2 ms, the
    lanes busy 6 lane-ms of 8.  Red if a transfer waits for a whole free link (B at 2 ms
    but starting at 1 ms) or the lane left idle stays idle."""
    lk = Lanes(4, 3, 4e9)
    a = lk.submit(1, 3 * MB, 0.0)
    b = lk.submit(2, 3 * MB, 0.0)
    lk.finish()
    assert lk.done == [1, 2]
    assert (a.end_s, b.start_s, b.end_s) == pytest.approx((1 * MS, 0.0, 2 * MS))
    assert lk.link.busy_s == pytest.approx(6 * MS / 4)
    assert lk.link.started == 2


def test_an_on_demand_load_takes_the_next_free_lane_and_pauses_nothing() -> None:
    """2 lanes of 1 GB/s, 2 slices: prefetches P and Q (8 MB, two 4 MB slices each), then
    at 1 ms an on-demand D (2 MB).  P's slices run in [0, 4] ms and are not paused; D's
    run in [4, 5] ms ahead of Q's, which run in [5, 9] ms.  Red if D waits behind Q (lands
    at 9 ms) or stops P's moving slices."""
    lk = Lanes(2, 2, 2e9)
    p = lk.submit(1, 8 * MB, 0.0)
    q = lk.submit(2, 8 * MB, 0.0)
    d = lk.submit(3, 2 * MB, 1 * MS, prio=ON_DEMAND)
    lk.finish()
    assert lk.done == [1, 3, 2]
    assert p.end_s == pytest.approx(4 * MS) and p.preemptions == 0
    assert (d.start_s, d.end_s) == pytest.approx((4 * MS, 5 * MS))
    assert (q.start_s, q.end_s) == pytest.approx((5 * MS, 9 * MS))


def test_priorities_order_slices_and_escalation_moves_a_started_transfer_ahead() -> None:
    """2 lanes of 1 GB/s, 4 slices of 1 MB: A (priority 1) starts two slices at 0; B
    (priority 0.5) arrives at 0.5 ms and goes before A's other two: B's in [1, 3] ms, A
    lands at 4 ms.  Escalating A at 0.5 ms instead puts its two slices left first: A lands
    at 2 ms, B at 4 ms.  Red if a started transfer's slices keep their place after an
    escalation, or if priorities do not order the slices still to start."""
    lk = Lanes(2, 4, 2e9)
    a = lk.submit(1, 4 * MB, 0.0, prio=1.0)
    b = lk.submit(2, 4 * MB, 0.5 * MS, prio=0.5)
    lk.finish()
    assert lk.done == [2, 1]
    assert (b.start_s, b.end_s, a.end_s) == pytest.approx((1 * MS, 3 * MS, 4 * MS))
    esc = Lanes(2, 4, 2e9)
    a = esc.submit(1, 4 * MB, 0.0, prio=1.0)
    b = esc.submit(2, 4 * MB, 0.5 * MS, prio=0.5)
    esc.link.escalate(a, 0.5 * MS)
    esc.finish()
    assert esc.done == [1, 2] and a.escalated
    assert (a.end_s, b.start_s, b.end_s) == pytest.approx((2 * MS, 2 * MS, 4 * MS))


def test_abort_drops_the_slices_not_started_and_cancel_only_what_never_started() -> None:
    """2 lanes of 1 GB/s, 4 slices of 1 MB: A aborted at 0.5 ms keeps moving its two
    started slices to 1 ms (2 MB wasted), drops the other two and never lands; B, queued
    behind, starts at 1 ms.  A transfer whose slices have all started cannot stop; a
    started one cannot be cancelled; a never-started one can.  Red if an abort lands the
    transfer, counts its moving slices as not moved, or frees their lanes early."""
    lk = Lanes(2, 4, 2e9)
    a = lk.submit(1, 4 * MB, 0.0)
    b = lk.submit(2, 4 * MB, 0.0)
    c = lk.submit(3, 2 * MB, 0.0)
    assert not lk.link.cancel(a)  # started
    assert lk.at(0.5 * MS).abort(a, 0.5 * MS)
    assert a.aborted and a.state == sim_engine._CANCELLED and a.moved_bytes == 2 * MB
    assert lk.link.cancel(c) and c.state == sim_engine._CANCELLED  # never started
    lk.at(2.5 * MS)
    assert not lk.link.abort(b, 2.5 * MS)  # its last two slices moving since 2 ms
    lk.finish()
    assert lk.done == [2]
    assert a.end_s == pytest.approx(1 * MS)
    assert (b.start_s, b.end_s) == pytest.approx((1 * MS, 3 * MS))
    assert lk.link.busy_s == pytest.approx(6 * MS / 2)


def test_a_delayed_prefetch_waits_for_its_release_on_idle_lanes() -> None:
    """A prefetch released at 2 ms on idle lanes starts then (not at its submission, not
    at the next other event).  Red if the lanes' next event ignores a release."""
    lk = Lanes(2, 2, 2e9)
    rec = TransferRecord(1, 0, 2 * MB, "prefetch", 1.0, 0.0)
    rec.release_s = 2 * MS
    lk.link.submit(rec, 0.0)
    assert lk.link.cur_end_s == pytest.approx(2 * MS) and lk.link.cur is None
    lk.finish()
    assert (rec.start_s, rec.end_s) == pytest.approx((2 * MS, 3 * MS))


@pytest.mark.parametrize("fifo", [False, True])
def test_a_fifo_link_of_lanes_starts_slices_in_arrival_order(fifo: bool) -> None:
    """2 lanes of 1 GB/s, 2 slices: X runs in [0, 2] ms; A (priority 5) then B (priority
    0.1) queue behind it.  By priority B goes first, [2, 3] ms; first come first served, A
    does.  Red if ``engine.link_order=fifo`` does not reach a link of lanes."""
    lk = Lanes(2, 2, 2e9, fifo=fifo)
    lk.submit(0, 4 * MB, 0.0)
    a = lk.submit(1, 2 * MB, 0.5 * MS, prio=5.0)
    b = lk.submit(2, 2 * MB, 0.5 * MS, prio=0.1)
    lk.finish()
    first, second = (a, b) if fifo else (b, a)
    assert (first.start_s, first.end_s) == pytest.approx((2 * MS, 3 * MS))
    assert (second.start_s, second.end_s) == pytest.approx((3 * MS, 4 * MS))


#: (kind, key, arg) requests, as tests/test_engine_timing.py's link tests send them
OPS = st.lists(
    st.tuples(st.integers(0, 5), st.integers(0, 12), st.integers(0, 5)), min_size=30, max_size=200
)


def _drive(link, records: dict[int, TransferRecord], kind: int, key: int, arg: int, t: float):
    """At ``t``: submit a prefetch of priority ``arg`` (0) / on demand (1) / cancel (2) /
    reprioritize (3) / escalate (4) / abort (5); 4 MB each, one live transfer per key."""
    link.advance(t)
    rec = records.get(key)
    live = rec is not None and rec.state not in (sim_engine._DONE, sim_engine._CANCELLED)
    if kind <= 1 and not live:
        prio = float(arg) if kind == 0 else ON_DEMAND
        rec = TransferRecord(key, 0, 4 * MB, "prefetch" if kind == 0 else "on_demand", prio, t)
        link.submit(rec, t)
        records[key] = rec
    elif rec is not None and kind == 2:
        link.cancel(rec)
    elif rec is not None and kind == 3:
        link.reprioritize(rec, float(arg))
    elif rec is not None and kind == 4:
        link.escalate(rec, t)
    elif rec is not None and kind == 5:
        link.abort(rec, t)


@settings(max_examples=80, deadline=None)
@given(OPS, st.sampled_from([2, 4]))
def test_as_many_slices_as_lanes_runs_as_one_link(ops, k: int) -> None:
    """With k slices over k lanes every transfer's slices start and end together, so the
    link is one server at the whole rate: under any requests it lands the same transfers
    in the same order at the same times as :class:`SimLink` moving whole transfers without
    pauses.  Red if a free lane takes a slice out of priority order, a lane's rate is not
    its share, or a cancel, re-ranking, escalation or abort leaves the queue wrong."""
    lanes = sim_engine.LaneLink(1e9, 0.0, k, k, lambda key: done[0].append(key))
    one = sim_engine.SimLink(1e9, 0.0, 1 << 40, False, lambda key: done[1].append(key))
    done: list[list[int]] = [[], []]
    recs: list[dict[int, TransferRecord]] = [{}, {}]
    t = 0.0
    for kind, key, arg in ops:
        t += 0.7 * MS
        for link, r in zip((lanes, one), recs, strict=True):
            _drive(link, r, kind, key, arg, t)
    lanes.advance(float("inf"))
    one.advance(float("inf"))
    assert done[0] == done[1]
    ends = [[(k_, r.state, r.end_s) for k_, r in sorted(rs.items())] for rs in recs]
    assert [e[:2] for e in ends[0]] == [e[:2] for e in ends[1]]
    np.testing.assert_allclose([e[2] for e in ends[0]], [e[2] for e in ends[1]], rtol=1e-9)
    assert lanes.busy_s == pytest.approx(one.busy_s)


@settings(max_examples=80, deadline=None)
@given(OPS, st.integers(1, 4), st.integers(1, 5))
def test_lanes_keep_their_books_under_any_requests(ops, lanes: int, slices: int) -> None:
    """Whatever the requests: the queue holds exactly the transfers with slices still to
    start; no more slices move than there are lanes; every transfer submitted ends landed
    once, cancelled or aborted, and an aborted one moved only whole slices.  Red if a
    transfer is lost, lands twice, or a lane runs two slices at once."""
    done: list[int] = []
    link = sim_engine.LaneLink(1e9, 0.1 * MS, lanes, slices, done.append)
    recs: dict[int, TransferRecord] = {}
    every: list[TransferRecord] = []
    t = 0.0
    for kind, key, arg in ops:
        t += 0.5 * MS
        _drive(link, recs, kind, key, arg, t)
        rec = recs.get(key)
        if rec is not None and all(r is not rec for r in every):
            every.append(rec)
        assert sum(j is not None for j in link._lane_job) <= lanes
        waiting = {id(j) for j in every if link._queued(j)}
        assert {id(j) for j in link._queue} == waiting and len(link._queue) == len(waiting)
    link.advance(float("inf"))
    assert all(j is None for j in link._lane_job) and not link._queue and not link._progress
    assert sorted(done) == sorted(r.key for r in every if r.state == sim_engine._DONE)
    assert len(done) == sum(r.state == sim_engine._DONE for r in every)
    # an aborted transfer moved its first n slices, 0 < n < slices
    whole_slices = {4 * MB * n // slices for n in range(1, slices)}
    for r in every:
        assert r.state in (sim_engine._DONE, sim_engine._CANCELLED)
        if r.aborted:
            assert r.moved_bytes in whole_slices


def test_every_layer_misses_one_sliced_expert(tmp_path) -> None:
    """Through the whole simulator: every layer of TINY misses one 6 MB expert; on 2 lanes
    with 3 slices (2 MB each, 5 GB/s a lane, 0.1 ms fixed cost each) a load takes two
    rounds of 0.5 ms: 1 ms of stall a layer, as ``HardwareSpec.transfer_time_s`` says,
    against 0.7 ms on one server.  Red if the backend builds a one-server link for a
    preset with lanes, or if the demand-only closed form (a one-server formula) times
    these layers."""
    hw = dataclasses.replace(TINY_HW, link_lanes=2, transfer_slices=3)
    t_x = hw.transfer_time_s(SIZE)
    assert t_x == pytest.approx(1.0 * MS) and TINY_HW.transfer_time_s(SIZE) == pytest.approx(
        0.7 * MS
    )
    tr = read_trace(write_sequence_trace(tmp_path / "t", CYCLE, prompt_tokens=3))
    r = simulate(tr, TINY, hw, LRU(), 2 * SIZE)
    n, L = len(CYCLE), TINY.num_layers
    assert (r.summary["hits"], r.summary["late"], r.summary["misses"]) == (0, 0, n * L)
    assert r.summary["stall_s"] == pytest.approx(n * L * t_x, rel=1e-12)
    for t in r.transfers:  # each on-demand load runs alone on idle lanes
        assert t.end_s - t.start_s == pytest.approx(t_x, rel=1e-9)
    whole = simulate(tr, TINY, TINY_HW, LRU(), 2 * SIZE)
    assert whole.summary["stall_s"] == pytest.approx(n * L * 0.7 * MS, rel=1e-12)


@pytest.mark.parametrize(
    ("change", "key"),
    [
        ({"link_lanes": 0}, "hardware.link_lanes"),
        ({"link_lanes": True}, "hardware.link_lanes"),
        ({"transfer_slices": 1.5}, "hardware.transfer_slices"),
        (
            {"link_lanes": 2, "measured": {"m": {"host_link_depth": 2}}},
            "hardware.measured.m.host_link_depth",
        ),
    ],
)
def test_bad_lanes_and_slices_name_their_key(change, key) -> None:
    """Red if a lane count of 0, a boolean or a fractional slice count is taken (a link
    that never moves, or slices of fractional bytes), or lanes are combined with a
    host-issued link, which has one lane."""
    with pytest.raises(ConfigError, match=f"'{key}'"):
        dataclasses.replace(HardwareSpec(), **change).validate()
