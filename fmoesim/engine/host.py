"""The host's share of a layer step: a timed backend for engines whose Python (or C++)
host work, not the GPU, sets the pace.

:class:`fmoesim.engine.sim.SimBackend` models a GPU-bound engine: a layer step lasts its
modelled compute plus its transfer stalls, and the host is free.  A host-bound engine (a
Python serving loop at batch 1, such as this project's own replay) also spends host time
at every step, while the GPU idles: reading the gate's output back, the runner's and the
cache's bookkeeping, the policy's decision, issuing each expert's kernels, queueing each
transfer and issuing each copy.  :class:`HostModel` holds those costs, and
:class:`HostBoundSimBackend` adds them to the simulated clock, in order with the
compute, as a host that issues everything itself does: the gate's cost after attention
and router, one access cost before each expert's FFN, one submission cost when a
transfer is queued, and one issue cost for every transfer the link starts (the host
issues the copy; a transfer cancelled while queued costs its submission only).  The
host launches each segment of a split expert as its own FFN, as the replay does, so a
segment's compute pays every kernel's launch (``ComputeModel.segment_s``), where the
GPU-bound :class:`SimBackend` charges its share of the whole expert.  The link
keeps moving while the host works.  With ``host_link_depth`` in the profile, the link
also waits for the host: a queued transfer starts at the host's next point (the gate,
an expert's launch, a submission, a wait), and at most that many transfers are issued
to the copy engine at a time (:class:`fmoesim.engine.sim.SimLink`, ``host_depth``).

The costs come from a measured hardware profile (``hardware.measured[<model name>]``:
``host_layer_s``, ``host_access_s``, ``host_submit_s``, ``host_transfer_s``,
``host_decision_s``, a map from policy name to seconds per MoE layer step, and
``host_link_depth``); a profile
without them keeps the GPU-bound :class:`SimBackend`.  ``fmoesim-validate-grid host-fit``
measures them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from fmoesim.engine.backend import TransferRecord
from fmoesim.engine.cache import ExpertCache
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.sim import SimBackend
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec

#: the keys of ``hardware.measured[<model>]`` the host model reads
HOST_KEYS = ("host_layer_s", "host_access_s", "host_transfer_s")
#: an optional key: host seconds per transfer queued (0 where a profile lacks it)
HOST_SUBMIT_KEY = "host_submit_s"
#: every engine cost the host model reads (any one of them turns it on)
HOST_COST_KEYS = (*HOST_KEYS, HOST_SUBMIT_KEY)
#: an optional key: how many transfers the host keeps issued to the copy engine, the
#: running one included (the link waits for the host to issue each); absent or 0, the
#: link starts every queued transfer the moment it frees
HOST_LINK_DEPTH_KEY = "host_link_depth"


@dataclass(frozen=True)
class HostModel:
    """Host seconds of one engine: per MoE layer step (``layer_s``, plus the policy's
    ``decision_s``), per routed-expert access, per transfer queued (``submit_s``) and per
    transfer the link starts (``transfer_s``: the host issues the copy and sees it land);
    ``link_depth``, where >= 1, makes the host issue every transfer to the link
    (:class:`fmoesim.engine.sim.SimLink`'s ``host_depth``)."""

    layer_s: float = 0.0
    access_s: float = 0.0
    transfer_s: float = 0.0
    decision_s: float = 0.0
    submit_s: float = 0.0
    link_depth: int = 0

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec, policy: str) -> HostModel | None:
        """The host costs the profile measured for ``model`` (and ``policy``'s decision);
        None where it measured none."""
        m = (hw.measured or {}).get(model.name) or {}
        if not any(k in m for k in HOST_COST_KEYS):
            return None
        decisions = m.get("host_decision_s") or {}
        return cls(
            layer_s=float(m.get("host_layer_s", 0.0)),
            access_s=float(m.get("host_access_s", 0.0)),
            transfer_s=float(m.get("host_transfer_s", 0.0)),
            decision_s=float(decisions.get(policy, 0.0)),
            submit_s=float(m.get(HOST_SUBMIT_KEY, 0.0)),
            link_depth=int(m.get(HOST_LINK_DEPTH_KEY, 0)),
        )

    @property
    def gate_s(self) -> float:
        """Host seconds between a layer's gate and its first expert."""
        return self.layer_s + self.decision_s


