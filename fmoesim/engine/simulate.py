"""One simulation run: trace + model + hardware + policy + budget -> metrics."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.metrics import Metrics
from fmoesim.engine.runner import Runner, ServingConfig
from fmoesim.engine.sim import SimBackend, TransferRecord
from fmoesim.errors import ConfigError
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.reader import Trace
from policies.base import Policy, PolicyContext

GB = 1e9


@dataclass
class RunResult:
    """What one run produced."""

    summary: dict[str, Any]
    metrics: Metrics
    transfers: list[TransferRecord] = field(default_factory=list)

    @property
    def hit_rate_per_layer(self) -> np.ndarray:
        """HIT / accesses per MoE layer."""
        return self.metrics.hit_rate_per_layer()


def check_shapes(trace: Trace, model: ModelSpec) -> None:
    """Refuse a trace whose shape differs from the model's."""
    tm = trace.manifest.model
    for key in ("num_layers", "num_experts", "top_k"):
        if getattr(tm, key) != getattr(model, key):
            raise ConfigError(
                f"model.{key}",
                getattr(model, key),
                f"trace {trace.path} has {key} = {getattr(tm, key)} "
                f"(model '{tm.name}'); pick the matching model= preset",
            )


def check_budget(model: ModelSpec, budget_bytes: int, key: str = "cache.budget_gb") -> None:
    """The budget must be positive and hold at least one layer's top-k experts."""
    if not budget_bytes > 0:
        raise ConfigError(key, budget_bytes / GB, "must be > 0")
    if budget_bytes < model.layer_topk_bytes:
        raise ConfigError(
            key,
            budget_bytes / GB,
            f"must hold one layer's top-{model.top_k} experts of {model.name} "
            f"({model.layer_topk_bytes / GB:.3f} GB)",
        )


def simulate(
    trace: Trace,
    model: ModelSpec,
    hardware: HardwareSpec,
    policy: Policy,
    budget_bytes: int,
    *,
    serving: ServingConfig | None = None,
    seed: int = 0,
    progress: bool = False,
) -> RunResult:
    """Simulate serving ``trace`` with ``policy`` under an expert budget of ``budget_bytes``."""
    model.validate()
    hardware.validate()
    check_shapes(trace, model)
    check_budget(model, budget_bytes)
    serving = serving or ServingConfig()
    if serving.batch_size < 1:
        raise ConfigError("serving.batch_size", serving.batch_size, "must be >= 1")
    rng = np.random.default_rng(seed)
    policy.reset(
        PolicyContext(
            model=model,
            budget_bytes=int(budget_bytes),
            expert_size_bytes=model.expert_size_bytes,
            rng=rng,
        )
    )
    cache = ExpertCache(int(budget_bytes), policy)
    metrics = Metrics(trace.num_layers)
    backend = SimBackend(hardware, ComputeModel.from_specs(model, hardware), cache)
    runner = Runner(trace, model, policy, cache, metrics, serving)
    n_req = sum(len(b) for b in runner.batches())
    total_iters = int(trace.output_tokens[:n_req].sum())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total_iters, unit="it", desc=f"simulate {policy.name}", delay=2.0, leave=False
        )
        runner.on_iteration = bar.update
    t0 = time.perf_counter()
    try:
        sim_s = backend.run(runner.run())
    finally:
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    s = metrics.summary()
    s.update(
        {
            "policy": policy.name,
            "model": model.name,
            "hardware": hardware.name,
            "budget_gb": budget_bytes / GB,
            "batch_size": serving.batch_size,
            "seed": seed,
            "expert_size_bytes": model.expert_size_bytes,
            "budget_experts": int(budget_bytes // model.expert_size_bytes),
            "wasted_bytes": cache.wasted_bytes,
            "evictions": cache.evictions,
            "peak_expert_bytes": cache.peak_bytes,
            "simulated_s": sim_s,
            "gpu_busy_s": backend.busy_compute_s,
            "wall_s": wall,
            "speedup_vs_real": sim_s / wall if wall > 0 else float("inf"),
        }
    )
    return RunResult(summary=s, metrics=metrics, transfers=backend.link.log)
