"""The papers' figures and tables, rebuilt from the results store.

Each entry of :data:`FIGURES` names the ``conf/experiment/`` sweep whose rows it reads
(``experiment`` column of the store) and a function that draws it.  :func:`render`
writes ``<out>/<name>.png``, ``.pdf`` and a caption file ``<name>.md`` (what the paper
shows, what was run, the trace, how many of its requests were served and whether its
routing is real or synthetic, which plotted series coincide, and the plotted numbers as
a table), each atomically.  Policies keep one colour, marker and dash pattern everywhere
(:mod:`fmoesim.plots.style`); legends sit outside the data area.  A figure that plots
latencies reads timed runs only (``engine.timing=true``): a hit-rate-only run has no
latencies.
"""

from __future__ import annotations

import inspect
import json
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.atomic import atomic_file
from fmoesim.errors import AmbiguousRunsError, FmoesimError
from fmoesim.plots.style import (
    held_in_count,
    legend_outside,
    policy_color,
    save_figure,
    series_style,
    setup,
    trace_caption,
    trace_requests,
)


def cfg_value(row: Any, dotted: str) -> Any:
    """A value of a stored row's resolved config (``config_json``), by dotted key."""
    node: Any = json.loads(row["config_json"])
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            raise FmoesimError(f"run {row.get('config_hash', '?')}: its config has no {dotted}")
        node = node[part]
    return node


def sweep_value(row: Any, key: str) -> Any:
    """A stored row's value of a swept ``key`` (:func:`cfg_value`): a config group
    (``model``, ``hardware``...) by its preset's ``name``, as a sweep names it."""
    value = cfg_value(row, key)
    if isinstance(value, dict) and "name" in value:
        return value["name"]
    return value


def _cfg_get(row: Any, dotted: str, default: Any) -> Any:
    """:func:`cfg_value`, or ``default`` when the row's config lacks the key."""
    try:
        return cfg_value(row, dotted)
    except FmoesimError:
        return default


def is_timed(row: Any) -> bool:
    """Whether a stored run simulated time (``engine.timing``), so that its latency
    columns hold latencies: the row's ``timing`` column when it has a value, else its
    config's ``engine.timing`` (true when the config does not say, its default)."""
    value = row.get("timing")
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    return bool(_cfg_get(row, "engine.timing", True))


def _with(df: Any, dotted: str, column: str) -> Any:
    df = df.copy()
    df[column] = [cfg_value(r, dotted) for _, r in df.iterrows()]
    return df


def _policies(df: Any) -> list[str]:
    """Policies in the order of the frame (:func:`render` sorts it in the experiment's
    sweep order)."""
    return list(dict.fromkeys(df["policy"]))


def sweep_params(experiment: str) -> dict[str, list[str]]:
    """The swept keys of an experiment preset (``+`` prefixes dropped) and their values,
    in the order its ``hydra.sweeper.params`` lists them."""
    import yaml

    from fmoesim.config.schema import CONF_DIR

    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    if not path.is_file():
        return {}
    params = ((yaml.safe_load(path.read_text()).get("hydra") or {}).get("sweeper") or {}).get(
        "params"
    ) or {}
    return {k.lstrip("+"): [v.strip() for v in str(vals).split(",")] for k, vals in params.items()}


def _points(df: Any, experiment: str) -> Any:
    """The rows of ``experiment`` from the running code's version, one per sweep point;
    more than one row for a point (a rerun with extra overrides into the same store)
    is refused rather than plotted at random."""
    from fmoesim.results.store import code_version

    if "code_version" in df.columns:
        df = df[df["code_version"] == code_version()]
        if len(df) == 0:
            raise FmoesimError(
                f"experiment {experiment}: the store's runs are from other code versions "
                f"(rerun: fmoesim -m experiment={experiment})"
            )
    keys = [k for k in sweep_params(experiment) if k != "policy"]
    point = [
        tuple([r["policy"], *(str(sweep_value(r, k)) for k in keys)]) for _, r in df.iterrows()
    ]
    seen: dict[tuple[str, ...], int] = {}
    for p in point:
        seen[p] = seen.get(p, 0) + 1
    doubled = [p for p, n in seen.items() if n > 1]
    if doubled:
        p = doubled[0]
        shown = f"policy={p[0]}" + "".join(f" {k}={v}" for k, v in zip(keys, p[1:], strict=True))
        more = f" and {len(doubled) - 1} more points" if len(doubled) > 1 else ""
        raise AmbiguousRunsError(
            f"experiment {experiment}: {seen[p]} runs for the point {shown}{more} (rule: one "
            f"run per point of the preset; a sweep of experiment={experiment} with other "
            "overrides wrote into this store: give such runs a store.dir of their own)"
        )
    return df


def without_run_hint(text: str) -> str:
    """An error of :func:`experiment_rows` without its closing hint to run the preset
    (``(run: fmoesim -m experiment=...)``), for a command that says how to run what is
    missing into the store it reads."""
    import re

    return re.sub(r"[\s;(]*\b(?:re)?run: fmoesim -m [^)]*\)?$", "", text)


def point_value(value: Any) -> str:
    """A swept value as text, numbers as numbers (``12`` and ``12.0`` are one point)."""
    try:
        return repr(float(value))
    except (TypeError, ValueError):
        return str(value)


def missing_runs(df: Any, experiment: str) -> list[str]:
    """The points of ``experiment``'s sweep (every combination of its
    ``hydra.sweeper.params``) that no row of ``df`` (its rows, as
    :func:`experiment_rows` returns them) holds, each as ``key=value ...``."""
    import itertools

    params = sweep_params(experiment)
    keys = list(params)
    have = {
        tuple(point_value(r["policy"] if k == "policy" else sweep_value(r, k)) for k in keys)
        for _, r in df.iterrows()
    }
    out = []
    for combo in itertools.product(*(params[k] for k in keys)):
        if tuple(point_value(v) for v in combo) not in have:
            out.append(" ".join(f"{k}={v}" for k, v in zip(keys, combo, strict=True)))
    return out


def _short(path: str) -> str:
    """A trace path relative to the project root when it is inside it."""
    from fmoesim.config.schema import PROJECT_ROOT

    p = Path(path)
    try:
        return str(p.resolve().relative_to(PROJECT_ROOT.resolve()))
    except ValueError:
        return path


def _bars(ax: Any, df: Any, column: str, scale: float, ylabel: str) -> None:
    names = _policies(df)
    vals = [scale * float(df[df.policy == p][column].iloc[0]) for p in names]
    ax.bar(names, vals, color=[policy_color(p) for p in names])
    ax.set_ylabel(ylabel)
    ax.tick_params(axis="x", rotation=35)
    for lab in ax.get_xticklabels():
        lab.set_ha("right")


