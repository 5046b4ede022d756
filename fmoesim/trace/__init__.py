"""The trace format: schema, streaming writer, validating reader, statistics."""

from fmoesim.trace.reader import Trace, read_trace
from fmoesim.trace.schema import TraceManifest, TraceModel
from fmoesim.trace.writer import TraceWriter

__all__ = ["Trace", "TraceManifest", "TraceModel", "TraceWriter", "read_trace"]
