"""Bad inputs to the trace tools (``fmoesim-trace import``, ``validate``, ``synth`` and
the Python importers): each is refused with one line naming the file, the row or line
(or the array index) and the rule, exit status 2 on the command line, and nothing is
written; ``--force`` replaces only a trace directory."""

from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fmoesim.cli.trace_cli import main
from fmoesim.errors import FmoesimError, TraceError
from fmoesim.trace import read_trace
from fmoesim.trace import schema as S
from fmoesim.trace.importers import import_eamc
from fmoesim.trace.reader import validate_trace
from fmoesim.trace.table import from_arrays, import_routed_experts, import_table
from fmoesim.workload.synthetic import read_azure_csv
from tests._trace_helpers import edit_manifest
from tests.tiny import small_model

M = small_model(2, 4, 2)  # 2 layers x 4 experts, top-2
MIXTRAL_L, MIXTRAL_E = 32, 8  # the shape of --model mixtral-8x7b (top-2)
MIX = ("--model", "mixtral-8x7b")


def refused(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``fmoesim-trace argv``: exit status 2 and one line on stderr; returns it."""
    with pytest.raises(SystemExit) as info:
        main(list(argv))
    assert info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("fmoesim-trace: error: "), lines[0]
    return lines[0]


def assert_nothing_written(out: Path) -> None:
    """No trace at ``out`` and no temporary beside it."""
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def jsonl(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def route(layer: int, tok: int, experts: list[int], probs: list[float] | None = None) -> dict:
    """One vLLM-style route row (request 0)."""
    row: dict[str, object] = {"layer": layer, "token_idx": tok, "experts": experts}
    if probs is not None:
        row["gating_probs"] = probs
    return row


GOOD = [route(0, 0, [0, 1], [0.6, 0.4]), route(1, 0, [2, 3], [0.5, 0.5])]


# -- route tables: rows, lines, rules ----------------------------------------------------
#: (file name, text, expected fragment after the file name); the defect each one is for
BAD_TABLES = [
    # a line that is a JSON array, weights NaN or null (pandas TypeError tracebacks)
    ("r.jsonl", [*GOOD, "[1, 2, 3]"], " line 3: each line is a JSON object (got an array)"),
    ("r.jsonl", ['{"layer": 0, "token_idx": 0, "experts": [0, 1], "gating_probs": [NaN, 0.5]}'],
     " line 1: weights are finite numbers >= 0 (got nan)"),
    ("r.jsonl", [route(0, 0, [0, 1], [None, 0.5])],  # type: ignore[list-item]
     " line 1: weights are finite numbers >= 0 (got None)"),
    # a weight that is not a number (ValueError traceback)
    ("r.csv", "layer,expert,weight\n0,0,heavy\n0,1,0.5\n",
     " row 1: weights are finite numbers >= 0 (got 'heavy')"),
    ("r.csv", 'layer,experts,weights\n0,"[0, 1]","[""heavy"", 0.5]"\n',
     " row 1: weights are finite numbers >= 0 (got 'heavy')"),
    # a truncated line: its line number, not a byte offset
    ("r.jsonl", [*GOOD, '{"layer": 0, "token_idx"'],
     " line 3: each line is a JSON object (Expecting ':' delimiter at column 25)"),
    ("r.jsonl", [*GOOD, '{"layer": 0, "phase": "pre'],
     " line 3: each line is a JSON object (Unterminated string starting at column 23)"),
    # a llama.cpp-style header of another model's shape (it imported under --model)
    ("r.csv", '# model=x n_layer=2 n_expert=8 n_expert_used=2\nlayer,experts\n0,"[0, 1]"\n',
     " line 1: the header's n_expert is the model's experts, 4 (the log of another model?"),
    ("r.csv", '# n_expert_used=1\nlayer,experts\n0,"[0, 1]"\n',
     " line 1: the header's n_expert_used is the model's top_k, 2 (the log of another"),
    # a JSON line without a key, an empty cell: said so, not "an integer (got nan)"
    ("r.jsonl", [GOOD[0], '{"token_idx": 1, "experts": [0, 1]}'],
     " line 2: layer is given on every row (it is missing or empty)"),
    ("r.csv", 'layer,position,experts\n0,0,"[0, 1]"\n1,,"[2, 3]"\n',
     " row 2: position is given on every row (it is missing or empty)"),
    # a blank line still counts in the file's line numbers
    ("r.jsonl", [GOOD[0], "", route(5, 0, [0, 1])], " line 3: layer in [0, 2) (got 5)"),
    # rank out of range, an unknown phase, bad size comments
    ("r.csv", "layer,slot,expert\n0,0,0\n0,5,1\n", " row 2: rank in [0, 2) (top_k) (got 5)"),
    ("r.csv", "layer,expert,phase\n0,0,maybe\n0,1,maybe\n",
     " row 1: phase is a prefill value (0, p, prefill, prompt) or a decode value"),
    ("r.csv", '# layer=0 expert_bytes=-5\nlayer,experts\n0,"[0, 1]"\n',
     " line 1: expert_bytes in a comment is a positive integer (got '-5')"),
    ("r.csv", '# v1\n# layer=1 expert_bytes=abc\nlayer,experts\n0,"[0, 1]"\n',
     " line 2: expert_bytes in a comment is a positive integer (got 'abc')"),
    ("r.csv", '# layer=7 expert_bytes=64\nlayer,experts\n0,"[0, 1]"\n',
     " line 1: layer in a comment is in [0, 2) (got '7')"),
    ("r.csv", '# layer=0 expert_bytes=64\n# layer=0 expert_bytes=65\nlayer,experts\n0,"[0, 1]"\n',
     " line 2: one expert size per layer (layer 0: 65 after 64)"),
    # a size column of 0 on a layer's first row (a KeyError traceback)
    ("r.csv", 'layer,experts,size_bytes\n0,"[0, 1]",0\n',
     " row 1: expert_bytes > 0 (layer 0: got 0)"),
    ("r.csv", 'layer,experts,size_bytes\n0,"[0, 1]",64\n0,"[2, 3]",65\n',
     " row 2: one expert size per layer (layer 0: 65 after 64)"),
    # an empty request id became a request named "nan"
    ("r.csv", 'request_id,layer,experts\n0,0,"[0, 1]"\n0,1,"[2, 3]"\n,0,"[0, 1]"\n',
     " row 3: request_id is given on every row (it is empty)"),
    ("r.jsonl", [{"problem_id": None, "layer": 0, "experts": [0, 1]}],
     " line 1: problem_id is given on every row (it is empty)"),
    # top-k count and duplicates: the row that breaks the rule
    ("r.csv", 'layer,experts\n0,"[0, 1]"\n1,"[0, 1, 2]"\n', " row 2: every token has 2 distinct"),
    # one expert where top-2 are routed: its rule, not "weights holds one number per expert"
    ("r.csv", 'layer,experts,weights\n0,"[1]","[0.5, 0.5]"\n',
     " row 1: every token has 2 distinct"),
    ("r.csv", "layer,slot,expert\n0,0,1\n0,1,1\n", " row 2: every token has 2 distinct"),
    ("r.csv", "layer,slot,expert\n0,0,1\n0,1,2\n1,0,3\n", " row 3: every token has 2 distinct"),
    ("r.csv", "position,layer,expert,phase\n0,0,0,1\n0,0,1,1\n1,0,2,0\n1,0,3,0\n",
     " row 3: prefill tokens come before decode tokens"),
    # an empty file says so
    ("r.jsonl", "", ": a route table has at least one row (the file has none)"),
    ("r.jsonl", "\n\n", ": a route table has at least one row (the file has none)"),
    ("r.csv", "", ": a route table has at least one row (the file has none)"),
    ("r.csv", "layer,experts\n", ": a route table has at least one row (the file has none)"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("name", "text", "expected"), BAD_TABLES, ids=[e.strip()[:40] for _, _, e in BAD_TABLES]
)
def test_bad_route_tables_name_file_row_and_rule(
    tmp_path: Path, name: str, text: object, expected: str
) -> None:
    """Red if a JSON-array line or a NaN, null or text weight raises a traceback, a bad
    JSON line is named by a byte offset instead of its line, a bad rank, phase, size
    column or size comment is accepted (or a size of 0 raises a KeyError), an empty
    request id becomes a request named "nan", a top-k error names no row, or an empty
    file is reported as a missing layer column."""
    src = tmp_path / name
    if isinstance(text, list):
        jsonl(src, text)
    else:
        src.write_text(str(text))
    with pytest.raises(FmoesimError) as info:
        import_table(src, tmp_path / "t", M)
    msg = str(info.value)
    assert msg == str(src) + expected or msg.startswith(str(src) + expected), msg
    assert "\n" not in msg
    assert_nothing_written(tmp_path / "t")


def test_route_lines_through_the_command_line(tmp_path: Path, capsys) -> None:
    """Red if a JSON-array line or a NaN weight raises a TypeError traceback."""
    rows = [route(layer, 0, [0, 1], [0.6, 0.4]) for layer in range(MIXTRAL_L)]
    for bad, want in (
        ("[1, 2, 3]", "line 33: each line is a JSON object (got an array)"),
        ('{"layer": 0, "token_idx": 1, "experts": [0, 1], "gating_probs": [NaN, 0.5]}',
         "line 33: weights are finite numbers >= 0 (got nan)"),
    ):  # fmt: skip
        src = jsonl(tmp_path / "r.jsonl", [*rows, bad])
        line = refused(capsys, "import", "vllm-routes", str(src), str(tmp_path / "o"), *MIX)
        assert f"{src} {want}" in line
        assert_nothing_written(tmp_path / "o")


def test_a_directory_of_logs_names_the_bad_file_and_its_line(tmp_path: Path) -> None:
    """Red if the error names the folder and a running row count (``vdir row 7``) instead
    of the file and its own line."""
    d = tmp_path / "vdir"
    d.mkdir()
    jsonl(d / "a.jsonl", [*GOOD, route(0, 1, [1, 2], [1, 0]), route(1, 1, [0, 3], [1, 0])])
    jsonl(d / "b.jsonl", [GOOD[0], route(1, 0, [2, 9], [1, 0])])
    with pytest.raises(FmoesimError) as info:
        import_table(d, tmp_path / "t", M, fmt="vllm-routes")
    assert str(info.value).startswith(f"{d / 'b.jsonl'} line 2: expert ids in [0, 4)")
    assert_nothing_written(tmp_path / "t")


@pytest.mark.parametrize(
    ("mapping", "expected"),
    [
        ({"layer": "token_idx"}, "--map layer=token_idx takes the position column 'token_idx'"),
        ({"layer": "l", "position": "l"}, "--map position=l and --map layer=l"),
    ],
)
def test_one_column_per_key(tmp_path: Path, mapping: dict[str, str], expected: str) -> None:
    """Red if two keys read the same column and the import goes on."""
    src = jsonl(tmp_path / "r.jsonl", [{**GOOD[0], "l": 0}, {**GOOD[1], "l": 1}])
    with pytest.raises(FmoesimError) as info:
        import_table(src, tmp_path / "t", M, mapping=mapping)
    assert str(info.value).startswith(f"{src}: each key reads a column of its own")
    assert expected in str(info.value)
    assert_nothing_written(tmp_path / "t")


def test_a_key_mapped_to_no_column(tmp_path: Path) -> None:
    """``--map position=-``: a table whose position counter is the request's id (its
    usual name taken by another key) imports with no position column, where a column
    shared by two keys is refused (red if ``-`` is read as a column name, or ignored)."""
    src = tmp_path / "r.csv"
    src.write_text("step,layer,expert\n0,0,0\n0,0,1\n0,1,2\n0,1,3\n1,0,1\n1,0,2\n1,1,0\n1,1,3\n")
    with pytest.raises(FmoesimError, match=r"or --map position=- for none"):
        import_table(src, tmp_path / "t", M, mapping={"request": "step"})
    path, rep = import_table(src, tmp_path / "t", M, mapping={"request": "step", "position": "-"})
    assert "position" not in rep.columns and rep.columns["request"] == "step"
    assert read_trace(path).num_requests == 2
    with pytest.raises(FmoesimError, match="has a layer column"):
        import_table(src, tmp_path / "u", M, mapping={"layer": "-"})


def test_valid_phases_and_sizes_still_import(tmp_path: Path) -> None:
    """Red if the new checks refuse what was valid: decode phase words, a phase column
    with gaps read as floats, size comments of every layer."""
    src = tmp_path / "r.csv"
    src.write_text(
        "# model=x n_layer=2\n# layer=0 expert_bytes=64 dense_bytes=9\n# layer=1 expert_bytes=64\n"
        "position,layer,slot,expert,phase\n"
        "0,0,0,0,prefill\n0,0,1,1,prefill\n0,1,0,2,0\n0,1,1,3,0\n"
        "1,0,0,1,decode\n1,0,1,2,decode\n1,1,0,0,1\n1,1,1,3,1\n"
    )
    path, rep = import_table(src, tmp_path / "t", M)
    tr = read_trace(path)
    assert tr.prompt_tokens.tolist() == [1] and rep.layer_bytes == [64, 64]


# -- routed-expert arrays -----------------------------------------------------------------
def _ok(T: int = 3, L: int = 2, K: int = 2) -> np.ndarray:
    return np.tile(np.arange(K), (T, L, 1))


def _with(a: np.ndarray, idx: tuple[int, int], value: list[int]) -> np.ndarray:
    a = a.copy()
    a[idx] = value
    return a


BAD_ARRAYS = [
    (np.zeros((3, 2), dtype=np.int64), ": experts is an integer array (tokens, 2, top_k) (got"),
    (np.zeros((0, 2, 2), dtype=np.int64), ": a request has at least one token (got shape"),
    (_with(_ok(), (1, 0), [0, 9]),
     ", token 1, layer 0: expert ids in [0, 4), or -1 for a whole layer (got [0, 9])"),
    (_with(_ok(), (2, 1), [3, 3]),
     ", token 2, layer 1: a token's experts at a layer are distinct (got [3, 3])"),
    (_ok(K=3), ": experts per token (the arrays' last dimension) at most the model's top_k = 2"),
]  # fmt: skip


@pytest.mark.parametrize(("arr", "expected"), BAD_ARRAYS, ids=[e[:30] for _, e in BAD_ARRAYS])
def test_bad_routed_expert_arrays(tmp_path: Path, arr: np.ndarray, expected: str) -> None:
    """Red if a wrong shape is shown as ``(tokens, L, 0)``, an empty array as
    ``prompt_tokens in [1, 0]``, a range or duplicate error names no token and layer, or
    more experts per token than the model's top_k are accepted."""
    np.save(tmp_path / "r.npy", arr)
    with pytest.raises(FmoesimError) as info:
        import_routed_experts(tmp_path / "r.npy", tmp_path / "t", M)
    assert str(info.value).startswith(str(tmp_path / "r.npy") + expected), str(info.value)
    assert_nothing_written(tmp_path / "t")


