"""Route tables from any logger (``fmoesim-trace import table``), vLLM's routed experts
(``import vllm-routed-experts``) and :func:`fmoesim.trace.table.from_arrays`."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fmoesim.cli.trace_cli import build_parser
from fmoesim.engine.simulate import simulate
from fmoesim.errors import FmoesimError
from fmoesim.trace import read_trace
from fmoesim.trace.reader import read_tokens, validate_trace
from fmoesim.trace.table import COLUMNS, from_arrays, import_routed_experts, import_table
from policies.lru import LRU
from tests.tiny import TINY_HW, small_model

ROOT = Path(__file__).resolve().parents[1]
EDGE = ROOT.parent / "shared" / "data" / "routing" / "bigmoeonedge-qwen3-30b-a3b"
M = small_model(2, 4, 2)  # 2 layers x 4 experts, top-2


def test_wide_csv_with_other_column_names_and_comments(tmp_path: Path) -> None:
    """Red if token_pos / topk_ids / req_id are not recognised, comment lines are read,
    or the tokens' counts land in the wrong iteration: two requests, the prompt 1 token,
    hand-computed counts."""
    src = tmp_path / "r.csv"
    src.write_text(
        "# logger v2\n"
        "req_id,token_pos,layer,topk_ids\n"
        'a,0,0,"[0, 1]"\na,0,1,"[2, 3]"\na,1,0,"[0, 2]"\na,1,1,"[2, 3]"\n'
        'b,0,0,"[3, 2]"\nb,0,1,"[1, 0]"\n'
    )
    path, rep = import_table(src, tmp_path / "t", M)
    tr = read_trace(path)
    assert rep.columns == {"request": "req_id", "position": "token_pos", "layer": "layer",
                           "experts": "topk_ids"}  # fmt: skip
    assert (rep.requests, rep.tokens, rep.missing_pairs) == (2, 3, 0)
    assert tr.prompt_tokens.tolist() == [1, 1] and tr.output_tokens.tolist() == [2, 1]
    np.testing.assert_array_equal(tr.counts[0], [[1, 1, 0, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(tr.counts[1], [[1, 0, 1, 0], [0, 0, 1, 1]])
    np.testing.assert_array_equal(tr.counts[2], [[0, 0, 1, 1], [1, 1, 0, 0]])
    assert tr.manifest.source["format"] == "table" and not tr.manifest.layer_gaps


def test_a_log_of_fewer_layers_than_the_model_is_refused(tmp_path: Path) -> None:
    """Red if a 2-layer model's log imported as a 4-layer model is written, its last two
    layers routing nothing, with only a count of (token, layer) gaps to show for it (a
    run on it reports a hit rate of a model that is not the log's); red too if the
    arrays' path (from_arrays) lets it through, or if a log whose first or inner layers
    no token routes at (a block-indexed log's dense blocks) is refused."""
    src = tmp_path / "r.csv"
    src.write_text('request,position,layer,experts\na,0,0,"[0, 1]"\na,0,1,"[2, 3]"\n')
    four = small_model(4, 4, 2)
    rule = r"^r\.csv: no token routes at layer\(s\) 2-3 of tiny-4x4-top2's 4, the log's last "
    with pytest.raises(FmoesimError, match=rule + r"being 1 \(rule: the log reaches the"):
        import_table(src, tmp_path / "t", four)
    ids = np.array([[[0, 1], [2, 3], [0, 1], [-1, -1]]])  # (T=1, L=4, K=2): layer 3 never
    with pytest.raises(FmoesimError, match=r"^arrays: no token routes at layer\(s\) 3 of"):
        from_arrays(ids, tmp_path / "t", four)
    assert not (tmp_path / "t").exists()
    import_table(src, tmp_path / "t", M)  # its own model's: fine
    # a layer before the last that no token routes at (a dense block of a log that numbers
    # every block) is kept, routing nothing
    inner = np.array([[[-1, -1], [2, 3], [-1, -1], [0, 1]]])
    assert read_trace(from_arrays(inner, tmp_path / "inner", four)).counts[:, [0, 2]].sum() == 0


def test_a_request_column_by_another_usual_name_or_none(tmp_path: Path) -> None:
    """Red if a ``request`` column is not read as the request (two requests merged into
    one, their positions' restarts read as new steps), or if a log without any request
    column (a ``seq_id``, an engine slot that may be reused, is none unless mapped)
    merges its requests without the report saying there was none."""
    rows = 'a,0,0,"[0, 1]"\na,0,1,"[2, 3]"\nb,0,0,"[1, 2]"\nb,0,1,"[0, 3]"\n'
    for name, requests in (("request", 2), ("seq_id", 1)):
        src = tmp_path / f"{name}.csv"
        src.write_text(f"{name},position,layer,experts\n" + rows)
        _, rep = import_table(src, tmp_path / name, M)
        assert rep.requests == requests
        hint = [line for line in rep.lines() if line.startswith("no request column")]
        assert len(hint) == (requests == 1), rep.lines()


def test_long_rows_phase_restarted_positions_and_a_missing_layer(tmp_path: Path) -> None:
    """Red if the restart rule does not split decode steps whose position is 0 every
    step, if phase does not set the prompt, or if a token missing a layer is dropped
    (instead of kept, routing nothing there): prompt of 2 tokens, 2 decode steps at
    position 0, the last one lacking layer 1."""
    rows = []

    def add(pos, layer, experts, phase):  # noqa: E306
        for rank, e in enumerate(experts):
            rows.append({"position": pos, "layer": layer, "slot": rank, "expert": e,
                         "weight": 0.5, "phase": phase})  # fmt: skip

    for pos, ex in ((0, [0, 1]), (1, [1, 2])):  # prefill: two tokens, both layers
        add(pos, 0, ex, "prefill")
        add(pos, 1, ex, "prefill")
    add(0, 0, [3, 2], "decode")
    add(0, 1, [3, 2], "decode")
    add(0, 0, [0, 3], "decode")  # layer 1 of this step is not logged
    src = tmp_path / "r.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    path, rep = import_table(src, tmp_path / "t", M)
    tr = read_trace(path)
    assert rep.steps_restarted == 2 and rep.missing_pairs == 1 and rep.tokens == 4
    assert tr.manifest.has_tokens  # the weights of the pairs the log has are kept
    assert tr.prompt_tokens.tolist() == [2] and tr.output_tokens.tolist() == [3]
    np.testing.assert_array_equal(tr.counts[0], [[1, 2, 1, 0], [1, 2, 1, 0]])
    np.testing.assert_array_equal(tr.counts[1], [[0, 0, 1, 1], [0, 0, 1, 1]])
    np.testing.assert_array_equal(tr.counts[2], [[1, 0, 0, 1], [0, 0, 0, 0]])
    assert tr.manifest.layer_gaps and tr.manifest.source["missing_token_layers"] == 1
    # the engine serves it: the missing layer accesses nothing (2 + 2 + 2 + 2 + 2 + 0)
    res = simulate(tr, M, TINY_HW, LRU(), 8 * M.expert_size_bytes)
    assert res.summary["accesses"] == 3 + 3 + 2 + 2 + 2


def test_a_log_missing_a_layer_keeps_the_weights_it_has(tmp_path: Path) -> None:
    """Red if an imported log in which a (token, layer) pair is missing keeps no gate
    weights at all (no tokens.parquet, as when that file could only hold every layer of
    every token), instead of the weights of every pair it logs, with a null row at each
    pair it lacks: a llama.cpp-style table (turn, phase, step, slot, expert, weight)
    whose prompt tokens are not logged at the last layer, as such engines log them."""
    head = "# n_layer=2 n_expert=4 n_expert_used=2\nturn,phase,step,layer,slot,expert,weight\n"
    rows = [  # (phase, step, layer, experts, weights): step 1 of the prompt lacks layer 1
        (0, 0, 0, [0, 1], [0.75, 0.25]), (0, 0, 1, [2, 3], [0.5, 0.5]),
        (0, 1, 0, [1, 2], [0.625, 0.375]),
        (1, 2, 0, [3, 0], [0.875, 0.125]), (1, 2, 1, [1, 3], [0.5625, 0.4375]),
    ]  # fmt: skip
    src = tmp_path / "r.csv"
    src.write_text(head + "".join(
        f"0,{ph},{st},{layer},{slot},{e},{w}\n"
        for ph, st, layer, es, ws in rows for slot, (e, w) in enumerate(zip(es, ws, strict=True))
    ))  # fmt: skip
    path, rep = import_table(src, tmp_path / "t", M)
    assert rep.missing_pairs == 1
    assert rep.lines()[-1] == (
        "1 (token, layer) pairs without rows: kept, routing nothing at that layer "
        "(layer_gaps); null rows in tokens.parquet"
    )
    tr = validate_trace(path)
    assert tr.manifest.layer_gaps and tr.manifest.has_tokens
    assert tr.prompt_tokens.tolist() == [2] and tr.output_tokens.tolist() == [2]
    tok = read_tokens(tr)
    # one row per (token, layer): prompt tokens 0 and 1, then the decode token
    assert tok.iteration.tolist() == [0, 0, 0, 0, 1, 1]
    assert tok.logged.tolist() == [True, True, True, False, True, True]
    assert tok.topk_ids.tolist() == [[0, 1], [2, 3], [1, 2], [-1, -1], [3, 0], [1, 3]]
    logged = [ws for *_, ws in rows]  # every weight is exact in float16
    np.testing.assert_array_equal(tok.topk_weights[tok.logged], logged)
    assert np.isnan(tok.topk_weights[3]).all()
    # on disk the missing pair is null in both lists, as pandas shows it
    df = pd.read_parquet(path / "tokens.parquet")
    assert df.topk_ids.isna().tolist() == df.topk_weights.isna().tolist() == [
        False, False, False, True, False, False]  # fmt: skip


def test_from_arrays_keeps_weights_around_a_missing_layer(tmp_path: Path) -> None:
    """Red if from_arrays drops every weight of a trace whose arrays mark a layer the
    logger missed (``-1``), or writes that pair's weights (NaN here) as if logged."""
    ids = np.array([[[0, 1], [2, 3]], [[1, 2], [-1, -1]]])  # token 1 lacks layer 1
    wts = np.array([[[0.75, 0.25], [0.5, 0.5]], [[0.625, 0.375], [np.nan, np.nan]]])
    tr = validate_trace(from_arrays(ids, tmp_path / "t", M, weights=wts, prompt_tokens=1))
    tok = read_tokens(tr)
    assert tok.logged.tolist() == [True, True, True, False]
    np.testing.assert_array_equal(tok.topk_weights[:3], wts.reshape(4, 2)[:3])
    assert tok.topk_ids[3].tolist() == [-1, -1] and np.isnan(tok.topk_weights[3]).all()


def test_map_help_names_every_key() -> None:
    """Red if ``--map``'s help leaves out a key the importer takes (a key of
    :data:`fmoesim.trace.table.COLUMNS`, such as ``size`` or ``dataset``), or lists one
    it does not."""
    sub = next(a for a in build_parser()._actions if a.choices and "import" in a.choices)
    imp = sub.choices["import"]
    (act,) = [a for a in imp._actions if "--map" in a.option_strings]
    listed = re.search(r"the column of a key \(([^)]*)\)", act.help or "")
    assert listed is not None, act.help
    assert listed.group(1).split(", ") == list(COLUMNS)
    text = " ".join(imp.format_help().split())  # as printed, line breaks undone
    assert f"({', '.join(COLUMNS)})" in text


@pytest.mark.parametrize("shape", ["wide", "long"])
def test_a_repeated_row_is_refused_not_read_as_a_new_step(tmp_path: Path, shape: str) -> None:
    """Red if a row logged twice (row 2, repeated as row 3) is read by the restart rule
    as the start of a new step: the wide table's token was cut in two at layer 1 (the
    prompt grew by a token, the import counted a restart and a (token, layer) gap); the
    long table's repeat, at layer 0, left a token of layer 0 alone.  Red too if a step
    that goes back to an earlier layer stops being a new step: the next decode step at
    position 0, and one that lacks layer 0 (kept, its layer 0 a gap)."""
    if shape == "wide":
        head, rows = "position,layer,experts", ['0,0,"[0, 1]"', '0,1,"[2, 3]"']
        step = ['0,0,"[1, 2]"', '0,1,"[0, 3]"']
        said = "(request 0, position 0, layer 1: also row 2)"
        rule = "a (position, layer) read again starts the next step only below the layer "
        rule += "of the request's row before (1): a repeated row?"
    else:
        head, rows = "position,layer,expert", ["0,0,0", "0,0,1", "0,1,2", "0,1,3"]
        step = ["0,0,1", "0,0,2", "0,1,0", "0,1,3"]
        said = "(request 0, position 0, layer 0: also row 2)"
        rule = "a (position, layer, expert) read again starts the next step only below the "
        rule += "layer of the request's row before (0): a repeated row?"
    src = tmp_path / "r.csv"
    src.write_text("\n".join([head, *rows[:2], rows[1], *rows[2:], *step]) + "\n")
    with pytest.raises(FmoesimError) as info:
        import_table(src, tmp_path / "t", M)
    assert str(info.value) == f"{src} row 3: {rule} {said}"
    assert not (tmp_path / "t").exists()
    src.write_text("\n".join([head, *rows, *step]) + "\n")  # without the repeat: two steps
    _, rep = import_table(src, tmp_path / "t", M)
    assert (rep.tokens, rep.steps_restarted, rep.missing_pairs) == (2, 1, 0)
    # three layers, the second step logged at layers 1 and 2 only: back to layer 1
    # after layer 2, a new step, its layer 0 a gap
    src.write_text(
        'position,layer,experts\n0,0,"[0, 1]"\n0,1,"[2, 3]"\n0,2,"[0, 3]"\n'
        '0,1,"[1, 2]"\n0,2,"[0, 1]"\n'
    )
    _, rep = import_table(src, tmp_path / "t3", small_model(3, 4, 2))
    assert (rep.tokens, rep.steps_restarted, rep.missing_pairs) == (2, 1, 1)


def test_a_row_logged_twice_after_the_last_layer_is_refused(tmp_path: Path) -> None:
    """A logger that flushed a row again after the step's last layer: the row goes back
    to an earlier layer, which the restart rule alone reads as a new step.  A new step
    starts where the step before started; a repeat elsewhere with the same experts and
    weights is the same row.  Red if it is imported as a made-up token that routes at
    one layer only (exit 0, one more token, a layer gap), or if a new step is refused
    because its first row equals the step before's: equal weights are common (rounded
    logs, top-1 models), in the wide and the long layout."""
    head = "position,layer,experts,weights"
    rows = ['0,0,"[0, 1]","[0.7, 0.3]"', '0,1,"[2, 3]","[0.6, 0.4]"',
            '1,0,"[1, 2]","[0.5, 0.5]"', '1,1,"[0, 3]","[0.9, 0.1]"']  # fmt: skip
    src = tmp_path / "r.csv"
    src.write_text("\n".join([head, *rows, rows[2]]) + "\n")
    with pytest.raises(FmoesimError) as info:
        import_table(src, tmp_path / "t", M)
    assert str(info.value) == (
        f"{src} row 5: a (position, layer) read again with the same experts and weights, "
        "away from where the step began, is a row logged twice, not a new step (request 0, "
        "position 1, layer 0: as row 3)"
    )
    assert not (tmp_path / "t").exists()
    # the next step (positions again from 0) opens with the very row the step before did
    src.write_text("\n".join([head, *rows, rows[0], '0,1,"[1, 3]","[0.6, 0.4]"']) + "\n")
    _, rep = import_table(src, tmp_path / "t", M)
    assert (rep.tokens, rep.steps_restarted, rep.missing_pairs) == (3, 1, 0)
    long = tmp_path / "long.csv"  # one row per routed expert: a new step's rank-0 row alike
    long.write_text(
        "position,layer,rank,expert,weight\n0,0,0,0,0.62\n0,0,1,1,0.38\n0,1,0,2,0.5\n"
        "0,1,1,3,0.5\n0,0,0,0,0.62\n0,0,1,2,0.38\n0,1,0,1,0.7\n0,1,1,3,0.3\n"
    )
    _, rep = import_table(long, tmp_path / "tl", M)
    assert (rep.tokens, rep.steps_restarted, rep.missing_pairs) == (2, 1, 0)


def test_a_json_array_reads_as_its_json_lines(tmp_path: Path) -> None:
    """Red if a ``.json`` file holding one array of records (what ``json.dump`` of a
    list writes) is refused as "each line is a JSON object", or imports another trace
    than the same records as JSON lines; red too if a record that is not an object is
    not named by its number."""
    recs = [{"request": r, "position": 0, "layer": layer, "experts": [layer, 2 + r]}
            for r in (0, 1) for layer in (0, 1)]  # fmt: skip
    (tmp_path / "r.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    (tmp_path / "r.json").write_text("\n  " + json.dumps(recs, indent=2))
    one = read_trace(import_table(tmp_path / "r.jsonl", tmp_path / "lines", M)[0])
    two = read_trace(import_table(tmp_path / "r.json", tmp_path / "array", M)[0])
    np.testing.assert_array_equal(one.counts, two.counts)
    assert two.prompt_tokens.tolist() == [1, 1]
    (tmp_path / "bad.json").write_text(json.dumps([recs[0], 7]))
    with pytest.raises(FmoesimError) as info:
        import_table(tmp_path / "bad.json", tmp_path / "bad", M)
    assert str(info.value) == (
        f"{tmp_path / 'bad.json'} record 2: a .json table is an array of JSON objects (or JSON "
        "lines) (got a number)"
    )
    (tmp_path / "late.json").write_text(json.dumps([recs[0], {**recs[1], "layer": 9}]))
    with pytest.raises(FmoesimError, match=r"late\.json record 2: layer in \[0, 2\)"):
        import_table(tmp_path / "late.json", tmp_path / "late", M)


def test_map_and_top_k_override(tmp_path: Path) -> None:
    """Red if --map does not name a column the usual names miss, or a run made with
    fewer experts per token cannot be imported with top_k, or a top_k above the model's
    is taken (a trace then records a model that routes more experts than it does)."""
    df = pd.DataFrame({"tok": [0, 0, 1, 1], "lyr": [0, 1, 0, 1], "e": [2, 3, 3, 1]})
    src = tmp_path / "r.parquet"
    df.to_parquet(src)
    with pytest.raises(FmoesimError, match="has a layer column"):
        import_table(src, tmp_path / "x", M)
    # without a position column a repeated layer starts the next token
    no_pos = tmp_path / "np.csv"
    no_pos.write_text('layer,experts\n0,"[0, 1]"\n1,"[2, 3]"\n0,"[1, 2]"\n1,"[0, 3]"\n')
    tr0 = read_trace(import_table(no_pos, tmp_path / "np", M)[0])
    np.testing.assert_array_equal(tr0.counts[1], [[0, 1, 1, 0], [1, 0, 0, 1]])
    path, _ = import_table(src, tmp_path / "t", M, top_k=1,
                           mapping={"position": "tok", "layer": "lyr", "experts": "e"})  # fmt: skip
    tr = read_trace(path)
    assert tr.top_k == 1
    np.testing.assert_array_equal(tr.counts[1], [[0, 0, 0, 1], [0, 1, 0, 0]])
    # more experts per token than the model routes: the trace would claim a top-3 model
    with pytest.raises(FmoesimError, match=r"^--top-k 3: must be in \[1, 2\] \(rule: a run"):
        import_table(src, tmp_path / "t3", M, top_k=3)


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ('layer,experts\n0,"[0, 1]"\n5,"[0, 1]"\n', "row 2: layer in [0, 2)"),
        ('layer,experts\n0,"[0, 9]"\n', "row 1: expert ids in [0, 4)"),
        ('layer,experts\nx,"[0, 1]"\n', "row 1: layer is an integer"),
        ('layer,experts\n0,"[0, 1, 2]"\n', "every token has 2 distinct experts"),
        ('layer,experts,weight\n0,"[0, 1]","[0.5]"\n', "row 1: weights holds one number"),
        ("position,expert\n0,1\n", "has a layer column"),
    ],
)
def test_bad_tables_are_refused_with_row_and_rule(tmp_path: Path, text: str, rule: str) -> None:
    """Red if a broken row is accepted, or refused without its file, row and rule, or
    leaves a half-written trace."""
    src = tmp_path / "bad.csv"
    src.write_text(text)
    with pytest.raises(FmoesimError, match=rule.replace("[", r"\[").replace(")", r"\)")) as info:
        import_table(src, tmp_path / "t", M)
    assert str(src) in str(info.value)
    assert not (tmp_path / "t").exists()


def test_from_arrays_and_routed_experts_files(tmp_path: Path) -> None:
    """Red if arrays of (tokens, layers, top_k) do not give the same trace as the table
    with the same routing, or an .npz's stored prompt lengths are ignored."""
    a = np.array([[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[3, 1], [0, 1]]])  # (3, 2, 2)
    b = np.array([[[3, 2], [1, 0]]])
    tr = read_trace(from_arrays([a, b], tmp_path / "t", M, prompt_tokens=[2, 1]))
    assert tr.prompt_tokens.tolist() == [2, 1] and tr.output_tokens.tolist() == [2, 1]
    np.testing.assert_array_equal(tr.counts[0], [[2, 1, 1, 0], [0, 0, 2, 2]])
    np.savez(tmp_path / "r.npz", r0=a, r1=b, prompt_tokens=np.array([2, 1]))
    tr2 = read_trace(import_routed_experts(tmp_path / "r.npz", tmp_path / "t2", M))
    np.testing.assert_array_equal(tr2.counts, tr.counts)
    assert tr2.manifest.source["format"] == "vllm-routed-experts"
    (tmp_path / "r.json").write_text(json.dumps({"routed_experts": b.tolist()}))
    tr3 = read_trace(import_routed_experts(tmp_path / "r.json", tmp_path / "t3", M))
    np.testing.assert_array_equal(tr3.counts[0], [[0, 0, 1, 1], [1, 1, 0, 0]])
    for name in ("empty.npy", "empty.npz"):  # an interrupted dump: red on numpy's EOFError
        (tmp_path / name).write_bytes(b"")
        with pytest.raises(FmoesimError, match=f"{name}: .*readable"):
            import_routed_experts(tmp_path / name, tmp_path / "t4", M)
    with pytest.raises(FmoesimError, match="distinct"):
        from_arrays(np.array([[[1, 1], [2, 3]]]), tmp_path / "t4", M)
    with pytest.raises(FmoesimError, match=r"-1 for a whole layer"):
        from_arrays(np.array([[[1, -1], [2, 3]]]), tmp_path / "t5", M)


def test_npz_requests_keep_the_order_savez_was_given(tmp_path: Path) -> None:
    """Red if an .npz's arrays are taken in string order (arr_0, arr_1, arr_10, arr_11,
    arr_2, ...): request i must be the i-th array, with the i-th prompt length."""
    arrs = [np.tile([0, 1], (i + 1, 2, 1)) for i in range(12)]  # request i: i + 1 tokens
    prompts = [1 + i % 2 for i in range(12)]
    np.savez(tmp_path / "r.npz", *arrs, prompt_tokens=np.array(prompts))
    tr = read_trace(import_routed_experts(tmp_path / "r.npz", tmp_path / "t", M))
    assert tr.prompt_tokens.tolist() == prompts
    assert tr.output_tokens.tolist() == [i + 1 - p + 1 for i, p in enumerate(prompts)]


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_real_engine_log_imports_through_the_cli(tmp_path: Path) -> None:
    """Red if the real on-device engine's log (turn, phase, step, slot, expert, weight,
    '#' header lines, 6 experts per token, prefill steps lacking a layer) needs any hand
    conversion, or loses a row: 28 prefill tokens, 128 decode steps, 27 gaps; red too if
    its weights are dropped because of those gaps (tokens.parquet keeps the 7,461 logged
    (token, layer) pairs' weights, each summing to 1 as the engine's renormalised top-6,
    and 27 null rows at layer 47, the layer the log lacks for its prefill tokens)."""
    out = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.trace_cli", "import", "table",
         str(EDGE / "qwen.route.csv"), str(tmp_path / "t"), "--model", "qwen3-30b-a3b",
         "--top-k", "6"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "27 (token, layer) pairs without rows" in out.stdout
    tr = read_trace(tmp_path / "t")
    assert tr.prompt_tokens.tolist() == [28] and tr.output_tokens.tolist() == [129]
    assert int(tr.counts.sum()) == 44766  # every routed row
    from fmoesim.trace.stats import format_report  # inspect says so too, not the import alone

    assert "; layer gaps: 27 (token, layer) pairs route nothing" in format_report(tr)
    tok = read_tokens(tr)
    assert int(tok.logged.sum()) == 44766 // 6 and set(tok.layer[~tok.logged].tolist()) == {47}
    np.testing.assert_allclose(tok.topk_weights[tok.logged].sum(axis=1), 1.0, atol=2e-3)


def test_a_table_without_positions_reads_each_return_to_layer_0_as_a_token(tmp_path: Path) -> None:
    """Red if a table without a position column is not read token by token (each return
    to an earlier layer a new token), or its report calls those "position restarts", a
    column it does not have."""
    src = tmp_path / "r.csv"
    src.write_text('layer,experts\n0,"[0, 1]"\n1,"[2, 3]"\n0,"[1, 2]"\n1,"[0, 3]"\n')
    _, rep = import_table(src, tmp_path / "t", M)
    assert (rep.tokens, rep.steps_restarted) == (2, 1)
    assert "1 returns to an earlier layer read as new tokens (no position column)" in rep.lines()


def test_a_header_may_count_the_dense_blocks_in_its_layers(tmp_path: Path) -> None:
    """Red if a llama.cpp-style header whose ``n_layer`` counts every block (a model with
    a dense first block, as DeepSeek's) is refused as the log of another model: the
    model counts its MoE layers only."""
    import dataclasses

    src = tmp_path / "r.csv"
    src.write_text(
        '# n_layer=3 n_expert=4 n_expert_used=2\nlayer,experts\n0,"[0, 1]"\n1,"[2, 3]"\n'
    )
    import_table(src, tmp_path / "t", dataclasses.replace(M, dense_layers=1))
    with pytest.raises(FmoesimError, match="the header's n_layer is the model's layers, 2 "):
        import_table(src, tmp_path / "t2", M)


def test_a_position_logged_at_no_layer_is_reported(tmp_path: Path) -> None:
    """A token missing from every layer leaves a hole in its step's positions: the
    import says so.  Red if it is dropped without a word (the report counted only pairs
    missing at some layers), or if a log whose positions restart each step reports
    holes it does not have."""
    src = tmp_path / "r.csv"
    src.write_text(
        'position,layer,experts\n0,0,"[0, 1]"\n0,1,"[2, 3]"\n2,0,"[1, 2]"\n2,1,"[0, 3]"\n'
        '3,0,"[1, 3]"\n3,1,"[0, 2]"\n'
    )
    _, rep = import_table(src, tmp_path / "t", M)
    assert (rep.tokens, rep.position_holes, rep.missing_pairs) == (3, 1, 0)
    assert "1 position within a step's range logged at no layer" in "\n".join(rep.lines())
    src.write_text(
        'position,layer,experts\n0,0,"[0, 1]"\n0,1,"[2, 3]"\n0,0,"[1, 2]"\n0,1,"[0, 3]"\n'
    )
    _, rep = import_table(src, tmp_path / "t2", M)
    assert (rep.tokens, rep.steps_restarted, rep.position_holes) == (2, 1, 0)
