"""The replay's host-to-device link: a copy engine and the host-side scheduler that
decides what it copies next.

A CUDA stream executes copies in the order they were issued and cannot reorder or drop
one, so priorities, on-demand preemption and cancellation (DESIGN.md's link model, the
simulator's :class:`fmoesim.engine.sim.SimLink`) live on the host: transfers wait in a
priority queue, and the scheduler keeps at most ``depth`` chunks issued to the copy
stream at a time.  Whenever the host thread comes by (:meth:`LinkScheduler.pump`, which
the backend calls at every step and while it waits) finished chunks retire and the
queue's best transfer gets the next chunk.  A transfer that was never issued can be
cancelled, one that was can be aborted (no further chunk is issued); an on-demand load
overtakes a prefetch at the next chunk boundary; a delayed prefetch (an asynchronous
matcher still deciding) waits off the queue until its release time.  ``depth`` trades
responsiveness (an on-demand load waits for at most ``depth`` chunks ahead of it)
against link idle time between visits of the host.

Two copy engines: :class:`CudaCopier` (a dedicated copy stream, ``copy_(non_blocking=
True)`` from pinned memory, CUDA events around every chunk) and :class:`ThreadCopier`
(a worker thread that copies in issue order, so the same scheduler runs, and is tested,
on a CPU).
"""

from __future__ import annotations

import heapq
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from fmoesim.engine.backend import ON_DEMAND, TransferRecord

_QUEUED, _ISSUING, _DONE, _CANCELLED, _DELAYED = range(5)


class Mark(Protocol):
    """A point on a stream: done or not, and when (seconds since the copier's origin)."""


