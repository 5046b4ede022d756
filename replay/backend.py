"""The real-hardware backends of the Runner: real expert weights, real copies, real FFNs.

The Runner, the caches and the policy object are the simulator's own
(:func:`fmoesim.engine.simulate.simulate` with ``make_backend=``); only the backend
differs, so a replay makes exactly the decisions the policy makes in simulation, under
measured instead of modelled time.  Two backends:

- :class:`GpuBackend` — the timed replay.  Every expert's weights live in (pinned) host
  memory (:class:`replay.weights.HostExperts`, ``(f, 3, h)`` per expert, so a MoEpic
  segment, a slice of the intermediate dimension, is one contiguous block); a transfer
  is chunked onto a dedicated copy stream by a host-side scheduler that keeps
  on-demand loads ahead of prefetches, holds delayed prefetches until their release
  time and cancels queued ones (:class:`replay.link.LinkScheduler`); the compute stream
  runs the attention and router stand-ins, the shared experts and one SwiGLU FFN per
  routed expert on its resident device copy.  Every transfer and every compute
  operator sits between two CUDA events; the clock is wall time since the backend
  started, taken after the compute stream has drained (the host reads the gate's
  output before it can route, as real offloading servers do).  A layer's stall is
  measured from events: the time between the compute stream running out of work (an
  event recorded when the Runner starts waiting) and the awaited copy's end event;
  zero when the copy landed first.  With ``device="cpu"`` the copy stream is a worker
  thread and compute is synchronous, so the same scheduling code runs in CI; its
  times describe a CPU and mean nothing for a GPU server.
- :class:`InstantReplayBackend` — the CPU path with the semantics of the hit-rate-only
  simulator with ``engine.landing=next_step`` (a copy lands at the next layer step or
  when the Runner waits for it) and real copies and FFNs: the decisions, and so the hit
  rates, equal that simulator's exactly for every policy (tested).

Multi-GPU expert parallelism is not replayed: the backends take one cache (one GPU).
"""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from fmoesim.engine.backend import Backend, TransferRecord
from fmoesim.engine.cache import Entry, ExpertCache
from fmoesim.engine.sim import InstantBackend
from fmoesim.errors import FmoesimError
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec
from replay.link import CudaCopier, LinkScheduler, ThreadCopier
from replay.weights import DEVICE_FRACTION, Executor, expert_rows, shared_host_experts

__all__ = [
    "GpuBackend",
    "InstantReplayBackend",
    "drop_evicted",
    "replay_backend",
    "segment_rows",
]


def segment_rows(model: ModelSpec, entries: dict[int, Entry], key: int) -> tuple[int, int]:
    """The intermediate rows ``[lo, hi)`` cache key ``key`` holds: all of an expert's
    ``f`` rows (``key < L E``; ``f`` its layer's :func:`replay.weights.expert_rows`), a
    top's first ``θ f`` rows (``L E <= key < 2 L E``), or a bottom's rest (the rows its
    top does not hold; the top's size against the layer's expert size, when cached, fixes
    ``θ``)."""
    n = model.num_layers * model.num_experts
    layer = (key % n) // model.num_experts
    f, S = expert_rows(model)[layer], model.layer_expert_bytes[layer]
    if key < n:
        return 0, f
    if key < 2 * n:
        return 0, round(f * entries[key].size_bytes / S)
    top = entries.get(n + key % n)
    if top is not None:
        return round(f * top.size_bytes / S), f
    return f - round(f * entries[key].size_bytes / S), f


def drop_evicted(dev: dict[int, Any], entries: dict[int, Entry]) -> None:
    """Free the device copies of keys the cache no longer holds."""
    for k in [k for k in dev if k not in entries]:
        del dev[k]


def split_device_copy(
    dev: dict[int, Any], model: ModelSpec, entries: dict[int, Entry], key: int, parts: list[int]
) -> None:
    """Whole expert ``key``'s device copy becomes its segments' (their rows of it, a copy
    on the device), as the cache split it."""
    whole = dev.pop(key)
    for k in parts:
        lo, hi = segment_rows(model, entries, k)
        dev[k] = whole[lo:hi].clone()


def _one_gpu(caches: Sequence[ExpertCache]) -> None:
    if len(caches) != 1:
        raise FmoesimError(
            f"hardware.num_gpus={len(caches)}: the replay runs one GPU (expert parallelism "
            "is simulated only)"
        )


