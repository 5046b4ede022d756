"""Policies on real routing: does the calibrated workload rank the policies as real
routing does?

Run ``python -m fmoesim.validation.real_routing`` (``--real DIR --out FILE``).

The scoreboards (docs/reproduction.md) compare policies on synthetic routing whose knobs
are fitted to real Mixtral-8x7B routing (``conf/workload/routing-mixtral-8x7b.yaml``,
traces/calibration.md).  The fit matches LRU's and LFU's hit-rate curves and how
predictable a token's later experts are from its first ones; this check asks the
question the scoreboards rely on: run the policies on the real route logs themselves
and on samples of the fitted workload, timed, and see whether each orders the policies
the same way.  Beside it run the workload fitted to the hit-rate curves only
(``routing-mixtral-8x7b-curves``, no token types) and the default workload model (the
``synthetic`` preset's knobs, more skewed and local than real routing) as the
uncalibrated reference.

Both kinds of trace are compared in the view the real logs allow: one token per
iteration (the real logs do not say where a prompt ends), the routed top-k experts, no
gate probabilities, no embeddings and no speculative prediction.  A synthetic sample is
generated with one-token prompts and written through the same route writer the importer
uses, keeping only its routed experts (:func:`topk_view`), so fMoE, for example, sees
routed-token shares as its maps on both sides.  A policy built on a speculative
prediction of a later layer's gate (``uses_spec``: Mixtral-Offloading, AdapMoE,
Pre-gated MoE, MoEpic, fMoE's ``speculate`` ablation) has no input in that view and is
left out; so are the other ablation presets.

Each synthetic sample has as many requests as the real logs, their output lengths drawn
around the real requests' median; the samples differ by seed, and their spread shows how
much a sample of that size moves a comparison.  Agreement is Kendall's tau between the
real logs' order of the policies by TPOT and each sample's (:func:`kendall_tau`), and
the pairs of policies every sample orders one way and the real logs the other.  The
report also gives each workload's path statistics (:func:`path_predictability`,
:func:`own_path_predictability`): how well other tokens' paths across the layers, in
other requests and in the token's own, predict a token's experts a few layers on, which
is what a policy matching stored paths (fMoE) lives on.

Last, it runs MoE-Infinity's §7.2 setting (:data:`BLOCKING_EXPERIMENT`: caching off, its
testbed; :func:`run_blocking`) on the real logs and on the samples of the scoreboards'
workload, with the policies of its Tables 2 and 4 (among them the ablations of its own
design, which the first part leaves out), and gives each one's GPU blocking time against
on-demand fetching's and vanilla prefetching's (:func:`blocking_section`): whether a
comparison of those tables that fails on the synthetic workload fails on real routing
too.

The report is written atomically (a temporary file, then a rename); bad input is one
line naming the file and the broken rule.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoesim.atomic import atomic_file
from fmoesim.config.schema import PROJECT_ROOT
from fmoesim.errors import ArgumentParser, FmoesimError, run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace.reader import Trace

PROG = "python -m fmoesim.validation.real_routing"
#: where the real route logs lie (outside the project; never copied into it)
REAL_DEFAULT = PROJECT_ROOT.parent / "shared" / "data" / "routing" / "mixtral-8x7b-vllm-top2"
MODEL = "mixtral-8x7b"
#: fMoE's testbed (six RTX 3090s over PCIe 4.0, compute of its prototype): the setting of
#: the fMoE scoreboard's Mixtral rows
HARDWARE = "fmoe-testbed"
#: total expert budgets over the testbed's six GPUs: 24 GB is fMoE Fig. 9's
#: (conf/experiment/fmoe-fig9.yaml), 48 GB twice that
BUDGETS_GB = (24.0, 48.0)
#: the workload presets whose routing knobs the synthetic samples take: fitted to the
#: real logs' hit-rate curves only, fitted to those and their paths across layers (token
#: types; the scoreboards' Mixtral workload), and the default (chosen, not fitted)
WORKLOADS = {
    "curves": "routing-mixtral-8x7b-curves",
    "paths": "routing-mixtral-8x7b",
    "default": "synthetic",
}
#: policy presets compared: every preset whose decisions need only routed experts,
#: ablations left out
POLICIES = (
    "lru", "lfu", "lcp", "fifo", "rnd", "belady", "deepspeed", "dependency",
    "brainstorm", "promoe", "moe-infinity", "fmoe",
)  # fmt: skip
#: seeds of the synthetic samples of each workload
SEEDS = 5
#: MoE-Infinity's §7.2 setting (caching off, Table 5's 39 Mixtral buffer slots, its
#: testbed, half of the requests building the EAMC): the preset the blocking-time section
#: runs, on the real logs and on the samples of :data:`BLOCKING_WORKLOAD`
BLOCKING_EXPERIMENT = "moe-infinity-tab2-3"
BLOCKING_WORKLOAD = "paths"
#: the policies of MoE-Infinity's Tables 2 and 4 (on-demand fetching is lru with caching
#: off), in the tables' order
BLOCKING_POLICIES = (
    "lru", "dependency", "brainstorm", "moe-infinity-vanilla", "moe-infinity-tracing",
    "moe-infinity-multi-layer", "moe-infinity",
)  # fmt: skip
#: the distance of :func:`path_predictability` in the report: fMoE's prefetch distance
#: d = 3 (fMoE §6.1, conf/policy/fmoe.yaml)
PATH_DISTANCE = 3


def topk_view(trace: Trace, model: ModelSpec, dst: Path) -> Trace:
    """``trace`` as real top-k route logs show it: its routed experts only (no gate
    probabilities, embeddings or speculative prediction), written with the importers'
    route writer, one token per iteration.  Refuses a trace with an iteration of more
    than one token (the view has no prompt) or a (token, layer) whose counts are not
    ``top_k`` distinct experts once each."""
    from fmoesim.trace import read_trace
    from fmoesim.trace.table import write_routed

    K = model.top_k
    where = np.flatnonzero(trace.num_tokens != 1)
    if where.size:
        raise FmoesimError(
            f"{trace.path}: iteration row {int(where[0])} feeds {int(trace.num_tokens[where[0]])} "
            "tokens (rule: one token per iteration, the view of top-k route logs)"
        )
    c = trace.counts  # (N, L, E)
    bad = np.flatnonzero(((c.sum(axis=2) != K) | (c.max(axis=2) > 1)).any(axis=1))
    if bad.size:
        raise FmoesimError(
            f"{trace.path}: iteration row {int(bad[0])} does not route to {K} distinct "
            "experts once each in every layer (rule: one token's top-k)"
        )
    ids = np.argsort(-c, axis=2, kind="stable")[:, :, :K].astype(np.int64)  # (N, L, K)
    weights = np.zeros(ids.shape, dtype=np.float64)  # (N, L, K) unused: no weights
    arrays = []
    for r in range(trace.num_requests):
        rows = slice(int(trace.iter_start[r]), int(trace.iter_start[r + 1]))
        arrays.append((f"request/{int(trace.request_id[r])}", ids[rows], weights[rows], 1))
    datasets = [str(d) for d in trace.dataset]
    source = [str(trace.path)]
    write_routed(dst, model, arrays, False, "top-k view", source, True, datasets=datasets)
    return read_trace(dst)


def synthetic_sample(
    model: ModelSpec, workload: str, num_requests: int, tokens: int, seed: int, dst: Path
) -> Trace:
    """A sample of ``conf/workload/<workload>.yaml``'s synthetic workload in the top-k
    view (:func:`topk_view`): ``num_requests`` requests of one-token prompts and a median
    of ``tokens`` output tokens (at most twice that), generated with ``seed``."""
    from fmoesim.config.build import load_preset
    from fmoesim.config.schema import WorkloadConfig
    from fmoesim.trace import read_trace
    from fmoesim.workload.synthetic import generate

    wl = load_preset("workload", workload, WorkloadConfig)
    cfg = dataclasses.replace(
        wl.synthetic,
        num_requests=num_requests,
        embedding_dim=0,
        prompt_tokens_median=1,
        prompt_tokens_max=1,
        output_tokens_median=tokens,
        output_tokens_max=2 * tokens,
        arrival_rate_rps=None,
        arrivals_csv=None,
        seed=seed,
    )
    full = dst.with_name(dst.name + "-full")
    generate(model, cfg, full, overwrite=True)
    return topk_view(read_trace(full), model, dst)


def path_predictability(trace: Trace, distance: int = 3) -> tuple[float, float]:
    """How well other requests predict a token's experts ``distance`` layers ahead:
    ``(nearest path, popularity)``.

    For each token and each layer ``l`` with ``l + distance < L``: *nearest path* is the
    share of the token's routed experts at ``l + distance`` that the nearest token of
    another request routes to there too, the nearest being the one with the most experts
    in common over layers ``0..l`` (the first in trace order on a tie); *popularity* is
    the share of them among the ``top_k`` experts the other requests route to most often
    at ``l + distance``.  Each is a mean over tokens, then over layers.  Their gap is what
    a token's path across layers tells beyond popularity: what fMoE's trajectory search
    over stored maps (fMoE §4.2) can exploit, from a trace's routed experts alone."""
    K = trace.top_k
    req = trace.iter_request  # (N,)
    same = req[:, None] == req[None, :]  # (N, N)
    if bool(same.all()):
        raise FmoesimError(f"{trace.path}: path predictability needs two requests or more")
    nearest, popular = [], []
    for ahead, share in _nearest_paths(trace, ~same, distance):
        nearest.append(float(share.mean()))
        shares = []
        for r in np.unique(req):
            mine = req == r
            top = np.argsort(-ahead[~mine].sum(axis=0), kind="stable")[:K]  # (K,)
            shares.append(ahead[mine][:, top].sum(axis=1) / K)
        popular.append(float(np.concatenate(shares).mean()))
    return float(np.mean(nearest)), float(np.mean(popular))


