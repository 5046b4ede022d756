"""The crossover study: where each prefetching policy starts to beat on-demand LRU.

For each model preset, one layer's compute time is scaled by a compute factor ``s`` and
the PCIe bandwidth by a bandwidth factor ``b``; every policy and LRU run on the same trace
at each ``(s, b)`` and the table keeps ``TPOT(policy) / TPOT(LRU)``.  A ratio below 1
means the policy beats LRU there.

Compute is scaled without touching the engine: every operator of
:class:`fmoesim.engine.compute.ComputeModel` costs ``launches * kernel_overhead_s +
bytes / (hbm_gbps * 1e9 * memory_efficiency) + flops / (peak_tflops * 1e12 *
compute_efficiency)``, so multiplying ``kernel_overhead_s`` by ``s`` and dividing
``hbm_gbps`` and ``peak_tflops`` by ``s`` multiplies every coefficient by ``s``; a
preset's ``measured`` coefficients (the ``*-testbed`` presets) are multiplied by ``s``
too.  Bandwidth is ``hardware.pcie_gbps * b`` (the per-transfer overhead stays).

Setting: static batching, batch 1, timed; the expert budget is :data:`BUDGET_FRACTION`
of the model's routed experts (rounded up to whole experts).
"""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass, fields, replace
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.atomic import atomic_file
from fmoesim.errors import ArgumentParser, FmoesimError, counted
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec

NAME = "crossover"
#: the prefetching policies compared with LRU
POLICIES: tuple[str, ...] = ("fmoe", "moe-infinity", "promoe", "mixtral-offloading", "moepic")
BASELINE = "lru"
COMPUTE_FACTORS: tuple[float, ...] = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
BANDWIDTH_FACTORS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0)
#: the expert budget as a fraction of the model's routed experts
BUDGET_FRACTION = 0.25
#: requests per run by default (the bundled trace's first ones; synthetic traces this long)
REQUESTS = 2
#: a synthetic trace's longest output (decode tokens per request), which bounds a run's cost
OUTPUT_TOKENS_MAX = 32
#: a ratio below ``1 - RATIO_TOL`` counts as beating LRU (equal runs differ by rounding)
RATIO_TOL = 1e-6
HARDWARE = "rtx3090-pcie4"
#: the model presets of the default grid: the papers' models and one of each routing
#: shape up to 128 experts (the larger presets, DeepSeek-V3 and Qwen3-235B among them,
#: take ``--models``)
MODELS = (
    "deepseek-v2-lite", "mixtral-8x7b", "mixtral-8x7b-2bit", "olmoe-1b-7b", "phi-3.5-moe",
    "qwen1.5-moe-a2.7b", "qwen3-30b-a3b",
)  # fmt: skip
#: the model whose panel uses the bundled trace instead of a synthetic one
BUNDLED_MODEL = "mixtral-8x7b"
#: the table's columns, one row per (model, policy, compute factor, bandwidth factor)
COLUMNS: tuple[str, ...] = (
    "model", "policy", "compute_factor", "bandwidth_factor", "tpot_s", "lru_tpot_s", "ratio",
    "compute_to_transfer", "layer_compute_s", "expert_transfer_s", "trace", "trace_source",
    "requests", "trace_requests", "budget_experts", "hardware",
)  # fmt: skip


def _compute_fields() -> set[str]:
    from fmoesim.engine.compute import ComputeModel

    return {f.name for f in fields(ComputeModel)}