def _lines(
    ax: Any, df: Any, x: str, y: str, scale: float, xlabel: str, ylabel: str, legend: bool = True
) -> None:
    """One line per policy, each in its own colour, marker and dash pattern, later ones
    thinner (:func:`~fmoesim.plots.style.series_style`), the legend right of the axes."""
    for i, p in enumerate(_policies(df)):
        d = df[df.policy == p].sort_values(x)
        ax.plot(d[x], scale * d[y], label=p, **series_style(p, i))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if legend:
        legend_outside(ax)


def _table(df: Any, columns: Mapping[str, tuple[str, float, str]], index: list[str]) -> str:
    """Markdown table: ``index`` columns, then ``columns`` {label: (column, scale, fmt)}."""
    head = [*index, *columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for _, r in df.iterrows():
        cells = [str(r[c]) for c in index]
        cells += [format(s * float(r[c]), f) for c, s, f in columns.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


# -- the figures -----------------------------------------------------------------------


def fig4(df: Any, plt: Any) -> tuple[Any, str]:
    """Hit rate vs prefetch distance, coarse vs fine."""
    df = _with(df, "policy.prefetch_distance", "distance")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    _lines(ax, df, "distance", "hit_rate", 100, "prefetch distance (layers)", "expert hit rate (%)")
    ax.set_title("coarse (fmoe-hit-count: request-level counts) vs fine (fmoe: expert maps)",
                 fontsize=9)  # fmt: skip
    cols = {"hit rate %": ("hit_rate", 100, ".2f")}
    return fig, _table(df.sort_values(["policy", "distance"]), cols, ["policy", "distance"])


def fig9(df: Any, plt: Any) -> tuple[Any, str]:
    """TTFT, TPOT and hit rate per policy.  MoEpic keeps its paper τ of 5,000 tokens,
    more than Mixtral-8x7B's 10 served requests process (2,310 tokens): its configurator
    does not run here."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.8))
    _bars(axes[0], df, "ttft_mean_s", 1e3, "mean TTFT (ms)")
    _bars(axes[1], df, "tpot_mean_s", 1e3, "mean TPOT (ms)")
    _bars(axes[2], df, "hit_rate", 100, "expert hit rate (%)")
    cols = {
        "TTFT ms": ("ttft_mean_s", 1e3, ".1f"),
        "TPOT ms": ("tpot_mean_s", 1e3, ".1f"),
        "hit rate %": ("hit_rate", 100, ".2f"),
    }
    return fig, _table(df, cols, ["policy"])


def fig10(df: Any, plt: Any) -> tuple[Any, str]:
    """CDF of end-to-end request latency (online serving).  MoEpic keeps its paper τ of
    5,000 tokens; the 16 requests, with the arrival log's lengths, process 31,960 tokens
    (28,766 of them in prompts), so its configurator runs six times."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, p in enumerate(_policies(df)):
        e2e = np.sort(np.asarray(df[df.policy == p]["request_e2e_s"].iloc[0], dtype=float))
        style = series_style(p, i) | {"markersize": max(6.0 - 0.6 * i, 3.0)}
        ax.step(e2e, np.arange(1, len(e2e) + 1) / len(e2e), where="post", label=p, **style)
    ax.set_xlabel("end-to-end request latency (s)")
    ax.set_ylabel("CDF")
    legend_outside(ax)
    cols = {"e2e p50 s": ("e2e_p50_s", 1, ".2f"), "e2e p99 s": ("e2e_p99_s", 1, ".2f")}
    return fig, _table(df, cols, ["policy"])


def _tpot_against(df: Any, plt: Any, x: str, xlabel: str) -> tuple[Any, str]:
    """Mean TPOT against column ``x`` on a log-2 axis, one line per policy, and a table
    of TPOT and hit rate per policy and ``x``."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    _lines(ax, df, x, "tpot_mean_s", 1e3, xlabel, "mean TPOT (ms)")
    ax.set_xscale("log", base=2)
    ticks = sorted(set(df[x]))
    ax.set_xticks(ticks, [f"{v:g}" for v in ticks])
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "hit rate %": ("hit_rate", 100, ".2f")}
    return fig, _table(df.sort_values(["policy", x]), cols, ["policy", x])


def fig11(df: Any, plt: Any) -> tuple[Any, str]:
    """TPOT vs expert budget."""
    return _tpot_against(df, plt, "budget_gb", "expert budget per GPU (GB)")


def fig12(df: Any, plt: Any) -> tuple[Any, str]:
    """Ablations: hit rate and TPOT per variant."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _bars(axes[0], df, "hit_rate", 100, "expert hit rate (%)")
    _bars(axes[1], df, "tpot_mean_s", 1e3, "mean TPOT (ms)")
    cols = {"hit rate %": ("hit_rate", 100, ".2f"), "TPOT ms": ("tpot_mean_s", 1e3, ".1f")}
    return fig, _table(df, cols, ["policy"])


def fig13(df: Any, plt: Any) -> tuple[Any, str]:
    """fMoE's TTFT and TPOT vs prefetch distance (the fmoe rows of fmoe-fig4)."""
    df = _with(df[df.policy == "fmoe"], "policy.prefetch_distance", "distance")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _lines(axes[0], df, "distance", "ttft_mean_s", 1e3, "prefetch distance", "mean TTFT (ms)",
           legend=False)  # fmt: skip
    _lines(axes[1], df, "distance", "tpot_mean_s", 1e3, "prefetch distance", "mean TPOT (ms)")
    cols = {"TTFT ms": ("ttft_mean_s", 1e3, ".1f"), "TPOT ms": ("tpot_mean_s", 1e3, ".1f")}
    return fig, _table(df.sort_values("distance"), cols, ["distance"])


def fig14a(df: Any, plt: Any) -> tuple[Any, str]:
    """Mean similarity scores vs Expert Map Store capacity."""
    df = _with(df, "policy.store_capacity", "capacity").sort_values("capacity")
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, (col, lab, c, m, ls) in enumerate(
        (
            ("policy_mean_semantic_score", "semantic", "#3182bd", "s", "-"),
            ("policy_mean_trajectory_score", "trajectory", "#e6550d", "o", "--"),
        )
    ):
        style = series_style(lab, i) | {"color": c, "marker": m, "linestyle": ls}
        ax.plot(df.capacity, df[col], label=lab, **style)
    ax.set_xscale("log")
    ax.set_xlabel("Expert Map Store capacity (maps)")
    ax.set_ylabel("mean similarity of matches (cosine)")
    legend_outside(ax)
    cols = {
        "semantic": ("policy_mean_semantic_score", 1, ".3f"),
        "trajectory": ("policy_mean_trajectory_score", 1, ".3f"),
    }
    return fig, _table(df, cols, ["capacity"])


def fig14b(df: Any, plt: Any) -> tuple[Any, str]:
    """TTFT and TPOT vs batch size."""
    df = _with(df, "serving.batch_size", "batch")
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _lines(axes[0], df, "batch", "ttft_mean_s", 1e3, "batch size", "mean TTFT (ms)", legend=False)
    _lines(axes[1], df, "batch", "tpot_mean_s", 1e3, "batch size", "mean TPOT (ms)")
    cols = {"TTFT ms": ("ttft_mean_s", 1e3, ".1f"), "TPOT ms": ("tpot_mean_s", 1e3, ".1f")}
    return fig, _table(df.sort_values(["policy", "batch"]), cols, ["policy", "batch"])


def fig16(df: Any, plt: Any) -> tuple[Any, str]:
    """The Expert Map Store's memory vs its capacity, per model: the arrays allocated for
    the whole capacity (maps and their norms per layer, the trace's embeddings)."""
    df = _with(df, "policy.store_capacity", "capacity").sort_values(["model", "capacity"])
    fig, ax = plt.subplots(figsize=(7, 3.8))
    for i, m in enumerate(dict.fromkeys(df.model)):
        d = df[df.model == m]
        ax.plot(d.capacity, d.policy_mean_store_mb, label=m, **series_style(m, i))
    ax.set_xscale("log")
    ax.set_xlabel("Expert Map Store capacity (maps)")
    ax.set_ylabel("store memory (MB)")
    legend_outside(ax)
    cols = {"store MB": ("policy_mean_store_mb", 1, ".1f")}
    return fig, _table(df, cols, ["model", "capacity"])


def _normalised(
    df: Any, plt: Any, base: str, figure: str, ratios: dict[str, tuple[str, str]]
) -> tuple[Any, Any]:
    """Bars of ``column / base policy's column`` for each ``{new column: (column,
    y label)}``, one panel each; returns the figure and the frame with the ratios."""
    ref = df[df.policy == base]
    if ref.empty:
        raise FmoesimError(f"{figure}: no {base} run to normalise by")
    df = df.copy()
    fig, axes = plt.subplots(1, len(ratios), figsize=(5 * len(ratios), 3.8))
    for ax, (new, (col, label)) in zip(axes, ratios.items(), strict=True):
        df[new] = df[col] / float(ref[col].iloc[0])
        _bars(ax, df, new, 1, label)
    return fig, df


def _blocking_bandwidth(
    df: Any, plt: Any, reference: str, experiment: str, name: str
) -> tuple[Any, str]:
    """Blocking time and PCIe bytes normalised to ``reference``'s (called ``name``)."""
    fig, df = _normalised(
        df, plt, reference, experiment,
        {"blocking_norm": ("stall_s", f"GPU blocking time / {name}"),
         "bandwidth_norm": ("pcie_bytes", f"PCIe bytes / {name}")},
    )  # fmt: skip
    cols = {
        "blocking (norm.)": ("blocking_norm", 1, ".2f"),
        "bandwidth (norm.)": ("bandwidth_norm", 1, ".2f"),
        "stall s": ("stall_s", 1, ".1f"),
        "PCIe GB": ("pcie_bytes", 1e-9, ".0f"),
    }
    return fig, _table(df, cols, ["policy"])


def mi_tab23(df: Any, plt: Any) -> tuple[Any, str]:
    """Blocking time and bandwidth normalised to on-demand fetching (lru)."""
    return _blocking_bandwidth(df, plt, "lru", "moe-infinity-tab2-3", "on-demand")


def mi_tab4(df: Any, plt: Any) -> tuple[Any, str]:
    """Table 4's design ladder: blocking time and bandwidth normalised to Vanilla."""
    return _blocking_bandwidth(df, plt, "moe-infinity-vanilla", "moe-infinity-tab4", "Vanilla")


def mi_tab5(df: Any, plt: Any) -> tuple[Any, str]:
    """Buffer hit rate per policy and budget (belady = ideal demand caching); late: the
    share of accesses whose expert was still in flight."""
    budgets = sorted(set(df.budget_gb))
    names = _policies(df)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    w = 0.8 / len(names)
    for i, p in enumerate(names):
        d = df[df.policy == p].set_index("budget_gb")
        bars = ax.bar(np.arange(len(budgets)) + i * w,
                      [100 * d.hit_rate.get(b, np.nan) for b in budgets],
                      w, label=p, color=policy_color(p))  # fmt: skip
        ax.bar_label(bars, fmt="%.2f", fontsize=7)  # a 0% bar is a bar, not a gap
    slots = {
        b: int(n)
        for b, n in zip(df.budget_gb, df.get("budget_experts", [np.nan] * len(df)), strict=True)
        if n == n
    }
    ax.set_xticks(
        np.arange(len(budgets)) + 0.4 - w / 2,
        [f"{b:.2f} GB" + (f" ({slots[b]} slots)" if b in slots else "") for b in budgets],
    )
    ax.set_xlabel("expert cache budget")
    ax.set_ylabel("buffer hit rate (%)")
    legend_outside(ax)
    cols = {"hit rate %": ("hit_rate", 100, ".2f"), "late %": ("late_rate", 100, ".2f")}
    order = df.sort_values("budget_gb", kind="stable")  # the preset's policy order within
    return fig, _table(order, cols, ["budget_gb", "policy"])


def mi_fig9(df: Any, plt: Any) -> tuple[Any, str]:
    """Decoding latency (TPOT) and request latency against the request rate."""
    df = _with(df, "serving.rate_rps", "rps")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _lines(axes[0], df, "rps", "tpot_mean_s", 1e3, "requests per second", "mean TPOT (ms)",
           legend=False)  # fmt: skip
    _lines(axes[1], df, "rps", "e2e_mean_s", 1, "requests per second", "mean request latency (s)")
    for ax in axes:
        ax.set_xscale("log")
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "latency s": ("e2e_mean_s", 1, ".1f"),
            "hit rate %": ("hit_rate", 100, ".2f")}  # fmt: skip
    return fig, _table(df.sort_values(["policy", "rps"]), cols, ["policy", "rps"])


def mi_fig9_gpu_rich(df: Any, plt: Any) -> tuple[Any, str]:
    """The GPU-Rich reference of Fig. 9: TPOT and request latency against the request
    rate with every expert resident on eight GPUs."""
    df = _with(df, "serving.rate_rps", "rps").sort_values("rps")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    panels = ((axes[0], "tpot_mean_s", 1e3, "mean TPOT (ms)"),
              (axes[1], "e2e_mean_s", 1, "mean request latency (s)"))  # fmt: skip
    for ax, col, scale, label in panels:
        ax.plot(df.rps, df[col] * scale, color="black", marker="o", label="GPU-Rich (8 GPUs)")
        ax.set_xscale("log")
        ax.set_xlabel("requests per second")
        ax.set_ylabel(label)
    legend_outside(axes[1])
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "latency s": ("e2e_mean_s", 1, ".1f")}
    return fig, _table(df, cols, ["rps"])


