"""The policy protocol: events in, decisions out.

A policy never reads a clock, never sleeps and never touches the simulator, torch or
the backend, so the same object drives the simulator (:mod:`fmoesim.engine`) and the
GPU replay (:mod:`replay`).  Randomness comes only from the ``np.random.Generator`` in the
:class:`PolicyContext` handed to :meth:`Policy.reset`.

Experts are identified by an integer key ``layer * num_experts + expert``
(:func:`expert_key`).  The cache (:class:`fmoesim.engine.cache.ExpertCache`, one per
GPU) does all the accounting (bytes, residency, pins, in-flight transfers) and calls
the policy's hooks; the policy only chooses.  :meth:`Policy.victim` must be free of
side effects: it peeks, the cache evicts.

Order of events the Runner guarantees, per run and per iteration (one forward pass of
a batch)::

    reset(ctx); learn(held_in)     once per run; learn only when requests are held in
    on_request_start(r)            for each request entering service (before its prefill)
    on_iteration_start(batch) -> Actions or None   (prefetches for the first layers)
    for each MoE layer l:
        on_gate(l, gate)     -> Actions(prefetch=[...], cancel=[...])
        on_access(key, outcome)   for each expert the batch routes to in layer l,
                                  in ascending expert order, all classified before any load;
                                  the accessed experts are pinned
        on-demand loads of layer l's misses, then the gate's cancellations and prefetches
        [on_insert(key) / on_evict(key) / victim(...)]  whenever the cache admits or evicts
    on_iteration_end(batch)
    on_request_end(request_id)     for each request that produced its last token

``on_insert`` is called when a transfer is *issued* (the bytes are reserved at once);
``on_evict`` when an entry leaves the cache, including a cancelled prefetch.

What the protocol offers beyond these events:

- per-request tracing: :attr:`GateView.request_counts` and
  :attr:`GateView.request_probs` for policies that trace per request
  (``uses_request_gates``), and :meth:`Policy.learn` for the offline mode (requests
  held in from the trace);
- the gate as lists: :attr:`GateView.counts_list` / :attr:`GateView.spec_list`, made on
  first use from the iteration's :class:`GateRows`;
- prefetching: a prefetch of a key whose transfer is still queued moves it to the new
  priority; :meth:`Policy.on_iteration_start` may return :class:`Actions` (before layer
  0 runs, for predictions that need no gate, e.g. a semantic search on the iteration's
  embedding); :attr:`Actions.delay_s` holds prefetches back for an asynchronous
  matcher's latency; :class:`PrefetchBatch` hands many prefetches as two lists;
- split experts (``uses_segments``, :meth:`Policy.split_ratio`, :func:`top_key`,
  :func:`bottom_key`), budget groups (:meth:`Policy.cache_groups`), and
  :attr:`Actions.budgets` / :attr:`Actions.evict` / :attr:`Prefetch.reason` for cache
  reconfiguration (MoEpic);
- synchronous prefetching (:meth:`Policy.waits_for_prefetches`: no expert of a layer
  computes before every transfer in flight on its GPU has landed) and whole-layer fetches
  (:meth:`Policy.fetches_whole_layers`);
- :meth:`Policy.report`: a policy's own per-iteration table.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, ClassVar, Final

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.specs.model import ModelSpec


class Outcome(IntEnum):
    """What an expert access found: resident (HIT), still in flight (LATE), or absent (MISS)."""

    HIT = 0
    LATE = 1
    MISS = 2


def expert_key(layer: int, expert: int, num_experts: int) -> int:
    """Integer key of ``(layer, expert)``."""
    return layer * num_experts + expert


def top_key(key: int, num_keys: int) -> int:
    """Key of the top segment of expert ``key`` (MoEpic's split experts; ``num_keys`` =
    ``L * E``): segments live in their own key ranges, ``[n, 2n)`` tops and ``[2n, 3n)``
    bottoms, so the cache holds them as entries of their own."""
    return num_keys + key


def bottom_key(key: int, num_keys: int) -> int:
    """Key of the bottom segment of expert ``key`` (see :func:`top_key`)."""
    return 2 * num_keys + key


def split_key(key: int, num_experts: int) -> tuple[int, int]:
    """``(layer, expert)`` of an integer key."""
    return divmod(key, num_experts)


@dataclass(frozen=True)
class FutureAccesses:
    """The whole access sequence of a run, known in advance (for oracle policies).

    Global layer step ``s`` (the ``s``-th call of :meth:`Policy.on_gate` in a run, see
    :attr:`GateView.step`) accesses ``keys[ptr[s]:ptr[s + 1]]`` in ascending order.
    Only available when the schedule does not depend on timing (static batching).
    """

    ptr: np.ndarray  # (S + 1,) int64 offsets into keys
    keys: np.ndarray  # (A,) int64 expert keys

    @property
    def num_steps(self) -> int:
        """Number of layer steps in the run."""
        return len(self.ptr) - 1


@dataclass(frozen=True)
class LayerTimes:
    """Modelled per-layer times of one decoding token (batch 1, the trace's mean prompt
    as context): attention + router, one expert's FFN, the LM head, and loading one
    whole expert over PCIe (fixed cost + bytes / bandwidth).  The latency metrics
    MoEpic's cache configurator takes as input (§3.4, Algorithm 1)."""

    t_att_s: float
    t_expert_s: float
    t_head_s: float
    t_load_s: float


