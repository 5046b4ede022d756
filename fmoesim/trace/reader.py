"""Read a trace directory into numpy arrays once, validating every rule of the format.

Hot loops (the engine) index these arrays directly; pandas is never used there.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from numpy.typing import ArrayLike

from fmoesim.errors import TraceError
from fmoesim.trace import schema as S


def _read_table(path: Path, expected: pa.Schema) -> pa.Table:
    """Read a Parquet file and check its columns and types against ``expected``."""
    if not path.is_file():
        raise TraceError(path, "the trace directory holds this file", detail="file not found")
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as exc:
        msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        if "Expected all lists to be of size" in msg:
            # pyarrow before 26 cannot read a null row of a fixed-size list column
            # (apache/arrow GH-35692), which traces use for absent probabilities
            raise TraceError(
                path,
                "readable by pyarrow >= 26 (null fixed-size lists)",
                detail=f"pyarrow {pa.__version__} failed: {msg}",
            ) from None
        raise TraceError(
            path, "a readable Parquet file (truncated or corrupt?)", detail=msg
        ) from None
    for fld in expected:
        if fld.name not in table.column_names:
            raise TraceError(
                path, f"has column '{fld.name}' of type {fld.type}", detail="column missing"
            )
        got = table.schema.field(fld.name).type
        if got != fld.type:
            raise TraceError(
                path,
                f"column '{fld.name}' has type {fld.type} (shape from trace.json)",
                detail=f"it has type {got}",
            )
        col = table.column(fld.name)
        if not fld.nullable and col.null_count:
            # a null in a key or count column would reach numpy as NaN/garbage unnoticed
            valid = col.combine_chunks().is_valid().to_numpy(zero_copy_only=False)
            raise TraceError(
                path,
                f"column '{fld.name}' has no nulls",
                row=_first(~valid),
                detail=f"{fld.name} is null",
            )
    return table


def _fixed_block(col: pa.ChunkedArray, width: int, dtype: type) -> tuple[np.ndarray, np.ndarray]:
    """A fixed-size list column as a ``(rows, width)`` array plus a ``(rows,)`` validity mask.

    Null rows come back as zeros with ``valid=False``.
    """
    arr = col.combine_chunks()
    n = len(arr)
    valid = (
        np.ones(n, dtype=bool)
        if arr.null_count == 0
        else arr.is_valid().to_numpy(zero_copy_only=False)
    )
    start = arr.offset * width
    values = arr.values.slice(start, n * width)
    if values.null_count:
        values = values.fill_null(0)
    block = values.to_numpy(zero_copy_only=False).astype(dtype, copy=False).reshape(n, width)
    if not valid.all():
        block = block.copy()
        block[~valid] = 0
    return block, valid


def _refuse(
    bad: ArrayLike, path: Path, rule: str, detail: Callable[[int], str] | None = None
) -> None:
    """Raise :class:`TraceError` at the first True row of ``bad``, if any."""
    if np.any(bad):
        row = _first(bad)
        raise TraceError(path, rule, row=row, detail=detail(row) if detail else "")


def _after_first(pairwise: np.ndarray) -> np.ndarray:
    """Align a mask over consecutive pairs (row i-1, row i) to rows: True marks row i."""
    return np.concatenate([[False], pairwise])


def _first(mask: ArrayLike) -> int:
    """Index of the first True in a flat boolean mask."""
    return int(np.flatnonzero(np.asarray(mask).reshape(-1))[0])


@dataclass
class Trace:
    """A trace held as numpy arrays.

    Iterations are indexed ``0..N-1`` in (request_id, iteration) order; request ``r``
    (position in ``request_id``) owns iterations ``iter_start[r]:iter_start[r+1]``.
    ``num_tokens`` is each iteration's; :attr:`layer_tokens` each layer's.  A null
    ``probs`` row reads as zeros, a null ``spec_probs`` row as zeros with ``spec_valid``
    False (in an encoder-decoder trace, the encoder layers after iteration 0).
    """

    path: Path
    manifest: S.TraceManifest
    request_id: np.ndarray  # (R,) int64
    prompt_tokens: np.ndarray  # (R,) int32
    output_tokens: np.ndarray  # (R,) int32
    arrival_s: np.ndarray  # (R,) float64, NaN where null
    dataset: np.ndarray  # (R,) object
    iter_start: np.ndarray  # (R+1,) int64
    iter_request: np.ndarray  # (N,) int64 request position of each iteration
    iteration: np.ndarray  # (N,) int32
    num_tokens: np.ndarray  # (N,) int32
    embedding: np.ndarray  # (N, D) float16
    counts: np.ndarray  # (N, L, E) int32
    probs: np.ndarray | None  # (N, L, E) float16, None for top-k-only traces
    spec_probs: np.ndarray | None  # (N, L, E) float16, zeros where spec_valid is False
    spec_valid: np.ndarray | None  # (N, L) bool

    @property
    def num_layers(self) -> int:
        """Number of MoE layers."""
        return self.manifest.model.num_layers

    @property
    def num_experts(self) -> int:
        """Routed experts per MoE layer."""
        return self.manifest.model.num_experts

    @property
    def top_k(self) -> int:
        """Experts each token is routed to."""
        return self.manifest.model.top_k

    @property
    def num_requests(self) -> int:
        """Number of requests."""
        return len(self.request_id)

    @property
    def num_iterations(self) -> int:
        """Number of (request, iteration) rows."""
        return len(self.iteration)

    @property
    def encoder_layers(self) -> int:
        """MoE layers of the encoder (the first ones); 0 for a decoder-only model."""
        return self.manifest.model.encoder_layers

    @property
    def layer_tokens(self) -> np.ndarray:
        """Tokens each MoE layer sees in each iteration ``(N, L)`` int32 (the routing
        rows' ``num_tokens``; see :func:`layer_tokens`), computed on each call."""
        return layer_tokens(self.num_tokens, self.iteration, self.num_layers, self.encoder_layers)

    def request_iterations(self, r: int) -> range:
        """Iteration indices of the request at position ``r``."""
        return range(int(self.iter_start[r]), int(self.iter_start[r + 1]))

    def files_bytes(self) -> dict[str, int]:
        """Size on disk of each file of the trace."""
        return {p.name: p.stat().st_size for p in sorted(self.path.iterdir()) if p.is_file()}


def read_trace(path: str | os.PathLike[str], *, validate: bool = True) -> Trace:
    """Load a trace directory; with ``validate`` (default) refuse any rule violation.

    Raises :class:`TraceError` naming the file, the row and the broken rule.
    """
    root = Path(path)
    if not root.is_dir():
        raise TraceError(
            root,
            "a trace is a directory holding trace.json and Parquet files",
            detail="a file, not a directory" if root.exists() else "directory not found",
        )
    manifest = S.TraceManifest.load(root / S.MANIFEST)
    m = manifest.model
    L, E, D = m.num_layers, m.num_experts, manifest.embedding_dim

    req = _read_table(root / S.REQUESTS, S.requests_schema())
    its = _read_table(root / S.ITERATIONS, S.iterations_schema(D))
    rout = _read_table(root / S.ROUTING, S.routing_schema(E))

    request_id = req.column("request_id").to_numpy()
    prompt_tokens = req.column("prompt_tokens").to_numpy()
    output_tokens = req.column("output_tokens").to_numpy()
    arrival_col = req.column("arrival_s")
    arrival_s = arrival_col.to_numpy(zero_copy_only=False).astype(np.float64)
    arrival_null = ~arrival_col.is_valid().to_numpy(zero_copy_only=False).astype(bool)
    dataset = np.array(req.column("dataset").to_pylist(), dtype=object)

    it_rid = its.column("request_id").to_numpy()
    iteration = its.column("iteration").to_numpy()
    num_tokens = its.column("num_tokens").to_numpy()
    if D > 0:
        embedding, _ = _fixed_block(its.column("embedding"), D, np.float16)
    else:
        embedding = np.zeros((len(iteration), 0), dtype=np.float16)

    r_rid = rout.column("request_id").to_numpy()
    r_it = rout.column("iteration").to_numpy()
    r_layer = rout.column("layer").to_numpy()
    r_ntok = rout.column("num_tokens").to_numpy()
    counts, _ = _fixed_block(rout.column("expert_counts"), E, np.int32)
    probs_b, probs_valid = _fixed_block(rout.column("probs"), E, np.float16)
    spec_b, spec_valid = _fixed_block(rout.column("spec_probs"), E, np.float16)

    N = len(iteration)
    if validate:
        _validate(
            root,
            manifest,
            request_id,
            prompt_tokens,
            output_tokens,
            arrival_s,
            it_rid,
            iteration,
            num_tokens,
            embedding,
            r_rid,
            r_it,
            r_layer,
            r_ntok,
            counts,
            probs_b,
            probs_valid,
            spec_b,
            spec_valid,
            arrival_null,
        )
    # position of each iteration's request
    iter_request = np.searchsorted(request_id, it_rid)
    iter_start = np.searchsorted(it_rid, request_id, side="left").astype(np.int64)
    iter_start = np.append(iter_start, N)

    has_probs = bool(probs_valid.any())
    has_spec = bool(spec_valid.any())
    return Trace(
        path=root,
        manifest=manifest,
        request_id=request_id,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        arrival_s=arrival_s,
        dataset=dataset,
        iter_start=iter_start,
        iter_request=iter_request,
        iteration=iteration,
        num_tokens=num_tokens,
        embedding=embedding,
        counts=counts.reshape(N, L, E),
        probs=probs_b.reshape(N, L, E) if has_probs else None,
        spec_probs=spec_b.reshape(N, L, E) if has_spec else None,
        spec_valid=spec_valid.reshape(N, L) if has_spec else None,
    )


def _validate(
    root: Path,
    manifest: S.TraceManifest,
    request_id: np.ndarray,
    prompt_tokens: np.ndarray,
    output_tokens: np.ndarray,
    arrival_s: np.ndarray,
    it_rid: np.ndarray,
    iteration: np.ndarray,
    num_tokens: np.ndarray,
    embedding: np.ndarray,
    r_rid: np.ndarray,
    r_it: np.ndarray,
    r_layer: np.ndarray,
    r_ntok: np.ndarray,
    counts: np.ndarray,
    probs: np.ndarray,
    probs_valid: np.ndarray,
    spec: np.ndarray,
    spec_valid: np.ndarray,
    arrival_null: np.ndarray | None = None,
) -> None:
    """Check every rule of the format; raise on the first violation (file, row, rule).
    ``arrival_null`` marks the null ``arrival_s`` cells (without it, NaN reads as null)."""
    m = manifest.model
    L, k = m.num_layers, m.top_k
    fq, fi, fr = root / S.REQUESTS, root / S.ITERATIONS, root / S.ROUTING

    # requests.parquet
    if len(request_id) == 0:
        raise TraceError(fq, "a trace has at least one request", detail="no rows")
    _refuse(
        _after_first(np.diff(request_id) <= 0),
        fq,
        "request_id strictly increasing (sorted, unique)",
        lambda row: f"request_id {request_id[row]} after {request_id[row - 1]}",
    )
    for name, col in (("prompt_tokens", prompt_tokens), ("output_tokens", output_tokens)):
        _refuse(col < 1, fq, f"{name} >= 1", lambda row: f"{name} = {col[row]}")  # noqa: B023 - called at once
    null = np.isnan(arrival_s) if arrival_null is None else arrival_null
    bad = ~null & ~(np.isfinite(arrival_s) & (arrival_s >= 0))
    _refuse(
        bad,
        fq,
        "arrival_s is null or a finite time >= 0",
        lambda row: f"arrival_s = {arrival_s[row]}",
    )

    # iterations.parquet: sorted, contiguous 0..output_tokens-1 per request
    N = len(iteration)
    if N == 0:
        raise TraceError(fi, "every request has its iterations", detail="no rows")
    _refuse(
        _after_first((np.diff(it_rid) < 0) | ((np.diff(it_rid) == 0) & (np.diff(iteration) <= 0))),
        fi,
        "rows sorted by (request_id, iteration), no duplicates",
        lambda row: (
            f"({it_rid[row]}, {iteration[row]}) after ({it_rid[row - 1]}, {iteration[row - 1]})"
        ),
    )
    pos = np.searchsorted(request_id, it_rid)
    unknown = (pos >= len(request_id)) | (
        request_id[np.minimum(pos, len(request_id) - 1)] != it_rid
    )
    _refuse(
        unknown,
        fi,
        "request_id appears in requests.parquet",
        lambda row: f"request_id {it_rid[row]} unknown",
    )
    start = np.searchsorted(it_rid, request_id, side="left")
    end = np.searchsorted(it_rid, request_id, side="right")
    expected_iter = np.arange(N) - np.repeat(start, end - start)
    bad = iteration != expected_iter
    _refuse(
        bad,
        fi,
        "iterations of a request are 0, 1, 2, ... with none missing",
        lambda row: (
            f"request {it_rid[row]} has iteration {iteration[row]} where "
            f"{expected_iter[row]} was expected"
        ),
    )
    n_iter = end - start
    bad = n_iter != output_tokens
    _refuse(
        bad,
        fq,
        "a request has output_tokens iterations (prefill + decodes)",
        lambda row: (
            f"request {request_id[row]} has output_tokens={output_tokens[row]} "
            f"but {n_iter[row]} iterations in {S.ITERATIONS}"
        ),
    )
    first_rows = start
    bad = num_tokens[first_rows] != prompt_tokens
    if bad.any():
        row = int(first_rows[_first(bad)])
        raise TraceError(
            fi,
            "the prefill iteration has num_tokens == prompt_tokens",
            row=row,
            detail=f"num_tokens = {num_tokens[row]}",
        )
    _refuse(num_tokens < 1, fi, "num_tokens >= 1", lambda row: f"num_tokens = {num_tokens[row]}")
    if embedding.size:
        finite = np.isfinite(embedding.astype(np.float32)).all(axis=1)
        _refuse(~finite, fi, "embedding values are finite")

    # routing.parquet: exactly L rows per iteration, in layer order
    if len(r_rid) != N * L:
        # locate the first iteration whose layer block is wrong
        raise_row = _first_layer_gap(r_rid, r_it, r_layer, it_rid, iteration, L)
        raise TraceError(
            fr,
            f"one row per (request, iteration, layer) for all {L} layers",
            row=raise_row if len(r_rid) else None,  # an empty file has no row to name
            detail=f"{len(r_rid)} rows for {N} iterations x {L} layers = {N * L}",
        )
    exp_layer = np.tile(np.arange(L), N)
    bad = (
        (r_rid != np.repeat(it_rid, L)) | (r_it != np.repeat(iteration, L)) | (r_layer != exp_layer)
    )
    _refuse(
        bad,
        fr,
        "rows sorted by (request_id, iteration, layer) with no missing layer or iteration",
        lambda row: (
            f"found ({r_rid[row]}, {r_it[row]}, layer {r_layer[row]}), "
            f"expected ({it_rid[row // L]}, {iteration[row // L]}, "
            f"layer {exp_layer[row]})"
        ),
    )
    n_enc = m.encoder_layers
    want_ntok = layer_tokens(num_tokens, iteration, L, n_enc).reshape(-1)  # (N * L,)
    if n_enc == 0:
        _refuse(
            r_ntok != want_ntok,
            fr,
            "num_tokens equals the iteration's num_tokens",
            lambda row: f"{r_ntok[row]} != {num_tokens[row // L]}",
        )
    else:
        _refuse(
            r_ntok != want_ntok,
            fr,
            f"num_tokens is the tokens the layer sees: an encoder layer (layer < "
            f"encoder_layers = {n_enc}) the iteration's num_tokens at iteration 0 and 0 "
            "after, a decoder layer 1",
            lambda row: (
                f"num_tokens {r_ntok[row]} at layer {r_layer[row]}, iteration {r_it[row]}, "
                f"expected {want_ntok[row]}"
            ),
        )
    _refuse(
        (counts < 0).any(axis=1),
        fr,
        "expert_counts are non-negative",
        lambda row: f"expert {int(np.argmin(counts[row]))}: {int(counts[row].min())}",
    )
    sums = counts.sum(axis=1, dtype=np.int64)
    if manifest.layer_gaps:  # tokens the logger missed at a layer route nothing there
        bad = (sums % k != 0) | (sums > r_ntok.astype(np.int64) * k)
        _refuse(
            bad,
            fr,
            f"expert_counts sum to top_k (= {k}) times the tokens routed, at most num_tokens",
            lambda row: f"sum {sums[row]} with num_tokens {r_ntok[row]}",
        )
    else:
        bad = sums != r_ntok.astype(np.int64) * k
        _refuse(
            bad,
            fr,
            f"expert_counts sum to num_tokens * top_k (top_k = {k})",
            lambda row: f"sum {counts[row].sum()} != {r_ntok[row]} * {k}",
        )
    _refuse(
        (counts > r_ntok[:, None]).any(axis=1),
        fr,
        "no expert gets more tokens than the iteration has"
        if n_enc == 0
        else "no expert gets more tokens than the layer sees (num_tokens)",
    )

    if n_enc == 0:
        if manifest.has_probs:
            _refuse(
                ~probs_valid,
                fr,
                "probs present on every row (trace.json says has_probs)",
                lambda row: "probs is null",
            )
    else:
        idle = r_ntok == 0  # encoder layers after iteration 0
        _refuse(
            idle & (probs_valid | spec_valid),
            fr,
            "probs and spec_probs are null where the layer sees no token "
            "(an encoder layer after iteration 0)",
            lambda row: f"{'probs' if probs_valid[row] else 'spec_probs'} is not null",
        )
        if manifest.has_probs:
            _refuse(
                ~probs_valid & ~idle,
                fr,
                "probs present on every row whose layer sees tokens (trace.json says has_probs)",
                lambda row: "probs is null",
            )
    _check_probs(fr, "probs", probs, probs_valid)
    if manifest.has_spec_probs and not spec_valid.any():
        raise TraceError(
            fr,
            "spec_probs present (trace.json says has_spec_probs)",
            detail="spec_probs is null on every row",
        )
    _check_probs(fr, "spec_probs", spec, spec_valid)

    # trace.json: the row counts it records
    for key, rows, name in (
        ("num_requests", len(request_id), S.REQUESTS),
        ("num_iterations", N, S.ITERATIONS),
    ):
        if getattr(manifest, key) != rows:
            raise TraceError(
                root / S.MANIFEST,
                f"{key} is the number of rows of {name}",
                detail=f"{key} = {getattr(manifest, key)}, {name} has {rows} rows",
            )


def _check_probs(path: Path, name: str, block: np.ndarray, valid: np.ndarray) -> None:
    """Probabilities: finite, non-negative, each non-null row summing to 1 within tolerance."""
    if not valid.any():
        return
    rows = np.flatnonzero(valid)
    vals = block[rows].astype(np.float32)
    finite = np.isfinite(vals).all(axis=1)
    if not finite.all():
        row = int(rows[_first(~finite)])
        raise TraceError(path, f"{name} are finite (no NaN/inf)", row=row)
    neg = (vals < 0).any(axis=1)
    if neg.any():
        row = int(rows[_first(neg)])
        raise TraceError(
            path, f"{name} are non-negative", row=row, detail=f"min {vals[_first(neg)].min():.4g}"
        )
    sums = vals.sum(axis=1)
    off = np.abs(sums - 1.0) > S.PROB_SUM_TOL
    if off.any():
        i = _first(off)
        raise TraceError(
            path,
            f"{name} sum to 1 within {S.PROB_SUM_TOL}",
            row=int(rows[i]),
            detail=f"{name} sum to {sums[i]:.4f}",
        )


def layer_tokens(
    num_tokens: np.ndarray, iteration: np.ndarray, num_layers: int, encoder_layers: int
) -> np.ndarray:
    """The tokens each MoE layer sees in each iteration, ``(N, num_layers)`` int32.

    Decoder-only (``encoder_layers == 0``): the iteration's ``num_tokens`` at every
    layer.  Encoder-decoder: an encoder layer (``layer < encoder_layers``) sees the
    iteration's ``num_tokens`` (the prompt) at iteration 0 and no token after; a decoder
    layer sees 1 token at every iteration.
    """
    ntok = np.asarray(num_tokens, dtype=np.int32)
    out = np.repeat(ntok[:, None], num_layers, axis=1)
    if encoder_layers:
        out[:, encoder_layers:] = 1
        out[np.asarray(iteration) != 0, :encoder_layers] = 0
    return out


def _first_layer_gap(
    r_rid: np.ndarray,
    r_it: np.ndarray,
    r_layer: np.ndarray,
    it_rid: np.ndarray,
    iteration: np.ndarray,
    L: int,
) -> int | None:
    """First routing row where the (request, iteration, layer) sequence departs from expected."""
    n = min(len(r_rid), len(it_rid) * L)
    k = np.arange(n)  # the expected sequence up to the rows there are, not N x L of it
    exp_rid, exp_it, exp_layer = it_rid[k // L], iteration[k // L], k % L
    bad = (r_rid[:n] != exp_rid) | (r_it[:n] != exp_it) | (r_layer[:n] != exp_layer)
    return _first(bad) if bad.any() else n


def validate_trace(path: str | os.PathLike[str]) -> Trace:
    """Check every rule of the format, ``tokens.parquet`` included (:func:`read_trace`,
    then :func:`read_tokens` when ``has_tokens``; without it, no ``tokens.parquet``);
    return the trace.  Raises :class:`TraceError` naming the file, the row and the rule."""
    trace = read_trace(path)
    if trace.manifest.has_tokens:
        read_tokens(trace)
    elif (trace.path / S.TOKENS).exists():
        raise TraceError(
            trace.path / S.TOKENS,
            "tokens.parquet is present only when trace.json says has_tokens",
            detail="has_tokens is false",
        )
    return trace


@dataclass
class TokenTable:
    """``tokens.parquet`` as columns: one row per (request, iteration, token, layer).

    A (token, layer) pair the log lacks (a null row, in a trace with ``layer_gaps``) has
    ``logged`` False, ids ``-1`` and weights NaN."""

    request_id: np.ndarray  # (N,) int64
    iteration: np.ndarray  # (N,) int32
    token: np.ndarray  # (N,) int32
    layer: np.ndarray  # (N,) int16
    topk_ids: np.ndarray  # (N, k) int16
    topk_weights: np.ndarray  # (N, k) float32
    logged: np.ndarray  # (N,) bool: False where the log has no routing for the pair


def read_tokens(trace: Trace) -> TokenTable:
    """Load and check a trace's optional ``tokens.parquet``: ids distinct and in
    ``[0, E)``, weights finite and >= 0, one row per (request, iteration, token, layer)
    in order, and every iteration's ids adding up to its ``expert_counts``.  A row's
    ids and weights are null together, and only in a trace with ``layer_gaps``: the
    (token, layer) pairs the log lacks, which the counts then leave out."""
    m = trace.manifest
    path = trace.path / S.TOKENS
    if not m.has_tokens:
        raise TraceError(trace.path / S.MANIFEST, "has_tokens is true to read tokens.parquet")
    if m.model.encoder_layers:
        raise TraceError(
            trace.path / S.MANIFEST,
            "tokens.parquet is read for decoder-only traces (model.encoder_layers = 0)",
        )
    k, L, E = m.model.top_k, m.model.num_layers, m.model.num_experts
    t = _read_table(path, S.tokens_schema(k))
    ids, logged = _fixed_block(t.column("topk_ids"), k, np.int64)
    w, w_logged = _fixed_block(t.column("topk_weights"), k, np.float32)
    cols = {c: t.column(c).to_numpy() for c in ("request_id", "iteration", "token", "layer")}
    _refuse(
        logged != w_logged,
        path,
        "topk_ids and topk_weights are null on the same rows",
        lambda row: (
            f"topk_ids {'null' if not logged[row] else ids[row].tolist()}, "
            f"topk_weights {'null' if not w_logged[row] else w[row].tolist()}"
        ),
    )
    if not m.layer_gaps:
        _refuse(
            ~logged,
            path,
            "a row is null only in a trace with layer_gaps (a (token, layer) pair the log lacks)",
            lambda row: "topk_ids null, and trace.json has no layer_gaps",
        )
    _refuse(
        logged & ((ids < 0) | (ids >= E)).any(axis=1),
        path,
        f"topk_ids in [0, {E})",
        lambda row: f"topk_ids {ids[row].tolist()}",
    )
    srt = np.sort(ids, axis=1)
    _refuse(
        logged & (srt[:, 1:] == srt[:, :-1]).any(axis=1),
        path,
        "topk_ids are distinct",
        lambda row: f"topk_ids {ids[row].tolist()}",
    )
    _refuse(
        logged & (~np.isfinite(w) | (w < 0)).any(axis=1),
        path,
        "topk_weights finite and >= 0",
        lambda row: f"topk_weights {w[row].tolist()}",
    )
    # expected rows, in order, from the routing's (request, iteration, num_tokens)
    rows = np.repeat(np.arange(trace.num_iterations), trace.num_tokens * L)
    rid = np.repeat(trace.request_id, trace.output_tokens)[rows]
    it = np.concatenate([np.arange(o) for o in trace.output_tokens])[rows]
    if len(rows) != len(ids):
        raise TraceError(
            path, "one row per (request, iteration, token, layer)",
            detail=f"{len(ids)} rows, the routing implies {len(rows)}",
        )  # fmt: skip
    tok = np.concatenate([np.repeat(np.arange(n), L) for n in trace.num_tokens])
    lay = np.tile(np.arange(L), int(trace.num_tokens.sum()))
    for name, want in (("request_id", rid), ("iteration", it), ("token", tok), ("layer", lay)):
        _refuse(
            cols[name] != want, path, f"rows sorted by (request, iteration, token, layer): {name}"
        )
    counts = np.zeros((trace.num_iterations, L, E), dtype=np.int64)
    on = np.repeat(logged, k)  # a null row routes nothing
    np.add.at(counts, (np.repeat(rows, k)[on], np.repeat(lay, k)[on], ids.reshape(-1)[on]), 1)
    bad = (counts != trace.counts).any(axis=2)  # (iterations, L): the layers that differ
    _refuse(
        bad[rows, lay], path, "top-k ids add up to expert_counts",
        lambda row: f"request {rid[row]}, iteration {it[row]}, layer {lay[row]}: the first "
        "row of that layer's tokens",
    )  # fmt: skip
    ids[~logged], w[~logged] = -1, np.nan
    return TokenTable(
        cols["request_id"], cols["iteration"], cols["token"], cols["layer"],
        ids.astype(np.int16), w, logged,
    )  # fmt: skip
