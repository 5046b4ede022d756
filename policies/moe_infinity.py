"""MoE-Infinity: request-level expert activation tracing, activation-aware prefetch and cache.

Implements ``003`` (MoE-Infinity) §4-§6 on the policy protocol:

- :class:`EAMC` — the Expert Activation Matrix Collection (§4.2): fixed capacity, cosine
  matching over the layers observed so far, replacement of the most similar entry, saved
  and reloaded as ``.npz`` (§5.3 "Failure recovery").
- :func:`activation_priorities` — Fig. 7: aggregate matched EAMs, normalise rows into
  activation probabilities, weight by layer proximity ``1 - (i - l) / L``.
- :class:`MoEInfinity` — the policy: prefetch (§5.1) and caching (§5.2), every design
  intuition a switch for Table 4's ablation.
"""

from __future__ import annotations

import heapq
import os
from collections.abc import Collection, Sequence
from pathlib import Path
from zipfile import BadZipFile

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.atomic import save_npz_atomic
from fmoesim.errors import ConfigError
from policies.base import (
    NO_ACTIONS,
    Actions,
    BatchInfo,
    GateView,
    Outcome,
    Policy,
    PolicyContext,
    PrefetchBatch,
    RequestInfo,
    RequestTrace,
)

EAMC_FORMAT = 1  # version of the .npz layout written by :func:`save_eamcs`
INF = float("inf")


