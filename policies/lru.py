"""Least-recently-used expert cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from policies.base import Outcome, Policy, PolicyContext


class LRU(Policy):
    """Evict the expert whose last access is oldest.

    paper: Mixtral-Offloading (Eliseev & Mazur 2023) keeps a per-layer LRU cache, and
    fMoE §6.1 sets up DeepSpeed-Inference as on-demand loading with an LRU cache.
    here: one global LRU over all layers' experts under the byte budget, loads on
    demand only, because that is the simplest demand-caching baseline; an access that
    finds the expert resident, in flight or absent all count as a use.
    """

    name = "lru"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget all recency information."""
        super().reset(ctx)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def on_insert(self, key: int) -> None:
        """A newly admitted expert is the most recently used."""
        self._order[key] = None
        self._order.move_to_end(key)

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Mark ``key`` most recently used."""
        if key in self._order:
            self._order.move_to_end(key)

    def on_evict(self, key: int) -> None:
        """Drop ``key`` from the recency list."""
        self._order.pop(key, None)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The least recently used of ``candidates``."""
        for key in self._order:
            if key in candidates:
                return key
        raise ValueError("no candidate is tracked by this LRU")
