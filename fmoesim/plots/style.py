"""One look for every figure: a fixed colour, marker and dash pattern per policy preset
(the same in every figure, notebook and report), readable sizes, legends outside the
axes, and the caption rule (each figure names its trace, how many of its requests were
served, and whether its routing is real or synthetic)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

#: colour per policy preset; families share a hue (fMoE variants are oranges, MoEpic
#: variants greens, MoE-Infinity variants blues, classic caches greys)
POLICY_COLORS: dict[str, str] = {
    "fmoe": "#e6550d",
    "fmoe-map-ts": "#fd8d3c",
    "fmoe-map-t": "#fdae6b",
    "fmoe-hit-count": "#a63603",
    "fmoe-lru": "#fdd0a2",
    "fmoe-lfu": "#d94801",
    "fmoe-speculate": "#f16913",
    "moepic": "#31a354",
    "moepic-no-sp": "#74c476",
    "moepic-no-lcp": "#a1d99b",
    "moepic-no-cca": "#006d2c",
    "moe-infinity": "#3182bd",
    "moe-infinity-vanilla": "#c6dbef",
    "moe-infinity-tracing": "#9ecae1",
    "moe-infinity-multi-layer": "#4292c6",
    "moe-infinity-sync": "#2171b5",
    "mixtral-offloading": "#756bb1",
    "mixtral-offloading-sync": "#807dba",
    "adapmoe": "#9e9ac8",
    "promoe": "#c51b8a",
    "pregated": "#fa9fb5",
    "deepspeed": "#636363",
    "dependency": "#6baed6",
    "brainstorm": "#08519c",
    "brainstorm-count": "#08306b",
    "lru": "#969696",
    "lfu": "#bdbdbd",
    "lcp": "#54278f",
    "fifo": "#d9d9d9",
    "rnd": "#cccc66",
    "belady": "#000000",
}
_FALLBACK = ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4"]

#: (marker, dash pattern) per policy preset, no two alike, so lines of equal values
#: stay apart; the policies compared in one figure differ in both where possible
POLICY_MARKS: dict[str, tuple[str, str]] = {
    "fmoe": ("o", "-"),
    "fmoe-map-ts": ("s", "--"),
    "fmoe-map-t": ("^", "-."),
    "fmoe-hit-count": ("v", ":"),
    "fmoe-lru": ("D", "--"),
    "fmoe-lfu": ("P", "-."),
    "fmoe-speculate": ("X", ":"),
    "moepic": ("P", "--"),
    "moepic-no-sp": ("s", ":"),
    "moepic-no-lcp": ("<", "--"),
    "moepic-no-cca": ("v", "-."),
    "moe-infinity": ("v", "-"),
    "moe-infinity-vanilla": ("8", ":"),
    "moe-infinity-tracing": ("H", "--"),
    "moe-infinity-multi-layer": ("d", "-."),
    "moe-infinity-sync": ("*", ":"),
    "mixtral-offloading": ("^", "--"),
    "mixtral-offloading-sync": ("*", "--"),
    "adapmoe": ("<", ":"),
    "promoe": ("D", ":"),
    "pregated": (">", "-."),
    "deepspeed": ("s", "-"),
    "dependency": ("h", "--"),
    "brainstorm": ("p", ":"),
    "brainstorm-count": ("p", "-."),
    "lru": ("o", "--"),
    "lfu": ("s", "-."),
    "lcp": ("D", "-"),
    "fifo": ("X", "--"),
    "rnd": ("^", ":"),
    "belady": ("*", "-"),
}
_FALLBACK_MARKS = [("h", "-."), ("p", "-"), ("8", "--"), ("H", ":"), ("d", "-."), ("<", "-")]


def _pick(name: str, options: Sequence[Any]) -> Any:
    return options[sum(map(ord, name)) % len(options)]


def policy_color(name: str) -> str:
    """The policy's colour (a stable one from a small palette for unknown names)."""
    return POLICY_COLORS[name] if name in POLICY_COLORS else _pick(name, _FALLBACK)


def policy_marks(name: str) -> tuple[str, str]:
    """The policy's ``(marker, linestyle)`` (a stable pair for unknown names)."""
    return POLICY_MARKS[name] if name in POLICY_MARKS else _pick(name, _FALLBACK_MARKS)


def series_style(name: str, order: int = 0) -> dict[str, Any]:
    """``plot`` keywords for the ``order``-th series of a panel, named ``name``: its
    colour, marker and dash pattern, and a line and marker that get thinner and smaller
    with ``order``, so a series drawn over an equal earlier one leaves that one's wider
    line and larger marker showing around it."""
    marker, linestyle = policy_marks(name)
    return {
        "color": policy_color(name),
        "marker": marker,
        "linestyle": linestyle,
        "linewidth": max(3.0 - 0.4 * order, 1.4),
        "markersize": max(9.0 - 1.1 * order, 4.5),
        "markeredgecolor": "white",
        "markeredgewidth": 0.6,
        "zorder": 2 + 0.1 * order,
    }