@dataclass(frozen=True)
class PolicyContext:
    """What a policy learns at :meth:`Policy.reset`.

    ``budget_bytes`` is the expert budget of *each* GPU; with ``num_gpus > 1`` expert
    ``e`` of every layer lives on GPU ``e % num_gpus`` (round-robin, fMoE §5) and each
    GPU has its own cache, whose victims are chosen from that GPU's entries only.
    """

    model: ModelSpec
    budget_bytes: int
    expert_size_bytes: int
    rng: np.random.Generator
    num_gpus: int = 1
    future: FutureAccesses | None = None  # set only for policies with uses_future = True
    times: LayerTimes | None = None  # the simulator's modelled times (None: unknown)

    @property
    def capacity_experts(self) -> int:
        """How many whole experts fit in one GPU's budget."""
        return self.budget_bytes // self.expert_size_bytes

    def gpu_of(self, key: int) -> int:
        """The GPU that holds expert ``key``."""
        return (key % self.model.num_experts) % self.num_gpus


@dataclass(frozen=True)
class RequestInfo:
    """A request entering service."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    embedding: np.ndarray | None = None  # (D,) the prefill iteration's semantic embedding


@dataclass(frozen=True)
class RequestTrace:
    """The whole recorded routing of one request, for :meth:`Policy.learn`.

    Row ``t`` is the request's iteration ``t`` (0 = its prefill).  Arrays are views of
    the trace: treat them as read-only.
    """

    request_id: int
    counts: np.ndarray  # (T, L, E) tokens routed to each expert
    num_tokens: np.ndarray  # (T,) tokens in each iteration
    probs: np.ndarray | None = None  # (T, L, E) mean gate probabilities, if recorded
    embeddings: np.ndarray | None = None  # (T, D) iteration embeddings, if recorded


class BatchInfo:
    """The requests of one iteration (one forward pass).

    ``iteration`` counts forward passes in the run (0, 1, 2...).  ``request_iterations``
    gives each request's own iteration index (0 = its prefill); in static batching all
    are equal, in online (continuous) batching a prefill pass holds only new requests
    and a decode pass holds requests at different points.  ``embeddings`` (B, D): the
    requests' iteration embeddings, if the trace recorded them.

    Immutable, compared by value (the embeddings element by element) and hashed by its
    other fields.  perf: a plain class with read-only properties, not
    ``@dataclass(frozen=True)``, whose generated ``__init__`` is never compiled and cost
    ~9,000 instructions per iteration (2% of LRU's run, callgrind), as for
    :class:`Prefetch`.
    """

    __slots__ = (
        "_iteration",
        "_request_ids",
        "_request_iterations",
        "_num_tokens",
        "_prefill",
        "_embeddings",
    )

    def __init__(
        self,
        iteration: int,
        request_ids: tuple[int, ...],
        request_iterations: tuple[int, ...],
        num_tokens: int,
        prefill: bool,
        embeddings: np.ndarray | None = None,
    ) -> None:
        self._iteration = iteration
        self._request_ids = request_ids
        self._request_iterations = request_iterations
        self._num_tokens = num_tokens
        self._prefill = prefill
        self._embeddings = embeddings

    @property
    def iteration(self) -> int:
        """Forward passes before this one in the run."""
        return self._iteration

    @property
    def request_ids(self) -> tuple[int, ...]:
        """The batch's request ids."""
        return self._request_ids

    @property
    def request_iterations(self) -> tuple[int, ...]:
        """Each request's own iteration index (0 = its prefill)."""
        return self._request_iterations

    @property
    def num_tokens(self) -> int:
        """Tokens in this forward pass."""
        return self._num_tokens

    @property
    def prefill(self) -> bool:
        """Whether this pass is a prefill."""
        return self._prefill

    @property
    def embeddings(self) -> np.ndarray | None:
        """(B, D) per-request iteration embeddings, or None."""
        return self._embeddings

    def _fields(self) -> tuple[int, tuple[int, ...], tuple[int, ...], int, bool]:
        return (
            self._iteration,
            self._request_ids,
            self._request_iterations,
            self._num_tokens,
            self._prefill,
        )

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchInfo):
            return NotImplemented
        a, b = self._embeddings, other._embeddings
        same = a is b or (a is not None and b is not None and np.array_equal(a, b))
        return same and self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())  # equal batches have equal fields

    def __reduce__(self) -> tuple[type[BatchInfo], tuple[object, ...]]:
        return (BatchInfo, (*self._fields(), self._embeddings))

    def __repr__(self) -> str:
        return (
            f"BatchInfo(iteration={self._iteration!r}, request_ids={self._request_ids!r}, "
            f"request_iterations={self._request_iterations!r}, "
            f"num_tokens={self._num_tokens!r}, prefill={self._prefill!r}, "
            f"embeddings={self._embeddings!r})"
        )


