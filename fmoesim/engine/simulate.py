"""One simulation run: trace + model + hardware + policy + budget -> metrics."""

from __future__ import annotations

import dataclasses
import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from fmoesim.engine.backend import Backend, TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.fast import NotApplicable, lru_hit_only
from fmoesim.engine.host import HostBoundSimBackend, HostModel
from fmoesim.engine.metrics import Metrics, blank_times
from fmoesim.engine.runner import Runner, closed_form_applies
from fmoesim.engine.serving import (
    ServingConfig,
    arrival_times_s,
    split_requests,
    static_batches,
)
from fmoesim.engine.sim import InstantBackend, LinkStepBackend, SimBackend
from fmoesim.errors import ConfigError
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.reader import Trace
from fmoesim.trace.schema import TraceManifest
from policies.base import FutureAccesses, LayerTimes, Policy, PolicyContext, RequestTrace
from policies.lru import LRU

GB = 1e9
#: ``engine.landing``: when a prefetch becomes resident in hit-rate-only mode
LANDINGS = ("link", "next_step")
#: ``engine.link_order``: the timed link's queue discipline (:class:`SimLink`)
LINK_ORDERS = ("priority", "fifo")
#: ``engine.reserve``: when a prefetch reserves its bytes (queued, or its copy started)
RESERVES = ("submit", "start")


@dataclass
class RunResult:
    """What one run produced."""

    summary: dict[str, Any]
    metrics: Metrics
    transfers: list[TransferRecord] = field(default_factory=list)
    accesses: dict[str, np.ndarray] | None = None  # the per-access log, if asked for
    caches: list[ExpertCache] = field(default_factory=list)
    policy_log: dict[str, np.ndarray] | None = None  # the policy's own table (Policy.report)

    def transfer_table(self) -> dict[str, np.ndarray]:
        """The transfer log as columns (:func:`transfer_table`); its times (``*_s``) are
        NaN in a hit-rate-only run, which has no clock."""
        return transfer_table(self.transfers, self.metrics.timing)

    @property
    def hit_rate_per_layer(self) -> np.ndarray:
        """HIT / accesses per MoE layer."""
        return self.metrics.hit_rate_per_layer()


#: the columns of a transfer log (:func:`transfer_table`), one per TransferRecord field
TRANSFER_COLUMNS = (
    "key", "gpu", "size_bytes", "reason", "priority", "submit_s", "release_s", "start_s",
    "end_s", "used", "escalated", "preemptions", "cancelled", "aborted", "moved_bytes",
)  # fmt: skip


def transfer_table(transfers: list[TransferRecord], timed: bool = True) -> dict[str, np.ndarray]:
    """A transfer log as columns (:data:`TRANSFER_COLUMNS`, one row per transfer, in
    submission order); the times (``*_s``) NaN unless ``timed``."""
    return {
        c: np.array([getattr(t, c) for t in transfers])
        if timed or not c.endswith("_s")
        else np.full(len(transfers), np.nan)
        for c in TRANSFER_COLUMNS
    }


def check_shapes(trace: Trace, model: ModelSpec) -> None:
    """Refuse a trace whose shape differs from the model's."""
    check_manifest_shape(trace.manifest, trace.path, model)


