"""MoEpic: split experts, a speculative prefetcher, LCP and the cache configurator.

Implements ``002`` (MoEpic) §3 on the policy protocol; the engine models the split
(``uses_segments``: top and bottom segments as cache entries, resident parts computing
while the rest loads) and the configurator's maths is :mod:`policies.moepic_config`.
"""

from __future__ import annotations

import math
from collections.abc import Collection

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.errors import ConfigError
from policies.base import (
    NO_ACTIONS,
    Actions,
    BatchInfo,
    GateView,
    Outcome,
    Policy,
    PolicyContext,
    Prefetch,
)
from policies.moepic_config import LayerStats, Timing, vram_allocation

PREFETCH = ("speculative", "random", "none")
CACHES = ("lcp", "rnd")
BUFFER = -1  # budget group of whole experts and bottom segments (the engine's)


def applied_split(
    V: np.ndarray, sizes: np.ndarray, theta: np.ndarray, S: int, E: int
) -> tuple[np.ndarray, np.ndarray]:
    """The split ratios and cache sizes ``(L,)`` that the cache enforces for Algorithm 1's
    budgets ``V`` (in experts of ``S`` bytes), cache sizes ``C`` and ratios ``θ = V / C``:
    ``C_i`` tops (at most ``E``) of ``floor(V_i S / C_i)`` bytes (at most ``S``), so the
    ``C_i`` tops fit in ``V_i`` however ``θ_i S`` rounds (a top of ``round(θ_i S)`` bytes,
    a byte over ``V_i S / C_i``, would leave room for ``C_i - 1``).  ``θ`` is kept where
    ``C_i = 0`` (nothing cached)."""
    C = np.minimum(np.asarray(sizes, dtype=np.int64), E)
    top = np.minimum(np.floor(np.asarray(V) * S / np.maximum(C, 1)), S)  # bytes
    return np.where(C > 0, top / S, np.asarray(theta, dtype=np.float64)), C


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class MoEpic(Policy):
    """MoEpic (``002`` §3): experts split into a cached top and a prefetched bottom.

    Split (§2.3, §3.1).  paper: each expert of layer ``i`` is divided vertically with
    ratio ``θ_i``; the top segments of ``C_i`` experts are cached in the layer's VRAM
    budget ``V_i`` (``C_i = V_i / θ_i``), bottoms and every other expert are fetched into
    a buffer of ``K`` whole experts (§4.1); a hit needs both segments, and a cached top
    computes while its bottom loads.  here: the engine does exactly that
    (:attr:`Policy.uses_segments`): the budget minus the buffer is split into per-layer
    groups of ``C_i`` tops of ``round(θ_i S)`` bytes.  The buffer (``buffer_experts``)
    holds ``K`` whole experts, as §4.1 sets it; the prefetch of layer ``i + 1`` shares it
    with the parts layer ``i`` computes from, so a guess that finds no room is dropped
    (on MoEpic's testbed twice that, over 24 requests, gave a 0.1% higher TPOT on
    Mixtral-8x7B at 2 bits and 160 experts and a 1.4% higher one on Qwen1.5-MoE at 6 GB:
    a smaller cache, and no fewer misses; on fMoE's, bf16 Mixtral-8x7B over six GPUs at
    24 GB (fmoe-fig9), K gives 394 ms against 381 ms, a prompt's misses queueing for the
    buffer).
    The paper's buffer sits beside the budget ``V_e`` that MoEpic shares with the
    baselines (eq. 8, ``V_e = V - U_n - U_b``); here it is inside the run's budget, the
    one number every policy of a sweep gets, so MoEpic caches ``K`` experts' worth less
    than the paper's at the same budget (2 of Mixtral's 96 at §4.1's default).  ``θ = 0``
    caches nothing (prefetch only), ``θ = 1`` with ``prefetch="none"`` caches whole
    experts per layer (cache only), as §2.3 says.

    Segment compute (§3.1, Fig. 3).  paper: with both segments in VRAM the top and the
    bottom are concatenated and computed as one expert; otherwise the top computes
    first and the missing part once it lands, a segment of share ``f`` taking ``f`` of
    the expert's time (Fig. 3(d); eq. 5-7 count computation per expert).  here: each
    segment is its own computation.  The GPU-bound simulator charges it its fraction of
    the whole expert, launches included, as the paper's figure and model do; a split
    computation's second launches are left out (charged, on MoEpic's testbed, whose
    calibration puts 93 us on every kernel, MoEpic's TPOT on Qwen1.5-MoE at 6 GB over 24
    requests went from 110.9 to 114.9 ms and its hit rate from 4.1% to 15.1%, the
    slower compute leaving its prefetches more time).  The host-bound one, which
    models this project's replay (each segment launched as its own FFN, measured there:
    2 launches an access), charges every kernel's launch to each segment
    (:meth:`fmoesim.engine.compute.ComputeModel.segment_s`).

    Speculative prefetcher (§3.2, eq. 3).  paper: feed ``h_i`` to the next layer's router,
    prefetch one by one in descending predicted score (only the bottom when the top is
    cached), stop when the router result arrives, then load what is missing while
    computing what is there; layer 0 uses the previous token's last layer.  here: the
    trace's ``spec_probs`` (``gate.spec_next``; at the last gate, the next iteration's
    layer 0), prefetched in that order as long as the buffer has room; at the next gate
    the ones the router did not pick are aborted (the ones it picked load on demand): a
    queued one is dropped, one already on the link stops at its next chunk boundary, its
    moved chunks wasted, and its room in the buffer is free at once (the paper
    "terminates the prefetch operation" without saying how; a copy engine cannot drop a
    copy it was given, so the engine stops issuing chunks, as the replay does).
    ``abort_wrong=False`` only cancels wrong guesses that have not started: a started
    one finishes and holds its room until it lands (``tests/test_moepic_fig3.py`` times
    both).  A missing expert loads as its top (which joins its layer's cache),
    then its bottom, so the top computes while the bottom loads (eq. 6 charges the whole
    expert's load).  ``prefetch="random"`` (Table 3 "w/o SP") orders them at random,
    ``"none"`` prefetches nothing.

    Cache (§3.3, eq. 4).  LCP: ``P = mu * rho ** (nu / omega)`` per expert, ``mu`` the
    activations so far, ``nu`` the passes since the last one (as :class:`policies.lcp.
    LCP`, same ranking and ties, so ``θ = 1`` without prefetch equals LCP with a cache
    per layer); on a miss the loaded expert's top replaces the layer's lowest-priority
    top.  ``cache="rnd"`` (Table 3 "w/o LCP") replaces a random one.  Buffer entries
    leave oldest first, except the latest gate's guesses: the prefetcher fills the
    buffer in score order counting what it already holds there, so a guess already in
    the buffer is neither loaded again nor pushed out by a lower-scored one.  A
    prefetched whole expert that is used joins the cache as a missed one does (its top
    replaces the lowest priority; the engine's ``Runner._split_whole``).

    Configurator (§3.4, Algorithm 1).  paper: start uniform (``V_i = V_e / L``,
    ``θ_i = 0.5``, random tops); every ``τ`` tokens, when the device is idle, run
    VramAllocation on the statistics and reconfigure: per layer, split the top-``C_i``
    experts by priority and cache their tops (``C_i = V_i / θ_i``).  here: the ``C_i``
    VramAllocation chose, with tops of ``floor(V_i S / C_i)`` bytes so that all ``C_i``
    fit (:func:`applied_split`); statistics from batch-1 decode
    passes (the paper's per-token definitions; a prefill routes many tokens at once);
    ``τ`` counts every token processed (prompt and generated), because the paper says
    only "tokens" and a prompt's tokens pass through the experts as a generated one's
    do; the reconfiguration runs
    at the first iteration boundary after ``τ`` tokens (the simulated server has no other
    idle point in static batching), its new tops load as ``configure`` transfers charged
    to the link behind demand loads, and tops cut at an old ratio are dropped.  Latency
    inputs: the engine's modelled times (:attr:`PolicyContext.times`).
    ``configurator=False`` (Table 3 "w/o CCA") keeps the uniform start with ``θ = 0.5``.
    ``warm_start=False`` starts with no tops (for comparisons with plain caches).

    Several GPUs.  paper: one GPU (§4.1).  here: with experts round-robin over ``G``
    GPUs (fMoE's testbed runs it on six), the budget and the buffer are each GPU's, as
    the engine gives every GPU its own cache with the same group budgets: a GPU caches
    ``C_i`` tops of its own experts of layer ``i`` (at most ``ceil(E / G)``, the most of
    a layer one GPU holds), its buffer takes the guesses of its own experts, and
    Algorithm 1 plans the model's ``G V_e``, each GPU getting ``V_i / G``, because a
    layer's statistics are the whole layer's.  One GPU is the paper's setting unchanged.

    Expert sizes.  paper: one size in every layer (Qwen1.5-MoE, Mixtral).  here: the same
    is required, and a model whose layers' experts differ in size
    (``expert_size_bytes_by_layer``, which an imported trace may record) is refused with
    one line, because the buffer, the tops and Algorithm 1's budgets are counted in
    experts of one size.
    """

    name = "moepic"
    uses_spec = True
    uses_segments = True

    def __init__(
        self,
        split_ratio: float = 0.5,
        omega: float = 128.0,
        rho: float = 0.25,
        prefetch: str = "speculative",
        cache: str = "lcp",
        configurator: bool = True,
        tau_tokens: int = 5000,
        zeta: float = 0.01,
        buffer_experts: int | None = None,
        warm_start: bool = True,
        label: str | None = None,
        abort_wrong: bool = True,
    ) -> None:
        if not 0.0 <= float(split_ratio) <= 1.0:
            raise ValueError(f"split_ratio must be in [0, 1], got {split_ratio}")
        if not (math.isfinite(omega) and omega > 0):
            raise ValueError(f"omega must be finite and > 0, got {omega}")
        if not 0 < rho <= 1:
            raise ValueError(f"rho must be in (0, 1], got {rho}")
        if prefetch not in PREFETCH:
            raise ValueError(f"prefetch must be one of {list(PREFETCH)}, got {prefetch!r}")
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {list(CACHES)}, got {cache!r}")
        if int(tau_tokens) < 1:
            raise ValueError(f"tau_tokens must be >= 1, got {tau_tokens}")
        if not 0 < zeta < 1:
            raise ValueError(f"zeta must be in (0, 1), got {zeta}")
        if buffer_experts is not None and int(buffer_experts) < 1:
            raise ValueError(f"buffer_experts must be >= 1 or None, got {buffer_experts}")
        self.split = float(split_ratio)
        self.omega, self.rho = float(omega), float(rho)
        self.prefetch, self.cache = prefetch, cache
        self.configurator = bool(configurator)
        self.tau_tokens, self.zeta = int(tau_tokens), float(zeta)
        self.buffer_experts = None if buffer_experts is None else int(buffer_experts)
        self.warm_start = bool(warm_start)
        self.abort_wrong = bool(abort_wrong)
        if label is not None:
            self.name = str(label)  # type: ignore[misc]

    # -- configuration ------------------------------------------------------------------
    def reset(self, ctx: PolicyContext) -> None:
        """Uniform start: ``V_i = V_e / L``, ``θ_i`` = ``split_ratio``; zero statistics."""
        super().reset(ctx)
        m = ctx.model
        if not m.uniform_experts:  # its buffer, tops and budgets count experts of one size
            raise ConfigError(
                "model.expert_size_bytes_by_layer",
                m.expert_size_bytes_by_layer,
                f"{self.name} needs one expert size in every layer (its buffer, cached tops "
                "and layer budgets count experts of one size)",
            )
        self._L, self._E, self._K = L, E, K = m.num_layers, m.num_experts, m.top_k
        self._n = n = L * E
        self._S = S = ctx.expert_size_bytes
        self._G = G = ctx.num_gpus
        self._cap = -(-E // G)  # the most experts of a layer one GPU holds (e % G == g)
        nbuf = self.buffer_experts or K
        self._buffer = nbuf * S
        if self._buffer >= ctx.budget_bytes and self.split > 0:
            raise ConfigError(
                "cache.budget_gb",
                round(ctx.budget_bytes / 1e9, 3),
                f"{ctx.budget_bytes / S:.1f} experts leave nothing beside MoEpic's buffer of "
                f"{nbuf} experts (policy.buffer_experts)",
            )
        self._V_e = max(ctx.budget_bytes - self._buffer, 0) / S  # in whole experts
        self._theta = np.full(L, self.split)
        self._V = np.full(L, self._V_e / L)
        self._sizes = self._cache_sizes(self._V, self._theta)  # (L,) C_i
        self._age = -math.log(self.rho) / self.omega
        self._clock = 0  # passes begun
        self._mu = np.zeros(n)  # activations per expert
        self._at = np.zeros(n)  # clock at the last activation
        self._seq = 0  # activations so far (the ranks' ties)
        # LCP's rank of every expert (log P up to a common term, its last activation's
        # seq, key), kept up to date by on_access, the only event that changes one
        self._ranks: list[tuple[float, int, int]] = [(-math.inf, -1, k) for k in range(n)]
        self._in: set[int] = set()  # keys admitted (full, top, bottom), not evicted
        self._ticket: dict[int, float] = {}  # cache="rnd": top key -> uniform draw
        self._pending: dict[int, int] = {}  # prefetched key -> target layer
        self._pred: dict[int, np.ndarray] = {}  # layer -> prediction for this pass
        self._protect: set[int] = set()  # buffer keys of the latest guesses
        self._tokens = 0
        self._next_config = self.tau_tokens
        self._started = False
        self._single = False  # this pass is one token (statistics)
        self.stats = LayerStats(L, E, K)
        self.configurations = 0

    def _cache_sizes(self, V: np.ndarray, theta: np.ndarray) -> np.ndarray:
        """Tops per layer and GPU: ``floor(V_i S / round(θ_i S))`` (0 where ``θ_i = 0``),
        at most the layer's experts one GPU holds."""
        S = self._S
        out = np.zeros(len(V), dtype=np.int64)
        for i, (v, th) in enumerate(zip(V.tolist(), theta.tolist(), strict=True)):
            tb = round(th * S)
            out[i] = min(int(v * S // tb), self._cap) if tb > 0 else 0
        return out

    def _on_each_gpu(self, order: list[int], count: int) -> list[int]:
        """The first ``count`` experts of ``order`` (a layer's expert ids) that each GPU
        holds: ``order[:count]`` on one GPU."""
        G = self._G
        if G == 1:
            return order[:count]
        taken = [0] * G
        out = []
        for e in order:
            if taken[e % G] < count:
                taken[e % G] += 1
                out.append(e)
        return out

    def _group_budgets(self) -> dict[int, int]:
        S = self._S
        budgets = {BUFFER: self._buffer}
        for i in range(self._L):
            budgets[i] = int(self._sizes[i]) * round(float(self._theta[i]) * S)
        return budgets

    def cache_groups(self) -> dict[int, int]:
        """The buffer and one group per layer for its tops."""
        return self._group_budgets()

    def split_ratio(self, layer: int) -> float:
        """The current ``θ`` of ``layer``."""
        return float(self._theta[layer])

    # -- LCP ----------------------------------------------------------------------------
    def _rank(self, key: int) -> tuple[float, int, int]:
        """LCP's order (lowest first): ``log P`` up to a common term (``-inf`` before the
        first activation), last access, key."""
        return self._ranks[key]

    def priorities(self, layer: int) -> np.ndarray:
        """Eq. 4 for the experts of ``layer`` now ``(E,)``."""
        sl = slice(layer * self._E, (layer + 1) * self._E)
        return self._mu[sl] * self.rho ** ((self._clock - self._at[sl]) / self.omega)

    def _by_priority(self, layer: int) -> list[int]:
        """Experts of ``layer``, highest cache priority first (LCP's order reversed)."""
        base = layer * self._E
        return sorted(range(self._E), key=lambda e: self._rank(base + e), reverse=True)

    # -- events -------------------------------------------------------------------------
    def on_iteration_start(self, batch: BatchInfo) -> Actions | None:
        """Advance the LCP clock; first pass: random tops; every ``τ`` tokens: reconfigure."""
        self._clock += 1
        self._single = batch.num_tokens == 1
        acts: Actions | None = None
        if not self._started:
            self._started = True
            if self.warm_start:
                acts = self._initial_tops()
        elif self.configurator and self._tokens >= self._next_config:
            self._next_config = self._tokens + self.tau_tokens
            acts = self._reconfigure()
        self._tokens += batch.num_tokens
        return acts

    def _initial_tops(self) -> Actions | None:
        """Algorithm 1 line 4: the cached experts are selected randomly."""
        rng, n, E = self.ctx.rng, self._n, self._E
        pf = []
        for i in range(self._L):
            for e in self._on_each_gpu(rng.permutation(E).tolist(), int(self._sizes[i])):
                pf.append(Prefetch(n + i * E + e, 10.0, "configure"))
        return Actions(prefetch=pf) if pf else None

    def _reconfigure(self) -> Actions | None:
        """VramAllocation on the statistics, then the new tops (§3.4)."""
        t = self.ctx.times
        if t is None or self.stats.tokens.min() == 0:
            return None
        timing = Timing(t.t_att_s, self._K * t.t_expert_s, t.t_head_s, t.t_load_s)
        G = self._G
        # the model's top budget over its layers; each GPU holds its share of a layer's
        V, theta, sizes, _ = vram_allocation(self._V_e * G, self.zeta, self.stats, timing)
        if G > 1:
            V = V / G
            sizes = self._cache_sizes(V, theta)
        theta, sizes = applied_split(V, sizes, theta, self._S, self._cap)
        n, E = self._n, self._E
        evict: list[int] = []
        changed = np.abs(theta - self._theta) > 1e-12
        for i in np.flatnonzero(changed).tolist():  # tops (and bottoms) cut at the old θ
            base = i * E
            for e in range(E):
                for k in (n + base + e, 2 * n + base + e):
                    if k in self._in:
                        evict.append(k)
        self._V, self._theta, self._sizes = V, theta, sizes
        pf = []
        for i in range(self._L):
            order = self._by_priority(i)
            if self.cache == "rnd":
                order = self.ctx.rng.permutation(E).tolist()
            want = self._on_each_gpu(order, int(self._sizes[i]))
            for e in want:
                k = n + i * E + e
                if changed[i] or k not in self._in:
                    pf.append(Prefetch(k, 10.0, "configure"))
        self.configurations += 1
        return Actions(prefetch=pf, evict=evict, budgets=self._group_budgets())

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Statistics; cancel passed prefetches; prefetch the next layer speculatively."""
        L, E, n = self._L, self._E, self._n
        base = layer * E
        routed = np.flatnonzero(gate.counts)
        if self._single and self.configurator:
            pred = self._pred.get(layer)
            if pred is not None:
                prio = self.priorities(layer)
                self.stats.observe(layer, routed, _ranks(prio), _ranks(pred))
        cancel = []
        for key in [k for k, t in self._pending.items() if t == layer]:
            del self._pending[key]
            if not gate.counts[(key % n) - base]:
                cancel.append(key)
        spec = gate.spec_next
        target = layer + 1 if layer + 1 < L else 0
        if spec is None:
            self._pred.pop(target, None)
            return self._stop(cancel, []) if cancel else NO_ACTIONS
        self._pred[target] = np.asarray(spec, dtype=np.float64)
        if self.prefetch == "none":
            return self._stop(cancel, []) if cancel else NO_ACTIONS
        if self.prefetch == "speculative":
            order = np.argsort(-self._pred[target], kind="stable").tolist()  # ties by id
        else:
            order = self.ctx.rng.permutation(E).tolist()
        tb = round(float(self._theta[target]) * self._S)
        G = self._G
        # each GPU's buffer takes the guesses of its own experts, in order, until one
        # does not fit (room -1: that GPU is done)
        room, pf, open_gpus = [self._buffer] * G, [], G
        tbase = target * E
        protect: set[int] = set()
        for r, e in enumerate(order):
            g = e % G
            if room[g] < 0:
                continue
            k = tbase + e
            held = k in self._in or 2 * n + k in self._in  # in the buffer already: it counts
            if held:
                key, size = (k, self._S) if k in self._in else (2 * n + k, self._S - tb)
            else:
                key, size = (2 * n + k, self._S - tb) if n + k in self._in else (k, self._S)
                if size <= 0:
                    continue
            if size > room[g]:  # this GPU's buffer is full
                room[g] = -1
                open_gpus -= 1
                if open_gpus == 0:
                    break
                continue
            room[g] -= size
            protect.add(key)
            if not held:
                pf.append(Prefetch(key, 1.0 + r / E))
                self._pending[key] = target
        self._protect = protect
        if not pf and not cancel:
            return NO_ACTIONS
        return self._stop(cancel, pf)

    def _stop(self, wrong: list[int], pf: list[Prefetch]) -> Actions:
        """The gate's actions: the wrong guesses aborted (``abort_wrong``) or cancelled,
        then the prefetches ``pf``."""
        if self.abort_wrong:
            return Actions(prefetch=pf, abort=wrong)
        return Actions(prefetch=pf, cancel=wrong)

    def on_access(self, key: int, outcome: Outcome) -> None:
        """LCP: the expert is activated."""
        self._mu[key] += 1.0
        self._at[key] = self._clock
        # eq. 4's log P = log mu + (now - at) log(rho) / omega; less the term every
        # expert shares (now log(rho) / omega), it is log mu + at * age, at = the clock
        self._ranks[key] = (math.log(self._mu[key]) + self._clock * self._age, self._seq, key)
        self._seq += 1

    def on_insert(self, key: int) -> None:
        """Mirror the cache; ``cache="rnd"``: draw the new top's random eviction ticket."""
        self._in.add(key)
        if self.cache == "rnd" and self._n <= key < 2 * self._n:
            self._ticket[key] = float(self.ctx.rng.random())

    def on_evict(self, key: int) -> None:
        """Mirror the cache."""
        self._in.discard(key)
        self._pending.pop(key, None)
        self._ticket.pop(key, None)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """A top: LCP's lowest priority (``cache="rnd"``: a uniformly random one, by the
        smallest ticket drawn at its admission, so peeking has no side effect); the
        buffer: the oldest entry."""
        n = self._n
        if n <= incoming < 2 * n or (incoming < 0 and _first(candidates) >= n):
            if self.cache == "rnd":
                tops = [k for k in candidates if n <= k < 2 * n]
                if tops:
                    return min(tops, key=self._ticket.__getitem__)
            else:
                ranks = self._ranks  # unique (the key is in each): the min is the victim
                lowest = [ranks[k - n] for k in candidates if n <= k < 2 * n]
                if lowest:
                    return min(lowest)[2] + n
        first = -1
        for k in candidates:  # admission order: the oldest first, not the latest guesses
            if k not in self._protect:
                return k
            if first < 0:
                first = k
        if first >= 0:
            return first
        raise ValueError("MoEpic.victim called with no candidates")

    def report(self) -> dict[str, np.ndarray]:
        """The current configuration per layer: budget (experts), θ and tops cached, and
        how many times the configurator has run (the same on every row)."""
        return {
            "layer": np.arange(self._L),
            "budget_experts": self._V.copy(),
            "split_ratio": self._theta.copy(),
            "cached_tops": self._sizes.copy(),
            "configurations": np.full(self._L, float(self.configurations)),
        }


def _ranks(values: np.ndarray) -> np.ndarray:
    """Rank of every entry, 0 = largest (ties: the smaller index first)."""
    order = np.argsort(-np.asarray(values), kind="stable")
    r = np.empty(len(order), dtype=np.int64)
    r[order] = np.arange(len(order))
    return r


def _first(candidates: Collection[int]) -> int:
    for k in candidates:
        return k
    return -1