def scale_hardware(
    hw: HardwareSpec, compute_factor: float, bandwidth_factor: float
) -> HardwareSpec:
    """``hw`` with every modelled compute time multiplied by ``compute_factor`` (launch
    overhead times it, HBM bandwidth and peak FLOP/s over it, measured coefficients times
    it) and its PCIe bandwidth multiplied by ``bandwidth_factor``."""
    if not (compute_factor > 0 and math.isfinite(compute_factor)):
        raise FmoesimError(f"compute factor {compute_factor}: must be a positive number")
    if not (bandwidth_factor > 0 and math.isfinite(bandwidth_factor)):
        raise FmoesimError(f"bandwidth factor {bandwidth_factor}: must be a positive number")
    s = compute_factor
    keys = _compute_fields()
    measured = {
        model: {k: float(v) * s if k in keys else v for k, v in coeffs.items()}
        for model, coeffs in (hw.measured or {}).items()
    }
    return replace(
        hw,
        kernel_overhead_s=hw.kernel_overhead_s * s,
        peak_tflops=hw.peak_tflops / s,
        hbm_gbps=hw.hbm_gbps / s,
        pcie_gbps=hw.pcie_gbps * bandwidth_factor,
        measured=measured,
    )


def layer_compute_s(model: ModelSpec, hw: HardwareSpec, kv_tokens: int) -> float:
    """One MoE layer's modelled decode compute for one token (batch 1, ``kv_tokens`` of
    context): attention, router, ``top_k`` routed experts and the shared experts."""
    from fmoesim.engine.compute import ComputeModel

    cm = ComputeModel.from_specs(model, hw)
    return (
        cm.attention_s(1, kv_tokens, kv_tokens + 1)
        + cm.router_s(1)
        + model.top_k * cm.expert_s(1)
        + cm.shared_s(1)
    )


def budget_experts(model: ModelSpec, fraction: float = BUDGET_FRACTION) -> int:
    """Whole experts in the budget: ``ceil(fraction * layers * experts)``."""
    return max(1, math.ceil(fraction * model.num_layers * model.num_experts))


@dataclass(frozen=True)
class _Job:
    model: str
    policy: str
    trace: str
    requests: int
    hardware: str
    output_tokens_max: int
    cells: tuple[tuple[float, float], ...]  # (compute factor, bandwidth factor)


def _overrides(
    model: str, policy: str, requests: int, hardware: str, output_tokens_max: int
) -> list[str]:
    ov = [f"model={model}", f"policy={policy}", f"hardware={hardware}", "progress=false"]
    ov += ["serving.mode=static", "serving.batch_size=1", "engine.timing=true"]
    if model == BUNDLED_MODEL:
        return ov + ["workload=bundled", f"serving.max_requests={requests}"]
    return ov + [
        "workload=synthetic",
        f"workload.synthetic.num_requests={requests}",
        f"workload.synthetic.output_tokens_max={output_tokens_max}",
    ]


def _spec(model: str, policy: str, requests: int, hardware: str, output_tokens_max: int) -> Any:
    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run

    cfg = compose_config(_overrides(model, policy, requests, hardware, output_tokens_max))
    return cfg, build_run(cfg)


def _run_job(job: _Job) -> list[dict[str, Any]] | str:
    """TPOT of one policy on one model at each cell; a string: why it cannot run."""
    from hydra.utils import instantiate

    from fmoesim.engine.simulate import simulate
    from fmoesim.trace.reader import read_trace

    cfg, spec = _spec(job.model, job.policy, job.requests, job.hardware, job.output_tokens_max)
    trace = read_trace(job.trace)
    budget = budget_experts(spec.model) * spec.model.expert_size_bytes
    rows = []
    for s, b in job.cells:
        hw = scale_hardware(spec.hardware, s, b)
        try:
            res = simulate(
                trace, spec.model, hw, instantiate(cfg.policy), budget,
                serving=spec.serving, seed=spec.seed, timing=True,
            )  # fmt: skip
        except (ValueError, FmoesimError) as exc:
            return " ".join(str(exc).split())
        rows.append(
            {"model": job.model, "policy": job.policy, "compute_factor": s,
             "bandwidth_factor": b, "tpot_s": float(res.summary["tpot_mean_s"]),
             "requests": int(res.summary.get("num_requests", job.requests))}
        )  # fmt: skip
    return rows