def check_manifest_shape(manifest: TraceManifest, path: Any, model: ModelSpec) -> None:
    """Refuse a trace (its manifest, read from ``path``) whose shape differs from the
    model's."""
    from fmoesim.config.build import is_plain_name, load_preset, preset_names

    tm = manifest.model
    keys = ("num_layers", "num_experts", "top_k", "encoder_layers")
    wrong = [k for k in keys if getattr(tm, k, 0) != getattr(model, k)]
    if not wrong:
        return
    key, value = wrong[0], getattr(tm, wrong[0], 0)
    # its name too (the last part of a path or hub id), where no preset has it: a run's
    # results then name the trace's model, not the preset whose shape was changed
    name = str(tm.name).replace("\\", "/").rstrip("/").rsplit("/", 1)[-1]
    renamed = [] if tm.name in preset_names("model") or not is_plain_name(name) else [name]
    fix = "pick a model= preset of its shape, or set " + " ".join(
        [*(f"model.name={n}" for n in renamed if n != model.name)]
        + [f"model.{k}={getattr(tm, k, 0)}" for k in wrong]
    )
    if tm.name != model.name and tm.name in preset_names("model"):
        named = load_preset("model", tm.name, ModelSpec)
        if all(getattr(named, k) == getattr(tm, k, 0) for k in keys):
            fix = f"model={tm.name} matches it"
    raise ConfigError(
        f"model.{key}",
        getattr(model, key),
        f"trace {path} has {key} = {value} (model '{tm.name}'); {fix}",
    )


def model_for_trace(model: ModelSpec, trace: Trace) -> ModelSpec:
    """``model`` with the trace's per-layer expert sizes (``source.expert_bytes_by_layer``,
    which an import of a log that records them writes) when the model gives none."""
    sizes = trace.manifest.source.get("expert_bytes_by_layer")
    if model.expert_size_bytes_by_layer is not None or not sizes:
        return model
    out = dataclasses.replace(model, expert_size_bytes_by_layer=[int(b) for b in sizes])
    try:
        return out.validate()
    except ConfigError as exc:
        raise ConfigError(
            "model.expert_size_bytes_by_layer", sizes, f"from trace {trace.path}: {exc.rule}"
        ) from None


#: the largest budget: byte counts are int64 in the results (about 9.2e9 GB)
MAX_BUDGET_BYTES = 2**63 - 1


def _check_link_what_if(
    key: str,
    value: str,
    allowed: tuple[str, ...],
    timing: bool,
    replay: bool,
    untimed: str,
    replayed: str,
) -> None:
    """Refuse ``value`` of config key ``key`` outside ``allowed``, and any but the first
    (the default) where no timed simulated link runs: in hit-rate-only mode (``untimed``
    says why) and in the GPU replay (``replayed``)."""
    if value not in allowed:
        raise ConfigError(key, value, f"must be one of {', '.join(allowed)}")
    if value != allowed[0] and not timing:
        why = f"needs the timed simulator (engine.timing=true): hit-rate-only mode {untimed}"
        raise ConfigError(key, value, why)
    if value != allowed[0] and replay:
        raise ConfigError(key, value, f"is the simulator's what-if; the replay {replayed}")


def check_link_order(link_order: str, timing: bool, replay: bool = False) -> None:
    """Refuse an unknown ``engine.link_order``, and ``fifo`` where no timed simulated link
    runs: hit-rate-only mode keeps its own order (:class:`LinkStepBackend`) and the GPU
    replay its scheduler's."""
    _check_link_what_if(
        "engine.link_order", link_order, LINK_ORDERS, timing, replay,
        "keeps its own", "keeps its scheduler's order",
    )  # fmt: skip


def check_reserve(reserve: str, timing: bool, replay: bool = False) -> None:
    """Refuse an unknown ``engine.reserve``, and ``start`` where no timed simulated link
    runs (the link reserves a prefetch's bytes when it starts the copy)."""
    _check_link_what_if(
        "engine.reserve", reserve, RESERVES, timing, replay,
        "starts no copy", "reserves as its backend does",
    )  # fmt: skip


def _check_reserve_run(
    reserve: str,
    policy: Policy,
    model: ModelSpec,
    hardware: HardwareSpec,
    caches: list[ExpertCache],
) -> None:
    """Refuse ``engine.reserve=start`` for what it does not model: budget groups (split
    experts, per-layer caches), several lanes or slices on a link, a host that issues
    copies ahead (measured host costs), and a policy whose layers wait for their
    prefetches to land (a refused one would never land)."""
    if reserve != "start":
        return
    why = ""
    if any(c.group_of is not None for c in caches):
        why = "does not model budget groups (split experts, cache.experts_per_layer)"
    elif hardware.link_lanes > 1 or hardware.transfer_slices > 1:
        why = "does not model a link of several lanes or slices (hardware.link_lanes)"
    elif HostModel.from_specs(model, hardware, policy.name) is not None:
        why = f"does not model the host costs that {hardware.name} measured for {model.name}"
    elif policy.waits_for_prefetches():
        why = f"does not model {policy.name}, whose layers wait for their prefetches to land"
    if why:
        raise ConfigError("engine.reserve", reserve, why)


