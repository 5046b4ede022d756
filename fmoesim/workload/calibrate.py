"""Calibrate the synthetic workload model on real routing data.

Run ``python -m fmoesim.workload.calibrate`` (``--real DIR --out traces/calibration.md``).

The real data (``../shared/data/routing/``, never copied into the project) are top-k
route logs of Mixtral-8x7B (imported with :func:`fmoesim.trace.importers.
import_vllm_routes`, one token per iteration), Qwen3-30B-A3B aggregates (per-layer expert
heat, within-layer co-activation lift) and token-to-token transition matrices.  The fit
searches a grid of the workload model's routing knobs (``skew``, ``locality``,
``noise``, ``request_jitter``) for the one whose per-layer LRU and LFU hit-rate curves
(a cache of C experts in every layer, C = 1..E-1) are closest to the real trace's in the
worst point; it also reports next-token reuse and per-layer frequency skew.  The fitted
knobs go into ``conf/workload/routing-mixtral-8x7b-curves.yaml``.  Qwen3-30B-A3B's heat
Gini fits ``skew`` (``routing-qwen3-30b-a3b.yaml``); Qwen1.5-MoE-A2.7B's transition
matrix fits ``skew`` and ``locality`` to its top-1 frequency Gini and top-1 stickiness
(``routing-qwen1.5-moe-a2.7b.yaml``), and Switch's the same two on switch-large-128's
decoder layers (``routing-switch.yaml``).  A second Mixtral fit (:func:`fit_paths`) adds the
workload model's token types and matches the hit-rate curves and how predictable a
token's experts three layers on are from other requests' tokens (path predictability,
:mod:`fmoesim.validation.real_routing`) together
(``routing-mixtral-8x7b.yaml``, the scoreboards' Mixtral workload).  The report with
its plot is written atomically (temp file, then rename).
"""

from __future__ import annotations

import itertools
import json
import math
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.atomic import atomic_file
from fmoesim.config.schema import PROJECT_ROOT
from fmoesim.errors import ArgumentParser, FmoesimError, run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace.reader import Trace
from fmoesim.validation.real_routing import PATH_DISTANCE

PROG = "python -m fmoesim.workload.calibrate"
#: where the real data of the committed calibration lie (never copied into the project)
SHARED = PROJECT_ROOT.parent / "shared"
#: The knobs searched, and their grid (a small one keeps the fit under a few minutes).
GRID: dict[str, Sequence[float]] = {
    "skew": (0.0, 0.3),
    "locality": (0.15, 0.25, 0.35),
    "noise": (1.25, 1.5, 2.0),
    "request_jitter": (0.0,),
}
POLICIES = ("lru", "lfu")
#: The grid of the path fit (:func:`fit_paths`): the routing knobs with the workload
#: model's token types.  ``noise`` and ``cross_layer`` are single values, the best of a
#: wider grid (1.5 or 2, 0 or 0.5, locality 0.4-0.7, type_share 0.4-0.7) scored without
#: the own-request statistic; the rest spans both that grid's best point (no context,
#: no repeats, 64 types, type_zipf 0) and the region where the own-request statistic
#: is met.
PATH_GRID: dict[str, Sequence[float]] = {
    "locality": (0.55, 0.7),
    "noise": (2.0,),
    "cross_layer": (0.5,),
    "type_share": (0.55, 0.85),
    "type_context": (0.0, 0.3),
    "type_repeat": (0.0, 0.5),
    "token_types": (64, 256),
    "type_zipf": (0.0, 1.0),
}
#: Knobs the path fit holds: no popularity profile shared by all requests (the real
#: logs' popularity, 27.3%, is near uniform routing's 25%: the token types' own
#: preferences are all the popularity they leave room for), no per-request jitter (the
#: fit above finds none)
PATH_FIXED: dict[str, float] = {"skew": 0.0, "request_jitter": 0.0}


def hit_curves(trace: Trace, model: ModelSpec, hardware: HardwareSpec) -> dict[str, list[float]]:
    """Hit rate of LRU and LFU with a cache of ``C`` experts per layer, C = 1..E-1."""
    from fmoesim.engine.simulate import simulate
    from policies.lfu import LFU
    from policies.lru import LRU

    S, L = model.expert_size_bytes, model.num_layers
    out: dict[str, list[float]] = {}
    for name, cls in (("lru", LRU), ("lfu", LFU)):
        out[name] = [
            simulate(
                trace, model, hardware, cls(), C * L * S, timing=False, experts_per_layer=C
            ).summary["hit_rate"]
            for C in range(1, model.num_experts)
        ]
    return out


def reuse_probability(trace: Trace) -> float:
    """Mean share of a token's experts that the previous token of the same request also
    used (next-token reuse), over decode iterations of one token."""
    used = trace.counts > 0  # (rows, L, E)
    num, den = 0, 0
    for r in range(trace.num_requests):
        a = int(trace.iter_start[r])
        b = a + int(trace.output_tokens[r])
        x = used[a:b]
        num += int((x[1:] & x[:-1]).sum())
        den += int(x[1:].sum())
    return num / den if den else math.nan


def frequency_skew(trace: Trace) -> tuple[float, float]:
    """Mean over layers of the Gini coefficient and the max/mean ratio of expert
    selection frequency."""
    return skew_of(trace.counts.sum(axis=0))


def skew_of(freq: np.ndarray) -> tuple[float, float]:
    """Mean over layers of the Gini coefficient and the max/mean ratio of the per-layer
    expert frequencies ``freq`` ``(L, E)``."""
    freq = np.asarray(freq, dtype=np.float64)
    return float(np.mean([gini(f) for f in freq])), float(
        np.mean(freq.max(axis=1) / np.maximum(freq.mean(axis=1), 1e-12))
    )


def layer_dependence(trace: Trace) -> float:
    """How much layer ``l``'s choice tells about layer ``l + 1``'s: the mean total
    variation distance between ``P(e_{l+1} | e_l)`` and ``P(e_{l+1})``, over layers and
    weighted by ``P(e_l)`` (0 = independent layers)."""
    return dependence_at(trace.counts, 1)


#: The layer distances of :func:`depth_dependence` (fMoE prefetches 1-6 layers ahead).
DEPTH_DISTANCES = (2, 3, 4, 5, 6)


