"""fMoE: fine-grained expert offloading guided by expert maps.

Implements ``000`` (fMoE) §3-§5 on the policy protocol:

- :class:`ExpertMapStore` — §4.1 and §4.4: per iteration an ``(L, J)`` probability map
  and the iteration's semantic embedding; capacity ``C``; when full, the stored map
  most redundant with the new one (RDY) is replaced.
- :class:`TrajectoryQuery` — §4.2 eq. 5, incremental: the cosine of each request's
  observed layers against every stored map's same layers.
- :func:`select_experts` — §4.3 eq. 6-8: ``δ = clip(1 - score, 0, 1)``, experts in
  descending probability until their sum reaches ``δ``, never fewer than top-k.
- :func:`prefetch_priority`, :func:`eviction_priority` — §4.5.
- :class:`FMoE` — the policy, with the §6.5 ablation variants as switches.
- :func:`pearson` — Fig. 8's correlation of similarity scores and hit rate.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Collection, Sequence

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
    RequestInfo,
    RequestTrace,
)

GUIDES = ("map", "hit_count", "speculate")
CACHES = ("fmoe", "lru", "lfu")
#: eq. 8's minimum at prefill: ``tokens`` = min(J, K * prompt tokens), ``top_k`` = K
PREFILL_K = ("tokens", "top_k")
_EPS = 1e-6  # tolerance of the cumulative-probability test (rows are float16 in traces)


def select_experts(probs: np.ndarray, top_k: int, score: float | None = None) -> list[int]:
    """§4.3 eq. 6-8: the experts of one layer to prefetch, most probable first.

    With ``score`` (a cosine similarity in [-1, 1]) the threshold is
    ``δ = clip(1 - score, 0, 1)`` and experts are taken in descending probability until
    their summed probability reaches ``δ`` (within 1e-6), but never fewer than
    ``top_k`` (eq. 8) and never one of probability 0 beyond the ``top_k``.  Without a
    score (``None``: the ablations without δ) exactly the ``top_k`` most probable.  Ties
    go to the smaller expert id.
    """
    return _select(np.asarray(probs, dtype=np.float64).tolist(), top_k, score)


def _select(p: list[float], top_k: int, score: float | None) -> list[int]:
    """:func:`select_experts` on a row given as a list."""
    # perf: a Python sort of the row (J <= a few hundred) beats numpy's per-call
    # overhead on rows this small; sorted() is stable, so ties keep the smaller id
    order = sorted(range(len(p)), key=p.__getitem__, reverse=True)
    k = min(int(top_k), len(p))
    if score is None:
        return order[:k]
    delta = min(max(1.0 - float(score), 0.0), 1.0) - _EPS
    total, n = 0.0, 0
    for e in order:  # the fewest experts whose summed probability reaches δ (eq. 6-7)
        if n >= k and (total >= delta or p[e] <= 0.0):
            break
        total += p[e]
        n += 1
    return order[:n]


def prefetch_priority(p: float, layer: int, current_layer: int) -> float:
    """§4.5: ``PRI_prefetch = p / (l - l_now)`` (higher goes first); ``layer`` must be
    ahead of ``current_layer`` (``-1`` before layer 0 runs)."""
    if layer <= current_layer:
        raise ValueError(f"prefetch target layer {layer} is not ahead of layer {current_layer}")
    return p / (layer - current_layer)


def eviction_priority(p: float, freq: float) -> float:
    """§4.5: ``PRI_evict = 1 / (p * freq)`` (higher is evicted first; ``inf`` at 0)."""
    v = p * freq
    return math.inf if v <= 0 else 1.0 / v


def pearson(x: Sequence[float] | np.ndarray, y: Sequence[float] | np.ndarray) -> float:
    """Pearson correlation of the pairs where both are finite (NaN if fewer than two
    pairs or either side is constant)."""
    a = np.asarray(x, dtype=np.float64)
    b = np.asarray(y, dtype=np.float64)
    ok = np.isfinite(a) & np.isfinite(b)
    a, b = a[ok], b[ok]
    if len(a) < 2:
        return math.nan
    a = a - a.mean()
    b = b - b.mean()
    den = math.sqrt(float(a @ a) * float(b @ b))
    return math.nan if den == 0 else float(a @ b) / den


class ExpertMapStore:
    """The Expert Map Store (§4.1, §4.4).

    Each entry is one iteration of one request: its expert map ``(L, J)`` (the mean
    gate probabilities of every layer) and its semantic embedding ``(D,)``.  Below
    capacity a new entry takes the next slot; at capacity it replaces the stored entry
    with the highest redundancy ``RDY = (d/L)·score_sem + ((L-d)/L)·score_map`` (§4.4:
    ``score_sem`` the cosine of the embeddings, ``score_map`` the cosine of the whole
    maps; ties: the lowest slot).  An entry without an embedding (``D = 0``, or a trace
    without them) contributes a semantic score of 0.  An all-zero map is not stored.

    perf: maps are stored layer-major ``(L, C, J)`` float32 with the inverse norm of
    every stored map's first ``l + 1`` layers precomputed, so a trajectory query adds
    one ``(B, J) @ (J, C)`` product per layer (:class:`TrajectoryQuery`); embeddings are
    stored unit-normalised, so a semantic query is one ``(B, D) @ (D, C)`` product.
    """

    def __init__(
        self,
        capacity: int,
        num_layers: int,
        num_experts: int,
        embedding_dim: int,
        prefetch_distance: int,
    ) -> None:
        if int(capacity) < 1:
            raise ValueError(f"store capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.L, self.J, self.D = int(num_layers), int(num_experts), int(embedding_dim)
        if not 1 <= int(prefetch_distance) <= self.L:
            raise ValueError(f"prefetch distance must be in [1, {self.L}], got {prefetch_distance}")
        self.d = int(prefetch_distance)
        self.size = 0
        C = self.capacity
        self._maps = np.zeros((self.L, C, self.J), dtype=np.float32)  # (L, C, J)
        self._inv_norm = np.zeros((self.L, C), dtype=np.float32)  # (L, C)
        self._emb = np.zeros((C, self.D), dtype=np.float32)  # (C, D) unit rows (0: none)
        self._sum = np.zeros((self.L, self.J), dtype=np.float64)  # (L, J) sum of stored maps

    # -- reading ----------------------------------------------------------------------
    def maps(self) -> np.ndarray:
        """The stored maps ``(size, L, J)`` in slot order (a copy)."""
        return self._maps[:, : self.size].transpose(1, 0, 2).copy()

    def embeddings(self) -> np.ndarray:
        """The stored unit embeddings ``(size, D)`` (zero rows where none)."""
        return self._emb[: self.size].copy()

    def map_rows(self, slot: int, start: int = 0) -> np.ndarray:
        """Layers ``start..L-1`` of the map in ``slot``: ``(L - start, J)`` (a view)."""
        return self._maps[start:, slot]

    def mean_map(self) -> np.ndarray:
        """The mean of the stored maps ``(L, J)``: the historical popularity of every
        expert (zeros when empty)."""
        return self._sum / self.size if self.size else np.zeros((self.L, self.J))

    def nbytes(self) -> int:
        """Bytes held by the store's arrays."""
        return self._maps.nbytes + self._inv_norm.nbytes + self._emb.nbytes + self._sum.nbytes

    # -- search -----------------------------------------------------------------------
    def semantic_scores(self, embeddings: np.ndarray) -> np.ndarray:
        """Eq. 4: cosine ``(B, size)`` of each new embedding ``(B, D)`` to each stored
        one (0 where either is zero)."""
        e = np.atleast_2d(np.asarray(embeddings, dtype=np.float32))
        stored = self._emb[: self.size]
        if len(e) == 1:  # perf: one matrix-vector product and a scalar norm
            n1 = math.sqrt(float(e[0] @ e[0]))
            return (stored @ (e[0] / n1))[None] if n1 > 0 else np.zeros((1, self.size), np.float32)
        n = np.sqrt(np.einsum("bd,bd->b", e, e))[:, None]  # (B, 1)
        e = np.divide(e, n, out=np.zeros_like(e), where=n > 0)
        return e @ stored.T

    def trajectory_scores(self, observed: np.ndarray) -> np.ndarray:
        """Eq. 5 (reference computation): cosine ``(B, size)`` of each request's observed
        layers ``(B, l, J)`` to every stored map's first ``l`` layers.  The policy uses
        the incremental :class:`TrajectoryQuery`."""
        obs = np.asarray(observed, dtype=np.float64)
        if obs.ndim == 2:
            obs = obs[None]
        n_l = obs.shape[1]
        stored = self._maps[:n_l, : self.size].astype(np.float64)  # (l, n, J)
        dot = np.einsum("lnj,blj->bn", stored, obs)
        norms = (
            np.sqrt((obs**2).sum(axis=(1, 2)))[:, None]
            * np.sqrt((stored**2).sum(axis=(0, 2)))[None, :]
        )
        return np.divide(dot, norms, out=np.zeros_like(dot), where=norms > 0)

    def redundancy(self, expert_map: np.ndarray, embedding: np.ndarray | None) -> np.ndarray:
        """§4.4: ``RDY (size,)`` of a new entry against every stored entry."""
        L, d = self.L, self.d
        m = np.asarray(expert_map, dtype=np.float32)
        n = self.size
        # perf: the whole-map cosine from the float32 store and its precomputed norms,
        # as one batched matrix-vector product per layer (einsum is ~2x slower)
        dot = np.matmul(self._maps[:, :n], m[:, :, None])[..., 0].sum(axis=0, dtype=np.float64)
        norm = float(np.sqrt((m.astype(np.float64) ** 2).sum()))
        score_map = dot * self._inv_norm[L - 1, :n] / norm if norm > 0 else np.zeros(n)
        rdy = ((L - d) / L) * score_map
        if embedding is not None and self.D:
            rdy += (d / L) * self.semantic_scores(np.asarray(embedding)[None])[0]
        return rdy

    def query(self, batch_size: int) -> TrajectoryQuery:
        """A matcher for one iteration of ``batch_size`` requests."""
        return TrajectoryQuery(self, batch_size)

    # -- update -----------------------------------------------------------------------
    def add(
        self,
        expert_map: np.ndarray,
        embedding: np.ndarray | None = None,
        score_map: np.ndarray | None = None,
        score_sem: np.ndarray | None = None,
    ) -> int:
        """Store one iteration's map ``(L, J)`` and embedding ``(D,)``; return its slot
        (-1 for an all-zero map).

        perf: ``score_map`` / ``score_sem`` (``(size,)``), when given, are this entry's
        cosines to the stored maps / embeddings as the search already computed them
        (the iteration's trajectory query ends with the whole-map dot products), so
        RDY costs nothing more; without them they are computed here."""
        m = np.asarray(expert_map)
        if m.shape != (self.L, self.J):
            raise ValueError(f"expert map shape {m.shape} != ({self.L}, {self.J})")
        if not np.isfinite(m).all() or (m < 0).any():
            raise ValueError("an expert map holds probabilities: finite and >= 0")
        if not m.any():
            return -1
        if embedding is not None and self.D:
            embedding = np.asarray(embedding, dtype=np.float32)
            if embedding.shape != (self.D,):
                raise ValueError(f"embedding shape {embedding.shape} != ({self.D},)")
        else:
            embedding = None
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
        else:
            if score_map is not None and len(score_map) == self.size:
                L, d = self.L, self.d
                rdy = ((L - d) / L) * score_map
                if embedding is not None and self.D:
                    if score_sem is None or len(score_sem) != self.size:
                        score_sem = self.semantic_scores(embedding[None])[0]
                    rdy = rdy + (d / L) * score_sem
            else:
                rdy = self.redundancy(m, embedding)
            slot = int(np.argmax(rdy))
            self._sum -= self._maps[:, slot]
        m32 = m.astype(np.float32)
        self._maps[:, slot] = m32
        self._sum += m32
        sq = np.cumsum((m32.astype(np.float64) ** 2).sum(axis=1))  # (L,)
        with np.errstate(divide="ignore"):
            self._inv_norm[:, slot] = np.where(sq > 0, 1.0 / np.sqrt(sq), 0.0)
        self._emb[slot] = 0.0
        if embedding is not None:
            n = float(np.linalg.norm(embedding))
            if n > 0:
                self._emb[slot] = embedding / n
        return slot