class GateRows:
    """One iteration's gate array, ``(L, E)``: each layer's row as an array and as a Python
    list, each made on first use (the Runner shares one between an iteration's gates).

    perf: compiled, a row's view costs ~900 instructions and its ``tolist()`` as much
    again, while one ``tolist()`` of a 32-layer array costs about a quarter of its rows'
    views and lists; a policy that reads lists (the prefetching baselines) takes no
    views at all.
    """

    __slots__ = ("array", "_lists")

    def __init__(self, array: np.ndarray) -> None:
        self.array = array  # (L, E)
        self._lists: list[list[Any]] | None = None

    def row(self, layer: int) -> np.ndarray:
        """Row ``layer`` as an array (a view)."""
        return self.array[layer]  # type: ignore[no-any-return]

    def row_list(self, layer: int) -> list[Any]:
        """Row ``layer`` as a Python list."""
        lists = self._lists
        if lists is None:
            lists = self._lists = self.array.tolist()
        return lists[layer]


class GateView:
    """The gate output of one layer for the current batch, as revealed by the trace.

    ``counts`` (E,) tokens routed to each expert (summed over the batch: a decode batch
    needs the union of its requests' experts); ``probs`` (E,) the token-weighted mean
    gate probability (None unless the policy sets ``uses_probs`` and the trace has
    them); ``spec_next`` (E,) the speculative probabilities of layer ``layer + 1``
    computed one layer early (None unless ``uses_spec``, the trace has them and they are
    valid for every request of the batch; at the last layer it predicts layer 0 of the
    next iteration of the requests that keep decoding, from this iteration's last hidden
    state, as AdapMoE and MoEpic do); ``step`` is the global layer-step index
    (see :class:`FutureAccesses`); ``request_counts`` (B, E) the same counts per request
    of the batch, in :attr:`BatchInfo.request_ids` order (None unless the policy sets
    ``uses_request_gates``); ``request_probs`` (B, E) each request's mean gate
    probabilities (None unless the policy sets both ``uses_request_gates`` and
    ``uses_probs`` and the trace has probabilities).  ``counts_list`` and ``spec_list``
    are ``counts`` and ``spec_next`` as Python lists (``tolist()``), for policies that
    loop over experts.  Treat every array and list as read-only.

    The Runner passes ``count_rows`` / ``spec_rows`` (:class:`GateRows`, shared by the
    iteration's gates) instead of ``counts`` / ``spec_next``, with ``spec_layer`` the row
    of ``spec_next``; the arrays and lists are then made on first use (perf: a
    prefetching baseline reads only lists, ~6% of ProMoE's run in row views and
    ``tolist()`` calls, callgrind).
    """

    __slots__ = (
        "layer",
        "num_tokens",
        "probs",
        "step",
        "request_counts",
        "request_probs",
        "_counts",
        "_counts_list",
        "_spec",
        "_spec_list",
        "_count_rows",
        "_spec_rows",
        "_spec_layer",
    )

    def __init__(
        self,
        layer: int,
        counts: np.ndarray | None,
        num_tokens: int,
        probs: np.ndarray | None = None,
        spec_next: np.ndarray | None = None,
        step: int = 0,
        request_counts: np.ndarray | None = None,
        request_probs: np.ndarray | None = None,
        count_rows: GateRows | None = None,
        spec_rows: GateRows | None = None,
        spec_layer: int = -1,
    ) -> None:
        if (counts is None) == (count_rows is None):
            raise ValueError("a gate needs its counts or the iteration's count rows (one)")
        self.layer = layer
        self.num_tokens = num_tokens
        self.probs = probs
        self.step = step
        self.request_counts = request_counts
        self.request_probs = request_probs
        self._counts = counts
        self._counts_list: list[int] | None = None
        self._spec = spec_next
        self._spec_list: list[float] | None = None
        self._count_rows = count_rows
        self._spec_rows = spec_rows if spec_next is None and spec_layer >= 0 else None
        self._spec_layer = spec_layer

    @property
    def counts(self) -> np.ndarray:
        """(E,) tokens routed to each expert."""
        c = self._counts
        if c is None:
            rows = self._count_rows
            assert rows is not None  # one of the two, checked at construction
            c = self._counts = rows.row(self.layer)
        return c

    @property
    def counts_list(self) -> list[int]:
        """``counts`` as a Python list."""
        c = self._counts_list
        if c is None:
            rows = self._count_rows
            c = self._counts_list = (
                self.counts.tolist() if rows is None else rows.row_list(self.layer)
            )
        return c

    @property
    def spec_next(self) -> np.ndarray | None:
        """(E,) speculative probabilities of the next layer, or None."""
        s = self._spec
        if s is None and self._spec_rows is not None:
            s = self._spec = self._spec_rows.row(self._spec_layer)
        return s

    @property
    def spec_list(self) -> list[float] | None:
        """``spec_next`` as a Python list, or None."""
        s = self._spec_list
        if s is None:
            rows = self._spec_rows
            if rows is not None:
                s = self._spec_list = rows.row_list(self._spec_layer)
            elif self._spec is not None:
                s = self._spec_list = self._spec.tolist()
        return s