def mi_fig12(df: Any, plt: Any) -> tuple[Any, str]:
    """Prefill throughput and time to first token against the batch size."""
    df = _with(df, "serving.batch_size", "batch")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _lines(axes[0], df, "batch", "prefill_tokens_per_s", 1, "batch size",
           "prefill throughput (tokens/s)", legend=False)  # fmt: skip
    _lines(axes[1], df, "batch", "ttft_mean_s", 1, "batch size", "mean TTFT (s)")
    for ax in axes:
        ax.set_xscale("log", base=2)
    cols = {"prefill tokens/s": ("prefill_tokens_per_s", 1, ".1f"),
            "TTFT s": ("ttft_mean_s", 1, ".3f"),
            "hit rate %": ("hit_rate", 100, ".2f")}  # fmt: skip
    return fig, _table(df.sort_values(["policy", "batch"]), cols, ["policy", "batch"])


def mi_tab7(df: Any, plt: Any) -> tuple[Any, str]:
    """Per-request TPOT (a moving mean over :data:`RECOVERY_WINDOW` requests) against the
    request's place in the run, the workload shift marked; the table gives the mean TPOT
    before and after the shift and the requests to recover."""
    from fmoesim.engine.metrics import RECOVERY_WINDOW

    w = RECOVERY_WINDOW
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    lines = ["| policy | TPOT ms before | TPOT ms after | requests to recover |", "|" + "---|" * 4]
    shift = None
    for i, p in enumerate(_policies(df)):
        r = df[df.policy == p].iloc[0]
        try:
            shift = int(cfg_value(r, "workload.synthetic.shift_at"))
        except FmoesimError:  # a run of another workload: no shift in its config
            shift = None
        t = np.asarray(r["request_tpot_s"], dtype=float) * 1e3  # (R,)
        moving = np.convolve(t, np.full(w, 1.0 / w), mode="valid")  # (R - w + 1,)
        ax.plot(np.arange(len(moving)) + w - 1, moving, label=p, **series_style(p, i))
        at = shift if shift else len(t) // 2
        rec = r.get("shift_recovery_requests", float("nan"))
        lines.append(f"| {p} | {np.nanmean(t[:at]):.1f} | {np.nanmean(t[at:]):.1f} | {rec:g} |")
    if shift:
        ax.axvline(shift - 0.5, color="grey", linestyle=":", label="task shift")
    ax.set_xlabel(f"request (in serving order; the mean TPOT of it and the {w - 1} before)")
    ax.set_ylabel("TPOT (ms), moving mean")
    legend_outside(ax)
    return fig, "\n".join(lines)


