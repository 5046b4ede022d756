"""The replay's link scheduler, hand-traced with a copier whose chunks finish when the
test says so: chunking, depth, on-demand first (preemption at a chunk boundary),
cancellation, delayed release, reprioritising, and the records' times."""

from __future__ import annotations

from fmoesim.engine.backend import ON_DEMAND, TransferRecord
from replay.link import LinkScheduler


class Mark:
    def __init__(self) -> None:
        self.t: float | None = None


class FakeCopier:
    """Copies 'finish' only in :meth:`finish`, in issue order, at given times."""

    def __init__(self) -> None:
        self.issued: list[tuple[int, int, int]] = []  # (key, lo, hi)
        self._open: list[tuple[Mark, Mark]] = []

    def copy(self, dst, src):  # type: ignore[no-untyped-def]
        m = (Mark(), Mark())
        self._open.append(m)
        return m

    def finish(self, n: int, t0: float, dt: float = 1.0) -> None:
        for i in range(n):
            start, end = self._open.pop(0)
            start.t, end.t = t0 + i * dt, t0 + (i + 1) * dt

    def done(self, mark):  # type: ignore[no-untyped-def]
        return mark.t is not None

    def time_s(self, mark):  # type: ignore[no-untyped-def]
        return mark.t

    def span_s(self, a, b):  # type: ignore[no-untyped-def]
        return b.t - a.t


def make(rows: dict[int, int], depth: int = 1, preempt: bool = True, chunk_rows: int = 2):
    copier = FakeCopier()
    landed: list[int] = []

    def issue(rec, lo, hi):  # type: ignore[no-untyped-def]
        copier.issued.append((rec.key, lo, hi))
        return copier.copy(None, None)

    link = LinkScheduler(
        copier,
        row_bytes=10,
        chunk_bytes=10 * chunk_rows,
        depth=depth,
        preempt=preempt,
        issue=issue,
        rows=lambda rec: rows[rec.key],
        on_done=lambda rec: landed.append(rec.key),
    )
    return link, copier, landed


def rec(key: int, priority: float, t: float = 0.0, delay: float = 0.0) -> TransferRecord:
    r = TransferRecord(key, 0, 100, "prefetch" if priority != ON_DEMAND else "on_demand",
                       priority, t)  # fmt: skip
    r.release_s = t + delay
    return r


def test_chunks_go_out_depth_at_a_time_and_land_with_their_times():
    link, cp, landed = make({1: 5}, depth=2)
    r = rec(1, 1.0)
    link.submit(r, 0.0)
    link.pump(0.0)
    assert cp.issued == [(1, 0, 2), (1, 2, 4)]  # depth 2
    cp.finish(1, t0=3.0)
    assert not link.pump(3.5)
    assert cp.issued[-1] == (1, 4, 5)  # the last, short chunk
    cp.finish(2, t0=4.0)
    assert link.pump(6.0)
    assert landed == [1]
    assert (r.start_s, r.end_s) == (3.0, 6.0)
    assert link.busy_s == 3.0
    assert link.idle()


def test_priority_order_and_ties_by_submission():
    link, cp, landed = make({1: 1, 2: 1, 3: 1, 4: 1})
    for key, p in [(1, 5.0), (2, 1.0), (3, 1.0), (4, 0.5)]:
        link.submit(rec(key, p), 0.0)
    for i in range(4):
        link.pump(float(i))
        cp.finish(1, t0=float(i))
    link.pump(9.0)
    assert [k for k, _, _ in cp.issued] == [4, 2, 3, 1]
    assert landed == [4, 2, 3, 1]


def test_on_demand_overtakes_a_prefetch_at_the_next_chunk_boundary():
    link, cp, landed = make({1: 6, 2: 2})
    pre = rec(1, 1.0)
    link.submit(pre, 0.0)
    link.pump(0.0)
    dem = rec(2, ON_DEMAND)
    link.submit(dem, 0.5)
    link.pump(0.5)
    assert cp.issued == [(1, 0, 2)]  # the issued chunk cannot be recalled
    cp.finish(1, t0=0.0)
    link.pump(1.0)
    assert cp.issued[-1] == (2, 0, 2)  # the on-demand load goes next
    cp.finish(1, t0=1.0)
    link.pump(2.0)
    assert landed == [2]
    assert cp.issued[-1] == (1, 2, 4)  # the prefetch resumes where it paused
    cp.finish(1, t0=2.0)
    link.pump(3.0)
    cp.finish(1, t0=3.0)
    link.pump(4.0)
    assert landed == [2, 1]
    assert pre.preemptions == 1 and pre.start_s == 0.0 and pre.end_s == 4.0