def check_budget(
    model: ModelSpec, budget_bytes: int, key: str = "cache.budget_gb", num_gpus: int = 1
) -> None:
    """The budget (one GPU's) must be a positive whole number of bytes that fits in int64
    and hold the experts one GPU computes for a token in a layer: the layer's top-k on one
    GPU, at most ``ceil(E / num_gpus)`` of them on several (expert ``e`` on GPU ``e mod
    num_gpus``).  A budget above the model's experts is allowed: every expert fits."""
    if isinstance(budget_bytes, float) and not math.isfinite(budget_bytes):
        raise ConfigError(key, budget_bytes / GB, "must be a finite number")
    if not budget_bytes > 0:
        raise ConfigError(key, budget_bytes / GB, "must be > 0")
    if budget_bytes > MAX_BUDGET_BYTES:
        whole = model.total_expert_bytes
        raise ConfigError(
            key,
            budget_bytes / GB,
            f"must be at most {MAX_BUDGET_BYTES / GB:.3g} GB (bytes are counted in int64); "
            f"every expert of {model.name} fits in {whole / GB:.4g} GB",
        )
    floor_bytes = model.gpu_topk_bytes(num_gpus)
    if budget_bytes < floor_bytes:
        n = model.gpu_topk_experts(num_gpus)
        where = (
            f"one layer's top-{model.top_k} experts of {model.name}"
            if num_gpus == 1
            else f"the {n} expert{'s' if n > 1 else ''} of {model.name} that one of {num_gpus}"
            " GPUs computes in a token's layer step"
        )
        raise ConfigError(key, budget_bytes / GB, f"must hold {where} ({floor_bytes / GB:.3f} GB)")


def check_experts_per_layer(model: ModelSpec, hardware: HardwareSpec, C: object) -> None:
    """A cache per layer holds 1..E experts, on one GPU (fewer than top_k is allowed:
    the calibration's hit curves start at one expert per layer, traces/calibration.md)."""
    if not isinstance(C, int) or not 1 <= C <= model.num_experts:
        raise ConfigError("cache.experts_per_layer", C, f"must be in [1, {model.num_experts}]")
    if hardware.num_gpus != 1:
        raise ConfigError("cache.experts_per_layer", C, "needs hardware.num_gpus=1")


