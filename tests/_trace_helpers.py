"""Shared helpers of the trace tests: a small hand-built trace and Parquet/manifest surgery.

The hand-built trace has 2 requests, L=3 MoE layers, E=4 experts, top_k=2 and 5-dim
embeddings.  Its iterations, in file order (the iteration index ``i``)::

    i  request  iteration  num_tokens
    0  0        0          3   (prefill, prompt_tokens=3)
    1  0        1          1
    2  0        2          1
    3  1        0          2   (prefill, prompt_tokens=2)
    4  1        1          1

so ``routing.parquet`` row ``3 * i + layer`` holds iteration ``i``, layer ``layer``
(15 rows; e.g. row 7 is request 0, iteration 2, layer 1).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fmoesim.trace import TraceManifest, TraceModel, TraceWriter

L, E, K, D = 3, 4, 2, 5

#: (request_id, prompt_tokens, output_tokens, arrival_s, dataset)
REQUESTS = [(0, 3, 3, 0.5, "alpaca"), (1, 2, 2, None, None)]
#: (request_id, iteration, num_tokens) in file order
ITERATIONS = [(0, 0, 3), (0, 1, 1), (0, 2, 1), (1, 0, 2), (1, 1, 1)]
N = len(ITERATIONS)

#: expert_counts per iteration (L, E); each row sums to num_tokens * K, no entry > num_tokens
COUNTS = np.array(
    [
        [[3, 2, 1, 0], [0, 3, 2, 1], [1, 0, 3, 2]],  # 3 tokens
        [[1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]],  # 1 token
        [[1, 0, 0, 1], [1, 0, 1, 0], [0, 1, 0, 1]],  # 1 token
        [[2, 1, 1, 0], [0, 2, 1, 1], [1, 1, 0, 2]],  # 2 tokens
        [[0, 1, 1, 0], [1, 1, 0, 0], [0, 0, 1, 1]],  # 1 token
    ],
    dtype=np.int32,
)

#: A probability whose float16 rounding differs when it goes through float32 first:
#: 0.25 + 2**-13 is a float16 tie (spacing 2**-12 at 0.25), the 2**-32 tips it upward,
#: but float32 drops the 2**-32 and then rounds the tie to even (down to 0.25).
DOUBLE_ROUNDING = 0.25 + 2.0**-13 + 2.0**-32


def make_inputs(seed: int = 7) -> dict[str, np.ndarray]:
    """Probabilities, speculative probabilities and embeddings fed to the writer (float64)."""
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.ones(E), size=(N, L))
    probs[1, 2] = [DOUBLE_ROUNDING, 0.25, 0.25, 0.5 - DOUBLE_ROUNDING]
    spec = rng.dirichlet(np.ones(E), size=(N, L))
    spec[0, 0] = np.nan  # prefill of request 0: nothing precedes layer 0
    spec[3, 0] = np.nan  # prefill of request 1
    emb = rng.standard_normal((N, D))
    return {"counts": COUNTS.copy(), "probs": probs, "spec_probs": spec, "embedding": emb}


def manifest(
    *, embedding_dim: int = D, has_probs: bool = True, has_spec_probs: bool = True
) -> TraceManifest:
    """A manifest for the hand-built trace's shape."""
    return TraceManifest(
        model=TraceModel(name="tiny", num_layers=L, num_experts=E, top_k=K, hidden_size=16),
        embedding_dim=embedding_dim,
        source={"kind": "importer", "format": "hand-built", "original": "tests"},
        has_probs=has_probs,
        has_spec_probs=has_spec_probs,
    )


def build_trace(
    path: Path,
    *,
    with_probs: bool = True,
    with_spec: bool = True,
    embedding_dim: int = D,
    row_group_iterations: int = 512,
    overwrite: bool = False,
) -> dict[str, np.ndarray]:
    """Write the hand-built trace to ``path``; return the inputs given to the writer."""
    inp = make_inputs()
    man = manifest(embedding_dim=embedding_dim, has_probs=with_probs, has_spec_probs=with_spec)
    with TraceWriter(
        path, man, row_group_iterations=row_group_iterations, overwrite=overwrite
    ) as w:
        for rid, prompt, output, arrival, dataset in REQUESTS:
            w.add_request(rid, prompt, output, arrival, dataset)
        for i, (rid, it, ntok) in enumerate(ITERATIONS):
            w.add_iteration(
                rid,
                it,
                ntok,
                inp["embedding"][i] if embedding_dim else None,
                inp["counts"][i],
                inp["probs"][i] if with_probs else None,
                inp["spec_probs"][i] if with_spec else None,
            )
    return inp


Rows = list[dict[str, Any]]


def rewrite_rows(path: Path, edit: Callable[[Rows], Rows | None]) -> None:
    """Rewrite one Parquet file after ``edit`` changed its rows (list of dicts).

    The rewritten file keeps the column types but declares every column nullable, so a
    test can plant a null where the format forbids one.
    """
    table = pq.read_table(path)
    rows = table.to_pylist()
    new = edit(rows)
    rows = rows if new is None else new
    schema = pa.schema([f.with_nullable(True) for f in table.schema])
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)


def rewrite_table(path: Path, edit: Callable[[pa.Table], pa.Table]) -> None:
    """Rewrite one Parquet file after ``edit`` changed the whole Arrow table."""
    pq.write_table(edit(pq.read_table(path)), path)


def edit_manifest(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite ``trace.json`` after ``edit`` changed the parsed JSON object in place."""
    raw = json.loads(path.read_text())
    new = edit(raw)
    path.write_text(json.dumps(raw if new is None else new))
