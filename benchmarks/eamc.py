"""EAMC query cost (MoE-Infinity §6 "Trace query cost"), one core.

Run ``python -m benchmarks.eamc``.  Mixtral shape (32 layers x 8 experts).  The
collection holds random request-level EAMs (Poisson counts); a query is what the policy
does at one gate: add the layer's counts to the running match and rank the collection
(:class:`policies.moe_infinity.EAMCQuery`), averaged over the 32 gates of an iteration.
The paper measures 21 us per query at 1K EAMs and 226 us at 10K; the target here
is at most 21 us at 1K and at most 100 us at 10K.  "full" is the non-incremental
reference (:meth:`EAMC.similarity` over all observed layers at every gate).
"""

from __future__ import annotations

import time

import numpy as np

from benchmarks._cli import build_line, parser, positive_int
from policies.moe_infinity import EAMC

L, E = 32, 8


def _filled(capacity: int, rng: np.random.Generator) -> EAMC:
    c = EAMC(capacity, L, E)
    for _ in range(capacity):
        c.add(rng.poisson(rng.uniform(0.1, 20.0, size=(L, E))))
    return c


def per_query_us(c: EAMC, iters: np.ndarray, k: int, repeat: int) -> tuple[float, float]:
    """(incremental, full) microseconds per gate, best of ``repeat``."""
    best_inc = best_full = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for it in iters:
            q = c.query()
            for layer in range(L):
                q.observe(layer, it[layer])
                q.top(k)
        best_inc = min(best_inc, (time.perf_counter() - t0) / (len(iters) * L))
        t0 = time.perf_counter()
        for it in iters[:4]:
            for layer in range(L):
                c.similarity(it[: layer + 1])
        best_full = min(best_full, (time.perf_counter() - t0) / (4 * L))
    return best_inc * 1e6, best_full * 1e6


def main() -> None:
    """Print the table for the README."""
    ap = parser("python -m benchmarks.eamc", __doc__.splitlines()[0])
    ap.add_argument("--repeat", type=positive_int, default=3, help="timings of each (3)")
    args = ap.parse_args()
    print(build_line())
    rng = np.random.default_rng(0)
    iters = rng.multinomial(2, np.full(E, 1 / E), size=(20, L))  # (20, L, E) decode tokens
    print("| EAMs | matched (k) | us / query (incremental) | us / query (full recompute) |")
    print("|---|---|---|---|")
    for cap in (1000, 10000):
        c = _filled(cap, rng)
        for k in (1, 4):
            inc, full = per_query_us(c, iters, k, args.repeat)
            print(f"| {cap:,} | {k} | {inc:.1f} | {full:.0f} |")


if __name__ == "__main__":
    main()
