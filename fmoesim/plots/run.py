"""The figure of one run: where accesses hit, arrived late or missed, per layer."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def plot_run(
    accesses: np.ndarray, stall_per_layer_s: np.ndarray, title: str, path: Path, caption: str = ""
) -> None:
    """Write a PNG: stacked hit/late/miss share per layer, and stall seconds per layer.

    ``accesses`` is ``(L, 3)`` counts of HIT, LATE, MISS.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L = accesses.shape[0]
    total = np.maximum(accesses.sum(axis=1, keepdims=True), 1)
    share = accesses / total * 100
    x = np.arange(L)
    fig, (ax1, ax2) = plt.subplots(
        2, 1, figsize=(9, 5.5), sharex=True, gridspec_kw={"height_ratios": [2, 1]}
    )
    bottom = np.zeros(L)
    for i, (name, colour) in enumerate(
        (("hit", "#2a9d8f"), ("late", "#e9c46a"), ("miss", "#e76f51"))
    ):
        ax1.bar(x, share[:, i], bottom=bottom, color=colour, label=name, width=0.85)
        bottom += share[:, i]
    ax1.set_ylabel("expert accesses (%)")
    ax1.set_ylim(0, 100)
    ax1.legend(loc="upper right", ncols=3, fontsize=8)
    ax1.set_title(title, fontsize=10)
    ax2.bar(x, stall_per_layer_s, color="#264653", width=0.85)
    ax2.set_ylabel("GPU stall (s)")
    ax2.set_xlabel("MoE layer")
    if caption:
        fig.text(0.01, 0.005, caption, fontsize=7, color="#555555")
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)