def test_routed_experts_name_the_npz_array(tmp_path: Path) -> None:
    np.savez(tmp_path / "r.npz", a=_ok(), b=_with(_ok(), (0, 1), [1, 1]))
    with pytest.raises(FmoesimError) as info:
        import_routed_experts(tmp_path / "r.npz", tmp_path / "t", M)
    assert str(info.value).startswith(f"{tmp_path / 'r.npz'} array 'b', token 0, layer 1:")


OK_LIST = _ok().tolist()
BAD_ROUTED_JSON = [
    # non-integer ids were truncated, booleans and strings cast; a 1e30 id an OverflowError
    ({"routed_experts": (_ok() + 0.5).tolist()}, "routed_experts holds integer expert ids"),
    ({"routed_experts": [[[True, False]] * 2] * 3}, "routed_experts holds integer expert ids"),
    ({"routed_experts": [[["0", "1"]] * 2] * 3}, "routed_experts holds integer expert ids"),
    ({"routed_experts": [[[10**30, 1]] * 2] * 3}, "routed_experts holds integer expert ids"),
    # prompt lengths cast (2.9 became 2), or all dropped when one request lacked one
    ({"routed_experts": OK_LIST, "prompt_tokens": 2.9}, "prompt_tokens is an integer (request 0"),
    ({"routed_experts": OK_LIST, "prompt_tokens": True}, "prompt_tokens is an integer (request 0"),
    ([{"routed_experts": OK_LIST, "prompt_tokens": 2}, {"routed_experts": OK_LIST}],
     "every request gives prompt_tokens, or none does (request 1 has none)"),
]  # fmt: skip


