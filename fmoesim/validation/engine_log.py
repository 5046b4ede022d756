"""The simulator's cache against a real engine's logged cache outcomes.

A route log that records, per routed expert, whether the engine found it in its cache
(a ``residency`` column: 1 hit, 0 read from storage) and which phase each step belongs
to is imported with :func:`fmoesim.trace.table.import_table` (the prompt one prefill
iteration, run layer by layer over all its tokens, as a batched prefill is; each decode
step one iteration), served by the simulator with the same policy, budget and per-layer
expert sizes in hit-rate-only mode with an access log, and compared.  Decode accesses
are matched one to one, ``(step, layer, expert)`` of the log against ``(iteration, layer,
expert)`` of the simulation: the logged and simulated hit rates and the share of accesses
where both say the same.  Prefill is reported, not matched: the simulator accesses each
distinct expert of a layer once per prefill iteration, where the log has a row per token
(and an engine may log every prefill access as a miss, whatever its cache held).

Run ``python -m fmoesim.validation.engine_log LOG.csv`` (the defaults are those of the
BigMoeOnEdge log: ``--model qwen3-30b-a3b --top-k 6 --budget-mib 4000 --policy lru``).
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.errors import FmoesimError, run_or_exit

PROG = "python -m fmoesim.validation.engine_log"
PHASES = {0: "prefill", 1: "decode"}


@dataclass
class PhaseResult:
    """One phase's comparison."""

    phase: str
    logged_accesses: int
    logged_hit_rate: float
    simulated_accesses: int
    simulated_hit_rate: float
    agreement: float | None  # share of matched accesses with the same outcome (decode)


def compare(
    log: str | Path,
    model_name: str = "qwen3-30b-a3b",
    top_k: int | None = 6,
    budget_bytes: int = 4000 * 2**20,
    policy: str = "lru",
) -> list[PhaseResult]:
    """Import ``log``, simulate it with ``policy`` at ``budget_bytes`` and compare
    (module docstring)."""
    import pandas as pd

    from fmoesim.config.build import load_preset
    from fmoesim.engine.simulate import model_for_trace, simulate
    from fmoesim.specs import HardwareSpec, ModelSpec
    from fmoesim.trace import read_trace
    from fmoesim.trace.table import import_table
    from policies.base import Outcome

    path = Path(log)
    model = load_preset("model", model_name, ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)  # no time is reported
    with tempfile.TemporaryDirectory() as tmp:
        tpath, _ = import_table(path, Path(tmp) / "t", model, top_k=top_k)
        trace = read_trace(tpath)
        run_model = model_for_trace(dataclasses.replace(model, top_k=trace.top_k), trace)
        pol = _policy(policy)
        res = simulate(trace, run_model, hw, pol, budget_bytes, timing=False, access_log=True)
    acc = res.accesses
    assert acc is not None
    sim = pd.DataFrame(
        {
            "step": np.asarray(acc["iteration"], dtype=np.int64),
            "layer": np.asarray(acc["layer"], dtype=np.int64),
            "expert": np.asarray(acc["expert"], dtype=np.int64),
            "sim_hit": np.asarray(acc["outcome"]) == int(Outcome.HIT),
        }
    )
    raw = pd.read_csv(path, comment="#")
    for col in ("phase", "step", "layer", "expert", "residency"):
        if col not in raw.columns:
            raise FmoesimError(f"{path}: has a '{col}' column (rule: a cache log to compare)")
    decode_steps = sorted(raw.loc[raw["phase"] == 1, "step"].unique())
    iteration = {s: i + 1 for i, s in enumerate(decode_steps)}  # the prompt is iteration 0
    logged = pd.DataFrame(
        {
            "step": raw["step"].map(iteration).fillna(0).astype(np.int64),
            "layer": raw["layer"].astype(np.int64),
            "expert": raw["expert"].astype(np.int64),
            "phase": raw["phase"].astype(np.int64),
            "log_hit": raw["residency"].astype(np.int64) == 1,
        }
    )
    out = []
    pre_log, pre_sim = logged[logged["phase"] == 0], sim[sim["step"] == 0]
    if len(pre_log):
        out.append(
            PhaseResult(
                "prefill", len(pre_log), float(pre_log["log_hit"].mean()),
                len(pre_sim), float(pre_sim["sim_hit"].mean()), None,
            )
        )  # fmt: skip
    dec = logged[logged["phase"] == 1]
    both = dec.merge(sim, on=["step", "layer", "expert"], how="left", validate="one_to_one")
    if both["sim_hit"].isna().any():
        row = int(np.flatnonzero(both["sim_hit"].isna().to_numpy())[0])
        raise FmoesimError(f"{path}: decode access {row} has no simulated access to match")
    hit = both["sim_hit"].astype(bool)
    out.append(
        PhaseResult(
            "decode", len(both), float(both["log_hit"].mean()),
            int((sim["step"] > 0).sum()), float(sim.loc[sim["step"] > 0, "sim_hit"].mean()),
            float((both["log_hit"] == hit).mean()),
        )
    )  # fmt: skip
    return out


def _policy(name: str) -> Any:
    """A fresh policy object from ``conf/policy/<name>.yaml``."""
    from hydra.utils import instantiate
    from omegaconf import DictConfig, OmegaConf

    from fmoesim.config.schema import CONF_DIR
    from fmoesim.errors import ConfigError

    path = CONF_DIR / "policy" / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError("--policy", name, "names a preset of conf/policy/")
    raw = OmegaConf.load(path)
    assert isinstance(raw, DictConfig)
    raw.pop("defaults", None)
    return instantiate(raw)


def format_report(results: list[PhaseResult]) -> str:
    """A Markdown table of the comparison."""
    lines = [
        "| phase | engine: accesses | engine: hit rate | simulator: accesses "
        "| simulator: hit rate | same outcome |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        same = "n.a." if r.agreement is None else f"{100 * r.agreement:.2f}%"
        lines.append(
            f"| {r.phase} | {r.logged_accesses:,} | {100 * r.logged_hit_rate:.2f}% "
            f"| {r.simulated_accesses:,} | {100 * r.simulated_hit_rate:.2f}% | {same} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: print the comparison table."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("log", help="route log with phase, step, layer, expert and residency")
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--top-k", type=int, default=6)
    ap.add_argument("--budget-mib", type=float, default=4000.0)
    ap.add_argument("--policy", default="lru")
    args = ap.parse_args(argv)

    def run() -> None:
        res = compare(args.log, args.model, args.top_k, int(args.budget_mib * 2**20), args.policy)
        print(format_report(res))

    run_or_exit(PROG, run)


if __name__ == "__main__":
    main()
