"""Streaming trace writer: row groups are flushed as they fill, never the whole trace in memory.

The trace is built in a hidden temporary directory beside the destination and renamed
into place on :meth:`TraceWriter.close`; if anything fails, the temporary directory is
removed and no half-written trace is left behind.  An existing destination is replaced
only when asked to (``overwrite``) and only when it is a trace directory (one holding
``trace.json``) or an empty directory (:func:`check_destination`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from fmoesim.atomic import as_created, clean_stale_temps, temp_prefix
from fmoesim.errors import FmoesimError, TraceError
from fmoesim.trace import schema as S


def check_destination(path: str | os.PathLike[str], overwrite: bool) -> None:
    """Refuse a destination that exists, unless ``overwrite`` and it is a trace directory
    (one holding ``trace.json``) or an empty directory: a plain file or a directory of
    other things is never replaced."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if path.is_dir():
        names = [p.name for p in path.iterdir()]
        if S.MANIFEST in names or not names:
            if overwrite:
                return
            raise FmoesimError(
                f"{path}: already exists (pass overwrite=True / --force to replace it)"
            )
        what = "a directory without trace.json"
    else:
        what = "a file" if path.is_file() else "not a directory"
    raise FmoesimError(
        f"{path}: already exists and is {what} (rule: overwrite=True / --force replaces only "
        "a trace directory, one holding trace.json, or an empty directory)"
    )


def _fixed_list(
    values: np.ndarray, width: int, value_type: pa.DataType, valid: np.ndarray | None = None
) -> pa.FixedSizeListArray:
    """Wrap a (rows, width) numpy block as an Arrow fixed-size list column."""
    flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=value_type)
    mask = None if valid is None or valid.all() else pa.array(~valid)
    return pa.FixedSizeListArray.from_arrays(flat, width, mask=mask)


