"""What a backend must do for the Runner: execute compute and transfers, report time.

The Runner (:mod:`fmoesim.engine.runner`) holds all serving logic and calls these
methods in program order, as a host thread drives CUDA streams.  The simulator backend
(:mod:`fmoesim.engine.sim`) advances a modelled clock; the GPU backend (``replay/``)
issues real copies and matmuls and waits on CUDA events.  Each backend owns one
host-to-device link per GPU and updates the per-GPU :class:`ExpertCache` (``complete``)
when a transfer lands; residency accounting stays in the cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import partial
from typing import Final, NamedTuple

from mypy_extensions import mypyc_attr

from fmoesim.engine.cache import ExpertCache

#: Priority of an on-demand load: ahead of every prefetch (lower values go first).
ON_DEMAND: Final = float("-inf")

# perf: parsed once, not by a float("nan") call per transfer record; Final, so the
# compiled build reads these as constants, not from the module's dict
_NAN: Final = float("nan")


class TransferRecord:
    """One host-to-device transfer: the transfer log row of DESIGN.md.

    ``reason`` is ``"prefetch"``, ``"on_demand"`` or ``"configure"``; ``used`` turns
    True when the expert is first used after this transfer; ``escalated`` when an
    access found it in flight and raised it to on-demand priority; ``preemptions``
    counts the times an on-demand load paused it at a chunk boundary.  A transfer
    cancelled before it started has ``cancelled=True``, moved no bytes and
    ``start_s = end_s = submit_s``.  A transfer aborted after it started
    (:meth:`Backend.abort`) has ``aborted=True``, ``end_s`` the time its last chunk
    landed, and moved ``size_bytes - left_bytes`` (:attr:`moved_bytes`).
    """

    __slots__ = (
        "key",
        "gpu",
        "size_bytes",
        "reason",
        "priority",
        "submit_s",
        "release_s",
        "start_s",
        "end_s",
        "used",
        "escalated",
        "preemptions",
        "cancelled",
        "aborted",
        # the link's own bookkeeping (fmoesim.engine.sim.SimLink): bytes left to move,
        # current queue priority (on-demand once escalated), submission number, state
        "left_bytes",
        "link_priority",
        "seq",
        "state",
    )

    def __init__(
        self, key: int, gpu: int, size_bytes: int, reason: str, priority: float, submit_s: float
    ) -> None:
        self.key = key
        self.gpu = gpu
        self.size_bytes = size_bytes
        self.reason = reason
        self.priority = priority
        self.submit_s = submit_s
        self.release_s = submit_s  # earliest start (later for a delayed prefetch)
        self.start_s = _NAN
        self.end_s = _NAN
        self.used = False
        self.escalated = False
        self.preemptions = 0
        self.cancelled = False
        self.aborted = False
        self.left_bytes = size_bytes
        self.link_priority = priority
        self.seq = 0
        self.state = 0

    @property
    def moved_bytes(self) -> int:
        """Bytes that crossed the link: all of them, none for a cancelled transfer, the
        chunks before the stop for an aborted one."""
        if self.cancelled:
            return 0
        if self.aborted:
            return self.size_bytes - self.left_bytes
        return self.size_bytes

    def __repr__(self) -> str:
        return (
            f"TransferRecord(key={self.key}, gpu={self.gpu}, {self.reason}, "
            f"{self.start_s:.6f}-{self.end_s:.6f}s, used={self.used})"
        )


class DemandTiming(NamedTuple):
    """What the closed form of a demand-only layer step needs from the timed backend,
    for one iteration (every MoE layer of it has the same batch).

    A layer step on one GPU whose link is idle and which issues no prefetches: attention
    and router (``pre_s``); the misses load back to back (:meth:`Backend.demand_loads`);
    the shared experts (``shared_s``, or None when the model has none); the resident
    experts compute as one block (``n * expert_a_s + expert_b_s * tokens``); then each
    miss waits for its load (the stall) and computes.
    """

    pre_s: float
    shared_s: float | None
    expert_a_s: float
    expert_b_s: float


@mypyc_attr(allow_interpreted_subclasses=True)
class Backend(ABC):
    """The operations the Runner needs.  Times are seconds; GPUs are numbered from 0.

    The clock of the forward pass (``now``) advances through the non-expert operators;
    between :meth:`begin_experts` and :meth:`end_experts` each GPU runs its own experts
    (expert parallelism) and the layer ends when the slowest GPU is done.
    """

    caches: Sequence[ExpertCache]
    transfers: list[TransferRecord]  # every transfer submitted, in order (the log)
    busy_compute_s: float  # time the GPUs spent computing (modelled or measured)
    clock_s: float  # closed-form backends: the forward pass's clock (:meth:`now`)
    #: Whether the Runner may time demand-only layer steps in closed form: the backend
    #: implements :meth:`link_idle`, :meth:`demand_timing` and :meth:`demand_loads`, and
    #: its time is nothing but ``clock_s`` and ``busy_compute_s``, which the Runner then
    #: advances itself (the simulator; see ``Runner._layers_closed_form``).
    closed_form_demand: bool = False
    #: Layer steps the Runner timed in closed form (tests and benchmarks read it).
    closed_form_steps: int = 0

    @abstractmethod
    def now(self) -> float:
        """The current time of the forward pass."""

    @abstractmethod
    def sync(self) -> float:
        """Make every transfer finished by now resident in its cache; return now."""

    @abstractmethod
    def idle_until(self, t_s: float) -> None:
        """Nothing to run before ``t_s`` (online serving waits for an arrival)."""

    @abstractmethod
    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention and router of MoE layer ``layer``; then :meth:`sync` (the gate's
        output is known when the router is done, and so is what has landed by then)."""

    @abstractmethod
    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """A whole dense (non-MoE) decoder layer: attention and MLP."""

    @abstractmethod
    def lm_head(self, sequences: int) -> None:
        """The LM head for ``sequences`` next tokens."""

    @abstractmethod
    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Queue a host-to-device copy of ``key`` on ``gpu``'s link; it may not start
        before ``delay_s`` from now (a prefetch waiting for an asynchronous decision)."""

    @abstractmethod
    def escalate(self, gpu: int, key: int) -> None:
        """An access needs in-flight ``key`` now: give its transfer on-demand priority."""

    def reprioritize(self, gpu: int, key: int, priority: float) -> None:
        """Move ``key``'s queued, never-started prefetch to ``priority`` (default: no
        ordering to change)."""

    def reprioritize_record(self, gpu: int, record: TransferRecord | None, priority: float) -> None:
        """:meth:`reprioritize` for the transfer ``record`` (a cache entry's record, as
        :meth:`submit` returned it; None: nothing to move), for a caller that holds it
        (default: by its key)."""
        if record is not None:
            self.reprioritize(gpu, record.key, priority)

    def reprioritizer(self, gpu: int) -> Callable[[TransferRecord, float], None]:
        """:meth:`reprioritize_record` on ``gpu`` as one callable of the record and the
        priority (perf: a caller moving hundreds of prefetches makes one call each)."""
        return partial(self.reprioritize_record, gpu)

    def split(self, gpu: int, key: int, parts: list[int]) -> None:
        """Resident whole expert ``key`` is now the segments ``parts`` in the cache
        (:meth:`fmoesim.engine.cache.ExpertCache.split`), its bytes already on ``gpu``
        (default: nothing to move; the replay slices its device copy)."""

    @abstractmethod
    def cancel(self, gpu: int, key: int) -> bool:
        """Drop ``key``'s transfer if it is queued and has not started; True if dropped."""

    def abort(self, gpu: int, key: int) -> bool:
        """Stop ``key``'s transfer: a queued one that has not started is dropped (as
        :meth:`cancel`), one that has started stops at its next chunk boundary (its
        moved bytes wasted, the record marked ``aborted``); True if it will not land.
        The link moves one transfer at a time, so the caller may free the entry's bytes
        at once: nothing else lands before the stop.  Default: :meth:`cancel` (a backend
        without chunked transfers cannot stop a started copy)."""
        return self.cancel(gpu, key)

    @abstractmethod
    def begin_experts(self, layer: int, tokens: int) -> None:
        """The layer's always-on shared experts run (resident, outside the budget; none
        for most models), then the expert phase starts on every GPU."""

    @abstractmethod
    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """Run resident expert ``key`` on ``tokens`` tokens on ``gpu``; a segment of a
        split expert runs ``fraction`` of the expert's work."""

    def experts(
        self,
        gpu: int,
        tokens: list[int],
        fractions: list[float] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        """Run several resident experts (or segments) back to back on ``gpu``."""
        for i, tok in enumerate(tokens):
            key = -1 if keys is None else keys[i]
            self.expert(gpu, key, tok, 1.0 if fractions is None else fractions[i])

    @abstractmethod
    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Block ``gpu``'s compute until one of ``keys`` is resident; return it."""

    def catch_up(self, gpu: int) -> None:
        """Make every transfer on ``gpu``'s link that has landed by that GPU's current
        time resident in its cache, without moving any clock (default: nothing to do,
        a backend whose residency follows real completions)."""

    def link_idle(self, gpu: int) -> bool:
        """Whether ``gpu``'s link has nothing moving, queued or waiting for release."""
        return False

    def demand_timing(self, tokens: int, kv_tokens: int, pairs: int) -> DemandTiming:
        """The constants of the closed form for one iteration's layers (see
        :class:`DemandTiming`).  Only where :attr:`closed_form_demand` is true."""
        raise NotImplementedError(f"{type(self).__name__} has no closed form for a layer")

    def demand_loads(self, keys: list[int], size_bytes: int, t_s: float) -> list[TransferRecord]:
        """On-demand loads of ``keys`` on GPU 0's idle link, back to back from ``t_s``,
        already finished: their records (in the transfer log, the link's busy time and
        sequence numbers updated), ``end_s`` of each the time it lands.  Only where
        :attr:`closed_form_demand` is true."""
        raise NotImplementedError(f"{type(self).__name__} has no closed form for a layer")

    def drain(self) -> None:
        """The run is over: let every transfer still in flight land (default: none)."""

    def link_busy_s(self) -> float:
        """Seconds the links spent moving data (0 where not modelled or measured)."""
        return 0.0

    def close(self) -> None:
        """Release what the backend holds (threads, device memory); default: nothing."""

    @abstractmethod
    def end_experts(self) -> float:
        """All GPUs finished the layer's experts; return the layer's stall (seconds):
        the longest time any GPU's compute waited for an expert in this layer."""
