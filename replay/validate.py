"""``fmoesim-validate``: how far is the simulator from the real hardware?

For one trace and a set of policies, runs the simulator (with the hardware profile the
overrides name, normally one ``fmoesim-profile`` measured: ``hardware=measured/<name>``)
and the replay (:class:`replay.backend.GpuBackend`: the same trace, the same policy,
real copies and FFNs), and writes a report directory::

    report.md        TTFT, TPOT, stall and hit rate side by side, relative errors
                     (:func:`fmoesim.validation.numbers.error`), the targets (mean
                     |TPOT| error <= 5%, |TTFT| <= 10%, hit rate within 1 point) and
                     whether they are met
    validation.csv   the same numbers, one row per policy
    validation.png   and .pdf: the four metrics as grouped bars, simulator vs replay

Examples::

    fmoesim-validate --device cuda hardware=measured/h100 model=qwen1.5-moe-a2.7b \\
        workload=synthetic cache.budget_gb=12
    fmoesim-validate --device cpu --policies lru,lfu model=... workload=...   # CI smoke

On ``--device cpu`` the replay's times describe this CPU's copies and FFNs, not a GPU
server, and the report says so; only its hit rates mean anything there.  The directory
is written atomically (a temporary directory renamed into place).  Exit status 2 and one
line on stderr for bad input.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
from pathlib import Path
from typing import Any

from fmoesim.errors import ArgumentParser, ConfigError, FmoesimError, names_of, run_or_exit
from fmoesim.validation import numbers

PROG = "fmoesim-validate"
DEFAULT_POLICIES = "lru,lfu,moe-infinity,fmoe,moepic"
#: (summary key, label, kind of quantity) of the compared metrics; the kinds are
#: :data:`fmoesim.validation.numbers.KINDS`, which the report writes them by
METRICS = (
    ("ttft_mean_s", "TTFT", "s"),
    ("tpot_mean_s", "TPOT", "s"),
    ("stall_s", "stall", "s"),
    ("hit_rate", "hit rate", "share"),
)
#: the figure's axis of each kind: (scale, unit)
PLOT_UNITS = {"s": (1e3, "ms"), "share": (100.0, "%")}
#: the targets: mean |relative error| of TPOT and of TTFT (Vidur reports < 9%), the
#: largest hit-rate gap in points; ``fmoesim-validate-grid`` scores against the same
TARGET_TPOT_ERR = 0.05
TARGET_TTFT_ERR = 0.10
TARGET_HIT_POINTS = 1.0


def rel_err(sim: float, real: float) -> float:
    """``(sim - real) / real`` (NaN when ``real`` is 0)."""
    return (sim - real) / real if real else float("nan")


def compare(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Mean absolute TTFT and TPOT relative errors and the largest hit-rate gap in
    points, over ``rows`` (each with ``sim_<key>`` and ``replay_<key>``)."""
    import numpy as np

    def mean_abs(key: str) -> float:
        errs = [abs(rel_err(r[f"sim_{key}"], r[f"replay_{key}"])) for r in rows]
        return float(np.nanmean(errs)) if errs else float("nan")

    gaps = [100 * abs(r["sim_hit_rate"] - r["replay_hit_rate"]) for r in rows]
    return {
        "ttft_err": mean_abs("ttft_mean_s"),
        "tpot_err": mean_abs("tpot_mean_s"),
        "hit_gap_points": max(gaps) if gaps else float("nan"),
    }