class TrajectoryQuery:
    """Eq. 5, one iteration of ``B`` requests whose layers are observed in order.

    :meth:`observe` adds layer ``l``'s probability rows ``(B, J)``; :meth:`best` returns
    each request's most similar stored map over the layers observed so far and its
    cosine.  The store must not change while a query is in use (the policy adds maps
    between iterations).
    """

    def __init__(self, store: ExpertMapStore, batch_size: int) -> None:
        self.store = store
        self.n = store.size
        self.layer = -1
        self.B = batch_size
        self._dot = np.zeros((batch_size, self.n), dtype=np.float32)  # (B, n)
        self._sim = np.empty((batch_size, self.n), dtype=np.float32)  # (B, n) scratch
        self._sq = [0.0] * batch_size  # squared norms of the observed rows
        # perf: views made once per query, not once per gate
        self._maps = store._maps[:, : self.n]  # (L, n, J)
        self._inv = store._inv_norm[:, : self.n]  # (L, n)
        self._dot0, self._sim0 = self._dot[0], self._sim[0]  # (n,) batch-1 rows

    def observe(self, layer: int, rows: np.ndarray) -> None:
        """Add layer ``layer``'s rows ``(B, J)`` (a later layer than the last one observed;
        a layer skipped adds nothing, as an encoder-decoder model's encoder layers in a
        decoding iteration)."""
        if layer <= self.layer:
            raise ValueError(f"layers must be observed in order: got {layer} after {self.layer}")
        self.layer = layer
        r = rows if rows.dtype == np.float32 else rows.astype(np.float32)
        if self.B == 1:  # perf: one matrix-vector product, no (1, n) temporaries
            r0 = r[0]
            self._sq[0] += float(r0 @ r0)
            if self.n:
                self._dot0 += self._maps[layer] @ r0
            return
        for b, v in enumerate(np.einsum("bj,bj->b", r, r).tolist()):
            self._sq[b] += v
        if self.n:
            self._dot += r @ self._maps[layer].T

    def best(self) -> tuple[list[int], list[float]]:
        """Per request, the slot of the most similar stored map (ties: the lowest slot)
        and its cosine; slot -1 and score NaN where nothing matches (empty store or
        nothing observed).

        perf: ranking needs only ``dot / ||stored prefix||`` (the request's own norm is a
        common factor), computed into a scratch buffer."""
        B = self.B
        if not self.n or self.layer < 0:
            return [-1] * B, [math.nan] * B
        if B == 1:
            sim0 = np.multiply(self._dot0, self._inv[self.layer], out=self._sim0)
            i = int(sim0.argmax())
            norm = math.sqrt(self._sq[0])
            return [i], [float(sim0[i]) / norm if norm > 0 else 0.0]
        sim = np.multiply(self._dot, self._inv[self.layer], out=self._sim)
        slots = sim.argmax(axis=1).tolist()
        scores = []
        for b, i in enumerate(slots):
            norm = math.sqrt(self._sq[b])
            scores.append(float(sim[b, i]) / norm if norm > 0 else 0.0)
        return slots, scores

    def full_scores(self) -> np.ndarray:
        """After every layer has been observed: the cosine ``(B, n)`` of each request's
        whole map to each stored map (``score_map`` of §4.4's RDY)."""
        if self.layer != self.store.L - 1:
            raise ValueError(f"full_scores needs all {self.store.L} layers observed")
        norm = np.sqrt(np.asarray(self._sq))[:, None]
        sim = (self._dot * self.store._inv_norm[self.layer, : self.n]).astype(np.float64)
        return np.divide(sim, norm, out=np.zeros_like(sim), where=norm > 0)