@pytest.mark.parametrize(("doc", "expected"), BAD_ROUTED_JSON, ids=[e for _, e in BAD_ROUTED_JSON])
def test_bad_routed_experts_json(tmp_path: Path, doc: object, expected: str) -> None:
    """Red if a float, boolean or string expert id or prompt length is cast to an integer
    (or a 1e30 id raises an OverflowError), or one request's missing prompt length
    silently drops every request's."""
    (tmp_path / "r.json").write_text(json.dumps(doc))
    with pytest.raises(FmoesimError) as info:
        import_routed_experts(tmp_path / "r.json", tmp_path / "t", M)
    msg = str(info.value)
    assert msg.startswith(f"{tmp_path / 'r.json'}: {expected}"), msg
    assert_nothing_written(tmp_path / "t")


def test_unreadable_routed_experts_files(tmp_path: Path) -> None:
    """Red if a truncated .npz raises BadZipFile, JSON nested past Python's recursion
    limit raises RecursionError, or a directory is reported as missing."""
    np.savez(tmp_path / "ok.npz", a=_ok(), b=_ok())
    (tmp_path / "r.npz").write_bytes((tmp_path / "ok.npz").read_bytes()[:300])
    (tmp_path / "r.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp_path / "d.npz").mkdir()
    for name, expected in (("r.npz", ": readable ("), ("r.json", ": readable (")):
        with pytest.raises(FmoesimError) as info:
            import_routed_experts(tmp_path / name, tmp_path / "t", M)
        assert str(info.value).startswith(str(tmp_path / name) + expected), str(info.value)
    with pytest.raises(FmoesimError, match=r"d\.npz: a \.npy, \.npz or \.json file, not a dir"):
        import_routed_experts(tmp_path / "d.npz", tmp_path / "t", M)
    assert_nothing_written(tmp_path / "t")


def test_zero_prompt_tokens_refused_for_routed_experts(tmp_path: Path, capsys) -> None:
    """Red if ``--prompt-tokens 0`` is ignored (the file's or the default length used)."""
    np.save(tmp_path / "r.npy", _ok(T=20, L=MIXTRAL_L))
    line = refused(
        capsys, "import", "vllm-routed-experts", str(tmp_path / "r.npy"), str(tmp_path / "o"),
        "--prompt-tokens", "0", *MIX,
    )  # fmt: skip
    assert line.endswith("--prompt-tokens must be >= 1, got 0")
    assert_nothing_written(tmp_path / "o")


def test_an_import_refuses_the_options_it_does_not_use(tmp_path: Path, capsys) -> None:
    """Red if ``import eamc --top-k 1`` or ``import vllm-routed-experts --map ...`` exits 0
    with a trace that ignored the option."""
    np.save(tmp_path / "r.npy", _ok(T=20, L=MIXTRAL_L))
    for fmt, extra, line in (
        ("eamc", ["--top-k", "1"], "--top-k: import eamc does not use it (rule: it takes none "
         "of --map, --prompt-tokens and --top-k)"),
        ("vllm-routed-experts", ["--map", "layer=foo"], "--map: import vllm-routed-experts "
         "does not use it (rule: it takes --prompt-tokens alone of --map, --prompt-tokens and "
         "--top-k)"),
    ):  # fmt: skip
        got = refused(
            capsys, "import", fmt, str(tmp_path / "r.npy"), str(tmp_path / "o"), *extra, *MIX
        )
        assert got == f"fmoesim-trace: error: {line}"
        assert_nothing_written(tmp_path / "o")


def test_more_experts_than_top_k_refused_on_the_command_line(tmp_path: Path, capsys) -> None:
    """Red if the import exits 0 and writes a top-3 trace that a run then refuses."""
    np.save(tmp_path / "r.npy", _ok(T=20, L=MIXTRAL_L, K=3))
    line = refused(
        capsys, "import", "vllm-routed-experts", str(tmp_path / "r.npy"), str(tmp_path / "o"), *MIX
    )
    assert "at most the model's top_k = 2" in line and "got 3" in line
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize("bad", [math.nan, -0.5, math.inf])
def test_from_arrays_refuses_bad_weights_before_writing(tmp_path: Path, bad: float) -> None:
    """Red if the weights reach tokens.parquet unchecked."""
    w = np.full((3, 2, 2), 0.5)
    w[1, 1, 0] = bad
    with pytest.raises(FmoesimError, match=r"request 0, token 1, layer 1: weights are finite"):
        from_arrays(_ok(), tmp_path / "t", M, weights=w)
    assert_nothing_written(tmp_path / "t")


# -- EAMC --------------------------------------------------------------------------------
def test_eamc_counts_above_the_tokens_refused_before_writing(tmp_path: Path, capsys) -> None:
    """Red if the error names the output's routing.parquet, the invalid trace is left in
    place, or a rerun is answered ``already exists``."""
    eamc = np.zeros((2, MIXTRAL_L, MIXTRAL_E))
    eamc[1, :, 0], eamc[1, :, 1] = 6, 4  # 10 = 5 tokens x top-2, expert 0 with 6 of them
    np.save(tmp_path / "e.npy", eamc)
    for _ in range(2):  # a rerun gives the same answer
        line = refused(capsys, "import", "eamc", str(tmp_path / "e.npy"), str(tmp_path / "o"), *MIX)
        assert f"{tmp_path / 'e.npy'} row 1: no expert gets more tokens than the matrix" in line
        assert "(layer 0, expert 0: 6 of 5 tokens)" in line
        assert_nothing_written(tmp_path / "o")
    bad = np.zeros((1, 2, 4))
    bad[0] = [[3, 1, 0, 0], [1, 1, 1, 1]]
    np.save(tmp_path / "s.npy", bad)
    with pytest.raises(FmoesimError, match=r"s\.npy row 0: no expert gets more tokens"):
        import_eamc(tmp_path / "s.npy", tmp_path / "t", M)
    assert_nothing_written(tmp_path / "t")


def test_eamc_counts_beyond_int32_refused_without_a_warning(tmp_path: Path) -> None:
    """Red if a count of 1e30 reaches the int64 cast (numpy's RuntimeWarning, a second
    line on stderr) before it is refused."""
    bad = np.zeros((2, 2, 4))
    bad[1, 0, 0] = 1e30
    np.save(tmp_path / "e.npy", bad)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FmoesimError, match=r"e\.npy row 1: .*counts are at most 2147483647"):
            import_eamc(tmp_path / "e.npy", tmp_path / "t", M)
    assert_nothing_written(tmp_path / "t")


