"""The simulator backend: a SimPy clock, a PCIe link model and the compute model."""

from __future__ import annotations

import heapq
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any

import simpy

from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.commands import Compute, Now, Op, Transfer, WaitAny
from fmoesim.engine.compute import ComputeModel
from fmoesim.specs.hardware import HardwareSpec


@dataclass(frozen=True, slots=True)
class TransferRecord:
    """One finished host-to-device transfer."""

    key: int
    size_bytes: int
    reason: str
    start_s: float
    end_s: float


class SimLink:
    """One host-to-device link: transfers run one at a time, lowest priority value first.

    Each transfer takes ``transfer_overhead_s + size / pcie_bytes_per_s``.  Ties in
    priority break by submission order (a sequence number), so runs are reproducible.
    """

    def __init__(
        self, env: simpy.Environment, hw: HardwareSpec, on_done: Callable[[int], None]
    ) -> None:
        self.env, self.hw, self.on_done = env, hw, on_done
        self._queue: list[tuple[float, int, Transfer]] = []
        self._seq = 0
        self.busy = False
        self.log: list[TransferRecord] = []

    def submit(self, t: Transfer) -> None:
        """Queue a transfer; start serving if the link is idle."""
        heapq.heappush(self._queue, (t.priority, self._seq, t))
        self._seq += 1
        if not self.busy:
            self.busy = True
            self.env.process(self._serve())

    def _serve(self) -> Generator[simpy.Event, Any, None]:
        while self._queue:
            _, _, t = heapq.heappop(self._queue)
            start = self.env.now
            yield self.env.timeout(self.hw.transfer_time_s(t.size_bytes))
            self.log.append(TransferRecord(t.key, t.size_bytes, t.reason, start, self.env.now))
            self.on_done(t.key)
        self.busy = False


class SimBackend:
    """Executes a Runner's commands in simulated time."""

    def __init__(self, hw: HardwareSpec, compute: ComputeModel, cache: ExpertCache) -> None:
        self.env = simpy.Environment()
        self.compute, self.cache = compute, cache
        self.link = SimLink(self.env, hw, self._transfer_done)
        self._waiters: dict[int, list[simpy.Event]] = {}
        # perf: compute on the single GPU stream is sequential and touches nothing shared,
        # so consecutive Compute commands are summed and turned into one SimPy timeout only
        # at the next point where the Runner interacts with the link (Transfer, WaitAny, or
        # Now while a transfer is in flight).
        self._pending_s = 0.0
        self.busy_compute_s = 0.0

    def run(self, commands: Generator[Any, Any, None]) -> float:
        """Run the command generator to the end; return the simulated end time (s)."""
        self.env.process(self._drive(commands))
        self.env.run()
        return float(self.env.now)

    def duration_s(self, c: Compute) -> float:
        """Simulated time of one compute command."""
        cm = self.compute
        op = c.op
        if op is Op.EXPERT:
            return cm.expert_s(c.tokens)
        if op is Op.ATTENTION:
            return cm.attention_s(c.tokens, c.kv_tokens, c.pairs)
        if op is Op.ROUTER:
            return cm.router_s(c.tokens)
        if op is Op.SHARED:
            return cm.shared_s(c.tokens)
        if op is Op.DENSE_MLP:
            return cm.dense_mlp_s(c.tokens)
        return cm.lm_head_s(c.tokens)

    def _drive(self, gen: Generator[Any, Any, None]) -> Generator[simpy.Event, Any, None]:
        reply: Any = None
        while True:
            try:
                cmd = gen.send(reply)
            except StopIteration:
                break
            reply = None
            kind = type(cmd)
            if kind is Compute:
                d = self.duration_s(cmd)
                self._pending_s += d
                self.busy_compute_s += d
                continue
            if kind is Now and not self.link.busy:
                reply = self.env.now + self._pending_s  # perf: nothing can happen meanwhile
                continue
            if self._pending_s:
                yield self.env.timeout(self._pending_s)
                self._pending_s = 0.0
            if kind is Now:
                reply = self.env.now
            elif kind is Transfer:
                self.link.submit(cmd)
            elif kind is WaitAny:
                reply = yield from self._wait_any(cmd.keys)
            else:
                raise TypeError(f"unknown command {cmd!r}")
        if self._pending_s:
            yield self.env.timeout(self._pending_s)
            self._pending_s = 0.0

    def _wait_any(self, keys: tuple[int, ...]) -> Generator[simpy.Event, Any, int]:
        for k in keys:
            if self.cache.is_resident(k):
                return k
        ev = self.env.event()
        for k in keys:
            self._waiters.setdefault(k, []).append(ev)
        key = yield ev
        for k in keys:
            lst = self._waiters.get(k)
            if lst is not None and ev in lst:
                lst.remove(ev)
                if not lst:
                    del self._waiters[k]
        return int(key)

    def _transfer_done(self, key: int) -> None:
        self.cache.complete(key)
        for ev in self._waiters.pop(key, ()):
            if not ev.triggered:
                ev.succeed(key)
