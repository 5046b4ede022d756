"""Policies on real routing (``python -m fmoesim.validation.real_routing``): the top-k
view, the agreement measures, path predictability, the command and its refusals, and
the committed report against a rerun on the real logs (where ``../shared/data`` holds
them)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from fmoesim.config.build import load_preset, policy_from_preset
from fmoesim.errors import FmoesimError
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from fmoesim.trace.importers import import_vllm_routes
from fmoesim.trace.table import write_routed
from fmoesim.validation import real_routing as rr
from tests.tiny import small_model

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "routing" / "mixtral-8x7b-vllm-top2"
REPORT = ROOT / "traces" / "real-routing-policies.md"
MIXTRAL = load_preset("model", "mixtral-8x7b", ModelSpec)


def test_kendall_tau_hand_computed() -> None:
    """Red if a tie counts as a concordant pair, or the sign of a pair is taken from one
    score only: three pairs, computed by hand."""
    a = {"x": 1.0, "y": 2.0, "z": 3.0}
    assert rr.kendall_tau(a, a) == 1.0
    assert rr.kendall_tau(a, {"x": 3.0, "y": 2.0, "z": 1.0}) == -1.0
    # (x, y) +1, (x, z) +1, (y, z) -1
    assert rr.kendall_tau(a, {"x": 1.0, "y": 3.0, "z": 2.0}) == pytest.approx(1 / 3)
    # (x, y) tied: neither; (x, z) +1, (y, z) +1
    assert rr.kendall_tau(a, {"x": 1.0, "y": 1.0, "z": 2.0}) == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="different keys"):
        rr.kendall_tau(a, {"x": 1.0, "y": 2.0})


def test_flipped_pairs_need_every_sample() -> None:
    """Red if a pair counts as flipped when only some samples order it against the real
    scores, or a tie in the real scores counts."""
    real = {"a": 1.0, "b": 2.0, "c": 2.0}
    both = [{"a": 2.0, "b": 1.0, "c": 0.5}, {"a": 3.0, "b": 1.0, "c": 0.5}]
    assert rr.flipped_pairs(real, both) == [("b", "a"), ("c", "a")]
    one = [{"a": 2.0, "b": 1.0, "c": 3.0}, {"a": 0.0, "b": 1.0, "c": 3.0}]
    assert rr.flipped_pairs(real, one) == []


def _typed_log(dst: Path, model: ModelSpec, requests: list[str]) -> Path:
    """A top-k trace whose tokens are of type A (experts 0 and 1 in every layer) or B
    (2 and 3): one request per string of ``requests``, one token per letter."""
    route = {"A": [0, 1], "B": [2, 3]}
    arrays = []
    for r, types in enumerate(requests):
        ids = np.array([[route[t]] * model.num_layers for t in types], dtype=np.int64)
        arrays.append((f"r/{r}", ids, np.zeros(ids.shape), 1))
    write_routed(dst, model, arrays, False, "test", [], True)
    return dst


def test_path_predictability_hand_computed(tmp_path: Path) -> None:
    """Types of ``_typed_log``.  Requests A, A, B and A, B, B: the nearest token of the
    other request is always one of the same type (nearest path 1); request 1's top-2 is
    B's experts, which request 0's tokens route to 0, 0, 1 times of 2, and request 0's
    top-2 is A's, which request 1's route to 1, 0, 0: popularity 2/6.  Requests A, B and
    A, A: request 0's B has no B in the other request, its nearest is request 1's first
    A (no overlap anywhere; the first on a tie) and it predicts nothing: nearest path
    3/4.  Red if the nearest token may be the token itself or of its own request (1 in
    the second case), or the popularity counts the token's own request (2/3 in the
    first)."""
    model = small_model(4, 8, 2)
    tr = read_trace(_typed_log(tmp_path / "t", model, ["AAB", "ABB"]))
    nearest, popular = rr.path_predictability(tr, distance=1)
    assert nearest == pytest.approx(1.0)
    assert popular == pytest.approx(1 / 3)
    tr = read_trace(_typed_log(tmp_path / "t2", model, ["AB", "AA"]))
    nearest, _ = rr.path_predictability(tr, distance=2)
    assert nearest == pytest.approx(3 / 4)
    with pytest.raises(ValueError, match="distance"):
        rr.path_predictability(tr, distance=4)
    one = read_trace(_typed_log(tmp_path / "one", model, ["AB"]))
    with pytest.raises(FmoesimError, match="two requests"):
        rr.path_predictability(one)


def test_own_path_predictability_hand_computed(tmp_path: Path) -> None:
    """Types of ``_typed_log``, distance 1, gap 2.  Request A, B, A, B: tokens 0 and 1
    have no token two positions back (left out); token 2 (A) has token 0 (A), token 3
    (B) has tokens 0 and 1 and picks 1 (B): 1.  Request A, B, B, A: token 2 (B) has only
    token 0 (A) and predicts nothing, token 3 (A) picks token 0: 1/2.  Red if the
    previous token (token 1, a B, for token 2 of the second request) or the token itself
    may be the nearest, or tokens of another request may (the first request's B's)."""
    model = small_model(4, 8, 2)
    tr = read_trace(_typed_log(tmp_path / "t", model, ["ABAB"]))
    assert rr.own_path_predictability(tr, distance=1) == pytest.approx(1.0)
    tr = read_trace(_typed_log(tmp_path / "t2", model, ["ABBA"]))
    assert rr.own_path_predictability(tr, distance=1) == pytest.approx(0.5)
    tr = read_trace(_typed_log(tmp_path / "t3", model, ["ABAB", "ABBA"]))
    assert rr.own_path_predictability(tr, distance=1) == pytest.approx(0.75)
    short = read_trace(_typed_log(tmp_path / "t4", model, ["AB", "BA"]))
    with pytest.raises(FmoesimError, match="2 or more positions before it"):
        rr.own_path_predictability(short)


def test_topk_view_keeps_only_the_routed_experts(tmp_path: Path) -> None:
    """Red if the view keeps gate probabilities, embeddings or the speculative
    prediction (fMoE or a speculative policy would then see more than real top-k logs
    give), or moves an expert to another token, layer or request."""
    tr = rr.synthetic_sample(MIXTRAL, "routing-mixtral-8x7b", 3, 6, 0, tmp_path / "v")
    full = read_trace(tmp_path / "v-full")
    assert full.probs is not None and full.spec_probs is not None
    assert tr.probs is None and tr.spec_probs is None and tr.embedding.shape[1] == 0
    np.testing.assert_array_equal(tr.counts, full.counts)
    np.testing.assert_array_equal(tr.iter_start, full.iter_start)
    assert (tr.num_tokens == 1).all()


def test_topk_view_refuses_a_prompt_of_many_tokens(tmp_path: Path) -> None:
    """Red if a trace with multi-token prefills is cut into the view (its prefill counts
    are not one token's top-k): one line naming the trace, the row and the rule."""
    tr = read_trace(ROOT / "traces" / "default")
    with pytest.raises(FmoesimError, match=r"iteration row 0 feeds \d+ tokens \(rule: one"):
        rr.topk_view(tr, MIXTRAL, tmp_path / "v")


def _route_log(path: Path, requests: list[str]) -> Path:
    """``_typed_log``'s requests as a vLLM route log of Mixtral-8x7B (32 layers)."""
    route = {"A": [0, 1], "B": [2, 3]}
    with path.open("w") as f:
        for r, types in enumerate(requests):
            for layer in range(MIXTRAL.num_layers):
                for t, kind in enumerate(types):
                    row = {"problem_id": r, "layer": layer, "experts": route[kind],
                           "gating_probs": [0.6, 0.4], "token_idx": t}  # fmt: skip
                    f.write(json.dumps(row) + "\n")
    return path


def test_command_writes_the_report(tmp_path: Path) -> None:
    """Red if a workload, a budget or a policy is missing from the report, or the
    agreement table is not written: two policies, one budget, one sample per synthetic
    workload on a small route log."""
    log = _route_log(tmp_path / "log.jsonl", ["AABAB", "ABBBA", "BBAAB"])
    out = tmp_path / "report.md"
    rr.main(["--real", str(log), "--out", str(out), "--seeds", "1", "--policies", "lru,lfu",
             "--budgets-gb", "24", "--blocking-policies", "lru,brainstorm"])  # fmt: skip
    text = out.read_text()
    blocking = text.split("## Blocking time in MoE-Infinity's setting", 1)[1]
    assert re.search(r"^\| lru \| 100 \| 100 \(100 to 100\) \|$", blocking, re.M)
    assert re.search(r"^\| brainstorm \| \d+ \| \d+ \(\d+ to \d+\) \|$", blocking, re.M)
    assert "| 24 GB | " in text and "## 24 GB of experts" in text
    assert re.search(r"^\| lru \| [\d.]+ \| [\d.]+ \([\d.]+ to [\d.]+\) \|", text, re.M)
    assert re.search(r"^\| lfu \| ", text, re.M)
    assert re.search(r"^\| real \| [\d.]+ \| [\d.]+ \| -?[\d.]+ \| [\d.]+ \|$", text, re.M)
    assert "`workload=routing-mixtral-8x7b-curves` (curves)" in text
    assert "`workload=synthetic` (default)" in text
    assert "`workload=routing-mixtral-8x7b` (paths)" in text


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--real", "no/such/log"], "--real no/such/log: no such file or directory"),
        (["--policies", "moepic"], "--policies moepic: needs a speculative prediction"),
        (["--policies", "nosuch"], "nosuch"),
        (["--budgets-gb", "24,0"], "--budgets-gb '0': must be a positive number of GB"),
        (["--budgets-gb", "x"], "--budgets-gb 'x': must be a positive number of GB"),
        (["--seeds", "0"], "--seeds 0: must be at least 1"),
        (["--blocking-policies", "brainstorm"], "--blocking-policies brainstorm: must hold lru"),
        (
            ["--blocking-policies", "lru,moepic"],
            "--blocking-policies moepic: needs a speculative prediction",
        ),
    ],
)
def test_command_refuses_bad_input(
    tmp_path: Path, args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Red if bad input runs (or writes a report) instead of one line naming the flag and
    the rule, exit status 2."""
    log = _route_log(tmp_path / "log.jsonl", ["AB", "BA"])
    out = tmp_path / "report.md"
    base = ["--real", str(log), "--out", str(out)]
    with pytest.raises(SystemExit) as exc:
        rr.run_or_exit(rr.PROG, rr.main, [*base, *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not out.exists()


def test_blocking_section_by_hand() -> None:
    """Red if a blocking time is not taken against on-demand fetching's (lru) and vanilla
    prefetching's of the same trace, or a workload's samples are not summed up as mean
    and range: real logs lru 10 s, vanilla 8 s, MoE-Infinity 4 s; two samples lru 10 and
    20 s, vanilla 5 and 10 s, MoE-Infinity 5 and 15 s."""
    B = rr.Blocking
    rows = [B("real", -1, "lru", 10.0), B("real", -1, "moe-infinity-vanilla", 8.0),
            B("real", -1, "moe-infinity", 4.0)]  # fmt: skip
    for seed, (lru, van, moe) in enumerate([(10.0, 5.0, 5.0), (20.0, 10.0, 15.0)]):
        rows += [B("paths", seed, "lru", lru), B("paths", seed, "moe-infinity-vanilla", van),
                 B("paths", seed, "moe-infinity", moe)]  # fmt: skip
    lines = rr.blocking_section(rows)
    assert ("| policy | real: % of on-demand | paths: % of on-demand | real: % of vanilla "
            "| paths: % of vanilla |") in lines  # fmt: skip
    # MoE-Infinity: 4/10 = 40% and 4/8 = 50% on the real logs; 5/10, 15/20 = 50, 75% (mean
    # 62, rounded half to even) and 5/5, 15/10 = 100, 150% (mean 125) on the samples
    assert "| moe-infinity | 40 | 62 (50 to 75) | 50 | 125 (100 to 150) |" in lines
    assert "| lru | 100 | 100 (100 to 100) | 125 | 200 (200 to 200) |" in lines
    assert rr.blocking_section([]) == []


def _committed(policy: str, gb: float) -> tuple[float, float]:
    """(TPOT ms, hit %) of ``policy`` on the real logs in the committed report: the
    cells under ``TPOT real`` and ``hit real`` of the budget's table."""
    section = REPORT.read_text().split(f"## {gb:g} GB of experts", 1)[1]
    rows = [ln.strip("|").split("|") for ln in section.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in rows[0]]
    for cells in rows[1:]:
        if cells[0].strip() == policy:
            return float(cells[header.index("TPOT real")]), float(cells[header.index("hit real")])
    raise AssertionError(f"{policy} at {gb:g} GB is not in {REPORT}")


@pytest.mark.shared
@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_committed_report_matches_a_rerun(tmp_path: Path) -> None:
    """Red if the committed report is stale: LRU's and fMoE's TPOT and hit rate on the
    real logs at 24 GB, the real logs' path predictability (across requests and within
    them), and BrainStorm's and MoE-Infinity's blocking time in MoE-Infinity's setting
    against on-demand fetching's (the MoE-Infinity scoreboard's notes cite them), rerun
    now."""
    hw = load_preset("hardware", rr.HARDWARE, HardwareSpec)
    path, _ = import_vllm_routes(REAL, tmp_path / "real", MIXTRAL)
    real = read_trace(path)
    for policy in ("lru", "fmoe"):
        rows = rr.run_all({"real": [(-1, real)]}, MIXTRAL, hw, [policy], [24.0])
        tpot, hit = _committed(policy, 24.0)
        assert round(rows[0].tpot_ms, 1) == tpot
        assert round(100 * rows[0].hit_rate, 1) == hit
    nearest, popular = rr.path_predictability(real, rr.PATH_DISTANCE)
    own = rr.own_path_predictability(real, rr.PATH_DISTANCE)
    gap = 100 * nearest - 100 * popular
    row = f"| real | {100 * nearest:.1f} | {100 * popular:.1f} | {gap:.1f} | {100 * own:.1f} |"
    assert row in REPORT.read_text()
    blocking = {
        r.policy: r.stall_s
        for r in rr.run_blocking({"real": [(-1, real)]}, ["lru", "brainstorm", "moe-infinity"])
    }
    section = REPORT.read_text().split("## Blocking time in MoE-Infinity's setting", 1)[1]
    for policy in ("brainstorm", "moe-infinity"):
        pct = 100 * blocking[policy] / blocking["lru"]
        assert re.search(rf"^\| {policy} \| {pct:.0f} \| ", section, re.M), (policy, pct)


def test_every_default_policy_decides_on_routed_experts_only() -> None:
    """Red if a policy of the default list needs a speculative prediction (it would run
    without its input on both sides and its row would say nothing)."""
    assert not [p for p in rr.POLICIES if getattr(policy_from_preset(p), "uses_spec", False)]


@pytest.mark.shared
@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_paths_workload_gives_fmoe_the_real_logs_tpot(tmp_path: Path) -> None:
    """Red if the workload fitted to the real logs' paths (routing statistics only)
    stops giving fMoE the TPOT it has on the real logs: one sample (seed 0) within 4%
    at 24 GB (measured: +2.1%), where the workload fitted to the hit-rate curves alone
    is over 10% slower (+13.3%)."""
    hw = load_preset("hardware", rr.HARDWARE, HardwareSpec)
    path, _ = import_vllm_routes(REAL, tmp_path / "real", MIXTRAL)
    real = read_trace(path)
    tokens = int(np.median(real.output_tokens))
    traces = {"real": [(-1, real)]}
    for w in ("curves", "paths"):
        t = rr.synthetic_sample(MIXTRAL, rr.WORKLOADS[w], real.num_requests, tokens, 0,
                                tmp_path / w)  # fmt: skip
        traces[w] = [(0, t)]
    rows = {r.workload: r.tpot_ms for r in rr.run_all(traces, MIXTRAL, hw, ["fmoe"], [24.0])}
    assert abs(rows["paths"] / rows["real"] - 1) < 0.04, rows
    assert rows["curves"] / rows["real"] - 1 > 0.10, rows
