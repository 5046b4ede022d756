"""The calibrated Mixtral presets against the real Mixtral routing: the curve-only preset's
LRU and LFU hit rates at every per-layer capacity 1..7 within 5 points, and the paths
preset's (routing-mixtral-8x7b) curves and path statistics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from fmoesim.config.build import load_preset
from fmoesim.config.schema import CONF_DIR
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from fmoesim.trace.importers import import_vllm_routes
from fmoesim.workload.calibrate import (
    dependence_at,
    depth_dependence,
    depth_profile,
    frequency_skew,
    gini,
    hit_curves,
    layer_dependence,
    pair_lift,
    reuse_probability,
    synthetic_like,
    top1_stickiness,
    transition_stickiness,
)
from tests.tiny import small_model, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "routing" / "mixtral-8x7b-vllm-top2"
PRESET = Path(CONF_DIR) / "workload" / "routing-mixtral-8x7b-curves.yaml"


def routing_knobs() -> dict:
    """The preset's routing knobs (what the calibration fitted)."""
    syn = OmegaConf.to_container(OmegaConf.load(PRESET).synthetic)
    assert isinstance(syn, dict)
    return {k: syn[k] for k in ("skew", "locality", "noise", "request_jitter", "depth_share")}


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_calibrated_preset_matches_real_mixtral_lru_and_lfu(tmp_path):
    real, syn = _curves_within_5_points(routing_knobs(), tmp_path)
    assert abs(reuse_probability(syn) - reuse_probability(real)) < 0.05


def _curves_within_5_points(knobs: dict, tmp_path: Path) -> tuple:
    """The real Mixtral trace and a 16-request sample of ``knobs``, after checking that
    the sample's LRU and LFU hit rates are within 5 points of the real ones at every
    per-layer capacity 1..7."""
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    real = read_trace(import_vllm_routes(REAL, tmp_path / "real", model)[0])
    tokens = int(np.median(real.output_tokens))
    syn = synthetic_like(model, knobs, tmp_path / "syn", 16, tokens, seed=0)
    want, got = hit_curves(real, model, hw), hit_curves(syn, model, hw)
    for p in ("lru", "lfu"):
        assert len(got[p]) == 7
        diff = 100 * np.abs(np.asarray(got[p]) - np.asarray(want[p]))
        assert diff.max() <= 5.0, (p, diff.round(1).tolist())
    return real, syn


def test_statistics_by_hand(tmp_path):
    m = small_model(2, 4, 1)
    # one request, tokens route (layer 0, layer 1): (0,1) (0,2) (1,2) (0,1)
    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0, 1], [0, 2], [1, 2], [0, 1]], m))
    # reuse: token 2 shares 1 of 2 experts with token 1 (layer 0), token 3 shares 1 of 2
    # (layer 1), token 4 shares none -> 2 / 6
    assert reuse_probability(tr) == pytest.approx(2 / 6)
    assert gini(np.array([1.0, 1, 1, 1])) == 0.0
    assert gini(np.array([0.0, 0, 0, 4])) == pytest.approx(0.75)
    g, mm = frequency_skew(tr)
    # layer 0 frequencies (3, 1, 0, 0), layer 1 (0, 2, 2, 0)
    assert g == pytest.approx((gini(np.array([3.0, 1, 0, 0])) + gini(np.array([0.0, 2, 2, 0]))) / 2)
    assert mm == pytest.approx((3 / 1 + 2 / 1) / 2)
    # layer 0 -> 1: e0 -> {1, 2, 1}, e1 -> {2}: P(next) = (0, .5, .5, 0);
    # TV(e0) = .5 * (|2/3 - .5| + |1/3 - .5|) = 1/6, TV(e1) = .5 * (.5 + .5) = .5
    assert layer_dependence(tr) == pytest.approx(0.75 * (1 / 6) + 0.25 * 0.5)


def _routed(routes: list[list[int]], requests: list[int], experts: int = 2) -> SimpleNamespace:
    """A stand-in trace: one-token rows routed top-1 to ``routes[row][layer]``."""
    c = np.zeros((len(routes), len(routes[0]), experts), np.int32)
    for r, route in enumerate(routes):
        for layer, e in enumerate(route):
            c[r, layer, e] = 1
    return SimpleNamespace(counts=c, iter_request=np.asarray(requests))