class TraceWriter:
    """Write a trace directory iteration by iteration.

    Usage::

        with TraceWriter(path, manifest) as w:
            w.add_request(0, prompt_tokens=12, output_tokens=3)
            w.add_iteration(0, 0, num_tokens=12, embedding=e, counts=c, probs=p, spec_probs=None)
            ...

    ``overwrite`` replaces an existing trace directory (:func:`check_destination`);
    ``check`` reads the finished trace (``tokens.parquet`` included) before it is moved
    into place and refuses it, leaving nothing, if it breaks a rule of the format.

    Iterations must arrive sorted by (request_id, iteration).  ``counts`` is ``(L, E)``
    int, ``probs`` and ``spec_probs`` are ``(L, E)`` float arrays or None (either may
    have NaN rows, written as null: ``spec_probs`` for layers with no speculative
    prediction).  ``layer_tokens`` (``(L,)`` int, optional) is the routing rows'
    ``num_tokens``, the tokens each layer sees (an encoder-decoder model's encoder layers
    see the prompt at iteration 0 and no token after, its decoder layers 1 token); it
    defaults to the iteration's ``num_tokens`` at every layer.  The rows of a layer that
    sees no token are written with null ``probs`` and ``spec_probs``.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        manifest: S.TraceManifest,
        *,
        row_group_iterations: int = 512,
        overwrite: bool = False,
        check: bool = False,
    ) -> None:
        self.path = Path(path)
        self.manifest = manifest
        self._check, self._overwrite = check, overwrite
        check_destination(self.path, overwrite)
        self.path.parent.mkdir(parents=True, exist_ok=True)  # its OSError names the path
        clean_stale_temps(self.path.parent)  # what a killed writer left there
        try:
            tmp = tempfile.mkdtemp(prefix=temp_prefix(self.path.name), dir=self.path.parent)
        except OSError as exc:  # a read-only or virtual file system: name the destination
            raise FmoesimError(
                f"{self.path}: cannot be written ({exc.strerror or exc}; rule: the trace's "
                "folder can be created and written to)"
            ) from None
        as_created(tmp, 0o777)  # mkdtemp's 0700 would keep the trace from the group
        self._tmp = Path(tmp)
        m = manifest.model
        self._L, self._E, self._D = m.num_layers, m.num_experts, manifest.embedding_dim
        self._row_group = row_group_iterations
        self._routing = pq.ParquetWriter(
            self._tmp / S.ROUTING, S.routing_schema(self._E), compression=S.COMPRESSION
        )
        self._iters = pq.ParquetWriter(
            self._tmp / S.ITERATIONS, S.iterations_schema(self._D), compression=S.COMPRESSION
        )
        self._tokens: pq.ParquetWriter | None = None  # tokens.parquet, opened on first use
        self._with_tokens = 0  # iterations given per-token top-k
        self._requests: list[tuple[int, int, int, float | None, str | None]] = []
        self._buf: list[tuple] = []
        self._last_key: tuple[int, int] = (-(2**63), -1)
        self._num_iterations = 0
        self._closed = False

    # -- public API -----------------------------------------------------------------
    def add_request(
        self,
        request_id: int,
        prompt_tokens: int,
        output_tokens: int,
        arrival_s: float | None = None,
        dataset: str | None = None,
    ) -> None:
        """Record one request (any order; sorted on close)."""
        self._requests.append(
            (
                int(request_id),
                int(prompt_tokens),
                int(output_tokens),
                None if arrival_s is None else float(arrival_s),
                dataset,
            )
        )

    def add_iteration(
        self,
        request_id: int,
        iteration: int,
        num_tokens: int,
        embedding: np.ndarray | None,
        counts: np.ndarray,
        probs: np.ndarray | None = None,
        spec_probs: np.ndarray | None = None,
        tokens: tuple[np.ndarray, np.ndarray] | None = None,
        layer_tokens: np.ndarray | None = None,
    ) -> None:
        """Record one iteration of one request: all its MoE layers at once.  ``tokens``
        (optional, for ``tokens.parquet``): each token's top-k expert ids and weights,
        two ``(num_tokens, L, k)`` arrays; give them for every iteration or none, and
        only where every layer sees the iteration's ``num_tokens``.  A (token, layer)
        whose ids are all ``-1`` (a pair the log lacks, in a trace with ``layer_gaps``)
        is written as a null row of both lists.  ``layer_tokens``
        (optional): the tokens each layer sees, ``(L,)`` (see the class docstring)."""
        key = (int(request_id), int(iteration))
        if key <= self._last_key:
            raise FmoesimError(
                f"{self.path}: iterations must be added sorted by (request_id, "
                f"iteration); got {key} after {self._last_key}"
            )
        self._last_key = key
        counts = np.asarray(counts)
        if counts.shape != (self._L, self._E):
            raise FmoesimError(
                f"{self.path}: counts of request {request_id} iteration "
                f"{iteration} have shape {counts.shape}, manifest says "
                f"({self._L}, {self._E})"
            )
        for name, arr, shape in (
            ("probs", probs, (self._L, self._E)),
            ("spec_probs", spec_probs, (self._L, self._E)),
            ("embedding", embedding if self._D else None, (self._D,)),
        ):
            if arr is not None and np.shape(arr) != shape:
                raise FmoesimError(
                    f"{self.path}: {name} of request {request_id} iteration {iteration} has "
                    f"shape {np.shape(arr)}, manifest says {shape}"
                )
        if layer_tokens is not None:
            layer_tokens = np.asarray(layer_tokens)
            if layer_tokens.shape != (self._L,):
                raise FmoesimError(
                    f"{self.path}: layer_tokens of request {request_id} iteration "
                    f"{iteration} have shape {layer_tokens.shape}, manifest says ({self._L},)"
                )
            if (layer_tokens < 0).any():
                raise FmoesimError(
                    f"{self.path}: layer_tokens of request {request_id} iteration "
                    f"{iteration} are {layer_tokens.tolist()} (rule: >= 0)"
                )
            layer_tokens = layer_tokens.astype(np.int32)
            if tokens is not None and (layer_tokens != int(num_tokens)).any():
                raise FmoesimError(
                    f"{self.path}: tokens of request {request_id} iteration {iteration} "
                    "given with layer_tokens other than num_tokens (rule: tokens.parquet "
                    "holds num_tokens tokens at every layer)"
                )
        if tokens is not None:
            k = self.manifest.model.top_k
            ids, weights = (np.asarray(a) for a in tokens)
            want = (int(num_tokens), self._L, k)
            if ids.shape != want or weights.shape != want:
                raise FmoesimError(
                    f"{self.path}: tokens of request {request_id} iteration {iteration} have "
                    f"shapes {ids.shape} / {weights.shape}, expected {want}"
                )
            tokens = (ids, weights)
            self._with_tokens += 1
        self._buf.append(
            (
                key[0],
                key[1],
                int(num_tokens),
                embedding,
                counts,
                probs,
                spec_probs,
                tokens,
                layer_tokens,
            )
        )
        if len(self._buf) >= self._row_group:
            self._flush()

    def close(self) -> Path:
        """Flush, write the manifest and atomically move the trace into place."""
        if self._closed:
            return self.path
        try:
            self._flush()
            self._routing.close()
            self._iters.close()
            if self._tokens is not None:
                self._tokens.close()
            if self._with_tokens not in (0, self._num_iterations):
                raise FmoesimError(
                    f"{self.path}: {self._with_tokens} of {self._num_iterations} iterations "
                    "have per-token top-k (rule: all or none)"
                )
            self.manifest.has_tokens = self._with_tokens > 0
            self._write_requests()
            self.manifest.num_iterations = self._num_iterations
            self.manifest.num_requests = len(self._requests)
            (self._tmp / S.MANIFEST).write_text(self.manifest.to_json())
            if self._check:
                self._check_written()
            self._move_into_place()
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Discard everything written so far."""
        self._closed = True
        for w in (self._routing, self._iters, self._tokens):
            if w is None:
                continue
            try:
                w.close()
            except Exception:  # noqa: BLE001 - best effort while already failing
                pass
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    # -- internals ------------------------------------------------------------------
    def _flush(self) -> None:
        if not self._buf:
            return
        L, E, D = self._L, self._E, self._D
        n = len(self._buf)
        rid = np.array([b[0] for b in self._buf], dtype=np.int64)
        it = np.array([b[1] for b in self._buf], dtype=np.int32)
        ntok = np.array([b[2] for b in self._buf], dtype=np.int32)
        # iterations.parquet
        emb = np.zeros((n, D), dtype=np.float16)
        emb_valid = np.ones(n, dtype=bool)
        for i, b in enumerate(self._buf):
            if b[3] is None or D == 0:
                emb_valid[i] = False
            else:
                # float64 -> float16 directly: via float32 would round twice
                emb[i] = np.asarray(b[3], dtype=np.float64).reshape(D)
        icols = {"request_id": rid, "iteration": it, "num_tokens": ntok}
        if D > 0:
            icols["embedding"] = _fixed_list(emb, D, pa.float16(), emb_valid)
        self._iters.write_table(pa.table(icols, schema=self._iters.schema))
        # routing.parquet: L rows per iteration
        counts = np.stack([b[4] for b in self._buf]).astype(np.int32).reshape(n * L, E)
        row_ntok = np.repeat(ntok, L)  # (n * L,) the tokens each layer sees
        for i, b in enumerate(self._buf):
            if b[8] is not None:
                row_ntok[i * L : (i + 1) * L] = b[8]
        cols = {
            "request_id": np.repeat(rid, L),
            "iteration": np.repeat(it, L),
            "layer": np.tile(np.arange(L, dtype=np.int16), n),
            "num_tokens": row_ntok,
            "expert_counts": _fixed_list(counts, E, pa.int32()),
        }
        for name, idx in (("probs", 5), ("spec_probs", 6)):
            block = np.zeros((n, L, E), dtype=np.float16)
            valid = np.zeros((n, L), dtype=bool)
            for i, b in enumerate(self._buf):
                if b[idx] is not None:
                    arr = np.asarray(b[idx], dtype=np.float64).reshape(L, E)
                    ok = ~np.isnan(arr).all(axis=1)
                    if b[8] is not None:  # a layer that sees no token has null rows
                        ok &= b[8] > 0
                    block[i][ok] = arr[ok]
                    valid[i] = ok
            cols[name] = _fixed_list(block.reshape(n * L, E), E, pa.float16(), valid.reshape(-1))
        self._routing.write_table(pa.table(cols, schema=self._routing.schema))
        self._flush_tokens()
        self._num_iterations += n
        self._buf.clear()

    def _flush_tokens(self) -> None:
        with_tokens = [b for b in self._buf if b[7] is not None]
        if not with_tokens:
            return
        L, k = self._L, self.manifest.model.top_k
        if self._tokens is None:
            self._tokens = pq.ParquetWriter(
                self._tmp / S.TOKENS, S.tokens_schema(k), compression=S.COMPRESSION
            )
        rid, it, tok, lay, ids, wts = [], [], [], [], [], []
        for b in with_tokens:
            n = b[2]
            rid.append(np.full(n * L, b[0], dtype=np.int64))
            it.append(np.full(n * L, b[1], dtype=np.int32))
            tok.append(np.repeat(np.arange(n, dtype=np.int32), L))
            lay.append(np.tile(np.arange(L, dtype=np.int16), n))
            ids.append(b[7][0].reshape(n * L, k))
            wts.append(b[7][1].reshape(n * L, k))
        id_block = np.concatenate(ids).astype(np.int16)
        wt_block = np.concatenate(wts).astype(np.float16)
        logged = ~(id_block == -1).all(axis=1)  # a pair the log lacks: a null row
        id_block[~logged], wt_block[~logged] = 0, 0.0
        cols = {
            "request_id": np.concatenate(rid),
            "iteration": np.concatenate(it),
            "token": np.concatenate(tok),
            "layer": np.concatenate(lay),
            "topk_ids": _fixed_list(id_block, k, pa.int16(), logged),
            "topk_weights": _fixed_list(wt_block, k, pa.float16(), logged),
        }
        self._tokens.write_table(pa.table(cols, schema=self._tokens.schema))

    def _write_requests(self) -> None:
        rows = sorted(self._requests)
        table = pa.table(
            {
                "request_id": pa.array([r[0] for r in rows], pa.int64()),
                "prompt_tokens": pa.array([r[1] for r in rows], pa.int32()),
                "output_tokens": pa.array([r[2] for r in rows], pa.int32()),
                "arrival_s": pa.array([r[3] for r in rows], pa.float64()),
                "dataset": pa.array([r[4] for r in rows], pa.string()),
            },
            schema=S.requests_schema(),
        )
        pq.write_table(table, self._tmp / S.REQUESTS, compression=S.COMPRESSION)

    def _check_written(self) -> None:
        """Read the temporary trace as a reader would; a broken rule names the file at
        its destination."""
        from fmoesim.trace.reader import read_tokens, read_trace

        try:
            trace = read_trace(self._tmp)
            if trace.manifest.has_tokens:
                read_tokens(trace)
        except TraceError as exc:
            where = self.path / Path(exc.path).name
            raise TraceError(where, exc.rule, row=exc.row, detail=exc.detail) from None

    def _move_into_place(self) -> None:
        check_destination(self.path, self._overwrite)  # again: it may have changed meanwhile
        if self.path.exists():
            trash = Path(tempfile.mkdtemp(prefix=f".{self.path.name}.old-", dir=self.path.parent))
            os.replace(self.path, trash / "old")
            os.replace(self._tmp, self.path)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(self._tmp, self.path)
