"""Pre-gated MoE: prefetch the next layer's predicted experts, keep nothing else."""

from __future__ import annotations

from collections.abc import Collection

from mypy_extensions import mypyc_attr

from policies._prefetching import LayerGuard, PrefetchTable, stale_prefetches, top_spec
from policies.base import NO_ACTIONS, Actions, GateView, Policy, PolicyContext


@mypyc_attr(allow_interpreted_subclasses=True)
class PreGated(Policy, LayerGuard):
    """Prefetch layer ``l + 1``'s predicted experts at the gate of layer ``l``; no cache.

    paper: Pre-gated MoE (Hwang et al., ISCA 2024), as MoEpic §4.1 (``002``) states it:
    "trains a pre-gated function for each layer to predict the activated experts for the
    next layer. The predicted experts are prefetched into VRAM in parallel with the
    computation of the current layer"; §4.2: "there are no cached experts in Pre-gated
    MoE, [so] variations in the VRAM budget do not affect its performance".
    here: the pre-gate is the trace's speculative probabilities ``gate.spec_next`` (the
    next router applied one layer early, MoEpic eq. 3), because the trained pre-gate is
    not in any trace; its ``n`` most probable experts are prefetched, ``n`` =
    ``prefetch_experts`` or, if ``None``, the number of distinct experts the current layer
    routed to (never below ``top_k``), as in :class:`policies.mixtral_offloading.
    MixtralOffloading`.  "No cache": at each gate, every expert the policy holds
    (resident or in flight) that neither the current layer routes to nor this gate
    predicts for the next layer is evicted (``Actions.evict``; a queued one is
    cancelled), so the GPU holds the current and the next layer's experts and nothing
    else, and a budget above that changes nothing, as §4.2 says; when the budget is
    smaller, the victim is the oldest admitted candidate outside those two sets.
    ``cache_leftovers=True`` keeps what the two layers no longer need until the budget
    wants its room (a cache the paper's system does not have, for comparison).
    Stale predictions: the paper is silent (in Pre-gated MoE the pre-gate's choice is
    the routing, so nothing is mispredicted); here the router decides, so at the gate of
    layer ``l + 1`` the still-queued prefetches this policy issued for it that the gate
    did not route to are cancelled (``cancel_stale``, default on), because otherwise, on
    a link slower than a layer's compute, mispredictions pile up in the queue, hold the
    budget in flight and evict everything resident (TPOT then stays at the all-miss
    level at any budget); ``false`` keeps them queued.  Without a cache that happens
    anyway (a prediction the layer did not use is a leftover at that gate), so
    ``cancel_stale`` matters only with ``cache_leftovers=True``.
    """

    name = "pregated"
    uses_spec = True

    def __init__(
        self,
        prefetch_experts: int | None = None,
        cancel_stale: bool = True,
        cache_leftovers: bool = False,
    ) -> None:
        if prefetch_experts is not None and int(prefetch_experts) < 1:
            raise ValueError(f"prefetch_experts must be >= 1 or None, got {prefetch_experts}")
        self.prefetch_experts = None if prefetch_experts is None else int(prefetch_experts)
        self.cancel_stale = bool(cancel_stale)
        self.cache_leftovers = bool(cache_leftovers)

    def reset(self, ctx: PolicyContext) -> None:
        """Forget the last prediction."""
        super().reset(ctx)
        self._guard_reset(ctx)
        m = ctx.model
        self._L, self._E, self._K = m.num_layers, m.num_experts, m.top_k
        self._next: set[int] = set()  # keys predicted for the next layer at the last gate
        self._issued: list[list[int]] = [[] for _ in range(self._L)]  # per target layer
        self._prefetches = PrefetchTable(self._L * self._E, self._E)
        self._held: set[int] = set()  # keys in the cache (resident or in flight)

    def keeps_unused_experts(self) -> bool:
        """Only with ``cache_leftovers``: without it, each gate evicts what the two
        layers do not use."""
        return self.cache_leftovers

    def on_insert(self, key: int) -> None:
        """Track what the cache holds."""
        self._held.add(key)

    def on_evict(self, key: int) -> None:
        """Track what the cache holds."""
        self._held.discard(key)

    def _leftovers(self, layer: int, keep: set[int]) -> list[int]:
        """The held keys (ascending) that neither ``layer`` routes to nor ``keep``
        names: what "no cache" drops at this gate."""
        if self.cache_leftovers:
            return []
        return sorted(k for k in self._held if k not in keep and not self._guarded(k))

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Prefetch the pre-gate's top experts of the next layer."""
        self._guard(layer, gate.counts_list)
        cancel: list[int] = []
        if self.cancel_stale:
            cancel = stale_prefetches(self._issued, layer, gate.counts_list)
        spec = gate.spec_list  # perf: a list, so the gate makes no array (top_spec)
        if spec is None or layer + 1 >= self._L:
            self._next = set()
            evict = self._leftovers(layer, self._next)
            if cancel or evict:
                return Actions(cancel=cancel, evict=evict)
            return NO_ACTIONS
        routed = self._routed(gate)
        n = self.prefetch_experts or max(self._K, routed)
        n = min(min(n, self._E), self._room_experts(routed))  # perf: see ProMoE
        base = (layer + 1) * self._E
        keys = [base + e for e in top_spec(gate, n)]
        self._next = set(keys)
        if self.cancel_stale:
            self._issued[layer + 1] = keys
        return self._prefetches.actions(keys, cancel, self._leftovers(layer, self._next))

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """Oldest candidate the current and next layer do not need (else the oldest unguarded)."""
        nxt = self._next
        fallback = first = -1
        for key in candidates:  # admission order
            if first < 0:
                first = key
            if self._guarded(key):
                continue
            if key not in nxt:
                return key
            if fallback < 0:
                fallback = key
        if fallback >= 0:
            return fallback
        if first >= 0:
            return first
        raise ValueError("PreGated.victim called with no candidates")
