"""The trace format: schema, streaming writer, validating reader, statistics, and
:func:`from_arrays` (routed-expert arrays from any logger as a trace)."""

from fmoesim.trace.reader import Trace, read_trace
from fmoesim.trace.schema import TraceManifest, TraceModel
from fmoesim.trace.table import from_arrays
from fmoesim.trace.writer import TraceWriter

__all__ = ["Trace", "TraceManifest", "TraceModel", "TraceWriter", "from_arrays", "read_trace"]