def future_accesses(
    trace: Trace,
    batches: list[list[int]],
    iter_start: np.ndarray,
    output_tokens: np.ndarray,
    encoder_layers: int = 0,
) -> FutureAccesses:
    """The access sequence of static batching, step by step (for ``uses_future`` policies).

    A step is a layer an iteration runs: every layer at prefill, and after it the layers
    from ``encoder_layers`` on (an encoder-decoder model's decoder)."""
    E, L, n_enc = trace.num_experts, trace.num_layers, encoder_layers
    if all(len(b) == 1 for b in batches):
        # perf: one request per batch: the steps are the served rows' layers, in order
        pos = np.array([b[0] for b in batches], dtype=np.int64)
        lens = output_tokens[pos].astype(np.int64)
        starts = iter_start[pos].astype(np.int64)
        # row indices of every served request's iterations, request after request
        rows = np.repeat(starts - np.cumsum(lens) + lens, lens) + np.arange(lens.sum())
        counts = trace.counts[rows]  # (rows, L, E)
        if n_enc:
            # the encoder's layers of decode rows never run: drop those steps
            decode = np.ones(len(rows), dtype=bool)  # (rows,)
            decode[np.cumsum(lens) - lens] = False
            run = np.ones((len(rows), L), dtype=bool)  # (rows, L)
            run[decode, :n_enc] = False
            flat = counts[run]  # (steps, E)
            layer_of = np.nonzero(run)[1]  # (steps,)
        else:
            flat = counts.reshape(-1, E)  # (rows * L, E)
            layer_of = None
        rl, exp = np.nonzero(flat)
        ptr = np.zeros(len(flat) + 1, dtype=np.int64)
        np.cumsum(np.bincount(rl, minlength=len(flat)), out=ptr[1:])
        lay = rl % L if layer_of is None else layer_of[rl]
        return FutureAccesses(ptr=ptr, keys=(lay * E + exp).astype(np.int64))
    keys: list[np.ndarray] = []
    sizes: list[np.ndarray] = []
    for batch in batches:
        for j in range(int(max(output_tokens[r] for r in batch))):
            it_rows = [int(iter_start[r]) + j for r in batch if output_tokens[r] > j]
            counts = trace.counts[it_rows].sum(axis=0)  # (L, E)
            first = n_enc if j else 0
            lay, exp = np.nonzero(counts[first:])
            keys.append((lay + first) * E + exp)
            sizes.append(np.count_nonzero(counts[first:], axis=1))
    ptr = np.zeros(sum(len(s) for s in sizes) + 1, dtype=np.int64)
    np.cumsum(np.concatenate(sizes), out=ptr[1:])
    return FutureAccesses(ptr=ptr, keys=np.concatenate(keys).astype(np.int64))


def _layer_group(num_experts: int, key: int) -> int:
    """Budget group of ``key`` with a cache per layer: its layer."""
    return key // num_experts


def _segment_group(num_keys: int, num_experts: int, key: int) -> int:
    """Budget group of ``key`` for split experts: a top segment's layer; whole experts and
    bottom segments share the buffer, group -1."""
    return (key - num_keys) // num_experts if num_keys <= key < 2 * num_keys else -1


def layer_times(
    compute: ComputeModel, hardware: HardwareSpec, model: ModelSpec, trace: Trace
) -> LayerTimes:
    """One decoding token's modelled times (batch 1, the trace's mean prompt as context),
    handed to policies that plan with them (:class:`policies.base.LayerTimes`)."""
    kv = int(round(float(trace.prompt_tokens.mean()))) if trace.num_requests else 0
    return LayerTimes(
        t_att_s=compute.attention_s(1, kv, kv + 1) + compute.router_s(1),
        t_expert_s=compute.expert_a_s + compute.expert_b_s,
        t_head_s=compute.lm_head_s(1),
        t_load_s=hardware.transfer_time_s(model.expert_size_bytes),
    )


def held_in_requests(trace: Trace, positions: list[int]) -> list[RequestTrace]:
    """The recorded routing of the requests at ``positions`` (views of the trace)."""
    out = []
    has_emb = trace.embedding.shape[1] > 0
    for r in positions:
        a = int(trace.iter_start[r])
        b = a + int(trace.output_tokens[r])
        out.append(
            RequestTrace(
                request_id=int(trace.request_id[r]),
                counts=trace.counts[a:b],
                num_tokens=trace.num_tokens[a:b],
                probs=None if trace.probs is None else trace.probs[a:b],
                embeddings=trace.embedding[a:b] if has_emb else None,
            )
        )
    return out


@contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off for the duration (and back on after, if it was).

    perf: a run allocates a few objects per transfer and per layer step (transfer
    records, cache entries, gate views) and keeps the records to the end, so the
    collector's generation-2 passes walk an ever longer list of live objects: 10% of a
    Belady run's time.  The engine's objects form no reference cycles (reference
    counting frees them), so little waits for the collector, which resumes after the
    run: a ``gc.collect()`` after a 4-request run found 0 unreachable objects for LRU
    and Belady and at most 132 for any prefetching policy (fMoE, MoEpic, MoE-Infinity).
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _run_fields(
    policy: Policy,
    model: ModelSpec,
    hardware: HardwareSpec,
    budget_bytes: int,
    serving: ServingConfig,
    seed: int,
    timing: bool,
    num_gpus: int,
) -> dict[str, Any]:
    """The summary columns that say what was run (every path reports them the same way)."""
    return {
        "policy": policy.name,
        "model": model.name,
        "hardware": hardware.name,
        "num_gpus": num_gpus,
        "budget_gb": budget_bytes / GB,
        "serving_mode": serving.mode,
        "batch_size": serving.batch_size if serving.mode == "static" else serving.max_batch_size,
        "seed": seed,
        "timing": timing,
        "expert_size_bytes": model.expert_size_bytes,
        "budget_experts": int(budget_bytes // model.expert_size_bytes),
    }


def vram_footprint_bytes(model: ModelSpec, peak_expert_bytes: int) -> int:
    """The GPU memory a run's weights take at their peak, as papers report a "VRAM
    footprint" (MoEpic §4.1: "the peak GPU memory usage during the model inference"):
    the resident weights (:attr:`ModelSpec.resident_weight_bytes`) plus the peak expert
    memory of the fullest GPU (each GPU holds the resident weights).  The KV cache and
    activations are not counted: at batch 1 and a few hundred tokens they are tens of MB,
    the same for every policy."""
    return model.resident_weight_bytes + int(peak_expert_bytes)


def _preload(
    caches: list[ExpertCache], model: ModelSpec, policy: Policy, release_after_use: bool
) -> None:
    """Make every expert resident on its GPU (experts round-robin, ``e % num_gpus``), as
    a GPU-Rich deployment holds them: admitted and completed without a transfer."""
    if policy.uses_segments:
        raise ConfigError("cache.preload", True, f"holds whole experts; {policy.name} splits them")
    if not policy.keeps_unused_experts():
        why = f"keeps every expert resident; {policy.name} evicts those its next layers do not use"
        raise ConfigError("cache.preload", True, why)
    if release_after_use:
        raise ConfigError("cache.preload", True, "contradicts cache.release_after_use")
    E, N = model.num_experts, len(caches)
    per_expert_bytes = sum(model.layer_expert_bytes)  # one expert id over every layer
    need = [per_expert_bytes * len(range(g, E, N)) for g in range(N)]
    for g, cache in enumerate(caches):
        if need[g] > cache.budget_bytes:
            raise ConfigError(
                "cache.budget_gb",
                cache.budget_bytes / GB,
                f"cache.preload needs {need[g] / GB:.3f} GB on GPU {g} for its experts",
            )
    for layer, size in enumerate(model.layer_expert_bytes):
        for e in range(E):
            cache = caches[e % N]
            key = layer * E + e
            cache.admit(key, size, "preload")
            cache.complete(key)


def sim_backend(
    hardware: HardwareSpec,
    model: ModelSpec,
    policy_name: str,
    caches: list[ExpertCache],
    timing: bool = True,
    landing: str = "link",
    preempt: bool = True,
    link_order: str = "priority",
    reserve: str = "submit",
) -> Backend:
    """The simulator's backend of a run (what :func:`simulate` uses without
    ``make_backend``): timed, the GPU-bound :class:`SimBackend`, or the host-bound
    :class:`HostBoundSimBackend` where ``hardware`` measures the host's costs for
    ``model`` (:mod:`fmoesim.engine.host`); hit-rate-only, the backend of ``landing``.
    ``link_order`` is the timed link's queue discipline (``fifo``: one
    first-come-first-served queue, :class:`SimLink`); with ``reserve="start"`` a
    prefetch reserves its bytes when the link starts its copy."""
    compute = ComputeModel.from_specs(model, hardware)
    fifo = link_order == "fifo"
    at_start = reserve == "start"
    if timing:
        host = HostModel.from_specs(model, hardware, policy_name)
        if host is None:
            return SimBackend(hardware, compute, caches, preempt, fifo, at_start)
        return HostBoundSimBackend(hardware, compute, caches, host, preempt, fifo, at_start)
    if landing == "next_step":
        return InstantBackend(caches)
    return LinkStepBackend(hardware, compute, caches)


def _demand_only(policy: Policy, model: ModelSpec, caches: list[ExpertCache]) -> bool:
    """Whether every layer step of a run may take the closed form of on-demand loading
    (:func:`closed_form_applies`) with a policy that never returns actions: neither
    :meth:`Policy.on_gate` nor :meth:`Policy.on_iteration_start` overridden."""
    cls = type(policy)
    return (
        cls.on_gate is Policy.on_gate
        and cls.on_iteration_start is Policy.on_iteration_start
        and closed_form_applies(policy, model, caches)
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
    timing: bool = True,
    preempt: bool = True,
    landing: str = "link",
    link_order: str = "priority",
    reserve: str = "submit",
    access_log: bool = False,
    progress: bool = False,
    fast: bool = True,
    experts_per_layer: int | None = None,
    make_backend: Callable[[list[ExpertCache]], Backend] | None = None,
    release_after_use: bool = False,
    preload: bool = False,
) -> RunResult:
    """Simulate serving ``trace`` with ``policy`` under an expert budget of ``budget_bytes``
    per GPU (``hardware.num_gpus`` GPUs, experts round-robin).

    ``timing=False`` is the hit-rate-only mode: every time metric of the result is NaN
    (:data:`fmoesim.engine.metrics.TIME_COLUMNS`), and ``landing`` says when a prefetch
    becomes resident: ``"link"`` once its bytes have crossed the link during the modelled
    compute since it was issued (:class:`LinkStepBackend`), ``"next_step"`` at the next
    layer step (:class:`InstantBackend`, an infinitely fast link).  ``preempt`` lets
    on-demand loads pause a prefetch at a chunk boundary; ``link_order="fifo"`` gives
    the timed link one first-come-first-served queue (no priorities, no escalation, no
    pausing: :class:`SimLink`); ``reserve="start"`` has a prefetch reserve its bytes
    (and evict) when its copy starts rather than when it is queued
    (:class:`fmoesim.config.schema.EngineConfig`); ``access_log`` keeps one row
    per expert access.
    ``fast`` allows the exact fast paths: :mod:`fmoesim.engine.fast` for hit-rate-only
    runs of plain LRU on one GPU (it keeps no transfer log and no cache objects), and
    the closed-form timing of layer steps without prefetches on one GPU
    (:meth:`Runner._layers_closed_form`); ``fast=False`` runs everything event by event.
    ``experts_per_layer`` gives every layer a cache of its own for that many experts
    (one GPU; MoEpic Table 1's setting); ``budget_bytes`` must then be their total.
    ``make_backend(caches)`` replaces the simulator's backend (the GPU replay,
    :mod:`replay.backend`).  ``release_after_use`` turns caching off (every cache evicts
    an expert once it has been used; :class:`ExpertCache`).  ``preload`` is a GPU-Rich
    deployment: every expert is resident on its GPU before the first request and nothing
    crosses the link (each GPU's budget must hold its experts; whole experts only).
    """
    model.validate()
    hardware.validate()
    check_shapes(trace, model)
    groups: dict[int, int] | None = None
    if experts_per_layer is not None:
        C = experts_per_layer
        check_experts_per_layer(model, hardware, C)
        if budget_bytes != C * sum(model.layer_expert_bytes):
            raise ConfigError(
                "cache.budget_gb", budget_bytes / GB, "must be experts_per_layer x layers x expert"
            )
        groups = {layer: C * b for layer, b in enumerate(model.layer_expert_bytes)}
    else:
        check_budget(model, budget_bytes, num_gpus=hardware.num_gpus)
    serving = (serving or ServingConfig()).validate()
    if serving.mode == "online" and not timing:
        raise ConfigError("engine.timing", False, "hit-rate-only mode needs serving.mode=static")
    if landing not in LANDINGS:
        raise ConfigError("engine.landing", landing, f"must be one of {', '.join(LANDINGS)}")
    check_link_order(link_order, timing, make_backend is not None)
    check_reserve(reserve, timing, make_backend is not None)
    if serving.mode == "online" and policy.uses_future:
        raise ConfigError(
            "policy",
            policy.name,
            "needs static batching (serving.mode=static): the future must be known",
        )
    rng = np.random.default_rng(seed)
    # the held-in split and the arrivals draw from their own streams, so a policy's
    # draws never shift them
    served, held_in = split_requests(trace.num_requests, serving, np.random.default_rng([seed, 2]))
    future = None
    if policy.uses_future:
        future = future_accesses(
            trace,
            static_batches(served, serving.batch_size),
            trace.iter_start,
            trace.output_tokens,
            model.encoder_layers,
        )
    arrival_s = None
    if serving.mode == "online":
        arrival_s = arrival_times_s(
            serving, trace.arrival_s, served, np.random.default_rng([seed, 1]), trace.path
        )
    num_gpus = hardware.num_gpus
    if (
        fast
        and not timing
        and not access_log
        and num_gpus == 1
        and serving.mode == "static"
        and type(policy) is LRU
        and model.uniform_experts  # the fast path counts the budget in experts
        and groups is None
        and make_backend is None
        and not release_after_use
        and not preload
    ):
        try:
            return _lru_hit_only(
                trace, model, hardware, policy, budget_bytes, serving, served, seed
            )
        except NotApplicable:
            pass
    compute = ComputeModel.from_specs(model, hardware)
    policy.reset(
        PolicyContext(
            model=model,
            budget_bytes=int(budget_bytes),
            expert_size_bytes=model.expert_size_bytes,
            rng=rng,
            num_gpus=num_gpus,
            future=future,
            times=layer_times(compute, hardware, model, trace),
        )
    )
    if held_in:
        policy.learn(held_in_requests(trace, held_in))
    E, n_keys = model.num_experts, model.num_layers * model.num_experts
    group_of: Callable[[int], int] | None = None
    asked = policy.cache_groups() if policy.uses_segments else None
    if asked is not None:
        if groups is not None:
            raise ConfigError(
                "cache.experts_per_layer", experts_per_layer, f"{policy.name} sets its own"
            )
        if sum(asked.values()) > budget_bytes:
            raise ValueError(
                f"policy {policy.name!r} asked for {sum(asked.values())} bytes of groups, "
                f"over the budget of {budget_bytes}"
            )
        groups = asked
        group_of = partial(_segment_group, n_keys, E)
    elif groups is not None:
        group_of = partial(_layer_group, E)
    caches = [
        ExpertCache(int(budget_bytes), policy, g, group_of, groups, release_after_use)
        if group_of is not None
        else ExpertCache(int(budget_bytes), policy, gpu=g, release_after_use=release_after_use)
        for g in range(num_gpus)
    ]
    _check_reserve_run(reserve, policy, model, hardware, caches)
    if preload:
        _preload(caches, model, policy, release_after_use)
    metrics = Metrics(trace.num_layers, timing=timing)
    backend: Backend
    if make_backend is not None:
        backend = make_backend(caches)
    elif fast and not timing and _demand_only(policy, model, caches):
        # perf: a policy that never asks for a transfer has the same hits and misses on
        # every backend (each step's misses load before its experts compute, nothing is in
        # flight between steps), so its hit-rate-only run takes the timed backend's
        # closed-form layer steps (Runner._layers_closed_form) and reports no time
        backend = SimBackend(hardware, compute, caches)
    else:
        backend = sim_backend(
            hardware, model, policy.name, caches, timing, landing, preempt, link_order, reserve
        )
    runner = Runner(
        trace,
        model,
        policy,
        caches,
        backend,
        metrics,
        serving,
        arrival_s,
        access_log=access_log,
        served=served,
        closed_form=fast,
        reserve_at_start=reserve == "start",
    )
    total_iters = int(trace.output_tokens[served].sum())
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=total_iters,
            unit="it",
            desc=f"simulate {policy.name}",
            delay=2.0,
            leave=False,
            disable=None,  # only on a terminal: a log file gets no bar fragments
        )
        runner.on_iteration = bar.update
    t0 = time.perf_counter()
    try:
        with _gc_paused():
            runner.run()
            backend.drain()  # let prefetches still in flight land
    finally:
        backend.close()
        if bar is not None:
            bar.close()
    wall = time.perf_counter() - t0
    sim_s = backend.now()
    s = metrics.summary(backend.transfers, caches)
    link_busy = backend.link_busy_s()
    s.update(
        {
            **_run_fields(policy, model, hardware, budget_bytes, serving, seed, timing, num_gpus),
            "experts_per_layer": experts_per_layer or 0,
            "simulated_s": sim_s,
            "gpu_busy_s": backend.busy_compute_s,
            "link_busy_s": link_busy,
            "wall_s": wall,
            "speedup_vs_real": sim_s / wall if wall > 0 else float("inf"),
        }
    )
    s["vram_footprint_bytes"] = vram_footprint_bytes(model, s["peak_expert_bytes"])
    log = None
    if runner.log is not None:
        log = {k: np.asarray(v) for k, v in runner.log.items()}
        if not timing:
            log["time_s"] = np.full(len(log["time_s"]), np.nan)
    if not timing:
        s = blank_times(s)
        if make_backend is not None:  # a replay backend measures its real compute time
            s["gpu_busy_s"] = backend.busy_compute_s
    return RunResult(
        summary=s,
        metrics=metrics,
        transfers=backend.transfers,
        accesses=log,
        caches=caches,
        policy_log=policy.report(),
    )


