"""The real-hardware backend of the Runner: real expert weights, real copies, real FFNs.

This is the CPU path of issue 8's GpuBackend (``device="cpu"``), which CI exercises: the
Runner, the caches and the policy are the simulator's own; the backend keeps every
expert's weights (random, the model's true shapes) in host memory, copies an expert (or
a MoEpic segment: a real slice of its intermediate dimension) into a device-side slot
when a transfer is submitted, and runs the expert's SwiGLU FFN on its routed token count.
Without CUDA streams a copy cannot overlap compute, so transfers land as the
hit-rate-only simulator's do: at the next layer step, or at once when the Runner waits
for them.  The decisions are therefore exactly the policy's own, and for policies whose
decisions do not depend on timing the hit rates equal the simulator's in hit-rate-only
mode (tested).  Its clock is wall time, which on a CPU says nothing about a GPU server.
The CUDA path (copy stream, events, a link scheduler) is still to come.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from fmoesim.engine.backend import Backend, TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.errors import FmoesimError
from fmoesim.specs.model import ModelSpec


def host_memory_bytes() -> int:
    """Physical memory of this machine in bytes (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class GpuBackend(Backend):
    """See the module docstring.  ``device`` must be ``"cpu"`` for now."""

    def __init__(
        self,
        model: ModelSpec,
        caches: Sequence[ExpertCache],
        device: str = "cpu",
        seed: int = 0,
    ) -> None:
        import torch

        if device != "cpu":
            raise FmoesimError(f"device {device!r}: only the CPU path exists yet (issue 8)")
        self.torch = torch
        self.model, self.caches, self.device = model, caches, device
        self.num_gpus = len(caches)
        L, E = model.num_layers, model.num_experts
        self.n = L * E
        need = self.n * model.expert_size_bytes * 2  # host weights + device copies
        have = host_memory_bytes()
        if have and need > 0.8 * have:
            raise FmoesimError(
                f"{model.name}: {L} x {E} experts of {model.expert_size_bytes / 1e6:.1f} MB "
                f"need {need / 1e9:.1f} GB here, but this machine has {have / 1e9:.1f} GB"
            )
        self.dtype = torch.float32  # CPU matmuls in bf16 are slow emulations
        gen = torch.Generator().manual_seed(seed)
        f, h = model.expert_intermediate_size, model.hidden_size
        # (3, f, h) per expert: w1 and w3 (f x h) and w2 transposed (f x h), so that any
        # slice of the intermediate dimension is one contiguous segment of all three
        self._host = [torch.randn(3, f, h, generator=gen) / h**0.5 for _ in range(self.n)]
        self._dev: list[dict[int, Any]] = [{} for _ in caches]  # key -> device tensor
        self._pending: list[TransferRecord] = []
        self.transfers: list[TransferRecord] = []
        self._t0 = time.perf_counter()
        self.busy_compute_s = 0.0

    # -- clock ----------------------------------------------------------------------
    def now(self) -> float:
        """Wall time since the backend was made."""
        return time.perf_counter() - self._t0

    def sync(self) -> float:
        """Carry out every pending copy; the copied experts become resident."""
        for rec in self._pending:
            if not rec.cancelled:
                self._copy(rec)
        self._pending.clear()
        return self.now()

    def idle_until(self, t_s: float) -> None:
        """Online arrivals: nothing to wait for on the CPU path."""

    # -- transfers ------------------------------------------------------------------
    def _rows(self, gpu: int, key: int) -> slice:
        """The intermediate rows ``key`` holds: all of them, or a segment's (a top the
        first ``θ`` of them, a bottom the rest)."""
        f, S, n = self.model.expert_intermediate_size, self.model.expert_size_bytes, self.n
        if key < n:
            return slice(0, f)
        entries = self.caches[gpu].entries
        if key < 2 * n:
            return slice(0, round(f * entries[key].size_bytes / S))
        top = entries.get(n + key % n)
        if top is not None:
            return slice(round(f * top.size_bytes / S), f)
        return slice(f - round(f * entries[key].size_bytes / S), f)

    def _copy(self, rec: TransferRecord) -> None:
        key = rec.key
        w = self._host[key % self.n][:, self._rows(rec.gpu, key)]
        self._dev[rec.gpu][key] = w.to(self.device, copy=True)
        self.caches[rec.gpu].complete(key)
        rec.start_s = rec.end_s = self.now()

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Queue a copy; it is carried out at the next sync."""
        rec = TransferRecord(key, gpu, size_bytes, reason, priority, self.now())
        self.transfers.append(rec)
        self._pending.append(rec)
        return rec

    def escalate(self, gpu: int, key: int) -> None:
        """Nothing to reorder: pending copies all run at the next sync."""

    def cancel(self, gpu: int, key: int) -> bool:
        """Drop a copy not carried out yet."""
        for rec in self._pending:
            if rec.key == key and rec.gpu == gpu and not rec.cancelled:
                rec.cancelled = True
                rec.start_s = rec.end_s = rec.submit_s
                return True
        return False

    def wait_any(self, gpu: int, keys: Sequence[int]) -> int:
        """Carry out the pending copies and return the first of ``keys`` now resident."""
        self.sync()
        for k in keys:
            if self.caches[gpu].is_resident(k):
                return k
        raise RuntimeError(f"GPU {gpu} waits for experts {list(keys)} that are not in flight")

    # -- compute --------------------------------------------------------------------
    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """The previous step's copies land (the attention stand-in is not run on CPU)."""
        if self._pending:
            self.sync()
        self._drop_evicted()

    def _drop_evicted(self) -> None:
        """Free device copies the caches no longer hold."""
        for g, dev in enumerate(self._dev):
            entries = self.caches[g].entries
            for k in [k for k in dev if k not in entries]:
                del dev[k]

    def dense_layer(self, index: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Not run on the CPU path."""

    def lm_head(self, sequences: int) -> None:
        """Not run on the CPU path."""

    def begin_experts(self, layer: int, tokens: int) -> None:
        """Nothing to set up."""

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """The SwiGLU FFN of resident ``key`` (a whole expert or a segment) on
        ``tokens`` random token states."""
        torch, F = self.torch, self.torch.nn.functional
        w = self._dev[gpu][key]
        t0 = time.perf_counter()
        x = torch.randn(max(tokens, 1), self.model.hidden_size)
        F.linear(F.silu(F.linear(x, w[0])) * F.linear(x, w[1]), w[2].T)
        self.busy_compute_s += time.perf_counter() - t0

    def experts(
        self,
        gpu: int,
        tokens: list[int],
        fractions: list[float] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        """Several resident experts back to back."""
        if keys is None:
            raise ValueError("GpuBackend.experts needs the experts' keys")
        for i, (k, t) in enumerate(zip(keys, tokens, strict=True)):
            self.expert(gpu, k, t, 1.0 if fractions is None else fractions[i])

    def end_experts(self) -> float:
        """No stall is measured on the CPU path."""
        return 0.0
