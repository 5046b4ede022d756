"""Metrics, one definition for both backends (DESIGN.md "Metrics").

- hit rate: HIT / accesses, per layer and overall; LATE (found in flight) and MISS
  (absent) are counted apart.  An access is one (layer step, expert) the batch needs.
- stall: per layer, the longest time any GPU's compute waited for an expert; summed.
- TTFT / TPOT / end-to-end per request (from batch start in static mode, from arrival
  in online mode); TPOT = (end - first token) / (output tokens - 1).
- PCIe bytes moved (by reason), bytes wasted (prefetched then evicted unused), unused
  prefetch bytes (prefetched and never used, including still resident at the end).
- peak expert memory (per GPU, max over GPUs).
- prefill throughput: the tokens of every prefill iteration over the seconds those
  iterations took, from the iteration's start (its start actions included) to its LM head.
- recovery after a workload shift (:func:`shift_recovery`): requests served after the
  first change of dataset label before TPOT is as low as before it.

A hit-rate-only run (``timing=False``) has no clock: its time metrics
(:data:`TIME_COLUMNS`, the per-request latencies and the per-layer stall) are missing
values (NaN), not zeros, so that an average over timed and untimed runs cannot take
them in.  Hit rates, counts and bytes are measured in both modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import numpy as np

from fmoesim.engine.backend import TransferRecord
from fmoesim.engine.cache import ExpertCache
from policies.base import Outcome

#: summary columns that measure time (seconds, or a ratio of times): NaN in a
#: hit-rate-only run
TIME_COLUMNS: Final = (
    "stall_s",
    "ttft_mean_s",
    "ttft_p50_s",
    "ttft_p99_s",
    "tpot_mean_s",
    "tpot_p50_s",
    "tpot_p99_s",
    "e2e_mean_s",
    "e2e_p50_s",
    "e2e_p99_s",
    "prefill_tokens_per_s",
    "shift_recovery_requests",
    "simulated_s",
    "gpu_busy_s",
    "link_busy_s",
    "speedup_vs_real",
)
#: list columns of a results-store row that hold times: per request (TTFT, TPOT,
#: end-to-end) and per MoE layer (stall); lists of NaN in a hit-rate-only run
LIST_TIME_COLUMNS: Final = ("request_ttft_s", "request_tpot_s", "request_e2e_s", "layer_stall_s")


#: :func:`shift_recovery`: the requests whose mean TPOT is compared, and by how much the
#: mean after the shift may exceed the mean before it and count as recovered
RECOVERY_WINDOW: Final = 8
RECOVERY_TOLERANCE: Final = 0.05


def shift_recovery(tpot_s: Sequence[float] | np.ndarray, shifted: Sequence[bool]) -> float:
    """How many requests after a workload shift are served before latency is low again.

    ``tpot_s`` (R,): each request's TPOT, and ``shifted`` (R,): whether its dataset label
    differs from the first request's, both in the order the requests started (requests
    without a TPOT, of one output token, are left out).  The shift
    is the first shifted request; "low" is the mean TPOT of the :data:`RECOVERY_WINDOW`
    requests before it.  The result is the smallest ``i >= 0`` such that the mean TPOT of
    the window of requests starting ``i`` requests after the shift is at most ``(1 +``
    :data:`RECOVERY_TOLERANCE` ``)`` times that.  NaN without a shift, with less than a
    window of requests on either side, or when no window after it is that low."""
    w = RECOVERY_WINDOW
    t = np.asarray(tpot_s, dtype=np.float64)  # (R,)
    keep = ~np.isnan(t)  # a request of one output token has no TPOT
    t, after = t[keep], np.asarray(shifted, dtype=bool)[keep]
    at = int(np.argmax(after)) if after.any() else -1
    if at < w or len(t) - at < w:
        return float("nan")
    low = float(t[at - w : at].mean())
    means = np.convolve(t[at:], np.full(w, 1.0 / w), mode="valid")  # (R - at - w + 1,)
    ok = np.flatnonzero(means <= (1.0 + RECOVERY_TOLERANCE) * low)
    return float(ok[0]) if len(ok) else float("nan")


def blank_times(row: dict[str, Any]) -> dict[str, Any]:
    """``row`` with every time column it holds (:data:`TIME_COLUMNS`,
    :data:`LIST_TIME_COLUMNS`) set to missing values: the row of a hit-rate-only run."""
    out = dict(row)
    for key in TIME_COLUMNS:
        if key in out:
            out[key] = float("nan")
    for key in LIST_TIME_COLUMNS:
        if key in out and out[key] is not None:
            out[key] = [float("nan")] * len(out[key])
    return out


@dataclass
class Metrics:
    """Counters filled by the Runner; :meth:`summary` turns them into one row.

    perf: the per-access counters are plain Python lists (``acc`` (L, 3),
    ``stall_layer_s`` (L,)) because incrementing numpy scalars costs several times more.

    ``timing=False`` (a hit-rate-only run): the tables and the summary report every
    time as NaN (see the module docstring).
    """

    num_layers: int
    acc: list[list[int]] = field(init=False)  # (L, 3) HIT, LATE, MISS
    stall_layer_s: list[float] = field(init=False)  # (L,)
    stall_s: float = 0.0
    prefetch_dropped: int = 0
    request_start_s: dict[int, float] = field(default_factory=dict)
    request_first_token_s: dict[int, float] = field(default_factory=dict)
    request_end_s: dict[int, float] = field(default_factory=dict)
    request_output_tokens: dict[int, int] = field(default_factory=dict)
    request_dataset: dict[int, str] = field(default_factory=dict)
    iterations: int = 0
    layer_steps: int = 0
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    timing: bool = True

    def __post_init__(self) -> None:
        self.acc = [[0, 0, 0] for _ in range(self.num_layers)]
        self.stall_layer_s = [0.0] * self.num_layers

    @property
    def accesses(self) -> np.ndarray:
        """(L, 3) counts of HIT, LATE, MISS per MoE layer."""
        return np.array(self.acc, dtype=np.int64).reshape(self.num_layers, 3)

    @property
    def stall_per_layer_s(self) -> np.ndarray:
        """(L,) stall seconds per MoE layer."""
        return np.array(self.stall_layer_s)

    def hit_rate_per_layer(self) -> np.ndarray:
        """HIT / accesses per layer (NaN where a layer had no access)."""
        a = self.accesses
        total = a.sum(axis=1)
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(total > 0, a[:, Outcome.HIT] / total, np.nan)

    def layer_table(self) -> dict[str, np.ndarray]:
        """Per-layer metrics as columns."""
        a = self.accesses
        return {
            "layer": np.arange(self.num_layers),
            "hits": a[:, 0],
            "late": a[:, 1],
            "misses": a[:, 2],
            "hit_rate": self.hit_rate_per_layer(),
            "stall_s": self.stall_per_layer_s if self.timing else np.full(self.num_layers, np.nan),
        }

    def request_table(self) -> dict[str, np.ndarray]:
        """Per-request TTFT, TPOT and end-to-end latency (seconds; NaN without timing)."""
        ids = np.array(sorted(self.request_end_s), dtype=np.int64)
        if not self.timing:
            none = np.full(len(ids), np.nan)
            return {"request_id": ids, "ttft_s": none, "tpot_s": none.copy(), "e2e_s": none.copy()}
        start = np.array([self.request_start_s[i] for i in ids])
        first = np.array([self.request_first_token_s[i] for i in ids])
        end = np.array([self.request_end_s[i] for i in ids])
        out = np.array([self.request_output_tokens[i] for i in ids])
        with np.errstate(invalid="ignore", divide="ignore"):
            tpot = np.where(out > 1, (end - first) / np.maximum(out - 1, 1), np.nan)
        return {"request_id": ids, "ttft_s": first - start, "tpot_s": tpot, "e2e_s": end - start}

    def _shift_recovery(self, req: dict[str, np.ndarray]) -> float:
        """:func:`shift_recovery` of the run (NaN without timing or dataset labels)."""
        if not self.timing or not self.request_dataset:
            return float("nan")
        ids = req["request_id"].tolist()
        order = sorted(range(len(ids)), key=lambda i: (self.request_start_s[ids[i]], ids[i]))
        first = self.request_dataset.get(ids[order[0]]) if order else None
        shifted = [self.request_dataset.get(ids[i]) != first for i in order]
        return shift_recovery(req["tpot_s"][order], shifted)

    def summary(
        self, transfers: Sequence[TransferRecord] = (), caches: Sequence[ExpertCache] = ()
    ) -> dict[str, Any]:
        """The metrics of DESIGN.md as one flat row."""
        hits, late, miss = (int(x) for x in self.accesses.sum(axis=0))
        total = hits + late + miss
        req = self.request_table()

        def stat(a: np.ndarray, fn: str) -> float:
            a = a[~np.isnan(a)]
            if not len(a):
                return float("nan")
            return float(np.mean(a)) if fn == "mean" else float(np.percentile(a, float(fn[1:])))

        by_reason: dict[str, int] = {"prefetch": 0, "on_demand": 0, "configure": 0}
        moved = n_moved = cancelled = unused = preempted = escalated = 0
        aborted = aborted_bytes = 0
        refused = sum(c.refused_at_start for c in caches)  # records cancelled, never moved
        for t in transfers:
            if t.cancelled:
                cancelled += 1
                continue
            n_moved += 1
            b = t.moved_bytes
            if t.aborted:
                aborted += 1
                aborted_bytes += b
            moved += b
            by_reason[t.reason] = by_reason.get(t.reason, 0) + b
            if t.reason == "prefetch" and not t.used:
                unused += b
            preempted += t.preemptions
            escalated += t.escalated
        return {
            "accesses": total,
            "hits": hits,
            "late": late,
            "misses": miss,
            "hit_rate": hits / total if total else float("nan"),
            "late_rate": late / total if total else float("nan"),
            "stall_s": self.stall_s if self.timing else float("nan"),
            "ttft_mean_s": stat(req["ttft_s"], "mean"),
            "ttft_p50_s": stat(req["ttft_s"], "p50"),
            "ttft_p99_s": stat(req["ttft_s"], "p99"),
            "tpot_mean_s": stat(req["tpot_s"], "mean"),
            "tpot_p50_s": stat(req["tpot_s"], "p50"),
            "tpot_p99_s": stat(req["tpot_s"], "p99"),
            "e2e_mean_s": stat(req["e2e_s"], "mean"),
            "e2e_p50_s": stat(req["e2e_s"], "p50"),
            "e2e_p99_s": stat(req["e2e_s"], "p99"),
            "shift_recovery_requests": self._shift_recovery(req),
            "prefill_tokens_per_s": (
                self.prefill_tokens / self.prefill_s
                if self.timing and self.prefill_s > 0
                else float("nan")
            ),
            "transfers": n_moved,
            "pcie_bytes": moved,
            "prefetch_bytes": by_reason["prefetch"],
            "on_demand_bytes": by_reason["on_demand"],
            "configure_bytes": by_reason["configure"],
            "wasted_bytes": sum(c.wasted_bytes for c in caches),
            "unused_prefetch_bytes": unused,
            "cancelled_transfers": cancelled - refused,
            "aborted_transfers": aborted,
            "aborted_bytes": aborted_bytes,
            "preemptions": preempted,
            "escalations": escalated,
            "prefetch_dropped": self.prefetch_dropped + refused,
            "evictions": sum(c.evictions for c in caches),
            "peak_expert_bytes": max((c.peak_bytes for c in caches), default=0),
            "requests": len(req["request_id"]),
            "iterations": self.iterations,
            "layer_steps": self.layer_steps,
        }