class HostBoundSimBackend(SimBackend):
    """:class:`SimBackend` with the host's costs on the clock (see the module
    docstring).  The demand-only closed form does not know them: every layer step takes
    the general path."""

    def __init__(
        self,
        hw: HardwareSpec,
        compute: ComputeModel,
        caches: Sequence[ExpertCache],
        host: HostModel,
        preempt: bool = True,
        fifo: bool = False,
        reserve_at_start: bool = False,
    ) -> None:
        super().__init__(hw, compute, caches, preempt, fifo, reserve_at_start)
        # set on the instance (no class attribute here): in the compiled build the Runner
        # reads the compiled base's attribute, which a class attribute of this interpreted
        # subclass would shadow for Python only
        self.closed_form_demand = False
        self.host = host
        self.host_s = 0.0  # host seconds added to the clock
        self._issued = [0] * self.num_gpus  # per GPU: the link's starts already charged
        self._host_links = host.link_depth > 0
        for link in self.links:
            link.host_depth = host.link_depth

    def _host_point(self, gpu: int) -> None:
        """The host passes ``gpu``'s link now and issues what it can (a host-issued
        link only)."""
        if self._host_links:
            self.links[gpu].host_point(self._gpu_s[gpu] if self._in_experts else self.clock_s)

    def _spend(self, gpu: int, d: float) -> None:
        """``d`` host seconds now: on ``gpu``'s timeline inside the expert phase, else on
        the forward pass's clock."""
        if self._in_experts:
            self._gpu_s[gpu] += d
        else:
            self.clock_s += d
        self.host_s += d

    def _issue_started(self, gpu: int) -> None:
        """The issue cost of every transfer ``gpu``'s link started since the last host
        point: the host issued those copies on its way here."""
        started = self.links[gpu].started
        new = started - self._issued[gpu]
        if new:
            self._issued[gpu] = started
            self._spend(gpu, new * self.host.transfer_s)

    def pre_gate(self, layer: int, tokens: int, kv_tokens: int, pairs: int) -> None:
        """Attention + router, then the host reads the gate and decides, then sync."""
        for gpu in range(self.num_gpus):
            self._host_point(gpu)  # the host launches attention and router
        self._run(self._pre_gate_s(tokens, kv_tokens, pairs))
        self.sync()  # the copies started meanwhile were issued during attention
        for gpu in range(self.num_gpus):
            self._host_point(gpu)
            self._issue_started(gpu)
        g = self.host.gate_s
        self.clock_s += g
        self.host_s += g
        self.sync()
        for gpu in range(self.num_gpus):
            self._host_point(gpu)

    def expert(self, gpu: int, key: int, tokens: int, fraction: float = 1.0) -> None:
        """The host issues the expert, then its FFN runs (a segment's as
        :meth:`~fmoesim.engine.compute.ComputeModel.segment_s`)."""
        self._host_point(gpu)
        self._issue_started(gpu)
        self._gpu_s[gpu] += self.host.access_s
        self.host_s += self.host.access_s
        self._host_point(gpu)  # after the launch
        if fraction == 1.0:
            super().expert(gpu, key, tokens)
            return
        d = self.compute.segment_s(tokens, fraction)
        self._gpu_s[gpu] += d
        self.busy_compute_s += d

    def experts(
        self,
        gpu: int,
        tokens: list[int],
        fractions: list[float] | None = None,
        keys: list[int] | None = None,
    ) -> None:
        """The host issues each expert; their FFNs run.  On a host-issued link the host
        passes the link at each expert, its launch and its FFN one after the other
        (:meth:`expert`), as a host that launches expert after expert feeds its copy
        stream between launches: else the link would idle behind its issued transfers
        for the whole batch's compute."""
        if self._host_links:
            for i, t in enumerate(tokens):
                key = keys[i] if keys is not None else -1
                self.expert(gpu, key, t, 1.0 if fractions is None else fractions[i])
            return
        self._host_point(gpu)
        self._issue_started(gpu)
        d = self.host.access_s * len(tokens)
        self._gpu_s[gpu] += d
        self.host_s += d
        self._host_point(gpu)  # after the launches
        if fractions is None:
            super().experts(gpu, tokens, fractions, keys)
            return
        c = self.compute
        a, b = c.expert_a_s, c.expert_b_s
        d = 0.0
        for t, f in zip(tokens, fractions, strict=True):
            d += a + b * t if f == 1.0 else c.segment_s(t, f)
        self._gpu_s[gpu] += d
        self.busy_compute_s += d

    def submit(
        self,
        gpu: int,
        key: int,
        size_bytes: int,
        priority: float,
        reason: str,
        delay_s: float = 0.0,
    ) -> TransferRecord:
        """Queue the transfer, then the host spends its submission cost, and the issue
        cost if the link started it at once."""
        rec = super().submit(gpu, key, size_bytes, priority, reason, delay_s)
        self._host_point(gpu)
        self._spend(gpu, self.host.submit_s)
        self._issue_started(gpu)
        return rec

    def wait_any(self, gpu: int, keys: list[int]) -> int:
        """Wait as :class:`SimBackend` does; the copies the link started during the wait
        were issued by a host with nothing else to do (their cost overlaps the wait): on
        a host-issued link, each starts as the one before it lands."""
        self._host_point(gpu)
        self._issue_started(gpu)
        link = self.links[gpu]
        depth = link.host_depth
        link.host_depth = 0  # the waiting host issues each transfer as the last lands
        try:
            k = super().wait_any(gpu, keys)
        finally:
            link.host_depth = depth
        self._issued[gpu] = link.started
        return k

    def drain(self) -> None:
        """Let every transfer land (the host issues each as the one before it lands)."""
        for link in self.links:
            link.host_depth = 0
        super().drain()
