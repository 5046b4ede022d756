"""The trace format: writer/reader round trip, streaming, atomicity and every validation rule."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fmoesim.errors import FmoesimError, TraceError
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter, read_trace
from fmoesim.trace import schema as S
from tests._trace_helpers import (
    COUNTS,
    DOUBLE_ROUNDING,
    ITERATIONS,
    REQUESTS,
    D,
    E,
    K,
    L,
    N,
    build_trace,
    edit_manifest,
    manifest,
    rewrite_rows,
    rewrite_table,
)


@pytest.fixture
def trace_dir(tmp_path: Path) -> Path:
    """A valid hand-built trace (see _trace_helpers) in a fresh directory."""
    path = tmp_path / "tiny"
    build_trace(path)
    return path


# -- round trip ------------------------------------------------------------------------
def test_a_null_embedding_reads_as_zeros(trace_dir: Path) -> None:
    """``iterations.embedding`` is nullable (traces/README.md): a null row reads as
    zeros, the other rows as written.  Red if the null row came back as another row's
    values or as the buffer's leftovers, or if the read refused it."""
    want = read_trace(trace_dir).embedding.copy()  # (N, D)

    def null_second(rows: list[dict]) -> None:
        rows[1]["embedding"] = None

    rewrite_rows(trace_dir / S.ITERATIONS, null_second)
    got = read_trace(trace_dir).embedding
    assert np.all(want[1] != 0)  # the planted null replaces a row of non-zeros
    np.testing.assert_array_equal(got[1], np.zeros(D, np.float16))
    np.testing.assert_array_equal(np.delete(got, 1, axis=0), np.delete(want, 1, axis=0))


def test_round_trip_values(tmp_path: Path) -> None:
    path = tmp_path / "tiny"
    inp = build_trace(path)
    tr = read_trace(path)

    assert sorted(p.name for p in path.iterdir()) == sorted(
        [S.MANIFEST, S.REQUESTS, S.ITERATIONS, S.ROUTING]
    )
    assert (tr.num_layers, tr.num_experts, tr.top_k) == (L, E, K)
    assert tr.manifest.num_requests == 2
    assert tr.manifest.num_iterations == 5

    # requests
    assert tr.request_id.tolist() == [0, 1]
    assert tr.prompt_tokens.tolist() == [3, 2]
    assert tr.output_tokens.tolist() == [3, 2]
    assert tr.arrival_s[0] == 0.5
    assert math.isnan(tr.arrival_s[1])  # null -> NaN
    assert tr.dataset.tolist() == ["alpaca", None]

    # iterations and their indexing
    assert tr.iteration.tolist() == [0, 1, 2, 0, 1]
    assert tr.num_tokens.tolist() == [3, 1, 1, 2, 1]
    assert tr.iter_start.tolist() == [0, 3, 5]
    assert tr.iter_request.tolist() == [0, 0, 0, 1, 1]
    assert list(tr.request_iterations(1)) == [3, 4]

    # routing
    assert tr.counts.shape == (N, L, E)
    np.testing.assert_array_equal(tr.counts, COUNTS)
    assert tr.probs is not None and tr.probs.dtype == np.float16
    np.testing.assert_array_equal(tr.probs, np.float16(inp["probs"]))
    # the double-rounding probe is stored as its nearest float16 (0.25 + 2**-12), not 0.25
    assert tr.probs[1, 2, 0] == np.float16(DOUBLE_ROUNDING) == np.float16(0.25 + 2.0**-12)

    assert tr.spec_valid is not None and tr.spec_probs is not None
    expected_valid = np.ones((N, L), dtype=bool)
    expected_valid[0, 0] = expected_valid[3, 0] = False  # the NaN prefill layer-0 rows
    np.testing.assert_array_equal(tr.spec_valid, expected_valid)
    assert tr.spec_probs.dtype == np.float16
    np.testing.assert_array_equal(
        tr.spec_probs[expected_valid], np.float16(inp["spec_probs"][expected_valid])
    )
    np.testing.assert_array_equal(tr.spec_probs[~expected_valid], 0)  # zeros where null

    assert tr.embedding.dtype == np.float16
    assert tr.embedding.shape == (N, D)
    np.testing.assert_array_equal(tr.embedding, np.float16(inp["embedding"]))


