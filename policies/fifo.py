"""First-in, first-out expert cache."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from policies.lru import AdmissionOrder


@mypyc_attr(allow_interpreted_subclasses=True)
class FIFO(AdmissionOrder):
    """Evict the expert admitted earliest, whatever its use since.

    paper: the textbook FIFO replacement policy; none of the three papers evaluates it,
    it is here as the recency-blind counterpart of LRU.
    here: one global FIFO over all layers' experts under the byte budget, loads on
    demand only; the order is the order of :meth:`on_insert` calls (a transfer being
    issued), and a hit does not move an expert, because that is what separates FIFO from
    LRU.  An expert evicted and loaded again joins the back of the queue.
    """

    name = "fifo"

    # An access does not change the order: ``on_access`` stays the base class's no-op,
    # which the engine does not even call (perf), where LRU moves the expert to the back.
