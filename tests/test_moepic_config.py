"""MoEpic's cache configurator (Algorithm 1): a hand-computed ExpertSplit on a 2-layer
toy, the statistics against their definitions, and properties of VramAllocation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.moepic_config import LayerStats, Timing, best_split, expert_split, vram_allocation


class FixedStats(LayerStats):
    """Statistics given directly (the toy of the hand computation)."""

    def __init__(self, H, P, PH, K):  # type: ignore[no-untyped-def]
        self._h, self._p, self._ph = (np.asarray(x, float) for x in (H, P, PH))
        self.L, self.N, self.K = self._p.shape[0], self._p.shape[1], K

    def H(self):  # type: ignore[no-untyped-def]
        return self._h

    def P(self):  # type: ignore[no-untyped-def]
        return self._p

    def PH(self):  # type: ignore[no-untyped-def]
        return self._ph


TOY = FixedStats(
    H=[[0, 0.6, 1.0], [0, 0.2, 1.0]],
    P=[[0.7, 0.3], [0.4, 0.6]],
    PH=[[[0, 0.5, 1], [0, 0.5, 1]], [[0, 0.2, 1], [0, 0.2, 1]]],
    K=1,
)
T = Timing(t_att_s=0.2, t_moe_s=0.5, t_head_s=0.3, t_load_s=1.0)


def test_expert_split_by_hand():
    """Layer 0, V = 1, window = head + attention = 0.5:
      C = 1, θ = 1: prefetch y0 costs (1 - .5) * 1 = .5 (fits), y1 would end at 1.0;
        m = 1 * .6 * 1 + .5 * .7 = .95
      C = 2, θ = .5: each prefetch (1 - 1 * .5) = .5, again one fits; m = .5 + .35 = .85
    -> C = 1, θ = 1; hide = .95 * .5 = .475, miss = .05 -> exposed 0;
       next window = (.5 - min(.475, .05)) + .2 = .65.
    Layer 1, V = .5:
      C = 1, θ = .5: a prefetch costs 1 - .2 * .5 = .9 > .65: none; m = .2 * .5 = .1
      C = 2, θ = .25: costs .75 > .65: none; m = 1 * .25 = .25
    -> C = 2, θ = .25; hide = .125, miss = .75 -> exposed .625."""
    m, C, th = best_split(1.0, 0.5, TOY.H()[0], TOY.P()[0], TOY.PH()[0], 1, 1.0)
    assert (m, C, th) == pytest.approx((0.95, 1, 1.0))
    exposed, theta, sizes = expert_split(np.array([1.0, 0.5]), TOY, T)
    np.testing.assert_allclose(exposed, [0.0, 0.625])
    np.testing.assert_allclose(theta, [1.0, 0.25])
    assert sizes.tolist() == [1, 2]


def test_no_budget_means_prefetch_only():
    m, C, th = best_split(0.0, 0.5, TOY.H()[0], TOY.P()[0], TOY.PH()[0], 1, 1.0)
    # nothing cached: one full prefetch (cost 1.0) does not fit in 0.5
    assert (m, C, th) == (0.0, 0, 0.0)
    m, C, th = best_split(0.0, 1.0, TOY.H()[0], TOY.P()[0], TOY.PH()[0], 1, 1.0)
    assert (m, C, th) == pytest.approx((0.7, 0, 0.0))


def test_statistics_follow_their_definitions():
    s = LayerStats(num_layers=1, num_experts=3, top_k=1)
    # token 1: expert 2 active; cache ranks (0 = best) 2 1 0 -> expert 2 has rank 0;
    # prediction ranks 1 0 2 -> expert 2 predicted third
    s.observe(0, np.array([2]), np.array([2, 1, 0]), np.array([1, 0, 2]))
    # token 2: expert 0 active, cache ranks 0 1 2, prediction ranks 0 1 2
    s.observe(0, np.array([0]), np.array([0, 1, 2]), np.array([0, 1, 2]))
    np.testing.assert_allclose(s.H()[0], [0, 1.0, 1.0, 1.0])  # both had cache rank 0
    np.testing.assert_allclose(s.P()[0], [0.5, 0.0, 0.5])  # predicted first once, third once
    # PH[y, C]: token 1: y0 = expert 1 (cache rank 1), y1 = expert 0 (rank 2), y2 = expert 2
    # (rank 0); token 2: y0 = expert 0 (rank 0), y1 = expert 1 (1), y2 = expert 2 (2)
    np.testing.assert_allclose(s.PH()[0], [[0, 0.5, 1, 1], [0, 0, 0.5, 1], [0, 0.5, 0.5, 1]])


@st.composite
def random_stats(draw):  # type: ignore[no-untyped-def]
    L = draw(st.integers(2, 5))
    N = draw(st.integers(2, 8))
    K = draw(st.integers(1, min(2, N)))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    s = LayerStats(L, N, K)
    for _ in range(draw(st.integers(1, 30))):
        for layer in range(L):
            act = rng.choice(N, size=K, replace=False)
            s.observe(layer, act, rng.permutation(N), rng.permutation(N))
    return s


@settings(max_examples=60, deadline=None)
@given(
    stats=random_stats(),
    V_e=st.floats(0.5, 20.0),
    zeta=st.sampled_from([0.01, 0.05, 0.1, 0.25]),
    t=st.tuples(*(st.floats(0.0, 2.0) for _ in range(3)), st.floats(0.01, 2.0)),
)
def test_vram_allocation_terminates_within_budget_and_never_worsens(stats, V_e, zeta, t):
    timing = Timing(*t)
    V, theta, sizes, moves = vram_allocation(V_e, zeta, stats, timing)
    assert V.sum() == pytest.approx(V_e)
    assert (V > 0).all()
    assert ((theta > 0) & (theta <= 1)).all()
    np.testing.assert_allclose(np.minimum(V / np.maximum(sizes, 1), 1.0), theta)
    uniform = expert_split(np.full(stats.L, V_e / stats.L), stats, timing)[0].sum()
    final = expert_split(V, stats, timing)[0].sum()
    assert final <= uniform + 1e-12
    if moves:
        assert final < uniform


def test_bad_knobs():
    with pytest.raises(ValueError, match="zeta"):
        vram_allocation(4.0, 1.5, TOY, T)
    with pytest.raises(ValueError, match="t_load_s"):
        Timing(0.1, 0.1, 0.1, -1.0)
