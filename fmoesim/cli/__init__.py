"""Command-line entry points: ``fmoesim`` (Hydra) and ``fmoesim-trace``."""
