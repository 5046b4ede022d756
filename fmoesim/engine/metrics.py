"""Metrics, one definition for both backends (DESIGN.md "Metrics")."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from policies.base import Outcome


@dataclass
class Metrics:
    """Counters filled by the Runner; :meth:`summary` turns them into one row."""

    num_layers: int
    accesses: np.ndarray = field(init=False)  # (L, 3) counts of HIT, LATE, MISS
    stall_s: float = 0.0
    stall_per_layer_s: np.ndarray = field(init=False)  # (L,)
    transfers: int = 0
    pcie_bytes: int = 0
    pcie_bytes_by_reason: dict[str, int] = field(default_factory=dict)
    request_start_s: dict[int, float] = field(default_factory=dict)
    request_first_token_s: dict[int, float] = field(default_factory=dict)
    request_end_s: dict[int, float] = field(default_factory=dict)
    request_output_tokens: dict[int, int] = field(default_factory=dict)
    iterations: int = 0
    layer_steps: int = 0

    def __post_init__(self) -> None:
        self.accesses = np.zeros((self.num_layers, 3), dtype=np.int64)
        self.stall_per_layer_s = np.zeros(self.num_layers)

    def access(self, layer: int, outcome: Outcome) -> None:
        """Count one expert access."""
        self.accesses[layer, outcome] += 1

    def transfer(self, size_bytes: int, reason: str) -> None:
        """Count one host-to-device transfer."""
        self.transfers += 1
        self.pcie_bytes += size_bytes
        self.pcie_bytes_by_reason[reason] = self.pcie_bytes_by_reason.get(reason, 0) + size_bytes

    def hit_rate_per_layer(self) -> np.ndarray:
        """HIT / accesses per layer (NaN where a layer had no access)."""
        total = self.accesses.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, self.accesses[:, Outcome.HIT] / total, np.nan)

    def request_table(self) -> dict[str, np.ndarray]:
        """Per-request TTFT, TPOT and end-to-end latency (seconds)."""
        ids = np.array(sorted(self.request_end_s), dtype=np.int64)
        start = np.array([self.request_start_s[i] for i in ids])
        first = np.array([self.request_first_token_s[i] for i in ids])
        end = np.array([self.request_end_s[i] for i in ids])
        out = np.array([self.request_output_tokens[i] for i in ids])
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), np.nan)
        return {"request_id": ids, "ttft_s": first - start, "tpot_s": tpot, "e2e_s": end - start}

    def summary(self) -> dict[str, Any]:
        """The metrics of DESIGN.md as one flat row."""
        hits, late, miss = (int(x) for x in self.accesses.sum(axis=0))
        total = hits + late + miss
        req = self.request_table()

        def stat(a: np.ndarray, fn: str) -> float:
            a = a[~np.isnan(a)]
            if not len(a):
                return float("nan")
            return float(np.mean(a)) if fn == "mean" else float(np.percentile(a, float(fn[1:])))

        return {
            "accesses": total,
            "hits": hits,
            "late": late,
            "misses": miss,
            "hit_rate": hits / total if total else float("nan"),
            "late_rate": late / total if total else float("nan"),
            "stall_s": self.stall_s,
            "ttft_mean_s": stat(req["ttft_s"], "mean"),
            "ttft_p50_s": stat(req["ttft_s"], "p50"),
            "ttft_p99_s": stat(req["ttft_s"], "p99"),
            "tpot_mean_s": stat(req["tpot_s"], "mean"),
            "tpot_p50_s": stat(req["tpot_s"], "p50"),
            "tpot_p99_s": stat(req["tpot_s"], "p99"),
            "e2e_mean_s": stat(req["e2e_s"], "mean"),
            "e2e_p99_s": stat(req["e2e_s"], "p99"),
            "transfers": self.transfers,
            "pcie_bytes": self.pcie_bytes,
            "requests": len(req["request_id"]),
            "iterations": self.iterations,
            "layer_steps": self.layer_steps,
        }
