"""How requests are served: static batches or online (continuous) batching with arrivals."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from fmoesim.errors import ConfigError


@dataclass
class ServingConfig:
    """The serving scheduler.

    ``mode="static"``: requests, in trace order, are grouped into batches of
    ``batch_size``; a batch runs its prefill, then decode iterations until its longest
    request finishes (a finished request leaves the batch); batches run back to back
    from time 0 and latencies are measured from the start of a request's batch
    (service latency, as an offline benchmark reports it).

    ``mode="online"``: requests arrive at their arrival times (``arrivals``: ``"trace"``
    = the trace's ``arrival_s``; ``"poisson"`` = a Poisson process of ``rate_rps``
    drawn from the run's seed; ``"gamma"`` = a renewal process whose gaps are gamma
    distributed with mean ``1 / rate_rps`` and coefficient of variation ``arrival_cv``
    (1: as bursty as Poisson arrivals; above 1, burstier), drawn from the run's seed;
    ``"csv"`` = the times of the arrival log ``arrivals_csv``, in order, relative to its
    first row: an Azure-format CSV, ISO 8601 date-times or numbers of seconds, or a
    Mooncake ``.jsonl`` trace, milliseconds,
    :func:`fmoesim.workload.synthetic.read_arrivals`) and wait in a FCFS
    queue.  At each iteration boundary the scheduler admits queued requests that have
    arrived while fewer than ``max_batch_size`` are running and runs their prefill as one
    iteration (prefill-first, like vLLM's default); otherwise it runs one decode
    iteration of all running requests, which needs the union of their experts.
    Latencies are measured from arrival, so they include queueing.

    ``held_in_fraction``: that share of the trace's requests (drawn with the run's seed)
    is not served but handed to the policy's ``learn`` before serving starts (the
    "offline" mode of MoE-Infinity §7 and fMoE §6.1's 7:3 split); the rest are served in
    trace order, and ``max_requests`` caps those.
    """

    mode: str = "static"
    batch_size: int = 1
    max_batch_size: int = 8
    max_requests: int | None = None
    arrivals: str = "trace"
    rate_rps: float = 1.0
    arrival_cv: float = 1.0
    arrivals_csv: str | None = None
    held_in_fraction: float = 0.0

    def validate(self, prefix: str = "serving") -> ServingConfig:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""
        if self.mode not in ("static", "online"):
            raise ConfigError(f"{prefix}.mode", self.mode, "must be 'static' or 'online'")
        for key in ("batch_size", "max_batch_size"):
            v = getattr(self, key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"{prefix}.{key}", v, "must be an integer >= 1")
        if self.max_requests is not None and (
            not isinstance(self.max_requests, int) or self.max_requests < 1
        ):
            raise ConfigError(f"{prefix}.max_requests", self.max_requests, "must be >= 1 or null")
        f = self.held_in_fraction
        if not (isinstance(f, (int, float)) and not isinstance(f, bool) and 0 <= f < 1):
            raise ConfigError(f"{prefix}.held_in_fraction", f, "must be a number in [0, 1)")
        if self.arrivals not in ("trace", "poisson", "gamma", "csv"):
            raise ConfigError(
                f"{prefix}.arrivals", self.arrivals, "must be 'trace', 'poisson', 'gamma' or 'csv'"
            )
        cv = self.arrival_cv
        if not (isinstance(cv, (int, float)) and not isinstance(cv, bool) and math.isfinite(cv)):
            raise ConfigError(f"{prefix}.arrival_cv", cv, "must be a finite number")
        if cv <= 0:
            raise ConfigError(f"{prefix}.arrival_cv", cv, "must be > 0")
        if cv != 1 and not (self.mode == "online" and self.arrivals == "gamma"):
            raise ConfigError(
                f"{prefix}.arrival_cv",
                cv,
                "is read with gamma arrivals only (serving.mode=online serving.arrivals=gamma)",
            )
        if self.mode == "static":  # static batching serves from time 0: no arrivals
            why = "is read in online serving only (serving.mode=online)"
            if self.arrivals != "trace":
                raise ConfigError(f"{prefix}.arrivals", self.arrivals, why)
            if self.arrivals_csv is not None:
                raise ConfigError(f"{prefix}.arrivals_csv", self.arrivals_csv, why)
        if self.mode == "online" and self.arrivals in ("poisson", "gamma"):
            if not (isinstance(self.rate_rps, (int, float)) and math.isfinite(self.rate_rps)):
                raise ConfigError(f"{prefix}.rate_rps", self.rate_rps, "must be a finite number")
            if self.rate_rps <= 0:
                raise ConfigError(f"{prefix}.rate_rps", self.rate_rps, "must be > 0")
        if self.mode == "online" and self.arrivals == "csv" and not self.arrivals_csv:
            raise ConfigError(
                f"{prefix}.arrivals_csv",
                self.arrivals_csv,
                "a CSV path is required with arrivals=csv",
            )
        return self


def split_requests(
    num_requests: int, serving: ServingConfig, rng: np.random.Generator
) -> tuple[list[int], list[int]]:
    """``(served, held_in)`` request positions, each in trace order.

    ``round(held_in_fraction * num_requests)`` positions drawn without replacement from
    ``rng`` are held in; ``max_requests`` then keeps the first of the others.  At least
    one request is always served.
    """
    n_held = min(round(serving.held_in_fraction * num_requests), num_requests - 1)
    held = np.zeros(num_requests, dtype=bool)
    if n_held > 0:
        held[rng.choice(num_requests, size=n_held, replace=False)] = True
    served = np.flatnonzero(~held).tolist()
    if serving.max_requests is not None:
        served = served[: serving.max_requests]
    return served, np.flatnonzero(held).tolist()


def static_batches(served: Sequence[int], batch_size: int) -> list[list[int]]:
    """The request positions ``served`` grouped, in order, into batches of ``batch_size``."""
    return [list(served[i : i + batch_size]) for i in range(0, len(served), batch_size)]


def arrival_times_s(
    serving: ServingConfig,
    trace_arrival_s: np.ndarray,
    served: Sequence[int] | int,
    rng: np.random.Generator,
    trace_path: object = "trace",
) -> np.ndarray:
    """Arrival time (s) of each served request (positions ``served``, or the first
    ``served`` for an int) in online mode, in the order of ``served``.

    ``"trace"`` reads the served requests' own arrivals; ``"poisson"``, ``"gamma"`` and ``"csv"``
    give the i-th served request the i-th time.  Reads the CSV for ``arrivals="csv"``
    (the only I/O here).  Raises a one-line error naming the file or key when the
    source cannot cover every request.
    """
    pos = list(range(served)) if isinstance(served, int) else list(served)
    num_requests = len(pos)
    if serving.arrivals == "trace":
        a = np.asarray(trace_arrival_s, dtype=np.float64)[pos]
        bad = np.flatnonzero(np.isnan(a))
        if len(bad):
            raise ConfigError(
                "serving.arrivals",
                "trace",
                f"{trace_path}/requests.parquet row {pos[int(bad[0])]} has a null arrival_s; "
                "use serving.arrivals=poisson or csv",
            )
        return a
    if serving.arrivals == "poisson":
        gaps = rng.exponential(1.0 / serving.rate_rps, size=num_requests)
        return np.cumsum(gaps) - gaps[0]  # the first request arrives at 0
    if serving.arrivals == "gamma":
        shape = 1.0 / serving.arrival_cv**2  # a gamma's CV is 1 / sqrt(shape)
        gaps = rng.gamma(shape, 1.0 / (serving.rate_rps * shape), size=num_requests)
        return np.cumsum(gaps) - gaps[0]
    from fmoesim.workload.synthetic import read_arrivals

    assert serving.arrivals_csv is not None
    lengths = read_arrivals(serving.arrivals_csv)
    assert lengths.arrival_s is not None
    if len(lengths.arrival_s) < num_requests:
        raise ConfigError(
            "serving.arrivals_csv",
            serving.arrivals_csv,
            f"has {len(lengths.arrival_s)} rows but {num_requests} requests are served",
        )
    return np.asarray(lengths.arrival_s[:num_requests], dtype=np.float64)
