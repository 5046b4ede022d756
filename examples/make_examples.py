"""Write the small example inputs that the README's tour uses (already committed here).

- ``vllm-routes.jsonl``: a route log in the vLLM-style JSON-lines format that
  ``fmoesim-trace import vllm-routes`` reads (one line per request, layer and token:
  ``layer``, ``token_idx``, top-2 ``experts`` and their ``gating_probs``, ``dataset`` and
  ``problem_id``).  Its routing is the decode tokens of the first three requests of the
  bundled synthetic trace (``traces/default``, Mixtral-8x7B shape): it shows the format,
  it is not real routing.
- ``route-table.csv``: a route table as a llama.cpp-style logger writes it (``#``
  header lines, one row per routed expert: ``turn,phase,step,layer,slot,expert,weight``;
  ``phase`` 0 for the prompt, 1 for decode; ``step`` one forward pass of one token), which
  ``fmoesim-trace import table`` reads without a column map: one request, 4 prompt
  tokens and 12 decode tokens, its routing the first 16 decode tokens of the bundled
  trace's first request (the format, not real routing).
- ``arrivals.csv``: an arrival trace in the Azure LLM inference format
  (``TIMESTAMP,ContextTokens,GeneratedTokens``; date-time stamps), 32 synthetic
  requests with bursty gaps (mean 15 s).  The real Azure traces are public in
  Azure/AzurePublicDataset (``AzureLLMInferenceTrace_code.csv``, ``_conv.csv``).

Run from the repository root: ``python examples/make_examples.py``.  Deterministic.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from fmoesim.cli.plot_cli import write_azure_synthetic
from fmoesim.trace.reader import read_trace

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
REQUESTS = 3  # requests of the bundled trace written to the route log
TOKENS = 24  # decode tokens per request


def write_routes(path: Path) -> int:
    """Write the route log; returns its number of lines."""
    tr = read_trace(ROOT / "traces" / "default")
    lines = []
    for r in range(REQUESTS):
        its = list(tr.request_iterations(r))[1 : 1 + TOKENS]  # decode: one token each
        for tok, i in enumerate(its):
            counts = tr.counts[i]  # (L, E) 0/1 for one token
            probs = tr.probs[i].astype(np.float64)  # (L, E)
            for layer in range(tr.num_layers):
                experts = sorted(
                    np.flatnonzero(counts[layer]).tolist(), key=lambda e: -probs[layer, e]
                )
                weights = probs[layer, experts]
                weights = weights / weights.sum()
                lines.append(
                    json.dumps(
                        {
                            "dataset": "example",
                            "problem_id": r,
                            "layer": layer,
                            "token_idx": tok,
                            "experts": [int(e) for e in experts],
                            "gating_probs": [round(float(w), 4) for w in weights],
                        }
                    )
                )
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def write_table(path: Path, prompt: int = 4, decode: int = 12) -> int:
    """Write the route table; returns its number of data rows."""
    tr = read_trace(ROOT / "traces" / "default")
    its = list(tr.request_iterations(0))[1 : 1 + prompt + decode]  # one token each
    lines = [
        "# route_trace example (fmoesim examples/make_examples.py): not real routing",
        f"# model=mixtral-8x7b n_layer={tr.num_layers} n_expert={tr.num_experts} n_expert_used=2",
        "turn,phase,step,layer,slot,expert,weight",
    ]
    for step, i in enumerate(its):
        probs = tr.probs[i].astype(np.float64)  # (L, E)
        for layer in range(tr.num_layers):
            experts = sorted(
                np.flatnonzero(tr.counts[i][layer]).tolist(), key=lambda e: -probs[layer, e]
            )
            weights = probs[layer, experts] / probs[layer, experts].sum()
            for slot, (e, w) in enumerate(zip(experts, weights, strict=True)):
                lines.append(f"0,{int(step >= prompt)},{step},{layer},{slot},{e},{w:.4f}")
    path.write_text("\n".join(lines) + "\n")
    return len(lines) - 3


if __name__ == "__main__":
    n = write_routes(HERE / "vllm-routes.jsonl")
    write_table(HERE / "route-table.csv")
    write_azure_synthetic(HERE / "arrivals.csv", num_requests=32, seed=0)
    print(f"wrote {HERE / 'vllm-routes.jsonl'} ({n} lines) and {HERE / 'arrivals.csv'}")