# -- --force ------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["file", "folder"])
def test_force_replaces_only_a_trace_directory(tmp_path: Path, capsys, kind: str) -> None:
    """Red if --force deletes a plain file or a folder holding thesis.txt."""
    src = jsonl(tmp_path / "r.jsonl", [route(layer, 0, [0, 1]) for layer in range(MIXTRAL_L)])
    out = tmp_path / "out"
    if kind == "file":
        out.write_text("precious")
    else:
        out.mkdir()
        (out / "thesis.txt").write_text("precious")
    line = refused(capsys, "import", "vllm-routes", str(src), str(out), "--force", *MIX)
    what = "a file" if kind == "file" else "a directory without trace.json"
    assert f"{out}: already exists and is {what} (rule: " in line
    kept = out if kind == "file" else out / "thesis.txt"
    assert kept.read_text() == "precious"
    with pytest.raises(FmoesimError, match="already exists and is"):  # the Python API too
        import_table(src, out, M, overwrite=True)


def test_synth_refuses_its_destination_before_any_progress_bar(tmp_path: Path, capsys) -> None:
    """Red if synth starts its progress bar before the destination is checked (two lines
    on stderr, the error glued to the bar), or a destination under a plain file is not
    one line naming that file."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "thesis.txt").write_text("precious")
    line = refused(capsys, "synth", "--requests", "1", str(out))
    assert line == f"fmoesim-trace: error: {out}: already exists and is a directory without " \
        "trace.json (rule: overwrite=True / --force replaces only a trace directory, one " \
        "holding trace.json, or an empty directory)"  # fmt: skip
    (tmp_path / "f").write_text("a file")
    line = refused(capsys, "synth", "--requests", "1", str(tmp_path / "f" / "t"))
    assert line == f"fmoesim-trace: error: {tmp_path / 'f'}: cannot be made as a directory: " \
        "is a file"  # fmt: skip
    assert (tmp_path / "f").read_text() == "a file"


def test_force_still_replaces_a_trace_and_fills_an_empty_folder(tmp_path: Path) -> None:
    src = jsonl(tmp_path / "r.jsonl", GOOD)
    out = tmp_path / "out"
    out.mkdir()
    import_table(src, out, M, overwrite=True)  # an empty folder
    import_table(src, out, M, overwrite=True)  # a trace
    assert read_trace(out).num_requests == 1
    with pytest.raises(FmoesimError, match="already exists .pass overwrite=True / --force"):
        import_table(src, out, M)


# -- validate: tokens.parquet, trace.json, arrival_s --------------------------------------
@pytest.fixture
def token_trace(tmp_path: Path) -> Path:
    """A valid trace with tokens.parquet (2 tokens x 2 layers, top-2 of 4 experts)."""
    src = jsonl(
        tmp_path / "r.jsonl",
        [*GOOD, route(0, 1, [1, 2], [0.7, 0.3]), route(1, 1, [0, 3], [0.9, 0.1])],
    )
    path, _ = import_table(src, tmp_path / "t", M)
    assert read_trace(path).manifest.has_tokens
    return path


def _junk(t: Path) -> None:
    (t / S.TOKENS).write_bytes(b"not parquet at all")


def _tokens_out_of_range(t: Path) -> None:
    tab = pq.read_table(t / S.TOKENS).to_pydict()
    tab["topk_ids"][0] = [0, 9]
    pq.write_table(pa.table(tab, schema=S.tokens_schema(2)), t / S.TOKENS)


def _no_tokens_flag(t: Path) -> None:
    edit_manifest(t / S.MANIFEST, lambda raw: raw.update(has_tokens=False))


def _null_tokens_row(t: Path, ids: bool = True, weights: bool = True) -> None:
    """Null row 1's ``topk_ids`` and / or ``topk_weights``."""
    tab = pq.read_table(t / S.TOKENS).to_pydict()
    if ids:
        tab["topk_ids"][1] = None
    if weights:
        tab["topk_weights"][1] = None
    pq.write_table(pa.table(tab, schema=S.tokens_schema(2)), t / S.TOKENS)