class Prefetch:
    """Ask the engine to load expert ``key``; lower ``priority`` values go first.

    ``reason`` labels the transfer in the log: ``"prefetch"`` or ``"configure"`` (a
    cache reconfiguration, e.g. MoEpic's, whose bytes are reported apart).

    Priorities only order prefetches among themselves: an on-demand load always goes
    first.  Prefetching a key that is resident, or whose transfer has started, does
    nothing; prefetching a key whose transfer is still queued moves it to ``priority``
    (the latest decision wins, as MoE-Infinity's I/O thread re-ranks its queue).

    Immutable, compared and hashed by value like a frozen dataclass.  perf: a plain
    class with read-only properties, not ``@dataclass(frozen=True)``: a frozen
    dataclass's generated ``__init__`` sets each field through ``object.__setattr__``
    and is never compiled, and prefetching policies build several per layer step.
    """

    __slots__ = ("_key", "_priority", "_reason")

    def __init__(self, key: int, priority: float = 1.0, reason: str = "prefetch") -> None:
        self._key = key
        self._priority = priority
        self._reason = reason

    @property
    def key(self) -> int:
        """The expert (or segment) key to load."""
        return self._key

    @property
    def priority(self) -> float:
        """Lower goes first (among prefetches)."""
        return self._priority

    @property
    def reason(self) -> str:
        """The transfer's label in the log."""
        return self._reason

    def _fields(self) -> tuple[int, float, str]:
        return (self._key, self._priority, self._reason)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Prefetch):
            return NotImplemented
        return self._fields() == other._fields()

    def __hash__(self) -> int:
        return hash(self._fields())

    def __reduce__(self) -> tuple[type[Prefetch], tuple[int, float, str]]:
        return (Prefetch, self._fields())

    def __repr__(self) -> str:
        return f"Prefetch(key={self._key!r}, priority={self._priority!r}, reason={self._reason!r})"


