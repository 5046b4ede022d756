"""MoE-Infinity (``003`` §4-§5): the EAMC (Fig. 5), prefetch priorities (Fig. 7), the
integrated cache (Fig. 8c), persistence, the switches, and the engine support it needs
(per-request gates, re-ranking of queued prefetches, held-in requests)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from fmoesim.engine.backend import ON_DEMAND, TransferRecord
from fmoesim.engine.serving import ServingConfig, split_requests
from fmoesim.engine.sim import SimLink
from fmoesim.engine.simulate import simulate
from fmoesim.errors import ConfigError
from fmoesim.trace import read_trace
from fmoesim.trace.reader import Trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.base import BatchInfo, GateView, Outcome, RequestInfo, RequestTrace
from policies.moe_infinity import (
    EAMC,
    MoEInfinity,
    activation_priorities,
    load_eamcs,
    save_eamcs,
)
from tests._baseline_helpers import (
    M32,
    M42,
    SLOW,
    context,
    e,
    outcomes,
    recording,
    small_model,
    write_fig8_trace,
)
from tests.tiny import TINY_HW

# -- EAMC (§4.2, Fig. 5) -----------------------------------------------------------------
EAM1 = [[2, 0], [2, 0], [0, 2]]
EAM2 = [[0, 1], [1, 0], [1, 0]]
EAM3 = [[1, 0], [0, 1], [0, 1]]
EAM4 = [[1, 0], [0, 1], [1, 0]]


def test_fig5_p4_replaces_eam3():
    """Fig. 5: capacity 3 holds EAM1-3; P4's EAM is closest to EAM3, which it replaces.

    Flattened: E1 = (2,0,2,0,0,2), E2 = (0,1,1,0,1,0), E3 = (1,0,0,1,0,1),
    E4 = (1,0,0,1,1,0); |E1| = sqrt(12), the others sqrt(3).  cos(E4, E1) = 2/6,
    cos(E4, E2) = 1/3, cos(E4, E3) = 2/3: the most similar (smallest distance) is EAM3.
    """
    c = EAMC(3, 3, 2)
    assert [c.add(np.array(m)) for m in (EAM1, EAM2, EAM3)] == [0, 1, 2]
    np.testing.assert_allclose(c.similarity(np.array(EAM4)), [1 / 3, 1 / 3, 2 / 3])
    assert c.add(np.array(EAM4)) == 2
    np.testing.assert_array_equal(c.eams(), np.array([EAM1, EAM2, EAM4]))
    assert c.size == 3


def test_eamc_matches_over_the_observed_layers_only():
    """After layer 1 only, P4 = [1, 0] matches EAM3's first row exactly (cos 1) and
    EAM2's not at all; EAM1's first row [2, 0] is parallel to it too (cos 1): a tie,
    which goes to the lower slot."""
    c = EAMC(3, 3, 2)
    for m in (EAM1, EAM2, EAM3):
        c.add(np.array(m))
    q = c.query()
    q.observe(0, np.array([1, 0]))
    np.testing.assert_allclose(q.similarity(), [1.0, 0.0, 1.0], rtol=1e-6)
    assert q.top(1) == [0]
    assert q.top(3) == [0, 2]  # similarity 0 never matches
    # now [[1,0],[0,1]] (norm sqrt 2): EAM1's [[2,0],[2,0]] gives 2 / (sqrt 8 sqrt 2) =
    # 1/2, EAM2's [[0,1],[1,0]] 0, EAM3's [[1,0],[0,1]] 1
    q.observe(1, np.array([0, 1]))
    np.testing.assert_allclose(q.similarity(), [0.5, 0.0, 1.0], rtol=1e-6)
    assert q.top(2) == [2, 0]
    with pytest.raises(ValueError, match="in order"):
        q.observe(0, np.array([1, 0]))


def test_incremental_query_equals_brute_force_cosine():
    rng = np.random.default_rng(3)
    L, E = 6, 5
    c = EAMC(40, L, E)
    stored = rng.poisson(1.0, size=(40, L, E))
    stored[7] = 0  # an all-zero EAM is not stored
    slots = [c.add(m) for m in stored]
    assert slots[7] == -1 and c.size == 39
    kept = np.delete(stored, 7, axis=0).reshape(39, L, E)
    it = rng.poisson(0.7, size=(L, E))
    q = c.query()
    for layer in range(L):
        q.observe(layer, it[layer])
        a = kept[:, : layer + 1].reshape(39, -1).astype(float)
        b = it[: layer + 1].reshape(-1).astype(float)
        den = np.linalg.norm(a, axis=1) * np.linalg.norm(b)
        ref = np.divide(a @ b, den, out=np.zeros(39), where=den > 0)
        np.testing.assert_allclose(q.similarity(), ref, rtol=1e-5, atol=1e-7)
        np.testing.assert_allclose(c.similarity(it[: layer + 1]), ref, rtol=1e-5, atol=1e-7)
        want = [int(i) for i in np.lexsort((np.arange(39), -np.round(ref, 5))) if ref[i] > 0]
        assert q.top(4) == want[:4]


def test_eamc_save_load_roundtrip_and_bad_files(tmp_path):
    c = EAMC(3, 3, 2)
    for m in (EAM1, EAM2):
        c.add(np.array(m))
    path = tmp_path / "eamc.npz"
    save_eamcs(path, {"prefill": c, "decode": EAMC(5, 3, 2)})
    back = load_eamcs(path, ("prefill", "decode"), 3, 2)
    np.testing.assert_array_equal(back["prefill"].eams(), c.eams())
    assert (back["prefill"].capacity, back["decode"].size) == (3, 0)
    assert list(tmp_path.iterdir()) == [path]  # no temp file left behind
    with pytest.raises(ValueError, match=r"key 'prefill_eams' has shape .* expected \(n, 4, 2\)"):
        load_eamcs(path, ("prefill",), 4, 2)
    with pytest.raises(ValueError, match="missing key 'spec_eams'"):
        load_eamcs(path, ("spec",), 3, 2)
    bad = tmp_path / "bad.npz"
    np.savez(bad, format=np.array(1), prefill_eams=-np.ones((1, 3, 2)), prefill_capacity=3)
    with pytest.raises(ValueError, match="key 'prefill_eams' row 0 is not finite non-negative"):
        load_eamcs(bad, ("prefill",), 3, 2)
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="junk.npz: not a readable .npz"):
        load_eamcs(tmp_path / "junk.npz", ("prefill",), 3, 2)


# -- prefetch priorities (§5.1, Fig. 7) --------------------------------------------------
# Two matched EAMs of the 4 x 2 model: summed, layer 3 is [1, 3] and layer 4 [1, 9].
FIG7_A = [[1, 0], [1, 0], [1, 3], [0, 4]]
FIG7_B = [[1, 0], [1, 0], [0, 0], [1, 5]]


def test_fig7_priority_computation():
    """Fig. 7 after the gate of layer 2 (index 1): step 2 normalises the summed rows,
    layer 3 -> [0.25, 0.75], layer 4 -> [0.1, 0.9]; step 3 weights layer i by
    1 - (i - l) / L: layer 3 by 1 - 1/4 = 0.75, layer 4 by 1 - 2/4 = 0.5.  E[3,2]
    (0.5625) now goes before E[4,2] (0.45), which has the higher raw probability."""
    m = np.array([FIG7_A, FIG7_B])
    raw = activation_priorities(m, 1, proximity=False)
    np.testing.assert_allclose(raw, [[0, 0], [0, 0], [0.25, 0.75], [0.1, 0.9]])
    p = activation_priorities(m, 1)
    np.testing.assert_allclose(p, [[0, 0], [0, 0], [0.1875, 0.5625], [0.05, 0.45]])


def _gate(layer: int, counts: Sequence[int]) -> GateView:
    c = np.asarray(counts, dtype=np.int64)
    return GateView(layer, c, int(c.sum()), request_counts=c[None, :])


def _primed(model, eams: dict[str, list], slots: int, **kw) -> MoEInfinity:  # type: ignore[no-untyped-def]
    """A policy whose collections hold ``eams`` (phase -> list of (L, E)), one request
    (id 0) started and its first iteration (a decode unless ``prefill``) begun."""
    prefill = kw.pop("prefill", False)
    p = MoEInfinity(**kw)
    p.reset(context(model, slots))
    for phase, ms in eams.items():
        for m in ms:
            p.eamcs[phase].add(np.array(m))
    p.on_request_start(RequestInfo(0, 4, 3))
    p.on_iteration_start(BatchInfo(0, (0,), (0,), 1, prefill))
    return p


def test_fig7_prefetch_order_from_the_policy():
    """The policy at layer 2's gate (token at E[2,1]): with both EAMs matched
    (``num_matched=2``) it prefetches E[3,2], E[4,2], E[3,1], E[4,1] in that order,
    priority value 1 - p (lower goes first); without layer proximity E[4,2] goes first."""
    want = [(e(3, 2), 1 - 0.5625), (e(4, 2), 1 - 0.45), (e(3, 1), 1 - 0.1875), (e(4, 1), 0.95)]
    for prox, order in ((True, want), (False, None)):
        p = _primed(M42, {"decode": [FIG7_A, FIG7_B]}, 8, num_matched=2, layer_proximity=prox)
        p.on_gate(0, _gate(0, [1, 0]))
        acts = p.on_gate(1, _gate(1, [1, 0]))
        got = [(x.key, x.priority) for x in acts.prefetch]
        if order is not None:
            assert [k for k, _ in got] == [k for k, _ in order]
            assert [q for _, q in got] == pytest.approx([q for _, q in order])
        else:
            assert [k for k, _ in got] == [e(4, 2), e(3, 2), e(3, 1), e(4, 1)]
            assert got[0][1] == pytest.approx(0.1)


def test_predictions_read_the_collection_as_it_is_now():
    """The predictions at each gate are the matched EAM's rows after that layer, from the
    collection as it is in that iteration.  Slot 0 holds Fig. 7's first EAM, whose rows
    2-4 normalise to [1, 0], [0.25, 0.75], [0, 1]; after that iteration the second EAM
    replaces it (capacity 1), and the next iteration's gate of layer 1 must predict [1,
    0], [0, 0], [1/6, 5/6].  Red if the normalised EAM kept per matched slot outlived
    the iteration (the first EAM's rows again), or if a prediction kept rows of layers
    already passed (layer 2's row after its gate)."""
    p = _primed(M42, {"decode": [FIG7_A]}, 8, eamc_capacity=1, learn_online=False)
    p.on_gate(0, _gate(0, [1, 0]))
    np.testing.assert_allclose(p.predict(0), [[0, 0], [1, 0], [0.25, 0.75], [0, 1]])
    p.on_gate(1, _gate(1, [1, 0]))
    np.testing.assert_allclose(p.predict(1), [[0, 0], [0, 0], [0.25, 0.75], [0, 1]])
    p.on_iteration_end(BatchInfo(0, (0,), (0,), 1, False))
    assert p.eamcs["decode"].add(np.array(FIG7_B)) == 0  # replaces the only slot
    p.on_iteration_start(BatchInfo(1, (0,), (1,), 1, False))
    p.on_gate(0, _gate(0, [1, 0]))
    np.testing.assert_allclose(p.predict(0), [[0, 0], [1, 0], [0, 0], [1 / 6, 5 / 6]])


def test_switches_shape_the_prefetch():
    """multi_layer=False: only the next layer; request_level_tracing=False: every expert
    of the next layer, equally likely (the vanilla dependency prefetch); an empty
    collection predicts nothing."""
    p = _primed(M42, {"decode": [FIG7_A]}, 8, multi_layer=False)
    p.on_gate(0, _gate(0, [1, 0]))
    assert [x.key for x in p.on_gate(1, _gate(1, [1, 0])).prefetch] == [e(3, 2), e(3, 1)]
    v = _primed(M42, {}, 8, request_level_tracing=False, multi_layer=False, layer_proximity=False)
    acts = v.on_gate(0, _gate(0, [1, 0]))
    assert [(x.key, x.priority) for x in acts.prefetch] == [(e(2, 1), 0.5), (e(2, 2), 0.5)]
    empty = _primed(M42, {}, 8)
    assert list(empty.on_gate(0, _gate(0, [1, 0])).prefetch) == []


# a collection of two decode EAMs: expert 1 at every layer, expert 2 at every layer
ALL_E1 = [[4, 0], [4, 0], [4, 0], [4, 0]]
ALL_E2 = [[0, 4], [0, 4], [0, 4], [0, 4]]


def _second_iteration_prefetch(match_on: str) -> tuple[list[int], list[int]]:
    """The next-layer prefetches at layer 1's gate (routed to E[1,1]) of a request's first
    decode iteration, which then routes E[l,2] at layers 2-4, and of its second."""
    p = _primed(M42, {"decode": [ALL_E1, ALL_E2]}, 8, multi_layer=False, match_on=match_on)
    first = [x.key for x in p.on_gate(0, _gate(0, [1, 0])).prefetch]
    for layer in range(1, 4):
        p.on_gate(layer, _gate(layer, [0, 1]))
    batch = BatchInfo(0, (0,), (0,), 1, False)
    p.on_iteration_end(batch)
    p.on_iteration_start(BatchInfo(1, (0,), (0,), 1, False))
    return first, [x.key for x in p.on_gate(0, _gate(0, [1, 0])).prefetch]


def test_request_matching_is_the_public_codes():
    """``match_on="request"`` matches the request's earlier iterations over the layers
    still to run: after an iteration on expert 2 everywhere, a token routed to E[1,1]
    matches ALL_E2 (layers 2-4 of the request: expert 2) and prefetches E[2,2], where
    §5.1's iteration EAM (layer 1 only: expert 1) matches ALL_E1 and prefetches E[2,1].
    In the first iteration the request has no earlier counts and both match as §5.1.
    Red if request matching ignores the request's earlier iterations (it would match as
    §5.1), or predicts nothing where they hold no counts instead of falling back."""
    assert _second_iteration_prefetch("iteration") == ([e(2, 1)], [e(2, 1)])
    assert _second_iteration_prefetch("request") == ([e(2, 1)], [e(2, 2)])
    with pytest.raises(ValueError, match="match_on must be one of iteration, request"):
        MoEInfinity(match_on="bogus")


def test_top_k_is_the_free_slots_and_losers_are_cancelled():
    """3 slots, the current layer's expert holds one: the top-2 predictions are loaded;
    at the next gate, a queued prediction that left the top-K is cancelled (case iii)
    and one for the current layer that the gate did not route to as well (case ii)."""
    p = _primed(M42, {"decode": [FIG7_A, FIG7_B]}, 3, num_matched=2)
    acts = p.on_gate(0, _gate(0, [1, 0]))  # layer 2: [2, 0] -> E[2,1]; then E[3,2] ...
    assert [x.key for x in acts.prefetch] == [e(2, 1), e(3, 2)]
    for k in (e(1, 1), e(2, 1), e(3, 2)):
        p.on_insert(k)
    p.on_access(e(1, 1), Outcome.MISS)
    acts = p.on_gate(1, _gate(1, [0, 1]))  # routed E[2,2]: E[2,1] was mispredicted
    assert e(2, 1) in acts.cancel
    assert e(2, 1) not in p._protected


def test_with_every_candidate_protected_the_least_important_prediction_goes():
    """Layer 0's gate of the Fig. 7 collection (3 slots, one held by the routed
    expert) protects E[2,1] at 1 x 0.75 (both EAMs put layer 1's token on it; proximity
    1 - 1/4) and E[3,2] at 3/4 x 0.5 = 0.375.  With both in the buffer and no other
    candidate, the victim is E[3,2], the lower prediction, whatever the candidates'
    order and the incoming key.  Red if the fallback reads a stale or missing priority
    (a tie at 0 gives the oldest, E[2,1]) or takes a protected key for an unprotected
    one."""
    p = _primed(M42, {"decode": [FIG7_A, FIG7_B]}, 3, num_matched=2)
    acts = p.on_gate(0, _gate(0, [1, 0]))
    assert [x.key for x in acts.prefetch] == [e(2, 1), e(3, 2)]
    for k in (e(2, 1), e(3, 2)):
        p.on_insert(k)
    assert p.victim([e(2, 1), e(3, 2)], -1) == e(3, 2)
    assert p.victim([e(3, 2), e(2, 1)], e(4, 1)) == e(3, 2)


def test_cache_priority_from_the_request_eam_with_initial_layer_boost():
    """Request-level prefill EAM [[1,2],[0,3],[0,3]] (Fig. 8): frequencies per row
    [1/3, 2/3], [0, 1], [0, 1]; the initial-layer weights 2 - l/3 = 2, 5/3, 4/3."""
    for boost, w in ((True, [2, 5 / 3, 4 / 3]), (False, [1, 1, 1])):
        p = MoEInfinity(initial_layer_priority=boost)
        p.reset(context(M32, 3))
        p.on_request_start(RequestInfo(0, 3, 2))
        p.on_iteration_start(BatchInfo(0, (0,), (0,), 3, True))
        for layer, c in enumerate(([1, 2], [0, 3], [0, 3])):
            p.on_gate(layer, _gate(layer, c))
        p.on_iteration_end(BatchInfo(0, (0,), (0,), 3, True))
        p.on_iteration_start(BatchInfo(1, (0,), (1,), 1, False))
        freq = [1 / 3, 2 / 3, 0, 1, 0, 1]
        want = [f * w[i // 2] for i, f in enumerate(freq)]
        assert p._cprio == pytest.approx(want)
        order = dict.fromkeys([e(1, 2), e(2, 2), e(1, 1), e(3, 2)]).keys()
        assert p.victim(order, e(2, 1)) == e(1, 1)  # lowest: 1/3 (x2 with the boost)


# -- Fig. 8c on the engine ---------------------------------------------------------------
@pytest.fixture(scope="module")
def fig8_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return read_trace(write_fig8_trace(tmp_path_factory.mktemp("fig8") / "trace"))


@pytest.fixture(scope="module")
def fig8_eamc(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A collection holding one earlier request like this one: prefill EAM
    [[1,2],[0,3],[0,3]] and decode EAM [[1,0],[0,1],[0,1]]."""
    path = tmp_path_factory.mktemp("eamc") / "fig8.npz"
    pre, dec = EAMC(10, 3, 2), EAMC(10, 3, 2)
    pre.add(np.array([[1, 2], [0, 3], [0, 3]]))
    dec.add(np.array([[1, 0], [0, 1], [0, 1]]))
    save_eamcs(path, {"prefill": pre, "decode": dec})
    return str(path)


Recording = recording(MoEInfinity)


def test_fig8c_request_level_eam_keeps_e22(fig8_trace: Trace, fig8_eamc: str):
    """Fig. 8c (``003`` §5.2), same model, trace and 3-slot buffer as Fig. 8a/8b
    (``tests/test_baselines.py``).  Hand trace (cache priority = request-EAM
    frequency x initial-layer weight; ``*`` in flight, admission order):

    it1 (prefill; request EAM still empty, all cache priorities 0)
        L1: match prefill EAMC (cos 1): L2 [0, 1] x 2/3, L3 [0, 1] x 1/3; top-K =
            3 slots - 2 routed = 1: E22*; E11 M, E12 M      -> [E11 E12 E22*]
        L2: E22 H; predict E32 (2/3 > priority 0 of E11/E12): evicts E11 (oldest)
        L3: E32 H                                         -> [E12 E22 E32]
    it2 (decode; priorities from the prefill EAM: E12 4/3, E22 5/3, E32 4/3)
        L1: match decode EAMC: E22 and E32 are the top-2, in the buffer: protected,
            not loaded; E11 M evicts E12 (lowest unprotected) -> [E22 E32 E11]
        L2: E22 H ("keeps E[2,2] from eviction, ensuring a buffer hit")
        L3: E32 H ("accurately prefetches and retains").
    Against Fig. 8a's (M, H, H) with 8 evictions and 8b's (M, M, H).
    """
    p = Recording(eamc_path=fig8_eamc)
    budget = 3 * M32.expert_size_bytes
    # the figure's prefetches land by the next layer: the infinitely fast link
    r = simulate(
        fig8_trace, M32, TINY_HW, p, budget, timing=False, landing="next_step", access_log=True
    )
    E11, E12, E22, E32 = e(1, 1), e(1, 2), e(2, 2), e(3, 2)
    assert outcomes(r, M32) == [
        (0, E11, "M"),
        (0, E12, "M"),
        (0, E22, "H"),
        (0, E32, "H"),
        (1, E11, "M"),
        (1, E22, "H"),
        (1, E32, "H"),
    ]
    assert p.evicted == [E11, E12]
    t = simulate(
        fig8_trace, M32, SLOW, Recording(eamc_path=fig8_eamc), budget, access_log=True,
        preempt=False,
    )  # fmt: skip
    assert [(k, o) for i, k, o in outcomes(t, M32) if i == 1] == [
        (E11, "M"),
        (E22, "H"),
        (E32, "H"),
    ]


# -- runs on a synthetic trace -----------------------------------------------------------
SMOKE = small_model(8, 8, 2)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("mi") / "trace"
    cfg = SyntheticConfig(
        num_requests=12, embedding_dim=0, prompt_tokens_median=8, prompt_tokens_max=16,
        output_tokens_median=12, output_tokens_max=20, seed=2,
    )  # fmt: skip
    generate(SMOKE, cfg, path, overwrite=True)
    return read_trace(path)


class NoLearn(MoEInfinity):
    """Ignores held-in requests (its collections come from a file)."""

    def learn(self, requests: Sequence[RequestTrace]) -> None:
        pass


def test_saved_and_reloaded_eamc_gives_identical_decisions(synthetic: Trace, tmp_path):
    """Offline mode: half the requests fill the collections (``learn``); the policy is
    checkpointed; a fresh policy reloaded from the checkpoint makes the same decisions
    (every transfer, priority and outcome) on the served half."""
    serving = ServingConfig(held_in_fraction=0.5)
    budget = 20 * SMOKE.expert_size_bytes
    a = MoEInfinity(learn_online=False)
    ra = simulate(synthetic, SMOKE, TINY_HW, a, budget, serving=serving, access_log=True)
    assert a.eamcs["prefill"].size == 6 and a.eamcs["decode"].size == 6
    path = tmp_path / "ckpt.npz"
    a.save(path)
    b = NoLearn(learn_online=False, eamc_path=str(path))
    rb = simulate(synthetic, SMOKE, TINY_HW, b, budget, serving=serving, access_log=True)
    assert [(t.key, t.reason, t.priority, t.start_s) for t in ra.transfers] == [
        (t.key, t.reason, t.priority, t.start_s) for t in rb.transfers
    ]
    np.testing.assert_array_equal(ra.accesses["outcome"], rb.accesses["outcome"])  # type: ignore[index]
    assert ra.summary["prefetch_bytes"] > 0
    # an empty collection (online mode from scratch) decides differently
    rc = simulate(synthetic, SMOKE, TINY_HW, NoLearn(learn_online=False), budget, serving=serving)
    assert rc.summary["prefetch_bytes"] == 0


def test_online_learning_fills_the_collections_as_requests_end(synthetic: Trace):
    p = MoEInfinity(eamc_capacity=5)
    simulate(synthetic, SMOKE, TINY_HW, p, 20 * SMOKE.expert_size_bytes, timing=False)
    assert p.eamcs["prefill"].size == 5 == p.eamcs["decode"].size  # 12 requests, capacity 5


def test_request_level_eams_with_batches(synthetic: Trace):
    """Batch 3: the per-request gate counts sum to the batch's counts, and each request's
    accumulated EAMs equal its recorded routing."""
    seen: dict[int, np.ndarray] = {}

    class Check(MoEInfinity):
        def on_gate(self, layer, gate):  # type: ignore[no-untyped-def]
            assert gate.request_counts is not None
            np.testing.assert_array_equal(gate.request_counts.sum(axis=0), gate.counts)
            return super().on_gate(layer, gate)

        def on_request_end(self, request_id: int) -> None:
            eams = self._req[request_id]
            seen[request_id] = eams["prefill"] + eams["decode"]
            super().on_request_end(request_id)

    serving = ServingConfig(batch_size=3)
    simulate(synthetic, SMOKE, TINY_HW, Check(), 20 * SMOKE.expert_size_bytes, serving=serving)
    for r in range(synthetic.num_requests):
        a = int(synthetic.iter_start[r])
        b = a + int(synthetic.output_tokens[r])
        rid = int(synthetic.request_id[r])
        np.testing.assert_array_equal(seen[rid], synthetic.counts[a:b].sum(axis=0))


def test_held_in_split_is_seeded_and_learn_gets_the_held_requests(synthetic: Trace):
    cfg = ServingConfig(held_in_fraction=0.25)
    s1, h1 = split_requests(12, cfg, np.random.default_rng(0))
    s2, h2 = split_requests(12, cfg, np.random.default_rng(0))
    assert (s1, h1) == (s2, h2) and len(h1) == 3 and sorted(s1 + h1) == list(range(12))
    assert s1 == sorted(s1)
    capped = ServingConfig(held_in_fraction=0.25, max_requests=4)
    assert split_requests(12, capped, np.random.default_rng(0))[0] == s1[:4]
    got: list[int] = []

    class Spy(MoEInfinity):
        def learn(self, requests: Sequence[RequestTrace]) -> None:
            got.extend(r.request_id for r in requests)
            for r in requests:
                assert r.counts.shape[1:] == (8, 8) and len(r.counts) == len(r.num_tokens)
            super().learn(requests)

    r = simulate(synthetic, SMOKE, TINY_HW, Spy(), 20 * SMOKE.expert_size_bytes, serving=cfg)
    held_ids = sorted(int(synthetic.request_id[i]) for i in split_requests(
        12, cfg, np.random.default_rng([0, 2]))[1])  # fmt: skip
    assert sorted(got) == held_ids
    assert r.summary["requests"] == 9
    with pytest.raises(ConfigError, match="held_in_fraction"):
        ServingConfig(held_in_fraction=1.0).validate()


def test_a_queued_prefetch_takes_its_new_priority():
    """Link: A runs; B (priority 2) and C (priority 3) queue; C re-ranked to 1 goes
    before B.  A started or on-demand transfer keeps its place."""
    done: list[int] = []
    link = SimLink(1e9, 0.0, 1 << 30, True, done.append)

    def rec(key: int, prio: float) -> TransferRecord:
        return TransferRecord(key, 0, 10**9, "prefetch", prio, 0.0)

    a, b, c = rec(1, 1.0), rec(2, 2.0), rec(3, 3.0)
    for r in (a, b, c):
        link.submit(r, 0.0)
    link.reprioritize(c, 1.0)
    link.reprioritize(a, 9.0)  # running: no effect
    link.advance(10.0)
    assert done == [1, 3, 2]
    d, f = rec(4, ON_DEMAND), rec(5, 1.0)
    link.submit(f, 10.0)
    link.submit(d, 10.0)
    link.reprioritize(d, 0.5)
    assert d.link_priority == ON_DEMAND


# -- the fast paths against their references -------------------------------------------
def _protections(pol: MoEInfinity) -> dict[int, float]:
    """The protected keys of ``pol`` with their prefetch priorities."""
    return {k: float(pol._prot_val[k]) for k in pol._protected}


def _admit_by_rebuilt_heap(
    pol: MoEInfinity, new: list[tuple[int, float]], routed: set[int]
) -> tuple[list[tuple[int, float]], dict[int, float]]:
    """:meth:`MoEInfinity._admit` as a fresh heap of every displaceable cached expert,
    built at the first load that needs a slot, on a copy of the protections: the
    (key, priority) prefetches and the protections it leaves."""
    import heapq

    E, N = pol._E, pol._N
    protected = _protections(pol)
    free = [pol._slots - u for u in pol._used]
    for k in routed:
        if k not in pol._in:
            free[(k % E) % N] -= 1
    heaps: list[list[tuple[float, int]]] | None = None
    out, done = [], [False] * N
    for key, p in new:
        if key in protected and key in pol._in:
            out.append((key, 1.0 - p))
            continue
        g = (key % E) % N
        if done[g]:
            continue
        if free[g] > 0:
            free[g] -= 1
        else:
            if heaps is None:
                heaps = [[] for _ in range(N)]
                for k in pol._in:
                    if k not in protected and k not in routed:
                        heaps[(k % E) % N].append((pol._cprio[k], k))
                for h in heaps:
                    heapq.heapify(h)
            h = heaps[g]
            if not h or h[0][0] >= p:
                done[g] = True
                continue
            heapq.heappop(h)
        protected[key] = p
        out.append((key, 1.0 - p))
    return out, protected


class CheckedFastPaths(MoEInfinity):
    """MoE-Infinity that checks, at every gate, its top-K against the full scan and its
    admissions against a heap rebuilt from every cached expert."""

    calls = 0

    def _top_k(self, flat, first, routed):  # type: ignore[no-untyped-def]
        keys, vals = super()._top_k(flat, first, routed)
        ref = self._top_k_scan(flat, first, routed)
        assert list(zip(keys.tolist(), vals.tolist(), strict=True)) == list(ref.items())
        return keys, vals

    def _admit(self, keys, vals, routed):  # type: ignore[no-untyped-def]
        new = list(zip(keys.tolist(), vals.tolist(), strict=True))
        want, protected = _admit_by_rebuilt_heap(self, new, routed)
        got = super()._admit(keys, vals, routed)
        assert [(p.key, p.priority) for p in got] == want
        assert _protections(self) == protected
        assert set(np.flatnonzero(self._prot_mask).tolist()) == set(protected)
        CheckedFastPaths.calls += 1
        return got


@pytest.mark.parametrize("gpus", [1, 2])
def test_fast_top_k_and_admissions_equal_their_references(synthetic: Trace, gpus: int):
    """Every gate of a run with a tight buffer (many displacements, and keys whose
    heap entry was pushed twice: unprotected by a use, protected again as a prediction
    already in the buffer, unprotected again): the partition's top-K equals the scan's,
    and the admissions taken off the persistent victim heaps equal those of a heap of
    every cached expert rebuilt per gate.  Red if the partition dropped a tie at the
    K-th value or reordered ties, or if a key's second heap entry counted twice as a
    displaceable expert."""
    from dataclasses import replace

    hw = replace(TINY_HW, num_gpus=gpus)
    CheckedFastPaths.calls = 0
    for budget in (6, 12, 24):
        simulate(synthetic, SMOKE, hw, CheckedFastPaths(), budget * SMOKE.expert_size_bytes,
                 serving=ServingConfig(held_in_fraction=0.5))  # fmt: skip
    assert CheckedFastPaths.calls > 100


def test_top_k_partition_keeps_ties_in_id_order():
    """Ties at the K-th value: the partition's top-K takes the lower ids first, as the
    stable scan does.  Red if it took any of the tied entries."""
    pol = MoEInfinity()
    pol._N, pol._E, pol._slots = 1, 4, 3
    flat = np.array([0.5, 0.2, 0.2, 0.0, 0.2, 0.9, 0.2, 0.0])
    keys, vals = pol._top_k(flat, 100, set())
    assert keys.tolist() == [105, 100, 101] and vals.tolist() == [0.9, 0.5, 0.2]
    ref = pol._top_k_scan(flat, 100, set())
    assert list(zip(keys.tolist(), vals.tolist(), strict=True)) == list(ref.items())
    pol._slots = 5
    assert pol._top_k(flat, 100, {1})[0].tolist() == [105, 100, 101, 102]
    pol._slots = 10  # more room than positive predictions: zeros never
    assert pol._top_k(flat, 100, set())[0].tolist() == [105, 100, 101, 102, 104, 106]
