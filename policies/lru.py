"""Least-recently-used expert cache (and the admission-order list FIFO shares with it)."""

from __future__ import annotations

from collections.abc import Collection, Iterable

from mypy_extensions import mypyc_attr

from policies.base import Outcome, Policy, PolicyContext


def _any_order(candidates: Collection[int]) -> Iterable[int]:
    """``candidates`` in whatever order is cheapest: a dict's own keys (the cache's
    candidates iterate in admission order by walking every entry; a minimum needs no
    order)."""
    return candidates.keys() if isinstance(candidates, dict) else candidates


@mypyc_attr(allow_interpreted_subclasses=True)
class AdmissionOrder(Policy):
    """Evict the candidate that comes first in an order kept from admissions: the base of
    :class:`LRU` (which moves an accessed expert to the back) and
    :class:`policies.fifo.FIFO` (which does not)."""

    name = "admission-order"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget the order."""
        super().reset(ctx)
        # key -> its stamp, first to evict first; stamps grow along the dict's order
        # perf: a plain dict (moving a key = delete + insert) iterates several times
        # faster than an OrderedDict, and the stamps let victim() rank a few candidates
        # without walking the order
        self._order: dict[int, int] = {}
        self._stamp = 0

    def on_insert(self, key: int) -> None:
        """A newly admitted expert goes to the back (with the newest stamp).

        perf: no membership test: the cache admits only a key it does not hold, and every
        entry that leaves it is reported to :meth:`on_evict`, so ``key`` is not in the
        order (the contract suite checks that the order follows the cache)."""
        self._stamp += 1
        self._order[key] = self._stamp

    def on_evict(self, key: int) -> None:
        """Drop ``key`` from the order."""
        # perf: a test and a del, not pop(key, None), a generic method call compiled
        # (~400 instructions, callgrind)
        order = self._order
        if key in order:
            del order[key]

    def _first_in_order(self, candidates: Collection[int]) -> int:
        """The first of ``candidates`` in the order (-1 if none is tracked).

        perf: when the candidates are few against the order (a saturated link leaves
        most admitted experts in flight: dependency prefetch's walk visited 65 of about
        68 keys per victim), the candidate with the smallest stamp is found without the
        walk.
        """
        order = self._order
        if 8 * len(candidates) < len(order):
            best, best_stamp = -1, self._stamp + 1
            for key in _any_order(candidates):
                s = order.get(key, best_stamp)
                if s < best_stamp:
                    best, best_stamp = key, s
            return best
        for key in order:
            if key in candidates:
                return key
        return -1

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The first of ``candidates`` in the order."""
        key = self._first_in_order(candidates)
        if key < 0:
            raise ValueError(f"no candidate is tracked by this {self.name} policy")
        return key


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
        order = self._order
        if key in order:  # perf: _to_back inlined, its membership test already made
            del order[key]
            self._stamp += 1
            order[key] = self._stamp