def dependence_at(counts: np.ndarray, distance: int) -> float:
    """:func:`layer_dependence` between layers ``l`` and ``l + distance`` of a routed
    count array ``(rows, L, E)``."""
    c = (counts > 0).astype(np.float64)
    out = []
    for layer in range(c.shape[1] - distance):
        joint = np.einsum("ri,rj->ij", c[:, layer], c[:, layer + distance])  # (E, E)
        tot = joint.sum()
        if tot == 0:
            continue
        p_next = joint.sum(axis=0) / tot
        rows = joint.sum(axis=1)
        cond = np.divide(joint, rows[:, None], out=np.zeros_like(joint), where=rows[:, None] > 0)
        tv = 0.5 * np.abs(cond - p_next[None, :]).sum(axis=1)
        out.append(float((rows / tot) @ tv))
    return float(np.mean(out)) if out else math.nan


def shuffle_within_requests(trace: Trace, rng: np.random.Generator) -> np.ndarray:
    """The trace's counts ``(rows, L, E)`` with every layer's rows permuted
    independently inside each request: each layer's routing and each request's mix
    stay, the link between a token's layers goes."""
    c = trace.counts.copy()
    req = np.asarray(trace.iter_request)
    groups = [np.flatnonzero(req == r) for r in np.unique(req)]
    for layer in range(c.shape[1]):
        for ix in groups:
            c[ix, layer] = c[rng.permutation(ix), layer]
    return c


def depth_profile(trace: Trace, distances: Sequence[int], shuffles: int = 3) -> list[float]:
    """How much a token's expert at layer ``l`` tells about its experts ``d`` layers
    later, for each ``d`` of ``distances``: :func:`dependence_at` minus the same on the
    trace shuffled within requests (:func:`shuffle_within_requests`, mean of
    ``shuffles`` shuffles from seed 0).  Subtracting the shuffled value removes the part
    a finite sample shows even between independent layers (about 0.05 for 577 Mixtral
    tokens), so traces of different lengths compare; 0 = no dependence beyond what the
    request's mix explains."""
    rng = np.random.default_rng(0)
    floors = [shuffle_within_requests(trace, rng) for _ in range(shuffles)]
    return [
        dependence_at(trace.counts, d) - float(np.mean([dependence_at(c, d) for c in floors]))
        for d in distances
    ]


def depth_dependence(trace: Trace) -> float:
    """The mean of :func:`depth_profile` over :data:`DEPTH_DISTANCES`: the statistic
    ``depth_share`` is fitted to."""
    return float(np.mean(depth_profile(trace, DEPTH_DISTANCES)))


def _top1(trace: Trace) -> np.ndarray | None:
    """The most probable expert of every iteration at each layer that routes one position
    per one-token iteration, ``(rows, L - encoder layers)``: every layer of a
    decoder-only model, the decoder's layers of an encoder-decoder one (its encoder
    layers route the prompt in iteration 0 alone, their probabilities the mean over its
    positions).  None without probabilities."""
    if trace.probs is None:
        return None
    return trace.probs[:, trace.encoder_layers :].astype(np.float32).argmax(axis=2)


def top1_stickiness(trace: Trace) -> float:
    """Share of consecutive decode tokens of a request whose most probable expert is the
    same, per layer, averaged (needs probabilities; NaN without them)."""
    top = _top1(trace)  # (rows, layers routing one position an iteration)
    if top is None:
        return math.nan
    same, n = 0, 0
    for r in range(trace.num_requests):
        a = int(trace.iter_start[r])
        b = a + int(trace.output_tokens[r])
        x = top[a + 1 : b]  # decode iterations (one token each)
        same += int((x[1:] == x[:-1]).sum())
        n += x[1:].size
    return same / n if n else math.nan


def top1_frequency_skew(trace: Trace) -> tuple[float, float]:
    """:func:`skew_of` the top-1 expert frequency: how often each expert is the most
    probable one, over one-token iterations (NaN without probabilities)."""
    top = _top1(trace)  # (rows, layers routing one position an iteration)
    if top is None:
        return math.nan, math.nan
    top = top[trace.num_tokens == 1]
    E = trace.num_experts
    return skew_of(np.stack([np.bincount(t, minlength=E) for t in top.T]))


def top1_frequency_gini(trace: Trace) -> float:
    """Mean over layers of the Gini coefficient of top-1 expert frequency
    (:func:`top1_frequency_skew`)."""
    return top1_frequency_skew(trace)[0]


def transition_matrix(path: Path) -> np.ndarray:
    """A transition-matrix file as float64 counts ``(L, E, E)``: per layer, the top-1
    expert at token t (row) -> at token t + 1 (column); the files are torch tensors."""
    import torch

    return torch.load(path, weights_only=True).double().numpy()


def transition_stickiness_by_layer(m: np.ndarray) -> np.ndarray:
    """Per layer, the share of a transition matrix's mass on its diagonal (top-1 expert at
    token t equal to the one at t + 1), ``(L,)``."""
    return np.trace(m, axis1=1, axis2=2) / np.maximum(m.sum(axis=(1, 2)), 1e-12)


def transition_stickiness(path: Path) -> tuple[float, int]:
    """Mean share of a transition matrix's mass on its diagonal (top-1 expert at token t
    equal to the one at t + 1), over layers, and the number of experts; the files are
    torch tensors ``(L, E, E)`` of counts."""
    m = transition_matrix(path)
    return float(transition_stickiness_by_layer(m).mean()), int(m.shape[-1])


def pair_lift(trace: Trace, top: int = 20) -> float:
    """Mean lift ``P(a, b) / (P(a) P(b))`` of the ``top`` most frequent within-layer
    expert pairs over one-token iterations (the co-activation measure of the Qwen3
    aggregates)."""
    one = trace.num_tokens == 1
    c = (trace.counts[one] > 0).astype(np.float64)  # (tokens, L, E)
    n = len(c)
    lifts = []
    for layer in range(trace.num_layers):
        x = c[:, layer]
        joint = x.T @ x  # (E, E) co-occurrence counts
        p = x.sum(axis=0) / n
        iu = np.triu_indices(len(p), 1)
        cnt = joint[iu]
        best = np.argsort(-cnt, kind="stable")[:top]
        for i in best:
            a, b = iu[0][i], iu[1][i]
            if p[a] > 0 and p[b] > 0:
                lifts.append((cnt[i] / n) / (p[a] * p[b]))
    return float(np.mean(lifts)) if lifts else math.nan