def report_markdown(rows: list[dict[str, Any]], meta: dict[str, str]) -> str:
    """The Markdown report."""
    agg = compare(rows)
    lines = [f"# Simulator vs replay: {meta['device_name']}, {meta['date']}", ""]
    lines += [f"- {k}: {v}" for k, v in meta.items() if k not in ("device_name", "date")]
    if meta["device"] == "cpu":
        lines += [
            "",
            "**CPU path: the replay's times describe this CPU's copies and FFNs, not a GPU "
            "server; the timing columns and errors below are meaningless.  Only the hit "
            "rates of policies that load on demand alone (LRU, LFU, LCP, FIFO, RND, "
            "Belady, DeepSpeed) mean something here: a prefetching policy's hits depend on "
            "when its transfers land, which this CPU's times decide.**",
        ]
    lines += ["", "| policy | " + " | ".join(
        f"{lab} sim | {lab} replay | err" for _, lab, _ in METRICS
    ) + " |"]  # fmt: skip
    lines.append("|---|" + "---|---|---|" * len(METRICS))
    for r in rows:
        cells = [r["policy"]]
        for key, _, kind in METRICS:
            cells += numbers.pair(r, key, kind)
        lines.append("| " + " | ".join(cells) + " |")
    ok_t = agg["tpot_err"] <= TARGET_TPOT_ERR and agg["ttft_err"] <= TARGET_TTFT_ERR
    ok_h = agg["hit_gap_points"] <= TARGET_HIT_POINTS
    lines += [
        "",
        f"- mean |TPOT error| {100 * agg['tpot_err']:.1f}% (target <= "
        f"{100 * TARGET_TPOT_ERR:.0f}%), mean |TTFT error| {100 * agg['ttft_err']:.1f}% "
        f"(target <= {100 * TARGET_TTFT_ERR:.0f}%): "
        + ("met" if ok_t else "NOT met")
        + (" (meaningless on the CPU)" if meta["device"] == "cpu" else ""),
        f"- largest hit-rate gap {numbers.points(agg['hit_gap_points'] / 100, signed=False)} "
        f"(target <= {TARGET_HIT_POINTS:g} pt): "
        + ("met" if ok_h else "NOT met")
        + (" (of a prefetching policy: meaningless on the CPU)" if meta["device"] == "cpu" else ""),
        *(
            line + (" (meaningless on the CPU)" if meta["device"] == "cpu" else "")
            for line in _order_lines(rows)
        ),
        "",
        "err: relative error = (simulator - replay) / replay; the difference "
        "(simulator - replay) instead where the replay's value is 0, or a stall of at "
        f"most {numbers.NEGLIGIBLE_STALL_SHARE:.1%} of the replay's wall time (a ratio to "
        "it says nothing), and for the hit rate, in percentage points (pt).  Each time "
        "in s, ms, us or ns by its size, to 3 significant figures.  TTFT: time to the "
        "first token; TPOT: time per output token after it; stall: the summed per-layer "
        "wait for experts (simulated, against measured: with CUDA events on a GPU); hit: "
        "the share of expert accesses found resident (docs/concepts.md has each).",
        "",
    ]
    return "\n".join(lines)


def _order_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The report's lines on which policy is faster (:func:`replay.campaign.policy_order`):
    per latency, the pairs of policies the simulator orders as the replay does and each
    side's fastest (none for a single policy)."""
    from replay.campaign import policy_order

    one = {"model": "", "budget_gb": 0.0, "mode": "", "compute_repeat": 1}
    return [
        f"- which policy is faster, by {o['metric']}: the simulator orders {o['alike']} of "
        f"the {o['pairs']} pairs of policies as the replay does (Kendall's tau "
        f"{o['kendall_tau']:+.2f}); the fastest is {o['fastest_replay']} in the replay and "
        f"{o['fastest_sim']} simulated"
        for o in policy_order([{**one, **r} for r in rows])
    ]