def _nearest_paths(
    trace: Trace, allowed: np.ndarray, distance: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """For each layer ``l`` with ``l + distance < L``: the tokens' routed experts at
    ``l + distance`` ``(N, E)`` (0/1) and, per token, the share of them its nearest
    token routes to there too ``(N,)``, the nearest being the one among ``allowed (N,
    N)`` (row: the token, column: a candidate) with the most experts in common over
    layers ``0..l``, the first on a tie (token 0 where a row allows none)."""
    c = (trace.counts > 0).astype(np.float32)  # (N, L, E)
    N, L, _ = c.shape
    if distance < 1 or distance >= L:
        raise ValueError(f"distance must be in [1, {L}), got {distance}")
    overlap = np.zeros((N, N), dtype=np.float32)  # (N, N) experts in common, layers 0..l
    for layer in range(L - distance):
        overlap += c[:, layer] @ c[:, layer].T
        nn = np.where(allowed, overlap, -1.0).argmax(axis=1)  # (N,)
        ahead = c[:, layer + distance]  # (N, E)
        yield ahead, (ahead * ahead[nn]).sum(axis=1) / trace.top_k


def own_path_predictability(trace: Trace, distance: int = 3, gap: int = 2) -> float:
    """:func:`path_predictability`'s nearest path within a token's own request: the
    nearest is among the request's tokens at least ``gap`` positions earlier (``gap =
    2`` leaves out the previous token, whose overlap is next-token reuse); tokens with
    none are left out.  How much a request repeats its own paths, as text repeats its
    words: what a policy that learns from the request being served (fMoE's online map
    store) can exploit beyond other requests."""
    req = trace.iter_request  # (N,)
    pos = np.arange(len(req))
    ok = (req[:, None] == req[None, :]) & (pos[None, :] <= pos[:, None] - gap)  # (N, N)
    has = ok.any(axis=1)  # (N,)
    if not has.any():
        raise FmoesimError(f"{trace.path}: no token has a token {gap} or more positions before it")
    shares = [float(share[has].mean()) for _, share in _nearest_paths(trace, ok, distance)]
    return float(np.mean(shares))


def path_stats(trace: Trace, distance: int = 3) -> tuple[float, float, float]:
    """:func:`path_predictability`'s nearest path and popularity, and
    :func:`own_path_predictability`, of ``trace`` at ``distance``."""
    near, pop = path_predictability(trace, distance)
    return near, pop, own_path_predictability(trace, distance)


def kendall_tau(a: Mapping[str, float], b: Mapping[str, float]) -> float:
    """Kendall's tau-a of two scores of the same keys: (concordant - discordant pairs)
    over all pairs; a pair tied in either counts as neither.  NaN with fewer than two
    keys."""
    if set(a) != set(b):
        raise ValueError(f"different keys: {sorted(set(a) ^ set(b))}")
    keys = sorted(a)
    pairs = list(itertools.combinations(keys, 2))
    if not pairs:
        return math.nan
    s = sum(np.sign(a[x] - a[y]) * np.sign(b[x] - b[y]) for x, y in pairs)
    return float(s / len(pairs))


def flipped_pairs(
    real: Mapping[str, float], samples: Sequence[Mapping[str, float]]
) -> list[tuple[str, str]]:
    """Pairs ``(x, y)`` every sample orders ``x < y`` strictly while the real scores have
    ``x > y`` strictly: the comparisons the samples agree on and get wrong."""
    out = []
    for x, y in itertools.permutations(sorted(real), 2):
        if real[x] > real[y] and all(s[x] < s[y] for s in samples):
            out.append((x, y))
    return out


@dataclass(frozen=True)
class Row:
    """One run: the workload (``real`` or a key of :data:`WORKLOADS`), the sample's seed
    (-1 for the real logs), the policy, the total budget and what the report shows of
    the run."""

    workload: str
    seed: int
    policy: str
    budget_gb: float
    tpot_ms: float
    hit_rate: float


def run_all(
    traces: Mapping[str, Sequence[tuple[int, Trace]]],
    model: ModelSpec,
    hardware: HardwareSpec,
    policies: Sequence[str] = POLICIES,
    budgets_gb: Sequence[float] = BUDGETS_GB,
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Every policy at every total budget on every trace, timed, static batches of one,
    each policy a fresh object from its preset."""
    from fmoesim.config.build import policy_from_preset
    from fmoesim.engine.simulate import simulate

    rows = []
    for (workload, samples), gb in itertools.product(traces.items(), budgets_gb):
        for (seed, trace), name in itertools.product(samples, policies):
            per_gpu = int(gb * 1e9 / hardware.num_gpus)
            s = simulate(trace, model, hardware, policy_from_preset(name), per_gpu).summary
            rows.append(Row(workload, seed, name, gb, 1e3 * s["tpot_mean_s"], s["hit_rate"]))
            if progress is not None:
                progress(f"{workload} seed {seed} {gb:g} GB {name}: TPOT {rows[-1].tpot_ms:.1f} ms")
    return rows


@dataclass(frozen=True)
class Blocking:
    """One run of :data:`BLOCKING_EXPERIMENT`: the workload (``real`` or a key of
    :data:`WORKLOADS`), the sample's seed (-1 for the real logs), the policy and its GPU
    blocking time."""

    workload: str
    seed: int
    policy: str
    stall_s: float


def run_blocking(
    traces: Mapping[str, Sequence[tuple[int, Trace]]],
    policies: Sequence[str] = BLOCKING_POLICIES,
    progress: Callable[[str], None] | None = None,
) -> list[Blocking]:
    """Every policy in :data:`BLOCKING_EXPERIMENT`'s setting on every trace (its preset
    with ``workload=trace`` on the trace's directory, nothing stored)."""
    from fmoesim.cli.main import compose_config, run_config

    rows = []
    for workload, samples in traces.items():
        for (seed, trace), name in itertools.product(samples, policies):
            cfg = compose_config([f"experiment={BLOCKING_EXPERIMENT}", f"policy={name}",
                                  "workload=trace", f"workload.path={trace.path}",
                                  "store.enabled=false", "output.write=false"])  # fmt: skip
            s = run_config(cfg, multirun=True)
            rows.append(Blocking(workload, seed, name, float(s["stall_s"])))
            if progress is not None:
                progress(f"{workload} seed {seed} {name}: blocking {rows[-1].stall_s:.2f} s")
    return rows


def blocking_section(rows: Sequence[Blocking]) -> list[str]:
    """The report's lines on :data:`BLOCKING_EXPERIMENT`: per policy its blocking time
    against on-demand fetching's (``lru``, Table 2's 100%) and, where the run has it,
    against vanilla prefetching's (Table 4's 100%), on the real logs and on the samples
    (mean with the range).  Empty without rows."""
    if not rows:
        return []
    policies = list(dict.fromkeys(r.policy for r in rows))
    workloads = list(dict.fromkeys(r.workload for r in rows))
    runs: dict[str, dict[int, dict[str, float]]] = {}
    for r in rows:
        runs.setdefault(r.workload, {}).setdefault(r.seed, {})[r.policy] = r.stall_s
    bases = [b for b in ("lru", "moe-infinity-vanilla") if b in policies]
    lines = [
        "",
        "## Blocking time in MoE-Infinity's setting",
        "",
        f"`experiment={BLOCKING_EXPERIMENT}` (MoE-Infinity §7.2: caching off, Table 5's 39 "
        "Mixtral buffer slots, its testbed; half of the requests build the EAMC and the "
        "others are served) with `workload=trace` on the real logs and on each sample: GPU "
        "blocking time in percent of on-demand fetching's (`lru`, Table 2's 100%) and of "
        "vanilla prefetching's (Table 4's 100%); a synthetic workload's cell is the mean of "
        "its samples with their range.",
        "",
        "| policy | " + " | ".join(
            f"{w}: % of {'on-demand' if b == 'lru' else 'vanilla'}" for b in bases
            for w in workloads) + " |",
        "|---|" + "---|" * (len(bases) * len(workloads)),
    ]  # fmt: skip
    for p in policies:
        cells = []
        for b, w in itertools.product(bases, workloads):
            pct = [100 * s[p] / s[b] for s in runs[w].values() if s[b] > 0]
            cells.append(_spread(pct, 0) if w != "real" else f"{pct[0]:.0f}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return lines


def _scores(rows: Sequence[Row], workload: str, gb: float, attr: str) -> list[dict[str, float]]:
    """Per sample of ``workload`` at ``gb``: policy -> ``attr``, samples by seed."""
    by_seed: dict[int, dict[str, float]] = {}
    for r in rows:
        if r.workload == workload and r.budget_gb == gb:
            by_seed.setdefault(r.seed, {})[r.policy] = getattr(r, attr)
    return [by_seed[s] for s in sorted(by_seed)]


def report(
    rows: Sequence[Row],
    real_source: str,
    real: Trace,
    setting: str,
    paths: Mapping[str, Sequence[tuple[float, float, float]]],
    blocking: Sequence[Blocking] = (),
) -> str:
    """The Markdown report: the agreement of the orders, each workload's
    :func:`path_predictability` and :func:`own_path_predictability` (``paths``: per
    workload, one triple per sample), then per
    budget each policy's TPOT and hit rate on the real logs and on the samples of each
    workload (mean, with the samples' range)."""
    budgets = sorted({r.budget_gb for r in rows})
    policies = list(dict.fromkeys(r.policy for r in rows))
    synth = [w for w in WORKLOADS if any(r.workload == w for r in rows)]
    n = {w: len(_scores(rows, w, budgets[0], "tpot_ms")) for w in synth}
    lines = [
        "# Policies on real routing",
        "",
        f"Generated by `{PROG}` from the real route logs in `{Path(real_source).name}/` "
        "(outside the project; never copied). Figures only.",
        "",
        f"Setting: {setting}. Real logs: {real.num_requests} requests, "
        f"{real.num_iterations} tokens, one token per iteration. Synthetic samples: "
        + ", ".join(f"{n[w]} of `workload={WORKLOADS[w]}` ({w})" for w in synth)
        + f", each {real.num_requests} requests of a median "
        f"{int(np.median(real.output_tokens))} tokens, in the same top-k view "
        "(routed experts only: no probabilities, embeddings or speculative prediction). "
        "Policies that need a speculative prediction have no input in that view and are "
        "left out.",
        "",
        "Kendall's tau compares the order of the policies by TPOT on the real logs with "
        "each sample's (1: the same order, 0: unrelated, -1: reversed); a flipped pair is "
        "one every sample orders one way and the real logs the other.",
        "",
        "| budget | " + " | ".join(f"tau: real vs {w} (mean, range)" for w in synth)
        + " | " + " | ".join(f"flipped pairs ({w})" for w in synth) + " |",
        "|---|" + "---|" * (2 * len(synth)),
    ]  # fmt: skip
    for gb in budgets:
        real_tpot = _scores(rows, "real", gb, "tpot_ms")[0]
        taus, flips = [], []
        for w in synth:
            samples = _scores(rows, w, gb, "tpot_ms")
            t = [kendall_tau(real_tpot, s) for s in samples]
            taus.append(f"{np.mean(t):.2f} ({min(t):.2f} to {max(t):.2f})")
            f = flipped_pairs(real_tpot, samples)
            flips.append(", ".join(f"{x} < {y}" for x, y in f) or "none")
        lines.append(f"| {gb:g} GB | " + " | ".join(taus) + " | " + " | ".join(flips) + " |")
    lines += [
        "",
        f"Path predictability ({PATH_DISTANCE} layers ahead, `path_predictability` in "
        f"`{PROG.split()[-1]}`): the share of a token's experts {PATH_DISTANCE} layers on "
        "that the nearest token of another request (the most experts in common so far) "
        "routes to, against the share among the other requests' most popular experts "
        "there, and the nearest path among the token's own request's tokens two or more "
        "positions back (`own_path_predictability`: how much a request repeats its own "
        "paths); in percent, a synthetic workload's cell the mean of its samples with "
        "their range.",
        "",
        "| workload | nearest path | popularity | path - popularity (points) "
        "| own request's nearest path |",
        "|---|---|---|---|---|",
    ]
    for w in ("real", *synth):
        near = [100 * a for a, _, _ in paths[w]]
        pop = [100 * b for _, b, _ in paths[w]]
        own = [100 * o for _, _, o in paths[w]]
        gap = [a - b for a, b in zip(near, pop, strict=True)]
        cells = [_spread(x, 1) if len(x) > 1 else f"{x[0]:.1f}" for x in (near, pop, gap, own)]
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    for gb in budgets:
        lines += [
            "",
            f"## {gb:g} GB of experts",
            "",
            "TPOT in ms and hit rate in percent; a synthetic workload's cell is the mean of "
            "its samples with their range.",
            "",
            "| policy | TPOT real | " + " | ".join(f"TPOT {w}" for w in synth)
            + " | hit real | " + " | ".join(f"hit {w}" for w in synth) + " |",
            "|---|" + "---|" * (2 + 2 * len(synth)),
        ]  # fmt: skip
        real_tpot = _scores(rows, "real", gb, "tpot_ms")[0]
        real_hit = _scores(rows, "real", gb, "hit_rate")[0]
        for p in sorted(policies, key=lambda p: real_tpot[p]):
            cells = [f"{real_tpot[p]:.1f}"]
            cells += [_spread([s[p] for s in _scores(rows, w, gb, "tpot_ms")], 1) for w in synth]
            cells.append(f"{100 * real_hit[p]:.1f}")
            cells += [
                _spread([100 * s[p] for s in _scores(rows, w, gb, "hit_rate")], 1) for w in synth
            ]
            lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += blocking_section(blocking)
    lines.append("")
    return "\n".join(lines)


def _spread(xs: Sequence[float], digits: int) -> str:
    """``mean (min to max)`` of ``xs``."""
    return f"{np.mean(xs):.{digits}f} ({min(xs):.{digits}f} to {max(xs):.{digits}f})"


def main(argv: list[str] | None = None) -> None:
    """Import the real logs, draw the samples, run every policy on each, write the
    report."""
    from fmoesim.config.build import check_preset_names, load_preset
    from fmoesim.trace import read_trace
    from fmoesim.trace.importers import import_vllm_routes

    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--real",
        default=str(REAL_DEFAULT),
        help="Mixtral-8x7B route logs in the vLLM route-log format (a .jsonl file or a "
        "directory of them; docs/traces.md) (default: %(default)s)",
    )
    ap.add_argument(
        "--out",
        default=str(PROJECT_ROOT / "traces" / "real-routing-policies.md"),
        help="the report to write (Markdown; default: %(default)s)",
    )
    ap.add_argument(
        "--seeds", type=int, default=SEEDS, help="synthetic samples per workload (%(default)s)"
    )
    ap.add_argument(
        "--policies",
        default=",".join(POLICIES),
        help="comma-separated policy presets (default: %(default)s)",
    )
    ap.add_argument(
        "--blocking-policies",
        default=",".join(BLOCKING_POLICIES),
        help=f"comma-separated policy presets run in {BLOCKING_EXPERIMENT}'s setting, "
        "lru among them; empty: no such section (default: %(default)s)",
    )
    ap.add_argument(
        "--budgets-gb",
        default=",".join(f"{b:g}" for b in BUDGETS_GB),
        help="comma-separated total expert budgets in GB (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    if not Path(args.real).exists():
        raise FmoesimError(f"--real {args.real}: no such file or directory")
    if args.seeds < 1:
        raise FmoesimError(f"--seeds {args.seeds}: must be at least 1")
    policies = [p for p in args.policies.split(",") if p]
    check_preset_names("policy", policies, "--policies")
    blocking_policies = [p for p in args.blocking_policies.split(",") if p]
    check_preset_names("policy", blocking_policies, "--blocking-policies")
    if blocking_policies and "lru" not in blocking_policies:
        raise FmoesimError(
            f"--blocking-policies {args.blocking_policies}: must hold lru (on-demand "
            "fetching, Table 2's 100%)"
        )
    from fmoesim.config.build import policy_from_preset

    for p in dict.fromkeys([*policies, *blocking_policies]):
        if getattr(policy_from_preset(p), "uses_spec", False):
            flag = "--policies" if p in policies else "--blocking-policies"
            raise FmoesimError(
                f"{flag} {p}: needs a speculative prediction, which top-k route logs "
                "do not have (rule: policies that decide on routed experts only)"
            )
    budgets = []
    for b in args.budgets_gb.split(","):
        try:
            gb = float(b)
        except ValueError:
            gb = math.nan
        if not (math.isfinite(gb) and gb > 0):
            raise FmoesimError(f"--budgets-gb {b!r}: must be a positive number of GB")
        budgets.append(gb)
    model = load_preset("model", MODEL, ModelSpec)
    hw = load_preset("hardware", HARDWARE, HardwareSpec)
    with tempfile.TemporaryDirectory() as tmp:
        path, _ = import_vllm_routes(args.real, Path(tmp) / "real", model)
        real = read_trace(path)
        tokens = int(np.median(real.output_tokens))
        traces: dict[str, list[tuple[int, Trace]]] = {"real": [(-1, real)]}
        for w, preset in WORKLOADS.items():
            traces[w] = [
                (s, synthetic_sample(model, preset, real.num_requests, tokens, s,
                                     Path(tmp) / f"{w}-{s}"))
                for s in range(args.seeds)
            ]  # fmt: skip
        paths = {w: [path_stats(t, PATH_DISTANCE) for _, t in ts] for w, ts in traces.items()}
        rows = run_all(traces, model, hw, policies, budgets, progress=print)
        blocking = run_blocking(
            {w: traces[w] for w in ("real", BLOCKING_WORKLOAD)}, blocking_policies, print
        )
    setting = (
        f"`model={MODEL}` on `hardware={HARDWARE}` (six RTX 3090s, experts round-robin), "
        f"static batches of one, an empty map store, total expert budgets of "
        + ", ".join(f"{b:g}" for b in budgets)
        + " GB"
    )
    text = report(rows, args.real, real, setting, paths, blocking)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(out) as tmp_path:
        tmp_path.write_text(text)
    print(f"wrote {out}")


if __name__ == "__main__":
    run_or_exit(PROG, main)