def _shown(path: Path) -> str:
    """``path`` relative to the project root when inside it (as captions show traces)."""
    from fmoesim.config.schema import PROJECT_ROOT

    try:
        return str(Path(path).resolve().relative_to(PROJECT_ROOT.resolve()))
    except ValueError:
        return str(path)


def run_grid(
    models: Sequence[str],
    policies: Sequence[str] = POLICIES,
    compute: Sequence[float] = COMPUTE_FACTORS,
    bandwidth: Sequence[float] = BANDWIDTH_FACTORS,
    requests: int = REQUESTS,
    hardware: str = HARDWARE,
    output_tokens_max: int = OUTPUT_TOKENS_MAX,
    jobs: int = 1,
    log: Any = None,
) -> Any:
    """Run every policy and LRU on each model at each ``(compute, bandwidth)`` factor
    pair; return the tidy table (:data:`COLUMNS`, a pandas DataFrame).  Policies that
    cannot run on a model are left out, their reasons in ``table.attrs["skipped"]``
    (``{"model/policy": reason}``).  ``requests``: the bundled trace's first ones for
    :data:`BUNDLED_MODEL`, a synthetic trace of that many (at most ``output_tokens_max``
    decode tokens each) for the others.  ``jobs`` processes run the (model, policy) pairs."""
    import pandas as pd

    from fmoesim.cli.main import _trace_path
    from fmoesim.plots.style import trace_requests

    if requests < 1:
        raise FmoesimError(f"--requests {requests}: must be >= 1")
    if jobs < 1:
        raise FmoesimError(f"--jobs {jobs}: must be >= 1")
    if not models or not compute or not bandwidth:
        raise FmoesimError("the grid is empty: give at least one model and factor of each kind")
    for f in (*compute, *bandwidth):
        if not (f > 0 and math.isfinite(f)):
            raise FmoesimError(f"factor {f}: must be a positive number")
    pols = [p for p in dict.fromkeys(policies) if p != BASELINE]
    if not pols:
        raise FmoesimError(
            f"--policies {','.join(policies)}: no policy to set against {BASELINE} (rule: "
            f"at least one prefetching policy; {BASELINE} runs at every point anyway)"
        )
    compute, bandwidth = list(dict.fromkeys(compute)), list(dict.fromkeys(bandwidth))
    cells = tuple((float(s), float(b)) for s in compute for b in bandwidth)
    meta: dict[str, dict[str, Any]] = {}
    todo: list[_Job] = []
    for m in dict.fromkeys(models):
        for p in (BASELINE, *pols):  # composes each preset: unknown names fail here, early
            _spec(m, p, requests, hardware, output_tokens_max)
        _, spec = _spec(m, BASELINE, requests, hardware, output_tokens_max)
        path = _trace_path(spec)  # generated here, once, not by racing workers
        from fmoesim.trace.reader import read_trace

        tr = read_trace(path)
        kv = int(round(float(tr.prompt_tokens.mean()))) if tr.num_requests else 0
        meta[m] = {
            "model": spec.model, "hw": spec.hardware, "kv": kv, "trace": _shown(path),
            "trace_source": tr.manifest.source.get("kind", ""),
            "trace_requests": trace_requests(path) or tr.num_requests,
            "budget_experts": budget_experts(spec.model),
        }  # fmt: skip
        todo += [
            _Job(m, p, str(path), requests, hardware, output_tokens_max, cells)
            for p in (BASELINE, *pols)
        ]
    t0 = time.perf_counter()
    outs: list[list[dict[str, Any]] | str] = []
    with ProcessPoolExecutor(jobs) if jobs > 1 else nullcontext() as ex:
        done = ex.map(_run_job, todo) if ex is not None else map(_run_job, todo)
        for k, (job, out) in enumerate(zip(todo, done, strict=True), 1):
            outs.append(out)
            if log is not None:  # progress: one line per (model, policy), in order
                log(f"[{k}/{len(todo)}] {job.model} {job.policy}: "
                    f"{time.perf_counter() - t0:.0f} s")  # fmt: skip
    if log is not None:
        grid = f"{len(todo)} model-policy pairs x {counted(len(cells), 'grid point')}"
        log(
            f"{counted(len(todo) * len(cells), 'run')} ({grid}) in {time.perf_counter() - t0:.0f} s"
        )
    skipped: dict[str, str] = {}
    rows: list[dict[str, Any]] = []
    base: dict[tuple[str, float, float], float] = {}
    for job, out in zip(todo, outs, strict=True):
        if isinstance(out, str):
            if job.policy == BASELINE:
                raise FmoesimError(f"{job.model}: LRU cannot run: {out}")
            skipped[f"{job.model}/{job.policy}"] = out
            continue
        for r in out:
            if job.policy == BASELINE:
                base[(job.model, r["compute_factor"], r["bandwidth_factor"])] = r["tpot_s"]
            else:
                rows.append(r)
    for r in rows:
        mm = meta[r["model"]]
        s, b = r["compute_factor"], r["bandwidth_factor"]
        hw = scale_hardware(mm["hw"], s, b)
        comp = layer_compute_s(mm["model"], hw, mm["kv"])
        load = hw.transfer_time_s(mm["model"].expert_size_bytes)
        lru = base[(r["model"], s, b)]
        r.update(
            lru_tpot_s=lru, ratio=r["tpot_s"] / lru, compute_to_transfer=comp / load,
            layer_compute_s=comp, expert_transfer_s=load, trace=mm["trace"],
            trace_source=mm["trace_source"], trace_requests=mm["trace_requests"],
            budget_experts=mm["budget_experts"], hardware=hardware,
        )  # fmt: skip
    table = pd.DataFrame(rows, columns=list(COLUMNS))
    table.attrs["skipped"] = skipped
    table.attrs["output_tokens_max"] = output_tokens_max
    return table


