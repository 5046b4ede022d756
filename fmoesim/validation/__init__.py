"""The simulator against real systems' own logs (:mod:`fmoesim.validation.engine_log`),
and the workload model's policy comparisons against real routing
(:mod:`fmoesim.validation.real_routing`)."""
