"""MoEpic: Table 1 (cache hit rates of RND, LFU, LRU, LCP) and Table 3 (ablations).

Run ``python -m benchmarks.moepic`` (``--part table1|table3``).

Table 1: MoEpic §3.3 measured Qwen1.5-MoE on MMLU with a
cache of C experts in every layer (``cache.experts_per_layer``); here the same layout on
a synthetic Qwen1.5-MoE-shaped trace (24 layers x 60 experts, top-4; the synthetic
workload model, 32 requests, seed 0; its default skew 1.5, and 0.5, whose RND line
lies near the paper's), hit-rate-only engine, batch 1, demand loading only.  The trace
is synthetic: the numbers show how the policies order on it, not what MMLU on the real
model gives.

Table 3: TTFT and TPOT of MoEpic and its three ablations (w/o SP: random prefetch order;
w/o LCP: random replacement; w/o CCA: uniform budgets, θ = 0.5) on the bundled trace
(Mixtral-8x7B shape, RTX 3090, 24 GB), beside LCP and the paper's baselines, at the
profile's PCIe bandwidth and at 8x it.  The configurator runs every 1,000 tokens (the
paper's 5,000 would run it once on this short trace).
"""

from __future__ import annotations

import dataclasses
import tempfile
from pathlib import Path

from benchmarks._cli import build_line, parser, positive_int
from fmoesim.config.build import load_preset
from fmoesim.engine.simulate import simulate
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.lcp import LCP
from policies.lfu import LFU
from policies.lru import LRU
from policies.rnd import RND

SIZES = (10, 20, 30, 40, 50)
#: MoEpic Table 1 (Qwen1.5-MoE, MMLU), hit rate in % at 10..50 cached experts per layer
PAPER = {
    "RND": (16.41, 33.02, 49.69, 67.41, 83.15),
    "LFU": (24.36, 43.74, 60.68, 75.84, 89.34),
    "LRU": (19.11, 38.88, 56.38, 73.16, 88.97),
    "LCP": (25.56, 45.36, 62.21, 77.12, 90.08),
}
POLICIES = {"RND": RND, "LFU": LFU, "LRU": LRU, "LCP": LCP}


def table1(workdir: Path, num_requests: int, skew: float) -> list[str]:
    """Markdown rows: measured and paper hit rates per policy and cache size."""
    model = load_preset("model", "qwen1.5-moe-a2.7b", ModelSpec)
    hw = load_preset("hardware", "a6000-pcie4", HardwareSpec)
    path = workdir / "qwen"
    cfg = SyntheticConfig(num_requests=num_requests, skew=skew, seed=0)
    generate(model, cfg, path, overwrite=True)
    trace = read_trace(path)
    S = model.expert_size_bytes
    rows = [
        "| policy | " + " | ".join(f"C = {c}" for c in SIZES) + " |",
        "|---|" + "---|" * len(SIZES),
    ]
    measured: dict[str, list[float]] = {}
    for name, cls in POLICIES.items():
        hits = []
        for c in SIZES:
            budget = c * model.num_layers * S
            s = simulate(trace, model, hw, cls(), budget, timing=False, experts_per_layer=c)
            hits.append(100 * s.summary["hit_rate"])
        measured[name] = hits
        rows.append(f"| {name} (here) | " + " | ".join(f"{h:.2f}%" for h in hits) + " |")
    for name, vals in PAPER.items():
        rows.append(f"| {name} (paper) | " + " | ".join(f"{v:.2f}%" for v in vals) + " |")
    order = []
    for i, c in enumerate(SIZES):
        ranked = sorted(measured, key=lambda n: -measured[n][i])
        order.append(f"C = {c}: " + " > ".join(ranked))
    rows += ["", "Measured order: " + "; ".join(order) + "."]
    return rows


TABLE3 = ("moepic", "moepic-no-sp", "moepic-no-lcp", "moepic-no-cca")
BASELINES = ("lcp", "mixtral-offloading", "adapmoe", "pregated")


def table3() -> list[str]:
    """Markdown rows: TTFT / TPOT per variant at 1x and 8x PCIe bandwidth."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    from fmoesim.config.schema import CONF_DIR, PROJECT_ROOT

    trace = read_trace(PROJECT_ROOT / "traces" / "default")
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    fast = dataclasses.replace(hw, pcie_gbps=8 * hw.pcie_gbps)
    rows = [
        "| policy | TTFT ms | TPOT ms | hit | late | TTFT ms (PCIe x8) | TPOT ms (PCIe x8) "
        "| hit (x8) | late (x8) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in TABLE3 + BASELINES:
        cells = []
        for h in (hw, fast):
            pol = instantiate(OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml"))
            if name.startswith("moepic"):
                pol.tau_tokens = 1000
            s = simulate(trace, model, h, pol, int(24e9)).summary
            cells += [
                f"{1e3 * s['ttft_mean_s']:.0f}",
                f"{1e3 * s['tpot_mean_s']:.1f}",
                f"{100 * s['hit_rate']:.1f}%",
                f"{100 * s['late_rate']:.1f}%",
            ]
        c = cells
        rows.append(
            f"| {name} | {c[0]} | {c[1]} | {c[2]} | {c[3]} | {c[4]} | {c[5]} | {c[6]} | {c[7]} |"
        )
    return rows


def main() -> None:
    """Print Table 1 and Table 3 for the README."""
    ap = parser("python -m benchmarks.moepic", __doc__.splitlines()[0])
    ap.add_argument("--part", choices=("table1", "table3", "all"), default="all")
    ap.add_argument("--requests", type=positive_int, default=32, help="synthetic requests (32)")
    ap.add_argument("--skew", type=float, nargs="+", default=[1.5, 0.5])
    args = ap.parse_args()
    print(build_line())
    if args.part in ("table3", "all"):
        print("\n### Table 3\n")
        print("\n".join(table3()))
    if args.part == "table3":
        return
    for skew in args.skew:
        print(f"\n### synthetic skew = {skew}\n")
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(table1(Path(tmp), args.requests, skew)))


if __name__ == "__main__":
    main()