def test_round_trip_routing_rows_on_disk(trace_dir: Path) -> None:
    """The file itself: sorted (request, iteration, layer) rows, spec null in prefill layer 0."""
    t = pq.read_table(trace_dir / S.ROUTING)
    assert t.num_rows == N * L == 15
    assert t.column("layer").to_pylist() == [0, 1, 2] * 5
    assert t.column("iteration").to_pylist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 0, 0, 0, 1, 1, 1]
    spec_null = [i for i, v in enumerate(t.column("spec_probs").to_pylist()) if v is None]
    assert spec_null == [0, 9]
    assert t.schema.field("probs").type == pa.list_(pa.float16(), E)
    assert (
        pq.ParquetFile(trace_dir / S.ROUTING).metadata.row_group(0).column(0).compression == "ZSTD"
    )


def test_round_trip_topk_only_without_embeddings(tmp_path: Path) -> None:
    path = tmp_path / "topk"
    build_trace(path, with_probs=False, with_spec=False, embedding_dim=0)
    tr = read_trace(path)
    assert tr.probs is None
    assert tr.spec_probs is None and tr.spec_valid is None
    assert tr.embedding.shape == (N, 0)
    assert "embedding" not in pq.read_schema(path / S.ITERATIONS).names
    np.testing.assert_array_equal(tr.counts, COUNTS)
    assert tr.num_tokens.tolist() == [3, 1, 1, 2, 1]
    assert (tr.manifest.has_probs, tr.manifest.has_spec_probs) == (False, False)


def test_manifest_json_is_deterministic_and_loads_back(trace_dir: Path) -> None:
    text = (trace_dir / S.MANIFEST).read_text()
    raw = json.loads(text)
    assert list(raw) == sorted(raw)
    assert raw["schema_version"] == S.SCHEMA_VERSION
    loaded = TraceManifest.load(trace_dir / S.MANIFEST)
    assert loaded.to_json() == text
    assert loaded.model.num_experts == E


# -- streaming -------------------------------------------------------------------------
def test_streaming_row_groups(tmp_path: Path) -> None:
    path = tmp_path / "stream"
    build_trace(path, row_group_iterations=2)
    # 5 iterations flushed 2 at a time: groups of 2, 2 and 1 iterations
    routing = pq.ParquetFile(path / S.ROUTING)
    assert routing.num_row_groups == 3
    assert [routing.metadata.row_group(g).num_rows for g in range(3)] == [6, 6, 3]
    assert pq.ParquetFile(path / S.ITERATIONS).num_row_groups == 3

    build_trace(tmp_path / "whole")
    assert pq.ParquetFile(tmp_path / "whole" / S.ROUTING).num_row_groups == 1
    a, b = read_trace(path), read_trace(tmp_path / "whole")
    for name in (
        "request_id",
        "iteration",
        "num_tokens",
        "embedding",
        "counts",
        "probs",
        "spec_probs",
        "spec_valid",
        "iter_start",
    ):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)
    assert pq.read_table(path / S.ROUTING).equals(pq.read_table(tmp_path / "whole" / S.ROUTING))


# -- atomicity -------------------------------------------------------------------------
def _leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


def test_exception_inside_writer_leaves_nothing(tmp_path: Path) -> None:
    dest = tmp_path / "t"
    with pytest.raises(RuntimeError, match="boom"):
        with TraceWriter(dest, manifest(), row_group_iterations=1) as w:
            w.add_request(0, 3, 3)
            w.add_iteration(0, 0, 3, np.zeros(D), COUNTS[0])
            w.add_iteration(0, 1, 1, np.zeros(D), COUNTS[1])  # flushed: files are open
            raise RuntimeError("boom")
    assert not dest.exists()
    assert _leftovers(tmp_path, "t") == []