def fit_knob(
    model: ModelSpec,
    knob: str,
    target: float,
    statistic: Callable[[Trace], float],
    bounds: tuple[float, float],
    fixed: dict[str, float] | None = None,
    num_requests: int = 32,
    tokens: int = 128,
    steps: int = 12,
) -> tuple[float, float]:
    """The value of the synthetic ``knob`` (the others at ``fixed``, or their defaults)
    whose ``statistic`` of a synthetic trace (seed 0) matches ``target``, by ``steps``
    bisection steps on ``bounds``; ``statistic`` must grow with the knob.  Returns (knob
    value, statistic at the last trace generated)."""
    lo, hi = bounds
    got = math.nan
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(steps):
            mid = (lo + hi) / 2
            knobs = {**(fixed or {}), knob: mid}
            tr = synthetic_like(model, knobs, Path(tmp) / "t", num_requests, tokens, 0)
            got = statistic(tr)
            if got < target:
                lo = mid
            else:
                hi = mid
    return (lo + hi) / 2, got


def fit_heat_skew(
    model: ModelSpec, target_gini: float, num_requests: int = 32, tokens: int = 128
) -> tuple[float, float]:
    """The synthetic ``skew`` whose per-layer frequency Gini (one-token iterations)
    matches ``target_gini``, by bisection on [0, 4]; returns (skew, Gini reached)."""
    return fit_knob(
        model, "skew", target_gini, lambda tr: frequency_skew(tr)[0], (0.0, 4.0),
        num_requests=num_requests, tokens=tokens,
    )  # fmt: skip


def fit_top1(
    model: ModelSpec,
    target_gini: float,
    target_stickiness: float,
    rounds: int = 2,
    steps: int = 8,
    num_requests: int = 32,
    tokens: int = 128,
    fixed: dict[str, float] | None = None,
    skew_bounds: tuple[float, float] = (0.0, 2.0),
) -> dict[str, float]:
    """The synthetic ``skew`` and ``locality`` whose top-1 frequency Gini
    (:func:`top1_frequency_gini`) and top-1 stickiness (:func:`top1_stickiness`) match
    the targets: ``rounds`` of alternating bisections, ``skew`` on ``skew_bounds`` at the
    current ``locality`` (first 0.5), then ``locality`` on [0, 0.95] at that ``skew``;
    the other knobs at ``fixed``, else their defaults.  Returns the two knobs, rounded
    to 2 decimals."""
    base = dict(fixed or {})
    skew, locality = 1.0, 0.5
    for _ in range(rounds):
        skew, _ = fit_knob(
            model, "skew", target_gini, top1_frequency_gini, skew_bounds,
            {**base, "locality": locality}, num_requests, tokens, steps,
        )  # fmt: skip
        locality, _ = fit_knob(
            model, "locality", target_stickiness, top1_stickiness, (0.0, 0.95),
            {**base, "skew": skew}, num_requests, tokens, steps,
        )  # fmt: skip
    return {"skew": round(skew, 2), "locality": round(locality, 2)}


def gini(x: np.ndarray) -> float:
    """Gini coefficient of non-negative values (0 = all equal)."""
    v = np.sort(np.asarray(x, dtype=np.float64))
    n, s = len(v), v.sum()
    if n == 0 or s == 0:
        return 0.0
    return float((2 * np.arange(1, n + 1) - n - 1) @ v / (n * s))


@dataclass
class Candidate:
    """One grid point: its knobs, curves, worst-point error (points) and statistics."""

    knobs: dict[str, float]
    curves: dict[str, list[float]]
    max_error_points: float
    reuse: float
    skew: tuple[float, float]
    dependence: float


def synthetic_like(
    model: ModelSpec,
    knobs: dict[str, Any],
    path: Path,
    num_requests: int,
    tokens: int,
    seed: int,
    embedding_dim: int = 0,
) -> Trace:
    """A synthetic trace in the real logs' view: one-token iterations (one-token
    prompts), ``tokens`` of them per request (median; at most twice that)."""
    from fmoesim.trace import read_trace
    from fmoesim.workload.synthetic import SyntheticConfig, generate

    cfg = SyntheticConfig(
        num_requests=num_requests,
        embedding_dim=embedding_dim,
        prompt_tokens_median=1,
        prompt_tokens_max=1,
        output_tokens_median=tokens,
        output_tokens_max=2 * tokens,
        seed=seed,
        **knobs,
    )
    generate(model, cfg, path, overwrite=True)
    return read_trace(path)


def fit(
    real: Trace,
    model: ModelSpec,
    hardware: HardwareSpec,
    grid: dict[str, Sequence[float]] = GRID,
    num_requests: int = 16,
    seed: int = 0,
) -> list[Candidate]:
    """Every grid point, best (smallest worst-point error) first."""
    target = hit_curves(real, model, hardware)
    tokens = int(np.median(real.output_tokens))
    out = []
    keys = list(grid)
    with tempfile.TemporaryDirectory() as tmp:
        for values in itertools.product(*(grid[k] for k in keys)):
            knobs = dict(zip(keys, values, strict=True))
            tr = synthetic_like(model, knobs, Path(tmp) / "t", num_requests, tokens, seed)
            c = hit_curves(tr, model, hardware)
            err = max(abs(a - b) for p in POLICIES for a, b in zip(c[p], target[p], strict=True))
            out.append(
                Candidate(knobs, c, 100 * err, reuse_probability(tr), frequency_skew(tr),
                          layer_dependence(tr))
            )  # fmt: skip
    return sorted(out, key=lambda c: c.max_error_points)


@dataclass
class PathCandidate:
    """One grid point of the path fit: its knobs, its worst error in points over the
    hit-rate curves and the three path statistics, and each of them."""

    knobs: dict[str, float]
    max_error_points: float
    curve_error_points: float
    nearest: float
    popularity: float
    own: float


