"""Hit-rate-only mode's landing rule (``engine.landing``) against hand-computed cases.

With ``landing="link"`` a prefetch is resident once its bytes have crossed the link in
the modelled compute since it was issued, behind the prefetches queued before it; with
``landing="next_step"`` it is resident at the next layer step whatever its size.  The
gap between a prefetch issued after layer 0's router and its use after layer 1's router
is layer 0's expert compute plus layer 1's attention and router (the ComputeModel terms,
as in ``tests/test_engine_timing.py``).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.simulate import simulate
from fmoesim.errors import ConfigError
from policies.base import Outcome
from tests._engine_helpers import Req, ScheduledPrefetch, pre_gate_s, transfer_s, write_trace
from tests.tiny import TINY, TINY_HW

SIZE = TINY.expert_size_bytes
TINY2 = replace(TINY, top_k=2)
C = ComputeModel.from_specs(TINY2, TINY_HW)
P = 1  # prompt tokens
#: iteration 0 loads layer 0's experts 0, 1 and layer 1's 0, 3; iteration 1 hits layer 0
#: and needs layer 1's experts 1 and 2 (keys 5 and 6), both prefetched at step 2 (its
#: layer 0)
ROUTES = [[[0, 1], [0, 3]], [[0, 1], [1, 2]]]
GAP_S = 2 * C.expert_s(1) + pre_gate_s(C, [(P, 1)])


def _hw(t_x: float):
    ov = 1e-6
    hw = replace(TINY_HW, transfer_overhead_s=ov, pcie_gbps=SIZE / (t_x - ov) / 1e9)
    assert transfer_s(hw, TINY2) == pytest.approx(t_x, rel=1e-12)
    return hw


def _outcomes(tmp_path, hw, landing: str, schedule) -> list[int]:
    tr = write_trace(tmp_path / "t", TINY2, [Req(0, P, ROUTES)])
    r = simulate(
        tr,
        TINY2,
        hw,
        ScheduledPrefetch(schedule),
        8 * SIZE,
        timing=False,
        landing=landing,
        access_log=True,
    )
    assert math.isnan(r.summary["ttft_mean_s"])  # still no time reported
    return [int(o) for o in r.accesses["outcome"][-2:]]  # layer 1 of iteration 1


@pytest.mark.parametrize("factor", [0.3, 0.9, 1.1, 3.0])
def test_one_prefetch_lands_when_its_bytes_fit_the_gap(tmp_path, factor):
    # a transfer shorter than the gap is a HIT, a longer one is LATE (the bug this
    # catches: a transfer landing at the next step whatever its size)
    out = _outcomes(tmp_path, _hw(factor * GAP_S), "link", {2: [5]})
    want = Outcome.HIT if factor < 1 else Outcome.LATE
    assert out == [int(want), int(Outcome.MISS)]  # key 6 was never prefetched


def test_prefetches_queue_on_the_link(tmp_path):
    # two prefetches of 0.6 gap each: the first ends at 0.6 gap (HIT), the second at
    # 1.2 gap (LATE); a link that moved both at once would make both HITs
    out = _outcomes(tmp_path, _hw(0.6 * GAP_S), "link", {2: [5, 6]})
    assert out == [int(Outcome.HIT), int(Outcome.LATE)]


def test_issued_two_layers_ahead_has_two_layers_of_compute(tmp_path):
    # issued at step 1 (iteration 0's layer 1) for step 3: the gap grows by layer 1's
    # experts, the LM head and iteration 1's layer 0 (attention, router, experts)
    gap2 = GAP_S + 2 * C.expert_s(1) + C.lm_head_s(1) + pre_gate_s(C, [(P, 1)])
    hw = _hw(0.5 * (GAP_S + gap2))  # longer than one gap, shorter than the two
    assert _outcomes(tmp_path, hw, "link", {2: [5]})[0] == int(Outcome.LATE)
    assert _outcomes(tmp_path, hw, "link", {1: [5]})[0] == int(Outcome.HIT)


@pytest.mark.parametrize("factor", [0.3, 3.0])
def test_next_step_lands_whatever_the_size(tmp_path, factor):
    # the infinitely fast link: both prefetches are HITs at any transfer time
    out = _outcomes(tmp_path, _hw(factor * GAP_S), "next_step", {2: [5, 6]})
    assert out == [int(Outcome.HIT), int(Outcome.HIT)]


def test_unknown_landing_is_refused(tmp_path):
    tr = write_trace(tmp_path / "t", TINY2, [Req(0, P, ROUTES)])
    with pytest.raises(ConfigError, match="engine.landing"):
        simulate(tr, TINY2, TINY_HW, ScheduledPrefetch({}), 8 * SIZE, timing=False, landing="x")