def test_writer_rejects_bad_input_and_cleans_up(tmp_path: Path) -> None:
    dest = tmp_path / "t"
    with pytest.raises(FmoesimError, match="sorted by"):
        with TraceWriter(dest, manifest()) as w:
            w.add_iteration(0, 1, 1, None, COUNTS[1])
            w.add_iteration(0, 0, 3, None, COUNTS[0])
    assert not dest.exists() and _leftovers(tmp_path, "t") == []
    with pytest.raises(FmoesimError, match=r"shape \(3, 5\)"):
        with TraceWriter(dest, manifest()) as w:
            w.add_iteration(0, 0, 3, None, np.zeros((L, E + 1)))
    assert not dest.exists() and _leftovers(tmp_path, "t") == []


def test_existing_destination_needs_overwrite(trace_dir: Path) -> None:
    before = (trace_dir / S.ROUTING).read_bytes()
    with pytest.raises(FmoesimError, match="already exists"):
        TraceWriter(trace_dir, manifest())
    assert (trace_dir / S.ROUTING).read_bytes() == before
    assert _leftovers(trace_dir.parent, trace_dir.name) == []

    build_trace(trace_dir, with_probs=False, with_spec=False, embedding_dim=0, overwrite=True)
    assert read_trace(trace_dir).probs is None
    assert _leftovers(trace_dir.parent, trace_dir.name) == []  # no .tmp-/.old- left


# -- validation: trace.json --------------------------------------------------------------
def _drop(key: str) -> Callable[[dict], None]:
    def edit(raw: dict) -> None:
        del raw[key]

    return edit


def _set(key: str, value: object) -> Callable[[dict], None]:
    return lambda raw: raw.__setitem__(key, value)


def _set_model(key: str, value: object) -> Callable[[dict], None]:
    return lambda raw: raw["model"].__setitem__(key, value)


MANIFEST_CASES = [
    # (id, edit of the parsed JSON, distinctive substring of the message)
    ("schema_version_2", _set("schema_version", 2), "rule: schema_version is 1"),
    ("schema_version_missing", _drop("schema_version"), "rule: schema_version is 1"),
    ("missing_model", _drop("model"), "rule: trace.json has key 'model'"),
    ("missing_embedding_dim", _drop("embedding_dim"), "rule: trace.json has key 'embedding_dim'"),
    ("missing_source", _drop("source"), "rule: trace.json has key 'source'"),
    ("missing_has_probs", _drop("has_probs"), "rule: trace.json has key 'has_probs'"),
    (
        "missing_has_spec_probs",
        _drop("has_spec_probs"),
        "rule: trace.json has key 'has_spec_probs'",
    ),
    ("unknown_key", _set("bogus", 1), "unknown key(s) ['bogus'] (rule: trace.json keys are among"),
    ("model_unknown_key", _set_model("experts", 4), "rule: model has keys name, num_layers"),
    (
        "model_missing_key",
        lambda raw: raw["model"].__delitem__("top_k"),
        "rule: model has keys name, num_layers",
    ),
    ("model_not_object", _set("model", [3, 4]), "rule: model has keys name, num_layers"),
    (
        "model_zero_layers",
        _set_model("num_layers", 0),
        "got 0 (rule: model.num_layers is an integer in [1, 2**31))",
    ),
    (
        "model_string_experts",
        _set_model("num_experts", "4"),
        "got '4' (rule: model.num_experts is an integer in [1, 2**31))",
    ),
    (
        "model_float_hidden",
        _set_model("hidden_size", 16.0),
        "rule: model.hidden_size is an integer in [1, 2**31)",
    ),
    # beyond the files' int32 (an OverflowError from pyarrow, a 2.5 PiB allocation)
    ("model_huge_layers", _set_model("num_layers", 2**40), "rule: model.num_layers is an integer"),
    ("model_huge_experts", _set_model("num_experts", 2**31), "model.num_experts is an integer"),
    ("huge_embedding_dim", _set("embedding_dim", 2**31), "rule: embedding_dim is an integer"),
    (
        "top_k_gt_experts",
        _set_model("top_k", 5),
        "top_k=5, num_experts=4 (rule: model.top_k <= model.num_experts)",
    ),
    (
        "negative_embedding_dim",
        _set("embedding_dim", -1),
        "rule: embedding_dim is an integer in [0, 2**31)",
    ),
    ("has_probs_string", _set("has_probs", "false"), "rule: has_probs is true or false"),
    ("source_string", _set("source", "synthetic"), "rule: source is a JSON object"),
]