class InstantReplayBackend(InstantBackend):
    """The CPU path with hit-rate-only semantics (see the module docstring): transfers
    land as :class:`fmoesim.engine.sim.InstantBackend`'s do, landing really copies the
    weights (or a segment's slice), and experts really compute.  Its clock is not
    advanced: there is no timing to report."""

    def __init__(
        self,
        model: ModelSpec,
        caches: Sequence[ExpertCache],
        seed: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        _one_gpu(caches)
        super().__init__(caches)
        self.model, self.device = model, "cpu"
        self.host = shared_host_experts(model, "cpu", seed, checkpoint)
        self.exe = Executor(model, "cpu", self.host.dtype, seed)
        self._dev: dict[int, Any] = {}  # key -> device copy

    def _land(self, rec: TransferRecord) -> None:
        """Copy the expert (or segment) to the device, then it is resident."""
        lo, hi = segment_rows(self.model, self.caches[0].entries, rec.key)
        self._dev[rec.key] = self.host.tensor(rec.key)[lo:hi].clone()
        super()._land(rec)

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """The previous step's copies land; evicted experts' device copies are freed."""
        super().pre_gate(layer, tokens, kv_tokens, pairs)
        drop_evicted(self._dev, self.caches[0].entries)

    def split(self, gpu: int, key: int, parts: list[int]) -> None:
        """The cache split a whole expert: slice its device copy."""
        split_device_copy(self._dev, self.model, self.caches[0].entries, key, parts)

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """The SwiGLU FFN of resident ``key`` (a whole expert or a segment)."""
        t0 = time.perf_counter()
        self.exe.ffn(self._dev[key], tokens)
        self.busy_compute_s += time.perf_counter() - t0


class _CpuMark:
    __slots__ = ("t",)

    def __init__(self, t: float) -> None:
        self.t = t


class GpuBackend(Backend):
    """The timed replay (see the module docstring).

    ``depth`` is the number of chunks the link scheduler keeps issued on the copy
    stream; chunks are ``hardware.chunk_bytes`` long (of the model's dtype on a GPU);
    ``preempt`` lets an on-demand load overtake a prefetch at a chunk boundary.
    ``max_tokens`` and ``max_kv`` size the device memory check of the stand-ins.
    ``compute_repeat`` runs every compute operator that many times (the replay's side of
    the compute-to-transfer crossover: the simulator's side scales every compute time by
    the same factor, :func:`fmoesim.plots.crossover.scale_hardware`).
    """

    def __init__(
        self,
        model: ModelSpec,
        hardware: HardwareSpec,
        caches: Sequence[ExpertCache],
        device: str = "cuda",
        *,
        seed: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
        depth: int = 2,
        preempt: bool = True,
        max_tokens: int = 4096,
        max_kv: int = 8192,
        compute_repeat: int = 1,
    ) -> None:
        if compute_repeat < 1:
            raise FmoesimError(f"compute_repeat {compute_repeat}: must be >= 1")
        if model.encoder_layers or model.moe_layer_period > 1 or model.expert_matrices != 3:
            raise FmoesimError(
                f"model {model.name!r}: the replay runs decoder-only models of SwiGLU experts "
                "with an MoE layer in every block (encoder_layers = 0, moe_layer_period = 1, "
                "expert_matrices = 3); simulate it instead"
            )
        self.repeat = compute_repeat
        try:
            import torch
        except ImportError:
            raise FmoesimError("the replay needs torch (pip install torch)") from None
        _one_gpu(caches)
        self.torch = torch
        self.cuda = device.startswith("cuda")
        if self.cuda and not torch.cuda.is_available():
            raise FmoesimError(f"device {device!r}: CUDA is not available here")
        if not self.cuda and device != "cpu":
            raise FmoesimError(f"device {device!r}: must be 'cpu' or 'cuda[:N]'")
        if self.cuda:
            dev = torch.device(device)
            if dev.index is None:  # "cuda": the current device, named by its index
                device = f"cuda:{torch.cuda.current_device()}"
            torch.cuda.set_device(device)  # events and default streams are per device
        self.model, self.device = model, device
        self.caches = caches
        self.num_gpus = 1
        self.transfers: list[TransferRecord] = []
        self.busy_compute_s = 0.0
        # whether the current layer step carries more than one token (at batch 1, the
        # prefill), from its attention on; the transfers submitted and the compute
        # measured in such steps
        self.multi_step = False
        self.multi_transfers: list[TransferRecord] = []
        self.busy_compute_multi_s = 0.0
        self.host = shared_host_experts(model, device, seed, checkpoint)
        self.exe = Executor(model, device, self.host.dtype, seed)
        if self.cuda:
            self._check_device_memory(caches[0].budget_bytes, max_tokens, max_kv)
        self._dev: dict[int, Any] = {}  # key -> device tensor (whole or segment rows)
        self._range: dict[int, tuple[int, int]] = {}  # key in flight -> host rows
        # compute operators' marks, unfolded: (start, end, in a multi-token layer step)
        self._spans: deque[tuple[Any, Any, bool]] = deque()
        self._layer_stall_s = 0.0
        self._final_s: float | None = None  # the clock when the run ended (drain)
        if self.cuda:
            torch.cuda.synchronize(device)
            self._origin = torch.cuda.Event(enable_timing=True)
            self._origin.record()
            self._t0 = time.perf_counter()
            self.copier: Any = CudaCopier(torch, device, self._origin)
        else:
            self._t0 = time.perf_counter()
            self.copier = ThreadCopier(self._t0)
        self.link = LinkScheduler(
            self.copier,
            self.host.row_bytes,
            hardware.chunk_bytes,
            depth,
            preempt,
            self._issue,
            self._rows,
            self._landed,
        )

    # -- memory --------------------------------------------------------------------------
    def _check_device_memory(self, budget_bytes: int, max_tokens: int, max_kv: int) -> None:
        cuda = self.torch.cuda
        free, total = cuda.mem_get_info(self.device)
        # memory torch's caching allocator holds but no tensor uses is free for this run
        free += cuda.memory_reserved(self.device) - cuda.memory_allocated(self.device)
        need = budget_bytes + self.exe.standin_bytes(max_tokens, max_kv)
        if need > DEVICE_FRACTION * free:
            raise FmoesimError(
                f"{self.device}: expert budget {budget_bytes / 1e9:.1f} GB + stand-ins "
                f"{(need - budget_bytes) / 1e9:.1f} GB = {need / 1e9:.1f} GB, over "
                f"{DEVICE_FRACTION:.0%} of the {free / 1e9:.1f} GB free (of "
                f"{total / 1e9:.1f} GB); lower cache.budget_gb"
            )

    # -- marks and time ------------------------------------------------------------------
    def _mark(self) -> Any:
        """A point on the compute stream (now, on the CPU)."""
        if not self.cuda:
            return _CpuMark(time.perf_counter() - self._t0)
        ev = self.torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _mark_done(self, mark: Any) -> bool:
        return True if not self.cuda else bool(mark.query())

    def _fold_spans(self, wait: bool = False) -> None:
        """Add finished compute operators' measured time to ``busy_compute_s`` (and to
        ``busy_compute_multi_s``, those of the multi-token layer steps)."""
        spans, span_s = self._spans, self.copier.span_s
        while spans and (wait or self._mark_done(spans[0][1])):
            a, b, multi = spans.popleft()
            d = span_s(a, b)
            self.busy_compute_s += d
            if multi:
                self.busy_compute_multi_s += d

    def _host_s(self) -> float:
        return time.perf_counter() - self._t0

    def _drain_compute(self) -> None:
        """Wait for the compute stream, feeding the link meanwhile."""
        if not self.cuda:
            return
        mark = self._mark()
        while not mark.query():
            self.link.pump(self._host_s())

    def _compute(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run one compute operator between two marks."""
        m0 = self._mark()
        for _ in range(self.repeat):
            fn(*args)
        self._spans.append((m0, self._mark(), self.multi_step))
        self.link.pump(self._host_s())

    def now(self) -> float:
        """Wall time since the backend started, once the compute stream has drained
        (after :meth:`drain`: when the run ended)."""
        if self._final_s is not None:
            return self._final_s
        self._drain_compute()
        return self._host_s()

    def sync(self) -> float:
        """Land what has arrived; return now."""
        t = self.now()
        self.link.pump(t)
        self._fold_spans()
        return t

    def idle_until(self, t_s: float) -> None:
        """Wait (feeding the link) until ``t_s``: an online request arrives then."""
        while self._host_s() < t_s:
            self.link.pump(self._host_s())
            time.sleep(min(1e-4, max(0.0, t_s - self._host_s())))

    # -- the link ------------------------------------------------------------------------
    def _rows(self, rec: TransferRecord) -> int:
        lo, hi = segment_rows(self.model, self.caches[0].entries, rec.key)
        self._range[rec.key] = (lo, hi)
        return hi - lo

    def _free_evicted(self) -> None:
        """Drop the device copies of keys the cache evicted (the allocator reuses their
        memory once the compute stream is past their last use: see ``_landed``)."""
        drop_evicted(self._dev, self.caches[0].entries)

    def _issue(self, rec: TransferRecord, lo: int, hi: int) -> tuple[Any, Any]:
        key = rec.key
        r0, r1 = self._range[key]
        if lo == 0:
            self._free_evicted()  # keep device memory within the budget
            self._dev[key] = self._alloc((r1 - r0, 3, self.model.hidden_size))
        src = self.host.tensor(key)[r0 + lo : r0 + hi]
        return self.copier.copy(self._dev[key][lo:hi], src)

    def _alloc(self, shape: tuple[int, int, int]) -> Any:
        """The device tensor an expert's copy lands in (rows, 3, hidden): on a GPU
        allocated on the copy stream, which writes it first (compute's use is recorded
        on landing, ``_landed``)."""
        if self.cuda:
            with self.torch.cuda.stream(self.copier.stream):
                return self.torch.empty(shape, device=self.device, dtype=self.host.dtype)
        return self.torch.empty(shape, dtype=self.host.dtype)

    def _landed(self, rec: TransferRecord) -> None:
        del self._range[rec.key]
        if self.cuda:  # the compute stream reads it from now on
            self._dev[rec.key].record_stream(self.torch.cuda.current_stream())
        self.caches[rec.gpu].complete(rec.key)

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Queue a copy of ``key``; it may not start before ``delay_s`` from now."""
        t = self._host_s()
        rec = TransferRecord(key, gpu, size_bytes, reason, priority, t)
        if delay_s > 0.0:
            rec.release_s = t + delay_s
        self.transfers.append(rec)
        if self.multi_step:
            self.multi_transfers.append(rec)
        self.link.submit(rec, t)
        self.link.pump(t)
        return rec

    def escalate(self, gpu: int, key: int) -> None:
        """On-demand priority for ``key``'s transfer."""
        self.link.escalate(key)
        self.link.pump(self._host_s())

    def reprioritize(self, gpu: int, key: int, priority: float) -> None:
        """Move a queued, never-issued prefetch."""
        self.link.reprioritize(key, priority)

    def cancel(self, gpu: int, key: int) -> bool:
        """Drop ``key``'s transfer if none of it was issued."""
        rec = self.link._jobs.get(key)
        if rec is None or not self.link.cancel(key):
            return False
        rec.cancelled = True
        rec.start_s = rec.end_s = rec.submit_s
        self._range.pop(key, None)
        return True

    def abort(self, gpu: int, key: int) -> bool:
        """Stop ``key``'s transfer: cancelled if none of it was issued, else no further
        chunk is issued (:meth:`replay.link.LinkScheduler.abort`)."""
        link = self.link
        link.pump(self._host_s())  # what has landed by now lands first
        if key not in link._jobs:
            return False
        if link._next_row[key] == 0:
            return self.cancel(gpu, key)
        if not link.abort(key):
            return False
        self._range.pop(key, None)
        return True

    # -- compute -------------------------------------------------------------------------
    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention and router stand-ins; the host waits for the gate (sync); device
        copies of evicted experts are freed.  A layer step of more than one token
        (``tokens``) counts apart from here to the next one's attention."""
        self.multi_step = tokens > 1
        self._compute(self.exe.attention, tokens, pairs)
        self._compute(self.exe.router, tokens)
        self.sync()
        self._free_evicted()

    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """A dense decoder layer's stand-in."""
        self._compute(self.exe.dense, tokens, pairs)

    def lm_head(self, sequences: int) -> None:
        """The LM head's stand-in."""
        self._compute(self.exe.lm_head, sequences)

    def begin_experts(self, layer: int, tokens: int) -> None:
        """Shared experts; the layer's stall count starts."""
        if self.exe.w_shared is not None:
            self._compute(self.exe.shared, tokens)
        self._layer_stall_s = 0.0

    def split(self, gpu: int, key: int, parts: list[int]) -> None:
        """The cache split a whole expert (landed: the cache holds it resident): slice
        its device copy, a copy on the device in the current stream, before the segments
        compute there."""
        split_device_copy(self._dev, self.model, self.caches[0].entries, key, parts)

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """The SwiGLU FFN of resident ``key`` on its device copy."""
        self._compute(self.exe.ffn, self._dev[key], tokens)

    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Feed the link until one of ``keys`` lands; the stall is the time from the
        compute stream running dry to that landing (0 if it landed first)."""
        entries = self.caches[0].entries
        ready = self._mark()
        link = self.link
        while True:
            for k in keys:
                if entries[k].resident:
                    land = link.last_end_mark.get(k)
                    if land is not None and self._mark_done(ready):
                        # perf/precision: an event-to-event interval, not two stamps
                        self._layer_stall_s += max(0.0, self.copier.span_s(ready, land))
                    return k
            if not any(link.in_flight(k) for k in keys):
                raise RuntimeError(
                    f"GPU {gpu} waits for experts {list(keys)} that are not in flight"
                )
            if not link.pump(self._host_s()):
                time.sleep(0)  # perf: let the copy thread (CPU path) have the GIL

    def catch_up(self, gpu: int) -> None:
        """Land the copies that have arrived by now (the link fed as :meth:`wait_any`
        feeds it), so a load that found no room sees them resident."""
        self.link.pump(self._host_s())

    def end_experts(self) -> float:
        """The layer's stall (summed over its waits)."""
        return self._layer_stall_s

    def drain(self) -> None:
        """Let every transfer land, wait for the compute stream, and add up the compute
        operators' measured time."""
        self._final_s = self.now()
        while not self.link.idle():
            if not self.link.pump(self._host_s()):
                time.sleep(0)
        if self.cuda:
            self.torch.cuda.synchronize(self.device)
        self._fold_spans(wait=True)

    def link_busy_s(self) -> float:
        """Measured busy time of the copy stream (sum of its chunks' event spans)."""
        return self.link.busy_s

    def close(self) -> None:
        """Stop the copy thread (CPU path) and free the device copies and stand-ins (a
        sweep's next replay gets the GPU's memory back without waiting for the garbage
        collector to break the backend's reference cycles)."""
        if isinstance(self.copier, ThreadCopier):
            self.copier.close()
        self._dev.clear()
        self._spans.clear()
        self.link.last_end_mark.clear()
        self.exe.release()


def check_device(device: str, needs: str = "the replay") -> Any:
    """``device`` is one the replay can use (``cpu``, or ``cuda[:N]`` with CUDA here) and
    torch imports; returns the torch module.  Checked by every command before its first
    run or measurement, in one line naming ``--device``."""
    import re

    cuda = re.fullmatch(r"cuda(?::(\d+))?", device)
    if cuda is None and device != "cpu":
        raise FmoesimError(f"--device {device}: must be 'cpu' or 'cuda[:N]'")
    try:
        import torch
    except ImportError:
        raise FmoesimError(f"{needs} needs torch (pip install torch)") from None
    if cuda and not torch.cuda.is_available():
        raise FmoesimError(f"--device {device}: CUDA is not available here (rule: the "
                           "replay runs on a GPU; --device cpu replays on the CPU)")  # fmt: skip
    if cuda and cuda.group(1) is not None and int(cuda.group(1)) >= torch.cuda.device_count():
        raise FmoesimError(f"--device {device}: no such GPU (rule: N < the "
                           f"{torch.cuda.device_count()} GPUs here)")  # fmt: skip
    return torch


def replay_backend(
    model: ModelSpec,
    hardware: HardwareSpec,
    device: str = "cpu",
    timed: bool = True,
    **kwargs: Any,
) -> Callable[[list[ExpertCache]], Backend]:
    """A ``make_backend`` for :func:`fmoesim.engine.simulate.simulate`: the timed
    :class:`GpuBackend`, or, on the CPU with ``timed=False``, the
    :class:`InstantReplayBackend`.  A model whose expert size differs by layer, or is
    quantized, replays each layer's experts as the rows that hold its bytes
    (:func:`replay.weights.expert_rows`)."""
    if not timed:
        if device != "cpu":
            raise FmoesimError(f"device {device!r}: the untimed replay is the CPU path only")
        return lambda caches: InstantReplayBackend(model, caches, **kwargs)
    return lambda caches: GpuBackend(model, hardware, caches, device, **kwargs)
