"""The figure of one run: where accesses hit, arrived late or missed, per layer."""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.plots.style import held_in_count, trace_caption, trace_requests


def run_caption(
    trace: str,
    trace_source: str,
    requests_served: int | None = None,
    requests_total: int | None = None,
    held_in_fraction: float = 0.0,
    timed: bool = True,
) -> str:
    """The caption of a run's figure: its trace, whether the routing is real or
    synthetic, and how many of the trace's requests it served (the total is read from
    the trace's ``trace.json`` when not given); a hit-rate-only run (``timed`` false)
    says that it has no stall times."""
    total = requests_total if requests_total is not None else trace_requests(trace)
    held = held_in_count(held_in_fraction, total) if total is not None else 0
    caption = trace_caption([trace], [trace_source], [requests_served], [total], [held])
    return caption if timed else caption + "; hit-rate-only: no stall"


def draw_run(
    accesses: np.ndarray, stall_per_layer_s: np.ndarray, title: str, caption: str = ""
) -> Any:
    """The run's figure (a matplotlib ``Figure``, Agg backend): stacked hit/late/miss
    share per layer with the legend above the bars, stall seconds per layer below, the
    caption at the foot.  ``accesses`` is ``(L, 3)`` counts of HIT, LATE, MISS."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = accesses.shape[0]
    total = np.maximum(accesses.sum(axis=1, keepdims=True), 1)
    share = accesses / total * 100
    x = np.arange(L)
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(9, 5.8), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    bottom = np.zeros(L)
    for i, (name, colour) in enumerate(
        (("hit", "#2a9d8f"), ("late", "#e9c46a"), ("miss", "#e76f51"))
    ):
        ax1.bar(x, share[:, i], bottom=bottom, color=colour, label=name, width=0.85)
        bottom += share[:, i]
    ax1.set_ylabel("expert accesses (%)")
    ax1.set_ylim(0, 100)
    # above the bars, between the title and the data area: it covers no layer
    ax1.legend(loc="lower center", bbox_to_anchor=(0.5, 1.01), ncols=3, fontsize=8,
               borderaxespad=0.0, frameon=False)  # fmt: skip
    fig.suptitle(title, fontsize=10)
    ax2.bar(x, stall_per_layer_s, color="#264653", width=0.85)
    ax2.set_ylabel("GPU stall (s)")
    ax2.set_xlabel("MoE layer")
    note = textwrap.fill(caption, int(fig.get_figwidth() * 16))  # ~16 characters/inch at 7 pt
    if note:
        fig.text(0.01, 0.005, note, fontsize=7, color="#555555", va="bottom")
    fig.tight_layout(rect=(0, 0.03 * (note.count("\n") + 1) + 0.005, 1, 1))
    return fig


def plot_run(
    accesses: np.ndarray,
    stall_per_layer_s: np.ndarray,
    title: str,
    path: Path,
    caption: str = "",
    *,
    trace: str | None = None,
    trace_source: str = "",
    requests_served: int | None = None,
    requests_total: int | None = None,
    held_in_fraction: float = 0.0,
    timed: bool = True,
) -> None:
    """Write the run's figure (:func:`draw_run`) as a PNG.

    With ``trace`` the caption is built here (:func:`run_caption`: the trace, real or
    synthetic routing from ``trace_source``, ``requests_served`` of ``requests_total``
    requests, the held-in share, and "hit-rate-only" when ``timed`` is false); otherwise
    ``caption`` is printed as given.
    """
    import matplotlib.pyplot as plt

    if trace is not None:
        caption = run_caption(
            trace, trace_source, requests_served, requests_total, held_in_fraction, timed
        )
    fig = draw_run(accesses, stall_per_layer_s, title, caption)
    fig.savefig(path, dpi=120)
    plt.close(fig)