@pytest.mark.parametrize(
    ("edit", "expected"), [c[1:] for c in MANIFEST_CASES], ids=[c[0] for c in MANIFEST_CASES]
)
def test_manifest_rules(trace_dir: Path, edit: Callable[[dict], None], expected: str) -> None:
    edit_manifest(trace_dir / S.MANIFEST, edit)
    with pytest.raises(TraceError) as info:
        read_trace(trace_dir)
    msg = str(info.value)
    assert msg.startswith(str(trace_dir / S.MANIFEST) + ": "), msg
    assert expected in msg
    assert info.value.row is None


def test_manifest_missing(trace_dir: Path) -> None:
    (trace_dir / S.MANIFEST).unlink()
    with pytest.raises(
        TraceError,
        match=r"trace\.json: file not found "
        r"\(rule: a trace directory holds trace\.json\)",
    ):
        read_trace(trace_dir)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("{not json", "rule: trace.json is valid JSON"),
        ("", "rule: trace.json is valid JSON"),
        ("[1, 2]", "rule: trace.json is a JSON object"),
        ("[" * 100_000 + "]" * 100_000, "rule: trace.json is valid JSON"),  # RecursionError
        ('{"embedding_dim": 0, "embedding_dim": 4}', "key 'embedding_dim' given twice (rule"),
    ],
    ids=["not-json", "empty", "array", "nested-too-deep", "key-twice"],
)
def test_manifest_not_json_object(trace_dir: Path, text: str, expected: str) -> None:
    (trace_dir / S.MANIFEST).write_text(text)
    with pytest.raises(TraceError) as info:
        read_trace(trace_dir)
    assert str(info.value).startswith(str(trace_dir / S.MANIFEST))
    assert expected in str(info.value)


def test_manifest_with_huge_layers_fails_on_the_row_count(trace_dir: Path) -> None:
    """Red if the expected (request, iteration, layer) sequence is built for every
    iteration x 2**30 layers (terabytes) before the row count is found wrong."""
    edit_manifest(trace_dir / S.MANIFEST, _set_model("num_layers", 2**30))
    with pytest.raises(TraceError, match=r"routing\.parquet row \d+: .* one row per"):
        read_trace(trace_dir)


def test_trace_directory_missing(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="directory not found"):
        read_trace(tmp_path / "nope")


# -- validation: files and columns -------------------------------------------------------
def _truncate(path: Path) -> None:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _widen_counts(t: pa.Table) -> pa.Table:
    """expert_counts as 5-wide lists while trace.json says num_experts = 4."""
    rows = [c + [0] for c in t.column("expert_counts").to_pylist()]
    col = pa.array(rows, type=pa.list_(pa.int32(), E + 1))
    return t.set_column(t.schema.get_field_index("expert_counts"), "expert_counts", col)


def _retype(name: str, typ: pa.DataType) -> Callable[[pa.Table], pa.Table]:
    def edit(t: pa.Table) -> pa.Table:
        i = t.schema.get_field_index(name)
        return t.set_column(i, name, t.column(name).cast(typ))

    return edit


