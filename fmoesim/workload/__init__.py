"""Workload models: synthetic traces and request-arrival processes."""

from fmoesim.workload.synthetic import (
    SyntheticConfig,
    SyntheticWorkload,
    generate,
    read_arrivals,
    read_azure_csv,
    read_mooncake_jsonl,
)

__all__ = [
    "SyntheticConfig",
    "SyntheticWorkload",
    "generate",
    "read_arrivals",
    "read_azure_csv",
    "read_mooncake_jsonl",
]
