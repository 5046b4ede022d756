"""The results store (one Parquet row per run, keyed by its config hash), the hit-rate
regression guard, and the paper figures built from the store."""

from fmoesim.results.store import ResultsStore, config_key, load_results

__all__ = ["ResultsStore", "config_key", "load_results"]