def beats(table: Any) -> Any:
    """Boolean Series, parallel to ``table``: the policy's TPOT is below LRU's (ratio
    below ``1 - RATIO_TOL``)."""
    return table["ratio"] < 1.0 - RATIO_TOL


def crossover_compute(table: Any) -> dict[tuple[str, str, float], float | None]:
    """For each (model, policy, bandwidth factor): the compute factor of the first win of
    the trailing run of cells where the policy does not lose to LRU (ratio at most
    ``1 + RATIO_TOL``: ties, as where every policy is compute-bound, do not end it); None
    where that run holds no win."""
    out: dict[tuple[str, str, float], float | None] = {}
    t = table.assign(_beats=beats(table), _loses=table["ratio"] > 1.0 + RATIO_TOL)
    for (m, p, b), g in t.groupby(["model", "policy", "bandwidth_factor"], sort=True):
        g = g.sort_values("compute_factor")
        start: float | None = None
        rows = zip(g["compute_factor"], g["_beats"], g["_loses"], strict=True)
        for c, win, lose in reversed(list(rows)):
            if lose:
                break
            if win:
                start = float(c)
        out[(str(m), str(p), float(b))] = start
    return out


def factor_label(x: float) -> str:
    """``1/4``, ``1``, ``8``: a factor as a short fraction."""
    f = Fraction(x).limit_denominator(64)
    return str(f.numerator) if f.denominator == 1 else f"{f.numerator}/{f.denominator}"