class EAMC:
    """Expert Activation Matrix Collection (``003`` §4.2, Fig. 5).

    Holds at most ``capacity`` request-level EAMs, each an ``(L, E)`` matrix of token
    counts.  Two EAMs match by the cosine similarity of their flattened matrices; a
    partial EAM (layers ``0..l`` observed) matches over those layers only.  When full,
    :meth:`add` replaces the stored EAM most similar to the new one (it keeps the newest
    pattern and the diversity of the rest).  An all-zero EAM has no direction and is
    not stored.

    perf: storage is layer-major, ``(L, C, E)``, with the squared norm of every stored
    EAM's first ``l + 1`` layers precomputed, so matching a growing iteration EAM adds
    one ``(C, E) @ (E,)`` product per layer (:class:`EAMCQuery`) instead of redoing
    ``(C, (l + 1) E)`` at every layer.
    """

    def __init__(self, capacity: int, num_layers: int, num_experts: int) -> None:
        if int(capacity) < 1:
            raise ValueError(f"EAMC capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.L, self.E = int(num_layers), int(num_experts)
        self.size = 0
        self._eams = np.zeros((self.L, self.capacity, self.E), dtype=np.float32)  # (L, C, E)
        # 1 / ||first l+1 layers|| of each stored EAM (0 where that prefix is all zero)
        self._inv_norm = np.zeros((self.L, self.capacity), dtype=np.float32)  # (L, C)

    def eams(self) -> np.ndarray:
        """The stored EAMs, ``(size, L, E)``, in slot order (a copy)."""
        return self._eams[:, : self.size].transpose(1, 0, 2).copy()

    def similarity(self, eam: np.ndarray) -> np.ndarray:
        """Cosine similarity ``(size,)`` of ``eam`` (``(l + 1, E)``: its first layers, or
        the whole ``(L, E)``) to each stored EAM over the same layers (0 for zero norms).
        The plain reference computation; the policy uses :class:`EAMCQuery`."""
        eam = np.asarray(eam, dtype=np.float64)
        n_l = eam.shape[0]
        stored = self._eams[:n_l, : self.size].astype(np.float64)  # (l + 1, n, E)
        dot = np.einsum("lne,le->n", stored, eam)
        norms = np.sqrt((stored**2).sum(axis=(0, 2))) * np.sqrt((eam**2).sum())
        out = np.zeros(self.size)
        ok = norms > 0
        out[ok] = dot[ok] / norms[ok]
        return out

    def add(self, eam: np.ndarray) -> int:
        """Store ``eam`` (``(L, E)``); return its slot, or -1 for an all-zero EAM.

        Below capacity it takes the next free slot; at capacity it replaces the most
        similar stored EAM (ties: the lowest slot).
        """
        eam = np.asarray(eam)
        if eam.shape != (self.L, self.E):
            raise ValueError(f"EAM shape {eam.shape} != ({self.L}, {self.E})")
        if not np.isfinite(eam).all() or (eam < 0).any():
            raise ValueError("an EAM holds token counts: finite and >= 0")
        if not eam.any():
            return -1
        if self.size < self.capacity:
            slot = self.size
            self.size += 1
        else:
            slot = int(np.argmax(self.similarity(eam)))
        e32 = eam.astype(np.float32)
        self._eams[:, slot] = e32
        sq = np.cumsum((e32.astype(np.float64) ** 2).sum(axis=1))  # (L,)
        with np.errstate(divide="ignore"):
            self._inv_norm[:, slot] = np.where(sq > 0, 1.0 / np.sqrt(sq), 0.0)
        return slot

    def query(self) -> EAMCQuery:
        """A matcher for one iteration whose layers are observed in order."""
        return EAMCQuery(self)


class EAMCQuery:
    """Matches an iteration-level EAM, observed layer by layer, against an :class:`EAMC`.

    Call :meth:`observe` for layers ``0, 1, 2, ...`` in order (a layer left out counts
    no tokens); :meth:`top` then ranks the
    stored EAMs by cosine similarity over the layers observed so far.  The collection
    must not change while a query is in use (the policy adds EAMs between iterations).
    """

    def __init__(self, eamc: EAMC) -> None:
        self.eamc = eamc
        self.n = eamc.size
        self.layer = -1
        self._dot = np.zeros(self.n, dtype=np.float32)  # (n,) running dot products
        self._sq = 0.0  # squared norm of the observed iteration EAM

    def observe(self, layer: int, counts: np.ndarray) -> None:
        """Add layer ``layer``'s token counts ``(E,)`` (a later layer than the last one
        observed; a layer skipped counts no tokens, as an encoder-decoder model's encoder
        layers in a decoding iteration)."""
        if layer <= self.layer:
            raise ValueError(f"layers must be observed in order: got {layer} after {self.layer}")
        self.layer = layer
        if self.n:
            c = counts.astype(np.float32)
            self._dot += self.eamc._eams[layer, : self.n] @ c
            self._sq += float(c @ c)

    def similarity(self) -> np.ndarray:
        """Cosine similarity ``(n,)`` of the observed layers to each stored EAM."""
        if self._sq == 0.0 or self.layer < 0:
            return np.zeros(self.n)
        return (
            self._dot.astype(np.float64)
            * self.eamc._inv_norm[self.layer, : self.n]
            / np.sqrt(self._sq)
        )

    def top(self, k: int) -> list[int]:
        """Slots of the ``k`` most similar stored EAMs with similarity > 0, most similar
        first, ties to the lower slot (up to float32 rounding: two EAMs of exactly equal
        cosine may score a last bit apart, and the higher slot can then win).

        perf: ranking needs only ``dot / ||stored prefix||`` (the query's own norm is a
        common factor); one ``argmax`` for ``k == 1``, a partition for larger ``k``.
        """
        if not self.n or self._sq == 0.0 or self.layer < 0:
            return []
        score = self._dot * self.eamc._inv_norm[self.layer, : self.n]  # (n,)
        if k == 1:
            i = int(np.argmax(score))
            return [i] if score[i] > 0 else []
        if k < self.n:
            # perf: partition out the k best (O(n)), then order only those
            kth = np.partition(score, self.n - k)[self.n - k]
            cand = (score >= kth).nonzero()[0]  # ascending slots; ties at kth included
        else:
            cand = np.arange(self.n)
        cs = score[cand]
        order = np.lexsort((cand, -cs))[:k]  # most similar first, then lower slot
        return [int(cand[i]) for i in order if cs[i] > 0]


def activation_priorities(matched: np.ndarray, layer: int, proximity: bool = True) -> np.ndarray:
    """Fig. 7: prefetch priorities ``(L, E)`` of the layers after ``layer``.

    ``matched`` ``(k, L, E)``: the matched EAMs.  Step 2 sums them and normalises each
    row into activation probabilities; step 3 multiplies row ``i`` by the layer
    proximity ``1 - (i - layer) / L`` (when ``proximity``).  Rows ``<= layer`` and rows
    whose matched counts are all zero are 0.
    """
    matched = np.asarray(matched, dtype=np.float64)
    agg = matched.sum(axis=0)  # (L, E)
    L = agg.shape[0]
    out = np.zeros_like(agg)
    rows = agg[layer + 1 :]
    tot = rows.sum(axis=1, keepdims=True)
    np.divide(rows, tot, out=out[layer + 1 :], where=tot > 0)
    if proximity:
        i = np.arange(layer + 1, L)
        out[layer + 1 :] *= (1.0 - (i - layer) / L)[:, None]
    return out


def save_eamcs(path: str | os.PathLike[str], collections: dict[str, EAMC]) -> None:
    """Write named collections to one ``.npz`` (no pickle), atomically (temp + rename)."""
    path = Path(path)
    arrays: dict[str, np.ndarray] = {"format": np.array(EAMC_FORMAT, dtype=np.int64)}
    for name, c in collections.items():
        arrays[f"{name}_eams"] = c.eams()
        arrays[f"{name}_capacity"] = np.array(c.capacity, dtype=np.int64)
    save_npz_atomic(path, arrays)


def load_eamcs(
    path: str | os.PathLike[str],
    names: Sequence[str],
    num_layers: int,
    num_experts: int,
    capacity: int | None = None,
) -> dict[str, EAMC]:
    """Read the collections ``names`` written by :func:`save_eamcs`; a one-line
    ``ValueError`` names the file, the key and the broken rule.  ``capacity``
    overrides the saved capacity (the EAMs are re-added in slot order, so a smaller one
    applies the replacement rule)."""
    path = Path(path)
    try:
        z = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, BadZipFile) as exc:
        raise ValueError(f"{path}: not a readable .npz EAMC file ({str(exc) or 'empty'})") from None
    if isinstance(z, np.ndarray):  # a .npy array
        raise ValueError(
            f"{path}: a .npy array (rule: an EAMC file is the .npz archive save_eamcs writes)"
        )
    with z:
        if "format" not in z.files or int(z["format"]) != EAMC_FORMAT:
            raise ValueError(f"{path}: key 'format' must be {EAMC_FORMAT}")
        out = {}
        for name in names:
            ek, ck = f"{name}_eams", f"{name}_capacity"
            for k in (ek, ck):
                if k not in z.files:
                    raise ValueError(f"{path}: missing key {k!r}")
            eams, cap = z[ek], int(z[ck])
            if eams.ndim != 3 or eams.shape[1:] != (num_layers, num_experts):
                raise ValueError(
                    f"{path}: key {ek!r} has shape {eams.shape}, "
                    f"expected (n, {num_layers}, {num_experts})"
                )
            if len(eams) > cap:
                raise ValueError(f"{path}: key {ek!r} holds {len(eams)} EAMs > capacity {cap}")
            bad = np.flatnonzero(~(np.isfinite(eams) & (eams >= 0)).all(axis=(1, 2)))
            if len(bad):
                raise ValueError(
                    f"{path}: key {ek!r} row {int(bad[0])} is not finite non-negative counts"
                )
            c = EAMC(cap if capacity is None else capacity, num_layers, num_experts)
            for eam in eams:
                c.add(eam)
            out[name] = c
    return out