def _count_shares(counts: np.ndarray) -> np.ndarray:
    """A request's expert hit counts ``(L, J)`` as each layer's shares (a layer without
    tokens stays zero): the probabilities fMoE's ranking takes as ``p``.  In a
    decoder-only model every layer of a request routes its tokens times K, so this
    divides the matrix by one number and leaves the cosine matches and the top-k picks
    as the counts give them (an encoder-decoder's encoder and decoder layers route
    different numbers of tokens, and there each layer weighs the same in a match)."""
    total = counts.sum(axis=1, keepdims=True)  # (L, 1)
    return np.divide(counts, total, out=np.zeros_like(counts), where=total > 0)


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class FMoE(Policy):
    """fMoE's map-guided prefetching and caching (``000`` §4).

    Expert maps (§4.1).  paper: per iteration, the gate's probability distribution of
    every layer; the store keeps them with the iteration's semantic embedding.  here:
    each request of a batch contributes its own map (its mean gate probabilities, from
    :attr:`GateView.request_probs`) and embedding (:attr:`BatchInfo.embeddings`),
    because a batch's mixed map matches no single request's later iterations, and at
    batch 1 the two are the same (the paper states no batch size but Fig. 14b's 1-4); on a
    trace without probabilities (top-k-only import) the map row is the routed-token
    share of each expert instead.

    Search (§4.2).  paper: for the first ``d`` layers, semantic search (eq. 4) picks the
    stored iteration with the most similar embedding and uses its first ``d`` layers;
    at layer ``l``, trajectory search (eq. 5) picks the stored map most similar over
    "previous (l - 1) layers" and uses its ``P_{l+d}``.  here: per request, and the
    trajectory includes the current layer's gate, because its distribution is known at
    that gate and without it layer ``d`` (0-based) would have no match to guide it
    (0-based: at iteration start the semantic match prefetches layers ``0..d-1``; the
    gate of layer ``g`` has shown ``g + 1`` layers and prefetches layer ``g + d``).
    Without embeddings, or with semantic search off (the Map(T) ablation), the first
    ``d`` layers use the historical popularity (the mean stored map, top-k),
    MoE-Infinity's rule that §4.2 contrasts with.

    Selection (§4.3 eq. 6-8): :func:`select_experts` with the match's score
    (``dynamic_threshold``; off: top-k).  With a batch, the union over requests.
    paper: at least K experts, "the number of experts needed to activate per layer
    (e.g., Mixtral-8x7B activates two experts per layer)", stated for one token.  here
    (``prefill_k=tokens``): a prefill iteration's layer activates up to K experts per
    prompt token, so its minimum is ``min(J, K * prompt tokens)`` (the layers that see
    the prompt: every layer, or an encoder-decoder's encoder), because a map is the
    iteration's mean and eq. 8 bounds the experts the iteration needs.  The authors'
    public code (FineMoE-EuroSys26) searches and selects per prompt token instead, and
    each search clears what the previous one queued, so what stays queued is the last
    token's picks (``docs/policies.md``).  ``prefill_k=top_k``: K at prefill too.

    Asynchronous matching (§4.3).  paper: matching and prefetching run in another
    thread, off the critical path.  here: each decision's prefetches are held back by
    ``match_latency_s`` (:attr:`Actions.delay_s`): they start no earlier than the
    match would finish, so a distance ``d`` shorter than the latency cannot hide it
    (Fig. 13).  The paper gives no number for the latency (Fig. 15 only shows it off
    the critical path); the default, 20 us, is about this matcher's measured cost per
    query at C = 1K (``benchmarks/fmoe.py``: 8-22 us a query, depending on the search
    and the machine's load); set
    it to a measured value of a real matcher (Python threads, a GPU round trip) to
    study Fig. 13.

    Priorities (§4.5).  Prefetch: ``p / (l - l_now)`` (:func:`prefetch_priority`), the
    engine's queue value being ``1 -`` that; prefetches still queued are re-ranked at
    every gate as ``l_now`` advances; a prefetch of a layer that has passed without
    using it is cancelled if it has not started (the paper is silent; the bytes would
    only delay later transfers).  Eviction: ``1 / (p · freq)``
    (:func:`eviction_priority`).  paper: ``freq`` is "the cache visit frequency", so
    that the experts "less frequently hit" go first; ``p`` "the probability from the
    searched map".  here: ``p`` is the expert's probability in the latest searched map
    row of its layer (max over the batch's requests; 0 before any search covered it),
    as in the authors' scheduler (FineMoE ``task_scheduler.cpp``); ``freq`` its visits
    since it entered the cache, the visit that missed and brought it in included, a
    prefetch's load not (a prefetch never used ranks at ``1 / 0``, first out once
    unprotected), both forgotten on eviction (as the scheduler does).  The scheduler
    counts every load as a visit: ``freq_counts_load=true`` (a fresh prefetch then ranks
    by ``p``, like an expert used once).  The experts the current searches picked and
    that have not been used yet, loading or already in the cache, are not evicted while
    any other candidate is left (the scheduler's ``replace_cache_candidates``).  Ties:
    the oldest admission.  On a miss the engine pauses prefetches and loads on demand
    (§4.5).

    Store (§4.4): :class:`ExpertMapStore` with RDY replacement.  Offline mode (§6.1):
    ``serving.held_in_fraction=0.7`` gives 70% of the requests to :meth:`learn`, which
    fills the store before serving; online mode (§6.3): an empty store (``learn_online``
    adds every finished iteration, in both modes, as fMoE's step 5 does).  paper: RDY
    scores "new iteration data" against "historical iteration data".  here: a batch's
    maps are added one after another, so a later request's scores are taken against
    the store as the earlier ones left it and may replace one of them (the paper does not
    say how a batch's new maps meet each other; batch 1 is the same either way).

    Ablations (§6.5, Fig. 12).  ``guide``: ``map`` (expert maps), ``hit_count``
    (MoE-Infinity's request-level expert hit counts: the store holds one count matrix
    per finished request, matched by trajectory on the iteration's counts, top-k; the
    paper does not say what ``p`` its caching takes there: here each layer's shares of
    the counts, a probability as §4.5's ``p`` is, so a long request's counts do not
    outrank a short one's in eviction or in the first layers' popularity),
    ``speculate`` (the trace's speculative prediction ``spec_probs``, top-k of layer
    ``g + 1`` at gate ``g`` and of the next iteration's layer 0 at the last gate: the
    one-layer-ahead guess the trace records, so at distance 1 whatever ``d`` is — the
    paper notes its accuracy drops with distance).  ``semantic`` / ``trajectory`` /
    ``dynamic_threshold``: Map(T) = ``semantic=false, dynamic_threshold=false``;
    Map(T+S) = ``dynamic_threshold=false``; Map(T+S+δ) = all on (the default).
    ``cache`` (Fig. 12b): ``fmoe`` (the eviction priority above), ``lru`` or ``lfu``.

    ``label`` names the variant in results (the ablation presets set it).

    :meth:`report`: per iteration, the mean best semantic and trajectory scores of the
    matches used and the iteration's hit rate (Fig. 8); :func:`pearson` correlates them.
    """

    name = "fmoe"
    uses_probs = True
    uses_spec = True
    uses_request_gates = True

    def __init__(
        self,
        prefetch_distance: int = 3,
        store_capacity: int = 1000,
        guide: str = "map",
        semantic: bool = True,
        trajectory: bool = True,
        dynamic_threshold: bool = True,
        cache: str = "fmoe",
        match_latency_s: float = 2e-5,
        learn_online: bool = True,
        freq_counts_load: bool = False,
        prefill_k: str = "tokens",
        label: str | None = None,
    ) -> None:
        if int(prefetch_distance) < 1:
            raise ValueError(f"prefetch_distance must be >= 1, got {prefetch_distance}")
        if int(store_capacity) < 1:
            raise ValueError(f"store_capacity must be >= 1, got {store_capacity}")
        if guide not in GUIDES:
            raise ValueError(f"guide must be one of {list(GUIDES)}, got {guide!r}")
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {list(CACHES)}, got {cache!r}")
        if prefill_k not in PREFILL_K:
            raise ValueError(f"prefill_k must be one of {list(PREFILL_K)}, got {prefill_k!r}")
        if not (math.isfinite(match_latency_s) and match_latency_s >= 0):
            raise ValueError(f"match_latency_s must be finite and >= 0, got {match_latency_s}")
        self.prefetch_distance = int(prefetch_distance)
        self.store_capacity = int(store_capacity)
        self.guide = guide
        self.semantic = bool(semantic)
        self.trajectory = bool(trajectory)
        self.dynamic_threshold = bool(dynamic_threshold)
        self.cache = cache
        self.match_latency_s = float(match_latency_s)
        self.learn_online = bool(learn_online)
        self.freq_counts_load = bool(freq_counts_load)
        self.prefill_k = prefill_k
        if label is not None:
            self.name = str(label)  # type: ignore[misc]  # an ablation's name in results
        # perf: the engine builds speculative probabilities only for the variant using them
        self.uses_spec = guide == "speculate"  # type: ignore[misc]

    # -- run lifecycle ------------------------------------------------------------------
    def reset(self, ctx: PolicyContext) -> None:
        """Empty the store; forget visits, requests and the log."""
        super().reset(ctx)
        m = ctx.model
        L, J = m.num_layers, m.num_experts
        if self.prefetch_distance > L:
            raise ConfigError(
                "policy.prefetch_distance",
                self.prefetch_distance,
                f"must be at most the model's {L} MoE layers",
            )
        self._L, self._J, self._K, self._d = L, J, m.top_k, self.prefetch_distance
        self.store: ExpertMapStore | None = None  # built at the first map (needs D)
        # per key (L*J,), Python lists: read and written one key at a time
        self._freq = [0.0] * (L * J)  # visits since admission (freq_counts_load: load = 1)
        self._last = [0] * (L * J)  # recency stamp (cache="lru")
        self._admitted = [0] * (L * J)  # admission stamp (ties)
        self._held = [False] * (L * J)  # mirror of the keys of _pending and _kept (victim)
        self._clock = 0
        self._guide = [0.0] * (L * J)  # p of the latest search
        self._in: set[int] = set()  # keys admitted and not evicted
        self._in_layer: list[set[int]] = [set() for _ in range(L)]  # _in by layer
        # victim order (see victim): a heap of ranks (score, or inf while held; admission;
        # key) holding, for every key in _in, its entry _top[key], a lower bound of its
        # rank (entries of a key not equal to _top[key] are stale: compared by value,
        # since the compiled build boxes these tuples anew on every read); keys whose rank
        # may have dropped wait in _dirty until the next victim call
        self._heap: list[tuple[float, int, int]] = []
        self._top: dict[int, tuple[float, int, int]] = {}
        self._dirty: set[int] = set()
        # entries taken off the heap because their key was no candidate (in flight or
        # pinned) at a victim call: they wait here, not re-pushed, until a call finds
        # their key a candidate again (or the entry stale)
        self._parked: list[tuple[float, int, int]] = []
        self._guided = self.cache == "fmoe"  # the rank reads _guide
        self._rank = self._ranker()
        self._pending: dict[int, float] = {}  # prefetched key -> its map probability p
        # picked keys already in the cache -> their layer: held like _pending's until used
        self._kept: dict[int, int] = {}
        self._prompt: dict[int, int] = {}  # request id -> prompt tokens
        # per request of the iteration: eq. 8's minimum K of the layers below _k_hi
        self._k_req: list[int] = []
        self._k_hi = 0
        self._n_enc = m.encoder_layers
        self._req_counts: dict[int, np.ndarray] = {}  # hit_count: request -> (L, J)
        self._spec_first: np.ndarray | None = None  # speculate: next iteration's layer 0
        self._log: dict[str, list[float]] = {
            k: []
            for k in (
                "iteration",
                "prefill",
                "semantic_score",
                "trajectory_score",
                "hits",
                "accesses",
            )
        }
        self._rows = np.zeros((0, L, J), dtype=np.float32)  # (B, L, J) this iteration
        self._query: TrajectoryQuery | None = None
        self._sem_slots: list[int] = []  # per request: the semantic match's slot
        self._sem_scores: list[float] = []  # ... and its cosine
        self._sem_all: np.ndarray | None = None  # (B, n) semantic cosines, reused by RDY
        self._traj: list[float] = []  # per gate: mean best trajectory cosine
        self._hits = self._accesses = 0

    def _store(self, embedding_dim: int) -> ExpertMapStore:
        if self.store is None:
            self.store = ExpertMapStore(
                self.store_capacity, self._L, self._J, embedding_dim, self.prefetch_distance
            )
        return self.store

    def learn(self, requests: Sequence[RequestTrace]) -> None:
        """Offline mode: fill the store from held-in requests (every iteration's map and
        embedding; for ``guide=hit_count`` one count matrix per request)."""
        for r in requests:
            emb = r.embeddings
            store = self._store(0 if emb is None else emb.shape[1])
            if self.guide == "hit_count":
                store.add(_count_shares(np.asarray(r.counts, dtype=np.float64).sum(axis=0)))
                continue
            if self.guide != "map":
                continue
            maps = _maps_of(r.probs, r.counts)  # (T, L, J)
            for t in range(len(maps)):
                store.add(maps[t], None if emb is None else emb[t])

    def on_request_start(self, request: RequestInfo) -> None:
        """Note the prompt's length (eq. 8 at prefill); ``hit_count``: open the
        request's count matrix."""
        self._prompt[request.request_id] = request.prompt_tokens
        if self.guide == "hit_count":
            self._req_counts[request.request_id] = np.zeros((self._L, self._J))

    def on_request_end(self, request_id: int) -> None:
        """``hit_count``: file the finished request's counts (``learn_online``)."""
        self._prompt.pop(request_id, None)
        counts = self._req_counts.pop(request_id, None)
        if counts is not None and self.learn_online:
            self._store(0).add(_count_shares(counts))

    def on_iteration_start(self, batch: BatchInfo) -> Actions | None:
        """Semantic search; prefetch the first ``d`` layers."""
        B, d = len(batch.request_ids), self._d
        emb = batch.embeddings
        store = self._store(0 if emb is None else emb.shape[1])
        self._rows = np.zeros((B, self._L, self._J), dtype=np.float32)
        self._traj = []
        self._hits = self._accesses = 0
        self._sem_slots = []
        self._sem_scores = []
        self._sem_all = None  # (B, n) semantic cosines, reused by RDY
        self._query = store.query(B) if self.guide != "speculate" and self.trajectory else None
        K = self._K
        if batch.prefill and self.prefill_k == "tokens":
            # eq. 8 for an iteration of many tokens: at most K experts a token, so up to
            # min(J, K * prompt) a layer; the layers that see the prompt are the encoder's
            # of an encoder-decoder model (its decoder sees one token), else every one
            self._k_req = [min(self._J, K * self._prompt.get(r, 1)) for r in batch.request_ids]
            self._k_hi = self._n_enc or self._L
        else:
            self._k_req = [K] * B
            self._k_hi = 0
        if self.guide == "speculate":
            first, self._spec_first = self._spec_first, None
            if first is None:
                return None
            self._set_guide(0, np.asarray(first, dtype=np.float64).tolist())
            return self._actions(self._pick(first, 0, None, self._k(-1, 0)), -1, [])
        if not store.size:
            return None
        picks: list[tuple[int, float]] = []  # (key, p)
        if self.guide == "map" and self.semantic and emb is not None and store.D:
            scores = store.semantic_scores(emb)  # (B, n)
            self._sem_all = scores
            self._sem_slots = scores.argmax(axis=1).tolist()
            self._sem_scores = [float(scores[i, s]) for i, s in enumerate(self._sem_slots)]
            rows = store._maps[:d, self._sem_slots].transpose(1, 0, 2)  # (B, d, J)
            self._set_guide(0, rows.max(axis=0).ravel().tolist())
            for i in range(B):
                sc = self._sem_scores[i] if self.dynamic_threshold else None
                for layer in range(d):
                    picks += self._pick(rows[i, layer], layer, sc, self._k(i, layer))
        else:  # no semantic search: historical popularity for the first d layers
            pop = store.mean_map()
            self._set_guide(0, pop[:d].ravel().tolist())
            for layer in range(d):
                picks += self._pick(pop[layer], layer, None, self._k(-1, layer))
        return self._actions(picks, -1, [])

    def _set_guide(self, layer: int, p: list[float]) -> None:
        """Set ``p`` of layers ``layer, layer + 1, ...`` to ``p`` (``J`` floats a layer);
        the keys whose ``p`` dropped may rank lower (:meth:`victim`)."""
        J, guide = self._J, self._guide
        a = layer * J
        if self._guided:  # perf: only the keys in the cache are ranked
            for lay in range(layer, layer + len(p) // J):
                self._dirty.update([k for k in self._in_layer[lay] if p[k - a] < guide[k]])
        guide[a : a + len(p)] = p

    def _k(self, i: int, layer: int) -> int:
        """Eq. 8's minimum for request ``i`` (-1: the batch, its largest) at ``layer``."""
        if layer >= self._k_hi:
            return self._K
        return max(self._k_req) if i < 0 else self._k_req[i]

    def _pick(
        self, row: np.ndarray, layer: int, score: float | None, k: int
    ) -> list[tuple[int, float]]:
        """``(key, p)`` of the experts :func:`select_experts` picks from ``row``, at
        least ``k``."""
        return self._pick_list(row.tolist(), layer, score, k)

    def _pick_list(
        self, p: list[float], layer: int, score: float | None, k: int
    ) -> list[tuple[int, float]]:
        """:meth:`_pick` on a row given as a list."""
        base = layer * self._J
        return [(base + e, p[e]) for e in _select(p, k, score)]

    def _actions(
        self, picks: list[tuple[int, float]], now: int, cancel: list[int]
    ) -> Actions | None:
        """Prefetches of ``picks`` (union over requests, max p) not in the cache yet, and
        re-ranks of the pending ones, at ``PRI = p / (l - l_now)``; lower engine values
        go first, so the queue value is ``1 - PRI``."""
        pending, inbuf, held, kept = self._pending, self._in, self._held, self._kept
        J = self._J
        for key, p in picks:
            if key in pending:
                if p > pending[key]:
                    pending[key] = p
            elif key not in inbuf:
                pending[key] = p
                held[key] = True  # not in the cache: not ranked
            elif key not in kept:  # in the cache already: nothing to load, kept until used
                kept[key] = key // J
                held[key] = True  # its rank rises to inf (victim re-pushes a risen rank)
        if not pending and not cancel:
            return None
        # perf: prefetch_priority inlined (every pending key's layer is ahead of now)
        out = sorted([(1.0 - p / (key // J - now), key) for key, p in pending.items()])
        return Actions(
            prefetch=[Prefetch(key, v) for v, key in out],
            cancel=cancel,
            delay_s=self.match_latency_s,
        )

    def _gate_rows(self, gate: GateView) -> np.ndarray:
        """The rows ``(B, J)`` this gate adds to each request's map (or counts)."""
        rows = gate.request_probs
        if rows is not None and self.guide != "hit_count":
            return rows
        rc = gate.request_counts
        counts = (gate.counts[None] if rc is None else rc).astype(np.float32)
        if self.guide == "hit_count":
            return counts
        tot = counts.sum(axis=1, keepdims=True)  # no probabilities: routed-token shares
        return np.divide(counts, tot, out=np.zeros_like(counts), where=tot > 0)

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Trajectory search; prefetch layer ``layer + d``; cancel passed prefetches."""
        L, J = self._L, self._J
        rows = self._gate_rows(gate)
        if len(rows) == len(self._rows):
            self._rows[:, layer] = rows
        # prefetches of this layer are settled: used now, or passed unused
        base, cancel = layer * J, []
        if self._pending:
            counts = gate.counts
            dirty = self._dirty
            for key in [k for k in self._pending if k < base + J]:
                del self._pending[key]
                self._held[key] = False
                dirty.add(key)  # its rank drops from inf
                if key < base or not counts[key - base]:
                    cancel.append(key)
        if self._kept:
            kept, dirty = self._kept, self._dirty
            for key in [k for k, lay in kept.items() if lay <= layer]:
                del kept[key]
                self._held[key] = False
                dirty.add(key)  # its rank drops from inf
        picks: list[tuple[int, float]] = []
        target = layer + self._d
        store = self.store
        if self.guide == "speculate":
            spec = gate.spec_next
            if spec is not None:
                if layer + 1 < L:
                    p = np.asarray(spec, dtype=np.float64).tolist()
                    self._set_guide(layer + 1, p)
                    picks = self._pick_list(p, layer + 1, None, self._k(-1, layer + 1))
                else:
                    self._spec_first = np.array(spec)
        elif self._query is not None:
            q = self._query
            q.observe(layer, rows)
            slots, scores = q.best() if target < L else ([-1], [])  # the last d gates: no use
            if slots[0] >= 0:
                self._traj.append(sum(scores) / len(scores))  # the matches used only
                assert store is not None
                if len(slots) == 1:  # perf: one row, no fancy indexing
                    mapped = store._maps[target, slots[0] : slots[0] + 1]  # (1, J)
                    rows_p = mapped.tolist()
                    self._set_guide(target, rows_p[0])
                else:
                    mapped = store._maps[target, slots]  # (B, J)
                    rows_p = mapped.tolist()
                    self._set_guide(target, mapped.max(axis=0).tolist())
                for i, sc in enumerate(scores):
                    if self.guide == "hit_count":  # the stored shares, top-k
                        row = mapped[i]  # float32: sums to 1 only up to rounding
                        tot = float(row.sum())
                        picks += self._pick(
                            row / tot if tot > 0 else row, target, None, self._k(i, target)
                        )
                    else:
                        picks += self._pick_list(
                            rows_p[i],
                            target,
                            sc if self.dynamic_threshold else None,
                            self._k(i, target),
                        )
        elif target < L and self._sem_slots and store is not None:
            # trajectory search off: the semantic match guides every layer
            mapped = store._maps[target, self._sem_slots]  # (B, J)
            self._set_guide(target, mapped.max(axis=0).tolist())
            for i, sc in enumerate(self._sem_scores):
                sc_i = sc if self.dynamic_threshold else None
                picks += self._pick(mapped[i], target, sc_i, self._k(i, target))
        acts = self._actions(picks, layer, cancel)
        return NO_ACTIONS if acts is None else acts

    def on_iteration_end(self, batch: BatchInfo) -> None:
        """Log the iteration's scores and hit rate; store its maps (``learn_online``)."""
        log = self._log
        log["iteration"].append(batch.iteration)
        log["prefill"].append(batch.prefill)
        sem = self._sem_scores
        log["semantic_score"].append(sum(sem) / len(sem) if sem else math.nan)
        traj = self._traj
        log["trajectory_score"].append(sum(traj) / len(traj) if traj else math.nan)
        log["hits"].append(self._hits)
        log["accesses"].append(self._accesses)
        if self.guide == "hit_count":
            for i, rid in enumerate(batch.request_ids):
                if rid in self._req_counts:
                    self._req_counts[rid] += self._rows[i]
            return
        if self.guide != "map" or not self.learn_online:
            return
        store = self.store
        assert store is not None
        emb = batch.embeddings
        q = self._query
        # perf: the search already has each request's cosines to the store (RDY's inputs)
        full = q.full_scores() if q is not None and q.n and q.layer == self._L - 1 else None
        n0 = store.size
        for i in range(len(batch.request_ids)):
            fresh = store.size == n0 and (i == 0 or n0 < store.capacity)
            store.add(
                self._rows[i],
                None if emb is None else emb[i],
                full[i] if full is not None and fresh else None,
                self._sem_all[i] if self._sem_all is not None and fresh else None,
            )

    # -- cache ------------------------------------------------------------------------
    def on_access(self, key: int, outcome: Outcome) -> None:
        """Count the visit (eviction priority, LFU) and the iteration's hit rate."""
        self._freq[key] += 1.0
        self._clock += 1
        self._last[key] = self._clock  # the rank only rises (p >= 0): _top stays a bound
        self._accesses += 1
        if outcome is Outcome.HIT:
            self._hits += 1

    def on_insert(self, key: int) -> None:
        """Track what the cache holds; the load is the first in-cache visit."""
        self._in.add(key)
        self._in_layer[key // self._J].add(key)
        # the visit that missed and brought it in counts (on_access came first); a
        # prefetch's load counts only with freq_counts_load (the authors' scheduler)
        freq = self._freq
        freq[key] = 1.0 if self.freq_counts_load or freq[key] > 0.0 else 0.0
        self._clock += 1
        self._last[key] = self._admitted[key] = self._clock
        self._dirty.add(key)

    def on_evict(self, key: int) -> None:
        """Forget an evicted or cancelled expert (its in-cache visits and ``p``)."""
        self._in.discard(key)
        self._in_layer[key // self._J].discard(key)
        self._top.pop(key, None)  # its heap entries are stale now
        if self._pending.pop(key, None) is not None or self._kept.pop(key, None) is not None:
            self._held[key] = False
        self._freq[key] = 0.0
        self._guide[key] = 0.0

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """``cache=fmoe``: the highest ``1 / (p · freq)``, i.e. the lowest ``p · freq``;
        ``lru``: least recently used; ``lfu``: fewest in-cache visits.  Experts picked
        by the current searches and not used yet go last; ties: the oldest admission.

        perf: the keys in the cache are ranked by ``(score, or inf while held;
        admission)`` in a heap whose entry per key is a lower bound of its rank: a
        visit only raises a rank and pushes nothing; a rank that may have dropped (a
        new key, a new ``p``, a released hold) is pushed at the next call.  The top
        entry is exact, or re-pushed at its current rank; the first exact top that is a
        candidate is the victim.  A key met on the way that is no candidate (pinned or
        in flight) parks its entry off the heap; each call first puts back the parked
        entries whose keys are candidates now, so a prefetch in flight is passed over
        once, not at every call until it lands.
        When that key is held (every candidate is: they then rank by score alone), or
        no candidate is found, every candidate is scored."""
        if not candidates:
            raise ValueError("FMoE.victim called with no candidates")
        heap, top, rank = self._heap, self._top, self._rank
        push = heapq.heappush
        parked = self._parked
        if parked:  # back to the heap: the parked keys that are candidates now
            still = []
            for e in parked:
                key = e[2]
                if top.get(key) == e:
                    if key in candidates:
                        push(heap, e)
                    else:
                        still.append(e)
            self._parked = parked = still
        if self._dirty:
            for key in self._dirty & self._in:
                r = rank(key)
                old = top.get(key)
                if old is None or r < old:
                    top[key] = r
                    push(heap, r)
            self._dirty.clear()
            if len(heap) > 2 * len(top) + 64:  # drop the stale entries
                heap[:] = top.values()
                heapq.heapify(heap)
                parked.clear()  # their entries are in the heap again
        pop, replace = heapq.heappop, heapq.heapreplace
        found = -1
        while heap:
            e = heap[0]
            key = e[2]
            if top.get(key) != e:
                pop(heap)
                continue
            r = rank(key)
            if r != e:  # risen since it was pushed
                top[key] = r
                replace(heap, r)
            elif key in candidates:
                if not self._held[key]:
                    found = key
                break
            else:
                parked.append(pop(heap))
        return found if found >= 0 else self._victim_scan(candidates)

    def _ranker(self) -> Callable[[int], tuple[float, int, int]]:
        """The victim order of a key (lowest first): ``(inf, admission, key)`` while
        held, else ``(score, admission, key)``."""
        held, adm, inf = self._held, self._admitted, math.inf
        if self.cache == "lru":
            last = self._last

            def rank(key: int) -> tuple[float, int, int]:
                return (inf, adm[key], key) if held[key] else (last[key], adm[key], key)

        elif self.cache == "lfu":
            freq = self._freq

            def rank(key: int) -> tuple[float, int, int]:
                return (inf, adm[key], key) if held[key] else (freq[key], adm[key], key)

        else:
            guide, freq = self._guide, self._freq

            def rank(key: int) -> tuple[float, int, int]:
                if held[key]:
                    return (inf, adm[key], key)
                return (guide[key] * freq[key], adm[key], key)

        return rank

    def _score(self, key: int) -> float:
        """The eviction score of ``key`` (lower goes first)."""
        if self.cache == "lru":
            return self._last[key]
        if self.cache == "lfu":
            return self._freq[key]
        return self._guide[key] * self._freq[key]

    def _victim_scan(self, candidates: Collection[int]) -> int:
        """:meth:`victim` by scoring every candidate."""
        held, adm, score = self._held, self._admitted, self._score
        keys = list(candidates)
        if not all(held[k] for k in keys):
            return min(keys, key=self._rank)
        return min(keys, key=lambda k: (score(k), adm[k]))  # all held: by score alone

    def report(self) -> dict[str, np.ndarray]:
        """Per iteration: ``iteration``, ``prefill``, ``semantic_score`` and
        ``trajectory_score`` (mean best cosine of the matches used; NaN where none),
        ``hits``, ``accesses`` and ``hit_rate`` (Fig. 8), and ``store_mb``: the Expert Map
        Store's memory in MB (1e6 bytes), allocated for its whole capacity when its first
        map arrives (Fig. 16; NaN before)."""
        out = {k: np.asarray(v) for k, v in self._log.items()}
        acc = out["accesses"].astype(np.float64)
        out["hit_rate"] = np.divide(out["hits"], acc, out=np.full(len(acc), np.nan), where=acc > 0)
        store_mb = math.nan if self.store is None else self.store.nbytes() / 1e6
        out["store_mb"] = np.full(len(acc), store_mb)
        return out

    def correlations(self, decode_only: bool = False) -> dict[str, float]:
        """Fig. 8: Pearson correlation of each score with the iteration hit rate (over
        decode iterations only with ``decode_only``: a prefill routes many tokens, so
        its hit rate and scores differ for reasons of their own)."""
        r = self.report()
        keep = ~r["prefill"].astype(bool) if decode_only else np.ones(len(r["prefill"]), bool)
        return {
            "semantic": pearson(r["semantic_score"][keep], r["hit_rate"][keep]),
            "trajectory": pearson(r["trajectory_score"][keep], r["hit_rate"][keep]),
        }


def _maps_of(probs: np.ndarray | None, counts: np.ndarray) -> np.ndarray:
    """Expert maps ``(T, L, J)``: the probabilities, or routed-token shares without them."""
    if probs is not None:
        return np.asarray(probs, dtype=np.float32)
    c = np.asarray(counts, dtype=np.float32)
    tot = c.sum(axis=2, keepdims=True)
    return np.divide(c, tot, out=np.zeros_like(c), where=tot > 0)
