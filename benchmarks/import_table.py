"""Route-table import (``fmoesim-trace import table``): time and memory of a large table.

Run ``python -m benchmarks.import_table`` (``--rows N``, default one million).  The table
is long (one row per routed expert, a llama.cpp-style logger's layout: ``turn, phase,
step, layer, slot, expert, weight``), Qwen3-30B-A3B shaped (48 layers x 128 experts,
top-8), one request, drawn from a seeded generator and written as CSV first (not timed).
Reported: the import's wall time and the peak resident memory of a fresh process that
runs it (Python, numpy and pandas loaded: the baseline is the same process importing a
ten-row table), against the size of the text and of the trace's counts in memory
(tokens x layers x experts int32).  The target: at most 30 s for one million rows.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks._cli import build_line, parser, positive_int

L, E, K = 48, 128, 8


def write_table(path: Path, rows: int, seed: int = 0) -> int:
    """Write about ``rows`` rows; returns the number written (whole tokens)."""
    rng = np.random.default_rng(seed)
    tokens = max(1, rows // (L * K))
    ids = np.argsort(rng.random((tokens, L, E)), axis=2)[:, :, :K]  # (T, L, K)
    step = np.repeat(np.arange(tokens), L * K)
    layer = np.tile(np.repeat(np.arange(L), K), tokens)
    slot = np.tile(np.arange(K), tokens * L)
    phase = (step >= 16).astype(np.int64)
    weight = np.round(rng.random(len(step)), 4)
    with path.open("w") as f:
        f.write("turn,phase,step,layer,slot,expert,weight\n")
        body = np.stack([np.zeros_like(step), phase, step, layer, slot, ids.reshape(-1)], axis=1)
        for row, w in zip(body.tolist(), weight.tolist(), strict=True):
            f.write(",".join(map(str, row)) + f",{w}\n")
    return len(step)


_CHILD = """
import resource, sys, time
from pathlib import Path
from fmoesim.config.build import load_preset
from fmoesim.specs import ModelSpec
from fmoesim.trace.table import import_table
model = load_preset("model", "qwen3-30b-a3b", ModelSpec)
t0 = time.perf_counter()
import_table(Path(sys.argv[1]), Path(sys.argv[2]), model)
wall = time.perf_counter() - t0
print(wall, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def _run(src: Path, dst: Path) -> tuple[float, float]:
    """(wall s, peak RSS MB) of an import in a fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(src), str(dst)], capture_output=True, text=True,
        check=True,
    )  # fmt: skip
    wall, rss = out.stdout.split()
    return float(wall), float(rss)


def main() -> None:
    """Print one Markdown table row."""
    ap = parser("python -m benchmarks.import_table", __doc__.splitlines()[0])
    ap.add_argument("--rows", type=positive_int, default=1_000_000, help="rows (1,000,000)")
    args = ap.parse_args()
    print(build_line())
    with tempfile.TemporaryDirectory() as tmp:
        small, src = Path(tmp) / "small.csv", Path(tmp) / "routes.csv"
        write_table(small, 10)
        n = write_table(src, args.rows)
        _, base_mb = _run(small, Path(tmp) / "small-trace")
        wall, peak_mb = _run(src, Path(tmp) / "trace")
        text_mb = src.stat().st_size / 1e6
        tokens = max(1, args.rows // (L * K))
        counts_mb = tokens * L * E * 4 / 1e6
    print("| rows | import s | text MB | trace counts MB | peak RSS MB (10-row import: base) |")
    print("|---|---|---|---|---|")
    print(
        f"| {n:,} | {wall:.1f} | {text_mb:.0f} | {counts_mb:.0f} "
        f"| {peak_mb:.0f} (base {base_mb:.0f}) |"
    )


if __name__ == "__main__":
    main()