class Copier(Protocol):
    """A copy engine: copies in issue order, each one marked."""

    def copy(self, dst: Any, src: Any) -> tuple[Any, Any]:
        """Issue ``dst.copy_(src)``; return its (start, end) marks."""
        ...

    def done(self, mark: Any) -> bool:
        """Whether the stream has passed ``mark``."""
        ...

    def time_s(self, mark: Any) -> float:
        """When the stream passed ``mark`` (it must be done)."""
        ...

    def span_s(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (both done)."""
        ...


class _CpuMark:
    __slots__ = ("t",)

    def __init__(self, t: float | None = None) -> None:
        self.t = t


class ThreadCopier:
    """Copies on a worker thread, in issue order (the CPU stand-in of a copy stream);
    marks hold ``perf_counter`` times relative to ``origin``."""

    def __init__(self, origin: float) -> None:
        self.origin = origin
        self._q: queue.SimpleQueue[tuple[Any, Any, _CpuMark, _CpuMark] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, daemon=True, name="fmoesim-copy")
        self._thread.start()

    def _work(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            dst, src, start, end = job
            start.t = time.perf_counter() - self.origin
            dst.copy_(src)
            end.t = time.perf_counter() - self.origin

    def copy(self, dst: Any, src: Any) -> tuple[_CpuMark, _CpuMark]:
        """Queue the copy for the worker."""
        start, end = _CpuMark(), _CpuMark()
        self._q.put((dst, src, start, end))
        return start, end

    def done(self, mark: _CpuMark) -> bool:
        """Whether the worker has finished up to ``mark``."""
        return mark.t is not None

    def time_s(self, mark: _CpuMark) -> float:
        """The mark's time."""
        assert mark.t is not None
        return mark.t

    def span_s(self, a: _CpuMark, b: _CpuMark) -> float:
        """Seconds from ``a`` to ``b``."""
        assert a.t is not None and b.t is not None
        return b.t - a.t

    def close(self) -> None:
        """Stop the worker after what was issued."""
        self._q.put(None)
        self._thread.join()


class CudaCopier:
    """A dedicated CUDA copy stream; every copy between two timing events.  Times are
    measured from ``origin_event`` (recorded when the backend starts)."""

    def __init__(self, torch: Any, device: str, origin_event: Any) -> None:
        self.torch = torch
        self.stream = torch.cuda.Stream(device=device)
        self.origin = origin_event

    def copy(self, dst: Any, src: Any) -> tuple[Any, Any]:
        """``dst.copy_(src, non_blocking=True)`` on the copy stream."""
        cuda = self.torch.cuda
        start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
        with cuda.stream(self.stream):
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
        return start, end

    def done(self, mark: Any) -> bool:
        """``event.query()``."""
        return bool(mark.query())

    def time_s(self, mark: Any) -> float:
        """Seconds from the origin event to ``mark`` (a float32 of milliseconds: about
        60 µs resolution after 1000 s, so intervals use :meth:`span_s`)."""
        return float(self.origin.elapsed_time(mark)) / 1e3

    def span_s(self, a: Any, b: Any) -> float:
        """Seconds from mark ``a`` to mark ``b`` (both done), at full resolution."""
        return float(a.elapsed_time(b)) / 1e3


class LinkScheduler:
    """The host-side queue of one link (see the module docstring).

    ``issue(record, lo, hi)`` must issue the copy of rows ``[lo, hi)`` of ``record``'s
    segment and return the copier's (start, end) marks; ``rows(record)`` gives the
    segment's row count; ``on_done(record)`` is called when its last chunk has landed.
    Records get ``start_s`` (first chunk's start mark) and ``end_s`` (last chunk's end).
    """

    def __init__(
        self,
        copier: Copier,
        row_bytes: int,
        chunk_bytes: int,
        depth: int,
        preempt: bool,
        issue: Callable[[TransferRecord, int, int], tuple[Any, Any]],
        rows: Callable[[TransferRecord], int],
        on_done: Callable[[TransferRecord], None],
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth {depth}: must be >= 1")
        self.copier = copier
        self.chunk_rows = max(1, chunk_bytes // max(1, row_bytes))
        self.depth = depth
        self.preempt = preempt
        self._issue, self._rows, self._on_done = issue, rows, on_done
        self._heap: list[tuple[float, int, TransferRecord]] = []
        self._delayed: list[tuple[float, int, TransferRecord]] = []
        self._jobs: dict[int, TransferRecord] = {}  # key -> queued/issuing/delayed record
        self._next_row: dict[int, int] = {}  # key -> first row not yet issued
        self._total_rows: dict[int, int] = {}
        self._cur: TransferRecord | None = None  # the transfer whose chunks go out now
        # issued chunks in issue order: (record, start mark, end mark, last chunk?)
        self._out: deque[tuple[TransferRecord, Any, Any, bool]] = deque()
        self._seq = 0
        self.busy_s = 0.0
        self.last_end_mark: dict[int, Any] = {}  # key -> end mark of its latest landing

    # -- the backend's requests --------------------------------------------------------
    def submit(self, rec: TransferRecord, now_s: float) -> None:
        """Queue ``rec`` (it may start at ``rec.release_s`` at the earliest)."""
        rec.seq = self._seq
        self._seq += 1
        rec.link_priority = rec.priority
        self._jobs[rec.key] = rec
        self._next_row[rec.key] = 0
        self._total_rows[rec.key] = self._rows(rec)
        if rec.release_s > now_s and rec.priority != ON_DEMAND:
            rec.state = _DELAYED
            heapq.heappush(self._delayed, (rec.release_s, rec.seq, rec))
        else:
            rec.state = _QUEUED
            heapq.heappush(self._heap, (rec.link_priority, rec.seq, rec))

    def escalate(self, key: int) -> None:
        """Give ``key``'s transfer on-demand priority (a delayed one is released)."""
        rec = self._jobs.get(key)
        if rec is None or rec.link_priority == ON_DEMAND:
            return
        rec.link_priority = ON_DEMAND
        rec.escalated = True
        if rec.state == _DELAYED:
            rec.state = _QUEUED
        if rec.state == _QUEUED:
            heapq.heappush(self._heap, (ON_DEMAND, rec.seq, rec))

    def reprioritize(self, key: int, priority: float) -> None:
        """Move a queued, never-issued prefetch to ``priority``."""
        rec = self._jobs.get(key)
        if rec is None or rec.link_priority in (ON_DEMAND, priority) or self._next_row[key] > 0:
            return
        rec.link_priority = priority
        if rec.state == _QUEUED:
            heapq.heappush(self._heap, (priority, rec.seq, rec))

    def cancel(self, key: int) -> bool:
        """Drop ``key``'s transfer if none of it was issued."""
        rec = self._jobs.get(key)
        if rec is None or rec.state not in (_QUEUED, _DELAYED) or self._next_row[key] > 0:
            return False
        rec.state = _CANCELLED
        del self._jobs[key], self._next_row[key], self._total_rows[key]
        return True

    def abort(self, key: int) -> bool:
        """Stop ``key``'s transfer: one with nothing issued is cancelled; otherwise no
        further chunk is issued (the issued ones land, wasted), unless its last chunk
        already is.  An escalated transfer goes on.  True if it will not land."""
        rec = self._jobs.get(key)
        if rec is None or rec.link_priority == ON_DEMAND:
            return False
        done, total = self._next_row[key], self._total_rows[key]
        if done == 0:
            return self.cancel(key)
        if done >= total:
            return False
        rec.left_bytes = round(rec.size_bytes * (total - done) / total)
        rec.state = _CANCELLED
        rec.aborted = True
        if self._cur is rec:
            self._cur = None
        del self._jobs[key], self._next_row[key], self._total_rows[key]
        return True

    def in_flight(self, key: int) -> bool:
        """Whether ``key`` is queued, delayed or moving."""
        return key in self._jobs

    def idle(self) -> bool:
        """Nothing issued, queued or delayed."""
        return not self._jobs and not self._out

    # -- the scheduler -----------------------------------------------------------------
    def pump(self, now_s: float) -> bool:
        """Retire finished chunks, release due prefetches, issue chunks up to ``depth``;
        return whether any transfer landed."""
        landed = False
        out, copier = self._out, self.copier
        while out and copier.done(out[0][2]):
            rec, start, end, last = out.popleft()
            if rec.start_s != rec.start_s:  # NaN: the first chunk's start
                rec.start_s = copier.time_s(start)
            self.busy_s += copier.span_s(start, end)
            # its latest chunk so far: the last one, or an aborted transfer's last
            rec.end_s = copier.time_s(end)
            if last:
                self.last_end_mark[rec.key] = end
                rec.state = _DONE
                del self._jobs[rec.key]
                del self._next_row[rec.key], self._total_rows[rec.key]
                self._on_done(rec)
                landed = True
        delayed = self._delayed
        while delayed and delayed[0][0] <= now_s:
            _, _, rec = heapq.heappop(delayed)
            if rec.state == _DELAYED:
                rec.state = _QUEUED
                heapq.heappush(self._heap, (rec.link_priority, rec.seq, rec))
        while len(out) < self.depth:
            nxt = self._choose()
            if nxt is None:
                break
            lo = self._next_row[nxt.key]
            hi = min(self._total_rows[nxt.key], lo + self.chunk_rows)
            start, end = self._issue(nxt, lo, hi)
            self._next_row[nxt.key] = hi
            last = hi >= self._total_rows[nxt.key]
            out.append((nxt, start, end, last))
            if last:
                self._cur = None
        return landed

    def _choose(self) -> TransferRecord | None:
        """The transfer that gets the next chunk: the current one, unless an on-demand
        load waits and the current one is a prefetch (preemption at a chunk boundary)."""
        cur = self._cur
        heap = self._heap
        while heap and (heap[0][2].state != _QUEUED or heap[0][0] != heap[0][2].link_priority):
            heapq.heappop(heap)  # stale: cancelled, issuing, or re-pushed elsewhere
        if cur is not None:
            if self.preempt and heap and heap[0][0] == ON_DEMAND and cur.link_priority != ON_DEMAND:
                cur.state = _QUEUED  # paused: back in the queue, keeps its progress
                cur.preemptions += 1
                heapq.heappush(heap, (cur.link_priority, cur.seq, cur))
            else:
                return cur
        if not heap:
            self._cur = None
            return None
        _, _, rec = heapq.heappop(heap)
        rec.state = _ISSUING
        self._cur = rec
        return rec
