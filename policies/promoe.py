"""ProMoE-style stride prefetching: prefetch ``stride`` layers ahead, LRU cache."""

from __future__ import annotations

from mypy_extensions import mypyc_attr

from fmoesim.errors import ConfigError
from policies._prefetching import (
    GuardedLRU,
    PrefetchTable,
    routed_by_count,
    stale_prefetches,
    top_spec,
)
from policies.base import NO_ACTIONS, Actions, GateView, PolicyContext, Prefetch


@mypyc_attr(allow_interpreted_subclasses=True)
class ProMoE(GuardedLRU):
    """At the gate of layer ``l``, prefetch the predicted experts of layer ``l + stride``.

    paper: ProMoE (Song et al. 2024, arXiv 2410.22134) trains a predictor per layer and
    prefetches "stride-based" (fMoE §6.1 of ``000``), i.e. a prefetch distance of
    ``stride`` layers; fMoE reproduced it on MoE-Infinity and, "following the evaluation
    of existing works [ProMoE]", set the prefetch distance ``d`` to three (fMoE §6.1),
    hence ``stride = 3``.  fMoE §6.5 groups ProMoE's prediction with Mixtral-Offloading's
    as "speculative", whose accuracy "decreases drastically as prefetch distance
    increases".
    here: the trace records one speculative prediction per layer, ``router_{l+1}(h_l)``
    (``gate.spec_next``), so a true ``stride``-ahead guess ``router_{l+d}(h_l)`` is not
    available.  Using ``spec_next`` as the guess for layer ``l + d`` would name experts of
    the wrong layer (expert ids are unrelated across layers), and reading the trace's
    prediction of layer ``l + d`` would use ``h_{l+d-1}``, which ProMoE does not have at
    layer ``l``.  So the ``d``-ahead guess is recent history, because it is the freshest
    signal about layer ``l + d`` that exists at layer ``l``: the experts routed at layer
    ``l + d`` the last time that layer ran (for a decode batch, the same requests one
    token ago: consecutive tokens reuse experts, MoE-Infinity §3.1 obs. 3), most tokens
    first; when ``l + d >= L`` it targets layer ``l + d - L`` of the next iteration, whose
    routing in the current iteration is already known.  Like a real ``d``-ahead
    predictor it is wrong where routing changes from token to token.  ``use_spec_next``
    (default off): also prefetch the speculative top experts of layer ``l + 1`` first
    (layer proximity, MoE-Infinity §5.1), because the engine offers that prediction and
    a one-layer-ahead guess is the most accurate one (fMoE §6.5).  This refinement is
    ours, not ProMoE's, and fMoE's prototype did without it: fMoE §6.2 gives
    Mixtral-Offloading the highest hit rate of the baselines "because of its synchronous
    speculative prefetching with a prefetch distance of 1", so ProMoE's distance was
    not 1.  Off is the stride reading §6.1 describes.
    ``n`` per target = ``prefetch_experts`` or, if ``None``, the experts the current layer
    routed to (never below ``top_k``) for the speculative part and all of the remembered
    routing for the stride part; all capped by the room next to the current layer's
    experts.  Cache: global LRU whose victim skips the current layer's routed experts
    (ProMoE's cache policy is not described in ``000``/``002``).  Stale prefetches (not
    described either): at the gate of a target layer, the still-queued prefetches this
    policy issued for it that the gate did not route to are cancelled (``cancel_stale``,
    default on), because otherwise, on a link slower than a layer's compute, wrong
    guesses pile up in the queue, hold the budget in flight and evict everything
    resident (TPOT then stays at the all-miss level at any budget: on the default
    Mixtral setting it stayed at about 720 ms from 6 to 48 GB); ``false`` keeps them
    queued.
    """

    name = "promoe"
    uses_spec = True

    def __init__(
        self,
        stride: int = 3,
        prefetch_experts: int | None = None,
        use_spec_next: bool = False,
        cancel_stale: bool = True,
    ) -> None:
        if int(stride) < 1:
            raise ValueError(f"stride must be >= 1, got {stride}")
        if prefetch_experts is not None and int(prefetch_experts) < 1:
            raise ValueError(f"prefetch_experts must be >= 1 or None, got {prefetch_experts}")
        self.stride = int(stride)
        self.prefetch_experts = None if prefetch_experts is None else int(prefetch_experts)
        self.use_spec_next = bool(use_spec_next)
        self.uses_spec = self.use_spec_next  # type: ignore[misc]  # read only then
        self.cancel_stale = bool(cancel_stale)

    def reset(self, ctx: PolicyContext) -> None:
        """Forget recency and routing history."""
        super().reset(ctx)
        m = ctx.model
        self._L, self._E, self._K = m.num_layers, m.num_experts, m.top_k
        if self.stride > self._L:
            raise ConfigError(
                "policy.stride", self.stride, f"must be at most the model's {self._L} MoE layers"
            )
        self._last: list[list[int]] = [[] for _ in range(self._L)]  # experts, most tokens first
        # keys prefetched for each target layer, not yet seen by that layer's gate
        self._issued: list[list[int]] = [[] for _ in range(self._L)]
        # priorities 1 + rank / E (the spec part) and stride + rank / E
        self._spec_prefetches = PrefetchTable(self._L * self._E, self._E, 1)
        self._stride_prefetches = PrefetchTable(self._L * self._E, self._E, self.stride)

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Remember this layer's routing; prefetch layer ``l + 1`` (spec) and ``l + stride``."""
        c = gate.counts_list
        self._guard(layer, c)
        self._last[layer] = routed_by_count(gate)
        cancel = stale_prefetches(self._issued, layer, c) if self.cancel_stale else []
        routed = self._routed(gate)
        room = self._room_experts(routed)
        E, cap = self._E, self.prefetch_experts
        prefetch: list[Prefetch] = []
        spec = gate.spec_list  # perf: a list, so the gate makes no array (top_spec)
        if self.use_spec_next and spec is not None and layer + 1 < self._L:
            n = cap or max(self._K, routed)
            base = (layer + 1) * E
            # perf: nested two-argument min, which compiles to comparisons (min of three
            # is a generic call); the Prefetches appended, no list of keys between
            table = self._spec_prefetches
            r = 0
            for e in top_spec(gate, min(min(n, E), room)):
                prefetch.append(table.get(base + e, r))
                r += 1
        target = (layer + self.stride) % self._L
        if self.stride > 1 or not prefetch:
            hist = self._last[target]
            # the first cap (if set) of them, as many as fit next to the spec part's
            m = min(len(hist), room - len(prefetch))
            if cap is not None:
                m = min(m, cap)
            base = target * E
            # never the spec's keys: a stride above 1 targets another layer, and a stride
            # of 1 reaches here only when the spec part prefetched nothing
            table = self._stride_prefetches
            for r in range(m):  # (m < 1: none)
                prefetch.append(table.get(base + hist[r], r))
        if self.cancel_stale:
            issued = self._issued
            for p in prefetch:
                # perf: no membership test; a key issued twice for a layer (by its stride
                # and its spec part) is cancelled twice, and the second finds nothing to do
                k = p.key
                issued[k // E].append(k)
        if not prefetch and not cancel:
            return NO_ACTIONS
        return Actions(prefetch=prefetch, cancel=cancel)