class PrefetchBatch(Sequence[Prefetch]):
    """Prefetches given as two lists, ``keys`` and ``priorities`` (reason
    ``"prefetch"``): the sequence ``[Prefetch(k, p) for k, p in zip(keys, priorities)]``,
    in that order, for a policy that re-ranks hundreds of predictions a layer step.
    ``keys`` and ``priorities`` may instead be two 1-D numpy arrays (integer keys
    ``(n,)``, float priorities ``(n,)``); iterating or indexing gives Python numbers
    all the same.

    perf: the Runner reads the two lists (no object per prefetch, no property calls);
    given arrays on one GPU, it passes over the keys resident when the batch arrives
    without looking at each (:meth:`fmoesim.engine.runner.Runner.apply`).  Iterating
    or indexing builds :class:`Prefetch` objects, for everything else."""

    __slots__ = ("keys", "priorities")

    def __init__(self, keys: Any, priorities: Any) -> None:
        if len(keys) != len(priorities):
            raise ValueError(f"{len(keys)} keys but {len(priorities)} priorities")
        self.keys = keys
        self.priorities = priorities

    def _lists(self) -> tuple[list[Any], list[Any]]:
        """``keys`` and ``priorities`` as lists of Python numbers."""
        keys, prios = self.keys, self.priorities
        return (
            keys.tolist() if isinstance(keys, np.ndarray) else keys,
            prios.tolist() if isinstance(prios, np.ndarray) else prios,
        )

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            keys, prios = self._lists()
            return [Prefetch(k, p) for k, p in zip(keys[i], prios[i], strict=True)]
        k, p = self.keys[i], self.priorities[i]  # one element, not the arrays converted
        return Prefetch(
            k.item() if isinstance(k, np.generic) else k,
            p.item() if isinstance(p, np.generic) else p,
        )

    def __iter__(self) -> Iterator[Prefetch]:
        keys, prios = self._lists()
        return (Prefetch(k, p) for k, p in zip(keys, prios, strict=True))

    def __repr__(self) -> str:
        keys, prios = self._lists()
        return f"PrefetchBatch(keys={keys!r}, priorities={prios!r})"