def fit_paths(
    real: Trace,
    model: ModelSpec,
    hardware: HardwareSpec,
    depth_share: float,
    grid: dict[str, Sequence[float]] | None = None,
    num_requests: int = 16,
    seed: int = 0,
) -> list[PathCandidate]:
    """Every point of ``grid`` (with :data:`PATH_FIXED` and ``depth_share``), best first:
    the worst error in points over the LRU and LFU hit-rate curves (on ``num_requests``
    requests, as :func:`fit`), the two statistics of
    :func:`fmoesim.validation.real_routing.path_predictability` and
    :func:`~fmoesim.validation.real_routing.own_path_predictability`, at
    :data:`PATH_DISTANCE` (on as many requests as the real trace has, the first of the
    same sample: the statistics depend on how many other tokens there are to match)."""
    from fmoesim.validation.real_routing import path_stats

    grid = PATH_GRID if grid is None else grid
    target = hit_curves(real, model, hardware)
    near_t, pop_t, own_t = path_stats(real, PATH_DISTANCE)
    tokens = int(np.median(real.output_tokens))
    out = []
    keys = list(grid)
    with tempfile.TemporaryDirectory() as tmp:
        for values in itertools.product(*(grid[k] for k in keys)):
            knobs = {**PATH_FIXED, "depth_share": depth_share}
            knobs.update(zip(keys, values, strict=True))
            if "token_types" in knobs:
                knobs["token_types"] = int(knobs["token_types"])
            tr = synthetic_like(model, knobs, Path(tmp) / "t", num_requests, tokens, seed)
            c = hit_curves(tr, model, hardware)
            curve = max(abs(a - b) for p in POLICIES for a, b in zip(c[p], target[p], strict=True))
            few = synthetic_like(model, knobs, Path(tmp) / "few", real.num_requests, tokens, seed)
            near, pop, own = path_stats(few, PATH_DISTANCE)
            worst = 100 * max(curve, abs(near - near_t), abs(pop - pop_t), abs(own - own_t))
            out.append(PathCandidate(knobs, worst, 100 * curve, near, pop, own))
    return sorted(out, key=lambda c: c.max_error_points)


def qwen3_stats(path: Path) -> dict[str, float]:
    """Per-layer heat skew (Gini, max/mean) and the mean lift of the 20 most frequent
    within-layer pairs, from the Qwen3-30B-A3B co-activation aggregates."""
    d = json.loads(path.read_text())
    ginis, ratios, lifts = [], [], []
    for layer in d["layers"]:
        heat = np.asarray(layer["heat"], dtype=np.float64)
        ginis.append(gini(heat))
        ratios.append(float(heat.max() / max(heat.mean(), 1e-12)))
        pairs = sorted(layer["pairs"], key=lambda p: -p[2])[:20]
        lifts += [float(p[3]) for p in pairs]
    return {
        "heat_gini": float(np.mean(ginis)),
        "heat_max_over_mean": float(np.mean(ratios)),
        "top20_pair_lift": float(np.mean(lifts)),
    }


def top1_matrix_stats(path: Path) -> dict[str, float]:
    """Top-1 routing statistics of a transition matrix (see :func:`transition_matrix`;
    Qwen1.5-MoE-A2.7B's, Switch's): the per-layer Gini and max/mean of top-1 expert
    frequency (row sums: the top-1 expert at token t) and the per-layer top-1
    stickiness (:func:`transition_stickiness_by_layer`), each averaged over layers, with
    the stickiness of the least and the most sticky layer, the tokens per layer, and the
    stickiness that independent tokens would show at each layer's frequencies (the sum
    of their squared shares), averaged over layers."""
    m = transition_matrix(path)  # (L, E, E)
    freq = m.sum(axis=2)  # (L, E)
    sticky = transition_stickiness_by_layer(m)  # (L,)
    share = freq / np.maximum(freq.sum(axis=1, keepdims=True), 1e-12)  # (L, E)
    g, mm = skew_of(freq)
    return {
        "top1_gini": g,
        "top1_max_over_mean": mm,
        "top1_stickiness": float(sticky.mean()),
        "top1_stickiness_min": float(sticky.min()),
        "top1_stickiness_max": float(sticky.max()),
        "tokens_per_layer": float(freq.sum(axis=1).mean()),
        "top1_independent_stickiness": float((share**2).sum(axis=1).mean()),
    }


def main(argv: list[str] | None = None) -> None:
    """Fit, then write the report and its plot."""
    from fmoesim.config.build import load_preset
    from fmoesim.trace import read_trace
    from fmoesim.trace.importers import import_vllm_routes

    data = SHARED / "data" / "routing"
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--real",
        default=str(data / "mixtral-8x7b-vllm-top2"),
        help="Mixtral-8x7B route logs in the vLLM route-log format (a .jsonl file or a "
        "directory of them; docs/traces.md) whose routing the knobs are fitted to "
        "(default: %(default)s)",
    )
    qwen3_default = data / "qwen3-coactivation/coactivation_qwen3-30b-a3b.json"
    trans_default = data / "transition-matrices"
    ap.add_argument(
        "--qwen3",
        default=None,
        help="Qwen3-30B-A3B co-activation aggregates (JSON; default: "
        f"{qwen3_default}, its section skipped where that is absent)",
    )
    ap.add_argument(
        "--transitions",
        default=None,
        help="a folder of *_markov_transition_matrix.pt files (needs torch; default: "
        f"{trans_default}, their sections skipped where that is absent)",
    )
    ap.add_argument(
        "--out",
        default=str(PROJECT_ROOT / "traces" / "calibration.md"),
        help="the report to write (Markdown; its plot beside it, .png)",
    )
    args = ap.parse_args(argv)
    for flag, given in (("--real", args.real), ("--qwen3", args.qwen3),
                        ("--transitions", args.transitions)):  # fmt: skip
        if given is not None and not Path(given).exists():
            raise FmoesimError(f"{flag} {given}: no such file or directory")
    qwen3_path = Path(args.qwen3) if args.qwen3 is not None else qwen3_default
    trans_dir = Path(args.transitions) if args.transitions is not None else trans_default
    q15_path = trans_dir / QWEN15_MATRIX
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    with tempfile.TemporaryDirectory() as tmp:
        path, dropped = import_vllm_routes(args.real, Path(tmp) / "real", model)
        real = read_trace(path)
        # the other data read (seconds) before the fits (minutes): a file of the wrong
        # kind stops the run now
        q = _read("--qwen3", qwen3_path, qwen3_stats) if qwen3_path.is_file() else None
        trans = _read("--transitions", trans_dir, _transitions)
        if not isinstance(trans, str):  # torch is there
            for matrix in (q15_path, trans_dir / SWITCH_MATRIX):
                if matrix.is_file():
                    _read("--transitions", matrix, top1_matrix_stats)
        target = hit_curves(real, model, hw)
        stats = (reuse_probability(real), frequency_skew(real), layer_dependence(real))
        ranked = fit(real, model, hw)
        best = ranked[0]
        depth = _depth(real, model, best.knobs)
        fitted = synthetic_like(model, best.knobs, Path(tmp) / "fitted", 16, 144, seed=0)
        sticky = top1_stickiness(fitted)
        fitted_knobs = {**best.knobs, "depth_share": depth["share"]}
        paths = _paths(real, model, hw, fitted_knobs, target, tmp)
    out = Path(args.out)
    plot = out.with_suffix(".png")
    if q is not None:
        qwen3 = load_preset("model", "qwen3-30b-a3b", ModelSpec)
        skew, _ = fit_heat_skew(qwen3, q["heat_gini"])
        q["fitted_skew"] = round(skew, 2)
        with tempfile.TemporaryDirectory() as tmp:
            tr = synthetic_like(qwen3, {"skew": q["fitted_skew"]}, Path(tmp) / "t", 32, 128, 0)
            q["fitted_gini"], q["fitted_max_over_mean"] = frequency_skew(tr)
            q["fitted_pair_lift"] = pair_lift(tr)
    q15 = _qwen15(q15_path)
    switch = _switch(trans_dir / SWITCH_MATRIX)
    text = _report(
        args.real, real, dropped, target, stats, ranked, plot.name, q, trans, sticky, q15,
        depth, paths, switch,
    )  # fmt: skip
    out.parent.mkdir(parents=True, exist_ok=True)
    _plot(target, best, plot)
    with atomic_file(out) as tmp_path:
        tmp_path.write_text(text)
    print(f"best knobs {best.knobs}: worst point {best.max_error_points:.1f} points; wrote {out}")


