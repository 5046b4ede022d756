"""The run configuration as typed dataclasses registered in Hydra's ConfigStore.

A typo'd key or a wrong type fails at composition, before anything runs.  Values are
checked by :func:`fmoesim.config.build.build_run`, which names the bad key.  Configs
never do I/O.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from fmoesim.engine.serving import ServingConfig
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec
from fmoesim.workload.synthetic import SyntheticConfig

#: The repository root (a source checkout / editable install) and its ``conf/``.
PROJECT_ROOT = Path(__file__).resolve().parents[2]
CONF_DIR = Path(os.environ.get("FMOESIM_CONF_DIR", PROJECT_ROOT / "conf"))


def resolve_path(p: str | os.PathLike[str]) -> Path:
    """A path as given if it exists (absolute, or relative to the working directory),
    else relative to the project root (so bundled ``traces/default`` works anywhere)."""
    path = Path(p).expanduser()
    if path.is_absolute() or path.exists():
        return path
    alt = PROJECT_ROOT / path
    return alt if alt.exists() else path


@dataclass
class CacheConfig:
    """The GPU expert cache: its budget in GB (1e9 bytes) for routed experts, or
    ``experts_per_layer`` experts in a cache of their own per layer (MoEpic Table 1's
    setting; replaces ``budget_gb``).  ``release_after_use`` turns caching off: an expert
    leaves the GPU once used, and the budget only buffers transfers and prefetches
    (MoE-Infinity Tables 2-4).  ``preload`` is a GPU-Rich deployment: every expert is
    resident on its GPU from the start and nothing crosses the link (the budget per GPU
    must hold its share; MoE-Infinity Fig. 9's reference)."""

    budget_gb: float = 24.0
    experts_per_layer: int | None = None
    release_after_use: bool = False
    preload: bool = False


@dataclass
class WorkloadConfig:
    """Where the trace comes from: a trace directory, or the synthetic workload model
    (generated once for the chosen ``model`` and cached under ``traces/.cache/``)."""

    kind: str = "trace"  # "trace" | "synthetic"
    path: str | None = "traces/default"
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    #: the ``model=`` presets a synthetic workload's knobs were fitted (or chosen) for;
    #: another model is refused (empty: any model)
    fitted_to: list[str] = field(default_factory=list)


@dataclass
class EngineConfig:
    """The simulator backend: ``timing=False`` is the hit-rate-only mode (no time is reported;
    faster for the demand-only policies, which take a closed form there); ``preempt``
    lets on-demand loads pause a prefetch at a chunk boundary.  ``landing`` says when a
    prefetch becomes resident in hit-rate-only mode: ``link`` once its bytes have
    crossed the link during the modelled compute since it was issued
    (:class:`fmoesim.engine.sim.LinkStepBackend`), ``next_step`` at the next layer step
    whatever its size (an infinitely fast link: an upper bound for prefetching,
    :class:`fmoesim.engine.sim.InstantBackend`).  ``link_order`` is the timed link's
    queue: ``priority`` (on-demand loads first, then prefetches by the policy's
    priority; a needed prefetch is escalated) or ``fifo`` (one first-come-first-served
    queue for every transfer, no escalation, no pausing: a what-if for an engine that
    queues every copy in order, :class:`fmoesim.engine.sim.SimLink`).  ``reserve`` is
    when a prefetch takes its bytes of the budget (evicting to make room): ``submit``,
    when it is queued, or ``start``, when its copy starts (a prefetch cancelled while
    queued then evicts nothing, one that finds no room at its start is dropped, and one
    needed while queued is replaced by an on-demand load, as MoE-Infinity's public code
    does); on-demand loads reserve when queued either way (timed simulator only)."""

    timing: bool = True
    preempt: bool = True
    landing: str = "link"
    link_order: str = "priority"
    reserve: str = "submit"


@dataclass
class OutputConfig:
    """Where a run writes: ``<dir>/<name>/`` (summary.parquet, layers.parquet,
    transfers.parquet, config.yaml, hit_rate.png; accesses.parquet if ``access_log``).

    ``name`` is one directory name (no ``/``, ``\\`` or ``..``, not starting with
    ``.``); unset, it is made of the time, policy, model, budget and config hash.  A
    run never replaces another config's directory (see
    :func:`fmoesim.cli.main.check_run_dir`).  ``verbose``: print the full summary
    table of every run (``None``: of a single run, not of a sweep's runs, which print
    one line each; ``fmoesim -v`` sets it).
    """

    dir: str = "results/runs"
    name: str | None = None
    plot: bool = True
    write: bool = True
    access_log: bool = False
    verbose: bool | None = None


@dataclass
class StoreConfig:
    """The results store (:mod:`fmoesim.results.store`): every run adds its summary row
    to ``dir``; ``skip_done`` skips a run whose config is already there (``None``: only
    in sweeps, so that a single run always runs)."""

    enabled: bool = True
    dir: str = "results/store"
    skip_done: bool | None = None


@dataclass
class RunConfig:
    """Everything one simulation run needs."""

    model: ModelSpec = MISSING
    hardware: HardwareSpec = MISSING
    policy: Any = MISSING
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    store: StoreConfig = field(default_factory=StoreConfig)
    experiment_name: str | None = None  # set by conf/experiment/ presets (paper figures)
    seed: int = 0
    progress: bool = True


_registered = False


def register_configs() -> None:
    """Register the schemas in Hydra's ConfigStore (idempotent)."""
    global _registered
    if _registered:
        return
    cs = ConfigStore.instance()
    cs.store(name="fmoesim_schema", node=RunConfig)
    cs.store(group="model", name="model_schema", node=ModelSpec)
    cs.store(group="hardware", name="hardware_schema", node=HardwareSpec)
    cs.store(group="workload", name="workload_schema", node=WorkloadConfig)
    _registered = True