def draw(table: Any) -> Any:
    """One panel per model: a cell per (compute factor, bandwidth factor), holding the
    marker of each policy that beats LRU there (TPOT ratio < 1), hollow where it does
    not; the x ticks also give the layer-compute / expert-transfer ratio at bandwidth x1
    (or the grid's nearest bandwidth).  Returns the figure."""
    from fmoesim.plots.style import legend_outside, policy_color, policy_marks, setup

    plt = setup()
    models = list(dict.fromkeys(table["model"]))
    policies = list(dict.fromkeys(table["policy"]))
    if not models:
        raise FmoesimError("crossover: the table is empty (every policy was skipped)")
    ncol = min(len(models), 3)
    nrow = math.ceil(len(models) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.6 * ncol + 2.2, 3.6 * nrow), squeeze=False)
    n = len(policies)
    offsets = np.linspace(-0.3, 0.3, n) if n > 1 else np.zeros(1)  # (n,) within a cell
    for ax, m in zip(axes.flat, models, strict=False):
        g = table[table["model"] == m]
        cs = sorted(set(g["compute_factor"]))
        bs = sorted(set(g["bandwidth_factor"]))
        ref_b = min(bs, key=lambda b: abs(math.log(b)))
        for k, p in enumerate(policies):
            gp = g[g["policy"] == p]
            marker, _ = policy_marks(p)
            col = policy_color(p)
            x = np.array([cs.index(c) for c in gp["compute_factor"]]) + offsets[k]  # (cells,)
            y = np.array([bs.index(b) for b in gp["bandwidth_factor"]])  # (cells,)
            win = beats(gp).to_numpy()  # (cells,)
            ax.scatter(x[win], y[win], marker=marker, color=col, s=46, zorder=3,
                       edgecolors="white", linewidths=0.5, label=p)  # fmt: skip
            ax.scatter(x[~win], y[~win], marker=marker, facecolors="none", edgecolors=col,
                       s=22, linewidths=0.6, alpha=0.5, zorder=2)  # fmt: skip
        r1 = g[g["bandwidth_factor"] == ref_b].groupby("compute_factor")["compute_to_transfer"]
        r1 = r1.first()
        ax.set_xticks(range(len(cs)))
        ax.set_xticklabels([f"x{factor_label(c)}\n{r1.get(c, float('nan')):.2g}" for c in cs],
                           fontsize=7)  # fmt: skip
        ax.set_yticks(range(len(bs)))
        ax.set_yticklabels([f"x{factor_label(b)}" for b in bs])
        ax.set_xlim(-0.5, len(cs) - 0.5)
        ax.set_ylim(-0.5, len(bs) - 0.5)
        ax.grid(False)
        for i in range(len(cs) - 1):
            ax.axvline(i + 0.5, color="0.85", linewidth=0.6, zorder=1)
        for j in range(len(bs) - 1):
            ax.axhline(j + 0.5, color="0.85", linewidth=0.6, zorder=1)
        ax.set_title(m)
        ax.set_xlabel(
            f"compute factor\n(layer compute / expert transfer at PCIe x{factor_label(ref_b)})"
        )
        ax.set_ylabel("PCIe bandwidth factor")
    for ax in list(axes.flat)[len(models) :]:
        ax.set_visible(False)
    handles = [
        plt.Line2D([], [], marker=policy_marks(p)[0], color=policy_color(p), linestyle="",
                   markersize=7, label=p)
        for p in policies
    ]  # fmt: skip
    hollow = {"marker": "o", "color": "0.5", "markerfacecolor": "none", "linestyle": ""}
    handles.append(plt.Line2D([], [], markersize=5, label="hollow: not below LRU", **hollow))
    legend_outside(axes.flat[ncol - 1], handles=handles, title="TPOT below LRU's")
    fig.tight_layout()
    return fig


def _caption(table: Any) -> str:
    from fmoesim.plots.style import trace_caption

    per = table.drop_duplicates(["model"])
    return trace_caption(
        list(per["trace"]), list(per["trace_source"]), list(per["requests"]),
        list(per["trace_requests"]),
    )  # fmt: skip


def _markdown(table: Any) -> str:
    """The ratios as one markdown table per (model, policy): bandwidth rows, compute columns."""
    lines: list[str] = []
    start = crossover_compute(table)
    for (m, p), g in table.groupby(["model", "policy"], sort=False):
        cs = sorted(set(g["compute_factor"]))
        lines += [f"### {m}: {p} TPOT / LRU TPOT", ""]
        lines.append(
            "| PCIe \\ compute | "
            + " | ".join(f"x{factor_label(c)}" for c in cs)
            + " | beats LRU from |"
        )
        lines.append("|---" * (len(cs) + 2) + "|")
        for b, gb in g.groupby("bandwidth_factor", sort=True):
            by_c = dict(zip(gb["compute_factor"], gb["ratio"], strict=True))
            st = start[(str(m), str(p), float(b))]
            cells = " | ".join(f"{by_c[c]:.3f}" if c in by_c else "" for c in cs)
            lines.append(
                f"| x{factor_label(b)} | {cells} | {'x' + factor_label(st) if st else 'never'} |"
            )
        lines.append("")
    return "\n".join(lines)


