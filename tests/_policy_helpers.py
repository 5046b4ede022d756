"""Helpers of the cache-policy tests: small models, hand-made and random routing traces.

Every trace written here holds one request whose iterations (the prefill included) each
carry exactly one token, so each layer step routes to exactly ``top_k`` distinct experts
and the engine's step order is simply iteration-major, layer-minor.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from fmoesim.specs import ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter
from policies.base import Outcome, Policy
from tests.tiny import TINY, small_model  # noqa: F401 - re-exported


def replay_order_ops(
    policy: Policy, ops: Sequence[tuple[str, int]], access_moves: bool
) -> list[int]:
    """Feed ``policy`` the hooks ``ops`` name (``"i"`` insert, ``"a"`` access, ``"e"``
    evict, each with a key) and return the reference order they imply, kept as a plain
    list, first to evict first: an insert goes to the back, an access moves a tracked
    key to the back when ``access_moves`` (LRU; FIFO keeps it), an evict drops it.  An
    insert of a key already tracked is skipped, as the protocol guarantees: the cache
    admits only keys it does not hold and reports every departure to ``on_evict``."""
    ref: list[int] = []
    for op, k in ops:
        if op == "i":
            if k in ref:
                continue
            policy.on_insert(k)
            ref.append(k)
        elif op == "a":
            policy.on_access(k, Outcome.HIT)
            if access_moves and k in ref:
                ref.remove(k)
                ref.append(k)
        else:
            policy.on_evict(k)
            if k in ref:
                ref.remove(k)
    return ref


#: routes[i][l] = the experts iteration ``i`` routes its token to in layer ``l``.
Routes = Sequence[Sequence[Sequence[int]]]


def _manifest(model: ModelSpec) -> TraceManifest:
    return TraceManifest(
        model=TraceModel.of(model),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/_policy_helpers.py"},
        has_probs=False,
        has_spec_probs=False,
    )


def write_routes_trace(path: Path, routes: Routes, model: ModelSpec) -> Path:
    """One request of ``len(routes)`` one-token iterations routed as ``routes`` says."""
    L, E, K = model.num_layers, model.num_experts, model.top_k
    with TraceWriter(path, _manifest(model), overwrite=True) as w:
        w.add_request(0, 1, len(routes))
        for i, per_layer in enumerate(routes):
            if len(per_layer) != L:
                raise ValueError(f"iteration {i} has {len(per_layer)} layers, model has {L}")
            counts = np.zeros((L, E), np.int32)
            for layer, experts in enumerate(per_layer):
                if len(set(experts)) != K:
                    raise ValueError(f"iteration {i} layer {layer}: need {K} distinct experts")
                counts[layer, list(experts)] = 1
            w.add_iteration(0, i, 1, None, counts)
    return path


def random_routes(
    rng: np.random.Generator, model: ModelSpec, num_iterations: int
) -> list[list[list[int]]]:
    """Uniform routing: each layer of each iteration picks ``top_k`` distinct experts."""
    L, E, K = model.num_layers, model.num_experts, model.top_k
    scores = rng.random((num_iterations, L, E))
    top = np.argsort(scores, axis=2)[:, :, :K]
    return [[sorted(top[i, layer].tolist()) for layer in range(L)] for i in range(num_iterations)]


def write_uniform_trace(path: Path, model: ModelSpec, num_iterations: int, seed: int) -> Path:
    """A uniform-routing one-request trace of ``num_iterations`` one-token iterations."""
    return write_routes_trace(
        path, random_routes(np.random.default_rng(seed), model, num_iterations), model
    )


def layer_steps(routes: Routes, num_experts: int) -> list[list[int]]:
    """The keys each layer step accesses, in the engine's order (ascending within a step)."""
    return [
        sorted(layer * num_experts + e for e in experts)
        for per_layer in routes
        for layer, experts in enumerate(per_layer)
    ]
