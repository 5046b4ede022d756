"""Helpers of the engine timing and serving tests: hand-routed traces and closed forms.

Every trace written here routes *all* tokens of an iteration of a request to the same
``top_k`` experts per layer, so an iteration of ``n`` tokens puts ``n`` tokens on each
of its experts and the expected compute times are plain sums of the ComputeModel's
``a + b * tokens`` terms.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoesim.engine.compute import ComputeModel
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter, read_trace
from fmoesim.trace.reader import Trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.base import NO_ACTIONS, Actions, BatchInfo, GateView, PolicyContext, Prefetch
from policies.lru import LRU

#: The columns of ``RunResult.transfer_table()`` (one per TransferRecord field).
TRANSFER_COLUMNS = {
    "key", "gpu", "size_bytes", "reason", "priority", "submit_s", "release_s", "start_s", "end_s",
    "used", "escalated", "preemptions", "cancelled", "aborted", "moved_bytes",
}  # fmt: skip

#: A small MoE shape (4 layers x 8 experts, top-2) for runs of every policy preset on
#: :func:`small_synthetic_trace` (the contract and closed-form suites).
SMALL_MOE = ModelSpec(
    name="contract",
    num_layers=4,
    num_experts=8,
    top_k=2,
    hidden_size=512,
    expert_intermediate_size=1024,
    num_attention_heads=8,
    num_kv_heads=8,
    head_dim=64,
    vocab_size=1000,
)

#: routes[i][l] = the experts (``top_k`` of them) iteration ``i`` routes to in layer ``l``.
Routes = Sequence[Sequence[Sequence[int]]]


@dataclass
class Req:
    """One request of a hand-made trace: ``len(routes)`` output tokens."""

    request_id: int
    prompt_tokens: int
    routes: Routes
    arrival_s: float | None = None


def write_trace(path: Path, model: ModelSpec, reqs: Sequence[Req]) -> Trace:
    """Write ``reqs`` as a trace of ``model``'s shape and read it back."""
    L, E = model.num_layers, model.num_experts
    man = TraceManifest(
        model=TraceModel(model.name, L, E, model.top_k, model.hidden_size),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/_engine_helpers.py"},
        has_probs=False,
        has_spec_probs=False,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        for r in reqs:
            w.add_request(r.request_id, r.prompt_tokens, len(r.routes), arrival_s=r.arrival_s)
        for r in sorted(reqs, key=lambda r: r.request_id):
            for i, route in enumerate(r.routes):
                n = r.prompt_tokens if i == 0 else 1
                counts = np.zeros((L, E), np.int32)
                for layer, experts in enumerate(route):
                    assert len(set(experts)) == model.top_k, (layer, experts)
                    counts[layer, list(experts)] = n
                w.add_iteration(r.request_id, i, n, None, counts)
    return read_trace(path)


def transfer_s(hw: HardwareSpec, model: ModelSpec) -> float:
    """One expert over an idle link: fixed cost + size / bandwidth."""
    return hw.transfer_overhead_s + model.expert_size_bytes / (hw.pcie_gbps * 1e9)


def pre_gate_s(c: ComputeModel, batch: Sequence[tuple[int, int]]) -> float:
    """Attention + router of one MoE layer for a batch of ``(prompt_tokens, iteration)``.

    Prefill (iteration 0) of a prompt of ``p`` tokens: ``p`` new tokens, no KV cache,
    ``p (p + 1) / 2`` causal (query, key) pairs.  Decode iteration ``j``: one new token
    reading the ``p + j - 1`` cached tokens and attending over ``p + j`` keys.
    """
    tokens = kv = pairs = 0
    for p, j in batch:
        if j == 0:
            tokens += p
            pairs += p * (p + 1) // 2
        else:
            tokens += 1
            kv += p + j - 1
            pairs += p + j
    return c.attention_s(tokens, kv, pairs) + c.router_s(tokens)


class Recording(LRU):
    """LRU that records what the Runner shows it (batches and gate token counts)."""

    name = "recording-lru"

    def reset(self, ctx: PolicyContext) -> None:
        """Forget recorded events too."""
        super().reset(ctx)
        self.batches: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = []
        self.gates: list[tuple[int, int, np.ndarray]] = []  # (iteration, layer, counts)

    def on_iteration_start(self, batch: BatchInfo) -> None:
        """Record the batch composition."""
        self.batches.append((batch.request_ids, batch.request_iterations, batch.prefill))
        self._it = batch.iteration

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Record the gate's token counts; no prefetch."""
        self.gates.append((self._it, layer, np.array(gate.counts)))
        return NO_ACTIONS


class ScheduledPrefetch(LRU):
    """LRU plus prefetches from a fixed schedule: global layer step -> expert keys.

    A scheduled entry is a key (priority 1.0) or a ``(key, priority)`` pair.
    """

    name = "scheduled-prefetch"

    def __init__(self, schedule: dict[int, Sequence[int | tuple[int, float]]]) -> None:
        super().__init__()
        self.schedule = schedule

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Prefetch the keys scheduled for this step."""
        keys = self.schedule.get(gate.step, ())
        if not keys:
            return NO_ACTIONS
        return Actions(
            prefetch=[Prefetch(*k) if isinstance(k, tuple) else Prefetch(k) for k in keys]
        )


def small_synthetic_trace(path: Path, model: ModelSpec, seed: int) -> Trace:
    """Six requests of the synthetic workload (gate and speculative probabilities, so
    prefetching policies act; prompts of ~12 tokens, ~10 outputs; 20 requests/s)."""
    cfg = SyntheticConfig(
        num_requests=6,
        embedding_dim=8,
        prompt_tokens_median=12,
        prompt_tokens_max=40,
        output_tokens_median=10,
        output_tokens_max=24,
        arrival_rate_rps=20.0,
        seed=seed,
    )
    generate(model, cfg, path, overwrite=True)
    return read_trace(path)


def random_trace(
    path: Path, model: ModelSpec, lengths: Sequence[int], seed: int, prompt: int = 1
) -> Trace:
    """Requests of ``lengths`` iterations (a prefill of ``prompt`` tokens, then one token
    each), every token routed to ``top_k`` experts drawn uniformly per layer."""
    rng = np.random.default_rng(seed)
    L, E, k = model.num_layers, model.num_experts, model.top_k
    man = TraceManifest(
        model=TraceModel(model.name, L, E, k, model.hidden_size),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/_engine_helpers.py"},
        has_probs=False,
        has_spec_probs=False,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        for rid, n in enumerate(lengths):
            w.add_request(rid, prompt, n)
            for i in range(n):
                tokens = prompt if i == 0 else 1
                counts = np.zeros((L, E), np.int32)
                for _ in range(tokens):
                    for layer in range(L):
                        counts[layer, rng.choice(E, size=k, replace=False)] += 1
                w.add_iteration(rid, i, tokens, None, counts, None, None)
    return read_trace(path)
