"""BrainStorm-style model-level tracing: prefetch and cache by counts over all requests."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from mypy_extensions import mypyc_attr

from policies._prefetching import GuardedLRU, prefetch_actions, stale_prefetches
from policies.base import NO_ACTIONS, Actions, GateView, PolicyContext

CACHE_PRIORITIES = ("lru", "count")


@mypyc_attr(allow_interpreted_subclasses=True)
class BrainStorm(GuardedLRU):
    """Prefetch the next layer's experts by model-level activation counts; LRU cache.

    paper: MoE-Infinity (``003``) §3.2 / §4.1 describe BrainStorm and DeepUM as
    "model-level" tracing: "the expert's usages are accumulated across all requests since
    serving the model".  Fig. 6b: the counts tell that E[3,2] is used more often than
    E[3,1], so it is prefetched first; once the gate shows only E[3,2] is needed, the
    queued prefetch of E[3,1] is cancelled; both E[4,1] and E[4,2] are prefetched (the
    whole next layer, in count order).  Fig. 8b: "model-level tracing with LRU, as in
    DeepUM and BrainStorm"; §2.3 (3) calls the existing caches "LRU or based on
    model-level counts".
    here: ``counts[l, e]`` = tokens routed to expert ``(l, e)`` since the run started,
    over every request (never reset).  At the gate of layer ``l``: add the gate's counts,
    cancel this policy's still-queued prefetches of layer ``l`` that the gate did not
    route to, then prefetch the experts of layer ``l + 1`` by descending count (ties:
    smaller expert id), ``prefetch_experts`` of them (``None`` = the whole layer, as
    Fig. 6b), at most as many as fit next to the current layer's experts, because that
    is what Fig. 6b and its text show (count order, cancellation of the mispredicted,
    both experts of layer 4 prefetched); token counts because they are the model-level
    sum of MoE-Infinity's EAMs.  Knob
    ``cache_priority``: ``"lru"`` (default, Fig. 8b's reading) or ``"count"`` (evict the
    candidate with the lowest model-level count, ties to the oldest admission; the
    "based on model-level counts" reading of §2.3; its victim scan is O(candidates)).
    Victims skip the current layer's routed experts and this gate's predictions for
    the next layer while another candidate exists (a ranked prediction is not evicted to
    make room for a lower-ranked one or for an on-demand load of the current layer);
    prefetching a resident expert does not otherwise refresh its recency.
    ``tests/test_baselines.py`` replays Fig. 6b and Fig. 8b.
    """

    name = "brainstorm"

    def __init__(self, prefetch_experts: int | None = None, cache_priority: str = "lru") -> None:
        if prefetch_experts is not None and int(prefetch_experts) < 1:
            raise ValueError(f"prefetch_experts must be >= 1 or None, got {prefetch_experts}")
        if cache_priority not in CACHE_PRIORITIES:
            raise ValueError(
                f"cache_priority must be one of {CACHE_PRIORITIES}, got {cache_priority!r}"
            )
        self.prefetch_experts = None if prefetch_experts is None else int(prefetch_experts)
        self.cache_priority = cache_priority

    def reset(self, ctx: PolicyContext) -> None:
        """Zero the model-level counts."""
        super().reset(ctx)
        L, E = ctx.model.num_layers, ctx.model.num_experts
        self._L, self._E = L, E
        # minus the tokens routed to each expert over all requests: an ascending stable
        # argsort of a row is then the count ranking with ties to the smaller id
        self._neg = np.zeros((L, E), dtype=np.int64)
        self._flat = self._neg.reshape(-1)  # view: -_flat[key] is the count of key
        self._n = E if self.prefetch_experts is None else min(self.prefetch_experts, E)
        self._issued: list[list[int]] = [[] for _ in range(L)]  # prefetched, per target layer
        self._predicted: set[int] = set()  # the last gate's prefetches, for O(1) membership

    def count(self, key: int) -> int:
        """Model-level count of expert ``key`` (tokens routed to it so far)."""
        return -int(self._flat[key])

    def add_counts(self, counts: np.ndarray) -> None:
        """Add ``(L, E)`` token counts observed outside this run (a model-level trace kept
        from earlier serving, which BrainStorm-style tracing accumulates indefinitely)."""
        self._neg -= np.asarray(counts, dtype=np.int64)

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Count, cancel the mispredicted prefetches of this layer, prefetch the next one."""
        counts = gate.counts
        self._guard(layer, counts)
        self._neg[layer] -= counts
        cancel = stale_prefetches(self._issued, layer, counts.tolist())
        self._predicted = set()
        if layer + 1 >= self._L:
            return Actions(cancel=cancel) if cancel else NO_ACTIONS
        n = min(self._n, self._room_experts(self._routed(gate)))
        nxt = (layer + 1) * self._E
        order = self._neg[layer + 1].argsort(kind="stable")[: max(n, 0)].tolist()
        keys = [nxt + e for e in order]
        self._issued[layer + 1] = keys
        self._predicted = set(keys)
        return prefetch_actions(keys, self._E, 1, cancel)

    def _guarded(self, key: int) -> bool:
        """Routed by the current layer, or named by this gate's prefetch of the next layer."""
        return key in self._predicted or super()._guarded(key)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """LRU (default) or lowest model-level count, skipping the current layer's experts."""
        if self.cache_priority == "lru":
            return super().victim(candidates, incoming)
        best = fallback = -1
        best_count = 0
        flat = self._flat
        for key in candidates:  # admission order: ties go to the oldest
            if self._guarded(key):
                if fallback < 0:
                    fallback = key
                continue
            c = -int(flat[key])  # an int: the compiled build refuses a numpy scalar here
            if best < 0 or c < best_count:
                best, best_count = key, c
        if best >= 0:
            return best
        if fallback >= 0:
            return fallback
        raise ValueError("BrainStorm.victim called with no candidates")