def test_depth_statistics_by_hand():
    """Red if dependence_at reads the wrong layer pair, or if depth_profile counts the
    dependence a request's own mix explains (no shuffle floor, or a shuffle across
    requests)."""
    # layers 0 and 2 agree, layer 1 is independent of both
    tr = _routed([[0, 0, 0], [0, 1, 0], [1, 0, 1], [1, 1, 1]], [0, 1, 2, 3])
    # d = 2: P(e2 | e0) is one-hot, P(e2) = (.5, .5): TV .5 from either expert
    assert dependence_at(tr.counts, 2) == pytest.approx(0.5)
    # d = 1: layer 0 -> 1 and layer 1 -> 2 are independent: TV 0
    assert dependence_at(tr.counts, 1) == pytest.approx(0.0)
    # every row its own request: a within-request shuffle moves nothing, the floor is the
    # statistic itself
    assert depth_profile(tr, [1, 2]) == pytest.approx([0.0, 0.0])
    # two requests, each routing one expert everywhere: the dependence (.5 at d = 2) is
    # the requests' mix, which the shuffle keeps
    tr = _routed([[0, 0, 0], [0, 0, 0], [1, 1, 1], [1, 1, 1]], [0, 0, 1, 1])
    assert dependence_at(tr.counts, 2) == pytest.approx(0.5)
    assert depth_profile(tr, [2]) == pytest.approx([0.0])


def test_bundled_trace_is_the_curve_only_presets_trace(tmp_path):
    """Red if traces/default stops being the trace workload=routing-mixtral-8x7b-curves
    generates (traces/README.md says byte for byte): a knob of the preset edited, or the
    generator's draws changed, without the bundled trace following."""
    import json

    from fmoesim.workload.synthetic import SyntheticConfig, generate

    syn = OmegaConf.to_container(OmegaConf.load(PRESET).synthetic)
    assert isinstance(syn, dict)
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    generate(model, SyntheticConfig(**syn), tmp_path / "t")  # type: ignore[arg-type]
    bundled = ROOT / "traces" / "default"
    for name in ("requests.parquet", "iterations.parquet", "routing.parquet"):
        assert (tmp_path / "t" / name).read_bytes() == (bundled / name).read_bytes(), name
    params = json.loads((bundled / "trace.json").read_text())["source"]["params"]
    assert {k: params[k] for k in syn} == syn


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_calibrated_preset_keeps_real_mixtral_dependence_across_layers(tmp_path):
    """Red if the preset's depth_share drifts from the fit (or the knob stops linking
    distant layers): real Mixtral routing's dependence over 2-6 layers is reproduced
    within 0.01, and without depth_share it is not."""
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    real = read_trace(import_vllm_routes(REAL, tmp_path / "real", model)[0])
    want = depth_dependence(real)
    knobs = routing_knobs()
    got = depth_dependence(synthetic_like(model, knobs, tmp_path / "syn", 32, 128, seed=0))
    flat = depth_dependence(
        synthetic_like(model, {**knobs, "depth_share": 0.0}, tmp_path / "flat", 32, 128, seed=0)
    )
    assert abs(got - want) < 0.01, (got, want)
    assert want - flat > 0.04, (flat, want)


def test_stickiness_by_hand(tmp_path):
    m = small_model(2, 4, 1)
    # decode tokens (iterations 1..): layer 0 tops 0, 0, 1, 1 -> 2 of 3 pairs the same;
    # layer 1 tops 2, 3, 3, 2 -> 1 of 3; the prefill (iteration 0) is not counted
    routes = [[3, 3], [0, 2], [0, 3], [1, 3], [1, 2]]
    tr = read_trace(write_sequence_trace(tmp_path / "t", routes, m))
    assert top1_stickiness(tr) == pytest.approx(3 / 6)
    torch = pytest.importorskip("torch", reason="transition matrices are torch tensors")
    mat = torch.zeros((2, 3, 3))
    mat[0] = torch.tensor([[2.0, 1, 0], [0, 1, 0], [0, 0, 0]])  # diagonal 3 of 4
    mat[1] = torch.eye(3)  # diagonal 3 of 3
    torch.save(mat, tmp_path / "x_markov_transition_matrix.pt")
    s, e = transition_stickiness(tmp_path / "x_markov_transition_matrix.pt")
    assert (s, e) == (pytest.approx((0.75 + 1.0) / 2), 3)