BAD_TRACES = [
    (_junk, "tokens.parquet: ", "a readable Parquet file"),
    (lambda t: (t / S.TOKENS).unlink(), "tokens.parquet: ", "file not found"),
    (_tokens_out_of_range, "tokens.parquet row 0: ", "topk_ids [0, 9] (rule: topk_ids in [0, 4)"),
    (_no_tokens_flag, "tokens.parquet: ", "present only when trace.json says has_tokens"),
    # a null row (a pair a log lacks) in a trace without layer_gaps, or in one list only
    (_null_tokens_row, "tokens.parquet row 1: ",
     "(rule: a row is null only in a trace with layer_gaps"),
    (lambda t: _null_tokens_row(t, weights=False), "tokens.parquet row 1: ",
     "topk_ids null, topk_weights [0.5, 0.5] (rule: topk_ids and topk_weights are null on"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r.update(num_requests=33)),
     "trace.json: ", "num_requests = 33, requests.parquet has 1 rows (rule: num_requests is"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r.update(num_iterations=7)),
     "trace.json: ", "(rule: num_iterations is the number of rows of iterations.parquet)"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r.update(num_requests="x")),
     "trace.json: ", "got 'x' (rule: num_requests is a non-negative integer)"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r["model"].update(dense_layers=-2)),
     "trace.json: ", "got -2 (rule: model.dense_layers is a non-negative integer)"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r["model"].update(num_layers=True)),
     "trace.json: ", "got True (rule: model.num_layers is an integer in [1, 2**31))"),
    (lambda t: edit_manifest(t / S.MANIFEST, lambda r: r.update(schema_version=True)),
     "trace.json: ", "schema_version is True (rule: schema_version is 1)"),
    (lambda t: edit_manifest(
        t / S.MANIFEST, lambda r: r.update(embedding_projection={"input_dim": "a"})),
     "trace.json: ", "(rule: embedding_projection is null or"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("spoil", "where", "expected"), BAD_TRACES, ids=[e[:40] for _, _, e in BAD_TRACES]
)
def test_validate_checks_tokens_and_manifest(
    token_trace: Path, capsys, spoil, where: str, expected: str
) -> None:
    """Red if ``validate`` prints ``valid`` for any of these."""
    main(["validate", str(token_trace)])
    assert ": valid (" in capsys.readouterr().out
    spoil(token_trace)
    line = refused(capsys, "validate", str(token_trace))
    assert f"error: {token_trace / where}" in line and expected in line, line
    with pytest.raises(TraceError):
        validate_trace(token_trace)


