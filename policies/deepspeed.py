"""DeepSpeed-Inference as the offloading papers set it up: on-demand loads, LRU cache."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from policies.lru import LRU


@mypyc_attr(allow_interpreted_subclasses=True)
class DeepSpeedInference(LRU):
    """On-demand loading only, with an LRU expert cache.

    paper: fMoE §6.1 (``000``): DeepSpeed-Inference "employs an expert-agnostic layer-wise
    parameter offloading approach, which uses pure on-demand loading and does not
    support prefetching"; the fMoE authors reimplemented its offloading logic in the
    MoE-Infinity codebase "and add[ed] an expert cache for a fair comparison" without
    naming the cache policy.  MoE-Infinity (``003`` Fig. 8a) pairs DeepSpeed-Inference's
    fetching with an LRU cache.
    here: global LRU over all layers' experts under the byte budget (the same decisions as
    :class:`policies.lru.LRU`), loads only what the gate routes to, because that is the
    fMoE §6.1 baseline and LRU is the cache MoE-Infinity names for DeepSpeed-Inference.
    The expert-agnostic whole-layer fetching of the original system is the separate
    ``dependency`` policy (:mod:`policies.dependency`).
    """

    name = "deepspeed"