FILE_CASES = [
    # (id, file, corruption of that file, expected substrings)
    (
        "iterations_missing",
        S.ITERATIONS,
        lambda p: p.unlink(),
        ["file not found", "rule: the trace directory holds this file"],
    ),
    ("requests_missing", S.REQUESTS, lambda p: p.unlink(), ["file not found"]),
    ("routing_truncated", S.ROUTING, _truncate, ["rule: a readable Parquet file"]),
    ("requests_truncated", S.REQUESTS, _truncate, ["rule: a readable Parquet file"]),
    (
        "routing_column_missing",
        S.ROUTING,
        lambda p: rewrite_table(p, lambda t: t.drop_columns(["num_tokens"])),
        ["column missing", "rule: has column 'num_tokens' of type int32"],
    ),
    (
        "iterations_embedding_missing",
        S.ITERATIONS,
        lambda p: rewrite_table(p, lambda t: t.drop_columns(["embedding"])),
        ["rule: has column 'embedding'"],
    ),
    (
        "routing_list_width",
        S.ROUTING,
        lambda p: rewrite_table(p, _widen_counts),
        [
            "int32>[5] (rule: column 'expert_counts' has type fixed_size_list<item: int32>[4] "
            "(shape from trace.json)"
        ],
    ),
    (
        "requests_column_type",
        S.REQUESTS,
        lambda p: rewrite_table(p, _retype("prompt_tokens", pa.int64())),
        ["rule: column 'prompt_tokens' has type int32"],
    ),
]


@pytest.mark.parametrize(
    ("fname", "corrupt", "expected"), [c[1:] for c in FILE_CASES], ids=[c[0] for c in FILE_CASES]
)
def test_file_rules(
    trace_dir: Path, fname: str, corrupt: Callable[[Path], None], expected: list[str]
) -> None:
    corrupt(trace_dir / fname)
    with pytest.raises(TraceError) as info:
        read_trace(trace_dir)
    msg = str(info.value)
    assert msg.startswith(str(trace_dir / fname) + ": "), msg  # names the file, no row
    for part in expected:
        assert part in msg, msg


@pytest.mark.parametrize(
    ("edit", "fname", "row", "expected"),
    [
        # trace.json says 4 -> 5 experts: the Parquet list width disagrees
        (
            _set_model("num_experts", 5),
            S.ROUTING,
            None,
            "rule: column 'expert_counts' has type fixed_size_list<item: int32>[5]",
        ),
        # trace.json says 5 -> 6 embedding values
        (
            _set("embedding_dim", 6),
            S.ITERATIONS,
            None,
            "rule: column 'embedding' has type fixed_size_list<item: halffloat>[6]",
        ),
        # trace.json says 2 layers: routing rows go 0, 1, 2 but 0, 1, 0 was expected at row 2
        (
            _set_model("num_layers", 2),
            S.ROUTING,
            2,
            "15 rows for 5 iterations x 2 layers = 10 (rule: one row per (request, iteration, "
            "layer) for all 2 layers)",
        ),
    ],
    ids=["num_experts", "embedding_dim", "num_layers"],
)
def test_manifest_shape_disagrees_with_files(
    trace_dir: Path, edit: Callable[[dict], None], fname: str, row: int | None, expected: str
) -> None:
    edit_manifest(trace_dir / S.MANIFEST, edit)
    with pytest.raises(TraceError) as info:
        read_trace(trace_dir)
    where = str(trace_dir / fname) + ("" if row is None else f" row {row}")
    assert str(info.value).startswith(where + ": "), str(info.value)
    assert expected in str(info.value)
    assert info.value.row == row


# -- validation: row rules -----------------------------------------------------------------
def _set_cell(row: int, col: str, value: object) -> Callable[[list], None]:
    return lambda rows: rows[row].__setitem__(col, value)


def _swap(a: int, b: int) -> Callable[[list], None]:
    def edit(rows: list) -> None:
        rows[a], rows[b] = rows[b], rows[a]

    return edit


def _delete(row: int) -> Callable[[list], None]:
    def edit(rows: list) -> None:
        del rows[row]

    return edit


def _duplicate(row: int) -> Callable[[list], None]:
    return lambda rows: rows.insert(row + 1, dict(rows[row]))


