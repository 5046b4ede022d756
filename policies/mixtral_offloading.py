"""Mixtral-Offloading: per-layer LRU expert caches plus speculative next-layer prefetch."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from mypy_extensions import mypyc_attr

from policies._prefetching import LayerGuard, PrefetchTable, top_spec
from policies.base import (
    NO_ACTIONS,
    Actions,
    BatchInfo,
    GateView,
    Outcome,
    Policy,
    PolicyContext,
)


@mypyc_attr(allow_interpreted_subclasses=True)
class MixtralOffloading(Policy, LayerGuard):
    """Each layer owns ``capacity // L`` slots managed by LRU; prefetch layer ``l + 1``'s
    speculatively predicted experts at the gate of layer ``l``.

    paper: Mixtral-Offloading (Eliseev & Mazur 2023): an LRU cache per layer with the same
    size for every layer (fMoE §6.1 of ``000``: "a layer-wise speculative expert
    prefetching and a LRU-based expert cache"; MoEpic §4.1 of ``002``: "caches a subset of
    experts via the LRU policy with a fixed cache size for all layers"), and a guess of
    the next layer's experts from the current hidden state fed to the next router
    (MoEpic eq. 3).  The public code (``notes-anchors.md``) has the per-layer LRU
    (eviction group = layer) and lists speculative prefetch as work in progress.
    here: quota ``layer_slots`` (default ``capacity_experts // L``) per layer and GPU; at
    the gate of layer ``l`` the ``n`` experts of layer ``l + 1`` with the highest
    ``gate.spec_next`` are prefetched, most probable first, where ``n`` =
    ``prefetch_experts`` or, if ``None``, the number of distinct experts layer ``l``
    routed to (never below ``top_k``): top-k for one decode token, and as many as a
    batch needs, because a batch needs the union of its tokens' top-k; ``n``
    is capped by the layer's quota and the room next to the current layer's experts.
    A prefetch request counts as a use of an expert already cached (moves it to the
    MRU end of its layer), so one predicted expert is not evicted to make room for
    another predicted one.  Victims come from the incoming key's layer while that layer
    holds at least its quota; the byte budget is global, so a layer may borrow free
    slots while the cache fills, and a layer below its quota takes a slot back from the
    layer most over its quota (its LRU expert).  Layer 0 is not prefetched by default
    (the public code has no speculation at all); ``first_layer_spec=True`` prefetches it
    at the last layer's gate from the prediction the engine gives there (the previous
    token's last hidden state fed to router 0, as AdapMoE does).

    Prefill.  paper: MoEpic §4.2 (``002``) reads Mixtral-Offloading, AdapMoE and
    MoE-Infinity in a prefill as "only incur[ring] the cost of loading non-cached
    experts"; the Mixtral-Offloading report does not say how it guesses in a prefill
    (its public code has no speculation at all); AdapMoE's public code guesses only in
    a step of one token (``src/custom_layers.py``, ``hidden_states.shape[0] == 1``).
    here: no guess during a prefill pass (:attr:`BatchInfo.prefill`) of more tokens than
    requests, the first-layer guess at its last gate included, so a prefill loads what
    its gates route and its cache keeps the experts it holds; a prefill of one-token
    prompts computes as a decode step and guesses as one, and every decode pass
    guesses, whatever its batch.  ``prefill_guesses=True`` guesses in a prefill too
    (``n`` then is the union of the prompt's routed experts, whose guesses take the
    cache slots of experts the prefill needs next).

    Synchronous prefetching.  paper: fMoE (``000``) §4.3 counts Mixtral-Offloading among
    the systems that "predict and prefetch experts synchronously during inference", and
    its §6.2 credits the baseline's hit rate and blames its latency on "its synchronous
    speculative prefetching with a prefetch distance of 1"; the Mixtral-Offloading
    report does not say.  here: asynchronous by default (a guess still on the link when
    its layer runs is LATE and costs only what is left of its transfer), because MoEpic
    (``002`` §2.2), which runs it as a baseline too, describes prefetch-based offloading
    as loading during the previous layer's computation;
    ``synchronous=True`` makes a layer compute no expert before every transfer in flight
    on its GPU has landed (:meth:`Policy.waits_for_prefetches`), so its guesses of the
    next layer are resident there and the wait is stall.  fMoE's presets run that
    variant (``policy=mixtral-offloading-sync``, ``label`` naming it in results).
    """

    name = "mixtral-offloading"
    uses_spec = True

    def __init__(
        self,
        prefetch_experts: int | None = None,
        layer_slots: int | None = None,
        first_layer_spec: bool = False,
        synchronous: bool = False,
        label: str | None = None,
        prefill_guesses: bool = False,
    ) -> None:
        if label is not None:
            self.name = str(label)  # type: ignore[misc]  # a variant's name in results
        self.first_layer_spec = bool(first_layer_spec)
        self.synchronous = bool(synchronous)
        self.prefill_guesses = bool(prefill_guesses)
        self._guessing = True  # whether the current pass guesses (not a prefill)
        for knob, v in (("prefetch_experts", prefetch_experts), ("layer_slots", layer_slots)):
            if v is not None and int(v) < 1:
                raise ValueError(f"{knob} must be >= 1 or None, got {v}")
        self.prefetch_experts = None if prefetch_experts is None else int(prefetch_experts)
        self.layer_slots = None if layer_slots is None else int(layer_slots)

    def waits_for_prefetches(self) -> bool:
        """``synchronous``: a layer waits for its guesses of the next layer to land."""
        return self.synchronous

    # -- state ------------------------------------------------------------------------
    def reset(self, ctx: PolicyContext) -> None:
        """Empty per-layer LRU lists; uniform quotas."""
        super().reset(ctx)
        self._guard_reset(ctx)
        m = ctx.model
        self._L, self._E, self._K, self._G = m.num_layers, m.num_experts, m.top_k, ctx.num_gpus
        # each layer's keys, least recently used first
        # perf: plain dicts, a key moved to the back by deleting and re-inserting it:
        # compiled, those are native dict operations, while OrderedDict.move_to_end is a
        # generic method call (counted with callgrind)
        self._orders: list[dict[int, None]] = [{} for _ in range(self._L)]
        self._held = [0] * (self._G * self._L)  # entries (resident or in flight) per (gpu, layer)
        self._prefetches = PrefetchTable(self._L * self._E, self._E)
        # per layer and GPU (capacity_experts is one GPU's); the quotas are the whole model's
        slots = self.layer_slots or ctx.capacity_experts // self._L
        self._set_quotas([slots * self._G] * self._L)
        self._guessing = True

    def on_iteration_start(self, batch: BatchInfo) -> None:
        """A prefill of prompts longer than one token makes no guesses unless
        ``prefill_guesses``."""
        self._guessing = (
            self.prefill_guesses or not batch.prefill or batch.num_tokens <= len(batch.request_ids)
        )

    def _set_quotas(self, per_layer_slots: Sequence[int]) -> None:
        """Install per-layer slot quotas (of the whole model, as AdapMoE's plan gives them;
        each GPU's is its even share, at least one slot)."""
        self.quotas = [int(q) for q in per_layer_slots]
        G = self._G
        self._quota_gpu = [q if G == 1 else max(1, q // G) for q in self.quotas]

    def layer_entries(self, layer: int, gpu: int = 0) -> int:
        """Experts of ``layer`` held (resident or in flight) on ``gpu``."""
        return self._held[gpu * self._L + layer]

    def _slot(self, key: int) -> int:
        layer, e = divmod(key, self._E)
        return (e % self._G) * self._L + layer

    # -- decisions --------------------------------------------------------------------
    def _predict(self, layer: int, gate: GateView) -> list[int]:
        """Keys of the next layer to prefetch, most probable first."""
        spec = gate.spec_list  # perf: a list, so the gate makes no array (top_spec)
        target = layer + 1
        if target == self._L and self.first_layer_spec:
            target = 0  # the last layer's gate predicts layer 0 of the next iteration
        if spec is None or target >= self._L:
            return []
        routed = self._routed(gate)
        n = self.prefetch_experts or max(self._K, routed)
        # perf: nested two-argument min compiles to comparisons, a longer one to a call
        n = min(min(n, self._E), min(self.quotas[target] or 1, self._room_experts(routed)))
        base = target * self._E
        return [base + e for e in top_spec(gate, n)]

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Prefetch the speculative top experts of the next layer (none in a prefill
        unless ``prefill_guesses``)."""
        self._guard(layer, gate.counts_list)
        if not self._guessing:
            return NO_ACTIONS
        keys = self._predict(layer, gate)
        if not keys:
            return NO_ACTIONS
        order = self._orders[keys[0] // self._E]
        for k in keys:  # a predicted expert counts as used: keep it over the others
            if k in order:
                del order[k]
                order[k] = None
        return self._prefetches.actions(keys)

    def on_insert(self, key: int) -> None:
        """A newly admitted expert is its layer's most recently used."""
        order = self._orders[key // self._E]
        if key in order:
            del order[key]
        order[key] = None
        self._held[self._slot(key)] += 1

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Mark ``key`` most recently used in its layer."""
        order = self._orders[key // self._E]
        if key in order:
            del order[key]
            order[key] = None

    def on_evict(self, key: int) -> None:
        """Drop ``key`` from its layer's list."""
        order = self._orders[key // self._E]
        if key in order:
            del order[key]
            self._held[self._slot(key)] -= 1

    def _lru_of(self, layer: int, candidates: Collection[int]) -> int:
        for key in self._orders[layer]:
            if key in candidates and not self._guarded(key):
                return key
        return -1

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """LRU expert of the incoming key's layer; else of the layer most over its quota."""
        layer = incoming // self._E
        g = (incoming % self._E) % self._G
        row = g * self._L
        held, quota = self._held, self._quota_gpu
        if held[row + layer] >= quota[layer]:
            key = self._lru_of(layer, candidates)
            if key >= 0:
                return key
        # the other layers over their quota, most over first (ties: smaller layer)
        # perf: one comprehension over the layers, then a sort of the few over quota,
        # each as the int layer - (held - quota) * L, which sorts as the tuple
        # (quota - held, layer) would (0 <= layer < L) but compares as a C int (and
        # multiplies two positive ints: compiled, a negative factor takes a slow path)
        L = self._L
        over = [
            lay - (held[row + lay] - quota[lay]) * L
            for lay in range(L)
            if held[row + lay] > quota[lay] and lay != layer
        ]
        over.sort()
        for k in over:
            key = self._lru_of(k % L, candidates)
            if key >= 0:
                return key
        key = self._first_unguarded(candidates, candidates)  # admission order: the oldest
        if key < 0:
            raise ValueError("MixtralOffloading.victim called with no candidates")
        return key
