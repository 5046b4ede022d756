"""fMoE: map-search cost, store memory, the §6.5 ablation ladder (Fig. 12), simulation speed.

Run ``python -m benchmarks.fmoe`` (``--part search|memory|ladder|speed`` for one table).

- search: one core, Mixtral shape (32 layers x 8 experts), batch 1, embeddings of 64
  values (the synthetic traces' size; the collector's random projection is meant to
  give a few hundred at most).  A *trajectory query* is what the policy does at one
  gate (add the layer's row to the running match and take the best stored map,
  :class:`policies.fmoe.TrajectoryQuery`), averaged over the 32 gates of an iteration;
  a *semantic query* is one iteration-start search over the embeddings.  The
  target: at most 20 us at C = 1K and 100 us at C = 10K (MoE-Infinity's matcher: 21
  and 226 us).  RDY is the cost of one store update at capacity when the scores must be
  recomputed (the policy reuses its searches' scores instead, so this is the
  worst case, e.g. :meth:`FMoE.learn`).
- memory: bytes of a store of 50K Mixtral-shaped maps (target: at most 100 MB; the
  paper quotes under 200 MB for 32K maps, Fig. 16), with 64-value embeddings and with
  the model's full hidden size (4096).
- ladder: hit rates of the Fig. 12a variants (Speculate, Hit count, Map (T), Map (T+S),
  Map (T+S+δ)) and Fig. 12b (fMoE's prefetching with LRU / LFU / its own caching) on
  the bundled synthetic trace, offline mode (7:3 split, ``serving.held_in_fraction``),
  hit-rate-only engine, at three budgets, plus Fig. 8's Pearson correlations of the
  best semantic / trajectory scores with the iteration hit rate.
- speed: how much faster than real time the default fMoE simulates (modelled seconds /
  wall seconds of ``simulate``, timed), best of ``--repeat`` runs: Mixtral-8x7B on the
  bundled trace, RTX 3090 PCIe 4, 24 GB (target: >= 1000x), and Qwen3-30B-A3B (128
  experts, top-8) on 8 synthetic requests (``workload=synthetic
  workload.synthetic.num_requests=8``) with a budget of a quarter of its experts
  (target: >= 50x).  ``python -m benchmarks.fmoe_digests`` checks that a change keeps
  every decision.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks._cli import build_line, parser, positive_int
from benchmarks.fmoe_digests import qwen3_setting
from fmoesim.config.build import check_preset_names, load_preset, policy_from_preset
from fmoesim.config.schema import PROJECT_ROOT
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.errors import run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from policies.fmoe import ExpertMapStore, FMoE

L, J, D = 32, 8, 64

FIG12A = [
    ("Speculate", dict(guide="speculate")),
    ("Hit count", dict(guide="hit_count", semantic=False, dynamic_threshold=False)),
    ("Map (T)", dict(semantic=False, dynamic_threshold=False)),
    ("Map (T+S)", dict(dynamic_threshold=False)),
    ("Map (T+S+δ)", dict()),
]
FIG12B = [("LRU", dict(cache="lru")), ("LFU", dict(cache="lfu")), ("fMoE", dict())]


def _filled(capacity: int, dim: int, rng: np.random.Generator) -> ExpertMapStore:
    s = ExpertMapStore(capacity, L, J, dim, 3)
    maps = rng.dirichlet(np.full(J, 0.3), size=(capacity, L)).astype(np.float32)
    embs = rng.standard_normal((capacity, dim)).astype(np.float32) if dim else None
    for i in range(capacity):
        s.add(maps[i], None if embs is None else embs[i])
    return s


def search(repeat: int) -> None:
    """Per-query microseconds at C = 1K and 10K."""
    rng = np.random.default_rng(0)
    iters = rng.dirichlet(np.full(J, 0.3), size=(20, L, 1)).astype(np.float32)  # (20, L, 1, J)
    embs = rng.standard_normal((20, 1, D)).astype(np.float32)
    print("| maps (C) | us / trajectory query | us / semantic query | us / RDY (recomputed) |")
    print("|---|---|---|---|")
    for cap in (1000, 10000):
        s = _filled(cap, D, rng)
        traj = sem = rdy = float("inf")
        for _ in range(repeat):
            t0 = time.perf_counter()
            for it in iters:
                q = s.query(1)
                for layer in range(L):
                    q.observe(layer, it[layer])
                    q.best()
            traj = min(traj, (time.perf_counter() - t0) / (len(iters) * L))
            t0 = time.perf_counter()
            for e in embs:
                s.semantic_scores(e).argmax(axis=1)
            sem = min(sem, (time.perf_counter() - t0) / len(embs))
            t0 = time.perf_counter()
            for it, e in zip(iters[:5], embs[:5], strict=True):
                s.redundancy(it[:, 0], e[0]).argmax()
            rdy = min(rdy, (time.perf_counter() - t0) / 5)
        print(f"| {cap:,} | {traj * 1e6:.1f} | {sem * 1e6:.1f} | {rdy * 1e6:.0f} |")


def memory() -> None:
    """Store bytes for 50K maps."""
    print("| maps | embedding values | store MB |")
    print("|---|---|---|")
    for dim in (D, 4096):
        s = ExpertMapStore(50_000, L, J, dim, 3)
        print(f"| 50,000 | {dim} | {s.nbytes() / 1e6:.0f} |")


def ladder(calibrated: bool = False) -> None:
    """Fig. 12 hit rates on the bundled trace (or on the synthetic workload calibrated on
    real Mixtral routing, ``workload=routing-mixtral-8x7b``)."""
    model = load_preset("model", "mixtral-8x7b", ModelSpec)
    if calibrated:
        import tempfile
        from pathlib import Path

        from omegaconf import OmegaConf

        from fmoesim.config.schema import CONF_DIR
        from fmoesim.workload.synthetic import SyntheticConfig, generate

        knobs = OmegaConf.to_container(
            OmegaConf.load(CONF_DIR / "workload" / "routing-mixtral-8x7b.yaml").synthetic
        )
        tmp = tempfile.mkdtemp()
        generate(model, SyntheticConfig(**knobs), Path(tmp) / "t")  # type: ignore[arg-type]
        trace = read_trace(Path(tmp) / "t")
    else:
        trace = read_trace(PROJECT_ROOT / "traces" / "default")
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    serving = ServingConfig(held_in_fraction=0.7)
    budgets = (6, 12, 24)
    head = " | ".join(f"{b} GB" for b in budgets)
    corr: dict[str, tuple[float, float, float, float]] = {}
    for title, rows in (
        ("Fig. 12a: expert pattern tracking", FIG12A),
        ("Fig. 12b: caching", FIG12B),
    ):
        print(f"\n### {title} (hit rate)\n")
        print(f"| variant | {head} |")
        print("|---|" + "---|" * len(budgets))
        for name, kw in rows:
            cells = []
            for b in budgets:
                pol = FMoE(**kw)
                s = simulate(trace, model, hw, pol, int(b * 1e9), serving=serving, timing=False)
                cells.append(f"{100 * s.summary['hit_rate']:.1f}%")
                if b == 12 and rows is FIG12A and kw.get("guide", "map") == "map":
                    a, d = pol.correlations(), pol.correlations(decode_only=True)
                    corr[name] = (a["semantic"], a["trajectory"], d["semantic"], d["trajectory"])
            print(f"| {name} | " + " | ".join(cells) + " |")
    print("\n### Fig. 8: Pearson correlation with the iteration hit rate (12 GB)\n")
    print("| variant | semantic | trajectory | semantic (decode) | trajectory (decode) |")
    print("|---|---|---|---|---|")
    for name, r in corr.items():
        print(f"| {name} | " + " | ".join(f"{x:.2f}" for x in r) + " |")


def speed(repeat: int, policy: str = "fmoe") -> None:
    """x real time of a policy preset (timed; fMoE by default) on Mixtral and Qwen3, best
    of ``repeat``."""
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    mixtral = load_preset("model", "mixtral-8x7b", ModelSpec)
    print("| setting | modelled s | wall s (best) | wall s (median) | x real time | target |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        qt, qm, qb = qwen3_setting(Path(tmp))
        cases = [
            ("Mixtral-8x7B, bundled trace, 24 GB", read_trace(PROJECT_ROOT / "traces" / "default"),
             mixtral, int(24e9), 1000),
            ("Qwen3-30B-A3B, 8 synthetic requests, 1/4 of the experts", qt, qm, qb, 50),
        ]  # fmt: skip
        for name, trace, model, budget, target in cases:
            runs = [
                simulate(trace, model, hw, policy_from_preset(policy), budget).summary
                for _ in range(repeat)
            ]
            walls = sorted(r["wall_s"] for r in runs)
            sim_s = runs[0]["simulated_s"]
            print(
                f"| {name} | {sim_s:.1f} | {walls[0]:.2f} | {walls[len(walls) // 2]:.2f} "
                f"| {sim_s / walls[0]:,.0f} | {target:,} |"
            )


def main() -> None:
    """Print the README's tables."""
    ap = parser("python -m benchmarks.fmoe", __doc__.splitlines()[0])
    ap.add_argument("--part", choices=("search", "memory", "ladder", "speed", "all"), default="all")
    ap.add_argument("--repeat", type=positive_int, default=3, help="runs of each (3)")
    ap.add_argument("--policy", default="fmoe", help="policy preset for --part speed (fmoe)")
    ap.add_argument(
        "--calibrated",
        action="store_true",
        help="ladder on workload=routing-mixtral-8x7b instead of the bundled trace",
    )
    args = ap.parse_args()
    run_or_exit(ap.prog, _main, args)


def _main(args: argparse.Namespace) -> None:
    check_preset_names("policy", [args.policy], "--policy")
    print(f"{build_line()}\n")
    if args.part in ("search", "all"):
        search(args.repeat)
    if args.part in ("memory", "all"):
        print()
        memory()
    if args.part in ("ladder", "all"):
        ladder(args.calibrated)
    if args.part in ("speed", "all"):
        print()
        speed(args.repeat, args.policy)


if __name__ == "__main__":
    main()