def _depth(real: Trace, model: ModelSpec, knobs: dict[str, float]) -> dict[str, Any]:
    """Fit ``depth_share`` (the other knobs at ``knobs``) to the real trace's
    :func:`depth_dependence`; the profiles over distances 1-6 of the real trace and of
    the fitted knobs without and with it."""
    target = depth_dependence(real)
    share, _ = fit_knob(model, "depth_share", target, depth_dependence, (0.0, 1.0), knobs, steps=8)
    share = round(share, 2)
    distances = list(range(1, 7))
    out: dict[str, Any] = {"target": target, "share": share, "distances": distances}
    out["real"] = depth_profile(real, distances)
    with tempfile.TemporaryDirectory() as tmp:
        for key, h in (("without", 0.0), ("with", share)):
            tr = synthetic_like(model, {**knobs, "depth_share": h}, Path(tmp) / key, 32, 128, 0)
            out[key] = depth_profile(tr, distances)
            out[f"{key}_mean"] = depth_dependence(tr)
    return out


def _paths(
    real: Trace,
    model: ModelSpec,
    hardware: HardwareSpec,
    fitted: dict[str, float],
    target: dict[str, list[float]],
    tmp: str,
) -> dict[str, Any]:
    """The path fit (:func:`fit_paths`) with what the report shows beside it: the three
    path statistics (:func:`~fmoesim.validation.real_routing.path_stats`) of the real
    trace and of the ``fitted`` knobs (the fit above), the real trace's hit-rate curves
    ``target`` (:func:`hit_curves`, already computed) with the best path knobs', and
    their next-token reuse and layer dependence."""
    from fmoesim.validation.real_routing import path_stats

    tokens = int(np.median(real.output_tokens))
    ranked = fit_paths(real, model, hardware, fitted["depth_share"])
    best = ranked[0]
    few = synthetic_like(model, fitted, Path(tmp) / "few", real.num_requests, tokens, 0)
    many = synthetic_like(model, best.knobs, Path(tmp) / "paths", 16, tokens, 0)
    return {
        "ranked": ranked,
        "real": path_stats(real, PATH_DISTANCE),
        "fitted": path_stats(few, PATH_DISTANCE),
        "real_stats": (reuse_probability(real), depth_dependence(real)),
        "best_stats": (reuse_probability(many), depth_dependence(many)),
        "best_curves": hit_curves(many, model, hardware),
        "target": target,
    }


