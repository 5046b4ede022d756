"""The simulator against real systems' own logs (:mod:`fmoesim.validation.engine_log`)."""