def _physical(table: Any) -> str:
    rows = ["| model | compute x | PCIe x | layer compute (ms) | expert transfer (ms) | ratio |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    per = table.drop_duplicates(["model", "compute_factor", "bandwidth_factor"])
    for r in per.sort_values(["model", "bandwidth_factor", "compute_factor"]).itertuples():
        rows.append(
            f"| {r.model} | x{factor_label(r.compute_factor)} | x{factor_label(r.bandwidth_factor)}"
            f" | {r.layer_compute_s * 1e3:.3f} | {r.expert_transfer_s * 1e3:.3f}"
            f" | {r.compute_to_transfer:.3g} |"
        )
    return "\n".join(rows)


def render(table: Any, out_dir: Path, name: str = NAME, command: str | None = None) -> list[Path]:
    """Write ``<name>.png``, ``.pdf``, ``.md`` (caption, boundaries, ratio tables) and
    ``.csv`` (the tidy table) under ``out_dir``, each atomically; return their paths.
    ``command`` is the command line that made ``table`` (the default grid's without)."""
    from fmoesim.plots.style import save_figure

    paths = save_figure(draw(table), out_dir, name, bbox_inches="tight")
    hw = ", ".join(dict.fromkeys(table["hardware"]))
    budgets = ", ".join(
        f"{m} {b}"
        for m, b in dict(zip(table["model"], table["budget_experts"], strict=True)).items()
    )
    skipped = table.attrs.get("skipped", {})
    cs = ", ".join(factor_label(c) for c in sorted(set(table["compute_factor"])))
    bs = ", ".join(factor_label(b) for b in sorted(set(table["bandwidth_factor"])))
    md = [
        "# Crossover: where prefetching beats on-demand LRU (TPOT)",
        "",
        f"- setting: hardware {hw} with compute times x{{{cs}}} and PCIe bandwidth x{{{bs}}};"
        f" static batching, batch 1, timed; expert budget {BUDGET_FRACTION:g} of each model's"
        f" routed experts (experts: {budgets}); synthetic traces at most"
        f" {table.attrs.get('output_tokens_max', '?')} decode tokens per request",
        f"- {_caption(table)}",
        "- axes in physical terms: the ratio of one MoE layer's modelled decode compute "
        "(attention at the trace's mean prompt, router, top-k experts, shared experts; one "
        "token) to one expert's PCIe transfer (overhead + bytes / bandwidth); the x tick's "
        "second line is that ratio at PCIe x1; each cell's value is in the last table",
        "- a marker filled: the policy's mean TPOT is below LRU's there; hollow: not",
        *(f"- skipped: {k}: {v}" for k, v in skipped.items()),
        f"- regenerate: `{command or f'fmoesim-plot {NAME}'}`",
        "",
        "## TPOT ratios (policy / LRU)",
        "",
        _markdown(table),
        "## Compute / transfer per cell",
        "",
        _physical(table),
        "",
    ]
    path = out_dir / f"{name}.md"
    with atomic_file(path) as tmp:
        tmp.write_text("\n".join(md))
    paths.append(path)
    path = out_dir / f"{name}.csv"
    with atomic_file(path) as tmp:
        table.to_csv(tmp, index=False)
    paths.append(path)
    return paths


def _factors(text: str) -> list[float]:
    """``1/4,1,8`` as floats (argparse type)."""
    try:
        out = [float(Fraction(x.strip())) for x in text.split(",") if x.strip()]
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"{text!r}: factors like 1/4,1,2") from None
    if not out or any(f <= 0 for f in out):
        raise argparse.ArgumentTypeError(f"{text!r}: positive factors like 1/4,1,2")
    return out