def _set_all(col: str, value: object) -> Callable[[list], None]:
    def edit(rows: list) -> None:
        for r in rows:
            r[col] = value

    return edit


def _unknown_request(rows: list) -> None:
    # iterations rows 3 and 4 belong to request 1; make them request 7 (still sorted)
    rows[3]["request_id"] = rows[4]["request_id"] = 7


def _set_list_item(row: int, col: str, j: int, value: float) -> Callable[[list], None]:
    def edit(rows: list) -> None:
        rows[row][col] = list(rows[row][col])
        rows[row][col][j] = value

    return edit


ROW_CASES = [
    # (id, file, edit of its rows, expected row, distinctive rule text)
    # requests.parquet: rows 0 (request 0) and 1 (request 1)
    (
        "request_duplicate",
        S.REQUESTS,
        _set_cell(1, "request_id", 0),
        1,
        "request_id 0 after 0 (rule: request_id strictly increasing (sorted, unique))",
    ),
    (
        "request_unsorted",
        S.REQUESTS,
        _swap(0, 1),
        1,
        "request_id 0 after 1 (rule: request_id strictly increasing",
    ),
    (
        "prompt_tokens_zero",
        S.REQUESTS,
        _set_cell(1, "prompt_tokens", 0),
        1,
        "prompt_tokens = 0 (rule: prompt_tokens >= 1)",
    ),
    (
        "output_tokens_zero",
        S.REQUESTS,
        _set_cell(0, "output_tokens", 0),
        0,
        "rule: output_tokens >= 1",
    ),
    (
        "arrival_negative",
        S.REQUESTS,
        _set_cell(0, "arrival_s", -1.0),
        0,
        "arrival_s = -1.0 (rule: arrival_s is null or a finite time >= 0)",
    ),
    (
        "arrival_infinite",
        S.REQUESTS,
        _set_cell(1, "arrival_s", math.inf),
        1,
        "rule: arrival_s is null or a finite time >= 0",
    ),
    (
        "output_tokens_vs_iterations",
        S.REQUESTS,
        _set_cell(1, "output_tokens", 3),
        1,
        "request 1 has output_tokens=3 but 2 iterations in iterations.parquet (rule: a request "
        "has output_tokens iterations",
    ),
    (
        "request_null_prompt",
        S.REQUESTS,
        _set_cell(1, "prompt_tokens", None),
        1,
        "rule: column 'prompt_tokens' has no nulls",
    ),
    # iterations.parquet: rows 0-2 request 0 iterations 0-2, rows 3-4 request 1 iterations 0-1
    (
        "iterations_unsorted",
        S.ITERATIONS,
        _swap(1, 2),
        2,
        "(0, 1) after (0, 2) (rule: rows sorted by (request_id, iteration), no duplicates)",
    ),
    (
        "iterations_duplicate",
        S.ITERATIONS,
        _set_cell(2, "iteration", 1),
        2,
        "rule: rows sorted by (request_id, iteration), no duplicates",
    ),
    (
        "iterations_unknown_request",
        S.ITERATIONS,
        _unknown_request,
        3,
        "request_id 7 unknown (rule: request_id appears in requests.parquet)",
    ),
    (
        "iterations_gap",
        S.ITERATIONS,
        _delete(1),
        1,
        "request 0 has iteration 2 where 1 was expected (rule: iterations of a request are "
        "0, 1, 2, ... with none missing)",
    ),
    (
        "prefill_num_tokens",
        S.ITERATIONS,
        _set_cell(3, "num_tokens", 4),
        3,
        "num_tokens = 4 (rule: the prefill iteration has num_tokens == prompt_tokens)",
    ),
    (
        "decode_num_tokens_zero",
        S.ITERATIONS,
        _set_cell(4, "num_tokens", 0),
        4,
        "num_tokens = 0 (rule: num_tokens >= 1)",
    ),
    (
        "embedding_infinite",
        S.ITERATIONS,
        _set_list_item(2, "embedding", 3, math.inf),
        2,
        "rule: embedding values are finite",
    ),
    (
        "iterations_null_num_tokens",
        S.ITERATIONS,
        _set_cell(4, "num_tokens", None),
        4,
        "rule: column 'num_tokens' has no nulls",
    ),
    # routing.parquet: row 3 * i + layer (i = iteration index 0-4, layer 0-2)
    (
        "routing_missing_layer",
        S.ROUTING,
        _delete(7),
        7,
        "14 rows for 5 iterations x 3 layers = 15 (rule: one row per (request, iteration, layer) "
        "for all 3 layers)",
    ),
    (
        "routing_empty",
        S.ROUTING,
        lambda rows: rows.clear(),
        None,  # an empty file has no row to name
        "0 rows for 5 iterations x 3 layers = 15 (rule: one row per (request, iteration, layer)",
    ),
    (
        "routing_extra_layer",
        S.ROUTING,
        _duplicate(7),
        8,
        "rule: one row per (request, iteration, layer) for all 3 layers",
    ),
    (
        "routing_layers_swapped",
        S.ROUTING,
        _swap(7, 8),
        7,
        "found (0, 2, layer 2), expected (0, 2, layer 1) (rule: rows sorted by (request_id, "
        "iteration, layer) with no missing layer or iteration)",
    ),
    (
        "routing_wrong_iteration",
        S.ROUTING,
        _set_cell(13, "iteration", 2),
        13,
        "found (1, 2, layer 1), expected (1, 1, layer 1) (rule: rows sorted by",
    ),
    (
        "routing_num_tokens",
        S.ROUTING,
        _set_cell(10, "num_tokens", 3),
        10,
        "3 != 2 (rule: num_tokens equals the iteration's num_tokens)",
    ),
    (
        "counts_negative",
        S.ROUTING,
        _set_cell(4, "expert_counts", [-1, 2, 1, 0]),
        4,
        "expert 0: -1 (rule: expert_counts are non-negative)",
    ),
    (
        "counts_sum",
        S.ROUTING,
        _set_cell(13, "expert_counts", [1, 0, 0, 0]),
        13,
        "sum 1 != 1 * 2 (rule: expert_counts sum to num_tokens * top_k (top_k = 2))",
    ),
    (
        "counts_exceed_tokens",
        S.ROUTING,
        _set_cell(5, "expert_counts", [2, 0, 0, 0]),
        5,
        "rule: no expert gets more tokens than the iteration has",
    ),
    (
        "counts_null",
        S.ROUTING,
        _set_cell(2, "expert_counts", None),
        2,
        "rule: column 'expert_counts' has no nulls",
    ),
    (
        "probs_nan",
        S.ROUTING,
        _set_list_item(7, "probs", 1, math.nan),
        7,
        "rule: probs are finite (no NaN/inf)",
    ),
    (
        "probs_negative",
        S.ROUTING,
        _set_cell(9, "probs", [-0.125, 0.5, 0.375, 0.25]),
        9,
        "min -0.125 (rule: probs are non-negative)",
    ),
    (
        "probs_sum",
        S.ROUTING,
        _set_cell(11, "probs", [0.5, 0.25, 0.125, 0.0625]),
        11,
        "probs sum to 0.9375 (rule: probs sum to 1 within 0.01)",
    ),
    (
        "probs_null_with_has_probs",
        S.ROUTING,
        _set_cell(6, "probs", None),
        6,
        "probs is null (rule: probs present on every row (trace.json says has_probs)",
    ),
    (
        "spec_probs_nan",
        S.ROUTING,
        _set_list_item(8, "spec_probs", 0, math.nan),
        8,
        "rule: spec_probs are finite (no NaN/inf)",
    ),
    (
        "spec_probs_sum",
        S.ROUTING,
        _set_cell(14, "spec_probs", [0.5, 0.5, 0.5, 0.5]),
        14,
        "spec_probs sum to 2.0000 (rule: spec_probs sum to 1 within 0.01)",
    ),
    (
        "spec_probs_all_null",
        S.ROUTING,
        _set_all("spec_probs", None),
        None,
        "spec_probs is null on every row (rule: spec_probs present (trace.json says "
        "has_spec_probs))",
    ),
]


