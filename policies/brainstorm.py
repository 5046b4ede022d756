"""BrainStorm-style model-level tracing: prefetch and cache by counts over all requests."""

from __future__ import annotations

from collections.abc import Collection

import numpy as np
from mypy_extensions import mypyc_attr

from policies._prefetching import GuardedLRU, PrefetchTable, stale_prefetches
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
    "based on model-level counts" reading of §2.3, and §7.3's Table 5 baseline, which
    "prioritizes caching based on model-level expert counts": ``policy=brainstorm-count``;
    its victim scan is O(candidates)).  ``label`` names a variant in results.
    Victims skip the current layer's routed experts and this gate's predictions for
    the next layer while another candidate exists (a ranked prediction is not evicted to
    make room for a lower-ranked one or for an on-demand load of the current layer);
    prefetching a resident expert does not otherwise refresh its recency.
    ``tests/test_baselines.py`` replays Fig. 6b and Fig. 8b.
    """

    name = "brainstorm"

    def __init__(
        self,
        prefetch_experts: int | None = None,
        cache_priority: str = "lru",
        label: str | None = None,
    ) -> None:
        if prefetch_experts is not None and int(prefetch_experts) < 1:
            raise ValueError(f"prefetch_experts must be >= 1 or None, got {prefetch_experts}")
        if cache_priority not in CACHE_PRIORITIES:
            raise ValueError(
                f"cache_priority must be one of {CACHE_PRIORITIES}, got {cache_priority!r}"
            )
        self.prefetch_experts = None if prefetch_experts is None else int(prefetch_experts)
        self.cache_priority = cache_priority
        if label is not None:
            self.name = str(label)  # type: ignore[misc]  # a variant's name in results

    def reset(self, ctx: PolicyContext) -> None:
        """Zero the model-level counts."""
        super().reset(ctx)
        L, E = ctx.model.num_layers, ctx.model.num_experts
        self._L, self._E = L, E
        # tokens routed to each expert over all requests, each layer's ranking by them
        # (descending, ties to the smaller id) and each expert's place in that ranking
        # perf: Python lists, and the ranking kept sorted as the counts grow (a bumped
        # expert moves forward past the experts it now outranks, usually a place or
        # two): a numpy row update, argsort and tolist per gate were 14% of the run, and
        # a Python sort of the layer per gate 5% (profiled, compiled build)
        self._counts: list[list[int]] = [[0] * E for _ in range(L)]  # (L, E)
        self._rank: list[list[int]] = [list(range(E)) for _ in range(L)]  # (L, E)
        self._place: list[list[int]] = [list(range(E)) for _ in range(L)]  # (L, E)
        self._n = E if self.prefetch_experts is None else min(self.prefetch_experts, E)
        self._issued: list[list[int]] = [[] for _ in range(L)]  # prefetched, per target layer
        self._predicted: set[int] = set()  # the last gate's prefetches, for O(1) membership
        self._prefetches = PrefetchTable(L * E, E)

    def count(self, key: int) -> int:
        """Model-level count of expert ``key`` (tokens routed to it so far)."""
        return self._counts[key // self._E][key % self._E]

    def add_counts(self, counts: np.ndarray) -> None:
        """Add ``(L, E)`` token counts observed outside this run (a model-level trace kept
        from earlier serving, which BrainStorm-style tracing accumulates indefinitely)."""
        add = np.asarray(counts, dtype=np.int64)
        if add.shape != (self._L, self._E):
            raise ValueError(f"counts must have shape {(self._L, self._E)}, got {add.shape}")
        for layer, row in enumerate(add.tolist()):
            mine = self._counts[layer]
            for e in range(self._E):
                mine[e] += row[e]
            # any change (even a decrease): sorted again
            rank = self._rank[layer] = sorted(range(self._E), key=mine.__getitem__, reverse=True)
            place = self._place[layer]
            for i, e in enumerate(rank):
                place[e] = i

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Count, cancel the mispredicted prefetches of this layer, prefetch the next one."""
        c = gate.counts_list  # perf: a typed list, so indexing it is native
        self._guard(layer, c)
        mine, rank, place = self._counts[layer], self._rank[layer], self._place[layer]
        for e in range(self._E):
            if c[e]:
                v = mine[e] = mine[e] + c[e]
                i = place[e]
                while i > 0:  # forward past the experts it now outranks
                    f = rank[i - 1]
                    if mine[f] > v or (mine[f] == v and f < e):
                        break
                    rank[i] = f
                    place[f] = i
                    i -= 1
                rank[i] = e
                place[e] = i
        cancel = stale_prefetches(self._issued, layer, c)
        if layer + 1 >= self._L:
            self._predicted = set()
            return Actions(cancel=cancel) if cancel else NO_ACTIONS
        n = min(self._n, self._room_experts(self._routed(gate)))
        nxt = (layer + 1) * self._E
        keys = [nxt + e for e in self._rank[layer + 1][: max(n, 0)]]
        self._issued[layer + 1] = keys
        self._predicted = set(keys)
        return self._prefetches.actions(keys, cancel)

    def _guarded(self, key: int) -> bool:
        """Routed by the current layer, or named by this gate's prefetch of the next layer."""
        return key in self._predicted or super()._guarded(key)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """LRU (default) or lowest model-level count, skipping the current layer's experts."""
        if self.cache_priority == "lru":
            return super().victim(candidates, incoming)
        best = fallback = -1
        best_count = 0
        counts, E = self._counts, self._E
        for key in candidates:  # admission order: ties go to the oldest
            if self._guarded(key):
                if fallback < 0:
                    fallback = key
                continue
            c = counts[key // E][key % E]
            if best < 0 or c < best_count:
                best, best_count = key, c
        if best >= 0:
            return best
        if fallback >= 0:
            return fallback
        raise ValueError("BrainStorm.victim called with no candidates")
