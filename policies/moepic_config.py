"""MoEpic's cache configurator (``002`` §3.4, Algorithm 1): per-layer VRAM budgets and
expert split ratios from observed statistics.

Pure functions over numpy arrays, no engine: :class:`LayerStats` accumulates the three
statistics of §3.4.2, :func:`expert_split` is Algorithm 1's ``ExpertSplit`` (eq. 5-7 and
11), :func:`vram_allocation` its ``VramAllocation`` fixed-point loop with rollback.

Budgets are in units of one full expert (``V_i = 2.5`` holds two and a half experts'
bytes), times in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from mypy_extensions import mypyc_attr


@dataclass(frozen=True)
class Timing:
    """The latency metrics Algorithm 1 takes: attention, the whole MoE module (``K``
    experts) and the head per token, and loading one full expert."""

    t_att_s: float
    t_moe_s: float
    t_head_s: float
    t_load_s: float

    def __post_init__(self) -> None:
        for k in ("t_att_s", "t_moe_s", "t_head_s", "t_load_s"):
            v = getattr(self, k)
            if not (np.isfinite(v) and v >= 0):
                raise ValueError(f"Timing.{k} must be finite and >= 0, got {v}")


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class LayerStats:
    """§3.4.2's statistics of every layer after ``q`` tokens.

    ``H[i, C]``: share of activated experts that a cache of the ``C`` highest-priority
    experts would have held; ``P[i, y]``: activations of the expert ranked ``y`` by
    predicted score, per token; ``PH[i, y, C]``: how often the expert ranked ``y`` by
    prediction is among the ``C`` highest-priority experts, per token.  Ranks are
    0-based here (the paper's ``y``-th is ``y - 1``); ``C`` runs over ``0..N``.
    """

    def __init__(self, num_layers: int, num_experts: int, top_k: int) -> None:
        self.L, self.N, self.K = num_layers, num_experts, top_k
        self.tokens = np.zeros(num_layers, dtype=np.int64)  # q per layer
        self._cache_rank = np.zeros((num_layers, num_experts), dtype=np.int64)  # hist
        self._act_pred_rank = np.zeros((num_layers, num_experts), dtype=np.int64)  # hist
        self._pred_cache = np.zeros((num_layers, num_experts, num_experts), dtype=np.int64)

    def observe(
        self, layer: int, activated: np.ndarray, priority_rank: np.ndarray, pred_rank: np.ndarray
    ) -> None:
        """One token at ``layer``: its activated experts, every expert's cache-priority
        rank ``(N,)`` (0 = highest) and predicted-score rank ``(N,)`` (0 = highest)."""
        self.tokens[layer] += 1
        act = np.asarray(activated, dtype=np.int64)
        np.add.at(self._cache_rank[layer], priority_rank[act], 1)
        np.add.at(self._act_pred_rank[layer], pred_rank[act], 1)
        order = np.argsort(pred_rank, kind="stable")  # experts by prediction rank y
        self._pred_cache[layer, np.arange(self.N), priority_rank[order]] += 1

    def H(self) -> np.ndarray:
        """``(L, N + 1)``: hit rate with ``C = 0..N`` cached experts."""
        q = np.maximum(self.tokens, 1)[:, None] * self.K
        c = np.concatenate([np.zeros((self.L, 1)), np.cumsum(self._cache_rank, axis=1)], axis=1)
        return c / q

    def P(self) -> np.ndarray:
        """``(L, N)``: activations of the rank-``y`` predicted expert per token."""
        return self._act_pred_rank / np.maximum(self.tokens, 1)[:, None]

    def PH(self) -> np.ndarray:
        """``(L, N, N + 1)``: the rank-``y`` predicted expert is cached with ``C``."""
        c = np.cumsum(self._pred_cache, axis=2)
        z = np.zeros((self.L, self.N, 1))
        return np.concatenate([z, c], axis=2) / np.maximum(self.tokens, 1)[:, None, None]


def best_split(
    V: float,
    window_s: float,
    H: np.ndarray,
    P: np.ndarray,
    PH: np.ndarray,
    K: int,
    t_load_s: float,
) -> tuple[float, int, float]:
    """Eq. 11 for one layer: the cache size ``C`` maximising the activated experts in
    VRAM after the prefetch window, ``m = K H(C) θ + Σ_{y<=Y} (1 - PH(y,C) θ) P(y)`` with
    ``θ = V / C`` (so ``C >= V``) and the ``Y`` prefetches ``(1 - PH(y,C) θ) t_load``
    that fit in ``window_s`` taken in prediction order.  Returns ``(m, C, θ)``; ties go
    to the smaller ``C``.  ``V = 0`` caches nothing (``C = 0``, prefetch only).

    ``H`` ``(N + 1,)``, ``P`` ``(N,)``, ``PH`` ``(N, N + 1)``.
    """
    N = len(P)
    if V <= 0:
        cs = np.array([0])
        theta = np.array([0.0])
    else:
        lo = int(np.ceil(V - 1e-9))
        cs = np.arange(max(lo, 1), N + 1)
        if not len(cs):  # V > N: everything cached whole
            cs = np.array([N])
        theta = np.minimum(V / cs, 1.0)  # (n,)
    frac = 1.0 - PH[:, cs] * theta[None, :]  # (N, n) share of expert y still to load
    t_cum = np.cumsum(frac * t_load_s, axis=0)  # (N, n)
    fits = t_cum <= window_s + 1e-15
    a_cum = np.cumsum(frac * P[:, None], axis=0)  # (N, n)
    Y = fits.sum(axis=0)  # prefetches in the window (t_cum rises with y)
    gain = np.where(Y > 0, a_cum[np.maximum(Y - 1, 0), np.arange(len(cs))], 0.0)
    m = K * H[cs] * theta + gain  # (n,)
    j = int(np.argmax(m))
    return float(m[j]), int(cs[j]), float(theta[j])


def expert_split(
    V: np.ndarray, stats: LayerStats, timing: Timing
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Algorithm 1 ``ExpertSplit``: layer by layer, the best split (eq. 11) given the
    prefetch window, then the exposed loading latency (eq. 5-6, with ``α + βθ ≈ m`` and
    ``β(1-θ) + γ ≈ K - m``) and the next window (eq. 7).  Returns the exposed latency
    ``(L,)``, split ratios ``(L,)`` and cache sizes ``(L,)``."""
    H, P, PH = stats.H(), stats.P(), stats.PH()
    K = stats.K
    t_exp = timing.t_moe_s / K
    window = timing.t_head_s + timing.t_att_s
    L = stats.L
    exposed = np.zeros(L)
    theta = np.zeros(L)
    sizes = np.zeros(L, dtype=np.int64)
    for i in range(L):
        m, C, th = best_split(float(V[i]), window, H[i], P[i], PH[i], K, timing.t_load_s)
        hide = m * t_exp
        miss = (K - m) * timing.t_load_s
        exposed[i] = max(0.0, miss - hide)
        theta[i], sizes[i] = th, C
        window = (timing.t_moe_s - min(hide, miss)) + timing.t_att_s
    return exposed, theta, sizes


def vram_allocation(
    V_e: float,
    zeta: float,
    stats: LayerStats,
    timing: Timing,
    max_iters: int = 100_000,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """Algorithm 1 ``VramAllocation``: start from the uniform ``V_e / L``; each round move
    ``ζ V_e`` from the layer where losing it costs least to the layer where gaining it
    helps most, keep the move if the total exposed latency drops, else roll it back and
    stop.  A layer never goes below ``ζ V_e`` (``V_i > 0``); the total stays ``V_e``.
    Returns budgets ``(L,)``, split ratios ``(L,)``, cache sizes ``(L,)`` and the number
    of moves kept."""
    if not 0 < zeta < 1:
        raise ValueError(f"zeta must be in (0, 1), got {zeta}")
    if V_e < 0:
        raise ValueError(f"V_e must be >= 0, got {V_e}")
    L = stats.L
    step = zeta * V_e
    V = np.full(L, V_e / L)
    moves = 0
    for _ in range(max_iters):
        t1, theta, sizes = expert_split(V, stats, timing)
        if step <= 0 or L < 2:
            return V, theta, sizes, moves
        t2, _, _ = expert_split(V + step, stats, timing)
        t3, _, _ = expert_split(np.maximum(V - step, 0.0), stats, timing)
        i1 = int(np.argmax(t1 - t2))
        cost = t3 - t1
        cost[i1] = np.inf
        cost[V <= step * (1 + 1e-9)] = np.inf  # would reach 0
        i2 = int(np.argmin(cost))
        if not np.isfinite(cost[i2]):
            return V, theta, sizes, moves
        new = V.copy()
        new[i1] += step
        new[i2] -= step
        t4, _, _ = expert_split(new, stats, timing)
        # no gain (beyond rounding, which could otherwise cycle): roll back (line 24)
        if (t4 - t1).sum() >= -1e-12 * max(1.0, float(t1.sum())):
            return V, theta, sizes, moves
        V = new
        moves += 1
    t1, theta, sizes = expert_split(V, stats, timing)
    return V, theta, sizes, moves
