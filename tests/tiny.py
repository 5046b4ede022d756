"""Hand-made tiny traces shared by the engine and CLI tests."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np

from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter

#: A model of 2 MoE layers x 4 experts, top-1, whose expert is 3 x 1000 x 1000 x 2 = 6 MB.
TINY = ModelSpec(
    name="tiny",
    num_layers=2,
    num_experts=4,
    top_k=1,
    hidden_size=1000,
    expert_intermediate_size=1000,
    num_attention_heads=8,
    num_kv_heads=8,
    head_dim=125,
    vocab_size=1000,
)
TINY_HW = HardwareSpec(name="tiny-hw", pcie_gbps=10.0, transfer_overhead_s=1e-4)


def small_model(num_layers: int, num_experts: int, top_k: int) -> ModelSpec:
    """TINY's sizes (a 6 MB expert) with another routing shape."""
    return replace(
        TINY,
        name=f"tiny-{num_layers}x{num_experts}-top{top_k}",
        num_layers=num_layers,
        num_experts=num_experts,
        top_k=top_k,
    )


def write_sequence_trace(
    path: Path, routes: list[list[int]], model: ModelSpec = TINY, prompt_tokens: int = 1
) -> Path:
    """One request whose iteration ``i`` routes its single token to ``routes[i][layer]``.

    Iteration 0 is a prefill of ``prompt_tokens`` tokens all routed like ``routes[0]``.
    """
    L, E = model.num_layers, model.num_experts
    man = TraceManifest(
        model=TraceModel(
            name=model.name,
            num_layers=L,
            num_experts=E,
            top_k=model.top_k,
            hidden_size=model.hidden_size,
        ),
        embedding_dim=2,
        source={"kind": "synthetic", "generator": "tests/tiny.py"},
        has_probs=True,
        has_spec_probs=False,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        w.add_request(0, prompt_tokens, len(routes))
        for i, route in enumerate(routes):
            n = prompt_tokens if i == 0 else 1
            counts = np.zeros((L, E), np.int32)
            counts[np.arange(L), route] = n
            probs = np.full((L, E), 0.0)
            probs[np.arange(L), route] = 1.0
            w.add_iteration(0, i, n, np.array([1.0, 0.0]), counts, probs, None)
    return path