def test_pair_lift_by_hand(tmp_path):
    from tests._baseline_helpers import Iteration, write_trace

    m = small_model(1, 4, 2)
    # one-token iterations routing (0,1), (0,1), (2,3), (0,2): P(0) = 3/4, P(1) = P(2) = 1/2
    its = [Iteration(tokens=[[pair]]) for pair in ([0, 1], [0, 1], [2, 3], [0, 2])]
    tr = read_trace(write_trace(tmp_path / "t", m, [its], with_spec=False))
    # the most frequent pair (0, 1): (2/4) / (3/4 * 2/4) = 4/3; the next, (0, 2) (ties go to
    # the earlier pair): (1/4) / (3/4 * 2/4) = 2/3
    assert pair_lift(tr, top=1) == pytest.approx(4 / 3)
    assert pair_lift(tr, top=2) == pytest.approx(1.0)


QWEN3 = ROOT.parent / "shared" / "data" / "routing" / "qwen3-coactivation"


@pytest.mark.skipif(not QWEN3.is_dir(), reason="../shared/data (Qwen3 aggregates) is absent")
def test_qwen3_preset_matches_the_real_heat_skew(tmp_path):
    from fmoesim.workload.calibrate import qwen3_stats

    real = qwen3_stats(QWEN3 / "coactivation_qwen3-30b-a3b.json")
    model = load_preset("model", "qwen3-30b-a3b", ModelSpec)
    skew = OmegaConf.load(Path(CONF_DIR) / "workload" / "routing-qwen3-30b-a3b.yaml")
    tr = synthetic_like(model, {"skew": float(skew.synthetic.skew)}, tmp_path / "t", 32, 128, 0)
    assert abs(frequency_skew(tr)[0] - real["heat_gini"]) < 0.02


@pytest.mark.parametrize(
    ("argv", "said"),
    [(["--real", "nosuch"], "--real nosuch: no such file or directory"),
     (["--real", "examples/route-table.csv"],
      "examples/route-table.csv line 1: each line is a JSON object"),
     (["--qwen3", "nosuch.json"], "--qwen3 nosuch.json: no such file or directory"),
     (["--qwen3", "{bad}"], "--qwen3 {bad}: not the data it names (KeyError: ")],
)  # fmt: skip
def test_a_bad_source_is_one_line_before_the_fit(tmp_path, argv, said):
    """Red if ``--real`` naming no file, or a CSV (the vLLM route-log format is JSON
    lines), ends in a Python traceback (exit status 1) instead of one line and exit
    status 2; if a mistyped ``--qwen3`` is taken for an absent one (its section silently
    skipped); if a JSON file of another kind fails only after the minutes of the fit,
    as a KeyError traceback; or if anything is written."""
    import subprocess
    import sys

    if "--real" not in argv and not REAL.is_dir():
        pytest.skip("../shared/data (real Mixtral routing) is absent")
    root = Path(__file__).resolve().parents[1]
    bad = tmp_path / "other.json"
    bad.write_text('{"something": "else"}')
    argv = [a.replace("{bad}", str(bad)) for a in argv]
    said = said.replace("{bad}", str(bad))
    out = tmp_path / "cal" / "report.md"
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.workload.calibrate", *argv, "--out", str(out)],
        capture_output=True, text=True, cwd=root, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        f"python -m fmoesim.workload.calibrate: error: {said}"
    ), lines
    assert not (tmp_path / "cal").exists()


PATHS_PRESET = Path(CONF_DIR) / "workload" / "routing-mixtral-8x7b.yaml"
CALIBRATION = ROOT / "traces" / "calibration.md"


