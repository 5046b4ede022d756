"""Workload models: synthetic traces and request-arrival processes."""

from fmoesim.workload.synthetic import SyntheticConfig, SyntheticWorkload, generate, read_azure_csv

__all__ = ["SyntheticConfig", "SyntheticWorkload", "generate", "read_azure_csv"]