def _names(text: str) -> list[str]:
    """``a,b`` as a list of names (argparse type)."""
    return [x.strip() for x in text.split(",") if x.strip()]


def main(argv: list[str], prog: str = "fmoesim-plot") -> None:
    """``fmoesim-plot crossover [options]``: run the grid, write the four files; a bad
    option or value is one line on stderr and exit status 2."""
    from fmoesim.errors import run_or_exit

    args = _parser(prog).parse_args(argv)
    run_or_exit(prog, _cli, args)


def _parser(prog: str = "fmoesim-plot") -> ArgumentParser:
    """The options of ``fmoesim-plot crossover``."""
    ap = ArgumentParser(
        prog=f"{prog} {NAME}",
        description="where each prefetching policy starts to beat on-demand LRU on TPOT",
    )
    ap.add_argument("--models", type=_names, default=list(MODELS), help="%(default)s")
    ap.add_argument("--policies", type=_names, default=list(POLICIES), help="%(default)s")
    ap.add_argument("--compute", type=_factors, default=list(COMPUTE_FACTORS),
                    help="compute-time factors (1/4,1/2,1,2,4,8,16,32)")  # fmt: skip
    ap.add_argument("--bandwidth", type=_factors, default=list(BANDWIDTH_FACTORS),
                    help="PCIe bandwidth factors (1/2,1,2,4,8)")  # fmt: skip
    ap.add_argument("--requests", type=int, default=REQUESTS, help="per run (%(default)s)")
    ap.add_argument("--hardware", default=HARDWARE, help="hardware preset (%(default)s)")
    ap.add_argument("--jobs", type=int, default=2, help="local processes (%(default)s)")
    ap.add_argument("--out", default="results/figures", help="figure directory (%(default)s)")
    ap.add_argument("--name", default=NAME, help="file name stem (%(default)s)")
    return ap


def command_line(args: argparse.Namespace) -> str:
    """The ``fmoesim-plot crossover`` command that runs the grid of ``args`` again: the
    options that differ from their defaults (``--jobs`` left out: it changes no number),
    each value as the option reads it back."""
    import shlex

    def factor(x: float) -> str:  # a short fraction where it is exact, else the number
        label = factor_label(x)
        return label if float(Fraction(label)) == x else repr(x)

    form = {"--compute": factor, "--bandwidth": factor}
    defaults = vars(_parser().parse_args([]))
    parts = [f"fmoesim-plot {NAME}"]
    for name, value in vars(args).items():
        if name == "jobs" or value == defaults.get(name):
            continue
        flag = f"--{name}"
        text = (
            ",".join(form.get(flag, str)(v) for v in value)
            if isinstance(value, list)
            else str(value)
        )
        parts.append(f"{flag} {shlex.quote(text)}")
    return " ".join(parts)


def _cli(args: argparse.Namespace) -> None:
    from fmoesim.atomic import is_plain_name, unwritable

    if not is_plain_name(args.name):  # the stem of four files in --out
        raise FmoesimError(
            f"--name {args.name}: not a file name (rule: no '/', '\\' or '..', not empty, "
            "not starting with '.')"
        )
    if (why := unwritable(args.out)) is not None:  # before minutes of runs
        raise FmoesimError(f"--out {args.out}: {why} (rule: a folder to write the figure into)")
    table = run_grid(
        args.models, args.policies, args.compute, args.bandwidth,
        args.requests, args.hardware, jobs=args.jobs, log=lambda m: print(m, flush=True),
    )  # fmt: skip
    for k, why in table.attrs.get("skipped", {}).items():
        print(f"skipped {k}: {why}")
    paths = render(table, Path(args.out), args.name, command_line(args))
    print(f"{args.name:<22} {paths[0]}  (+ .pdf, .md, .csv)")