def test_without_preemption_the_prefetch_finishes_first():
    link, cp, landed = make({1: 4, 2: 2}, preempt=False)
    link.submit(rec(1, 1.0), 0.0)
    link.pump(0.0)
    link.submit(rec(2, ON_DEMAND), 0.0)
    for i in range(3):
        cp.finish(1, t0=float(i))
        link.pump(float(i + 1))
    assert [c[0] for c in cp.issued] == [1, 1, 2]
    assert landed == [1, 2]


def test_escalating_a_queued_prefetch_moves_it_ahead():
    link, cp, landed = make({1: 2, 2: 2})
    link.submit(rec(1, 1.0), 0.0)
    link.submit(rec(2, 2.0), 0.0)
    link.escalate(2)
    link.pump(0.0)
    assert cp.issued == [(2, 0, 2)]


def test_cancel_only_what_was_never_issued():
    link, cp, landed = make({1: 4, 2: 2, 3: 2})
    link.submit(rec(1, 1.0), 0.0)
    link.submit(rec(2, 2.0), 0.0)
    link.submit(rec(3, 3.0), 0.0)
    link.pump(0.0)
    assert not link.cancel(1)  # one chunk of it is on the stream
    assert link.cancel(2)
    assert not link.in_flight(2)
    for i in range(3):
        cp.finish(1, t0=float(i))
        link.pump(float(i + 1))
    assert [c[0] for c in cp.issued] == [1, 1, 3]
    assert landed == [1, 3]
    assert link.idle()


def test_a_paused_prefetch_cannot_be_cancelled_or_reordered():
    link, cp, landed = make({1: 4, 2: 2, 3: 2})
    link.submit(rec(1, 5.0), 0.0)
    link.pump(0.0)
    link.submit(rec(2, ON_DEMAND), 0.0)
    cp.finish(1, t0=0.0)
    link.pump(1.0)  # 1 paused after its first chunk, 2 moving
    assert not link.cancel(1)
    link.submit(rec(3, 9.0), 1.0)
    link.reprioritize(1, 10.0)  # ignored: it keeps its place ahead of 3
    cp.finish(1, t0=1.0)
    link.pump(2.0)
    assert cp.issued[-1] == (1, 2, 4)


def test_a_delayed_prefetch_waits_for_its_release_unless_escalated():
    link, cp, landed = make({1: 2, 2: 2})
    link.submit(rec(1, 1.0, t=0.0, delay=5.0), 0.0)
    link.pump(4.9)
    assert cp.issued == []
    link.pump(5.0)
    assert cp.issued == [(1, 0, 2)]
    link.submit(rec(2, 1.0, t=5.0, delay=5.0), 5.0)
    link.escalate(2)
    cp.finish(1, t0=5.0)
    link.pump(6.0)
    assert cp.issued[-1] == (2, 0, 2)


def test_reprioritize_a_queued_prefetch():
    link, cp, landed = make({1: 2, 2: 2, 3: 2})
    for key, p in [(1, 1.0), (2, 2.0), (3, 3.0)]:
        link.submit(rec(key, p), 0.0)
    link.reprioritize(3, 0.5)
    link.reprioritize(2, 0.1)
    for i in range(3):
        link.pump(float(i))
        cp.finish(1, t0=float(i))
    link.pump(5.0)
    assert [c[0] for c in cp.issued] == [2, 3, 1]


def test_abort_stops_issuing_chunks_and_the_issued_ones_land_wasted():
    """A 6-row prefetch in 2-row chunks, depth 1: aborted after its first chunk is issued,
    it issues no more; the issued chunk retires (its end is the record's end), the next
    transfer gets the link, and the aborted one never lands: 4 of 6 rows' bytes left.
    A transfer with nothing issued is cancelled instead, and one whose last chunk is
    issued, or an escalated one, is not stopped.  Red if the scheduler kept issuing an
    aborted transfer's chunks, reported it landed, or stopped one someone waits for."""
    link, cp, landed = make({1: 6, 2: 2, 3: 2, 4: 4})
    a, b, c = rec(1, 1.0), rec(2, 2.0), rec(3, 3.0)
    for r in (a, b, c):
        link.submit(r, 0.0)
    link.pump(0.0)
    assert link.abort(1)
    assert not link.in_flight(1)
    assert a.aborted and a.left_bytes == round(100 * 4 / 6)
    assert link.abort(3) and not c.aborted  # nothing issued: cancelled
    cp.finish(1, t0=0.0)
    link.pump(1.0)
    assert a.end_s == 1.0 and a.start_s == 0.0
    assert cp.issued == [(1, 0, 2), (2, 0, 2)]
    assert not link.abort(2)  # its last (only) chunk is on the stream
    d = rec(4, 4.0)
    link.submit(d, 1.0)
    link.escalate(4)
    cp.finish(1, t0=1.0)
    link.pump(2.0)
    assert not link.abort(4)  # escalated: an access waits for it
    for i in range(2):
        cp.finish(1, t0=2.0 + i)
        link.pump(3.0 + i)
    assert landed == [2, 4]
    assert link.idle()