@dataclass
class Actions:
    """A policy's answer to :meth:`Policy.on_gate` (or :meth:`Policy.on_iteration_start`).

    ``prefetch``: loads to issue, in the order given (the cache admits them one by one
    and may evict for each; with ``engine.reserve=start`` a prefetch reserves its bytes,
    evicting then, when its copy starts).  ``cancel``: keys whose prefetch is queued on
    the link and has not started; a cancelled prefetch frees its reserved bytes and is
    reported back through :meth:`Policy.on_evict`.  Cancelling anything else does nothing.
    ``abort``: keys whose transfer stops even if it has started: a queued one is
    dropped as by ``cancel``, a moving one stops at its next chunk boundary (the bytes
    moved so far are wasted), and the entry is reported back through
    :meth:`Policy.on_evict`; a transfer an access waits for, or one that has landed, is
    left alone.  ``delay_s``: the new prefetches reserve their bytes now (unless
    ``engine.reserve=start``) but may not start moving before ``delay_s`` seconds from
    now (the latency of an asynchronous matcher that decided them, fMoE §4.3); one that
    is needed earlier loads on demand at once.  A policy states the delay as a
    configured number; it never reads a clock.
    The hit-rate-only backend applies it on the modelled compute clock of
    ``engine.landing=link`` and ignores it with ``landing=next_step``.

    ``evict``: keys to drop now: a resident one leaves the cache, a queued one is
    cancelled; one pinned by the current layer stays (e.g. segments cut at an old split
    ratio, or what a policy without a cache no longer needs).  For policies with budget
    groups (:meth:`Policy.cache_groups`): ``budgets`` sets new group budgets in bytes
    (shrinking evicts within the group, the policy's ``victim`` choosing).  Both are
    applied before the cancellations and the prefetches.

    perf: ``__init__`` is written out (a dataclass keeps a class's own ``__init__``) so
    that the compiled build compiles it; the generated one stays interpreted.
    """

    prefetch: Sequence[Prefetch] = ()
    cancel: Sequence[int] = ()
    delay_s: float = 0.0
    evict: Sequence[int] = ()
    budgets: dict[int, int] | None = None
    abort: Sequence[int] = ()

    def __init__(
        self,
        prefetch: Sequence[Prefetch] = (),
        cancel: Sequence[int] = (),
        delay_s: float = 0.0,
        evict: Sequence[int] = (),
        budgets: dict[int, int] | None = None,
        abort: Sequence[int] = (),
    ) -> None:
        self.prefetch = prefetch
        self.cancel = cancel
        self.delay_s = delay_s
        self.evict = evict
        self.budgets = budgets
        self.abort = abort


