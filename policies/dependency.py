"""Dependency-based prefetching with an LRU cache (DeepSpeed-Inference as MoE-Infinity sees it)."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from policies._prefetching import GuardedLRU
from policies.base import NO_ACTIONS, Actions, GateView, PolicyContext, Prefetch


@mypyc_attr(allow_interpreted_subclasses=True)
class DependencyPrefetch(GuardedLRU):
    """After layer ``l``'s gate, prefetch every expert of layer ``l + 1``; LRU cache.

    paper: MoE-Infinity (``003``) §3 / Fig. 6a: once a token is dispatched to E[2,1],
    "the dependency-based strategy (implemented in DeepSpeed-Inference) begins prefetching
    E[3,1] and E[3,2] in the immediate next layer", i.e. every expert the dispatched
    expert's output can flow to; §2.3 adds that such systems "cannot predict this
    selective activation and they instead prefetch/fetch all parameters of an MoE layer".
    Fig. 8a: "dependency-based prefetching with an LRU cache".
    here: at each gate of layer ``l < L - 1``, prefetch all ``E`` experts of layer
    ``l + 1`` in ascending expert order (E[3,1] before E[3,2], as Fig. 6a draws it), no
    cancellation, no prefetch across iterations; a global LRU chooses victims, because in
    a standard MoE every expert of layer ``l + 1`` depends on every expert of layer ``l``
    (the router sits between them), so the dependency rule names the whole next layer.
    A gate prefetches at most ``capacity - (experts the current layer routes to)``
    experts, and the victim skips experts the current layer routes to while any other
    candidate exists (see :mod:`policies._prefetching`).  Prefetching a resident
    expert does not refresh its recency: the rule names every expert, so naming one is
    no evidence of use.  ``tests/test_baselines.py`` replays Fig. 6a and Fig. 8a.
    """

    name = "dependency"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget recency; build each layer's prefetch list once (no per-gate allocation)."""
        super().reset(ctx)
        L, E = ctx.model.num_layers, ctx.model.num_experts
        self._L, self._E = L, E
        # priority 1 + rank / E: one layer ahead, ascending expert order (as prefetch_actions)
        self._lists = [
            [Prefetch(layer * E + e, 1.0 + e / E) for e in range(E)] for layer in range(L)
        ]

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Prefetch the whole next layer (as much of it as fits)."""
        self._guard(layer, gate.counts_list)
        if layer + 1 >= self._L:
            return NO_ACTIONS
        room = self._room_experts(self._routed(gate))
        todo = self._lists[layer + 1]
        if room < self._E:
            todo = todo[: max(room, 0)]
        return Actions(prefetch=todo)