def plot(rows: list[dict[str, Any]], title: str, stem: Path) -> None:
    """Grouped bars, simulator vs replay, one panel per metric; PNG and PDF."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(METRICS), figsize=(4 * len(METRICS), 3.6))
    x = np.arange(len(rows))
    for ax, (key, lab, kind) in zip(axes, METRICS, strict=True):
        scale, unit = PLOT_UNITS[kind]
        sim = [scale * r[f"sim_{key}"] for r in rows]
        rep = [scale * r[f"replay_{key}"] for r in rows]
        ax.bar(x - 0.2, sim, 0.4, label="simulator", color="#4c72b0")
        ax.bar(x + 0.2, rep, 0.4, label="replay", color="#dd8452")
        ax.set_xticks(x, [r["policy"] for r in rows], rotation=30, ha="right")
        ax.set_ylabel(f"{lab} ({unit})")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    for ext in ("png", "pdf"):
        fig.savefig(stem.with_suffix(f".{ext}"), dpi=130)
    plt.close(fig)


def validate(
    policies: list[str],
    overrides: list[str],
    device: str,
    out: Path,
    checkpoint: str | None = None,
    depth: int = 2,
) -> Path:
    """Run every policy in the simulator and the replay; write the report to ``out``."""
    import pandas as pd
    from hydra.utils import instantiate

    from fmoesim.atomic import atomic_dir, unwritable
    from fmoesim.cli.main import _trace_path, compose_config
    from fmoesim.config.build import build_run, simulate_spec
    from fmoesim.engine.simulate import check_link_order, check_reserve
    from fmoesim.trace.reader import read_trace
    from replay.backend import replay_backend

    if out.exists() and any(out.iterdir()):
        raise FmoesimError(f"--out {out}: exists and is not empty (pick another directory)")
    why = unwritable(out)
    if why is not None:
        raise FmoesimError(f"--out {out}: {why}")
    common: dict[str, Any] = dict(
        timing=True, access_log=False, progress=False, experts_per_layer=None
    )
    # every policy's config and simulation first (seconds): a bad preset or a knob the
    # model cannot take is refused before the replays (minutes of the device) begin
    runs = []
    traces: dict[Path, Any] = {}  # one read of each trace (the policies share it)
    for name in policies:
        cfg = compose_config([*overrides, f"policy={name}"])
        spec = build_run(cfg)
        if not spec.engine.timing:  # both sides are timed: the comparison is of times
            raise ConfigError("engine.timing", False, f"{PROG} compares timed runs: drop it")
        check_link_order(spec.engine.link_order, timing=True, replay=True)
        check_reserve(spec.engine.reserve, timing=True, replay=True)
        path = _trace_path(spec)
        trace = traces[path] = traces.get(path) or read_trace(path)
        runs.append((name, cfg, spec, trace, simulate_spec(spec, trace, **common).summary))
    rows: list[dict[str, Any]] = []
    for name, cfg, spec, trace, sim in runs:
        rep = simulate_spec(
            spec,
            trace,
            policy=instantiate(cfg.policy),  # a fresh object: the simulator's has state
            make_backend=replay_backend(
                spec.model,
                spec.hardware,
                device,
                seed=spec.seed,
                checkpoint=checkpoint,
                depth=depth,
            ),  # fmt: skip
            **common,
        ).summary
        row: dict[str, Any] = {"policy": name}
        for key, *_ in METRICS:
            row[f"sim_{key}"], row[f"replay_{key}"] = float(sim[key]), float(rep[key])
        row["replay_wall_s"] = float(rep["wall_s"])
        rows.append(row)
        print(
            f"{name:>14}: TPOT sim {1e3 * row['sim_tpot_mean_s']:.2f} ms, replay "
            f"{1e3 * row['replay_tpot_mean_s']:.2f} ms; hit rate sim "
            f"{100 * row['sim_hit_rate']:.2f}%, replay {100 * row['replay_hit_rate']:.2f}%"
        )
    spec = runs[0][2]
    import torch

    dev_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    meta = {
        "device_name": dev_name,
        "date": dt.date.today().isoformat(),
        "device": "cpu" if device == "cpu" else device,
        "torch": torch.__version__ + (f", CUDA {torch.version.cuda}" if device != "cpu" else ""),
        "model": spec.model.name,
        "hardware profile": f"{spec.hardware.name} ({spec.hardware.source or 'no source'})",
        "measured coefficients": "yes"
        if spec.model.name in (spec.hardware.measured or {})
        else "no: the simulator uses its roofline estimates",
        "trace": str(_trace_path(spec)),
        "budget": f"{spec.budget_bytes / 1e9:g} GB",
        "overrides": " ".join(overrides) or "(none)",
    }
    with atomic_dir(out) as tmp:
        (tmp / "report.md").write_text(report_markdown(rows, meta))
        pd.DataFrame(rows).to_csv(tmp / "validation.csv", index=False)
        plot(rows, f"simulator vs replay on {dev_name}, {spec.model.name}", tmp / "validation")
    return out


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--policies", default=DEFAULT_POLICIES, help="comma-separated presets")
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default: cuda)")
    ap.add_argument("--out", default=None, help="report directory (default: "
                    "results/validation/<gpu>-<date> on a GPU, to commit; "
                    "out/validation-cpu-<date> on the CPU)")  # fmt: skip
    ap.add_argument("--checkpoint", default=None, help="local safetensors checkpoint")
    ap.add_argument("--depth", type=int, default=2, help="chunks kept on the copy stream")
    ap.add_argument("overrides", nargs="*", help="fmoesim config overrides")
    # options may stand between the overrides (model=x --policies lru ...)
    args = ap.parse_intermixed_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    if args.depth < 1:
        raise FmoesimError(f"--depth {args.depth}: must be >= 1")
    policies = names_of("--policies", args.policies, empty_ok=True)
    if not policies:
        raise FmoesimError("--policies: give at least one policy preset")
    from replay.backend import check_device

    torch = check_device(args.device, PROG)  # before the trace is made (seconds)
    out = args.out
    if out is None:  # a CPU run is a smoke test: not beside the GPUs' reports
        out = f"out/validation-cpu-{dt.date.today().isoformat()}"
        if args.device.startswith("cuda"):
            slug = torch.cuda.get_device_name(args.device).lower().replace(" ", "-")
            out = f"results/validation/{slug}-{dt.date.today().isoformat()}"
    path = validate(policies, args.overrides, args.device, Path(out), args.checkpoint, args.depth)
    print(f"report     {path / 'report.md'}")


if __name__ == "__main__":
    main()
