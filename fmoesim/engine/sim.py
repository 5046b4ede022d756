"""The simulator backends: a modelled clock over a PCIe link model and the compute model.

Why no general event loop: the GPU runs one operator at a time in program order, so
compute time is a running sum, and each GPU's host-to-device link is a server (or a
few lanes) whose schedule depends only on what was submitted to it.  Each link therefore keeps
its own event state (current transfer, its end time, a priority queue) and is
*advanced lazily* to the times the Runner looks at it: when it syncs before a gate,
submits, or waits for an expert.  This is the event-queue semantics of a SimPy model
(events ordered by (time, priority, sequence)) without paying for a scheduler object
per transfer; ``tests/test_engine_timing.py`` checks it against closed forms.

- :class:`SimLink` — one host-to-device link: bandwidth, fixed cost per transfer,
  chunked transfers, priority queue, on-demand preemption, cancellation, abort.
- :class:`LaneLink` — a link of several lanes with transfers cut into slices
  (``hardware.link_lanes``, ``hardware.transfer_slices``).
- :class:`SimBackend` — the timed backend.
- :class:`InstantBackend` — hit-rate-only with ``engine.landing=next_step``: no clock;
  a transfer issued during a layer step is resident from the next step.
- :class:`LinkStepBackend` — hit-rate-only with ``engine.landing=link`` (the default):
  a prefetch is resident once its bytes have crossed the link during modelled compute
  (one transfer at a time at the link's whole rate: lanes and slices are the timed
  link's).
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_left
from collections.abc import Callable, Sequence
from typing import Final

from mypy_extensions import mypyc_attr

from fmoesim.engine.backend import ON_DEMAND, Backend, DemandTiming, TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.specs.hardware import HardwareSpec

# perf: Final, so the compiled build reads them as constants, not from the module's dict
# (a dict lookup per use, three in every cancel, counted with callgrind)
INF: Final = math.inf
_QUEUED: Final = 0
_RUNNING: Final = 1
_DONE: Final = 2
_CANCELLED: Final = 3
_DELAYED: Final = 4


class SimLink:
    """One host-to-device link (one per GPU).

    Model: transfers are served one at a time, lowest ``priority`` value first, ties by
    submission order.  A transfer costs ``overhead_s`` once (when it first starts) plus
    ``size / bytes_per_s``.  It moves in chunks of ``chunk_bytes``; when an on-demand
    load arrives while a prefetch is moving and ``preempt`` is on, the prefetch pauses
    at its next chunk boundary (at the end of its fixed cost if it has not moved data
    yet), the on-demand loads run, and the prefetch resumes later without paying the
    fixed cost again (fMoE §4.5).  Only a queued transfer that has never started can
    be cancelled (MoE-Infinity §5.1); a started one can be aborted, and stops at its
    next chunk boundary for good (MoEpic §3.2 "terminates the prefetch operation").  A
    transfer submitted with a release time later than now (an asynchronous matcher still
    deciding, fMoE §4.3) waits off the queue until then; if it is needed before then,
    escalating it releases it at once.

    A transfer that lands is reported to ``cache`` (its :meth:`ExpertCache.complete`)
    or, without a cache, to ``on_done(key)``.

    The link is addressed by record: :meth:`escalate`, :meth:`reprioritize` and
    :meth:`cancel` take the :class:`TransferRecord` that :meth:`submit` queued (the
    cache entry holds it), and ignore one that is no longer queued, delayed or running.

    The queue (``_queue``) holds exactly the jobs in state queued, sorted by
    ``(link_priority, seq)`` descending, so the next to start is the last (after a
    re-ranking, from the next time it is read).

    With ``fifo`` the link has one first-come-first-served queue instead: every transfer,
    on-demand or prefetch, starts in the order it reached the queue (its submission, or
    the release of a delayed one), and priorities, re-rankings, escalation and ``preempt``
    change no order (an escalated transfer is still never aborted).  It is a what-if for
    an engine that queues every copy on one stream in issue order; cancelling a queued
    transfer works as in the default discipline.

    ``cur_end_s`` is the time of the link's next event: the end (or pause point) of the
    running transfer, or, while idle, the next release time (``inf`` when there is
    neither).

    With ``host_depth`` n >= 1 the link is a host-issued one, as in an engine whose own
    host thread feeds a copy stream (this project's replay: ``LinkScheduler`` with its
    ``depth``): a queued transfer starts only when the host issues it
    (:meth:`host_point`), and the copy engine holds the running transfer and at most
    n - 1 issued ones, which start back to back in issue order.  So the link idles
    between a transfer's end and the host's next point when nothing was issued behind
    it.  A started transfer moves all its chunks back to back (the replay issues them
    one by one: exact where an expert is one chunk).
    """

    def __init__(
        self,
        bytes_per_s: float,
        overhead_s: float,
        chunk_bytes: int,
        preempt: bool,
        on_done: Callable[[int], None] | None = None,
        cache: ExpertCache | None = None,
        fifo: bool = False,
    ) -> None:
        if (on_done is None) == (cache is None):
            raise ValueError("a link reports landed transfers to on_done or to a cache (one)")
        self.bytes_per_s = bytes_per_s
        self.overhead_s = overhead_s
        self.chunk_bytes = chunk_bytes
        self.fifo = fifo  # one first-come-first-served queue: nothing overtakes, nothing pauses
        self.preempt = preempt and not fifo
        self.on_done = on_done
        # perf: a cache's complete() is called directly, a native call where a callable
        # is a generic one (SimBackend passes its caches)
        self.cache = cache
        # perf: a sorted list with cancelled and re-prioritised jobs taken out at once, not
        # a heap of (priority, seq, job) tuples with lazy deletion: the queue holds a few
        # dozen jobs at most, a scan of native float comparisons costs less than heapq's
        # tuple comparisons, and no stale entries are popped (BrainStorm cancels ~6 of the
        # ~8 prefetches it queues per layer step; the heap was 15% of its run, callgrind)
        self._queue: list[TransferRecord] = []  # queued jobs, (link_priority, seq) descending
        # perf: each queued job's sort key, ascending, kept beside the queue, so the binary
        # search compares tuples in C instead of calling a key function per probe
        self._qkeys: list[tuple[float, int]] = []
        # perf: a re-ranking policy (MoE-Infinity) moves hundreds of queued jobs a layer
        # step; a re-ranked job only takes its new priority and marks the queue dirty,
        # and the queue is sorted once when next read (to start, find or insert a job in
        # order), so every read sees the order the moves one by one would have made
        self._dirty = False
        self._delayed: list[tuple[float, int, TransferRecord]] = []  # (release_s, seq, job)
        # perf: no key -> job dict: the callers hold the records (a dict insert and delete
        # per transfer and a lookup per request, ~5% of BrainStorm's run, callgrind)
        self._seq = 0
        self.cur: TransferRecord | None = None
        self.cur_end_s = INF  # when the current job finishes or reaches its pause point
        self._pausing = False
        self._aborting = False  # the current job stops at its pause point for good
        self._pause_left_bytes = 0
        self._data_start_s = 0.0  # when the current run of the job starts moving bytes
        self._done_at_start = 0  # bytes of the job already moved when this run started
        self.busy_s = 0.0
        self.started = 0  # transfers started so far (first starts; resumptions not counted)
        # a host-issued link (:meth:`host_point`): 0 starts every queued transfer the
        # moment the link frees; n >= 1 lets the host issue transfers to a copy engine
        # that holds the running one and at most n - 1 more (``issued``, run in order)
        self.host_depth = 0
        self.issued: list[TransferRecord] = []
        # engine.reserve=start: a transfer whose cache entry holds no bytes yet (a queued
        # prefetch) reserves them when it first starts, or is dropped if they do not fit
        self.reserve_at_start = False

    # -- the event loop ---------------------------------------------------------------
    def advance(self, t_s: float) -> None:
        """Process every link event at or before ``t_s``."""
        while self.cur_end_s <= t_s:
            if self.cur is not None:
                self._end_current()
            elif self._delayed and not self.host_depth:
                self._start_next(self.cur_end_s)  # idle until a release
            else:
                break

    def _end_current(self) -> None:
        job = self.cur
        assert job is not None
        t = self.cur_end_s
        if self._aborting:
            job.left_bytes = self._pause_left_bytes
            job.state = _CANCELLED
            job.aborted = True
            job.end_s = t
        elif self._pausing:
            job.left_bytes = self._pause_left_bytes
            job.state = _QUEUED
            job.preemptions += 1
            job.end_s = t  # its last chunk so far (the final one overwrites it)
            self._enqueue(job)
        else:
            job.state = _DONE
            job.left_bytes = 0
            job.end_s = t
            if self.cache is not None:
                self.cache.complete(job.key)
            elif self.on_done is not None:
                self.on_done(job.key)
        if self.issued:  # the copy engine runs what the host issued, in order
            self._start(self.issued.pop(0), t)
        elif self.host_depth:
            self.cur = None  # the next transfer waits for the host to issue it
            self.cur_end_s = INF
        else:
            self._start_next(t)

    def host_point(self, t_s: float) -> None:
        """The host comes by at ``t_s`` (a host-issued link, ``host_depth`` >= 1): the
        link's events up to then, then the host issues the best queued transfers, one to
        start now if the link is free and more behind the running one up to the depth.
        An issued transfer can no longer be cancelled or re-ranked."""
        if self.cur_end_s <= t_s:
            self.advance(t_s)
        if self._delayed:
            self._release(t_s)
        if not self._queue:
            return
        if self.cur is None:
            self._start_next(t_s)
        issued = self.issued
        while self._queue and len(issued) < self.host_depth - 1:
            job = self._pop_next()
            job.state = _RUNNING  # on the copy engine, behind the running transfer
            issued.append(job)

    def _release(self, t_s: float) -> None:
        """Move the delayed transfers whose release time is ``<= t_s`` to the queue."""
        delayed = self._delayed
        while delayed and delayed[0][0] <= t_s:
            _, _, job = heapq.heappop(delayed)
            if job.state == _DELAYED:  # else stale: cancelled or escalated
                job.state = _QUEUED
                if self.fifo:
                    self._arrive(job)
                self._enqueue(job)

    def _arrive(self, job: TransferRecord) -> None:
        """A delayed ``job`` reaches a FIFO link's queue now: it takes the next place in
        the arrival order (``seq``), behind everything submitted or released before."""
        job.seq = self._seq
        self._seq += 1

    def _next_release_s(self) -> float:
        """The earliest pending release time (stale entries dropped), or ``inf``."""
        delayed = self._delayed
        while delayed:
            if delayed[0][2].state == _DELAYED:
                return delayed[0][0]
            heapq.heappop(delayed)
        return INF

    def _start_next(self, t_s: float) -> None:
        if self._delayed:
            self._release(t_s)
        if self._queue:
            self._start(self._pop_next(), t_s)
            return
        self.cur = None
        self.cur_end_s = self._next_release_s() if self._delayed else INF

    def _pop_next(self) -> TransferRecord:
        """The queued transfer that goes next, taken off the queue (which is sorted first
        where a re-ranking left it out of order)."""
        if self._dirty:
            self._sort()
        self._qkeys.pop()
        return self._queue.pop()

    def _start(self, job: TransferRecord, t_s: float) -> None:
        if self.reserve_at_start and job.start_s != job.start_s and not self._reserve(job):
            self._start_next(t_s)  # dropped: the next one starts instead
            return
        job.state = _RUNNING
        overhead = 0.0
        if job.start_s != job.start_s:  # NaN: the first start pays the fixed cost
            job.start_s = t_s
            overhead = self.overhead_s
            self.started += 1
        self.cur = job
        self._pausing = False
        self._aborting = False
        self._data_start_s = t_s + overhead
        self._done_at_start = job.size_bytes - job.left_bytes
        self.cur_end_s = self._data_start_s + job.left_bytes / self.bytes_per_s
        self.busy_s += self.cur_end_s - t_s

    def _reserve(self, job: TransferRecord) -> bool:
        """Reserve ``job``'s bytes in the cache at its first start (``engine.reserve=start``);
        where they do not fit, drop it (cancelled, its entry refused) and return False."""
        cache = self.cache
        assert cache is not None, "engine.reserve=start needs a link that reports to a cache"
        if cache.reserve(job.key):
            return True
        if job.link_priority == ON_DEMAND:  # pragma: no cover - the runner loads those itself
            raise RuntimeError(f"expert {job.key}: a needed transfer found no room at its start")
        job.state = _CANCELLED
        job.cancelled = True  # as a cancelled transfer's record: it moved nothing
        job.start_s = job.end_s = job.submit_s
        cache.refuse(job.key)
        return False

    def _pause_current(self, t_s: float) -> None:
        """Pause the running prefetch at its next chunk boundary after ``t_s``."""
        job = self.cur
        if job is None or self._pausing or job.link_priority == ON_DEMAND or not self.preempt:
            return
        self._stop_at_boundary(job, t_s)

    def _stop_at_boundary(self, job: TransferRecord, t_s: float) -> bool:
        """Make the running ``job`` stop at its next chunk boundary after ``t_s`` (the end
        of its fixed cost if it has moved no data yet); False if it is one chunk or that
        boundary is its end."""
        chunk = self.chunk_bytes
        if chunk >= job.size_bytes:
            return False  # one chunk: nothing to stop between
        moved = self._done_at_start + max(0.0, t_s - self._data_start_s) * self.bytes_per_s
        boundary = min(job.size_bytes, math.ceil(moved / chunk) * chunk)
        if boundary >= job.size_bytes:
            return False
        end = self._data_start_s + (boundary - self._done_at_start) / self.bytes_per_s
        self.busy_s -= self.cur_end_s - end
        self.cur_end_s = end
        self._pausing = True
        self._pause_left_bytes = job.size_bytes - boundary
        return True

    # -- the Runner's requests --------------------------------------------------------
    def submit(self, record: TransferRecord, t_s: float) -> None:
        """Queue ``record``'s transfer at ``t_s`` (the link must be advanced to ``t_s``);
        it may start at ``record.release_s`` at the earliest."""
        job = record  # perf: the record is the link's job (no second object per transfer)
        if not self._number(job, t_s):
            if self.cur is None and job.release_s < self.cur_end_s:
                self.cur_end_s = job.release_s  # idle: the release is the next event
            return
        if self.cur is None and not self._queue:  # perf: an idle link starts it directly
            self._start(job, t_s)
            return
        self._enqueue(job)
        if self.cur is None:
            self._start_next(t_s)
        elif job.link_priority == ON_DEMAND:
            self._pause_current(t_s)

    def _number(self, job: TransferRecord, t_s: float) -> bool:
        """Give a new ``job`` its submission number at ``t_s``; hold it off the queue until
        its release (False) or let it queue now (True).  A new record already has
        ``left_bytes = size_bytes``, ``link_priority = priority`` and state queued
        (:class:`TransferRecord`)."""
        if self.fifo and self._delayed:  # what was released by now reached the queue first
            self._release(t_s)
        job.seq = self._seq
        self._seq += 1
        if job.release_s > t_s and job.priority != ON_DEMAND:
            job.state = _DELAYED
            heapq.heappush(self._delayed, (job.release_s, job.seq, job))
            return False
        return True

    def _enqueue(self, job: TransferRecord) -> None:
        """Insert queued ``job`` at its place: after every job that goes later, before
        every job that goes first (lower ``(link_priority, seq)``; ``seq`` is unique).
        perf: a binary search, as a multi-layer prefetcher queues thousands of jobs on a
        model of 48 x 128 experts (a scan from the end was half of MoE-Infinity's run)."""
        if self._dirty:  # sorted when next read
            self._queue.append(job)
            return
        k = (0.0 if self.fifo else -job.link_priority, -job.seq)
        i = bisect_left(self._qkeys, k)
        self._qkeys.insert(i, k)
        self._queue.insert(i, job)

    def _dequeue(self, job: TransferRecord) -> None:
        """Take queued ``job`` out of the queue (at the priority it was queued with)."""
        if self._dirty:
            self._sort()
        q = self._queue
        i = bisect_left(self._qkeys, (0.0 if self.fifo else -job.link_priority, -job.seq))
        if i == len(q) or q[i] is not job:  # pragma: no cover - a queued job is in place
            i = len(q) - 1
            while q[i] is not job:
                i -= 1
        q.pop(i)
        self._qkeys.pop(i)

    def _sort(self) -> None:
        """Put the queue back in order after re-rankings: every job at its current
        ``(link_priority, seq)``, the order :meth:`_enqueue` keeps."""
        q = self._queue
        fifo = self.fifo
        keys = [(0.0 if fifo else -j.link_priority, -j.seq) for j in q]
        # perf: the positions sorted by their keys, not (key, job) pairs (a comparison
        # of flat tuples; 40% less time on a queue of 250)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self._qkeys = [keys[i] for i in order]
        self._queue = [q[i] for i in order]
        self._dirty = False

    def escalate(self, job: TransferRecord, t_s: float) -> None:
        """Give ``job``, queued, delayed or running, on-demand priority."""
        if self._to_on_demand(job, t_s) and job.state == _QUEUED:
            if self.cur is None:
                self._start_next(t_s)
            else:
                self._pause_current(t_s)

    def _queued(self, job: TransferRecord) -> bool:
        """Whether ``job`` is in the queue."""
        return job.state == _QUEUED

    def _to_on_demand(self, job: TransferRecord, t_s: float) -> bool:
        """:meth:`escalate`'s priority change: ``job`` takes on-demand priority, and its
        place in the queue with it (a delayed one is released now); False if it has
        landed, was dropped or is on demand already."""
        if job.link_priority == ON_DEMAND or job.state == _DONE or job.state == _CANCELLED:
            return False
        if self.fifo and job.state == _DELAYED:
            self._release(t_s)  # what was released by now (this job too) reached the queue
        queued = self._queued(job)
        if queued:
            self._dequeue(job)  # found at the priority it was queued with
        job.link_priority = ON_DEMAND
        job.escalated = True
        if job.state == _DELAYED:  # needed before its release: released now
            job.state = _QUEUED
            if self.fifo:
                self._arrive(job)
            self._enqueue(job)
        elif queued:
            self._enqueue(job)
        return True

    def reprioritize(self, job: TransferRecord, priority: float) -> None:
        """Move ``job``, a queued, never-started prefetch, to ``priority``."""
        if job.state == _DELAYED:
            job.link_priority = priority  # queued at this priority when released
            return
        if (
            job.state != _QUEUED
            or job.start_s == job.start_s  # started (now paused): keeps its place
            or job.link_priority == ON_DEMAND
            or job.link_priority == priority
        ):
            return
        job.link_priority = priority
        self._dirty = True  # the queue is put back in order when next read

    def cancel(self, job: TransferRecord) -> bool:
        """Drop ``job`` if it is queued (or delayed) and never started."""
        if (job.state != _QUEUED and job.state != _DELAYED) or job.start_s == job.start_s:
            return False
        delayed = job.state == _DELAYED
        if not delayed:
            self._dequeue(job)
        job.state = _CANCELLED
        if delayed and self.cur is None:  # idle: the next event is the next live release
            self.cur_end_s = self._next_release_s()
        return True

    def abort(self, job: TransferRecord, t_s: float) -> bool:
        """Stop ``job`` for good (the link advanced to ``t_s``): one that never started is
        cancelled; one paused at a chunk boundary leaves the queue; the running one stops
        at its next chunk boundary, unless that boundary is its end.  Its moved chunks are
        wasted.  An escalated transfer (someone waits for it) is never stopped.  True if
        ``job`` will not land."""
        if job.link_priority == ON_DEMAND or job.state == _DONE or job.state == _CANCELLED:
            return False
        if job.start_s != job.start_s:  # NaN: never started
            return self.cancel(job)
        if job.state == _QUEUED:  # paused
            self._dequeue(job)
            job.state = _CANCELLED
            job.aborted = True
            return True
        if job is not self.cur:  # pragma: no cover - a started job is queued or running
            return False
        if not self._pausing and not self._stop_at_boundary(job, t_s):
            return False
        self._aborting = True
        return True

    def idle(self) -> bool:
        """Whether nothing is moving or queued."""
        return self.cur is None


class LaneLink(SimLink):
    """A host-to-device link of several lanes, and transfers cut into slices.

    Model: ``lanes`` servers share the link's rate, each moving ``bytes_per_s / lanes``
    (an engine's reader threads, each with its own share of the storage's bandwidth).  A
    transfer is cut into ``slices`` jobs of equal size to the byte (slice i of s moves
    ``size * (i + 1) // s - size * i // s`` bytes): an engine that reads an expert one
    projection at a time, one job each.
    A lane that frees takes the next slice of the first transfer in the queue (lowest
    ``(link_priority, seq)``, as :class:`SimLink` orders it), so one transfer's slices
    run side by side on the free lanes and the next transfer's fill the lanes it leaves
    idle.  A transfer lands when its last slice does.  Each slice pays ``overhead_s``
    (one read or copy call each).

    A slice is the unit of preemption: a moving slice always finishes, and an on-demand
    load (or an escalated prefetch) takes the next lane that frees, ahead of every
    prefetch's slices still to start (``chunk_bytes`` and ``preempt`` play no part).
    Cancelling works as on :class:`SimLink` (a transfer none of whose slices has
    started).  Aborting a started transfer drops its slices not started; the moving ones
    finish, their bytes wasted, and it never lands; one whose slices have all started
    cannot stop and lands.  ``busy_s`` is the lanes' busy time over their number (the
    mean share of the link in use), ``left_bytes`` the bytes of slices not yet started.
    A host-issued link (``host_depth``) is not modelled with lanes.

    With one lane and one slice it gives :class:`SimLink`'s times without pauses; the
    backend uses :class:`SimLink` then.
    """

    def __init__(
        self,
        bytes_per_s: float,
        overhead_s: float,
        lanes: int,
        slices: int,
        on_done: Callable[[int], None] | None = None,
        cache: ExpertCache | None = None,
        fifo: bool = False,
    ) -> None:
        super().__init__(bytes_per_s, overhead_s, 1 << 62, False, on_done, cache, fifo)
        if lanes < 1 or slices < 1:
            raise ValueError(f"a link needs lanes >= 1 and slices >= 1, got {lanes}, {slices}")
        self.lanes = lanes
        self.slices = slices
        self.lane_bytes_per_s = bytes_per_s / lanes
        self._lane_end: list[float] = [INF] * lanes  # when each lane's slice ends
        self._lane_job: list[TransferRecord | None] = [None] * lanes
        # a started transfer not yet finished -> [its slices not started, its slices moving]
        self._progress: dict[TransferRecord, list[int]] = {}

    def advance(self, t_s: float) -> None:
        """Process every link event at or before ``t_s``: slices that end, releases."""
        ends = self._lane_end
        while self.cur_end_s <= t_s:
            t = self.cur_end_s
            if t == INF:  # nothing moving and nothing to release
                break
            if min(ends) == t:
                self._finish(ends.index(t), t)
            self._fill(t)

    def _finish(self, lane: int, t_s: float) -> None:
        """``lane``'s slice ends at ``t_s``; its transfer lands with its last slice."""
        job = self._lane_job[lane]
        assert job is not None
        self._lane_job[lane] = None
        self._lane_end[lane] = INF
        p = self._progress[job]
        p[1] -= 1
        job.end_s = t_s  # its last slice so far (the final one overwrites it)
        if p[0] or p[1]:
            return
        del self._progress[job]
        if job.state == _CANCELLED:  # aborted: its moving slices have finished
            return
        job.state = _DONE
        if self.cache is not None:
            self.cache.complete(job.key)
        elif self.on_done is not None:
            self.on_done(job.key)

    def _fill(self, t_s: float) -> None:
        """Release what is due, start the next slices on the free lanes at ``t_s``, and
        set the next event."""
        if self._delayed:
            self._release(t_s)
        jobs = self._lane_job
        if self._queue:
            for lane in range(self.lanes):
                if jobs[lane] is None:
                    if self._dirty:
                        self._sort()
                    self._start_slice(lane, self._queue[-1], t_s)
                    if not self._queue:
                        break
        end = min(self._lane_end)
        if self._delayed and None in jobs:
            end = min(end, self._next_release_s())
        self.cur_end_s = end
        self.cur = None
        for job in jobs:
            if job is not None:
                self.cur = job
                break

    def _start_slice(self, lane: int, job: TransferRecord, t_s: float) -> None:
        """Start the next slice of ``job``, the head of the queue, on ``lane``."""
        p = self._progress.get(job)
        if p is None:  # its first slice: the transfer starts
            p = [self.slices, 0]
            self._progress[job] = p
            job.start_s = t_s
            job.state = _RUNNING
            self.started += 1
        size, n = job.size_bytes, self.slices
        i = n - p[0]
        nbytes = size * (i + 1) // n - size * i // n
        p[0] -= 1
        p[1] += 1
        job.left_bytes -= nbytes
        if not p[0]:  # every slice started: it leaves the queue
            self._queue.pop()
            self._qkeys.pop()
        end = (t_s + self.overhead_s) + nbytes / self.lane_bytes_per_s
        self._lane_job[lane] = job
        self._lane_end[lane] = end
        self.busy_s += (end - t_s) / self.lanes

    def _queued(self, job: TransferRecord) -> bool:
        """Whether ``job`` is in the queue: queued, or started with slices to start."""
        if job.state == _QUEUED:
            return True
        p = self._progress.get(job)
        return job.state == _RUNNING and p is not None and p[0] > 0

    def host_point(self, t_s: float) -> None:
        """Not modelled: a host-issued link has one lane (``HardwareSpec.validate``)."""
        raise NotImplementedError("a host-issued link with lanes or slices is not modelled")

    def submit(self, record: TransferRecord, t_s: float) -> None:
        """Queue ``record``'s transfer at ``t_s`` (the link must be advanced to ``t_s``);
        it may start at ``record.release_s`` at the earliest."""
        if self._number(record, t_s):
            self._enqueue(record)
        self._fill(t_s)

    def escalate(self, job: TransferRecord, t_s: float) -> None:
        """Give ``job``, queued, delayed or moving, on-demand priority: its slices still
        to start go next."""
        if self._to_on_demand(job, t_s):
            self._fill(t_s)

    def abort(self, job: TransferRecord, t_s: float) -> bool:
        """Stop ``job`` for good: one that never started is cancelled; a started one drops
        its slices not started and its moving ones finish.  An escalated transfer, or one
        whose slices have all started, is not stopped.  True if ``job`` will not land."""
        if job.link_priority == ON_DEMAND or job.state == _DONE or job.state == _CANCELLED:
            return False
        if job.start_s != job.start_s:  # NaN: never started
            return self.cancel(job)
        p = self._progress[job]
        if not p[0]:
            return False
        self._dequeue(job)
        p[0] = 0
        job.state = _CANCELLED
        job.aborted = True
        if not p[1]:  # nothing moving: it stopped at its last slice's end
            del self._progress[job]
        return True

    def idle(self) -> bool:
        """Whether nothing is moving or queued."""
        return self.cur is None and not self._queue


@mypyc_attr(allow_interpreted_subclasses=True)
class SimBackend(Backend):
    """The timed simulator backend (see the module docstring)."""

    closed_form_demand = True

    def __init__(
        self,
        hw: HardwareSpec,
        compute: ComputeModel,
        caches: Sequence[ExpertCache],
        preempt: bool = True,
        fifo: bool = False,
        reserve_at_start: bool = False,
    ) -> None:
        self.compute = compute
        self.caches = caches
        self.num_gpus = len(caches)
        bps, overhead = hw.pcie_bytes_per_s, hw.transfer_overhead_s
        lanes, slices = hw.link_lanes, hw.transfer_slices
        sliced = lanes > 1 or slices > 1
        self.links: list[SimLink] = [
            LaneLink(bps, overhead, lanes, slices, cache=c, fifo=fifo)
            if sliced
            else SimLink(bps, overhead, hw.chunk_bytes, preempt, cache=c, fifo=fifo)
            for c in caches
        ]
        for link in self.links:
            link.reserve_at_start = reserve_at_start
        # the closed form of on-demand loads (demand_loads) is a single server's
        self.closed_form_demand = not sliced
        self.transfers: list[TransferRecord] = []
        self.clock_s = 0.0
        self.busy_compute_s = 0.0
        self._gpu_s = [0.0] * self.num_gpus
        self._wait_s = [0.0] * self.num_gpus
        self._in_experts = False
        self._shared = compute.shared_a_s > 0
        # perf: every MoE layer of an iteration has the same attention/router arguments,
        # so the last duration is memoised (_pre_gate_s).
        self._pre_args: tuple[int, int, int] = (-1, -1, -1)
        self._pre_s = 0.0

    def now(self) -> float:
        """The forward pass's clock."""
        return self.clock_s

    def sync(self) -> float:
        """Advance every link to now."""
        t = self.clock_s
        for link in self.links:
            if link.cur_end_s <= t:
                link.advance(t)
        return t

    def idle_until(self, t_s: float) -> None:
        """Jump the clock forward to ``t_s`` (no-op if it is already later)."""
        if t_s > self.clock_s:
            self.clock_s = t_s

    def _run(self, d: float) -> None:
        self.clock_s += d
        self.busy_compute_s += d

    def _pre_gate_s(self, tokens: int, kv_tokens: int, pairs: int) -> float:
        """Seconds of attention + router (memoised: every MoE layer of an iteration asks
        with the same arguments)."""
        args = (tokens, kv_tokens, pairs)
        if args != self._pre_args:
            c = self.compute
            self._pre_args = args
            self._pre_s = c.attention_s(tokens, kv_tokens, pairs) + c.router_s(tokens)
        return self._pre_s

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention + router, then sync."""
        self._run(self._pre_gate_s(tokens, kv_tokens, pairs))
        self.sync()

    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention + dense MLP."""
        c = self.compute
        self._run(c.attention_s(tokens, kv_tokens, pairs) + c.dense_mlp_s(tokens))

    def lm_head(self, sequences: int) -> None:
        """LM head."""
        self._run(self.compute.lm_head_s(sequences))

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Queue a transfer on ``gpu``'s link at that GPU's current time; it may start
        ``delay_s`` later at the earliest."""
        t = self._link_now(gpu)
        rec = TransferRecord(key, gpu, size_bytes, reason, priority, t)
        if delay_s > 0.0:
            rec.release_s = t + delay_s
        self.transfers.append(rec)
        self.links[gpu].submit(rec, t)
        return rec

    def _link_now(self, gpu: int) -> float:
        """``gpu``'s current time (its own in the expert phase, else the forward pass's),
        its link advanced to it: every transfer landed by then is resident."""
        t = self._gpu_s[gpu] if self._in_experts else self.clock_s
        link = self.links[gpu]
        if link.cur_end_s <= t:
            link.advance(t)
        return t

    def _record(self, gpu: int, key: int) -> TransferRecord | None:
        """The transfer record of ``key``'s cache entry on ``gpu`` (None if absent)."""
        ent = self.caches[gpu].entries.get(key)
        return None if ent is None else ent.record

    def escalate(self, gpu: int, key: int) -> None:
        """Raise an in-flight transfer to on-demand priority."""
        rec = self._record(gpu, key)
        if rec is None:
            return
        self.links[gpu].escalate(rec, self._link_now(gpu))

    def reprioritize(self, gpu: int, key: int, priority: float) -> None:
        """Move a queued, never-started prefetch to ``priority``."""
        rec = self._record(gpu, key)
        if rec is not None:
            self.links[gpu].reprioritize(rec, priority)

    def reprioritize_record(self, gpu: int, record: TransferRecord | None, priority: float) -> None:
        """Move ``record``'s transfer, a queued, never-started prefetch, to ``priority``
        (perf: no second look-up of the cache entry the caller holds)."""
        if record is not None:
            self.links[gpu].reprioritize(record, priority)

    def reprioritizer(self, gpu: int) -> Callable[[TransferRecord, float], None]:
        """``gpu``'s link's own :meth:`SimLink.reprioritize`."""
        return self.links[gpu].reprioritize

    def cancel(self, gpu: int, key: int) -> bool:
        """Cancel a queued, never-started transfer."""
        rec = self._record(gpu, key)
        if rec is None or not self.links[gpu].cancel(rec):
            return False
        rec.cancelled = True
        rec.start_s = rec.end_s = rec.submit_s
        return True

    def abort(self, gpu: int, key: int) -> bool:
        """Stop ``key``'s transfer (:meth:`SimLink.abort` at ``gpu``'s current time)."""
        rec = self._record(gpu, key)
        if rec is None:
            return False
        t = self._link_now(gpu)
        if rec.start_s != rec.start_s:  # NaN: never started
            return self.cancel(gpu, key)
        return self.links[gpu].abort(rec, t)

    def begin_experts(self, layer: int, tokens: int) -> None:
        """Shared experts, then every GPU starts its experts at the forward pass's clock."""
        if self._shared:
            self._run(self.compute.shared_s(tokens))
        n = self.num_gpus
        if n == 1:  # perf: in place, no two new lists per layer step
            self._gpu_s[0] = self.clock_s
            self._wait_s[0] = 0.0
        else:
            self._gpu_s = [self.clock_s] * n
            self._wait_s = [0.0] * n
        self._in_experts = True

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """One expert FFN on ``gpu`` (a segment: ``fraction`` of it, as a vertical split
        divides the FFN's columns and so its work)."""
        c = self.compute
        d = fraction * (c.expert_a_s + c.expert_b_s * tokens)
        self._gpu_s[gpu] += d
        self.busy_compute_s += d

    def experts(
        self,
        gpu: int,
        tokens: list[int],
        fractions: list[float] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        """Several experts on ``gpu``: ``n * a + b * sum(tokens)`` (weighted by the
        segments' fractions)."""
        c = self.compute
        if fractions is None:
            total = 0  # perf: a loop, not sum(), which the compiled build calls generically
            for t in tokens:
                total += t
            d = len(tokens) * c.expert_a_s + c.expert_b_s * total
        else:
            a, b = c.expert_a_s, c.expert_b_s
            d = sum(f * (a + b * t) for t, f in zip(tokens, fractions, strict=True))
        self._gpu_s[gpu] += d
        self.busy_compute_s += d

    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Advance ``gpu``'s link event by event until one of ``keys`` is resident."""
        link, entries = self.links[gpu], self.caches[gpu].entries
        t0 = self._gpu_s[gpu]
        if link.cur_end_s <= t0:
            link.advance(t0)
        t = t0
        while True:
            for k in keys:
                if entries[k].resident:  # every waited-for key is in flight or resident
                    if t > t0:
                        self._gpu_s[gpu] = t
                        self._wait_s[gpu] += t - t0
                    return k
            if link.cur_end_s == INF:  # nothing moving and nothing to be released
                raise RuntimeError(
                    f"GPU {gpu} waits for experts {list(keys)} that are not in flight"
                )
            t = link.cur_end_s
            link.advance(t)

    def catch_up(self, gpu: int) -> None:
        """Advance ``gpu``'s link to that GPU's clock (its landed transfers resident)."""
        self._link_now(gpu)

    def link_idle(self, gpu: int) -> bool:
        """Nothing moving on ``gpu``'s link and nothing queued or waiting for release
        (the release entries of cancelled delayed prefetches do not count)."""
        link = self.links[gpu]
        return link.cur is None and link.cur_end_s == INF and not link._queue

    def demand_timing(self, tokens: int, kv_tokens: int, pairs: int) -> DemandTiming:
        """The closed form's constants for an iteration's layers (see
        :class:`DemandTiming`); every duration is the float :meth:`pre_gate`,
        :meth:`begin_experts`, :meth:`experts` and :meth:`expert` compute."""
        c = self.compute
        shared = c.shared_s(tokens) if self._shared else None
        pre = self._pre_gate_s(tokens, kv_tokens, pairs)
        return DemandTiming(pre, shared, c.expert_a_s, c.expert_b_s)

    def demand_loads(self, keys: list[int], size_bytes: int, t_s: float) -> list[TransferRecord]:
        """The closed form of on-demand loads on GPU 0's idle link (see
        :meth:`Backend.demand_loads`): load ``i`` starts when load ``i - 1`` ends and
        takes ``overhead_s + size / bytes_per_s`` (on-demand loads are never paused).
        Every sum is taken in the order :class:`SimLink` takes it, so the records and
        the link's busy time agree with the event-driven path to the last bit
        (``tests/test_engine_demand.py``)."""
        link = self.links[0]
        bps, overhead = link.bytes_per_s, link.overhead_s
        transfers = self.transfers
        busy = link.busy_s
        t = t_s
        records: list[TransferRecord] = []
        seq = link._seq
        for key in keys:
            rec = TransferRecord(key, 0, size_bytes, "on_demand", ON_DEMAND, t_s)
            rec.start_s = t
            end = (t + overhead) + size_bytes / bps
            busy += end - t
            rec.end_s = t = end
            rec.left_bytes = 0
            rec.seq = seq
            seq += 1
            rec.state = _DONE
            records.append(rec)
        transfers += records
        link._seq = seq
        link.busy_s = busy
        link.started += len(records)
        return records

    def drain(self) -> None:
        """Let the prefetches still in flight land."""
        for link in self.links:
            link.advance(INF)

    def link_busy_s(self) -> float:
        """Modelled busy time of every link."""
        return sum(link.busy_s for link in self.links)

    def end_experts(self) -> float:
        """The layer ends when the slowest GPU is done."""
        self._in_experts = False
        if self.num_gpus == 1:
            self.clock_s = self._gpu_s[0]
            return self._wait_s[0]
        self.clock_s = max(self._gpu_s)
        return max(self._wait_s)


@mypyc_attr(allow_interpreted_subclasses=True)
class InstantBackend(Backend):
    """The hit-rate-only backend: no time at all.

    A transfer issued during a layer step (prefetch or on-demand) becomes resident at
    the next :meth:`sync` (the start of the next layer step), or at once when the
    Runner waits for it; so a prefetch issued at layer ``l`` for layer ``l + 1`` is a
    HIT there, and an access that finds its expert in flight is LATE but costs nothing.
    """

    def __init__(self, caches: Sequence[ExpertCache]) -> None:
        self.caches = caches
        self.num_gpus = len(caches)
        self.transfers: list[TransferRecord] = []
        self._pending: list[TransferRecord] = []
        self.clock_s = 0.0
        self.busy_compute_s = 0.0

    def now(self) -> float:
        """Always 0."""
        return 0.0

    def sync(self) -> float:
        """Land every pending transfer."""
        if self._pending:
            for rec in self._pending:
                if not rec.cancelled:
                    self._land(rec)
            self._pending.clear()
        return self.now()

    def _land(self, rec: TransferRecord) -> None:
        """``rec``'s expert is resident now (the replay backend copies it first)."""
        self.caches[rec.gpu].complete(rec.key)

    def idle_until(self, t_s: float) -> None:
        """No clock."""

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Sync: land what was issued in the previous step."""
        if self._pending:
            self.sync()

    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """No time."""

    def lm_head(self, sequences: int) -> None:
        """No time."""

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Record the transfer; it lands at the next sync (``delay_s`` is ignored: there
        is no clock, so a matcher's latency cannot be modelled here)."""
        rec = TransferRecord(key, gpu, size_bytes, reason, priority, self.now())
        rec.start_s = rec.end_s = rec.submit_s
        self.transfers.append(rec)
        self._pending.append(rec)
        return rec

    def escalate(self, gpu: int, key: int) -> None:
        """Nothing to reorder."""

    def cancel(self, gpu: int, key: int) -> bool:
        """Drop a transfer issued in this step (it has not landed yet)."""
        for rec in self._pending:
            if rec.key == key and rec.gpu == gpu and not rec.cancelled:
                rec.cancelled = True
                return True
        return False

    def begin_experts(self, layer: int, tokens: int) -> None:
        """No time."""

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """No time."""

    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Land everything in flight and return the first of ``keys``."""
        self.sync()
        for k in keys:
            if self.caches[gpu].is_resident(k):
                return k
        raise RuntimeError(f"GPU {gpu} waits for experts {list(keys)} that are not in flight")

    def end_experts(self) -> float:
        """No stall without a clock."""
        return 0.0


@mypyc_attr(allow_interpreted_subclasses=True)
class LinkStepBackend(InstantBackend):
    """The hit-rate-only backend whose prefetches take their time on the link.

    It keeps a clock of modelled compute only (attention, router, shared and routed
    experts, LM head; :class:`ComputeModel`), never of stalls: an access that waits for
    an expert costs nothing, as in :class:`InstantBackend`, and no time metric is
    reported.  A prefetch (any transfer but an on-demand load) queues on its GPU's link
    in submission order and needs ``transfer_overhead_s + size_bytes / pcie`` of that
    clock; the link moves the head of its queue while the GPU computes, and a prefetch is
    resident once its time is done.  So a prefetch issued ``d`` layers ahead is a hit
    only if its bytes cross the link in the compute of those ``d`` layers, behind the
    prefetches queued before it.

    The stall model is one of preemption (``engine.preempt``): an on-demand load, and
    the rest of a late prefetch an access waits for, move while the GPU computes
    nothing and the other prefetches are paused, so neither takes any of this clock;
    they are resident when the access asks, and a late prefetch leaves its link queue.
    Queued prefetches keep their submission order (the timed link orders them by
    priority); a cancelled prefetch that has not started leaves its queue.
    """

    def __init__(
        self, hw: HardwareSpec, compute: ComputeModel, caches: Sequence[ExpertCache]
    ) -> None:
        super().__init__(caches)
        self.compute = compute
        self._bytes_per_s = hw.pcie_bytes_per_s
        self._overhead_s = hw.transfer_overhead_s
        self._t_s = 0.0  # modelled compute so far (seconds)
        self._gpu_s = [0.0] * self.num_gpus  # each GPU's time in the expert phase
        self._link_s = [0.0] * self.num_gpus  # the time each link has been advanced to
        self._queues: list[list[TransferRecord]] = [[] for _ in range(self.num_gpus)]
        self._left_s: dict[int, float] = {}  # seq of a queued prefetch -> its time left
        self._seq = 0
        self._in_experts = False

    def _now_s(self, gpu: int) -> float:
        """``gpu``'s time: its own in the expert phase, else the forward pass's."""
        return self._gpu_s[gpu] if self._in_experts else self._t_s

    def _duration_s(self, size_bytes: int) -> float:
        """Link time of a whole transfer of ``size_bytes``."""
        return self._overhead_s + size_bytes / self._bytes_per_s

    def _dequeue(self, gpu: int, rec: TransferRecord) -> None:
        """Take queued ``rec`` off ``gpu``'s link (it lands or is cancelled elsewhere)."""
        del self._left_s[rec.seq]
        self._queues[gpu].remove(rec)

    def _advance(self, gpu: int, t_s: float) -> None:
        """Let ``gpu``'s link work until ``t_s``; land each prefetch it finishes."""
        queue, left = self._queues[gpu], self._left_s
        now_s = self._link_s[gpu]
        while queue and now_s < t_s:
            head = queue[0]
            now_s = max(now_s, head.release_s)
            if now_s >= t_s:
                break
            run_s = min(left[head.seq], t_s - now_s)
            left[head.seq] -= run_s
            now_s += run_s
            if left[head.seq] <= 0.0:
                del left[head.seq]
                queue.pop(0)
                self._land(head)
        self._link_s[gpu] = max(now_s, t_s)

    def sync(self) -> float:
        """Land the on-demand loads, and every prefetch finished by now."""
        if self._pending:
            super().sync()
        for g in range(self.num_gpus):
            self._advance(g, self._t_s)
        return 0.0

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention and router, then :meth:`sync`."""
        c = self.compute
        self._t_s += c.attention_s(tokens, kv_tokens, pairs) + c.router_s(tokens)
        self.sync()

    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention and the dense MLP."""
        c = self.compute
        self._t_s += c.attention_s(tokens, kv_tokens, pairs) + c.dense_mlp_s(tokens)

    def lm_head(self, sequences: int) -> None:
        """The LM head."""
        self._t_s += self.compute.lm_head_s(sequences)

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """An on-demand load lands at the next sync or wait; a prefetch joins its link's
        queue, startable ``delay_s`` after the GPU's current time."""
        if reason == "on_demand":
            return super().submit(gpu, key, size_bytes, priority, reason, delay_s)
        now_s = self._now_s(gpu)
        self._advance(gpu, now_s)
        rec = TransferRecord(key, gpu, size_bytes, reason, priority, 0.0)
        rec.start_s = rec.end_s = 0.0
        rec.release_s = now_s + delay_s
        rec.seq = self._seq
        self._seq += 1
        self.transfers.append(rec)
        self._left_s[rec.seq] = self._duration_s(size_bytes)
        self._queues[gpu].append(rec)
        return rec

    def _queued(self, gpu: int, key: int) -> TransferRecord | None:
        """``key``'s prefetch still in ``gpu``'s link queue (None if there is none)."""
        ent = self.caches[gpu].entries.get(key)
        rec = None if ent is None else ent.record
        if rec is None or rec.reason == "on_demand" or rec.seq not in self._left_s:
            return None
        return rec

    def cancel(self, gpu: int, key: int) -> bool:
        """Drop ``key``'s prefetch if it has not started (or its on-demand load issued
        in this step)."""
        if super().cancel(gpu, key):
            return True
        rec = self._queued(gpu, key)
        if rec is None:
            return False
        if self._left_s[rec.seq] < self._duration_s(rec.size_bytes):  # started
            return False
        self._dequeue(gpu, rec)
        rec.cancelled = True
        return True

    def abort(self, gpu: int, key: int) -> bool:
        """Drop ``key``'s prefetch, started or not (this link has no chunks: a started one
        stops where it is, its moved share of the bytes wasted)."""
        if self.cancel(gpu, key):
            return True
        rec = self._queued(gpu, key)
        if rec is None:
            return False
        data_left_s = min(self._left_s[rec.seq], rec.size_bytes / self._bytes_per_s)
        self._dequeue(gpu, rec)
        rec.aborted = True
        rec.left_bytes = round(data_left_s * self._bytes_per_s)  # the fixed cost goes first
        return True

    def begin_experts(self, layer: int, tokens: int) -> None:
        """Shared experts, then every GPU starts its experts."""
        if self.compute.shared_a_s > 0:
            self._t_s += self.compute.shared_s(tokens)
        self._gpu_s = [self._t_s] * self.num_gpus
        self._in_experts = True

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """One expert FFN (or ``fraction`` of it) on ``gpu``."""
        c = self.compute
        self._gpu_s[gpu] += fraction * (c.expert_a_s + c.expert_b_s * tokens)

    def catch_up(self, gpu: int) -> None:
        """Land the prefetches ``gpu``'s link has finished by that GPU's time."""
        self._advance(gpu, self._now_s(gpu))

    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Land this step's on-demand loads and what the link has finished by the GPU's
        time; if none of ``keys`` is resident then, land the first of ``keys`` still in
        the link's queue (it moves during the wait, which takes no clock)."""
        super().sync()
        self._advance(gpu, self._now_s(gpu))
        cache = self.caches[gpu]
        for k in keys:
            if cache.is_resident(k):
                return k
        for k in keys:
            rec = self._queued(gpu, k)
            if rec is not None:
                self._dequeue(gpu, rec)
                self._land(rec)
                return k
        raise RuntimeError(f"GPU {gpu} waits for experts {list(keys)} that are not in flight")

    def drain(self) -> None:
        """The run is over: every prefetch still queued lands."""
        super().sync()
        for g, queue in enumerate(self._queues):
            for rec in queue:
                del self._left_s[rec.seq]
                self._land(rec)
            self._queues[g] = []

    def end_experts(self) -> float:
        """The layer ends when the slowest GPU is done; no stall is reported."""
        for g in range(self.num_gpus):
            self._advance(g, self._gpu_s[g])
        self._t_s = max(self._gpu_s)
        self._in_experts = False
        return 0.0