def paths_knobs() -> dict:
    """The routing knobs of the paths preset."""
    syn = OmegaConf.to_container(OmegaConf.load(PATHS_PRESET).synthetic)
    assert isinstance(syn, dict)
    return {k: v for k, v in syn.items() if k not in ("num_requests", "seed")}


def test_fit_paths_scores_the_worst_of_the_curves_and_the_paths(tmp_path):
    """Red if a point's score is not the worst of its curve error and its three path
    errors (in points; the own-request one included), if the held knobs or depth_share
    are not the ones it ran with, or if the fit misses the knobs the stand-in for real
    routing was made with (token types that carry its paths, against none)."""
    from fmoesim.validation.real_routing import own_path_predictability, path_predictability
    from fmoesim.workload.calibrate import PATH_DISTANCE, PATH_FIXED, fit_paths

    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    knobs = {**PATH_FIXED, "depth_share": 0.5, "locality": 0.5, "token_types": 16,
             "type_zipf": 0.0, "cross_layer": 0.0}  # fmt: skip
    real = synthetic_like(model, {**knobs, "type_share": 0.9}, tmp_path / "r", 3, 24, seed=5)
    grid = {"type_share": (0.0, 0.9), "locality": (0.5,), "token_types": (16,),
            "type_zipf": (0.0,), "cross_layer": (0.0,)}  # fmt: skip
    ranked = fit_paths(real, model, hw, 0.5, grid=grid, num_requests=4)
    assert [c.knobs["type_share"] for c in ranked] == [0.9, 0.0]
    near_r, pop_r = path_predictability(real, PATH_DISTANCE)
    own_r = own_path_predictability(real, PATH_DISTANCE)
    for c in ranked:
        assert {k: c.knobs[k] for k in knobs} == knobs
        paths = (c.nearest - near_r, c.popularity - pop_r, c.own - own_r)
        want = 100 * max(abs(x) for x in paths)
        assert c.max_error_points == pytest.approx(max(c.curve_error_points, want))
    assert ranked[1].nearest - ranked[1].popularity < ranked[0].nearest - ranked[0].popularity


def test_paths_preset_holds_the_committed_fit():
    """Red if the paths preset's knobs drift from the best point of the committed path
    fit (traces/calibration.md), or if they lose their token types."""
    text = CALIBRATION.read_text()
    best = text.split("### Paths across layers", 1)[1].split("Best: `", 1)[1].split("`", 1)[0]
    fitted = {k: float(v) for k, v in (kv.split(": ") for kv in best.split(", "))}
    got = paths_knobs()
    assert set(got) == set(fitted)
    assert {k: float(v) for k, v in got.items()} == fitted
    assert got["type_share"] > 0


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (real Mixtral routing) is absent")
def test_paths_preset_matches_real_mixtral_curves_and_paths(tmp_path):
    """Red if the paths preset stops matching real Mixtral routing: LRU and LFU hit
    rates within 5 points at every C, and path predictability (nearest path,
    popularity and own request, three layers ahead, on as many requests as the real
    logs) within 5 points, where the curve-only preset misses the nearest path's gap to
    popularity and the own-request share by more than 10."""
    from fmoesim.validation.real_routing import own_path_predictability, path_predictability

    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    real, _ = _curves_within_5_points(paths_knobs(), tmp_path)
    tokens = int(np.median(real.output_tokens))
    few = synthetic_like(model, paths_knobs(), tmp_path / "few", real.num_requests, tokens, 0)
    near_r, pop_r = path_predictability(real)
    near, pop = path_predictability(few)
    assert abs(near - near_r) <= 0.05 and abs(pop - pop_r) <= 0.05, (near, pop, near_r, pop_r)
    own_r, own = own_path_predictability(real), own_path_predictability(few)
    assert abs(own - own_r) <= 0.05, (own, own_r)
    old = synthetic_like(model, routing_knobs(), tmp_path / "old", real.num_requests, tokens, 0)
    near_o, pop_o = path_predictability(old)
    assert (near_r - pop_r) - (near_o - pop_o) > 0.10
    assert own_r - own_path_predictability(old) > 0.10
