"""Least-recently-used expert cache (and the admission-order list FIFO shares with it)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from mypy_extensions import mypyc_attr

from policies.base import Outcome, Policy, PolicyContext


@mypyc_attr(allow_interpreted_subclasses=True)
class AdmissionOrder(Policy):
    """Evict the candidate that comes first in an order kept from admissions: the base of
    :class:`LRU` (which moves an accessed expert to the back) and
    :class:`policies.fifo.FIFO` (which does not)."""

    name = "admission-order"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget the order."""
        super().reset(ctx)
        self._order: OrderedDict[int, None] = OrderedDict()  # first to evict first

    def on_insert(self, key: int) -> None:
        """A newly admitted expert goes to the back."""
        self._order[key] = None
        self._order.move_to_end(key)

    def on_evict(self, key: int) -> None:
        """Drop ``key`` from the order."""
        self._order.pop(key, None)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The first of ``candidates`` in the order."""
        for key in self._order:
            if key in candidates:
                return key
        raise ValueError(f"no candidate is tracked by this {self.name} policy")


@mypyc_attr(allow_interpreted_subclasses=True)
class LRU(AdmissionOrder):
    """Evict the expert whose last access is oldest.

    paper: Mixtral-Offloading (Eliseev & Mazur 2023) keeps a per-layer LRU cache, and
    fMoE §6.1 sets up DeepSpeed-Inference as on-demand loading with an LRU cache.
    here: one global LRU over all layers' experts under the byte budget, loads on
    demand only, because that is the simplest demand-caching baseline; an access that
    finds the expert resident, in flight or absent all count as a use.
    """

    name = "lru"

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Mark ``key`` most recently used."""
        if key in self._order:
            self._order.move_to_end(key)