@pytest.mark.parametrize(
    ("fname", "edit", "row", "expected"), [c[1:] for c in ROW_CASES], ids=[c[0] for c in ROW_CASES]
)
def test_row_rules(
    trace_dir: Path, fname: str, edit: Callable[[list], None], row: int | None, expected: str
) -> None:
    # the untouched trace is valid: each case breaks exactly one rule
    read_trace(trace_dir)
    rewrite_rows(trace_dir / fname, edit)
    with pytest.raises(TraceError) as info:
        read_trace(trace_dir)
    msg = str(info.value)
    where = str(trace_dir / fname) + ("" if row is None else f" row {row}")
    assert msg.startswith(where + ": "), msg
    assert expected in msg, msg
    assert info.value.row == row


def test_rewrite_without_change_stays_valid(trace_dir: Path) -> None:
    """The surgery helpers alone (nullable schema, re-encoding) break no rule."""
    for name in (S.REQUESTS, S.ITERATIONS, S.ROUTING):
        rewrite_rows(trace_dir / name, lambda rows: None)
    tr = read_trace(trace_dir)
    np.testing.assert_array_equal(tr.counts, COUNTS)


def test_validate_false_skips_row_rules(trace_dir: Path) -> None:
    rewrite_rows(trace_dir / S.ROUTING, _set_cell(13, "expert_counts", [1, 0, 0, 0]))
    tr = read_trace(trace_dir, validate=False)
    assert tr.counts[4, 1].tolist() == [1, 0, 0, 0]