def _paths_section(d: dict[str, Any]) -> list[str]:
    """The report's section on the path fit (:func:`_paths`)."""
    ranked: list[PathCandidate] = d["ranked"]
    best = ranked[0]
    (near_r, pop_r, own_r), (near_f, pop_f, own_f) = d["real"], d["fitted"]
    (reuse_r, dep_r), (reuse_b, dep_b) = d["real_stats"], d["best_stats"]
    lines = [
        "",
        "### Paths across layers",
        "",
        f"Path predictability, {PATH_DISTANCE} layers ahead (fMoE's prefetch distance; "
        "`path_predictability` and `own_path_predictability` in "
        "`fmoesim.validation.real_routing`): the share of a token's experts "
        f"{PATH_DISTANCE} layers on that the nearest token of another request (the most "
        "experts in common so far) routes to (*nearest path*), against the share among "
        "the other requests' most popular experts there (*popularity*), and the share the "
        "nearest earlier token of its own request, 2 or more positions back, routes to "
        "(*own request*); a synthetic sample has as many requests as the real logs. The "
        "knobs above match the hit-rate curves but not this: real routing's paths are "
        "predictable from other requests' tokens and more so from the request's own, "
        "theirs are not.",
        "",
        "| | nearest path | popularity | own request | path - popularity (points) |",
        "|---|---|---|---|---|",
        f"| real | {100 * near_r:.1f} | {100 * pop_r:.1f} | {100 * own_r:.1f} "
        f"| {100 * (near_r - pop_r):.1f} |",
        f"| fitted above | {100 * near_f:.1f} | {100 * pop_f:.1f} | {100 * own_f:.1f} "
        f"| {100 * (near_f - pop_f):.1f} |",
        f"| fitted with token types | {100 * best.nearest:.1f} | {100 * best.popularity:.1f} "
        f"| {100 * best.own:.1f} | {100 * (best.nearest - best.popularity):.1f} |",
        "",
        "The workload model's token types give paths that structure: `type_share`, "
        "`token_types`, `type_zipf` (tokens of one type follow much the same path in "
        "every request), `type_context` (the share of a type's profile that is the "
        "request's own: a type routes more alike within a request than across requests) "
        "and `type_repeat` (the chance that a position repeats an earlier position's "
        "type). The grid below holds "
        + ", ".join(f"`{k}: {v}`" for k, v in PATH_FIXED.items())
        + f" and `depth_share: {best.knobs['depth_share']}` (fitted above) and scores each "
        "point by its worst error, in points, over the LRU and LFU curves and the three "
        f"path statistics. Best: `{_knobs_text(best.knobs)}`, worst error "
        f"{best.max_error_points:.1f} points (curves {best.curve_error_points:.1f}). "
        "They are the routing knobs of `conf/workload/routing-mixtral-8x7b.yaml`. "
        f"Next-token reuse {reuse_b:.3f} (real {reuse_r:.3f}); dependence 2-6 layers "
        f"apart {dep_b:.3f} (real {dep_r:.3f}; neither is in the score).",
        "",
        "| C | " + " | ".join(str(c) for c in range(1, len(d["target"]["lru"]) + 1)) + " |",
        "|---|" + "---|" * len(d["target"]["lru"]),
    ]
    for p in POLICIES:
        for name, curves in (("real", d["target"]), ("with token types", d["best_curves"])):
            lines.append(
                f"| {p.upper()} {name} | " + " | ".join(f"{100 * x:.1f}" for x in curves[p]) + " |"
            )
    lines += [
        "",
        f"Grid (the 12 best of {len(ranked)}, by the knobs it varies; errors in points, "
        "the path statistics' as measured minus real):",
        "",
        "| knobs | worst | curves | nearest path | popularity | own request |",
        "|---|---|---|---|---|---|",
    ]
    varied = [k for k in PATH_GRID if len(PATH_GRID[k]) > 1]
    lines += [
        f"| `{_knobs_text({k: c.knobs[k] for k in varied})}` | {c.max_error_points:.1f} "
        f"| {c.curve_error_points:.1f} | {100 * (c.nearest - near_r):+.1f} "
        f"| {100 * (c.popularity - pop_r):+.1f} | {100 * (c.own - own_r):+.1f} |"
        for c in ranked[:12]
    ]
    return lines


def _knobs_text(knobs: dict[str, float]) -> str:
    """``knobs`` as ``k: v`` pairs, integers without a point."""
    return ", ".join(f"{k}: {v:g}" for k, v in knobs.items())


def _depth_section(d: dict[str, Any]) -> list[str]:
    ds = d["distances"]
    row = lambda name, v: f"| {name} | " + " | ".join(f"{x:.3f}" for x in v) + " |"  # noqa: E731
    return [
        "",
        "Dependence across layers: how much a token's expert at layer l tells about its",
        "experts at layer l + d (mean TV distance as above, minus the same on the trace with",
        "every layer shuffled within each request, which removes what a finite sample shows",
        "between independent layers). Real Mixtral routing keeps the dependence as far as six",
        "layers on; without `depth_share` the workload model keeps it for one layer only.",
        "",
        "| d | " + " | ".join(str(x) for x in ds) + " |",
        "|---|" + "---|" * len(ds),
        row("real", d["real"]),
        row("fitted, `depth_share: 0`", d["without"]),
        row(f"fitted, `depth_share: {d['share']}`", d["with"]),
        "",
        f"`depth_share = {d['share']}` matches the mean over d = 2..6 (real "
        f"{d['target']:.3f}, fitted {d['with_mean']:.3f}) by bisection with the knobs above; "
        "each layer's routing alone, and so every hit-rate curve above, has the same law "
        "whatever `depth_share` is. At d = 1 it gives "
        f"{d['with'][0]:.3f} against {d['real'][0]:.3f}: `cross_layer`, the link to the next "
        "layer alone, keeps its default (not fitted).",
    ]


#: the Qwen1.5-MoE-A2.7B transition matrix's file in the ``--transitions`` folder
QWEN15_MATRIX = "qwen_markov_transition_matrix.pt"
#: the Switch transition matrix's file in the ``--transitions`` folder (6 layers x 128
#: experts: switch-base-128's six sparse layers of one stack)
SWITCH_MATRIX = "switch_markov_transition_matrix.pt"
#: the knobs the Switch fit holds: Mixtral-8x7B's fitted ``noise`` and ``request_jitter``
#: (routing-encoder-decoder's), and no topic part of the popularity (``topic_share``):
#: the matrix pools every token, and its stickiness is near that of independent tokens
#: at its own frequencies, where a popularity of each topic would raise it
SWITCH_FIXED = {"noise": 2.0, "request_jitter": 0.0, "topic_share": 0.0}


def _read(flag: str, path: Path, read: Callable[[Path], Any]) -> Any:
    """``read(path)``; a file of the wrong kind (a key, a shape or a format it lacks)
    becomes one :class:`FmoesimError` line naming ``flag``."""
    try:
        return read(path)
    except FmoesimError:
        raise
    except Exception as exc:  # noqa: BLE001 - JSON, torch and numpy errors, one line
        detail = str(exc).splitlines()[0] if str(exc) else ""
        raise FmoesimError(
            f"{flag} {path}: not the data it names ({type(exc).__name__}: {detail})"
        ) from None


