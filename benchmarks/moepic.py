"""MoEpic Table 1: cache hit rates of RND, LFU, LRU and LCP with C experts per layer.

Run ``python -m benchmarks.moepic``.  MoEpic §3.3 measured Qwen1.5-MoE on MMLU with a
cache of C experts in every layer (``cache.experts_per_layer``); here the same layout on
a synthetic Qwen1.5-MoE-shaped trace (24 layers x 60 experts, top-4; the synthetic
workload model, 32 requests, seed 0; its default skew 1.5, and 0.5, whose RND line
lies near the paper's), hit-rate-only engine, batch 1, demand loading only.  The trace
is synthetic: the numbers show how the policies order on it, not what MMLU on the real
model gives.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

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


def main() -> None:
    """Print Table 1 for the README."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--skew", type=float, nargs="+", default=[1.5, 0.5])
    args = ap.parse_args()
    for skew in args.skew:
        print(f"\n### synthetic skew = {skew}\n")
        with tempfile.TemporaryDirectory() as tmp:
            print("\n".join(table1(Path(tmp), args.requests, skew)))


if __name__ == "__main__":
    main()