def test_null_token_rows_match_the_routing_gaps(tmp_path: Path) -> None:
    """Red if ``validate`` passes a ``tokens.parquet`` whose null rows (the (token, layer)
    pairs a log lacks) disagree with the routing of a trace with layer_gaps: a null row
    where the routing counts the token, or a logged row where it routes nothing."""
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [-1, -1]]])  # token 1 lacks layer 1
    wts = np.full(ids.shape, 0.5)
    t = from_arrays(ids, tmp_path / "t", M, weights=wts)
    validate_trace(t)
    tab = pq.read_table(t / S.TOKENS).to_pydict()
    assert tab["topk_ids"][3] is None and tab["topk_weights"][3] is None
    for row, value in ((2, None), (3, [0, 3])):  # token 1's layer 0 nulled; its gap filled
        spoilt = {k: list(v) for k, v in tab.items()}
        spoilt["topk_ids"][row] = value
        spoilt["topk_weights"][row] = None if value is None else [0.5, 0.5]
        pq.write_table(pa.table(spoilt, schema=S.tokens_schema(2)), t / S.TOKENS)
        said = rf"tokens\.parquet row {row}: request 0, iteration 1, layer {row - 2}: the "
        with pytest.raises(TraceError, match=said + r".*top-k ids add up to expert_counts"):
            validate_trace(t)


