"""Arrival logs: what one says of its traffic (:func:`arrival_summary`), a random sample
of one (:func:`sample_arrivals`), and a stand-in for a real one that the project may not
ship (:func:`write_azure_conv_sample`).

fMoE §6.3 drives its online experiment with "64 requests randomly sampled" from the Azure
LLM inference traces, each request with the input and output lengths its row gives. The
traces are public (Azure/AzurePublicDataset, CC-BY-4.0) but not in this repository, so
:func:`write_azure_conv_sample` writes an Azure-format CSV of the same shape from
statistics of the 2023 conversation trace (``AzureLLMInferenceTrace_conv.csv``: 19,366
requests between 2023-11-16 18:15 and about 19:14 UTC), measured once and quoted below:

- lengths: 31 percentiles of ``ContextTokens`` and ``GeneratedTokens`` (every 5th, and
  finer in both tails; numpy's linear percentiles of the whole file, rounded); a request
  draws each length independently (their logarithms correlate at 0.09 in the file) by
  inverse transform, interpolating log-lengths between the percentiles;
- arrival times: ``n`` requests drawn at random from a trace whose arrivals spread
  evenly over its 3,501.7 s (its gaps' coefficient of variation is 1.09, near a Poisson
  process's 1) arrive at ``n`` uniform times over that span, sorted, counted from the
  first.

It is not the trace: the numbers of one request are not a real request's, and the
lengths' joint law is assumed independent. To use the real file, draw the requests from
it (:func:`sample_arrivals`, ``fmoesim-trace arrivals FILE --sample 64 --out OUT``) and
pass ``OUT`` with ``arrivals_csv=``.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import numpy as np

#: the percentiles (in %) the tables below give, finer in both tails
PERCENTILES = (
    0, 1, 2, 3, 4, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 55, 60, 65, 70, 75, 80, 85, 90,
    95, 96, 97, 98, 99, 99.5, 99.9, 100,
)  # fmt: skip
#: AzureLLMInferenceTrace_conv.csv (2023): ContextTokens at :data:`PERCENTILES`
CONV_PROMPT_TOKENS = (
    2, 29, 91, 161, 181, 181, 207, 372, 387, 396, 403, 414, 703, 984, 1020, 1045, 1071,
    1097, 1130, 1189, 1315, 1876, 2734, 4083, 4086, 4090, 4098, 4142, 4831, 6179, 14050,
)  # fmt: skip
#: the same for GeneratedTokens
CONV_OUTPUT_TOKENS = (
    7, 16, 24, 32, 38, 41, 54, 67, 77, 85, 91, 96, 103, 113, 129, 151, 177, 217, 384, 395,
    400, 411, 424, 451, 468, 509, 540, 601, 643, 954, 1000,
)  # fmt: skip
#: seconds from the file's first request to its last
CONV_SPAN_S = 3501.721937


def _azure_csv(times_s: np.ndarray, prompt: np.ndarray, output: np.ndarray, places: int) -> str:
    """Azure-format CSV text of requests arriving at ``times_s`` ``(n,)`` (seconds, to
    ``places`` decimals) with lengths ``prompt`` and ``output`` ``(n,)``."""
    rows = [f"{t:.{places}f},{p},{o}" for t, p, o in zip(times_s, prompt, output, strict=True)]
    return "TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n"


def _draw(lengths: tuple[int, ...], u: np.ndarray) -> np.ndarray:
    """Lengths ``(n,)`` at the uniform draws ``u`` ``(n,)``: log-lengths interpolated
    between ``lengths`` at :data:`PERCENTILES`, rounded to whole tokens."""
    q = np.asarray(PERCENTILES, dtype=np.float64) / 100.0  # (31,)
    log_len = np.interp(u, q, np.log(np.asarray(lengths, dtype=np.float64)))
    return np.rint(np.exp(log_len)).astype(np.int64)


def azure_conv_sample(num_requests: int = 64, seed: int = 0) -> str:
    """The CSV text (``TIMESTAMP,ContextTokens,GeneratedTokens``, seconds) of
    ``num_requests`` requests drawn as the module docstring says, from ``seed``."""
    if not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests = {num_requests!r} (rule: an integer >= 1)")
    rng = np.random.default_rng(seed)
    times = np.sort(rng.uniform(0.0, CONV_SPAN_S, num_requests))  # (n,)
    times -= times[0]
    prompt = _draw(CONV_PROMPT_TOKENS, rng.uniform(size=num_requests))
    output = _draw(CONV_OUTPUT_TOKENS, rng.uniform(size=num_requests))
    return _azure_csv(times, prompt, output, places=3)


def write_azure_conv_sample(
    path: str | os.PathLike[str], num_requests: int = 64, seed: int = 0
) -> Path:
    """Write :func:`azure_conv_sample` to ``path`` (atomically), unless the file holds
    those bytes already; return the path."""
    from fmoesim.atomic import atomic_file

    p = Path(path)
    text = azure_conv_sample(num_requests, seed)
    if not (p.is_file() and p.read_text() == text):
        with atomic_file(p) as tmp:
            tmp.write_text(text)
    return p


def arrival_summary(
    prompt: np.ndarray, output: np.ndarray, arrival_s: np.ndarray
) -> dict[str, Any]:
    """What an arrival log says of its traffic, from its requests' prompt and output
    lengths ``(n,)`` and arrival times ``(n,)`` (seconds, sorted): ``requests``,
    ``span_s`` (first to last arrival), ``rate_rps`` (``(n - 1) / span_s``), the gaps'
    ``gap_mean_s`` and coefficient of variation ``gap_cv`` (NaN where there are no gaps
    or no time between them), and per length (``prompt``, ``output``) its ``mean``, ``p50``,
    ``p90``, ``p99`` and ``max``.  ``rate_rps`` and ``gap_cv`` are the two knobs of gamma
    arrivals (``serving.arrivals=gamma``) that follow the log's rate and burstiness."""
    n = len(arrival_s)
    gaps = np.diff(arrival_s)  # (n - 1,)
    span = float(arrival_s[-1] - arrival_s[0]) if n else 0.0
    mean_gap = float(gaps.mean()) if len(gaps) else math.nan
    out: dict[str, Any] = {
        "requests": n,
        "span_s": span,
        "rate_rps": (n - 1) / span if span > 0 else math.nan,
        "gap_mean_s": mean_gap,
        "gap_cv": float(gaps.std() / mean_gap) if len(gaps) > 1 and mean_gap > 0 else math.nan,
    }
    for name, v in (("prompt", prompt), ("output", output)):
        p50, p90, p99 = np.percentile(v, [50, 90, 99])
        out[name] = {
            "mean": float(v.mean()),
            "p50": float(p50),
            "p90": float(p90),
            "p99": float(p99),
            "max": int(v.max()),
        }
    return out


def sample_arrivals(
    prompt: np.ndarray, output: np.ndarray, arrival_s: np.ndarray, n: int, seed: int = 0
) -> str:
    """The Azure-format CSV text (``TIMESTAMP`` in seconds from the first drawn request,
    to the microsecond) of ``n`` requests drawn at random without replacement from a log's
    prompt and output lengths ``(N,)`` and arrival times ``(N,)``, kept in time order (fMoE
    §6.3 samples its 64 requests from the Azure traces "randomly"; that they keep their
    order in time is assumed here)."""
    total = len(arrival_s)
    if not isinstance(n, int) or not 1 <= n <= total:
        raise ValueError(f"n = {n!r} (rule: an integer from 1 to the log's {total} requests)")
    idx = np.sort(np.random.default_rng(seed).choice(total, size=n, replace=False))  # (n,)
    return _azure_csv(arrival_s[idx] - arrival_s[idx[0]], prompt[idx], output[idx], places=6)
