"""DeepSpeed-Inference as the offloading papers set it up: whole layers on demand, LRU cache."""

from __future__ import annotations

from collections.abc import Collection

from mypy_extensions import mypyc_attr

from policies.base import Outcome, PolicyContext
from policies.lru import LRU


@mypyc_attr(allow_interpreted_subclasses=True)
class DeepSpeedInference(LRU):
    """On-demand loading only, of whole layers, with an LRU expert cache.

    paper: fMoE §6.1 (``000``): DeepSpeed-Inference "employs an expert-agnostic layer-wise
    parameter offloading approach, which uses pure on-demand loading and does not
    support prefetching"; the fMoE authors reimplemented its offloading logic in the
    MoE-Infinity codebase "and add[ed] an expert cache for a fair comparison" without
    naming the cache policy.  MoE-Infinity §2 (``003``): DeepSpeed-Inference "cannot
    predict this selective activation and [it] instead prefetch[es]/fetch[es] all
    parameters of an MoE layer"; its Fig. 8a pairs DeepSpeed-Inference's fetching with an
    LRU cache.
    here: when a layer runs, every expert of it missing from the cache loads on demand,
    routed or not, in expert order (:meth:`fetches_whole_layers`); the layer waits for all
    of them and computes the routed ones; the cache is a global LRU over all layers'
    experts under the byte budget, because LRU is the cache MoE-Infinity names for
    DeepSpeed-Inference, ranked by use: an expert the layer fetched and did not route to
    has never been used, so it goes before every used one (the oldest fetch first),
    because "least recently used" ranks by use.  Ranked by admission instead, the
    unrouted experts would push the routed ones out and decoding, a cycle over the layers
    longer than the cache, would never hit (0.0% on Fig. 9's Mixtral-8x7B point; the
    paper's DeepSpeed-Inference hits, since fMoE improves its hit rate by 147%).
    ``whole_layer=False`` loads only the routed experts: exact on-demand fetching, the
    decisions of :class:`policies.lru.LRU`.  Whole-layer prefetching of the next layer
    (MoE-Infinity's "dependency-based prefetching, used in DeepSpeed-Inference", §7.2) is
    the separate ``dependency`` policy (:mod:`policies.dependency`).
    """

    name = "deepspeed"

    def __init__(self, whole_layer: bool = True) -> None:
        self.whole_layer = bool(whole_layer)

    def fetches_whole_layers(self) -> bool:
        """``whole_layer``: the layer's every expert is fetched when it runs."""
        return self.whole_layer

    def reset(self, ctx: PolicyContext) -> None:
        """Forget the order and the unused experts."""
        super().reset(ctx)
        self._unused: dict[int, None] = {}  # fetched, never used: first to go, oldest first
        self._missed: set[int] = set()  # missed by an access, their admission to come

    def on_access(self, key: int, outcome: Outcome) -> None:
        """A use: the expert goes to the most recent end (a missed one when admitted)."""
        unused = self._unused
        if key in unused:
            del unused[key]
            super().on_insert(key)
        elif outcome is Outcome.MISS:
            self._missed.add(key)
        else:
            super().on_access(key, outcome)

    def on_insert(self, key: int) -> None:
        """A missed expert is used now; an unrouted one of a whole-layer fetch is not."""
        missed = self._missed
        if key in missed:
            missed.remove(key)
            super().on_insert(key)
        else:
            self._unused[key] = None

    def on_evict(self, key: int) -> None:
        """Drop ``key``."""
        unused = self._unused
        if key in unused:
            del unused[key]
        else:
            super().on_evict(key)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The oldest never-used candidate, else the least recently used one."""
        for key in self._unused:
            if key in candidates:
                return key
        return super().victim(candidates, incoming)
