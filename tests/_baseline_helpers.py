"""Helpers of the offloading-baseline tests: small models and hand-built traces whose
iterations may carry several tokens, top-k > 1 and speculative probabilities.

A token's route is one tuple of ``top_k`` experts per layer; an iteration is a list of
token routes (several tokens = a prefill) plus, optionally, its ``spec_probs`` ``(L, E)``
(NaN rows = no prediction for that layer, as the trace format allows for layer 0).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoesim.engine.simulate import RunResult
from fmoesim.specs import ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter
from fmoesim.trace.reader import Trace
from policies.base import Outcome, Policy, PolicyContext
from tests.tiny import TINY, TINY_HW, small_model  # noqa: F401 - re-exported

#: token_route[layer] = the top_k experts the token is routed to in that layer
TokenRoute = Sequence[Sequence[int]]


def context(model: ModelSpec, capacity_experts: int, num_gpus: int = 1) -> PolicyContext:
    """A policy context with room for ``capacity_experts`` experts per GPU."""
    return PolicyContext(
        model=model,
        budget_bytes=capacity_experts * model.expert_size_bytes,
        expert_size_bytes=model.expert_size_bytes,
        rng=np.random.default_rng(0),
        num_gpus=num_gpus,
    )


def counts_of(model: ModelSpec, tokens: Sequence[TokenRoute]) -> np.ndarray:
    """The ``(L, E)`` expert counts of an iteration whose tokens route as ``tokens``."""
    c = np.zeros((model.num_layers, model.num_experts), np.int32)
    for route in tokens:
        if len(route) != model.num_layers:
            raise ValueError(f"a token route has {len(route)} layers, model has {model.num_layers}")
        for layer, experts in enumerate(route):
            if len(set(experts)) != model.top_k:
                raise ValueError(f"layer {layer}: need {model.top_k} distinct experts, {experts}")
            c[layer, list(experts)] += 1
    return c


def one_hot_spec(model: ModelSpec, tokens: Sequence[TokenRoute], first: bool) -> np.ndarray:
    """Perfect speculative probabilities: each layer's gate mass spread over the experts
    the tokens route to (NaN for layer 0 of the first iteration, as in a prefill)."""
    c = counts_of(model, tokens).astype(np.float64)
    spec = c / c.sum(axis=1, keepdims=True)
    if first:
        spec[0] = np.nan
    return spec


@dataclass
class Iteration:
    """One iteration of one request: its tokens' routes and optional spec_probs (L, E)."""

    tokens: Sequence[TokenRoute]
    spec_probs: np.ndarray | None = None


def write_trace(
    path: Path, model: ModelSpec, requests: Sequence[Sequence[Iteration]], with_spec: bool
) -> Path:
    """One request per entry of ``requests``; iteration 0 of each is its prefill."""
    L, E = model.num_layers, model.num_experts
    man = TraceManifest(
        model=TraceModel(
            name=model.name, num_layers=L, num_experts=E, top_k=model.top_k, hidden_size=16
        ),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/_baseline_helpers.py"},
        has_probs=True,
        has_spec_probs=with_spec,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        for rid, iters in enumerate(requests):
            w.add_request(rid, len(iters[0].tokens), len(iters))
            for i, it in enumerate(iters):
                if i > 0 and len(it.tokens) != 1:
                    raise ValueError("a decode iteration carries exactly one token")
                counts = counts_of(model, it.tokens)
                probs = counts / counts.sum(axis=1, keepdims=True)
                spec = it.spec_probs if with_spec else None
                if with_spec and spec is None:
                    spec = np.full((L, E), np.nan)
                w.add_iteration(rid, i, len(it.tokens), None, counts, probs, spec)
    return path


def outcomes(result: RunResult, model: ModelSpec) -> list[tuple[int, int, str]]:
    """The access log as ``(iteration, key, 'H' | 'L' | 'M')`` in access order."""
    log = result.accesses
    assert log is not None, "run with access_log=True"
    letter = {Outcome.HIT: "H", Outcome.LATE: "L", Outcome.MISS: "M"}
    return [
        (int(i), int(layer) * model.num_experts + int(e), letter[Outcome(int(o))])
        for i, layer, e, o in zip(
            log["iteration"], log["layer"], log["expert"], log["outcome"], strict=True
        )
    ]


def recording(cls: type[Policy]) -> type[Policy]:
    """A subclass of ``cls`` that records its evictions (``.evicted``) in order."""

    class Recording(cls):  # type: ignore[valid-type, misc]
        def reset(self, ctx: PolicyContext) -> None:
            super().reset(ctx)
            self.evicted: list[int] = []

        def on_evict(self, key: int) -> None:
            self.evicted.append(key)
            super().on_evict(key)

    Recording.__name__ = f"Recording{cls.__name__}"
    return Recording


# -- MoE-Infinity's figures (003): 2 experts per layer, top-1 ------------------------------
M42 = small_model(4, 2, 1)  # Fig. 6 / Fig. 7: 4 MoE layers x 2 experts
M32 = small_model(3, 2, 1)  # Fig. 5 / Fig. 8: 3 MoE layers x 2 experts
SLOW = dataclasses.replace(TINY_HW, pcie_gbps=0.1)  # a 6 MB expert takes 60 ms; compute: µs


def e(layer: int, expert: int) -> int:
    """Key of the paper's 1-based E[layer, expert] in a 2-expert model."""
    return (layer - 1) * 2 + (expert - 1)


def write_fig8_trace(path: Path) -> Path:
    """Fig. 8's request on :data:`M32`: a 3-token prefill with request-level EAM
    [[1,2],[0,3],[0,3]] (E[1,1]->E[2,2]->E[3,2] once, E[1,2]->E[2,2]->E[3,2] twice),
    then one decode token E[1,1]->E[2,2]->E[3,2]."""
    a = [(0,), (1,), (1,)]
    b = [(1,), (1,), (1,)]
    return write_trace(path, M32, [[Iteration([a, b, b]), Iteration([a])]], with_spec=False)


def write_one_token_trace(
    path: Path,
    model: ModelSpec,
    num_requests: int,
    output_tokens: int,
    embedding_dim: int,
    seed: int,
) -> Trace:
    """A synthetic trace whose every iteration is one token (one-token prompts), with
    outputs of about ``output_tokens`` (median; at most twice that)."""
    from fmoesim.workload.calibrate import synthetic_like

    return synthetic_like(model, {}, path, num_requests, output_tokens, seed, embedding_dim)