PHASES = ("prefill", "decode")
MATCH_ON = ("iteration", "request")  # MoEInfinity.match_on: §5.1's, the public code's


@mypyc_attr(allow_interpreted_subclasses=True)  # tests subclass it
class MoEInfinity(Policy):
    """MoE-Infinity's activation-aware prefetching and caching (``003`` §4-§5).

    Tracing (§4.1).  paper: an iteration-level EAM counts the tokens each expert gets in
    one iteration; a request-level EAM accumulates them, "traced for prefilling and
    decoding separately".  here: the iteration EAM of the batch is built gate by gate
    (summed over the batch, as the paper's query runs once per layer per batched input);
    each request keeps a prefill EAM and a decode EAM (from
    :attr:`GateView.request_counts`), added to at the end of each iteration.  When a
    request ends, its prefill EAM joins a prefill EAMC and its decode EAM a decode EAMC
    (two collections, because the phases are traced separately; a prefill iteration is
    matched against the prefill collection, a decode iteration against the decode one).
    Encoder-decoder models (Switch, NLLB: §7.1).  paper: evaluated, the EAM's layout for
    them not described.  here: every MoE layer is a row of the EAM; a decoding iteration
    runs the decoder's layers only, so the decode EAMs hold no encoder tokens and its
    query starts at the decoder's first layer (the encoder's rows count zero), while the
    prefill EAMs hold the encoder's prompt and the decoder's start token.

    Prefetch (§5.1, Fig. 7).  paper: after each gate, match the iteration EAM against
    the EAMC, aggregate the matches and normalise rows into activation probabilities,
    weight layer ``i`` by ``1 - (i - l) / L``, re-rank the prefetch queue for all
    subsequent layers, take the top-K (K = buffer slots), skip what is in the buffer and
    prefetch the rest; on-demand fetches jump the queue.  here: exactly that, with
    K = the GPU's slots minus the experts the current layer routes to on it (per GPU
    with several GPUs), because those slots are taken by experts in use, which a
    prefetch cannot evict, so a top-K of all the slots would queue prefetches that
    find no room; experts with zero probability are never prefetched; a prefetch
    still queued is re-ranked (the engine moves it to its new priority); queued
    prefetches that fall out of the top-K, or whose layer has passed unrouted, are
    cancelled.  An empty collection (a cold start) predicts nothing.
    The public code (TorchMoE/MoE-Infinity, April 2024) queues every expert from the
    current layer on in score order with no top-K (``docs/policies.md``); here §5.1's
    top-K, because the claims checked are the paper's.  The paper does not say when a
    queued prefetch takes its slot; the public code's I/O thread evicts for it when it
    takes the task off the queue.  here: the engine's ``engine.reserve`` decides
    (``submit`` by default: when queued; ``start``: the public code's).

    Matching (``match_on``).  paper (§5.1, Fig. 7): the iteration-level EAM, matched over
    the layers it has run.  here: that by default (``"iteration"``).  ``"request"`` is
    the public code's ``find_most_similar``, for comparison: the request-level EAM of the
    batch's requests (their earlier iterations, both phases) against each stored EAM of
    the phase's collection over the layers after the current one, scored by the sum of
    the per-layer cosines (a layer with no counts on either side scores 0), the best
    ``num_matched`` with a score above 0 aggregated as in Fig. 7.  Where those layers
    hold no counts (a request's first iteration) it matches as ``"iteration"`` does: the
    public code ties every stored EAM there and takes the first.  It costs a float64
    copy of the collection per iteration and one ``(L - l - 1, C, E)`` product a gate,
    where ``"iteration"`` costs one ``(C, E)`` product a gate.

    Caching (§5.2, Fig. 8).  paper: slots hold experts being fetched and cache used ones;
    the victim is the cached expert with the lowest priority from the request-level
    EAM; prefetched experts get the maximal priority until used or judged unused; the
    priority resets to the request-level EAM count (i) after the expert's inference,
    (ii) for a prefetched expert the gate did not route to, (iii) for a prefetched
    expert that left the top-K; initial layers get higher caching priority.
    here: cache priority of expert ``(l, e)`` = the summed request-level EAM count of
    the batch's requests (the decode EAM once a request has decoded, before that its
    prefill EAM) over its layer's row total: the activation frequency, on the scale of a
    prefetch's predicted probability, which a load compares it with at admission (within
    a layer the counts' order, for a decoder-only model: an encoder-decoder's prefill EAM
    has encoder rows summing to the prompt and decoder rows to 1), times ``2 - l / L``
    when ``initial_layer_priority`` (the paper gives no formula; a linear boost chosen
    here, from 2x at the first layer to ~1x at the last, so the preference at most
    doubles a priority and never reorders one layer's experts), recomputed at each
    iteration start (the paper updates request EAMs at iteration end).  A prediction
    takes a free slot, or the slot of the cached expert of lowest cache priority if that
    priority is below its own: §5.1 starts prefetches "into the slots that exhibit lower
    priorities" and §5.2 names the victim.  §5.2 also gives an expert being prefetched
    "maximal" priority; read as "displace whatever the priority", the top-K predictions
    (K = every slot) would evict the cache at every gate: on the regression setting
    (``fmoesim-regress``, hit-rate-only) that reading drops this preset from 14.0% to
    6.6% at 12 GB and from 56.5% to 25.4% at 48 GB.  With the boost the priorities reach
    2 while a prediction stays below 1, so a cached expert of an early layer with a
    frequency of 0.5 or more is never displaced by a prefetch; and a gate's own
    cancellations do not count as free slots for its new prefetches, which then need
    room from the cache.  An expert in the current top-K that is already in the buffer
    is protected as well (the top-K own the slots).  Ties go to the oldest admission; if
    every candidate is protected, the least important prediction goes.

    Switches (Table 4 and §7.5): ``request_level_tracing`` (off: every expert of the
    next layers equally likely, the "vanilla" dependency prefetch), ``multi_layer`` (off:
    only layer ``l + 1``), ``layer_proximity``, ``initial_layer_priority``,
    ``num_matched`` (EAMs aggregated), ``eamc_capacity``; ``learn_online`` adds each
    finished request to the collections; ``eamc_path`` pre-fills them from a file saved
    by :meth:`save` ("offline" mode; so does ``serving.held_in_fraction`` through
    :meth:`learn`).  ``label`` names a variant in results (Table 4's ablation presets).

    Synchronous prefetching.  paper: MoE-Infinity's own §5.1 issues prefetches to a
    queue served beside the computation; fMoE (``000``) §4.3 says of its codebase that
    "MoE-Infinity cannot compute forward functions before finishing expert prediction
    and prefetching at every MoE layer", and §6.1 runs it with "synchronous expert
    prediction and prefetching".  here: asynchronous by default, as MoE-Infinity's paper
    describes it; ``synchronous=True`` makes a layer compute no expert before every
    transfer in flight on its GPU has landed (:meth:`Policy.waits_for_prefetches`), the
    reading of fMoE's presets (``policy=moe-infinity-sync``).
    """

    name = "moe-infinity"
    uses_request_gates = True

    def __init__(
        self,
        eamc_capacity: int = 1000,
        num_matched: int = 1,
        request_level_tracing: bool = True,
        multi_layer: bool = True,
        layer_proximity: bool = True,
        initial_layer_priority: bool = True,
        learn_online: bool = True,
        eamc_path: str | None = None,
        label: str | None = None,
        synchronous: bool = False,
        match_on: str = "iteration",
    ) -> None:
        self.synchronous = bool(synchronous)
        if match_on not in MATCH_ON:
            raise ValueError(f"match_on must be one of {', '.join(MATCH_ON)}, got {match_on!r}")
        self.match_on = str(match_on)
        if label is not None:
            self.name = str(label)  # type: ignore[misc]  # an ablation's name in results
        if int(eamc_capacity) < 1:
            raise ValueError(f"eamc_capacity must be >= 1, got {eamc_capacity}")
        if int(num_matched) < 1:
            raise ValueError(f"num_matched must be >= 1, got {num_matched}")
        self.eamc_capacity = int(eamc_capacity)
        self.num_matched = int(num_matched)
        self.request_level_tracing = bool(request_level_tracing)
        self.multi_layer = bool(multi_layer)
        self.layer_proximity = bool(layer_proximity)
        self.initial_layer_priority = bool(initial_layer_priority)
        self.learn_online = bool(learn_online)
        if eamc_path and not Path(eamc_path).is_file():
            raise ConfigError("policy.eamc_path", eamc_path, "file not found")
        self.eamc_path = eamc_path

    def waits_for_prefetches(self) -> bool:
        """``synchronous``: a layer waits for the prefetches its gate issued to land."""
        return self.synchronous

    # -- run lifecycle ------------------------------------------------------------------
    def reset(self, ctx: PolicyContext) -> None:
        """Empty (or reload) the collections; forget requests and protections."""
        super().reset(ctx)
        L, E = ctx.model.num_layers, ctx.model.num_experts
        self._L, self._E, self._N = L, E, ctx.num_gpus
        self._slots = ctx.capacity_experts
        if self.eamc_path:
            try:
                self.eamcs = load_eamcs(self.eamc_path, PHASES, L, E, self.eamc_capacity)
            except ValueError as exc:  # one line, without the path the key's value gives
                said = str(exc).removeprefix(f"{Path(self.eamc_path)}: ")
                raise ConfigError("policy.eamc_path", self.eamc_path, said) from None
        else:
            self.eamcs = {p: EAMC(self.eamc_capacity, L, E) for p in PHASES}
        self._req: dict[int, dict[str, np.ndarray]] = {}  # request -> phase -> (L, E) counts
        self._layer_w = 2.0 - np.arange(L) / L if self.initial_layer_priority else np.ones(L)
        self._cprio: list[float] = [0.0] * (L * E)  # cache priority per key
        # the protected keys (max cache priority), with their prefetch priorities v in
        # _prot_val (perf: a re-ranking updates hundreds of values by one array store)
        self._protected: set[int] = set()
        self._prot_mask = np.zeros(L * E, dtype=bool)  # (L E,) the keys of _protected
        self._prot_val = np.zeros(L * E)  # (L E,) v of the protected keys (else stale)
        self._in: set[int] = set()  # keys admitted and not evicted (the policy's mirror)
        self._in_mask = np.zeros(L * E, dtype=bool)  # (L E,) the same, as a mask
        self._used = [0] * ctx.num_gpus  # len(_in) per GPU
        # perf: victim() takes the least (cache priority, admission number) off a heap per
        # GPU instead of scanning every cached key; entries go stale (the key left, was
        # re-admitted, got protected) and are dropped when they surface
        self._admitted = [0] * (L * E)  # key -> admission number
        self._n_admitted = 0
        self._heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(ctx.num_gpus)]
        self._batch: BatchInfo | None = None
        self._iter = np.zeros((0, L, E), dtype=np.int64)  # (B, L, E) this iteration
        self._query: EAMCQuery | None = None
        # match_on="request": the batch's request-level EAM and norms, set per iteration
        self._req_eam = np.zeros((L, E))  # (L, E)
        self._req_norm = np.zeros(L)  # (L,)
        self._stored = np.zeros((L, 0, E))  # (L, C, E) the collection's EAMs
        self._stored_norm = np.zeros((L, 0))  # (L, C)
        self._uniform = np.full((L, E), 1.0 / E)
        self._no_match = np.zeros((L, E))
        self._norm_memo: dict[tuple[int, ...], np.ndarray] = {}  # slots -> (L, E)
        prox = 1.0 - (np.arange(L)[None, :] - np.arange(L)[:, None]) / L  # (l, i)
        self._prox = prox if self.layer_proximity else np.ones((L, L))

    def learn(self, requests: Sequence[RequestTrace]) -> None:
        """Offline mode: add each held-in request's prefill and decode EAMs."""
        for r in requests:
            counts = np.asarray(r.counts, dtype=np.int64)
            self.eamcs["prefill"].add(counts[0])
            if len(counts) > 1:
                self.eamcs["decode"].add(counts[1:].sum(axis=0))

    def save(self, path: str | os.PathLike[str]) -> None:
        """Checkpoint both collections to ``path`` (``.npz``, §5.3 failure recovery)."""
        save_eamcs(path, self.eamcs)

    def on_request_start(self, request: RequestInfo) -> None:
        """Open the request's prefill and decode EAMs."""
        z = np.zeros((self._L, self._E), dtype=np.int64)
        self._req[request.request_id] = {"prefill": z, "decode": z.copy()}

    def on_iteration_start(self, batch: BatchInfo) -> None:
        """Cache priorities from the batch's request-level EAMs; start matching."""
        self._batch = batch
        L, E = self._L, self._E
        self._iter = np.zeros((len(batch.request_ids), L, E), dtype=np.int64)
        acc = np.zeros((L, E), dtype=np.float64)
        for rid in batch.request_ids:
            eams = self._req[rid]
            acc += eams["decode"] if eams["decode"].any() else eams["prefill"]
        # row-normalised: the request's empirical activation probability, the same scale
        # as a prefetch's predicted probability (every row of a decoder-only model's EAM
        # sums to the same number of routed tokens, so this keeps the order of the counts)
        tot = acc.sum(axis=1, keepdims=True)
        freq = np.divide(acc, tot, out=np.zeros_like(acc), where=tot > 0)
        self._cprio = (freq * self._layer_w[:, None]).reshape(-1).tolist()
        self._rebuild_heaps()
        phase = "prefill" if batch.prefill else "decode"
        self._query = self.eamcs[phase].query() if self.request_level_tracing else None
        self._norm_memo = {}
        if self.match_on == "request" and self.request_level_tracing:
            self._start_request_match(self.eamcs[phase], batch)

    def on_iteration_end(self, batch: BatchInfo) -> None:
        """Add the iteration's per-request EAMs to the request-level EAMs."""
        phase = "prefill" if batch.prefill else "decode"
        for b, rid in enumerate(batch.request_ids):
            self._req[rid][phase] += self._iter[b]

    def on_request_end(self, request_id: int) -> None:
        """File the finished request's EAMs in the collections (``learn_online``)."""
        eams = self._req.pop(request_id)
        if self.learn_online:
            for phase in PHASES:
                self.eamcs[phase].add(eams[phase])

    def _start_request_match(self, eamc: EAMC, batch: BatchInfo) -> None:
        """``match_on="request"``: the batch's request-level EAM ``(L, E)`` (earlier
        iterations, both phases) with each row's norm, and the stored EAMs' row norms."""
        req = np.zeros((self._L, self._E))
        for rid in batch.request_ids:
            eams = self._req[rid]
            req += eams["prefill"] + eams["decode"]
        self._req_eam = req
        self._req_norm = np.sqrt((req**2).sum(axis=1))  # (L,)
        stored = eamc._eams[:, : eamc.size].astype(np.float64)  # (L, C, E)
        self._stored = stored
        self._stored_norm = np.sqrt((stored**2).sum(axis=2))  # (L, C)

    def _request_match(self, layer: int) -> list[int] | None:
        """Slots of the best ``num_matched`` stored EAMs by the sum of per-layer cosines
        with the request-level EAM over the layers after ``layer``, best first, ties to
        the lower slot; None where the request's EAM has no counts there."""
        rows = slice(layer + 1, self._L)
        qn = self._req_norm[rows]  # (F,)
        if not qn.any():
            return None
        stored, sn = self._stored[rows], self._stored_norm[rows]  # (F, C, E), (F, C)
        dots = np.einsum("fce,fe->fc", stored, self._req_eam[rows])  # (F, C)
        den = sn * qn[:, None]
        score = np.divide(dots, den, out=np.zeros_like(dots), where=den > 0).sum(axis=0)
        order = np.argsort(-score, kind="stable")[: self.num_matched]  # (k,)
        return [int(i) for i in order if score[i] > 0]

    # -- prefetch ---------------------------------------------------------------------
    def predict(self, layer: int) -> np.ndarray:
        """Activation probabilities ``(L, E)`` for the layers after ``layer`` (Fig. 7
        steps 1-2; zero rows where nothing matched)."""
        if not self.request_level_tracing:
            return self._uniform
        out = self._predicted(layer).copy()  # (L, E)
        out[: layer + 1] = 0.0
        return out

    def _predicted(self, layer: int) -> np.ndarray:
        """:meth:`predict`'s rows after ``layer``, in an ``(L, E)`` array whose other rows
        hold anything (perf: shared, not copied; read only)."""
        if not self.request_level_tracing:
            return self._uniform
        q = self._query
        assert q is not None
        slots = self._request_match(layer) if self.match_on == "request" else None
        if slots is None:
            slots = q.top(self.num_matched)
        if not slots:
            return self._no_match
        return self._normalised(slots)

    def _normalised(self, slots: list[int]) -> np.ndarray:
        """Every row of the sum of the stored EAMs at ``slots``, normalised into
        activation probabilities (a zero row stays zero), ``(L, E)``: the rows after a
        layer are :func:`activation_priorities`' of that layer (without proximity).

        perf: kept per tuple of slots for the iteration's query, while the collection
        does not change (:class:`EAMCQuery`); the best match stays the same at most gates
        of an iteration, so a gate whose match is unchanged divides nothing."""
        memo = self._norm_memo
        key = tuple(slots)
        out = memo.get(key)
        if out is None:
            q = self._query
            assert q is not None
            matched = q.eamc._eams[:, slots].transpose(1, 0, 2)  # (k, L, E)
            out = activation_priorities(matched, -1, proximity=False)
            memo[key] = out
        return out

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Trace the gate, reset priorities (cases ii, iii), re-rank the prefetches.

        perf: the protections are a set (per-key checks) with a mask and an array of
        their priorities beside it, so the passes over every protected key (cases ii and
        iii, the re-ranking) are array operations; cancellations come in ascending key
        order."""
        L, E = self._L, self._E
        counts = gate.counts
        rc = gate.request_counts
        if rc is not None:
            self._iter[:, layer] = rc
        if self._query is not None:
            self._query.observe(layer, counts)
        base = layer * E
        hit = counts.nonzero()[0] + base  # (r,) keys the gate routes to
        routed = set(hit.tolist())
        pmask = self._prot_mask
        # case (ii) and passed layers: predictions for this layer the gate did not route
        # to, and anything left from earlier layers, go back to their cache priority
        past = pmask[: base + E].copy()  # (base + E,)
        past[hit] = False
        cancel = self._unprotect(past.nonzero()[0])
        if layer + 1 >= L:
            return Actions(cancel=cancel) if cancel else NO_ACTIONS
        probs = self._predicted(layer)  # (L, E), rows after this layer
        last = L if self.multi_layer else layer + 2
        v = probs[layer + 1 : last] * self._prox[layer, layer + 1 : last, None]  # (F, E)
        flat = v.reshape(-1)
        first = (layer + 1) * E
        keys, vals = self._top_k(flat, first, routed)  # (K,) each, highest first
        # case (iii): prefetched experts no longer in the top-K
        left = pmask.copy()  # (L E,)
        left[keys] = False
        cancel += self._unprotect(left.nonzero()[0])
        # in priority order: predictions in flight (or landed) are re-ranked if still
        # queued, the rest not in the buffer are loaded; the rest already in the buffer
        # skip the load and keep their slot (protected from here on)
        was_k, in_k = pmask[keys], self._in_mask[keys]  # (K,) each, before this update
        load = was_k | ~in_k
        keep = was_k | in_k
        kept = keys[keep]
        self._protected.update(keys[keep & ~was_k].tolist())
        self._prot_val[kept] = vals[keep]
        pmask[kept] = True
        prefetch = self._admit(keys[load], vals[load], routed)
        if not prefetch and not cancel:
            return NO_ACTIONS
        return Actions(prefetch=prefetch, cancel=cancel)

    def _unprotect(self, keys: np.ndarray) -> list[int]:
        """Drop the protection of ``keys`` ``(n,)``: they compete on their cache priority
        again; returned as a list (to cancel)."""
        out = keys.tolist()
        if out:
            # perf: _unprotected inlined (tens of keys a gate)
            protected, inbuf, heaps = self._protected, self._in, self._heaps
            cprio, adm, E, N = self._cprio, self._admitted, self._E, self._N
            push = heapq.heappush
            for key in out:
                protected.remove(key)
                if key in inbuf:
                    push(heaps[(key % E) % N], (cprio[key], adm[key], key))
            self._prot_mask[keys] = False
        return out

    def _top_k(
        self, flat: np.ndarray, first: int, routed: set[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        """The top-K predictions, keys ``(K,)`` int64 and priorities ``(K,)``, highest
        first (nearer layer, then smaller id on ties), of ``flat`` ``(F E,)`` (keys from
        ``first``): per GPU, K = its slots minus what the current layer holds there; zero
        priorities never.

        perf: on one GPU, the first ``K`` positive entries of the stable descending
        order, found by a partition and a sort of those alone (:meth:`_top_k_scan` is
        the reference and the path for several GPUs)."""
        if self._N > 1:
            chosen = self._top_k_scan(flat, first, routed)
            return (
                np.fromiter(chosen, dtype=np.int64, count=len(chosen)),
                np.fromiter(chosen.values(), dtype=np.float64, count=len(chosen)),
            )
        take = min(self._slots - len(routed), int(np.count_nonzero(flat > 0)))
        if take <= 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0)
        neg = -flat
        if take < len(flat):
            kth = np.partition(neg, take - 1)[take - 1]
            cand = (neg <= kth).nonzero()[0]  # ascending ids; ties at the k-th included
        else:
            cand = np.arange(len(flat))
        idx = cand[np.argsort(neg[cand], kind="stable")[:take]]
        return idx + first, flat[idx]

    def _top_k_scan(self, flat: np.ndarray, first: int, routed: set[int]) -> dict[int, float]:
        """:meth:`_top_k` by a scan of the whole stable descending order."""
        E, N = self._E, self._N
        order = np.argsort(-flat, kind="stable")  # nearer layer, then smaller id on ties
        room = [self._slots] * N
        for k in routed:
            room[(k % E) % N] -= 1
        chosen: dict[int, float] = {}
        vals = flat.tolist()
        left = sum(max(r, 0) for r in room)
        for i in order.tolist():
            p = vals[i]
            if p <= 0 or left <= 0:
                break
            key = first + i
            g = (key % E) % N
            if room[g] > 0:
                room[g] -= 1
                left -= 1
                chosen[key] = p
        return chosen

    def _admit(self, keys: np.ndarray, vals: np.ndarray, routed: set[int]) -> PrefetchBatch:
        """Prefetches for the predictions ``keys`` ``(n,)`` with priorities ``vals``
        ``(n,)``, in priority order: keys already in the buffer (in flight or landed)
        are only re-ranked; a load takes a free slot, or the slot of the cached expert
        with the lowest cache priority if that is below the prediction's priority (§5.1:
        "start their prefetching into the slots that exhibit lower priorities").

        perf: the re-ranked keys pass as a mask; only the loads are looked at one by
        one, and the result goes to the runner as two arrays (:class:`PrefetchBatch`)."""
        E, N, protected, cprio = self._E, self._N, self._protected, self._cprio
        inbuf, adm, heaps = self._in, self._admitted, self._heaps
        take = self._in_mask[keys]  # (n,) re-ranked, then also the loads admitted
        cand = (~take).nonzero()[0]  # (m,) positions of the loads, in priority order
        if len(cand):
            free = [self._slots - u for u in self._used]
            for k in routed:  # this layer's misses are loaded (on demand) before prefetches
                if k not in inbuf:
                    free[(k % E) % N] -= 1
            # perf: the cached experts a load may displace (in the buffer, unprotected, not
            # routed now) come off the victim heaps in cache-priority order, not from a heap
            # of every cached key built here; the valid entries taken off go back at the end
            aside: list[tuple[float, int, int]] = []
            seen: set[int] = set()  # keys of the entries in aside (a key may have two)
            done = [False] * N
            n_done = 0
            pmask = self._prot_mask
            cand_l = cand.tolist()
            for i, key, p in zip(cand_l, keys[cand].tolist(), vals[cand].tolist(), strict=True):
                g = (key % E) % N
                if done[g]:
                    continue
                if free[g] > 0:
                    free[g] -= 1
                else:
                    h = heaps[g]
                    lowest = INF
                    while h:
                        c, n, k = h[0]
                        if (
                            k in seen
                            or k not in inbuf
                            or k in protected
                            or adm[k] != n
                            or cprio[k] != c
                        ):
                            heapq.heappop(h)  # stale, or a second entry of a key taken off
                        elif k in routed:
                            aside.append(heapq.heappop(h))
                            seen.add(k)
                        else:
                            lowest = c
                            break
                    if lowest >= p:  # nothing cached below it (INF: nothing to displace)
                        done[g] = True  # every later prediction is less important still
                        n_done += 1
                        if n_done == N:
                            break
                        continue
                    aside.append(heapq.heappop(h))
                    seen.add(aside[-1][2])
                protected.add(key)
                pmask[key] = True
                take[i] = True
            for item in aside:
                heapq.heappush(heaps[(item[2] % E) % N], item)
        self._prot_val[keys[take]] = vals[take]
        return PrefetchBatch(keys[take], 1.0 - vals[take])

    # -- cache ------------------------------------------------------------------------
    def on_access(self, key: int, outcome: Outcome) -> None:
        """Case (i): a used expert's priority goes back to its request-level count."""
        if key in self._protected:
            self._protected.remove(key)
            self._prot_mask[key] = False
            self._unprotected(key)

    def on_insert(self, key: int) -> None:
        """Track what the buffer holds."""
        self._in.add(key)
        self._in_mask[key] = True
        self._used[(key % self._E) % self._N] += 1
        self._n_admitted += 1
        self._admitted[key] = self._n_admitted
        if key not in self._protected:
            self._unprotected(key)

    def _unprotected(self, key: int) -> None:
        """``key`` competes on its cache priority again: a fresh heap entry."""
        if key in self._in:
            heapq.heappush(
                self._heaps[(key % self._E) % self._N],
                (self._cprio[key], self._admitted[key], key),
            )

    def _rebuild_heaps(self) -> None:
        """Every cached, unprotected key at its (new) cache priority."""
        heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(self._N)]
        cprio, adm, protected, E, N = self._cprio, self._admitted, self._protected, self._E, self._N
        for k in self._in:
            if k not in protected:
                heaps[(k % E) % N].append((cprio[k], adm[k], k))
        for h in heaps:
            heapq.heapify(h)
        self._heaps = heaps

    def on_evict(self, key: int) -> None:
        """Forget an evicted or cancelled expert."""
        self._in.remove(key)
        self._in_mask[key] = False
        self._used[(key % self._E) % self._N] -= 1
        if key in self._protected:
            self._protected.remove(key)
            self._prot_mask[key] = False

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The unprotected candidate with the lowest cache priority (ties: oldest); if
        all are protected, the least important prediction.

        perf: the least valid entry of the incoming key's GPU heap that is a candidate
        (cached keys in flight or in use are set aside and put back); the scan below is
        the reference, and the fallback where no unprotected candidate is found."""
        if incoming >= 0:
            heap = self._heaps[(incoming % self._E) % self._N]
            inbuf, protected, cprio, adm = self._in, self._protected, self._cprio, self._admitted
            aside: list[tuple[float, int, int]] = []
            found = -1
            while heap:
                p, n, k = heap[0]
                if k not in inbuf or k in protected or adm[k] != n or cprio[k] != p:
                    heapq.heappop(heap)  # stale
                elif k in candidates:
                    found = k
                    break
                else:
                    aside.append(heapq.heappop(heap))
            for item in aside:
                heapq.heappush(heap, item)
            if found >= 0:
                return found
        return self._victim_scan(candidates)

    def _victim_scan(self, candidates: Collection[int]) -> int:
        """:meth:`victim` by a scan of every candidate (the reference)."""
        protected, cprio, pval = self._protected, self._cprio, self._prot_val
        best, best_p = -1, INF
        spare, spare_p = -1, INF
        for key in candidates:  # admission order: strict < keeps the oldest on ties
            if key not in protected:
                p = cprio[key]
                if p < best_p:
                    best, best_p = key, p
            else:
                v = float(pval[key])
                if v < spare_p:
                    spare, spare_p = key, v
        if best >= 0:
            return best
        if spare >= 0:
            return spare
        raise ValueError("MoEInfinity.victim called with no candidates")
