"""MoEpic (``002`` §3): split experts in the engine (hand-timed), the two degenerate
cases against the plain policies, reconfiguration, and the ablation presets."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fmoesim.config.schema import CONF_DIR
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.simulate import simulate
from fmoesim.trace import read_trace
from fmoesim.trace.reader import Trace
from policies.base import BatchInfo, GateView, PolicyContext
from policies.lcp import LCP
from policies.moepic import MoEpic, applied_split
from policies.pregated import PreGated
from tests._baseline_helpers import context, write_one_token_trace
from tests.test_policy_contract import MODEL
from tests.tiny import TINY_HW, small_model, write_sequence_trace

ONE = small_model(1, 3, 1)  # one MoE layer of 3 experts, top-1; a 6 MB expert
S = ONE.expert_size_bytes


def test_a_cached_top_computes_while_its_bottom_loads(tmp_path):
    """θ = 0.25, a buffer of one expert, room for two tops; no prefetch, no start set.
    Tokens route to experts 0, 1, 0.  X = one expert over PCIe, ov = fixed cost, t =
    one expert's compute.
      pass 0: expert 0 has nothing: its top (X/4) and bottom (3X/4) load on demand, top
        first; the GPU waits ov + X/4, computes t/4, waits for the bottom (lands at
        2 ov + X) and computes 3t/4: stall 2 ov + X - t/4.
      pass 1: the same for expert 1; its top joins (two fit), its bottom evicts expert 0's
        (the buffer holds one 3X/4 bottom).
      pass 2: expert 0's top is cached, its bottom is not: a MISS that loads only the
        bottom while the top computes: stall ov + 3X/4 - t/4.
    """
    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0], [1], [0]], model=ONE))
    pol = MoEpic(
        split_ratio=0.25, prefetch="none", configurator=False, warm_start=False, buffer_experts=1
    )
    r = simulate(tr, ONE, TINY_HW, pol, int(1.5 * S))
    assert pol.cache_groups() == {-1: S, 0: 2 * (S // 4)}
    n = ONE.num_layers * ONE.num_experts
    top, bot = S // 4, S - S // 4
    log = [(t.key, t.size_bytes, t.reason) for t in r.transfers]
    assert log == [
        (n + 0, top, "on_demand"),
        (2 * n + 0, bot, "on_demand"),
        (n + 1, top, "on_demand"),
        (2 * n + 1, bot, "on_demand"),
        (2 * n + 0, bot, "on_demand"),
    ]
    assert (r.summary["hits"], r.summary["misses"]) == (0, 3)
    X = S / TINY_HW.pcie_bytes_per_s
    ov = TINY_HW.transfer_overhead_s
    t = ComputeModel.from_specs(ONE, TINY_HW).expert_s(1)
    want = 2 * (2 * ov + X - t / 4) + (ov + 0.75 * X - t / 4)
    assert r.summary["stall_s"] == pytest.approx(want, rel=1e-9)
    cache = r.caches[0]
    assert cache.group_used == {-1: bot, 0: 2 * top}


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("moepic") / "trace"
    return write_one_token_trace(path, MODEL, 5, 16, embedding_dim=0, seed=11)


def test_theta_one_without_prefetch_is_lcp_with_a_cache_per_layer(trace):
    """§2.3: θ = 1 and prefetching off is the cache-only approach: whole experts cached
    per layer under LCP, the same hits layer by layer as LCP with ``experts_per_layer``."""
    L, K = MODEL.num_layers, MODEL.top_k
    size = MODEL.expert_size_bytes
    for C in (2, 3, 5):
        pol = MoEpic(
            split_ratio=1.0,
            prefetch="none",
            configurator=False,
            warm_start=False,
            buffer_experts=K,
        )
        a = simulate(trace, MODEL, TINY_HW, pol, (L * C + K) * size, timing=False)
        b = simulate(trace, MODEL, TINY_HW, LCP(), L * C * size, timing=False, experts_per_layer=C)
        np.testing.assert_array_equal(a.metrics.acc, b.metrics.acc)
        assert a.summary["hits"] > 0


def test_theta_zero_is_prefetch_only_like_pregated(trace):
    """§2.3: θ = 0 caches nothing: every expert goes through the buffer, prefetched by the
    speculative prediction, as Pre-gated MoE does.  With a buffer of 2K experts both
    prefetch the K most probable experts of the next layer; MoEpic also predicts layer 0
    from the previous token, so layers 1.. must match exactly."""
    K = MODEL.top_k
    size = MODEL.expert_size_bytes
    pol = MoEpic(split_ratio=0.0, configurator=False, buffer_experts=2 * K)
    # the decisions alone (an infinitely fast link): on a real link MoEpic's extra layer-0
    # prefetches delay the others, so layers 1.. would differ by the link, not the choice
    kw = dict(timing=False, landing="next_step")
    a = simulate(trace, MODEL, TINY_HW, pol, 2 * K * size, **kw)
    b = simulate(trace, MODEL, TINY_HW, PreGated(prefetch_experts=K), 2 * K * size, **kw)
    n = MODEL.num_layers * MODEL.num_experts
    assert all(t.key < n for t in a.transfers)  # whole experts only
    np.testing.assert_array_equal(a.metrics.acc[1:], b.metrics.acc[1:])
    assert a.metrics.acc[0][0] >= b.metrics.acc[0][0]  # layer 0 predicted as well


def test_reconfiguration_moves_budget_and_keeps_the_total(trace):
    size = MODEL.expert_size_bytes
    K = MODEL.top_k
    budget = 14 * size
    pol = MoEpic(tau_tokens=20)
    r = simulate(trace, MODEL, TINY_HW, pol, budget)
    assert pol.configurations >= 2
    rep = pol.report()
    assert (rep["configurations"] == pol.configurations).all()  # reported per run
    V_e = (budget - K * size) / size  # the default buffer: K experts (§4.1)
    assert rep["budget_experts"].sum() == pytest.approx(V_e)
    assert (rep["budget_experts"] > 0).all()
    reasons = {t.reason for t in r.transfers}
    assert "configure" in reasons  # the start set and the reconfigurations use the link
    cache = r.caches[0]
    groups = pol.cache_groups()
    assert {g: cache.group_budget[g] for g in groups} == groups
    assert sum(groups.values()) <= budget
    # what the configurator asked for is what the cache enforces
    for i in range(MODEL.num_layers):
        tb = round(rep["split_ratio"][i] * size)
        assert groups[i] == rep["cached_tops"][i] * tb
        assert cache.group_used[i] <= groups[i]


def test_applied_split_keeps_algorithm_1s_cache_sizes():
    """Mixtral 2-bit's expert of 66,404,352 B, V = 3.795 experts, C = 4 (θ = V / C =
    0.94875): θ S = 63,001,128.96 B rounds up to 63,001,129, and four such tops need 4 B
    more than V S = 252,004,515.84 B, so floor(V S / round(θ S)) caches 3.  Tops of
    floor(V S / C) = 63,001,128 B fit all four.  A whole expert stays whole, C = 0 keeps
    θ, C is capped at E.  Red if the cache size is recomputed from a rounded θ, or a top
    of C_i no longer fits V_i."""
    S2 = 66_404_352
    V = np.array([3.795, 2.0, 0.0, 9.0])
    theta = np.array([3.795 / 4, 1.0, 0.0, 1.0])
    th, sizes = applied_split(V, np.array([4, 2, 0, 9]), theta, S2, 8)
    assert sizes.tolist() == [4, 2, 0, 8]
    assert round(th[0] * S2) == 63_001_128 and 4 * round(th[0] * S2) <= 3.795 * S2
    assert int(3.795 * S2 // round(theta[0] * S2)) == 3  # the rounded θ's count
    assert th[1:].tolist() == [1.0, 0.0, 1.0]


def test_same_seed_same_run(trace):
    size = MODEL.expert_size_bytes
    runs = [
        simulate(trace, MODEL, TINY_HW, MoEpic(tau_tokens=30, cache="rnd"), 12 * size, seed=3)
        for _ in range(2)
    ]
    assert runs[0].summary["tpot_mean_s"] == runs[1].summary["tpot_mean_s"]
    assert [t.key for t in runs[0].transfers] == [t.key for t in runs[1].transfers]


def test_kept_ranks_are_eq4s_order(trace):
    """The ranks MoEpic keeps per expert (updated on each activation) are LCP's eq. 4
    order at the end of a run: ``log mu + at log(1/rho) / omega`` recomputed from its
    counters, a distinct activation number as the tie-break, and the same best expert
    per layer as :meth:`MoEpic.priorities` (eq. 4 itself).  A rank left stale by an
    activation, or a wrong term, fails it."""
    pol = MoEpic(tau_tokens=30)
    simulate(trace, MODEL, TINY_HW, pol, 12 * MODEL.expert_size_bytes)
    n, E = MODEL.num_layers * MODEL.num_experts, MODEL.num_experts
    assert (pol._mu > 0).sum() > n // 2
    seqs = []
    for k in range(n):
        mu = pol._mu[k]
        s = math.log(mu) + pol._at[k] * (-math.log(pol.rho) / pol.omega) if mu > 0 else -math.inf
        rank = pol._rank(k)
        assert rank[0] == s and rank[2] == k and (rank[1] >= 0) == (mu > 0)
        seqs += [rank[1]] if mu > 0 else []
    assert len(set(seqs)) == len(seqs) and max(seqs) == pol._seq - 1  # the latest activation
    for layer in range(MODEL.num_layers):
        prio = pol.priorities(layer)
        if (prio == prio.max()).sum() == 1:
            best = max(range(E), key=lambda e: pol._rank(layer * E + e))
            assert best == int(prio.argmax())


def test_speculative_prefetch_goes_by_probability_then_expert_id():
    """The next layer's experts are prefetched in falling speculative probability, ties
    by expert id, while the buffer has room (four experts here)."""
    model = small_model(2, 8, 2)
    pol = MoEpic(split_ratio=0.0, configurator=False, warm_start=False, buffer_experts=4)
    pol.reset(
        PolicyContext(
            model=model, budget_bytes=6 * model.expert_size_bytes,
            expert_size_bytes=model.expert_size_bytes, rng=np.random.default_rng(0),
        )
    )  # fmt: skip
    pol.on_iteration_start(BatchInfo(1, (0,), (1,), 1, False))
    spec = np.array([0.1, 0.3, 0.05, 0.3, 0.0, 0.2, 0.3, 0.05], dtype=np.float32)
    acts = pol.on_gate(0, GateView(0, np.array([1, 1, 0, 0, 0, 0, 0, 0]), 1, None, spec))
    E = model.num_experts
    assert [p.key - E for p in acts.prefetch] == [1, 3, 6, 5]


def test_each_gpu_buffer_takes_the_guesses_of_its_own_experts():
    """With experts round-robin over two GPUs, each GPU's buffer of K = 2 experts takes
    the most probable guesses among its own experts: odd 1 and 3 on GPU 1, even 6 and 0
    on GPU 0 (order 1, 3, 6, 5, 0, ...; 5 finds GPU 1 full).  One GPU takes 1 and 3.
    Red if the GPUs share one buffer's room (two guesses in all on two GPUs)."""
    model = small_model(2, 8, 2)
    spec = np.array([0.1, 0.3, 0.05, 0.3, 0.0, 0.2, 0.3, 0.05], dtype=np.float32)
    E = model.num_experts
    for gpus, want in ((1, [1, 3]), (2, [1, 3, 6, 0])):
        pol = MoEpic(split_ratio=0.0, configurator=False, warm_start=False)
        pol.reset(context(model, 6, num_gpus=gpus))
        pol.on_iteration_start(BatchInfo(1, (0,), (1,), 1, False))
        acts = pol.on_gate(0, GateView(0, np.array([1, 1, 0, 0, 0, 0, 0, 0]), 1, None, spec))
        assert [p.key - E for p in acts.prefetch] == want, gpus


