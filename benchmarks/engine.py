"""Engine speed: simulated layer steps per second and modelled-time / wall-time, per policy.

Run ``make bench`` (or ``python -m benchmarks.engine``); prints Markdown tables for the
README.  Setting: the bundled trace (Mixtral-8x7B shape) on the RTX 3090 preset with the
default 24 GB expert budget, batch size 1, one core.  Each number is the best of
``--repeat`` runs (the machine is shared; the best run is the least disturbed one), run
in rounds over the policies; the per-policy table also gives the median.

Run it on both builds: as checked out (pure Python) and after ``make compiled``; the
first line says which one ran.

Targets: every policy models >= 1000x real time; LRU in hit-rate-only mode
processes >= 2 million expert accesses per second.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks._cli import build_line, parser, positive_int
from fmoesim.config.build import check_preset_names, load_preset, policy_from_preset, preset_names
from fmoesim.config.schema import PROJECT_ROOT
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.errors import names_of, run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.lru import LRU

GB = 1e9


def _best(repeat: int, make_policy: Any, *args: Any, **kw: Any) -> dict[str, Any]:
    """The summary of the fastest of ``repeat`` identical runs (a fresh policy each)."""
    runs = [
        simulate(args[0], args[1], args[2], make_policy(), *args[3:], **kw) for _ in range(repeat)
    ]
    return min((r.summary for r in runs), key=lambda s: s["wall_s"])


def per_policy(repeat: int, names: list[str] | None = None) -> list[str]:
    """One row per policy preset (all of ``conf/policy/``, or ``names``) on the default
    setting: the fastest of ``repeat`` runs, and the median modelled / wall time.

    The runs go in rounds (every policy once, then again), not ``repeat`` runs of one
    policy in a row: on this shared machine a busy spell lasts tens of seconds, and
    in rounds it slows one run of each policy instead of every run of one policy.
    """
    trace = read_trace(PROJECT_ROOT / "traces" / "default")
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    names = names or preset_names("policy")
    timed: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    hit_only: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for _ in range(repeat):
        for name in names:
            budget = int(24 * GB)
            timed[name].append(simulate(trace, model, hw, policy_from_preset(name), budget).summary)
            r = simulate(trace, model, hw, policy_from_preset(name), budget, timing=False)
            hit_only[name].append(r.summary)
    rows = [
        "| policy | hit | late | hit (hit-only mode) | TPOT (ms) | modelled s | wall s "
        "| x real time | x real time, median | layer steps/s | hit-only accesses/s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        s = min(timed[name], key=lambda x: x["wall_s"])
        h = min(hit_only[name], key=lambda x: x["wall_s"])
        median = statistics.median(x["speedup_vs_real"] for x in timed[name])
        rows.append(
            f"| {name} | {s['hit_rate'] * 100:.1f}% | {s['late_rate'] * 100:.1f}% "
            f"| {h['hit_rate'] * 100:.1f}% | {s['tpot_mean_s'] * 1e3:.1f} "
            f"| {s['simulated_s']:.1f} | {s['wall_s']:.2f} | {s['speedup_vs_real']:,.0f} "
            f"| {median:,.0f} | {s['layer_steps'] / s['wall_s']:,.0f} "
            f"| {h['accesses'] / h['wall_s']:,.0f} |"
        )
    return rows


def _small_model(L: int, E: int) -> ModelSpec:
    base = load_preset("model", "mixtral-8x7b", ModelSpec)
    return replace(base, name=f"mixtral-shape-{L}x{E}", num_layers=L, num_experts=E)


def scaling(repeat: int, workdir: Path) -> list[str]:
    """Wall time of LRU (timed) as trace length, layers, experts and batch size grow."""
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    cases = [
        ("requests", n, 32, 8, 1) for n in (8, 16, 32)
    ] + [("layers", 16, L, 8, 1) for L in (8, 16, 64)] + [
        ("experts", 16, 32, E, 1) for E in (16, 64)
    ] + [("batch", 16, 32, 8, b) for b in (2, 4, 8)]  # fmt: skip
    rows = [
        "| varied | requests | layers | experts | batch | layer steps | accesses | wall s "
        "| us / layer step | us / access |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for what, n, L, E, b in cases:
        model = _small_model(L, E)
        path = workdir / f"{L}x{E}-{n}"
        if not path.exists():
            cfg = SyntheticConfig(num_requests=n, output_tokens_median=64, seed=0)
            generate(model, cfg, path, overwrite=True)
        tr = read_trace(path)
        budget = int(0.25 * L * E) * model.expert_size_bytes  # a quarter of the experts
        s = _best(repeat, LRU, tr, model, hw, budget, serving=ServingConfig(batch_size=b))
        rows.append(
            f"| {what} | {n} | {L} | {E} | {b} | {s['layer_steps']:,} | {s['accesses']:,} "
            f"| {s['wall_s']:.2f} | {1e6 * s['wall_s'] / s['layer_steps']:.1f} "
            f"| {1e6 * s['wall_s'] / s['accesses']:.2f} |"
        )
    return rows


def main() -> None:
    """Print the benchmark tables."""
    ap = parser("python -m benchmarks.engine", __doc__.splitlines()[0])
    ap.add_argument("--repeat", type=positive_int, default=3, help="runs of each (3)")
    ap.add_argument("--skip-scaling", action="store_true")
    ap.add_argument("--policies", default=None, help="comma-separated presets (default: every one)")
    args = ap.parse_args()
    run_or_exit(ap.prog, _main, args)


def _main(args: argparse.Namespace) -> None:
    t0 = time.perf_counter()
    names = names_of("--policies", args.policies) if args.policies else None
    check_preset_names("policy", names or [], "--policies")
    print(f"{build_line()}\n")
    print("## Per policy (Mixtral-8x7B, RTX 3090 PCIe 4, 24 GB, batch 1, bundled trace)\n")
    print("\n".join(per_policy(args.repeat, names)))
    if not args.skip_scaling:
        print("\n## Scaling (LRU, timed, budget = 1/4 of the experts)\n")
        with tempfile.TemporaryDirectory() as d:
            print("\n".join(scaling(args.repeat, Path(d))))
    print(f"\n(benchmark wall time {time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
