"""fmoesim: a trace-driven simulator of Mixture-of-Experts expert offloading.

Three parts share one trace format (:mod:`fmoesim.trace`): a collector that records
gate distributions of real models, a discrete-event simulator (:mod:`fmoesim.engine`)
that evaluates pluggable offloading policies (:mod:`policies`), and a replayer
(:mod:`replay`) that runs the same policy on a real GPU.  ``import fmoesim`` never
imports torch.
"""

__version__ = "0.1.0"

from fmoesim._compiled import StaleBuildError, check_fresh
from fmoesim.errors import ConfigError, FmoesimError, TraceError

try:  # an optional compiled build must match its sources (fmoesim/_compiled.py)
    check_fresh()
except StaleBuildError as exc:  # one line naming the file and exit status 2, as every
    import sys  # command's bad input (fmoesim.errors), not an import traceback

    print(f"fmoesim: error: {exc}", file=sys.stderr)
    raise SystemExit(2) from None

__all__ = ["ConfigError", "FmoesimError", "TraceError", "__version__"]