def test_each_gpu_caches_tops_of_its_own_experts():
    """14 experts a GPU less a buffer of 2 leave 3 a layer over 4 layers: at θ = 0.5
    that is 6 tops a layer on one GPU, and on two GPUs each holds 4 of a layer's 8
    experts, so it caches all 4 of its own (8 tops a layer in all).  Red if the tops
    are drawn from the whole layer (6 a layer, unevenly over the GPUs) or capped at the
    layer's 8 on each GPU."""
    model = small_model(4, 8, 2)
    E, n = model.num_experts, model.num_layers * model.num_experts
    for gpus, per_gpu in ((1, [6]), (2, [4, 4])):
        pol = MoEpic(configurator=False)
        pol.reset(context(model, 14, num_gpus=gpus))
        acts = pol.on_iteration_start(BatchInfo(1, (0,), (1,), 1, False))
        assert acts is not None
        for i in range(model.num_layers):
            tops = [p.key - n - i * E for p in acts.prefetch if (p.key - n) // E == i]
            assert [sum(e % gpus == g for e in tops) for g in range(gpus)] == per_gpu


def test_the_configurator_plans_each_gpus_share_of_the_model(trace):
    """Two GPUs, 20 experts each: Algorithm 1 plans the model's 36 experts of tops and
    each GPU gets half of every layer's, so a GPU's layer budgets still sum to its 18
    and no layer caches more tops than the 4 of its experts a GPU holds.  Red if a
    GPU's plan is the model's (tops beyond 4 a layer, budget the GPU cannot use)."""
    import dataclasses

    size = MODEL.expert_size_bytes
    pol = MoEpic(tau_tokens=20)
    r = simulate(trace, MODEL, dataclasses.replace(TINY_HW, num_gpus=2), pol, 20 * size)
    assert pol.configurations >= 2
    rep = pol.report()
    assert rep["budget_experts"].sum() == pytest.approx(20 - MODEL.top_k)
    cap = -(-MODEL.num_experts // 2)
    assert (rep["cached_tops"] <= cap).all() and (rep["cached_tops"] > 0).all()
    for cache in r.caches:
        for i in range(MODEL.num_layers):
            assert cache.group_used[i] <= cache.group_budget[i]


@pytest.mark.parametrize(
    ("name", "knobs"),
    [
        ("moepic", {}),
        ("moepic-no-sp", {"prefetch": "random"}),
        ("moepic-no-lcp", {"cache": "rnd"}),
        ("moepic-no-cca", {"configurator": False}),
    ],
)
def test_ablation_presets(name, knobs):
    pol = instantiate(OmegaConf.load(Path(CONF_DIR) / "policy" / f"{name}.yaml"))
    assert isinstance(pol, MoEpic) and pol.name == name
    for k, v in knobs.items():
        assert getattr(pol, k) == v


def test_bad_knobs():
    with pytest.raises(ValueError, match="split_ratio"):
        MoEpic(split_ratio=1.5)
    with pytest.raises(ValueError, match="prefetch"):
        MoEpic(prefetch="oracle")
    with pytest.raises(ValueError, match="zeta"):
        MoEpic(zeta=0.0)


def test_experts_of_several_sizes_are_refused_with_one_line(trace):
    """Red if a model whose layers' experts differ in size (an imported trace may record
    them) runs MoEpic, whose buffer and tops are sized from the mean expert: a layer above
    it does not fit the buffer and the run stopped mid-way with a RuntimeError."""
    from dataclasses import replace

    from fmoesim.errors import ConfigError

    big, small = 2 * MODEL.expert_size_bytes, MODEL.expert_size_bytes // 2
    sizes = [big] + [small] * (MODEL.num_layers - 1)
    model = replace(MODEL, expert_size_bytes_by_layer=sizes)
    with pytest.raises(ConfigError, match="moepic needs one expert size in every layer"):
        simulate(trace, model, TINY_HW, MoEpic(), MODEL.num_experts * MODEL.num_layers * big)