#: The empty ``Actions`` (Final: the compiled build reads it as a constant).
NO_ACTIONS: Final = Actions()


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy(ABC):
    """Base class of every offloading policy.

    Subclasses set ``name`` and implement :meth:`victim`; every other hook defaults to
    doing nothing.  Class flags tell the Runner what to build (each costs time):
    ``uses_probs`` / ``uses_spec`` fill :attr:`GateView.probs` / ``spec_next``;
    ``uses_future`` fills :attr:`PolicyContext.future` (static batching only);
    ``uses_request_gates`` fills :attr:`GateView.request_counts`;
    ``uses_segments`` makes the engine model split experts (MoEpic): an expert of a layer
    with :meth:`split_ratio` ``θ > 0`` may be held as a top segment (key
    :func:`top_key`, ``θ`` of its bytes) and a bottom segment (:func:`bottom_key`, the
    rest); an access is a HIT only when the whole expert or both segments are resident,
    resident parts compute (their share of the expert's time) while missing ones load,
    and a miss loads the top into the layer's group and the bottom into the buffer
    (the whole expert into the buffer where the layer has no room for tops).
    """

    name: ClassVar[str] = "policy"
    uses_probs: ClassVar[bool] = False
    uses_spec: ClassVar[bool] = False
    uses_future: ClassVar[bool] = False
    uses_request_gates: ClassVar[bool] = False
    uses_segments: ClassVar[bool] = False

    ctx: PolicyContext

    def reset(self, ctx: PolicyContext) -> None:
        """Start a fresh run: forget everything learned in a previous one."""
        self.ctx = ctx

    def learn(self, requests: Sequence[RequestTrace]) -> None:
        """Offline knowledge: ``requests`` of the trace held in from serving (their
        whole routing), given once after :meth:`reset` when the run holds requests in
        (``serving.held_in_fraction``).  Policies that keep no history ignore it."""

    def on_request_start(self, request: RequestInfo) -> None:
        """A request enters service."""

    def on_iteration_start(self, batch: BatchInfo) -> Actions | None:
        """An iteration (forward pass) of ``batch`` begins; may return prefetches (e.g.
        for the first layers, which no gate precedes)."""
        return None

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """The gate of ``layer`` is known; return prefetches and cancellations."""
        return NO_ACTIONS

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Expert ``key`` is needed now and was found as ``outcome``."""

    def on_insert(self, key: int) -> None:
        """The cache admitted ``key`` (its transfer was issued)."""

    def on_evict(self, key: int) -> None:
        """``key`` left the cache (evicted, or its queued prefetch was cancelled)."""

    @abstractmethod
    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """Choose which of ``candidates`` to evict to make room for ``incoming``.

        ``candidates`` holds the resident, unpinned entries of the GPU whose cache
        needs room (membership tests are O(1); iteration is in admission order).
        ``incoming`` is the key being admitted.  Must not change any state.
        """

    def on_iteration_end(self, batch: BatchInfo) -> None:
        """An iteration finished."""

    def on_request_end(self, request_id: int) -> None:
        """A request produced its last token."""

    def cache_groups(self) -> dict[int, int] | None:
        """Budget groups of the per-GPU cache, ``{group: bytes}``, or None for one
        budget (the default).  Asked once after :meth:`reset` and :meth:`learn`; only
        policies with ``uses_segments`` may have them, and their groups are fixed by the
        engine: group ``l`` holds layer ``l``'s top segments, group ``-1`` (the buffer)
        whole experts and bottom segments."""
        return None

    def split_ratio(self, layer: int) -> float:
        """``uses_segments`` policies: the share ``θ`` of an expert of ``layer`` that its
        top segment holds (0 = not split); read when a segment is loaded."""
        return 0.0

    def fetches_whole_layers(self) -> bool:
        """True: every expert of a layer is fetched on demand when the layer runs, routed
        or not (DeepSpeed-Inference's expert-agnostic layer-wise offloading).  The
        engine then loads the layer's experts missing from the cache in expert order,
        admitted like on-demand loads; the layer waits for all of them, computes only the
        routed ones and counts an access only for those.  Read once, at the start of a
        run."""
        return False

    def keeps_unused_experts(self) -> bool:
        """False: at its gates the policy evicts every expert it holds that the current
        or the next layer does not use (Pre-gated MoE's "no cache"), so experts made
        resident before the run (``cache.preload``) would not stay: the engine refuses
        that combination.  Read once, at the start of a run."""
        return True

    def waits_for_prefetches(self) -> bool:
        """True: prefetching is synchronous.  On each GPU, no expert of a layer computes
        before every transfer in flight there (the gate's prefetches and the layer's own
        loads) has landed, so what the gate prefetched is resident when the next layer
        runs, and the GPU is blocked (stalled) while it waits, whether the guesses were
        right or not.  Read once, at the start of a run."""
        return False

    def report(self) -> dict[str, np.ndarray] | None:
        """The policy's own table of the run (equal-length columns), e.g. fMoE's
        per-iteration similarity scores; None (the default) when it keeps none.  The
        CLI writes it as ``policy_log.parquet``."""
        return None
