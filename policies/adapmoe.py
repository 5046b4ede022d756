"""AdapMoE: Mixtral-Offloading's speculative prefetch + LRU, with per-layer cache sizes by DP."""

from __future__ import annotations

import numpy as np
from mypy_extensions import mypyc_attr

from policies.base import Actions, BatchInfo, GateView, Outcome, PolicyContext
from policies.mixtral_offloading import MixtralOffloading


def allocate_slots(miss: np.ndarray, total_slots: int, min_slots: int) -> list[int]:
    """Per-layer slot counts minimising the summed misses, by dynamic programming.

    ``miss[l, s]`` is the number of misses layer ``l`` would have with ``s`` slots
    (``s = 0..E``, non-increasing in ``s``).  Returns ``slots`` with ``sum(slots) ==
    min(total_slots, L * E)`` and ``min(min_slots, total // L) <= slots[l] <= E``
    minimising ``sum(miss[l, slots[l]])``.  Ties go to the smaller size for later layers
    (so spare slots land on the initial layers, which MoE-Infinity §5.2 and MoEpic §3.2
    say benefit most from caching).  Cost: O(L * E) numpy passes over ``total + 1``.
    """
    miss = np.asarray(miss, dtype=np.float64)
    L, S = miss.shape
    E = S - 1
    total = min(int(total_slots), L * E)
    lo = min(int(min_slots), total // L, E)
    dp = np.full(total + 1, np.inf)
    dp[0] = 0.0
    choice = np.zeros((L, total + 1), dtype=np.int64)
    for layer in range(L):
        new = np.full(total + 1, np.inf)
        pick = choice[layer]
        for s in range(lo, min(E, total) + 1):
            cand = dp[: total + 1 - s] + miss[layer, s]
            better = cand < new[s:]
            new[s:][better] = cand[better]
            pick[s:][better] = s
        dp = new
    slots = [0] * L
    c = total
    for layer in reversed(range(L)):
        slots[layer] = int(choice[layer, c])
        c -= slots[layer]
    return slots


@mypyc_attr(allow_interpreted_subclasses=True)
class AdapMoE(MixtralOffloading):
    """Speculative next-layer prefetch and per-layer LRU, each layer's size chosen by DP.

    paper: AdapMoE (Zhong et al., ICCAD 2024), as MoEpic §4.1 (``002``) states it:
    "follows Mixtral-offloading to integrate LRU caching and speculative prefetching.
    Furthermore, it employs an algorithm based on dynamic programming to adjust the cache
    size for each layer".  Its public ``src/dp.py`` (``notes-anchors.md``) splits a total
    cache over the layers to minimise the summed expected misses, where a layer's misses
    come from an offline-profiled per-layer prediction accuracy and the assumption that
    a mispredicted expert is cached with probability ``size / E``.
    here: the same objective, ``min sum_l miss_l(s_l)`` subject to ``sum_l s_l =
    capacity`` and ``top_k <= s_l <= E`` (:func:`allocate_slots`), but ``miss_l(s)`` is
    measured online instead of modelled: during the first ``warmup_iterations``
    iterations (quotas uniform, i.e. Mixtral-Offloading), each layer keeps an LRU
    recency stack of its experts in which both a prefetch request and an access count as
    a reference, and each access records its stack distance; by LRU's inclusion property
    a per-layer LRU of ``s`` slots that also admits the prefetches holds exactly the top
    ``s`` of that stack, so ``miss_l(s)`` = accesses with distance ``>= s`` (cold ones
    included).  Measured, because the simulator sees no offline profile and the uniform
    assumption ignores skewed reuse; it counts what the paper's model approximates: a
    correctly predicted
    expert sits at distance ``< n`` (n = experts prefetched), so layers with accurate
    speculation need few slots and layers with poor speculation get more, and it needs
    no offline profiling nor a uniform-cache assumption.  At the end of the warm-up the DP
    runs and the quotas take effect (a shrunk layer gives up its slots lazily, as other
    layers claim them).  ``replan_iterations``: re-run the DP every that many
    iterations on all counts so far (``None``: plan once, then stop profiling, keeping
    the hooks O(1)).  ``warmup_iterations`` (64) has no source: the paper profiles
    offline; 64 iterations is a few requests of decoding, short against a run, long
    enough that every layer has seen over a hundred accesses (top-k of them an
    iteration).  With a budget below ``L * top_k`` experts the floor drops to
    ``capacity // L``, because every layer must still get slots and ``top_k`` each would
    exceed the budget.  Layer 0 is prefetched at the last layer's gate from the previous
    token's last hidden state (``first_layer_spec=True``; MoEpic §3.2 says it follows
    AdapMoE in this).  No guess in a prefill pass (``prefill_guesses=False``): its
    public code guesses only in a step of one token.  Everything else as
    :class:`MixtralOffloading`.
    """

    name = "adapmoe"

    def __init__(
        self,
        prefetch_experts: int | None = None,
        warmup_iterations: int = 64,
        replan_iterations: int | None = None,
        first_layer_spec: bool = True,
        prefill_guesses: bool = False,
    ) -> None:
        super().__init__(
            prefetch_experts=prefetch_experts,
            first_layer_spec=first_layer_spec,
            prefill_guesses=prefill_guesses,
        )
        if int(warmup_iterations) < 1:
            raise ValueError(f"warmup_iterations must be >= 1, got {warmup_iterations}")
        if replan_iterations is not None and int(replan_iterations) < 1:
            raise ValueError(f"replan_iterations must be >= 1 or None, got {replan_iterations}")
        self.warmup_iterations = int(warmup_iterations)
        self.replan_iterations = None if replan_iterations is None else int(replan_iterations)

    def reset(self, ctx: PolicyContext) -> None:
        """Uniform quotas, empty recency stacks and histograms."""
        super().reset(ctx)
        L, E = self._L, self._E
        self._stacks: list[list[int]] = [[] for _ in range(L)]  # experts, most recent first
        self._hist = [[0] * (E + 1) for _ in range(L)]  # accesses by stack distance (E = cold)
        self._profiling = True
        self._iterations = 0
        self.plans = 0  # how many times the DP ran

    @staticmethod
    def _reference(stack: list[int], expert: int) -> int:
        """Move ``expert`` to the top of ``stack``; return its distance before (-1 = new)."""
        try:
            d = stack.index(expert)
        except ValueError:
            d = -1
        else:
            del stack[d]
        stack.insert(0, expert)
        return d

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Prefetch as Mixtral-Offloading; while profiling, count prefetches as references."""
        actions = super().on_gate(layer, gate)
        if self._profiling and actions.prefetch:
            E = self._E
            stack = self._stacks[actions.prefetch[0].key // E]
            for p in actions.prefetch:
                self._reference(stack, p.key % E)
        return actions

    def on_access(self, key: int, outcome: Outcome) -> None:
        """LRU update; while profiling, record the access's stack distance."""
        super().on_access(key, outcome)
        if self._profiling:
            layer, e = divmod(key, self._E)
            d = self._reference(self._stacks[layer], e)
            self._hist[layer][self._E if d < 0 else d] += 1

    def miss_curves(self) -> np.ndarray:
        """``(L, E + 1)``: ``[l, s]`` = accesses of layer ``l`` that miss with ``s`` slots."""
        h = np.asarray(self._hist, dtype=np.int64)
        return np.cumsum(h[:, ::-1], axis=1)[:, ::-1]  # suffix sums: distance >= s

    def plan_slots(self) -> list[int]:
        """Run the DP on the profiled miss curves; return the per-layer slots."""
        return allocate_slots(self.miss_curves(), self.ctx.capacity_experts * self._G, self._K)

    def on_iteration_end(self, batch: BatchInfo) -> None:
        """At the end of the warm-up (and every ``replan_iterations`` after), re-plan."""
        self._iterations += 1
        n, w, every = self._iterations, self.warmup_iterations, self.replan_iterations
        if n == w or (every is not None and n > w and (n - w) % every == 0):
            self._set_quotas(self.plan_slots())
            self.plans += 1
            if every is None:
                self._profiling = False
