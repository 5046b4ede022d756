"""Benchmarks: speed and memory targets live here, never in timed unit tests.

Importing the package limits the BLAS and OpenMP libraries behind numpy to one thread
(unless the environment already says otherwise), before numpy loads: a matrix-vector
product of a matcher otherwise spreads over every core and, on a shared machine, its
wall time varies a hundredfold from run to run."""

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")