def test_a_nan_arrival_is_not_a_null_one(token_trace: Path) -> None:
    """Red if NaN is read as null and passes (the rule: null or finite >= 0)."""
    path = token_trace / S.REQUESTS
    tab = pq.read_table(path)
    for value, ok in ((None, True), (1.5, True), (math.nan, False), (-1.0, False)):
        arrival = pa.array([value], pa.float64(), from_pandas=False)
        pq.write_table(tab.set_column(3, "arrival_s", arrival), path)
        if ok:
            read_trace(token_trace)
        else:
            with pytest.raises(TraceError, match=r"requests\.parquet row 0: arrival_s = "):
                read_trace(token_trace)


# -- arrival CSVs ------------------------------------------------------------------------
HUGE = "99999999999999999999"


@pytest.mark.parametrize("col", ["ContextTokens", "GeneratedTokens"])
def test_out_of_range_token_counts_in_an_arrival_csv(tmp_path: Path, col: str) -> None:
    """Red if an overflowing count gives a RuntimeWarning, then garbage lengths (or a
    ValueError)."""
    row = {"ContextTokens": "10", "GeneratedTokens": "5", col: HUGE}
    p = tmp_path / "a.csv"
    p.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n0,10,5\n"
        f"1,{row['ContextTokens']},{row['GeneratedTokens']}\n"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(FmoesimError) as info:
            read_azure_csv(p)
    assert str(info.value) == (
        f"{p} row 2: {col} = {HUGE} (rule: a positive integer at most 2147483647)"
    )


