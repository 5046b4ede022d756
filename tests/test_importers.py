"""Importers (``fmoesim-trace import``): vLLM route logs and MoE-Infinity EAMC arrays."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.simulate import simulate
from fmoesim.errors import FmoesimError
from fmoesim.trace import read_trace
from fmoesim.trace.importers import import_eamc, import_vllm_routes
from policies.fmoe import FMoE
from policies.lru import LRU
from tests.tiny import TINY_HW, small_model

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "routing" / "mixtral-8x7b-vllm-top2"
M = small_model(2, 4, 2)  # 2 layers x 4 experts, top-2


def rows(routes: dict[int, list[list[list[int]]]], dataset: str = "d") -> list[dict]:
    """routes[request][token][layer] = the token's two experts at that layer."""
    out = []
    for req, toks in routes.items():
        for t, per_layer in enumerate(toks):
            for layer, ex in enumerate(per_layer):
                out.append(
                    {
                        "dataset": dataset,
                        "problem_id": req,
                        "layer": layer,
                        "token_idx": t,
                        "experts": ex,
                        "gating_probs": [0.6, 0.4],
                    }
                )
    return out


def write_jsonl(path: Path, items: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def test_routes_become_iterations_with_exact_counts(tmp_path):
    routes = {
        0: [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 3], [0, 1]]],
        1: [[[3, 2], [1, 0]], [[3, 2], [1, 2]]],
    }
    src = write_jsonl(tmp_path / "r.jsonl", rows(routes))
    tr = read_trace(import_vllm_routes(src, tmp_path / "t", M, prompt_tokens=2)[0])
    assert tr.num_requests == 2 and tr.probs is None
    assert tr.prompt_tokens.tolist() == [2, 2] and tr.output_tokens.tolist() == [2, 1]
    # request 0: prefill = tokens 0 and 1, then token 2 alone
    np.testing.assert_array_equal(tr.counts[0], [[2, 1, 1, 0], [0, 0, 2, 2]])
    np.testing.assert_array_equal(tr.counts[1], [[0, 1, 0, 1], [1, 1, 0, 0]])
    # request 1: its two tokens are its whole prefill
    np.testing.assert_array_equal(tr.counts[2], [[0, 0, 2, 2], [1, 2, 1, 0]])
    assert tr.manifest.source["format"] == "vllm-routes"
    # a top-k-only trace runs: fMoE falls back to routed-token shares for its maps
    r = simulate(tr, M, TINY_HW, FMoE(prefetch_distance=1), 4 * M.expert_size_bytes)
    assert r.summary["accesses"] > 0


def test_tokens_missing_from_some_layer_are_dropped_and_counted(tmp_path):
    items = rows({0: [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 3], [0, 1]]]})
    items = [r for r in items if not (r["token_idx"] == 2 and r["layer"] == 1)]
    items.append({**items[0], "token_idx": 7})  # a stray row on layer 0 only
    src = write_jsonl(tmp_path / "r.jsonl", items)
    path, dropped = import_vllm_routes(src, tmp_path / "t", M)
    assert dropped == 2  # token 2's layer-0 row, token 7's row
    assert read_trace(path).num_iterations == 2


@pytest.mark.parametrize(
    ("change", "rule"),
    [
        ({"layer": 2}, "line 1: layer in [0, 2)"),
        ({"experts": [0, 0]}, "line 1: experts holds 2 distinct ids in [0, 4)"),
        ({"experts": [0, 9]}, "line 1: experts holds 2 distinct ids"),
        ({"gating_probs": [0.5]}, "line 1: gating_probs holds 2 numbers"),
        ({"token_idx": -1}, "line 1: token_idx >= 0"),
    ],
)
def test_bad_rows_are_refused_with_line_and_rule(tmp_path, change, rule):
    items = rows({0: [[[0, 1], [2, 3]], [[0, 2], [2, 3]]]})
    items[0] = {**items[0], **change}
    src = write_jsonl(tmp_path / "r.jsonl", items)
    with pytest.raises(FmoesimError, match=rule.replace("[", r"\[").replace(")", r"\)")):
        import_vllm_routes(src, tmp_path / "t", M)
    assert not (tmp_path / "t").exists()


