"""The real-hardware side of fmoesim: the profiler (:mod:`replay.profile`,
``fmoesim-profile``), the replay backend (:mod:`replay.backend`, with its link scheduler
in :mod:`replay.link` and expert weights in :mod:`replay.weights`) and the validation
report (:mod:`replay.validate`, ``fmoesim-validate``).  The simulator never imports this
package.
"""