def _transitions(folder: Path) -> dict[str, tuple[float, int]] | str:
    """Stickiness of every ``*_markov_transition_matrix.pt`` in ``folder`` (why not,
    without torch or files)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch, which reads the `.pt` transition matrices, is not installed"
    files = sorted(folder.glob("*_markov_transition_matrix.pt")) if folder.is_dir() else []
    if not files:
        return f"no `*_markov_transition_matrix.pt` in `{folder}`"
    return {f.name.split("_")[0]: transition_stickiness(f) for f in files}


def _top1_fit(
    path: Path,
    model_name: str,
    sizes: dict[str, int],
    fixed: dict[str, float] | None = None,
    skew_bounds: tuple[float, float] = (0.0, 2.0),
) -> dict[str, Any] | str:
    """A transition matrix's real top-1 statistics (:func:`top1_matrix_stats`), the knobs that
    :func:`fit_top1` fits to them on the model preset ``model_name`` (``fixed`` held),
    and the synthetic statistics at those knobs, on a trace of each of ``sizes`` (key ->
    requests of 128 one-token iterations); why not, without torch or the file."""
    from fmoesim.config.build import load_preset

    try:
        import torch  # noqa: F401
    except ImportError:
        return "torch, which reads the `.pt` transition matrix, is not installed"
    if not path.is_file():
        return f"no `{path}`"
    q: dict[str, Any] = dict(top1_matrix_stats(path))
    model = load_preset("model", model_name, ModelSpec)
    q["knobs"] = fit_top1(
        model, q["top1_gini"], q["top1_stickiness"], fixed=fixed, skew_bounds=skew_bounds
    )
    knobs = {**(fixed or {}), **q["knobs"]}
    with tempfile.TemporaryDirectory() as tmp:
        for key, num_requests in sizes.items():
            tr = synthetic_like(model, knobs, Path(tmp) / "t", num_requests, 128, 0)
            q[f"{key}_gini"], q[f"{key}_max_over_mean"] = top1_frequency_skew(tr)
            q[f"{key}_stickiness"] = top1_stickiness(tr)
            q[f"{key}_tokens_per_layer"] = int((tr.num_tokens == 1).sum())
    return q


def _qwen15(path: Path) -> dict[str, Any] | str:
    """Qwen1.5-MoE-A2.7B's fit (:func:`_top1_fit`): the other knobs at their defaults; the
    fit's trace size (32 requests) and one of about the real token count (80)."""
    return _top1_fit(path, "qwen1.5-moe-a2.7b", {"fitted": 32, "fitted_80": 80})


def _switch(path: Path) -> dict[str, Any] | str:
    """Switch's fit (:func:`_top1_fit`) on switch-large-128's decoder layers with
    :data:`SWITCH_FIXED` held; the fit's trace size (32 requests) and one of about the
    real token count (40)."""
    return _top1_fit(
        path, "switch-large-128", {"fitted": 32, "fitted_40": 40}, SWITCH_FIXED, (0.0, 4.0)
    )