def _lru_hit_only(
    trace: Trace,
    model: ModelSpec,
    hardware: HardwareSpec,
    policy: Policy,
    budget_bytes: int,
    serving: ServingConfig,
    served: list[int],
    seed: int,
) -> RunResult:
    """The hit-rate-only run of plain LRU through :func:`fmoesim.engine.fast.lru_hit_only`,
    summarised exactly as the generic path would."""
    batches = static_batches(served, serving.batch_size)
    fut = future_accesses(
        trace, batches, trace.iter_start, trace.output_tokens, model.encoder_layers
    )
    size = model.expert_size_bytes
    t0 = time.perf_counter()
    acc, evictions = lru_hit_only(
        fut.keys, fut.ptr, trace.num_layers, trace.num_experts, int(budget_bytes // size)
    )
    wall = time.perf_counter() - t0
    metrics = Metrics(trace.num_layers, timing=False)
    metrics.acc = acc
    metrics.layer_steps = fut.num_steps
    out = trace.output_tokens
    metrics.iterations = sum(int(max(out[r] for r in b)) for b in batches)
    for r in served:
        rid = int(trace.request_id[r])
        metrics.request_start_s[rid] = metrics.request_first_token_s[rid] = 0.0
        metrics.request_end_s[rid] = 0.0
        metrics.request_output_tokens[rid] = int(out[r])
    s = metrics.summary()
    misses = s["misses"]
    distinct = len(np.unique(fut.keys))
    s.update(
        {
            "transfers": misses,
            "pcie_bytes": misses * size,
            "on_demand_bytes": misses * size,
            "evictions": evictions,
            "peak_expert_bytes": min(distinct, int(budget_bytes // size)) * size,
            **_run_fields(policy, model, hardware, budget_bytes, serving, seed, False, 1),
            "experts_per_layer": 0,
            "simulated_s": 0.0,
            "gpu_busy_s": 0.0,
            "link_busy_s": 0.0,
            "wall_s": wall,
            "speedup_vs_real": 0.0,
        }
    )
    s["vram_footprint_bytes"] = vram_footprint_bytes(model, s["peak_expert_bytes"])
    return RunResult(summary=blank_times(s), metrics=metrics)
