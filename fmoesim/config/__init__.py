"""Typed run configuration (Hydra structured configs) and where the config files live."""

from fmoesim.config.schema import (
    CONF_DIR,
    PROJECT_ROOT,
    CacheConfig,
    OutputConfig,
    RunConfig,
    WorkloadConfig,
    register_configs,
    resolve_path,
)

__all__ = [
    "CONF_DIR",
    "PROJECT_ROOT",
    "CacheConfig",
    "OutputConfig",
    "RunConfig",
    "WorkloadConfig",
    "register_configs",
    "resolve_path",
]