def _plot(target: dict[str, list[float]], best: Candidate, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    C = np.arange(1, len(target["lru"]) + 1)
    for p, color in (("lru", "tab:blue"), ("lfu", "tab:orange")):
        ax.plot(C, 100 * np.asarray(target[p]), "o-", color=color, label=f"{p.upper()} real")
        ax.plot(
            C, 100 * np.asarray(best.curves[p]), "x--", color=color, label=f"{p.upper()} fitted"
        )
    ax.set_xlabel("cached experts per layer (C)")
    ax.set_ylabel("hit rate (%)")
    ax.set_title("Mixtral-8x7B: LRU and LFU hit rates, real routing vs the calibrated workload")
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    try:
        with atomic_file(path) as tmp:
            fig.savefig(tmp, dpi=120)
    finally:
        plt.close(fig)


def _top1_table(q: dict[str, Any]) -> list[str]:
    """The table of a top-1 fit's real and fitted statistics (:func:`_top1_fit`)."""
    return [
        "| statistic | real | fitted synthetic |",
        "|---|---|---|",
        f"| per-layer top-1 frequency Gini (mean) | {q['top1_gini']:.3f} "
        f"| {q['fitted_gini']:.3f} |",
        f"| per-layer top-1 frequency max/mean (mean) | {q['top1_max_over_mean']:.2f} "
        f"| {q['fitted_max_over_mean']:.2f} |",
        f"| top-1 stickiness (mean over layers) | {q['top1_stickiness']:.3f} "
        f"| {q['fitted_stickiness']:.3f} |",
    ]


def _qwen15_section(q: dict[str, Any] | str | None) -> list[str]:
    """The Qwen1.5-MoE-A2.7B section of the report (a note of why not when ``q`` is
    not the statistics)."""
    head = ["## Qwen1.5-MoE-A2.7B (top-1 transition matrix)", ""]
    if not isinstance(q, dict):
        return [*head, f"Skipped: {q or 'no data given'}."]
    return [
        *head,
        f"24 layers x 60 experts, top-4; {q['tokens_per_layer']:.0f} token-to-token "
        "transitions of the top-1 expert per layer (wikitext prefill). The synthetic "
        f"trace: 32 requests, {q['fitted_tokens_per_layer']} one-token iterations.",
        "",
        *_top1_table(q),
        "",
        f"`{q['knobs']}` (the other knobs at their defaults) matches the Gini and the "
        "stickiness (`conf/workload/routing-qwen1.5-moe-a2.7b.yaml`, with "
        "`model=qwen1.5-moe-a2.7b`). On a synthetic trace of about the real size "
        f"(80 requests, {q['fitted_80_tokens_per_layer']} tokens) the Gini is "
        f"{q['fitted_80_gini']:.3f} and the stickiness {q['fitted_80_stickiness']:.3f}: "
        "a Gini measured on fewer tokens is larger. Only the top-1 expert is "
        "calibrated: the other three of the top-4, within-layer co-activation, "
        "layer-to-layer dependence and decode-time routing (the matrix is prefill) are "
        "not. The real stickiness ranges from "
        f"{q['top1_stickiness_min']:.3f} to {q['top1_stickiness_max']:.3f} across "
        "layers; the workload model has one `locality` for all layers, so only the "
        "mean is matched.",
    ]


def _switch_section(q: dict[str, Any] | str | None) -> list[str]:
    """The Switch section of the report (a note of why not when ``q`` is not the
    statistics)."""
    head = ["## Switch (top-1 transition matrix)", ""]
    if not isinstance(q, dict):
        return [*head, f"Skipped: {q or 'no data given'}."]
    return [
        *head,
        f"6 layers x 128 experts, top-1; {q['tokens_per_layer']:.0f} token-to-token "
        "transitions of the expert per layer (wikitext prefill). The file does not name "
        "its model; six sparse layers of 128 experts are switch-base-128's encoder or "
        "decoder. The fit runs on `switch-large-128` (the MoE-Infinity presets' model: "
        "12 + 12 sparse layers of 128 experts), on the decoder's layers, one token an "
        f"iteration: 32 requests, {q['fitted_tokens_per_layer']} iterations.",
        "",
        *_top1_table(q),
        "",
        f"`{q['knobs']}` with `{SWITCH_FIXED}` held matches the Gini and the stickiness "
        "(`conf/workload/routing-switch.yaml`, with `model=switch-large-128`). The real "
        f"stickiness is close to the {q['top1_independent_stickiness']:.3f} that "
        "independent tokens would show at each layer's own frequencies, so the "
        "popularity is held the same for every topic (`topic_share: 0`): with the "
        "default 0.6 the skew that matches the Gini makes consecutive tokens far "
        "stickier than the real ones. `noise` and `request_jitter` are Mixtral-8x7B's "
        "fitted values. On a synthetic trace of about the real size (40 requests, "
        f"{q['fitted_40_tokens_per_layer']} tokens) the Gini is "
        f"{q['fitted_40_gini']:.3f} and the stickiness {q['fitted_40_stickiness']:.3f}. "
        "Not calibrated: layer-to-layer dependence (`depth_share` is Mixtral-8x7B's), "
        "the difference between switch-base-128 and switch-large-128, the encoder's "
        "routing against the decoder's (one set of knobs for both), and decode-time "
        "routing (the matrix is prefill). The real stickiness ranges from "
        f"{q['top1_stickiness_min']:.3f} to {q['top1_stickiness_max']:.3f} across "
        "layers; only the mean is matched.",
    ]


def _report(
    src: str,
    real: Trace,
    dropped: int,
    target: dict[str, list[float]],
    stats: tuple[float, tuple[float, float], float],
    ranked: list[Candidate],
    plot: str,
    qwen3: dict[str, float] | None,
    trans: dict[str, tuple[float, int]] | str,
    sticky: float,
    qwen15: dict[str, Any] | str | None = None,
    depth: dict[str, Any] | None = None,
    paths: dict[str, Any] | None = None,
    switch: dict[str, Any] | str | None = None,
) -> str:
    best = ranked[0]
    reuse, (g, mm), dep = stats
    lines = [
        "# Calibration of the synthetic workload model",
        "",
        f"Generated by `{PROG}` from the real routing data in",
        f"`{Path(src).name}/` (outside the project; never copied). Figures only."
        if Path(src).resolve().is_relative_to(SHARED)
        else f"`{src}`. Figures only.",
        "",
        "## Mixtral-8x7B (vLLM top-2 route logs)",
        "",
        f"{real.num_requests} requests, {real.num_iterations} tokens after import "
        f"({dropped} token rows present in only some layers dropped); one token per iteration.",
        "",
        "| statistic | real | fitted synthetic |",
        "|---|---|---|",
        f"| next-token reuse (share of a token's experts the previous token used) "
        f"| {reuse:.3f} | {best.reuse:.3f} |",
        f"| per-layer frequency Gini | {g:.3f} | {best.skew[0]:.3f} |",
        f"| per-layer frequency max/mean | {mm:.2f} | {best.skew[1]:.2f} |",
        f"| layer-to-layer dependence (mean TV distance) | {dep:.3f} | {best.dependence:.3f} |",
        "",
        "Hit rate with a cache of C experts in every layer (hit-rate-only engine):",
        "",
        "| C | " + " | ".join(str(c) for c in range(1, len(target["lru"]) + 1)) + " |",
        "|---|" + "---|" * len(target["lru"]),
    ]
    for p in POLICIES:
        lines.append(
            f"| {p.upper()} real | " + " | ".join(f"{100 * x:.1f}" for x in target[p]) + " |"
        )
        lines.append(
            f"| {p.upper()} fitted | " + " | ".join(f"{100 * x:.1f}" for x in best.curves[p]) + " |"
        )
    lines += [
        "",
        f"![hit-rate curves]({plot})",
        "",
        f"Fitted knobs: `{best.knobs}` (worst point {best.max_error_points:.1f} points; the "
        "acceptance bound is 5). They are the routing knobs of "
        "`conf/workload/routing-mixtral-8x7b-curves.yaml`.",
    ]
    if depth is not None:
        lines += _depth_section(depth)
    lines += [
        "",
        "Grid (worst-point error in points, best first):",
        "",
        "| knobs | worst point | reuse |",
        "|---|---|---|",
    ]
    lines += [f"| `{c.knobs}` | {c.max_error_points:.1f} | {c.reuse:.3f} |" for c in ranked]
    if paths is not None:
        lines += _paths_section(paths)
    lines += ["", "## Qwen3-30B-A3B (co-activation aggregates)", ""]
    if qwen3 is None:
        lines.append("Skipped: no co-activation aggregates given (`--qwen3`).")
    else:
        lines += [
            "| statistic | real | fitted synthetic |",
            "|---|---|---|",
            f"| per-layer heat Gini (mean) | {qwen3['heat_gini']:.3f} "
            f"| {qwen3['fitted_gini']:.3f} |",
            f"| per-layer heat max/mean (mean) | {qwen3['heat_max_over_mean']:.2f} "
            f"| {qwen3['fitted_max_over_mean']:.2f} |",
            f"| lift of the 20 most frequent within-layer pairs (mean) | "
            f"{qwen3['top20_pair_lift']:.2f} | {qwen3['fitted_pair_lift']:.2f} |",
            "",
            f"Far more skewed than Mixtral (128 experts, top-8). `skew = "
            f"{qwen3['fitted_skew']}` matches the heat Gini "
            "(`conf/workload/routing-qwen3-30b-a3b.yaml`, with `model=qwen3-30b-a3b`); "
            "the co-activation lift is not reproduced: the workload model couples experts "
            "within a layer only through topics, so its pairs are nearly independent.",
        ]
    lines += ["", "## Token-to-token stickiness (transition matrices)", ""]
    if isinstance(trans, str):
        lines.append(f"Skipped: {trans}.")
    else:
        lines += [
            "Share of consecutive tokens whose top-1 expert is the same (wikitext prefill),",
            "against the 1/E of independent uniform routing:",
            "",
            "| model | experts | stickiness | 1/E |",
            "|---|---|---|---|",
        ]
        lines += [f"| {k} | {e} | {v:.3f} | {1 / e:.3f} |" for k, (v, e) in trans.items()]
        lines += [
            "",
            f"The calibrated synthetic Mixtral workload: top-1 stickiness {sticky:.3f} on "
            "decode tokens (Mixtral's matrix: see above). The \"deepseek\" file's shape "
            "(26 x 6 x 6) does not match DeepSeek's 64 or 256 routed experts; it is listed "
            "as found.",
        ]
    lines += ["", *_qwen15_section(qwen15)]
    lines += ["", *_switch_section(switch)]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    run_or_exit(PROG, main)