def mi_fig11(df: Any, plt: Any) -> tuple[Any, str]:
    """TPOT against the number of GPUs the experts are spread over."""
    return _tpot_against(_with(df, "hardware.num_gpus", "gpus"), plt, "gpus", "GPUs")


def mi_fig13(df: Any, plt: Any) -> tuple[Any, str]:
    """Latency vs EAMC capacity."""
    df = _with(df, "policy.eamc_capacity", "capacity").sort_values("capacity")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(df.capacity, df.e2e_mean_s, **series_style("moe-infinity"))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("EAMC capacity (matrices)")
    ax.set_ylabel("mean request latency (s)")
    cols = {"latency s": ("e2e_mean_s", 1, ".2f"), "hit rate %": ("hit_rate", 100, ".2f")}
    return fig, _table(df, cols, ["capacity"])


def moepic_fig4(df: Any, plt: Any) -> tuple[Any, str]:
    """TPOT and hit rate against the split ratio θ, with and without the speculative
    prefetcher (θ = 0 with it is Prefetch Only, θ = 1 without it Cache Only)."""
    df = _with(df, "policy.split_ratio", "theta")
    df = _with(df, "policy.prefetch", "prefetch").sort_values(["prefetch", "theta"])
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for order, (mode, d) in enumerate(df.groupby("prefetch", sort=False)):
        style = {**series_style("moepic", order), "color": "black" if order else None}
        style = {k: v for k, v in style.items() if v is not None}
        style["linestyle"] = "--" if mode == "none" else "-"
        label = "prefetch off" if mode == "none" else f"{mode} prefetch"
        axes[0].plot(d.theta, d.tpot_mean_s * 1e3, label=label, **style)
        axes[1].plot(d.theta, d.hit_rate * 100, label=label, **style)
    for ax, ylabel in zip(axes, ("mean TPOT (ms)", "hit rate (%)"), strict=True):
        ax.set_xlabel("split ratio θ (top segment's share)")
        ax.set_ylabel(ylabel)
    legend_outside(axes[1])
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "TTFT s": ("ttft_mean_s", 1, ".2f"),
            "hit rate %": ("hit_rate", 100, ".2f")}  # fmt: skip
    return fig, _table(df, cols, ["prefetch", "theta"])


#: MoEpic Fig. 2(b) (§2.2): "a cache hit rate of 40% will introduce about 3.81x higher
#: inference latency compared to the GPU-Rich baseline"; Fig. 2(c): "an average of
#: 2.07~3.39 experts will be prefetched correctly" of the 4 a layer activates
MOEPIC_FIG2B_POINT = (0.40, 3.81)
MOEPIC_FIG2C_RANGE = (2.07, 3.39)


