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

from fmoesim.engine.backend import TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.sim import InstantBackend
from fmoesim.errors import FmoesimError
from fmoesim.specs.model import ModelSpec


def host_memory_bytes() -> int:
    """Physical memory of this machine in bytes (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


class GpuBackend(InstantBackend):
    """See the module docstring.  ``device`` must be ``"cpu"`` for now.

    The transfer queue is :class:`fmoesim.engine.sim.InstantBackend`'s (a copy lands at
    the next layer step, or when the Runner waits for it); landing really copies the
    weights, and experts really compute."""

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
        super().__init__(caches)
        self.torch = torch
        self.model, self.device = model, device
        L, E = model.num_layers, model.num_experts
        self.n = L * E
        need = self.n * model.expert_size_bytes * 2  # host weights + device copies
        have = host_memory_bytes()
        if have and need > 0.8 * have:
            raise FmoesimError(
                f"{model.name}: {L} x {E} experts of {model.expert_size_bytes / 1e6:.1f} MB "
                f"need {need / 1e9:.1f} GB here, but this machine has {have / 1e9:.1f} GB"
            )
        gen = torch.Generator().manual_seed(seed)
        f, h = model.expert_intermediate_size, model.hidden_size
        # (3, f, h) per expert: w1 and w3 (f x h) and w2 transposed (f x h), so that any
        # slice of the intermediate dimension is one contiguous segment of all three
        self._host = [torch.randn(3, f, h, generator=gen) / h**0.5 for _ in range(self.n)]
        self._dev: list[dict[int, Any]] = [{} for _ in caches]  # key -> device tensor
        self._t0 = time.perf_counter()

    def now(self) -> float:
        """Wall time since the backend was made."""
        return time.perf_counter() - self._t0

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

    def _land(self, rec: TransferRecord) -> None:
        """Copy the expert (or segment) to the device, then it is resident."""
        key = rec.key
        w = self._host[key % self.n][:, self._rows(rec.gpu, key)]
        self._dev[rec.gpu][key] = w.to(self.device, copy=True)
        super()._land(rec)
        rec.start_s = rec.end_s = self.now()

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """The previous step's copies land; evicted experts' device copies are freed
        (the attention stand-in is not run on the CPU path)."""
        super().pre_gate(layer, tokens, kv_tokens, pairs)
        for g, dev in enumerate(self._dev):
            entries = self.caches[g].entries
            for k in [k for k in dev if k not in entries]:
                del dev[k]

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """The SwiGLU FFN of resident ``key`` (a whole expert or a segment) on
        ``tokens`` random token states."""
        torch, F = self.torch, self.torch.nn.functional
        w = self._dev[gpu][key]
        t0 = time.perf_counter()
        x = torch.randn(max(tokens, 1), self.model.hidden_size)
        F.linear(F.silu(F.linear(x, w[0])) * F.linear(x, w[1]), w[2].T)
        self.busy_compute_s += time.perf_counter() - t0
