"""Shared pieces of the prefetching baselines (dependency, BrainStorm, speculative ones).

Not a policy: helpers for ranking experts, building prefetch actions, a layer guard and a
global LRU with that guard.

The guard: a victim chosen while the current layer runs should not be an expert that
layer routes to.  The Runner already pins those experts before it admits the gate's
prefetches, so the guard only decides between candidates when a pinned expert has
been computed and released (loads deferred for lack of room), and keeps the policies
correct should the admission order change; subclasses extend it with "predicted for
the next layer" (BrainStorm, Pre-gated MoE).  It is built lazily, at the first victim
asked for after a gate.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable

import numpy as np
from mypy_extensions import mypyc_attr, trait

from policies.base import Actions, GateView, PolicyContext, Prefetch
from policies.lru import LRU, _any_order


def top_experts(scores: np.ndarray, n: int) -> list[int]:
    """Indices of the ``n`` largest ``scores``, largest first, ties to the smaller index.

    perf: one ``argmax`` for ``n == 1``; for a few of at most 64 experts or a small
    layer, the selection of :func:`_top_of_list` on one ``tolist()``; otherwise a
    stable argsort of the negated scores.
    """
    if n <= 0:
        return []
    if n == 1:
        return [int(scores.argmax())]
    top = _top_of_list(scores.tolist(), n) if len(scores) <= 64 else None
    if top is not None:
        return top
    return (-scores).argsort(kind="stable")[:n].tolist()


def top_spec(gate: GateView, n: int) -> list[int]:
    """:func:`top_experts` of ``gate.spec_next`` (not None), read from ``gate.spec_list``
    when that needs no argsort (perf: then the gate makes no array for it)."""
    s = gate.spec_list
    assert s is not None, "top_spec needs a speculative prediction"
    top = _top_of_list(s, n)
    if top is not None:
        return top
    spec = gate.spec_next
    assert spec is not None
    return top_experts(spec, n)


def _top_of_list(s: list[float], n: int) -> list[int] | None:
    """:func:`top_experts` on a list where it is cheap, None where an argsort should do it.

    perf: no sort and no numpy call for a few of at most 64 experts: the best two kept
    in local variables in one pass for ``n == 2`` (Mixtral's top-k), else ``n`` passes of
    selection; a Python sort for other layers of at most 16 experts.
    """
    if n <= 0:
        return []
    E = len(s)
    if n <= 4 and E <= 64:
        m = min(n, E)
        if m == 2:  # perf: top-2 (Mixtral's top_k), the best two in local variables
            b1, v1, b2, v2 = 0, s[0], 1, s[1]
            if v2 > v1:
                b1, v1, b2, v2 = 1, s[1], 0, s[0]
            for i in range(2, E):
                v = s[i]
                if v > v2:  # an equal score keeps the smaller index ahead
                    if v > v1:
                        b2, v2 = b1, v1
                        b1, v1 = i, v
                    else:
                        b2, v2 = i, v
            return [b1, b2]
        chosen: list[int] = []
        for _ in range(m):
            best, best_v = -1, 0.0
            for i in range(E):
                v = s[i]
                if (best < 0 or v > best_v) and i not in chosen:
                    best, best_v = i, v
            chosen.append(best)
        return chosen
    if E <= 16:
        order = sorted(range(E), key=s.__getitem__, reverse=True)  # stable
        return order[:n]
    return None


def routed_by_count(gate: GateView) -> list[int]:
    """Experts the gate routes to, most tokens first, ties to the smaller index.

    perf: one token routes to its top-k with one token each, so no sort is needed then;
    the nonzero entries are found on ``gate.counts_list`` (``np.flatnonzero`` on a row of
    a few dozen experts costs several times more).
    """
    c = gate.counts_list
    nz = [e for e in range(len(c)) if c[e]]
    if gate.num_tokens > 1 and len(nz) > 1:
        nz.sort(key=c.__getitem__, reverse=True)  # stable: equal counts keep id order
    return nz


class PrefetchTable:
    """The prefetches of one layer distance, ``Prefetch(key, distance + rank / E)``, each
    built once and handed out again (they are immutable values).

    Priority (lower = earlier) is ``distance + rank / num_experts``: nearer layers first
    (MoE-Infinity §5.1's layer proximity), then the order given (``rank`` < ``E``).

    perf: the prefetching baselines name the same (key, rank) pairs gate after gate;
    building, tracking and freeing a new Prefetch each time cost ~300 instructions
    (compiled, callgrind), 3-4% of ProMoE's and BrainStorm's runs.
    """

    def __init__(self, num_keys: int, num_experts: int, distance: float = 1.0) -> None:
        self._E = num_experts
        self._distance = float(distance)
        # built on first use, so a large model pays only for the pairs it names
        self._made: list[list[Prefetch | None]] = [[None] * num_experts for _ in range(num_keys)]

    def get(self, key: int, rank: int) -> Prefetch:
        """``Prefetch(key, distance + rank / num_experts)``."""
        row = self._made[key]
        p = row[rank]
        if p is None:
            p = row[rank] = Prefetch(key, self._distance + rank / self._E)
        return p

    def actions(
        self, keys: list[int], cancel: list[int] | None = None, evict: list[int] | None = None
    ) -> Actions:
        """Prefetch ``keys`` in the given order (the first at rank 0); cancel ``cancel``;
        evict ``evict``."""
        return Actions(
            prefetch=[self.get(k, r) for r, k in enumerate(keys)],
            cancel=() if cancel is None else cancel,
            evict=() if evict is None else evict,
        )


def stale_prefetches(issued: list[list[int]], layer: int, counts: list[int]) -> list[int]:
    """The keys prefetched for ``layer`` (``issued[layer]``, emptied here) that its gate
    did not route to (``counts``: the gate's counts as a list, ``gate.counts_list``):
    once the layer has run they are no longer needed for it, so a policy cancels them
    (the engine drops only those still queued and never started).

    Without this, on a link slower than the layers (a 14 ms expert against 1 ms of
    compute) mispredicted prefetches pile up in the queue, hold the budget in flight
    and evict everything resident.
    """
    keys = issued[layer]
    if not keys:
        return []
    issued[layer] = []
    E = len(counts)
    return [k for k in keys if not counts[k % E]]


@trait
@mypyc_attr(allow_interpreted_subclasses=True)
class LayerGuard:
    """Remembers the current gate's layer and counts to protect its routed experts.

    Call :meth:`_guard` at the top of ``on_gate``; :meth:`_guarded` is then true for
    every expert the current layer routes tokens to.  The guard stays until the next gate
    (after the accesses those experts are pinned or not resident, so it is harmless).
    """

    _guard_layer: int = -1
    _guard_counts: list[int] | None = None
    _guard_keys: set[int] | None = None
    _guard_E: int = 1
    _guard_K: int = 1
    _capacity_total: int = 0

    def _guard_reset(self, ctx: PolicyContext) -> None:
        self._guard_layer = -1
        self._guard_counts = None
        self._guard_keys = None
        self._guard_E = ctx.model.num_experts
        self._guard_K = ctx.model.top_k
        self._capacity_total = ctx.capacity_experts * ctx.num_gpus

    def _guard(self, layer: int, counts: list[int]) -> None:
        """Guard the experts ``counts`` (the gate's ``counts_list``) routes to."""
        self._guard_layer = layer
        self._guard_counts = counts
        self._guard_keys = None  # built on first use: most gates never need a victim

    def _guarded(self, key: int) -> bool:
        """Whether ``key`` is routed to by the layer whose gate was seen last."""
        if key // self._guard_E != self._guard_layer:
            return False
        keys = self._guard_keys
        if keys is None:
            base = self._guard_layer * self._guard_E
            c = self._guard_counts
            assert c is not None  # set with the layer
            keys = self._guard_keys = {base + e for e in range(len(c)) if c[e]}
        return key in keys

    def _first_unguarded(self, keys: Iterable[int], candidates: Collection[int]) -> int:
        """The first of ``keys`` that is a candidate and not guarded; else the first that
        is a candidate; -1 if none is."""
        fallback = -1
        every = keys is candidates  # perf: then no membership test per key
        for key in keys:
            if every or key in candidates:
                if not self._guarded(key):
                    return key
                if fallback < 0:
                    fallback = key
        return fallback

    def _routed(self, gate: GateView) -> int:
        """Distinct experts the gate routes to (``top_k`` for one token, no numpy call)."""
        if gate.num_tokens == 1:
            return self._guard_K
        c = gate.counts_list
        return len(c) - c.count(0)

    def _room_experts(self, routed: int) -> int:
        """How many prefetches fit next to the ``routed`` experts of the current layer."""
        return self._capacity_total - routed


@mypyc_attr(allow_interpreted_subclasses=True)
class GuardedLRU(LRU, LayerGuard):
    """Global LRU whose victim skips the current layer's routed experts when it can.

    Prefetching a resident expert leaves its recency unchanged (the prefetch is a no-op
    in the engine and not a use).
    """

    def reset(self, ctx: PolicyContext) -> None:
        """Forget recency and the guard."""
        super().reset(ctx)
        self._guard_reset(ctx)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """Least recently used candidate not routed by the current layer (else plain LRU)."""
        order = self._order
        if 8 * len(candidates) < len(order):  # perf: see AdmissionOrder._first_in_order
            key = fallback = -1
            stamp = fallback_stamp = self._stamp + 1
            for k in _any_order(candidates):
                s = order.get(k, -1)
                if s < 0 or (s > stamp and s > fallback_stamp):
                    continue
                if self._guarded(k):
                    if s < fallback_stamp:
                        fallback, fallback_stamp = k, s
                elif s < stamp:
                    key, stamp = k, s
            if key < 0:
                key = fallback
        else:
            key = self._first_unguarded(order, candidates)
        if key < 0:
            raise ValueError("no candidate is tracked by this LRU")
        return key