def moepic_fig2b(df: Any, plt: Any) -> tuple[Any, str]:
    """Fig. 2(b): TPOT against the hit rate of the cache-based policies (C = 10..50 of 60
    experts a layer), the GPU-Rich reference (C = 60: every expert resident) and the
    paper's point (40%, 3.81x GPU-Rich); Fig. 2(c): how many of a layer's ``k`` experts
    the trace's next-layer prediction gets right, per layer (the same in every run: a
    property of the trace), against the paper's range."""
    df = df.copy()
    df["C"] = df.experts_per_layer.astype(int)
    full = int(df.C.max())
    rich = df[df.C == full]
    curve = df[df.C < full].assign(hit_pct=lambda d: 100 * d.hit_rate)
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    _lines(axes[0], curve, "hit_pct", "tpot_mean_s", 1e3, "hit rate (%)", "mean TPOT (ms)",
           legend=False)  # fmt: skip
    rich_ms = 1e3 * float(rich.tpot_mean_s.min())
    axes[0].axhline(rich_ms, color="0.4", linestyle=":", label=f"GPU-Rich (C = {full})")
    hit, times = MOEPIC_FIG2B_POINT
    axes[0].plot([100 * hit], [times * rich_ms], "k*", markersize=9,
                 label=f"paper: {times:g}x GPU-Rich at {100 * hit:g}%")  # fmt: skip
    legend_outside(axes[0])
    k = int(cfg_value(df.iloc[0], "model.top_k"))
    recall = np.asarray(df.iloc[0]["layer_spec_recall"], dtype=float)  # (L,)
    correct = k * recall
    axes[1].bar(np.arange(len(correct)), correct, color=policy_color("adapmoe"))
    lo, hi = MOEPIC_FIG2C_RANGE
    axes[1].axhspan(lo, hi, color="0.85", zorder=0)
    axes[1].set_title(f"grey: the paper's {lo:g} to {hi:g} a layer", fontsize=9)
    axes[1].set_xlabel("MoE layer")
    axes[1].set_ylabel(f"experts predicted right (of {k})")
    cols = {"hit rate %": ("hit_rate", 100, ".2f"), "TPOT ms": ("tpot_mean_s", 1e3, ".1f")}
    table = _table(df.sort_values(["policy", "C"]), cols, ["policy", "C"])
    return fig, table + (
        f"\n\nGPU-Rich (C = {full}): {rich_ms:.1f} ms.  Next-layer prediction: "
        f"{correct.min():.2f} to {correct.max():.2f} of {k} experts right a layer "
        f"(the paper: {lo:g} to {hi:g})."
    )


def moepic_fig9b(df: Any, plt: Any) -> tuple[Any, str]:
    """TPOT against the configurator's allocation granularity ζ."""
    df = _with(df, "policy.zeta", "zeta").sort_values("zeta")
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    ax.plot(df.zeta, df.tpot_mean_s * 1e3, **series_style("moepic"))
    ax.set_xscale("log")
    ax.set_xlabel("allocation granularity ζ (share of an expert per step)")
    ax.set_ylabel("mean TPOT (ms)")
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "hit rate %": ("hit_rate", 100, ".2f")}
    return fig, _table(df, cols, ["zeta"])


def moepic_fig9a(df: Any, plt: Any) -> tuple[Any, str]:
    """TPOT under LCP's balance ρ and observation window ω: one bar per setting, the
    spread (largest minus smallest TPOT) in the title, as the paper's "latency variation"."""
    df = _with(_with(df, "policy.rho", "rho"), "policy.omega", "omega")
    df = df.sort_values(["rho", "omega"]).reset_index(drop=True)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    labels = [f"ρ={r:g}\nω={o:g}" for r, o in zip(df.rho, df.omega, strict=True)]
    ax.bar(range(len(df)), df.tpot_mean_s * 1e3, color=policy_color("moepic"))
    ax.set_xticks(range(len(df)), labels, fontsize=7)
    ax.set_ylabel("mean TPOT (ms)")
    spread_ms = 1e3 * float(df.tpot_mean_s.max() - df.tpot_mean_s.min())
    ax.set_title(f"spread {spread_ms:.1f} ms (the paper: at most 8 ms)", fontsize=9)
    cols = {"TPOT ms": ("tpot_mean_s", 1e3, ".1f"), "hit rate %": ("hit_rate", 100, ".2f")}
    return fig, _table(df, cols, ["rho", "omega"]) + f"\n\nSpread: {spread_ms:.1f} ms."


def moepic_tab1(df: Any, plt: Any) -> tuple[Any, str]:
    """Hit rate vs experts per layer."""
    df = df.copy()
    df["C"] = df.experts_per_layer.astype(int)
    fig, ax = plt.subplots(figsize=(7, 3.8))
    _lines(ax, df, "C", "hit_rate", 100, "cache size C (experts per layer, of 60)", "hit rate (%)")
    table = df.pivot_table(index="C", columns="policy", values="hit_rate") * 100
    lines = ["| C | " + " | ".join(table.columns) + " |", "|---|" + "---|" * len(table.columns)]
    for c, r in table.iterrows():
        lines.append(f"| {c} | " + " | ".join(f"{v:.2f}" for v in r) + " |")
    return fig, "\n".join(lines)


