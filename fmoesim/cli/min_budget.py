"""``fmoesim-min-budget``: the smallest expert budget that meets a target TPOT.

MoEpic §4.3 and Fig. 8 ask it of MoEpic; this answers it for any policy, by bisection
over simulator runs.

Examples::

    fmoesim-min-budget --target-tpot-ms 300,400 policy=lcp
    fmoesim-min-budget --target-tpot-ms 150 policy=fmoe hardware=a6000-pcie4

The overrides are ``fmoesim``'s.  The budget is searched in whole experts between one
layer's top-k and the whole model (on several GPUs: per GPU, up to one GPU's share of
the model), assuming TPOT does not rise when the budget grows
(true of every policy here up to small anomalies; the printed table shows the runs so a
user can check).  Exit status 2 and one line on stderr for bad input (a target that is
not a finite number > 0; ``engine.timing=false``, as the search needs timed runs).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass

from fmoesim.errors import ArgumentParser, FmoesimError, run_or_exit

PROG = "fmoesim-min-budget"


@dataclass
class MinBudget:
    """The answer for one target: ``experts`` (None when even the largest budget misses
    it) and the TPOT measured there."""

    target_s: float
    experts: int | None
    tpot_s: float


def min_budget(tpot_s: Callable[[int], float], lo: int, hi: int, target_s: float) -> MinBudget:
    """Smallest ``n`` in ``[lo, hi]`` with ``tpot_s(n) <= target_s`` by bisection (``tpot_s``
    assumed non-increasing in ``n``); ``tpot_s`` is called O(log(hi - lo)) times."""
    if lo > hi:
        raise ValueError(f"empty budget range [{lo}, {hi}]")
    top = tpot_s(hi)
    if top > target_s:
        return MinBudget(target_s, None, top)
    best, best_t = hi, top
    while lo < best:
        mid = (lo + best) // 2
        t = tpot_s(mid)
        if t <= target_s:
            best, best_t = mid, t
        else:
            lo = mid + 1
    return MinBudget(target_s, best, best_t)


def _floats(s: str) -> list[float]:
    try:
        return [float(x) for x in s.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of numbers: {s!r}") from None


def main(argv: list[str] | None = None) -> None:
    """Console entry point (exit contract: :mod:`fmoesim.errors`)."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument(
        "--target-tpot-ms",
        type=_floats,
        required=True,
        help="one or more target TPOTs in ms, comma-separated",
    )
    ap.add_argument("overrides", nargs="*", help="fmoesim config overrides, e.g. policy=lcp")

    def parse_and_run() -> None:
        # options may stand between the overrides (policy=lfu --target-tpot-ms 300 ...)
        args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
        _run(args.target_tpot_ms, args.overrides)

    run_or_exit(PROG, parse_and_run)


def _check_overrides(overrides: list[str]) -> None:
    """Refuse a sweep (``policy=lru,lfu``: Hydra would answer with its multirun hint,
    which this command does not take) and a budget (the search sets it)."""
    from fmoesim.cli.main import parse_overrides

    for o, text in zip(parse_overrides(overrides), overrides, strict=True):
        if o.is_sweep_override():
            raise FmoesimError(
                f"{text}: {PROG} searches one configuration (rule: one value per key; run "
                "it once per value)"
            )
        if o.key_or_group == "cache.budget_gb":
            raise FmoesimError(f"{text}: {PROG} searches the budget (rule: leave it out)")