def test_eamc_rows_become_one_iteration_requests(tmp_path):
    eamc = np.zeros((3, 2, 4))
    eamc[0] = [[2, 1, 1, 0], [0, 0, 2, 2]]  # 2 tokens x top-2
    eamc[2] = [[1, 1, 0, 0], [0, 1, 0, 1]]  # 1 token; slot 1 is unused
    np.save(tmp_path / "e.npy", eamc)
    tr = read_trace(import_eamc(tmp_path / "e.npy", tmp_path / "t", M))
    assert tr.num_requests == 2 and tr.num_tokens.tolist() == [2, 1]
    np.testing.assert_array_equal(tr.counts, eamc[[0, 2]])
    eamc[2, 1] = [0, 1, 0, 0]  # layer 1 routes fewer tokens than layer 0
    np.save(tmp_path / "bad.npy", eamc)
    with pytest.raises(FmoesimError, match="row 2: every layer routes the same"):
        import_eamc(tmp_path / "bad.npy", tmp_path / "u", M)
    np.save(tmp_path / "shape.npy", np.zeros((2, 3, 4)))
    with pytest.raises(FmoesimError, match=r"shape: \(capacity, 2, 4\)"):
        import_eamc(tmp_path / "shape.npy", tmp_path / "v", M)
    (tmp_path / "empty.npy").write_bytes(b"")  # an interrupted dump: red on numpy's EOFError
    with pytest.raises(FmoesimError, match="empty.npy: not a readable .npy array"):
        import_eamc(tmp_path / "empty.npy", tmp_path / "w", M)


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_real_mixtral_routes_import_through_the_cli(tmp_path):
    out = tmp_path / "real"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fmoesim.cli.trace_cli",
            "import",
            "vllm-routes",
            str(REAL),
            str(out),
            "--model",
            "mixtral-8x7b",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    # every row is kept: tokens a layer lacks route nothing there (the complete-token
    # import, import_vllm_routes, drops them)
    assert "18668 rows -> 4 requests, 585 tokens" in p.stdout
    assert "52 (token, layer) pairs without rows" in p.stdout
    tr = read_trace(out)
    assert tr.num_requests == 4 and tr.num_layers == 32 and tr.num_experts == 8
    assert tr.manifest.layer_gaps and tr.manifest.source["format"] == "vllm-routes"
    sums = tr.counts.sum(axis=2)  # one token x top-2, or 0 where the log lacks the layer
    assert set(np.unique(sums).tolist()) == {0, 2} and int((sums == 0).sum()) == 52
    from fmoesim.config.build import load_preset
    from fmoesim.specs import ModelSpec

    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    budget = 4 * 32 * model.expert_size_bytes  # 4 of 8 experts per layer
    r = simulate(tr, model, TINY_HW, LRU(), budget, timing=False, experts_per_layer=4)
    assert 0.3 < r.summary["hit_rate"] < 0.9


def test_gating_weights_become_tokens_parquet_and_are_checked(tmp_path):
    from fmoesim.trace.reader import read_tokens

    routes = {0: [[[0, 1], [2, 3]], [[0, 2], [2, 3]], [[1, 3], [0, 1]]]}
    src = write_jsonl(tmp_path / "r.jsonl", rows(routes))
    tr = read_trace(import_vllm_routes(src, tmp_path / "t", M, prompt_tokens=2)[0])
    assert tr.manifest.has_tokens
    tok = read_tokens(tr)
    assert tok.topk_ids.shape == (3 * 2, 2)  # 3 tokens x 2 layers
    assert tok.topk_ids[:, 0].tolist() == [0, 2, 0, 2, 1, 0]
    np.testing.assert_allclose(tok.topk_weights, [[0.6, 0.4]] * 6, atol=1e-3)
    assert tok.iteration.tolist() == [0, 0, 0, 0, 1, 1]  # two prefill tokens, then one
    # ids that disagree with the routing are refused, naming the rule
    import pyarrow.parquet as pq

    t = pq.read_table(tmp_path / "t" / "tokens.parquet").to_pydict()
    t["topk_ids"][0] = [3, 1]
    import pyarrow as pa

    from fmoesim.trace.schema import tokens_schema

    pq.write_table(pa.table(t, schema=tokens_schema(2)), tmp_path / "t" / "tokens.parquet")
    with pytest.raises(FmoesimError, match="top-k ids add up to expert_counts"):
        read_tokens(read_trace(tmp_path / "t"))
    # the error names the (iteration, layer) whose counts differ, not the iteration's row 0
    t["topk_ids"][0] = [0, 1]
    t["topk_ids"][3] = [0, 3]  # token 1, layer 1 of iteration 0
    pq.write_table(pa.table(t, schema=tokens_schema(2)), tmp_path / "t" / "tokens.parquet")
    with pytest.raises(FmoesimError, match=r"tokens\.parquet row 1: request 0, iteration 0, "
                       r"layer 1: the first row of that layer's tokens"):  # fmt: skip
        read_tokens(read_trace(tmp_path / "t"))
    # without weights in the log, no tokens.parquet
    bare = [{k: v for k, v in r.items() if k != "gating_probs"} for r in rows(routes)]
    tr2 = read_trace(
        import_vllm_routes(write_jsonl(tmp_path / "b.jsonl", bare), tmp_path / "u", M)[0]
    )
    assert not tr2.manifest.has_tokens


def test_an_encoder_decoder_model_is_refused_before_anything_is_written(tmp_path):
    # red if an importer writes an encoder-decoder manifest over decoder-only rows (the
    # reader would then refuse the finished trace) or leaves a partial directory behind
    ed = dataclasses.replace(M, encoder_layers=1)
    src = write_jsonl(tmp_path / "r.jsonl", rows({0: [[[0, 1], [2, 3]], [[0, 2], [2, 3]]]}))
    with pytest.raises(FmoesimError, match="is an encoder-decoder model"):
        import_vllm_routes(src, tmp_path / "t", ed)
    assert not (tmp_path / "t").exists()
