"""The real-hardware side of fmoesim (issue 8).

Built so far: the profiler (:mod:`replay.profile`, ``fmoesim-profile``).  Still to come:
the GpuBackend of the Runner and the validation report.  The simulator never imports
this package.
"""