def moepic_fig7(df: Any, plt: Any) -> tuple[Any, str]:
    """TTFT and TPOT against the expert budget."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    _lines(axes[0], df, "budget_gb", "ttft_mean_s", 1, "expert budget (GB)", "mean TTFT (s)",
           legend=False)  # fmt: skip
    _lines(axes[1], df, "budget_gb", "tpot_mean_s", 1e3, "expert budget (GB)", "mean TPOT (ms)")
    cols = {"TTFT s": ("ttft_mean_s", 1, ".2f"), "TPOT ms": ("tpot_mean_s", 1e3, ".1f"),
            "hit rate %": ("hit_rate", 100, ".2f")}  # fmt: skip
    return fig, _table(df.sort_values(["policy", "budget_gb"]), cols, ["policy", "budget_gb"])


def moepic_tab3(df: Any, plt: Any) -> tuple[Any, str]:
    """Ablations: TTFT and TPOT relative to full MoEpic; the configurator's runs and the
    final mean split ratio θ show what the cache configuration changed (every τ = 5,000
    tokens, see ``conf/experiment/moepic-tab3.yaml``)."""
    fig, df = _normalised(
        df, plt, "moepic", "moepic-tab3",
        {"ttft_norm": ("ttft_mean_s", "TTFT / MoEpic's"),
         "tpot_norm": ("tpot_mean_s", "TPOT / MoEpic's")},
    )  # fmt: skip
    cols = {
        "TTFT ms": ("ttft_mean_s", 1e3, ".1f"),
        "TPOT ms": ("tpot_mean_s", 1e3, ".1f"),
        "TTFT x": ("ttft_norm", 1, ".2f"),
        "TPOT x": ("tpot_norm", 1, ".2f"),
        "configurations": ("policy_mean_configurations", 1, ".0f"),
        "mean θ": ("policy_mean_split_ratio", 1, ".3f"),
    }
    return fig, _table(df, cols, ["policy"])


def min_budgets(
    df: Any, targets_s: Sequence[float], size: str = "budget_gb"
) -> dict[str, list[float]]:
    """Per policy and target TPOT, the ``size`` column (default: the budget in GB) of the
    run at the smallest swept budget whose TPOT meets the target, NaN where none does (the
    rule of the scoreboard's ``min_budget`` claims)."""
    out = {}
    for p in _policies(df):
        d = df[df.policy == p].sort_values("budget_gb")
        out[p] = [
            float(d[d.tpot_mean_s <= t][size].iloc[0]) if (d.tpot_mean_s <= t).any() else np.nan
            for t in targets_s
        ]
    return out


#: MoEpic §4.3's target TPOTs (s) per model: "80, 100, 120, 140, 160 for Qwen1.5-MoE, and
#: 100, 130, 160, 190, 220 for Mixtral-8x7B"
MOEPIC_FIG8_TARGETS_S = {
    "qwen1.5-moe-a2.7b": (0.08, 0.10, 0.12, 0.14, 0.16),
    "mixtral-8x7b-2bit": (0.10, 0.13, 0.16, 0.19, 0.22),
}


def moepic_fig8(df: Any, plt: Any) -> tuple[Any, str]:
    """The smallest VRAM footprint per target TPOT (MoEpic §4.3's targets): per policy,
    the footprint (resident weights plus peak expert memory, ``vram_footprint_bytes``) of
    the run at the smallest swept budget whose mean TPOT meets the target; "not met" where
    no swept budget does.  Footprints are in GiB, the unit of the paper's "GB" (its
    GPU-Rich Qwen1.5-MoE, 26.67 GB, is 28.63e9 bytes)."""
    model = str(df.model.iloc[0])
    if model not in MOEPIC_FIG8_TARGETS_S:
        raise FmoesimError(
            f"moepic-fig8: model {model} has no target TPOTs in the paper; "
            f"valid: {', '.join(MOEPIC_FIG8_TARGETS_S)}"
        )
    targets = MOEPIC_FIG8_TARGETS_S[model]
    mins = {
        p: [v / 2**30 for v in vs]
        for p, vs in min_budgets(df, targets, "vram_footprint_bytes").items()
    }
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    w = 0.8 / len(mins)
    for i, (p, v) in enumerate(mins.items()):
        x = np.arange(len(targets)) + i * w
        axes[0].bar(x, v, w, label=p, color=policy_color(p))
        for xj, vj in zip(x, v, strict=True):
            if vj != vj:  # no swept budget meets the target: say so where the bar would be
                axes[0].text(xj, 0.2, "not met", rotation=90, ha="center", va="bottom",
                             fontsize=6, color=policy_color(p))  # fmt: skip
    axes[0].set_xticks(np.arange(len(targets)) + 0.4 - w / 2, [f"{1e3 * t:.0f}" for t in targets])
    axes[0].set_xlabel("target TPOT (ms)")
    axes[0].set_ylabel("minimum VRAM footprint (GiB)")
    _lines(axes[1], df, "budget_gb", "tpot_mean_s", 1e3, "expert budget (GB)", "mean TPOT (ms)")
    for t in targets:
        axes[1].axhline(1e3 * t, color="0.8", lw=0.6, zorder=0)
    lines = ["| target TPOT ms | " + " | ".join(mins) + " |", "|---|" + "---|" * len(mins)]
    for j, t in enumerate(targets):
        cells = ["not met" if v[j] != v[j] else f"{v[j]:.2f} GiB" for v in mins.values()]
        lines.append(f"| {1e3 * t:.0f} | " + " | ".join(cells) + " |")
    return fig, "\n".join(lines)


@dataclass(frozen=True)
class Figure:
    """One paper figure: the experiment (sweep) it reads, its title, its drawer, whether
    it plots latencies (then it reads the experiment's timed runs only), and whether it
    draws every model its preset sweeps (else the first one)."""

    experiment: str
    title: str
    draw: Callable[[Any, Any], tuple[Any, str]]
    timed: bool = True
    all_models: bool = False


FIGURES: dict[str, Figure] = {
    "fmoe-fig4": Figure("fmoe-fig4", "fMoE Fig. 4: hit rate vs prefetch distance", fig4, False),
    "fmoe-fig9": Figure("fmoe-fig9", "fMoE Fig. 9: TTFT, TPOT, hit rate per policy", fig9),
    "fmoe-fig10": Figure("fmoe-fig10", "fMoE Fig. 10: request latency CDF, online", fig10),
    "fmoe-fig11": Figure("fmoe-fig11", "fMoE Fig. 11: TPOT vs expert budget", fig11),
    "fmoe-fig12": Figure("fmoe-fig12", "fMoE Fig. 12: ablations", fig12),
    "fmoe-fig13": Figure("fmoe-fig4", "fMoE Fig. 13: latency vs prefetch distance", fig13),
    "fmoe-fig14a": Figure(
        "fmoe-fig14a", "fMoE Fig. 14a: similarity vs store capacity", fig14a, False
    ),
    "fmoe-fig14b": Figure("fmoe-fig14b", "fMoE Fig. 14b: latency vs batch size", fig14b),
    "fmoe-fig16": Figure(
        "fmoe-fig16", "fMoE Fig. 16: Expert Map Store memory", fig16, False, all_models=True
    ),
    "moe-infinity-tab2-3": Figure(
        "moe-infinity-tab2-3", "MoE-Infinity Tables 2-3: blocking time and bandwidth", mi_tab23
    ),
    "moe-infinity-tab4": Figure(
        "moe-infinity-tab4", "MoE-Infinity Table 4: prefetching design ladder", mi_tab4
    ),
    "moe-infinity-tab5": Figure(
        "moe-infinity-tab5", "MoE-Infinity Table 5: buffer hit rate", mi_tab5, False
    ),
    "moe-infinity-tab2-3-arctic": Figure(
        "moe-infinity-tab2-3-arctic", "MoE-Infinity Tables 2-3, Arctic", mi_tab23
    ),
    "moe-infinity-tab5-arctic": Figure(
        "moe-infinity-tab5-arctic", "MoE-Infinity Table 5, Arctic", mi_tab5, False
    ),
    "moe-infinity-tab2-3-switch": Figure(
        "moe-infinity-tab2-3-switch", "MoE-Infinity Tables 2-3, Switch", mi_tab23
    ),
    "moe-infinity-tab5-switch": Figure(
        "moe-infinity-tab5-switch", "MoE-Infinity Table 5, Switch", mi_tab5, False
    ),
    "moe-infinity-tab2-3-nllb": Figure(
        "moe-infinity-tab2-3-nllb", "MoE-Infinity Tables 2-3, NLLB-MoE", mi_tab23
    ),
    "moe-infinity-tab5-nllb": Figure(
        "moe-infinity-tab5-nllb", "MoE-Infinity Table 5, NLLB-MoE", mi_tab5, False
    ),
    "moe-infinity-fig9": Figure(
        "moe-infinity-fig9", "MoE-Infinity Fig. 9: latency against request rate", mi_fig9
    ),
    "moe-infinity-fig9-switch": Figure(
        "moe-infinity-fig9-switch",
        "MoE-Infinity Fig. 9(a): Switch, latency against request rate",
        mi_fig9,
    ),
    "moe-infinity-fig9-nllb": Figure(
        "moe-infinity-fig9-nllb",
        "MoE-Infinity Fig. 9(b): NLLB-MoE, latency against request rate",
        mi_fig9,
    ),
    "moe-infinity-fig9-gpu-rich": Figure(
        "moe-infinity-fig9-gpu-rich",
        "MoE-Infinity Fig. 9: the GPU-Rich reference (8 GPUs, every expert resident)",
        mi_fig9_gpu_rich,
    ),
    "moe-infinity-fig11": Figure(
        "moe-infinity-fig11", "MoE-Infinity Fig. 11: Switch, latency against GPUs", mi_fig11
    ),
    "moe-infinity-fig11-nllb": Figure(
        "moe-infinity-fig11-nllb",
        "MoE-Infinity Fig. 11: NLLB-MoE, latency against GPUs",
        mi_fig11,
    ),
    "moe-infinity-fig12": Figure(
        "moe-infinity-fig12", "MoE-Infinity Fig. 12: prefill throughput", mi_fig12
    ),
    "moe-infinity-fig12-nllb": Figure(
        "moe-infinity-fig12-nllb", "MoE-Infinity Fig. 12: NLLB-MoE, prefill throughput", mi_fig12
    ),
    "moe-infinity-tab7": Figure(
        "moe-infinity-tab7", "MoE-Infinity Table 7: latency after a task shift", mi_tab7
    ),
    "moe-infinity-tab7-nllb": Figure(
        "moe-infinity-tab7-nllb",
        "MoE-Infinity Table 7: NLLB-MoE, latency after a task shift",
        mi_tab7,
    ),
    "moe-infinity-tab7-arctic": Figure(
        "moe-infinity-tab7-arctic",
        "MoE-Infinity Table 7: Arctic, latency after a task shift",
        mi_tab7,
    ),
    "moe-infinity-fig13": Figure(
        "moe-infinity-fig13", "MoE-Infinity Fig. 13: EAMC capacity", mi_fig13
    ),
    "moepic-fig4": Figure(
        "moepic-fig4", "MoEpic Fig. 4(b): latency against the split ratio", moepic_fig4
    ),
    "moepic-fig2b": Figure(
        "moepic-fig2b",
        "MoEpic Fig. 2(b)-(c): TPOT against the hit rate; next-layer prediction per layer",
        moepic_fig2b,
    ),
    "moepic-fig9a": Figure(
        "moepic-fig9a", "MoEpic Fig. 9(a): TPOT against LCP's ρ and ω", moepic_fig9a
    ),
    "moepic-fig9b": Figure(
        "moepic-fig9b", "MoEpic Fig. 9(b): TPOT against the allocation granularity", moepic_fig9b
    ),
    "moepic-tab1": Figure(
        "moepic-tab1", "MoEpic Table 1: hit rate vs cache size", moepic_tab1, False
    ),
    "moepic-fig7": Figure(
        "moepic-fig7", "MoEpic Fig. 7: TTFT and TPOT against the budget", moepic_fig7
    ),
    "moepic-fig7-qwen": Figure(
        "moepic-fig7-qwen",
        "MoEpic Fig. 7(a), (c): TTFT and TPOT against the budget, Qwen1.5-MoE",
        moepic_fig7,
    ),
    "moepic-tab3": Figure("moepic-tab3", "MoEpic Table 3: ablations", moepic_tab3),
    "moepic-fig8": Figure(
        "moepic-fig8", "MoEpic Fig. 8(a): minimum VRAM per target TPOT, Qwen1.5-MoE", moepic_fig8
    ),
    "moepic-fig8-mixtral": Figure(
        "moepic-fig8-mixtral",
        "MoEpic Fig. 8(b): minimum VRAM per target TPOT, Mixtral-8x7B",
        moepic_fig8,
    ),
}


def coinciding_series(fig: Any) -> list[str]:
    """A sentence per group of labelled lines that are identical (same x and y values)
    in some panel of ``fig``, naming the panels by their y label; such lines lie on top
    of each other, which the caption says."""
    found: dict[tuple[str, ...], list[str]] = {}
    for ax in fig.axes:
        groups: list[tuple[Any, Any, list[str]]] = []
        for line in ax.get_lines():
            label = str(line.get_label())
            if label.startswith("_"):
                continue
            x = np.asarray(line.get_xdata(), dtype=float)
            y = np.asarray(line.get_ydata(), dtype=float)
            for gx, gy, names in groups:
                if np.array_equal(gx, x, equal_nan=True) and np.array_equal(gy, y, equal_nan=True):
                    names.append(label)
                    break
            else:
                groups.append((x, y, [label]))
        for _, _, names in groups:
            if len(names) > 1:
                found.setdefault(tuple(names), []).append(ax.get_ylabel() or "the plot")
    return [
        f"{' and '.join(names)} coincide (identical values) in {' and '.join(panels)}"
        for names, panels in found.items()
    ]


@dataclass
class Drawing:
    """A drawn figure before it is written: the matplotlib figure, its numbers as a
    Markdown table, and the parts of its caption."""

    fig: Any
    table: str
    setting: str
    trace: str
    notes: list[str]

    @property
    def caption(self) -> str:
        """The caption printed under the figure: setting, trace, notes."""
        return "; ".join([self.setting, self.trace, *self.notes])


def arrivals_note(df: Any) -> str:
    """How requests arrived in the rows' runs when they served online (``serving.mode``):
    the trace's arrival times (with the arrival log a synthetic trace took its lengths
    and times from, if any), Poisson or gamma arrivals at a rate (gamma: with its gaps'
    coefficient of variation), or an arrival log named by path; empty for static
    batches."""
    notes = []
    rates: list[Any] = []
    gamma: dict[Any, list[Any]] = {}  # the gaps' coefficient of variation -> rates
    for _, r in df.iterrows():
        if _cfg_get(r, "serving.mode", "static") != "online":
            continue
        kind = _cfg_get(r, "serving.arrivals", "trace")
        if kind == "csv":
            note = f"arrivals from {_short(str(_cfg_get(r, 'serving.arrivals_csv', '?')))}"
        elif kind == "poisson":
            rates.append(_cfg_get(r, "serving.rate_rps", "?"))
            continue
        elif kind == "gamma":
            cv = _cfg_get(r, "serving.arrival_cv", "?")
            gamma.setdefault(cv, []).append(_cfg_get(r, "serving.rate_rps", "?"))
            continue
        elif (log := _cfg_get(r, "workload.synthetic.arrivals_csv", None)) and _cfg_get(
            r, "workload.kind", "trace"
        ) == "synthetic":
            note = f"lengths and arrivals from {_short(str(log))}"
        else:
            note = "arrivals at the trace's times"
        notes.append(note)

    def ascending(values: list[Any]) -> str:
        ordered = sorted(set(values), key=lambda v: (not isinstance(v, int | float), v))
        return ", ".join(map(str, ordered))

    if rates:  # one note for every swept rate, in ascending order
        notes.append(f"Poisson arrivals at {ascending(rates)} requests/s")
    for cv, at in gamma.items():
        notes.append(f"gamma arrivals at {ascending(at)} requests/s (gaps' CV {cv})")
    return "online serving, " + "; ".join(dict.fromkeys(notes)) if notes else ""


def figure_caption_trace(df: Any) -> str:
    """The trace part of a figure's caption from its rows: each trace, whether its
    routing is real or synthetic, and how many of its requests the runs served (the
    ``requests`` column, of the trace's ``num_requests``; the held-in share from each
    run's ``serving.held_in_fraction``)."""
    totals = {t: trace_requests(t) for t in set(df.trace)}
    served = list(df["requests"]) if "requests" in df.columns else None
    held = []
    for _, r in df.iterrows():
        total = totals[r.trace]
        fraction = float(_cfg_get(r, "serving.held_in_fraction", 0.0) or 0.0)
        held.append(held_in_count(fraction, total) if total is not None else 0)
    return trace_caption(
        [_short(t) for t in df.trace],
        list(df.trace_source),
        served,
        [totals[t] for t in df.trace],
        held,
    )


def experiment_rows(
    results: Any, experiment: str, *, timed: bool, what: str | None = None, verb: str = "reads"
) -> tuple[Any, int]:
    """The rows of ``experiment`` in the store's DataFrame ``results`` that a figure or a
    claim reads: from the running code version, one per sweep point, timed ones only when
    ``timed`` (a reader of latencies), sorted in the preset's policy order, then its model
    order.  Returns them and how many hit-rate-only rows were left out.  ``what`` names
    the reader in errors (default ``experiment <name>``), ``verb`` what it does with
    latencies."""
    what = what or f"experiment {experiment}"
    df = results[results["experiment"] == experiment] if len(results) else results
    if len(df) == 0:
        raise FmoesimError(
            f"{what}: no runs of experiment {experiment} in the store "
            f"(run: fmoesim -m experiment={experiment})"
        )
    untimed = 0
    if timed:
        timed_rows = [is_timed(r) for _, r in df.iterrows()]
        untimed = len(df) - sum(timed_rows)
        df = df[timed_rows]
        if len(df) == 0:
            raise FmoesimError(
                f"{what}: {verb} latencies, but the store's runs of experiment "
                f"{experiment} are hit-rate-only (engine.timing=false); "
                f"run: fmoesim -m experiment={experiment} engine.timing=true"
            )
    df = _points(df, experiment)
    swept = sweep_params(experiment)
    order = {p: i for i, p in enumerate(swept.get("policy", []))}
    df = df.assign(_o=[order.get(p, len(order)) for p in df.policy])
    keys = ["_o", "policy"]
    if "model" in df.columns:  # then the preset's model order (the store's is its hashes')
        models = {m: i for i, m in enumerate(swept.get("model", []))}
        df = df.assign(_m=[models.get(m, len(models)) for m in df.model])
        keys.append("_m")
    df = df.sort_values(keys, kind="stable").drop(columns=keys[:1] + keys[2:])
    return df.reset_index(drop=True), untimed


def draw_figure(name: str, results: Any) -> Drawing:
    """Draw figure ``name`` from the store's DataFrame ``results`` (the experiment's
    rows of the running code version, timed ones only for a figure of latencies:
    :func:`experiment_rows`)."""
    if name not in FIGURES:
        raise FmoesimError(f"figure {name!r}: unknown; valid: {', '.join(FIGURES)}")
    f = FIGURES[name]
    df, untimed = experiment_rows(
        results, f.experiment, timed=f.timed, what=f"figure {name}", verb="plots"
    )
    models = list(dict.fromkeys(df["model"])) if "model" in df.columns else []
    shown = ""
    if len(models) > 1 and not f.all_models:  # a preset sweeping models: draw its first
        first = sweep_params(f.experiment).get("model", models)[0]
        df = df[df["model"] == first]
        shown = f", {first} of the {len(models)} models it sweeps (fmoesim-reproduce averages them)"
    plt = setup()
    try:
        fig, table = f.draw(df, plt)
    except KeyError as exc:
        raise FmoesimError(f"figure {name}: the store's rows lack {exc}") from None
    row0 = df.iloc[0]
    names = ", ".join(dict.fromkeys(df["model"])) if "model" in df.columns else row0.model
    setting = f"{names} on {row0.hardware}, {len(df)} runs (experiment={f.experiment}{shown})"
    if untimed:
        setting += f", timed runs only ({untimed} hit-rate-only runs left out)"
    if arrivals := arrivals_note(df):
        setting += f", {arrivals}"
    drawing = Drawing(fig, table, setting, figure_caption_trace(df), coinciding_series(fig))
    fig.suptitle(f.title, fontsize=11)
    width_chars = int(fig.get_figwidth() * 16)  # about 16 characters per inch at 7 pt
    note = textwrap.fill(drawing.caption, width_chars)
    fig.text(0.01, 0.005, note, fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.035 * (note.count("\n") + 1) + 0.01, 1, 1))
    return drawing


def render(name: str, results: Any, out_dir: Path, command: str | None = None) -> list[Path]:
    """Draw figure ``name`` from the store's DataFrame ``results`` (:func:`draw_figure`);
    write PNG, PDF and the caption file atomically; return their paths.  ``command`` is
    the caption's "regenerate" line (``fmoesim-plot <name> --run`` when not given)."""
    drawing = draw_figure(name, results)
    f = FIGURES[name]
    paths = save_figure(drawing.fig, out_dir, name)
    again = command or f"fmoesim-plot {name} --run"
    md = "\n".join(
        [f"# {f.title}", "", f"- setting: {drawing.setting}", f"- {drawing.trace}",
         *(f"- note: {n}" for n in drawing.notes),
         f"- regenerate: `{again}`", "", inspect.cleandoc(f.draw.__doc__ or ""),
         "", drawing.table, ""]
    )  # fmt: skip
    path = out_dir / f"{name}.md"
    with atomic_file(path) as tmp:
        tmp.write_text(md)
    paths.append(path)
    return paths