def legend_outside(ax: Any, **kw: Any) -> Any:
    """The axes' legend to the right of its data area (never over a data point); the
    figure's ``tight_layout`` makes room for it."""
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kw)


def setup(agg: bool = True) -> Any:
    """matplotlib with readable defaults (and the Agg backend for files; notebooks pass
    ``agg=False`` to keep their inline backend); returns ``pyplot``."""
    import matplotlib

    if agg:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update(
        {
            "font.size": 10,
            "axes.titlesize": 10,
            "axes.labelsize": 10,
            "legend.fontsize": 8,
            "axes.grid": True,
            "grid.alpha": 0.3,
            "savefig.dpi": 150,
        }
    )
    return plt


#: what each ``trace.json`` ``source.kind`` says about the routing
ROUTING: dict[str, str] = {
    "synthetic": "synthetic routing from fmoesim's workload model, not real",
    "collector": "real routing, collected from the model",
    "importer": "real routing, imported from a published trace",
}


def routing_note(source: str) -> str:
    """Whether a trace's routing is real or synthetic, from its ``source.kind``."""
    return ROUTING.get(source, f"routing of unknown origin (source {source or 'not recorded'})")


def trace_requests(trace: str | Path) -> int | None:
    """The number of requests a trace holds (its ``trace.json``'s ``num_requests``; a
    relative path is taken from the project root), or None when it cannot be read."""
    from fmoesim.config.schema import PROJECT_ROOT

    path = Path(trace)
    if not path.is_absolute():
        path = PROJECT_ROOT / path
    try:
        n = json.loads((path / "trace.json").read_text())["num_requests"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return int(n) if isinstance(n, int) else None


def held_in_count(fraction: float, total: int) -> int:
    """Requests a run held in for the policy's learning: ``round(fraction * total)``, at
    most ``total - 1`` (as the serving split draws them)."""
    return min(round(fraction * total), total - 1) if fraction > 0 else 0


def _requests_note(served: list[int], total: int | None, held_in: list[int]) -> str:
    lo, hi = min(served), max(served)
    n = f"{lo}" if lo == hi else f"{lo}-{hi}"
    if total is None:
        text = f"{n} request{'' if n == '1' else 's'} served"
    elif lo == hi == total:
        text = "the 1 request served" if total == 1 else f"all {total} requests served"
    else:
        text = f"{n} of {total} requests served"
    held = sorted({h for h in held_in if h})
    if held:
        h = str(held[0]) if len(held) == 1 else f"{held[0]}-{held[-1]}"
        text += f", {h} others held in for the policy to learn from"
    return text


def trace_caption(
    traces: Sequence[str],
    sources: Sequence[str],
    served: Sequence[int | None] | None = None,
    totals: Sequence[int | None] | None = None,
    held_in: Sequence[int] | None = None,
) -> str:
    """``trace: <path> (<real or synthetic routing>; <n> of <N> requests served)`` for
    the traces a figure or run used, one entry per trace.  The lists run parallel, one
    item per run: its trace path, its ``source.kind``, the requests it served, the
    trace's number of requests (None: unknown, read from the trace when it can be) and
    the requests it held in for learning."""
    n = len(traces)
    served = list(served) if served is not None else [None] * n
    totals = list(totals) if totals is not None else [None] * n
    held_in = list(held_in) if held_in is not None else [0] * n
    by_trace: dict[tuple[str, str], list[tuple[int | None, int | None, int]]] = {}
    for item in zip(traces, sources, served, totals, held_in, strict=True):
        by_trace.setdefault((item[0], item[1]), []).append(item[2:])
    parts = []
    for (t, s), uses in sorted(by_trace.items()):
        note = routing_note(s)
        counts = [int(u[0]) for u in uses if u[0] is not None]
        if counts:
            known = [u[1] for u in uses if u[1] is not None]
            total = known[0] if known else trace_requests(t)
            note += "; " + _requests_note(counts, total, [u[2] for u in uses])
        parts.append(f"{t} ({note})")
    return "trace: " + "; ".join(parts)


def save_figure(fig: Any, out_dir: Path, name: str, bbox_inches: str | None = None) -> list[Path]:
    """Write ``fig`` as ``<name>.png`` and ``<name>.pdf`` under ``out_dir``, each
    atomically (the PDF without a creation date: the same numbers give the same file),
    close it and return the two paths."""
    import matplotlib.pyplot as plt

    from fmoesim.atomic import atomic_file

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    try:
        for ext in ("png", "pdf"):
            path = out_dir / f"{name}.{ext}"
            with atomic_file(path) as tmp:
                meta = {"CreationDate": None} if ext == "pdf" else None
                fig.savefig(tmp, format=ext, metadata=meta, bbox_inches=bbox_inches)
            paths.append(path)
    finally:
        plt.close(fig)
    return paths
