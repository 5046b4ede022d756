"""fmoesim: a trace-driven simulator of Mixture-of-Experts expert offloading.

Three parts share one trace format (:mod:`fmoesim.trace`): a collector that records
gate distributions of real models, a discrete-event simulator (:mod:`fmoesim.engine`)
that evaluates pluggable offloading policies (:mod:`policies`), and a replayer
(:mod:`replay`) that runs the same policy on a real GPU.  ``import fmoesim`` never
imports torch.
"""

__version__ = "0.1.0"

from fmoesim._compiled import check_fresh
from fmoesim.errors import ConfigError, FmoesimError, TraceError

check_fresh()  # an optional compiled build must match its sources (fmoesim/_compiled.py)

__all__ = ["ConfigError", "FmoesimError", "TraceError", "__version__"]