def budget_gb_for(experts: int, size_bytes: int) -> str:
    """The shortest ``cache.budget_gb`` (at least two decimals) that holds exactly
    ``experts`` experts of ``size_bytes`` when typed back: a run takes
    ``budget_bytes_of(budget_gb) // size_bytes`` experts, so a value rounded to the
    nearest hundredth can hold one expert fewer; this one is rounded up, at as many
    decimals as keep it below one more expert."""
    from fmoesim.config.build import budget_bytes_of

    need = experts * size_bytes  # bytes
    for d in range(2, 13):
        q = 10**d
        units = -(-need * q // 10**9)  # the budget in 1/q GB, rounded up
        text = f"{units // q}.{units % q:0{d}d}"
        if budget_bytes_of(float(text)) // size_bytes == experts:
            return text
    return repr(need / 1e9)


def _run(targets_ms: list[float], overrides: list[str]) -> None:
    from hydra.utils import instantiate

    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run, simulate_spec
    from fmoesim.engine.simulate import check_shapes
    from fmoesim.errors import ConfigError
    from fmoesim.trace.reader import read_trace

    for t in targets_ms:
        if not 0 < t < math.inf:
            raise FmoesimError(f"--target-tpot-ms {t:g}: must be a finite number > 0")
    _check_overrides(overrides)
    cfg = compose_config(overrides)
    if not cfg.engine.timing:
        raise ConfigError(
            "engine.timing", False, f"{PROG} searches by TPOT, which needs timed runs: drop it"
        )
    spec = build_run(cfg)
    for key, value in (("experts_per_layer", spec.experts_per_layer), ("preload", spec.preload)):
        if value:  # the search sets one global budget, expert by expert
            raise ConfigError(
                f"cache.{key}", value, f"{PROG} searches a global cache.budget_gb: drop it"
            )
    trace = read_trace(_trace_path(spec))
    check_shapes(trace, spec.model)  # before the header, not at the first run
    m = spec.model
    size = m.expert_size_bytes
    runs: dict[int, float] = {}

    def tpot(n: int) -> float:
        if n not in runs:
            r = simulate_spec(
                spec,
                trace,
                policy=instantiate(cfg.policy),
                budget_bytes=n * size,
                timing=True,
                access_log=False,
                progress=False,
                experts_per_layer=None,
            )
            runs[n] = r.summary["tpot_mean_s"]
            gb = budget_gb_for(n, size)  # as typed back, it holds these n experts
            print(f"  {n:>5} experts ({gb:>7} GB): TPOT {1e3 * runs[n]:9.2f} ms")
        return runs[n]

    gpus = spec.hardware.num_gpus
    lo = m.gpu_topk_experts(gpus)  # what one GPU computes of a token's layer
    hi = max(lo, m.experts_per_gpu(gpus))  # the budget is per GPU
    per = " per GPU" if gpus > 1 else ""
    print(
        f"{spec.policy.name} on {m.name} / {spec.hardware.name}: bisection over {lo}..{hi} "
        f"experts{per}"
    )
    answers = [min_budget(tpot, lo, hi, t / 1e3) for t in sorted(set(targets_ms))]
    print(f"\n| target TPOT ms | min experts{per} | cache.budget_gb | TPOT there ms |")
    print("|---|---|---|---|")
    for a in answers:
        if a.experts is None:
            whole = "every expert" + (" of each GPU" if gpus > 1 else "")
            print(f"| {1e3 * a.target_s:g} | not met | - | {1e3 * a.tpot_s:.2f} ({whole}) |")
        else:
            gb = budget_gb_for(a.experts, size)
            floor = " (the least searched)" if a.experts == lo else ""
            print(f"| {1e3 * a.target_s:g} | {a.experts}{floor} | {gb} | {1e3 * a.tpot_s:.2f} |")
    met = [a.experts for a in answers if a.experts is not None]
    gpu_bytes = spec.hardware.gpu_memory_gb * 1e9
    if met and max(met) * size + spec.model.resident_weight_bytes > gpu_bytes:
        print(
            f"\nnote: {budget_gb_for(max(met), size)} GB of experts and "
            f"{spec.model.resident_weight_bytes / 1e9:.2f} GB of the model's other weights exceed "
            f"the {spec.hardware.gpu_memory_gb:g} GB of the {spec.hardware.gpu}: a what-if, "
            "not this GPU (cache.budget_gb is not checked against its memory)"
        )


if __name__ == "__main__":
    main()
