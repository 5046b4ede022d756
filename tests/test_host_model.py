"""The host-bound timing model (:mod:`fmoesim.engine.host`): a measured profile's host
costs on the clock, by hand, and nowhere else."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fmoesim.engine import simulate
from fmoesim.engine.host import HostBoundSimBackend, HostModel
from fmoesim.engine.serving import ServingConfig
from policies.base import Policy
from policies.lfu import LFU
from policies.lru import LRU
from tests._engine_helpers import Req, write_trace
from tests.test_compute_by_hand import (
    HAND,
    HAND_HW,
    REL,
    attention_s,
    dense_s,
    expert_s,
    lm_head_s,
    router_s,
    shared_s,
)

LAYER_S, ACCESS_S, TRANSFER_S = 3e-6, 5e-6, 7e-6
DECISION = {"lru": 11e-6, "lfu": 13e-6}
HOST = {"host_layer_s": LAYER_S, "host_access_s": ACCESS_S, "host_transfer_s": TRANSFER_S,
        "host_decision_s": DECISION}  # fmt: skip


def _hw(extra: dict[str, object]):
    return replace(HAND_HW, measured={HAND.name: dict(extra)})


def test_the_host_model_reads_the_profile_of_the_model_and_policy():
    """Red if another model's or another policy's costs are taken, or if a profile with
    no host costs turns the host-bound backend on."""
    hm = HostModel.from_specs(HAND, _hw(HOST), "lfu")
    assert hm == HostModel(LAYER_S, ACCESS_S, TRANSFER_S, 13e-6)
    assert hm.gate_s == pytest.approx(LAYER_S + 13e-6)
    assert HostModel.from_specs(HAND, _hw(HOST), "fmoe").decision_s == 0.0
    assert HostModel.from_specs(replace(HAND, name="other"), _hw(HOST), "lru") is None
    assert HostModel.from_specs(HAND, _hw({"expert_a_s": 1e-5}), "lru") is None
    assert HostModel.from_specs(HAND, HAND_HW, "lru") is None
    only = HostModel.from_specs(HAND, _hw({"host_submit_s": 2e-6}), "lru")
    assert only == HostModel(submit_s=2e-6)  # a submission cost alone turns it on


def test_decode_steps_pay_the_gate_and_every_access_by_hand(tmp_path):
    """The tiny trace of test_compute_by_hand (two requests in a batch of 2, every decode
    a hit in both MoE layers, two experts each): each decode iteration's MoE layer adds
    the gate's host cost (layer + LRU's decision) and two access costs to the GPU-bound
    time; the dense layer and the LM head add none; the prefill's four on-demand loads
    each add a transfer cost.  Red if the decision is skipped or charged per access, if
    the access cost is charged per layer, or if the dense layer pays a gate."""
    a = Req(0, 3, [[[0, 1], [2, 3]]] * 3)
    b = Req(1, 2, [[[0, 1], [2, 3]]] * 2)
    tr = write_trace(tmp_path / "t", HAND, [a, b])
    gate = LAYER_S + DECISION["lru"]
    moe1 = attention_s(2, 5, 7) + router_s(2) + shared_s(2) + 2 * expert_s(2)
    t1 = attention_s(2, 5, 7) + dense_s(2) + 2 * moe1 + lm_head_s(2)
    moe2 = attention_s(1, 4, 5) + router_s(1) + shared_s(1) + 2 * expert_s(1)
    t2 = attention_s(1, 4, 5) + dense_s(1) + 2 * moe2 + lm_head_s(1)
    host_step = 2 * (gate + 2 * ACCESS_S)  # two MoE layers per iteration
    serving = ServingConfig(batch_size=2)
    r = simulate(tr, HAND, _hw(HOST), LRU(), 8 * 49_152, serving=serving)
    base = simulate(tr, HAND, HAND_HW, LRU(), 8 * 49_152, serving=serving)
    req = r.metrics.request_table()
    assert req["tpot_s"].tolist() == pytest.approx(
        [(t1 + t2) / 2 + host_step, t1 + host_step], rel=REL
    )
    # the same decisions; the host's time is not GPU time
    s, s0 = r.summary, base.summary
    assert (s["hits"], s["late"], s["misses"]) == (s0["hits"], s0["late"], s0["misses"])
    assert s["gpu_busy_s"] == pytest.approx(s0["gpu_busy_s"], rel=REL)
    # every layer step's gate, every access, every transfer: 3 iterations x 2 layers,
    # 2 accesses each, 4 loads
    host_total = 6 * gate + 12 * ACCESS_S + 4 * TRANSFER_S
    assert s["simulated_s"] - s0["simulated_s"] >= 6 * gate + 8 * ACCESS_S
    assert s["simulated_s"] - s0["simulated_s"] <= host_total + 1e-12


def test_a_profile_without_host_costs_keeps_the_gpu_bound_backend(tmp_path, monkeypatch):
    """Red if the paper testbeds' presets (no host costs) leave the exact closed-form
    GPU-bound timing, or if a host profile keeps it (its clock would miss the costs); in
    the compiled build, red if the host backend says so only in a class attribute, which
    the compiled Runner does not read."""
    seen = []
    init = HostBoundSimBackend.__init__

    def spy(self, *a, **k):
        init(self, *a, **k)
        seen.append(self.closed_form_demand)

    monkeypatch.setattr(HostBoundSimBackend, "__init__", spy)
    a = Req(0, 3, [[[0, 1], [2, 3]]] * 2)
    tr = write_trace(tmp_path / "t", HAND, [a])
    simulate(tr, HAND, HAND_HW, LFU(), 8 * 49_152)
    assert seen == []
    r = simulate(tr, HAND, _hw(HOST), LFU(), 8 * 49_152)
    assert seen == [False]
    assert (
        r.summary["simulated_s"]
        > simulate(tr, HAND, HAND_HW, LFU(), 8 * 49_152).summary["simulated_s"]
    )


def test_queued_transfers_pay_their_submission_and_started_ones_their_issue():
    """By hand on the backend: a transfer the idle link starts at once costs submission +
    issue; one queued behind it costs its submission, and its issue at the first host
    point after the link starts it; a cancelled one costs its submission only; one the
    link starts while the GPU waits costs no issue (the waiting host issues it).  Red if
    the issue is charged per submission (BrainStorm's cancelled prefetches would cost a
    copy each), twice, or never."""
    from fmoesim.engine.cache import ExpertCache
    from fmoesim.engine.compute import ComputeModel

    S, T, A = 0.2e-6, 1e-6, 0.5e-6  # each well under a copy (20 us)
    size = HAND.expert_size_bytes
    cache = ExpertCache(8 * size, _Keep())
    be = HostBoundSimBackend(
        HAND_HW, ComputeModel.from_specs(HAND, HAND_HW), [cache],
        HostModel(access_s=A, transfer_s=T, submit_s=S),
    )  # fmt: skip

    def submit(key):
        assert cache.admit(key, size, "prefetch")
        cache.entries[key].record = be.submit(0, key, size, 1.0, "prefetch")

    submit(0)  # the idle link starts it at once
    assert be.host_s == pytest.approx(S + T)
    submit(1)
    submit(2)  # both queued behind 0
    assert be.host_s == pytest.approx(3 * S + T)
    assert be.cancel(0, 1)
    be.idle_until(21e-6)  # 0 landed at 20.2 us and 2 started (it lands at 40.2 us)
    be.pre_gate(0, 1, 1, 1)  # 14 us of compute; then the host pays the issue of 2
    assert be.host_s == pytest.approx(3 * S + 2 * T)
    submit(3)  # queued behind 2
    be.begin_experts(0, 1)
    assert be.wait_any(0, [3]) == 3  # 2 lands and 3 starts during the wait
    be.expert(0, 3, 1)
    assert be.host_s == pytest.approx(4 * S + 2 * T + A)
    assert be.links[0].started == 3


def test_the_host_bound_backend_computes_a_segment_with_every_launch_by_hand():
    """The replay launches each segment of a split expert as its own FFN: on the
    host-bound backend a 40% segment costs an access and
    :func:`tests.test_compute_by_hand.segment_s`, alone or among whole experts, while the
    GPU-bound backend keeps 40% of the whole expert.  Red if the host-bound backend
    charges the segment its fraction of the launches, a whole expert pays a segment's
    cost, or the GPU-bound backend changes."""
    from fmoesim.engine.cache import ExpertCache
    from fmoesim.engine.compute import ComputeModel
    from fmoesim.engine.sim import SimBackend
    from tests.test_compute_by_hand import segment_s

    A = 0.5e-6
    compute = ComputeModel.from_specs(HAND, HAND_HW)
    host = HostBoundSimBackend(HAND_HW, compute, [ExpertCache(1, LRU())], HostModel(access_s=A))
    gpu = SimBackend(HAND_HW, compute, [ExpertCache(1, LRU())])
    for be in (host, gpu):
        be.begin_experts(0, 1)
    t0 = host._gpu_s[0]
    host.expert(0, 0, 3, 0.4)
    assert host._gpu_s[0] - t0 == pytest.approx(A + segment_s(3, 0.4), rel=REL)
    t0 = host._gpu_s[0]
    host.experts(0, [3, 2, 5], [1.0, 0.4, 0.6], [0, 1, 2])
    want = 3 * A + expert_s(3) + segment_s(2, 0.4) + segment_s(5, 0.6)
    assert host._gpu_s[0] - t0 == pytest.approx(want, rel=REL)
    t0 = gpu._gpu_s[0]
    gpu.expert(0, 0, 3, 0.4)
    gpu.experts(0, [2, 5], [0.4, 0.6], [1, 2])
    want = 0.4 * expert_s(3) + 0.4 * expert_s(2) + 0.6 * expert_s(5)
    assert gpu._gpu_s[0] - t0 == pytest.approx(want, rel=REL)


class _Keep(Policy):
    """A policy for caches that never fill: it has no victim."""

    name = "keep"

    def victim(self, candidates, incoming):
        raise AssertionError("no eviction here")


def _link(depth: int):
    """A host-issued link of ``depth`` over which a transfer takes 20 us (10 us of fixed
    cost and 10 us of bytes), landing into a collector."""
    from fmoesim.engine.sim import SimLink

    landed: list[int] = []
    link = SimLink(HAND_HW.pcie_bytes_per_s, HAND_HW.transfer_overhead_s, HAND_HW.chunk_bytes,
                   True, on_done=landed.append)  # fmt: skip
    link.host_depth = depth
    return link, landed


def _record(key: int, t_s: float = 0.0):
    from fmoesim.engine.backend import TransferRecord

    return TransferRecord(key, 0, HAND.expert_size_bytes, "prefetch", 1.0, t_s)


def test_a_host_issued_link_starts_a_transfer_only_when_the_host_issues_it():
    """By hand, 20 us a transfer.  At 0 the idle link starts A at once, and the host
    issues B behind it (depth 2: the copy engine holds the running transfer and one
    more); C and D stay queued.  B, issued, can no longer be cancelled or re-ranked; D,
    queued, can.  A lands at 20 and B starts at once; B lands at 40 and the link waits,
    with C queued, for the host's next point at 55.  The same submissions on a link that
    starts each transfer the moment it frees (depth 0) start C at 40.  Red if an issued
    transfer waits for the host, a queued one does not, the depth is ignored, or an
    issued one is cancelled."""
    link, landed = _link(2)
    a, b, c, d = (_record(k) for k in range(4))
    for r in (a, b, c, d):
        link.submit(r, 0.0)
    link.host_point(0.0)
    assert a.start_s == 0.0 and link.issued == [b]
    assert not link.cancel(b)
    link.reprioritize(b, 9.0)
    assert b.link_priority == 1.0
    assert link.cancel(d)
    link.advance(50e-6)
    assert landed == [0, 1] and b.start_s == pytest.approx(20e-6)
    assert link.cur is None and c.start_s != c.start_s  # queued, not started (NaN)
    link.host_point(55e-6)
    assert c.start_s == pytest.approx(55e-6) and link.issued == []
    link.host_depth = 0  # a draining host issues each as the last lands
    link.advance(float("inf"))
    assert landed == [0, 1, 2] and c.end_s == pytest.approx(75e-6)

    free, _ = _link(0)
    rs = [_record(k) for k in range(3)]
    for r in rs:
        free.submit(r, 0.0)
    free.advance(float("inf"))
    assert [r.start_s for r in rs] == pytest.approx([0.0, 20e-6, 40e-6])


def test_with_a_link_depth_the_host_issues_transfers_at_its_own_points_by_hand():
    """A host-bound backend whose profile has ``host_link_depth`` 2 (no host costs but
    45 us a launch): three on-demand loads queued at 0 before the expert phase; A starts,
    B is issued behind it (the submission is a host point), C waits.  The GPU computes
    two resident experts (host points at each launch and after it), then waits for C.
    The host issues C at its first point after B starts (20 us), when the copy engine
    has room: here after the first launch (the shared expert's time plus 45 us), after B
    landed at 40, so C starts there (at 40 on a link that does not wait for the host).
    Red if the link starts C when B lands, or only when the wait begins."""
    from fmoesim.engine.cache import ExpertCache
    from fmoesim.engine.compute import ComputeModel

    size = HAND.expert_size_bytes
    A = 45e-6
    e = expert_s(1)

    def run(depth):
        cache = ExpertCache(8 * size, _Keep())
        be = HostBoundSimBackend(
            HAND_HW, ComputeModel.from_specs(HAND, HAND_HW), [cache],
            HostModel(access_s=A, link_depth=depth),
        )  # fmt: skip
        for key in (10, 11):  # resident
            assert cache.admit(key, size, "prefetch")
            cache.complete(key)
        recs = []
        for key in (0, 1, 2):
            assert cache.admit(key, size, "on_demand")
            recs.append(be.submit(0, key, size, 0.0, "on_demand"))
            cache.entries[key].record = recs[-1]
        be.begin_experts(0, 1)
        be.expert(0, 10, 1)
        be.expert(0, 11, 1)
        assert be.wait_any(0, [2]) == 2
        return recs

    h = shared_s(1)  # the shared expert runs before the expert phase
    points = [h, h + A, h + A + e, h + 2 * A + e, h + 2 * A + 2 * e]  # the wait's last
    c_start = max(40e-6, next(p for p in points if p >= 20e-6))
    host = run(2)
    assert [r.start_s for r in host[:2]] == pytest.approx([0.0, 20e-6])
    assert host[2].start_s == pytest.approx(c_start)
    free = run(0)
    assert free[2].start_s == pytest.approx(40e-6)
    assert c_start > 40e-6  # the test separates the two


def test_a_batch_of_experts_lets_the_host_issue_transfers_at_each_launch_by_hand():
    """The same host-issued link (depth 2, 45 us a launch, 20 us a transfer), four
    transfers queued at 0 and four resident experts computed as one batch
    (``experts``), as the runner computes a layer's resident experts.  A starts at 0 and
    B, issued behind it, at 20; B lands at 40.  A host that launches expert after expert
    passes the link at each launch: the first launch ends at the shared expert's time
    plus 45 us, where C starts and D is issued behind it (D starts as C lands).  The
    batch takes four launches and four FFNs, as four single experts do.  Red if the host
    passes the link only before and after the whole batch (C would wait for the fourth
    launch), or the batch's time changes."""
    from fmoesim.engine.cache import ExpertCache
    from fmoesim.engine.compute import ComputeModel

    size = HAND.expert_size_bytes
    A = 45e-6
    cache = ExpertCache(16 * size, _Keep())
    be = HostBoundSimBackend(HAND_HW, ComputeModel.from_specs(HAND, HAND_HW), [cache],
                             HostModel(access_s=A, link_depth=2))  # fmt: skip
    resident = [10, 11, 12, 13]
    for key in resident:
        assert cache.admit(key, size, "prefetch")
        cache.complete(key)
    recs = []
    for key in (0, 1, 2, 3):
        assert cache.admit(key, size, "on_demand")
        recs.append(be.submit(0, key, size, 0.0, "on_demand"))
        cache.entries[key].record = recs[-1]
    be.begin_experts(0, 1)
    t0 = be._gpu_s[0]
    be.experts(0, [1, 1, 1, 1], None, resident)
    assert be._gpu_s[0] - t0 == pytest.approx(4 * A + 4 * expert_s(1), rel=REL)
    c = shared_s(1) + A  # the first launch's end: B landed at 40, so the link is free
    assert [r.start_s for r in recs] == pytest.approx([0.0, 20e-6, c, c + 20e-6])