def test_synth_with_an_overflowing_arrival_csv_is_one_line(tmp_path: Path, capsys) -> None:
    p = tmp_path / "a.csv"
    p.write_text(f"TIMESTAMP,ContextTokens,GeneratedTokens\n0,{HUGE},5\n1,10,5\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        line = refused(
            capsys, "synth", "--requests", "2", "--arrivals", str(p), str(tmp_path / "o")
        )
    assert f"{p} row 1: ContextTokens = " in line and "at most 2147483647" in line
    assert_nothing_written(tmp_path / "o")


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--requests", "0"], "'--requests' = 0: must be a positive integer"),
        (["--rate", "-2"], "'--rate' = -2.0: must be a finite number > 0"),
        (["--set", "skew=-1"], "'--set skew' = -1.0: must be a finite number >= 0"),
    ],
)
def test_synth_names_the_flag_a_bad_knob_came_from(tmp_path: Path, capsys, argv, said) -> None:
    """Red if a bad ``--requests``, ``--rate`` or ``--set`` value is reported under the
    config key the user never typed (``workload.synthetic.num_requests``)."""
    line = refused(capsys, "synth", *argv, str(tmp_path / "o"))
    assert said in line and "workload.synthetic" not in line, line
    assert_nothing_written(tmp_path / "o")
