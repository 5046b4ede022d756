"""The Runner: the serving loop, written once for both backends.

It is a generator that yields backend commands (:mod:`fmoesim.engine.commands`) and
receives their answers.  It owns batching, prefill and decode iterations, the layer
loop, revealing each gate from the trace, asking the policy, classifying accesses,
admitting experts into the cache, and the metrics.  A backend only executes.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import numpy as np

from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.commands import ON_DEMAND, Compute, Now, Op, Transfer, WaitAny
from fmoesim.engine.metrics import Metrics
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.reader import Trace
from policies.base import BatchInfo, GateView, Outcome, Policy, RequestInfo

Command = Compute | Transfer | WaitAny | Now


@dataclass
class ServingConfig:
    """How requests are served.

    ``batch_size`` requests are grouped in request order into static batches; a batch
    runs its prefill, then decode iterations until its longest request finishes (a
    finished request leaves the batch).  Batches run back to back from time 0 (the
    trace's arrival times are used by the online mode of the engine issue).
    """

    batch_size: int = 1
    max_requests: int | None = None


class Runner:
    """Serve ``trace`` with ``policy`` on a cache; see the module docstring."""

    def __init__(
        self,
        trace: Trace,
        model: ModelSpec,
        policy: Policy,
        cache: ExpertCache,
        metrics: Metrics,
        serving: ServingConfig,
        on_iteration: Callable[[], None] | None = None,
    ) -> None:
        self.trace, self.model, self.policy, self.cache = trace, model, policy, cache
        self.metrics, self.serving = metrics, serving
        self.expert_bytes = model.expert_size_bytes
        self.E = trace.num_experts
        self.on_iteration = on_iteration

    def batches(self) -> list[list[int]]:
        """Request positions grouped into static batches."""
        n = self.trace.num_requests
        if self.serving.max_requests is not None:
            n = min(n, self.serving.max_requests)
        b = self.serving.batch_size
        return [list(range(i, min(i + b, n))) for i in range(0, n, b)]

    def run(self) -> Generator[Command, Any, None]:
        """The whole serving loop."""
        for batch in self.batches():
            yield from self._serve_batch(batch)

    # -- one batch ------------------------------------------------------------------
    def _serve_batch(self, batch: list[int]) -> Generator[Command, Any, None]:
        tr, m = self.trace, self.metrics
        start = yield Now()
        for r in batch:
            rid = int(tr.request_id[r])
            m.request_start_s[rid] = start
            m.request_output_tokens[rid] = int(tr.output_tokens[r])
            first = int(tr.iter_start[r])
            emb = tr.embedding[first] if tr.embedding.shape[1] else None
            self.policy.on_request_start(
                RequestInfo(rid, int(tr.prompt_tokens[r]), int(tr.output_tokens[r]), emb)
            )
        longest = max(int(tr.output_tokens[r]) for r in batch)
        for j in range(longest):
            active = [r for r in batch if tr.output_tokens[r] > j]
            rows = np.array([tr.iter_start[r] + j for r in active], dtype=np.int64)  # (B,)
            yield from self._iteration(j, active, rows)
            now = yield Now()
            for r in active:
                rid = int(tr.request_id[r])
                if j == 0:
                    m.request_first_token_s[rid] = now
                if j == tr.output_tokens[r] - 1:
                    m.request_end_s[rid] = now

    def _iteration(
        self, j: int, active: list[int], rows: np.ndarray
    ) -> Generator[Command, Any, None]:
        tr, model = self.trace, self.model
        ntok = tr.num_tokens[rows]  # (B,)
        tokens = int(ntok.sum())
        prompt = tr.prompt_tokens[active].astype(np.int64)
        if j == 0:  # prefill: causal attention over the prompt
            kv_tokens, pairs = 0, int((prompt * (prompt + 1) // 2).sum())
        else:  # decode: one new token attends over prompt + j - 1 cached tokens and itself
            ctx = prompt + j
            kv_tokens, pairs = int((ctx - 1).sum()), int(ctx.sum())
        emb = tr.embedding[rows] if tr.embedding.shape[1] else None
        self.policy.on_iteration_start(
            BatchInfo(j, tuple(int(tr.request_id[r]) for r in active), tokens, emb)
        )
        for layer in range(model.dense_layers):
            yield Compute(Op.ATTENTION, -1 - layer, tokens, kv_tokens, pairs)
            yield Compute(Op.DENSE_MLP, -1 - layer, tokens)
        for layer in range(tr.num_layers):
            yield from self._layer(layer, rows, ntok, tokens, kv_tokens, pairs)
        yield Compute(Op.LM_HEAD, tokens=len(active))
        self.metrics.iterations += 1
        self.policy.on_iteration_end(j)
        if self.on_iteration is not None:
            self.on_iteration()

    # -- one layer ------------------------------------------------------------------
    def _gate(self, layer: int, rows: np.ndarray, ntok: np.ndarray, tokens: int) -> GateView:
        tr, pol = self.trace, self.policy
        if len(rows) == 1:
            counts = tr.counts[rows[0], layer]
        else:
            counts = tr.counts[rows, layer].sum(axis=0)
        probs = spec_next = None
        if pol.uses_probs and tr.probs is not None:
            probs = (ntok / tokens) @ tr.probs[rows, layer].astype(np.float32)
        if (
            pol.uses_spec
            and tr.spec_probs is not None
            and tr.spec_valid is not None
            and layer + 1 < tr.num_layers
        ):
            ok = tr.spec_valid[rows, layer + 1]
            if ok.any():
                ww = ntok[ok] / ntok[ok].sum()
                spec_next = ww @ tr.spec_probs[rows[ok], layer + 1].astype(np.float32)
        return GateView(layer, counts, tokens, probs, spec_next)

    def _admit(self, key: int, reason: str, priority: float) -> Generator[Command, Any, bool]:
        """Reserve room for ``key`` and start its transfer; False if no room."""
        if not self.cache.admit(key, self.expert_bytes, reason):
            return False
        self.metrics.transfer(self.expert_bytes, reason)
        yield Transfer(key, self.expert_bytes, priority, reason)
        return True

    def _layer(
        self,
        layer: int,
        rows: np.ndarray,
        ntok: np.ndarray,
        tokens: int,
        kv_tokens: int,
        pairs: int,
    ) -> Generator[Command, Any, None]:
        cache, policy, metrics, E = self.cache, self.policy, self.metrics, self.E
        yield Compute(Op.ATTENTION, layer, tokens, kv_tokens, pairs)
        yield Compute(Op.ROUTER, layer, tokens)
        yield Now()  # sync: the cache must reflect transfers finished by now
        gate = self._gate(layer, rows, ntok, tokens)
        actions = policy.on_gate(layer, gate)
        for p in actions.prefetch:
            if p.key not in cache.entries:
                yield from self._admit(p.key, "prefetch", p.priority)
        metrics.layer_steps += 1
        counts = gate.counts
        ready: list[int] = []
        pending: list[int] = []
        missing: list[int] = []
        base = layer * E
        for e in np.flatnonzero(counts).tolist():
            key = base + e
            outcome = cache.outcome(key)
            metrics.access(layer, outcome)
            policy.on_access(key, outcome)
            if outcome is Outcome.MISS:
                missing.append(key)
            else:
                cache.pin(key)
                (ready if outcome is Outcome.HIT else pending).append(key)
        deferred: list[int] = []
        for key in missing:  # on-demand loads jump the link's queue
            if (yield from self._admit(key, "on_demand", ON_DEMAND)):
                cache.pin(key)
                pending.append(key)
            else:
                deferred.append(key)
        if self.model.num_shared_experts:
            yield Compute(Op.SHARED, layer, tokens)
        for key in ready:  # experts already here compute while the others load
            yield Compute(Op.EXPERT, layer, int(counts[key - base]), key=key)
            cache.unpin(key)
        while pending or deferred:
            if deferred:  # room may have been freed by experts computed since
                still = []
                for key in deferred:
                    if (yield from self._admit(key, "on_demand", ON_DEMAND)):
                        cache.pin(key)
                        pending.append(key)
                    else:
                        still.append(key)
                deferred = still
            if not pending:
                raise RuntimeError(
                    f"layer {layer}: the expert budget cannot hold the experts this layer needs"
                )
            t0 = yield Now()
            key = yield WaitAny(tuple(pending))
            t1 = yield Now()
            metrics.stall_s += t1 - t0
            metrics.stall_per_layer_s[layer] += t1 - t0
            pending.remove(key)
            yield Compute(Op.EXPERT, layer, int(counts[key - base]), key=key)
            cache.unpin(key)
