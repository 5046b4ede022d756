"""First-in, first-out expert cache."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection

from policies.base import Policy, PolicyContext


class FIFO(Policy):
    """Evict the expert admitted earliest, whatever its use since.

    paper: the textbook FIFO replacement policy; none of the three papers evaluates it,
    it is here as the recency-blind counterpart of LRU.
    here: one global FIFO over all layers' experts under the byte budget, loads on
    demand only; the order is the order of :meth:`on_insert` calls (a transfer being
    issued), and a hit does not move an expert, because that is what separates FIFO from
    LRU.  An expert evicted and loaded again joins the back of the queue.
    """

    name = "fifo"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget the admission order."""
        super().reset(ctx)
        self._order: OrderedDict[int, None] = OrderedDict()  # earliest admitted first

    def on_insert(self, key: int) -> None:
        """A newly admitted expert joins the back of the queue (O(1))."""
        if key not in self._order:
            self._order[key] = None

    def on_evict(self, key: int) -> None:
        """Drop ``key`` from the queue (O(1))."""
        self._order.pop(key, None)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The earliest admitted of ``candidates``."""
        for key in self._order:
            if key in candidates:
                return key
        raise ValueError("no candidate is tracked by this FIFO")
