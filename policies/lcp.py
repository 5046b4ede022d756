"""MoEpic's Least Cache Priority (LCP) expert cache (MoEpic §3.3, eq. 4)."""

from __future__ import annotations

import math

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.errors import ConfigError
from policies._ranked import Rank, RankedKeys, RankedPolicy
from policies.base import (
    NO_ACTIONS,
    Actions,
    BatchInfo,
    GateView,
    Outcome,
    PolicyContext,
)

UNITS = ("pass", "token")


@mypyc_attr(allow_interpreted_subclasses=True)
class LCP(RankedPolicy):
    """Evict the expert of lowest cache priority ``P = mu * rho ** (nu / omega)``.

    paper (MoEpic §3.3, eq. 4): for every expert ``E_ij`` MoEpic records the activation
    frequency ``mu_ij``, "the accumulated activation count of the expert", and the
    activation interval ``nu_ij``, "how many consecutive tokens have not activate[d] this
    expert at present"; ``omega`` is the observation window (128) and ``rho`` in (0, 1)
    weighs recency against frequency (0.25).  On a miss it evicts the lowest-priority
    expert.  Both indicators are counted in *tokens* and kept for every expert, cached or
    not; the paper serves one request at a time, so one decoding step is one token.
    here: with ``unit="pass"`` (default) both are counted in *forward passes*
    (iterations): ``mu`` is the number of passes whose batch routed at least one token to
    the expert (one per access, hit, late or miss), and ``nu`` is the number of passes
    begun since the one that last activated it (0 during that pass).  For batch-1
    decoding this is the paper's token count; it differs only for prefill and batched
    passes, where the engine also counts one access per expert, because the cache serves
    a pass, not a token, and a long prompt should not age every unused expert by hundreds
    of "tokens" at once.  ``unit="token"`` is the literal reading: ``mu`` grows by the
    tokens routed to the expert in the pass and ``nu`` by the tokens of each pass.
    ``mu`` and ``nu`` persist across evictions (they describe the expert, not the cache
    entry).  The paper keeps a cache per layer; here, by default, one global cache holds
    all layers under the byte budget, the engine's default cache, so that LCP compares
    with the other demand caches on one budget (``cache.experts_per_layer=C`` gives each
    layer its own cache of C experts, Table 1's setting).  Priorities of different layers
    are then compared directly, so
    ``nu`` runs on one clock for all layers: mid-pass, an expert of a layer the pass has
    not reached yet already counts the current pass as one that did not activate it (its
    priority is lower by a factor ``rho ** (1 / omega)``, 0.989 by default).  Loads on
    demand only, as Table 1 compares it with RND, LRU and LFU; MoEpic pairs it with its
    prefetcher in :class:`policies.moepic.MoEpic`.  ``rho = 1`` is allowed and gives LFU
    with persistent counts.

    Ties on priority go to the least recently accessed expert, then to the smallest key
    (as in :class:`policies.lfu.LFU`).  Ranking: ``log P = log mu + nu * log(rho) / omega``
    and, with one clock ``t`` and ``nu = t - t_last``, ``log P = s - t * |log rho| / omega``
    where ``s = log mu + t_last * |log rho| / omega`` changes only when the expert is
    accessed.  So the admitted experts stay sorted by ``s`` between accesses (no rescoring
    as time passes), and nothing underflows to 0 after ~70k idle passes as ``rho ** (nu /
    omega)`` would; a never-activated expert has priority 0.  Priorities equal in exact
    arithmetic but reached by different ``(mu, nu)`` may be ordered either way by rounding.

    Cost: O(log n) per access, insert and evict; :meth:`victim` walks the sorted list
    from the front.
    """

    name = "lcp"

    def __init__(self, omega: float = 128.0, rho: float = 0.25, unit: str = "pass") -> None:
        if not (isinstance(omega, (int, float)) and math.isfinite(omega) and omega > 0):
            raise ConfigError("policy.omega", omega, "must be a finite number > 0")
        if not (isinstance(rho, (int, float)) and 0 < rho <= 1):
            raise ConfigError("policy.rho", rho, "must be in (0, 1]")
        if unit not in UNITS:
            raise ConfigError("policy.unit", unit, f"must be one of {', '.join(UNITS)}")
        self.omega = float(omega)
        self.rho = float(rho)
        self.unit = unit

    def reset(self, ctx: PolicyContext) -> None:
        """Zero every expert's frequency and the clock."""
        super().reset(ctx)
        n = ctx.model.num_layers * ctx.model.num_experts
        self._E = ctx.model.num_experts
        self._by_token = self.unit == "token"
        self._age = -math.log(self.rho) / self.omega  # log-priority lost per idle unit, >= 0
        self._clock = 0.0  # passes (or tokens) begun
        self._mu = [0.0] * n  # activation frequency
        self._at = [0.0] * n  # clock at the last activation
        self._last = [-1] * n  # seq of the last access (ties)
        self._seq = 0
        self._counts: np.ndarray | None = None  # tokens per expert of the current pass
        self._ranked = RankedKeys()  # admitted keys by (s, last, key)

    def _rank(self, key: int) -> Rank:
        mu = self._mu[key]
        s = math.log(mu) + self._at[key] * self._age if mu > 0 else -math.inf
        return (s, self._last[key], key)

    def on_iteration_start(self, batch: BatchInfo) -> None:
        """A pass begins: the clock advances by one pass (or by the pass's tokens)."""
        self._clock += batch.num_tokens if self._by_token else 1

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Token mode: remember how many tokens the pass routes to each expert."""
        self._counts = gate.counts
        return NO_ACTIONS

    def on_access(self, key: int, outcome: Outcome) -> None:
        """``key`` is activated: grow ``mu``, restart ``nu`` at 0."""
        if self._by_token and self._counts is not None:
            self._mu[key] += float(self._counts[key % self._E])
        else:
            self._mu[key] += 1.0
        self._at[key] = self._clock
        self._last[key] = self._seq
        self._seq += 1
        self._rerank(key)

    def priority(self, key: int) -> float:
        """Eq. 4 for ``key`` now: ``mu * rho ** (nu / omega)``."""
        nu = self._clock - self._at[key]
        return self._mu[key] * self.rho ** (nu / self.omega)