def test_empty_tables_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    build_trace(path)
    rewrite_rows(path / S.REQUESTS, lambda rows: [])
    with pytest.raises(
        TraceError,
        match=r"requests\.parquet: no rows \(rule: a trace has at "
        r"least one request\)",
    ):
        read_trace(path)
    shutil.rmtree(path)
    build_trace(path)
    rewrite_rows(path / S.ITERATIONS, lambda rows: [])
    with pytest.raises(TraceError, match=r"iterations\.parquet: no rows"):
        read_trace(path)


def test_requests_and_iterations_in_hand_built_trace_match_constants(trace_dir: Path) -> None:
    """Guards the row numbers the rule tests were computed from."""
    req = pq.read_table(trace_dir / S.REQUESTS).to_pylist()
    assert [(r["request_id"], r["prompt_tokens"], r["output_tokens"]) for r in req] == [
        (r[0], r[1], r[2]) for r in REQUESTS
    ]
    its = pq.read_table(trace_dir / S.ITERATIONS).to_pylist()
    assert [(r["request_id"], r["iteration"], r["num_tokens"]) for r in its] == ITERATIONS
    rout = pq.read_table(trace_dir / S.ROUTING).to_pylist()
    assert (rout[7]["request_id"], rout[7]["iteration"], rout[7]["layer"]) == (0, 2, 1)
    assert (rout[10]["request_id"], rout[10]["iteration"], rout[10]["layer"]) == (1, 0, 1)
    assert rout[13]["expert_counts"] == [1, 1, 0, 0]


def test_writer_refuses_probs_of_the_wrong_shape(tmp_path):
    man = TraceManifest(
        model=TraceModel("m", 2, 3, 1, 8),
        embedding_dim=0,
        source={"kind": "synthetic"},
        has_probs=True,
        has_spec_probs=False,
    )
    dest = tmp_path / "t"
    with pytest.raises(FmoesimError, match=r"probs of request 0 iteration 0 has shape \(2, 4\)"):
        with TraceWriter(dest, man) as w:
            w.add_request(0, 1, 1)
            counts = np.array([[1, 0, 0], [0, 1, 0]], np.int32)
            w.add_iteration(0, 0, 1, None, counts, np.full((2, 4), 0.25))
    assert not dest.exists()
