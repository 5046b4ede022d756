"""The real-hardware backend of the Runner (GpuBackend, profiler, validation).

Not built yet: it arrives with issue 8. The simulator never imports this package.
"""
