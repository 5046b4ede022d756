"""One look for every figure: a fixed colour per policy preset (the same in every
figure, notebook and report), readable sizes, and the caption rule (each figure names
its trace and says when the routing is synthetic)."""

from __future__ import annotations

from typing import Any

#: colour per policy preset; families share a hue (fMoE variants are oranges, MoEpic
#: variants greens, classic caches greys and blues)
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
    "mixtral-offloading": "#756bb1",
    "adapmoe": "#9e9ac8",
    "promoe": "#c51b8a",
    "pregated": "#fa9fb5",
    "deepspeed": "#636363",
    "dependency": "#6baed6",
    "brainstorm": "#08519c",
    "lru": "#969696",
    "lfu": "#bdbdbd",
    "lcp": "#54278f",
    "fifo": "#d9d9d9",
    "rnd": "#cccc66",
    "belady": "#000000",
}
_FALLBACK = ["#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf", "#1f77b4"]


def policy_color(name: str) -> str:
    """The policy's colour (a stable one from a small palette for unknown names)."""
    if name in POLICY_COLORS:
        return POLICY_COLORS[name]
    return _FALLBACK[sum(map(ord, name)) % len(_FALLBACK)]


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


def trace_caption(traces: list[str], sources: list[str]) -> str:
    """``trace: <path> (synthetic routing, not real)`` for the traces a figure used."""
    parts = []
    for t, s in sorted(set(zip(traces, sources, strict=True))):
        note = (
            "synthetic routing from fmoesim's workload model, not real" if s == "synthetic" else s
        )
        parts.append(f"{t} ({note})")
    return "trace: " + "; ".join(parts)
