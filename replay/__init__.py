"""The real-hardware side of fmoesim (issue 8).

Built so far: the profiler (:mod:`replay.profile`, ``fmoesim-profile``) and the CPU path
of the replay backend (:mod:`replay.backend`).  Still to come: its CUDA path (copy
stream, events, link scheduler) and the validation report.  The simulator never imports
this package.
"""
