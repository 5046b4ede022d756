"""First-in, first-out expert cache."""

from __future__ import annotations

from policies.base import Policy
from policies.lru import LRU


class FIFO(LRU):
    """Evict the expert admitted earliest, whatever its use since.

    paper: the textbook FIFO replacement policy; none of the three papers evaluates it,
    it is here as the recency-blind counterpart of LRU.
    here: one global FIFO over all layers' experts under the byte budget, loads on
    demand only; the order is the order of :meth:`on_insert` calls (a transfer being
    issued), and a hit does not move an expert, because that is what separates FIFO from
    LRU.  An expert evicted and loaded again joins the back of the queue.
    """

    name = "fifo"

    # An access does not change the admission order: the base class's no-op, not LRU's
    # move to the back (perf: the engine skips hooks a policy leaves as the base's).
    on_access = Policy.on_access
