"""The trace format: file names, Parquet schemas and the manifest.

A trace is a directory (see ``traces/README.md`` for the full description):

- ``trace.json``        manifest (:class:`TraceManifest`)
- ``requests.parquet``  one row per request
- ``iterations.parquet`` one row per (request, iteration); iteration 0 is the prefill
- ``routing.parquet``   one row per (request, iteration, MoE layer)
- ``tokens.parquet``    optional, one row per (request, iteration, token, layer)

Every file is sorted by its key columns.  Probabilities are float16 fixed-size lists;
token counts int32 fixed-size lists; zstd compression.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from fmoesim.errors import FmoesimError, TraceError

SCHEMA_VERSION = 1
MANIFEST = "trace.json"
REQUESTS = "requests.parquet"
ITERATIONS = "iterations.parquet"
ROUTING = "routing.parquet"
TOKENS = "tokens.parquet"

#: Tolerance on sum(probs) == 1 (float16 storage rounds each entry to ~1e-3 relative).
PROB_SUM_TOL = 1e-2
COMPRESSION = "zstd"


def requests_schema() -> pa.Schema:
    """Schema of ``requests.parquet``."""
    return pa.schema(
        [
            pa.field("request_id", pa.int64(), nullable=False),
            pa.field("prompt_tokens", pa.int32(), nullable=False),
            pa.field("output_tokens", pa.int32(), nullable=False),
            pa.field("arrival_s", pa.float64(), nullable=True),
            pa.field("dataset", pa.string(), nullable=True),
        ]
    )


def iterations_schema(embedding_dim: int) -> pa.Schema:
    """Schema of ``iterations.parquet`` for embeddings of ``embedding_dim`` values.

    A trace without embeddings (``embedding_dim == 0``, e.g. imported top-k logs) has no
    ``embedding`` column.
    """
    fields = [
        pa.field("request_id", pa.int64(), nullable=False),
        pa.field("iteration", pa.int32(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
    ]
    if embedding_dim > 0:
        fields.append(pa.field("embedding", pa.list_(pa.float16(), embedding_dim), nullable=True))
    return pa.schema(fields)


def routing_schema(num_experts: int) -> pa.Schema:
    """Schema of ``routing.parquet`` for ``num_experts`` routed experts per layer."""
    return pa.schema(
        [
            pa.field("request_id", pa.int64(), nullable=False),
            pa.field("iteration", pa.int32(), nullable=False),
            pa.field("layer", pa.int16(), nullable=False),
            pa.field("num_tokens", pa.int32(), nullable=False),
            pa.field("expert_counts", pa.list_(pa.int32(), num_experts), nullable=False),
            pa.field("probs", pa.list_(pa.float16(), num_experts), nullable=True),
            pa.field("spec_probs", pa.list_(pa.float16(), num_experts), nullable=True),
        ]
    )


def tokens_schema(top_k: int) -> pa.Schema:
    """Schema of the optional ``tokens.parquet`` (per token and layer: top-k ids, weights).

    ``topk_ids`` and ``topk_weights`` are null together on the row of a (token, layer)
    pair the log lacks, in a trace with ``layer_gaps`` (that token routes nothing there)."""
    return pa.schema(
        [
            pa.field("request_id", pa.int64(), nullable=False),
            pa.field("iteration", pa.int32(), nullable=False),
            pa.field("token", pa.int32(), nullable=False),
            pa.field("layer", pa.int16(), nullable=False),
            pa.field("topk_ids", pa.list_(pa.int16(), top_k), nullable=True),
            pa.field("topk_weights", pa.list_(pa.float16(), top_k), nullable=True),
        ]
    )


#: the largest token count a trace holds (its token columns are int32)
MAX_TOKENS = 2**31 - 1


def check_prompt_tokens(prompt_tokens: int | None) -> None:
    """A prompt length given on the command line (``--prompt-tokens``): None, or >= 1."""
    if prompt_tokens is not None and prompt_tokens < 1:
        raise FmoesimError(f"--prompt-tokens must be >= 1, got {prompt_tokens}")


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object whose keys are each given once (json keeps the last silently)."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ValueError(f"key {k!r} given twice")
        out[k] = v
    return out


def is_json_int(v: Any) -> bool:
    """An integer of a JSON file (true and false are not)."""
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass
class TraceModel:
    """The model shape recorded in a manifest (MoE layers only).

    ``encoder_layers`` (encoder-decoder models): the first ``encoder_layers`` of the
    ``num_layers`` MoE layers are the encoder's, in ``[0, num_layers)``; 0 for a
    decoder-only model.  It is written to ``trace.json`` only when non-zero.
    """

    name: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    num_shared_experts: int = 0
    dense_layers: int = 0
    encoder_layers: int = 0

    @classmethod
    def of(cls, model: Any) -> TraceModel:
        """The shape of a :class:`fmoesim.specs.ModelSpec` (any object with its fields)."""
        return cls(
            name=model.name,
            num_layers=model.num_layers,
            num_experts=model.num_experts,
            top_k=model.top_k,
            hidden_size=model.hidden_size,
            num_shared_experts=model.num_shared_experts,
            dense_layers=model.dense_layers,
            encoder_layers=getattr(model, "encoder_layers", 0),
        )

    @classmethod
    def decoder_only(cls, model: Any, what: str) -> TraceModel:
        """:meth:`of` a decoder-only model; refuses an encoder-decoder one (one line
        naming ``what``, which writes only decoder-only traces)."""
        if getattr(model, "encoder_layers", 0):
            raise FmoesimError(
                f"{what}: model {model.name!r} is an encoder-decoder model "
                f"(encoder_layers = {model.encoder_layers}); {what} writes decoder-only traces"
            )
        return cls.of(model)


@dataclass
class TraceManifest:
    """Contents of ``trace.json``.

    ``source`` says where the trace came from: ``{"kind": "synthetic", "generator": ...,
    "params": {...}, "seed": ...}``, ``{"kind": "collector", "model_id": ..., "versions":
    {...}}`` or ``{"kind": "importer", "format": ..., "original": ...}``.
    ``created_at`` is the ISO-8601 UTC time of a collection, or null for synthetic and
    imported traces: those are a pure function of their parameters and seed or of the
    log they read, so the same input gives the same bytes.
    ``embedding_projection`` is null, or ``{"input_dim": D_in, "seed": s}`` when the
    embeddings were reduced by a seeded Gaussian random projection.
    ``layer_gaps`` (written only when true) says that some tokens have no routing at some
    layers (a logger that missed rows): an iteration's counts at a layer then sum to
    ``top_k`` times the tokens routed there, which may be fewer than its tokens, and
    those tokens access no expert at that layer.
    ``model.encoder_layers`` is written only when non-zero.
    """

    model: TraceModel
    embedding_dim: int
    source: dict[str, Any]
    has_probs: bool
    has_spec_probs: bool
    has_tokens: bool = False
    num_requests: int = 0
    num_iterations: int = 0
    created_at: str | None = None
    embedding_projection: dict[str, Any] | None = None
    schema_version: int = SCHEMA_VERSION
    notes: str = ""
    layer_gaps: bool = False

    def to_json(self) -> str:
        """Serialise deterministically (sorted keys, fixed indentation); ``layer_gaps``
        only when true and ``model.encoder_layers`` only when non-zero, so traces without
        gaps and decoder-only traces keep their bytes."""
        raw = asdict(self)
        if not raw["layer_gaps"]:
            del raw["layer_gaps"]
        if not raw["model"]["encoder_layers"]:
            del raw["model"]["encoder_layers"]
        return json.dumps(raw, indent=2, sort_keys=True) + "\n"

    @classmethod
    def load(cls, path: Path) -> TraceManifest:
        """Read and check ``trace.json``; raise :class:`TraceError` naming the broken rule."""
        if not path.is_file():
            raise TraceError(path, "a trace directory holds trace.json", detail="file not found")
        try:
            raw = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise TraceError(
                path, "trace.json is valid JSON", detail=str(exc).splitlines()[0]
            ) from None
        if not isinstance(raw, dict):
            raise TraceError(path, "trace.json is a JSON object")
        version = raw.get("schema_version")
        if not is_json_int(version) or version != SCHEMA_VERSION:
            raise TraceError(
                path, f"schema_version is {SCHEMA_VERSION}", detail=f"schema_version is {version!r}"
            )
        required = ("model", "embedding_dim", "source", "has_probs", "has_spec_probs")
        for key in required:
            if key not in raw:
                raise TraceError(path, f"trace.json has key '{key}'", detail="key missing")
        model_raw = raw["model"]
        try:
            model = TraceModel(**model_raw)
        except TypeError as exc:
            raise TraceError(
                path,
                "model has keys name, num_layers, num_experts, top_k, "
                "hidden_size[, num_shared_experts, dense_layers, encoder_layers]",
                detail=str(exc),
            ) from None
        if not isinstance(model.name, str):
            raise TraceError(path, "model.name is a string", detail=f"got {model.name!r}")
        for key in ("num_layers", "num_experts", "top_k", "hidden_size"):
            value = getattr(model, key)
            if not is_json_int(value) or not 0 < value <= MAX_TOKENS:  # the files' int32
                raise TraceError(
                    path, f"model.{key} is an integer in [1, 2**31)", detail=f"got {value!r}"
                )
        for key in ("num_shared_experts", "dense_layers"):
            value = getattr(model, key)
            if not is_json_int(value) or value < 0:
                raise TraceError(
                    path, f"model.{key} is a non-negative integer", detail=f"got {value!r}"
                )
        enc = model.encoder_layers
        if not is_json_int(enc) or not 0 <= enc < model.num_layers:
            raise TraceError(
                path,
                "model.encoder_layers is an integer in [0, model.num_layers)",
                detail=f"encoder_layers={enc!r}, num_layers={model.num_layers}",
            )
        if model.top_k > model.num_experts:
            raise TraceError(
                path,
                "model.top_k <= model.num_experts",
                detail=f"top_k={model.top_k}, num_experts={model.num_experts}",
            )
        if not is_json_int(raw["embedding_dim"]) or not 0 <= raw["embedding_dim"] <= MAX_TOKENS:
            raise TraceError(
                path,
                "embedding_dim is an integer in [0, 2**31)",
                detail=f"got {raw['embedding_dim']!r}",
            )
        for key in ("has_probs", "has_spec_probs", "has_tokens", "layer_gaps"):
            if key in raw and not isinstance(raw[key], bool):
                raise TraceError(path, f"{key} is true or false", detail=f"got {raw[key]!r}")
        if not isinstance(raw["source"], dict):
            raise TraceError(path, "source is a JSON object", detail=f"got {raw['source']!r}")
        for key in ("num_requests", "num_iterations"):
            if key in raw and (not is_json_int(raw[key]) or raw[key] < 0):
                raise TraceError(
                    path, f"{key} is a non-negative integer", detail=f"got {raw[key]!r}"
                )
        proj = raw.get("embedding_projection")
        if proj is not None and not (
            isinstance(proj, dict)
            and set(proj) == {"input_dim", "seed"}
            and is_json_int(proj["input_dim"])
            and proj["input_dim"] > 0
            and is_json_int(proj["seed"])
            and proj["seed"] >= 0
        ):
            raise TraceError(
                path,
                'embedding_projection is null or {"input_dim": a positive integer, '
                '"seed": an integer >= 0}',
                detail=f"got {proj!r}",
            )
        for key, kinds, what in (
            ("created_at", (str, type(None)), "null or a string"),
            ("notes", (str,), "a string"),
        ):
            if key in raw and not isinstance(raw[key], kinds):
                raise TraceError(path, f"{key} is {what}", detail=f"got {raw[key]!r}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise TraceError(
                path,
                f"trace.json keys are among {sorted(known)}",
                detail=f"unknown key(s) {unknown}",
            )
        raw = dict(raw)
        raw["model"] = model
        return cls(**raw)
