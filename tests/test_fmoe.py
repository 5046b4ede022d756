"""fMoE (``000`` §4): hand-computed selection, priorities, RDY replacement, the
semantic/trajectory switch at layer d, the oracle store, matcher latency, offline and
online modes, the per-iteration score log and the CLI's policy log."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fmoesim.engine.serving import ServingConfig, split_requests
from fmoesim.engine.simulate import held_in_requests, simulate
from fmoesim.errors import ConfigError
from fmoesim.trace.reader import Trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.base import NO_ACTIONS, BatchInfo, GateView, Outcome, RequestInfo, RequestTrace
from policies.belady import Belady
from policies.fmoe import (
    ExpertMapStore,
    FMoE,
    eviction_priority,
    pearson,
    prefetch_priority,
    select_experts,
)
from policies.lru import LRU
from tests._baseline_helpers import context, write_one_token_trace
from tests.test_cli import tiny_overrides
from tests.test_policy_contract import MODEL  # 4 layers x 8 experts, top-2
from tests.tiny import TINY, TINY_HW, small_model

ROOT = Path(__file__).resolve().parents[1]


# -- §4.3 eq. 6-8: similarity-aware selection ------------------------------------------------
P = np.array([0.1, 0.5, 0.15, 0.25])


@pytest.mark.parametrize(
    ("score", "top_k", "expected"),
    [
        (0.9, 1, [1]),  # δ = 0.1: the top expert (0.5) already reaches it
        (0.3, 1, [1, 3]),  # δ = 0.7: 0.5 + 0.25 = 0.75
        (0.2, 1, [1, 3, 2]),  # δ = 0.8: 0.5 + 0.25 + 0.15 = 0.9
        (0.25, 1, [1, 3]),  # δ = 0.75 is reached exactly by 0.75
        (-0.5, 1, [1, 3, 2, 0]),  # δ = clip(1.5) = 1: everything
        (1.0, 1, [1]),  # δ = 0
        (1.0, 2, [1, 3]),  # δ = 0, but never fewer than top-k (eq. 8)
        (None, 2, [1, 3]),  # no threshold (ablations): exactly top-k
        (None, 1, [1]),
    ],
)
def test_select_experts_hand_computed(score, top_k, expected):
    assert select_experts(P, top_k, score) == expected


def test_select_experts_skips_zero_probabilities_beyond_top_k_and_breaks_ties_by_id():
    p = np.array([0.6, 0.0, 0.4, 0.0])
    assert select_experts(p, 1, -1.0) == [0, 2]  # δ = 1 but the zeros add nothing
    assert select_experts(p, 3, -1.0) == [0, 2, 1]  # the top-k floor still holds
    assert select_experts(np.full(4, 0.25), 2, None) == [0, 1]
    assert select_experts(np.full(4, 0.25), 1, 0.5) == [0, 1]  # δ = 0.5


# -- §4.5: both priorities ---------------------------------------------------------------------
def test_prefetch_priority_is_probability_over_layer_distance():
    assert prefetch_priority(0.6, 5, 2) == pytest.approx(0.2)
    assert prefetch_priority(0.6, 0, -1) == pytest.approx(0.6)  # before layer 0 runs
    # a likelier expert two layers ahead can outrank a less likely one a layer ahead
    assert prefetch_priority(0.9, 4, 2) > prefetch_priority(0.4, 3, 2)
    with pytest.raises(ValueError, match="not ahead"):
        prefetch_priority(0.5, 2, 2)


def test_eviction_priority_is_inverse_of_probability_times_frequency():
    assert eviction_priority(0.5, 4) == pytest.approx(0.5)
    assert eviction_priority(0.2, 4) > eviction_priority(0.5, 4)
    assert eviction_priority(0.0, 3) == math.inf


def batch(embedding, iteration=0, rid=7, prefill=True) -> BatchInfo:
    return BatchInfo(iteration, (rid,), (iteration,), 1, prefill, np.array([embedding], float))


def gate(layer: int, probs) -> GateView:
    """A one-request gate whose token routes to the most probable expert."""
    p = np.array([probs], dtype=np.float32)
    counts = np.zeros(p.shape[1], dtype=np.int64)
    counts[int(np.argmax(p[0]))] = 1
    return GateView(layer, counts, 1, p[0], None, layer, counts[None], p)


def one_iteration(rid: int, rows, embedding) -> RequestTrace:
    rows = np.array(rows, dtype=np.float32)  # (L, E)
    counts = np.zeros((1, *rows.shape), dtype=np.int32)
    for layer, row in enumerate(rows):
        counts[0, layer, int(np.argmax(row))] = 1
    return RequestTrace(rid, counts, np.array([1]), rows[None], np.array([embedding], float))


def test_eviction_lowest_probability_times_in_cache_visits_and_protects_predictions():
    """L = 2, J = 4, d = 1.  The semantic match's row 0 is (.5, .2, .3, 0).  Keys 0-2 are
    prefetched (a load is no visit) and then visited: key 0 never, key 1 three times, key
    2 five times, so p·freq = 0, .6, 1.5.  Key 0 is the match's prediction for layer 0 and
    not used yet, so it is kept and key 1 goes; once the gate shows layer 0 routes
    elsewhere, key 0 goes."""
    m = small_model(2, 4, 1)
    pol = FMoE(prefetch_distance=1)
    pol.reset(context(m, 3))
    pol.learn([one_iteration(0, [[0.5, 0.2, 0.3, 0.0], [0.25] * 4], [1.0, 0.0])])
    acts = pol.on_iteration_start(batch([1.0, 0.0]))
    assert acts is not None and [p.key for p in acts.prefetch] == [0]
    for k in (0, 1, 2):
        pol.on_insert(k)
    for _ in range(3):
        pol.on_access(1, Outcome.HIT)
    for _ in range(5):
        pol.on_access(2, Outcome.HIT)
    assert pol.victim({0, 1, 2}, 9) == 1
    assert pol.victim({0}, 9) == 0  # only predictions left: the least valuable goes
    acts = pol.on_gate(0, gate(0, [0.0, 0.0, 0.0, 1.0]))
    assert 0 in acts.cancel  # predicted, passed unused
    assert pol.victim({0, 1, 2}, 9) == 0
    # the same ranking as the paper's formula, highest 1/(p·freq) first
    pri = {k: eviction_priority(p, f) for k, p, f in ((0, 0.5, 1), (1, 0.2, 4), (2, 0.3, 6))}
    assert max(pri, key=pri.get) == 0


def test_eviction_freq_counts_visits_not_a_prefetchs_load():
    """§4.5: freq is the cache visit frequency ("less frequently hit" go first).  Both
    keys of layer 0 have p = .5.  Key 1 missed, was loaded on demand (its visit counts:
    freq 1) and is the older; key 0 was prefetched, never used (freq 0), so it goes.
    With ``freq_counts_load`` (the authors' scheduler) both count 1 and the older, key 1,
    goes.  Red if the load counts by default, or the miss that brought a key in does not."""
    m = small_model(2, 4, 1)
    for counts_load, want in ((False, 0), (True, 1)):
        pol = FMoE(prefetch_distance=1, freq_counts_load=counts_load)
        pol.reset(context(m, 3))
        pol.learn([one_iteration(0, [[0.5, 0.5, 0.0, 0.0], [0.25] * 4], [1.0, 0.0])])
        acts = pol.on_iteration_start(batch([1.0, 0.0]))
        assert acts is not None and [p.key for p in acts.prefetch] == [0]
        pol.on_access(1, Outcome.MISS)
        pol.on_insert(1)  # loaded on demand
        pol.on_insert(0)  # the prefetch lands
        pol.on_gate(0, gate(0, [0.0, 1.0, 0.0, 0.0]))  # key 0 passed unused: unprotected
        assert pol.victim({0, 1}, 9) == want, counts_load


def test_picks_already_in_the_cache_are_kept_until_their_layer():
    """The search's picks not used yet are protected whether they still load or are in the
    cache already (the authors' ``replace_cache_candidates``).  L = 2, J = 4, d = 1, top-1.
    Keys 2 and 3 are cached, visited once and three times; the match's row 0 is (0, 0,
    .6, .4), so it picks key 2, in the cache: p·freq = .6 against 1.2, yet key 3 goes
    while key 2 waits for layer 0; after gate 0, key 2 goes.  Red if a resident pick is
    left unprotected, or stays protected after its layer."""
    m = small_model(2, 4, 1)
    pol = FMoE(prefetch_distance=1)
    pol.reset(context(m, 3))
    pol.learn([one_iteration(0, [[0.0, 0.0, 0.6, 0.4], [0.25] * 4], [1.0, 0.0])])
    for k in (2, 3):
        pol.on_insert(k)
    pol.on_access(2, Outcome.HIT)
    for _ in range(3):
        pol.on_access(3, Outcome.HIT)
    acts = pol.on_iteration_start(batch([1.0, 0.0]))
    assert acts is None  # nothing to load: key 2 is in the cache
    assert pol.victim({2, 3}, 9) == 3
    pol.on_gate(0, gate(0, [0.0, 0.0, 1.0, 0.0]))
    assert pol.victim({2, 3}, 9) == 2


def test_prefill_minimum_is_k_per_prompt_token():
    """Eq. 8 at prefill: a 3-token prompt of a top-1 model activates up to 3 experts a
    layer, so the match (score 1, δ = 0) prefetches at least 3 (the zero beyond them
    never); decoding, 1.  ``prefill_k=top_k``: 1 at prefill too.  Red if prefill keeps
    one token's minimum, or decoding takes the prompt's."""
    m = small_model(2, 4, 1)
    for prefill_k, want in (("tokens", [0, 1, 2]), ("top_k", [0])):
        pol = FMoE(prefetch_distance=1, prefill_k=prefill_k)
        pol.reset(context(m, 4))
        pol.learn([one_iteration(0, [[0.7, 0.2, 0.1, 0.0], [0.25] * 4], [1.0, 0.0])])
        pol.on_request_start(RequestInfo(7, 3, 2, np.array([1.0, 0.0])))
        acts = pol.on_iteration_start(batch([1.0, 0.0]))
        assert acts is not None and [p.key for p in acts.prefetch] == want, prefill_k
        for layer in range(2):
            pol.on_gate(layer, gate(layer, [0.7, 0.2, 0.1, 0.0]))
        pol.on_iteration_end(batch([1.0, 0.0]))
        acts = pol.on_iteration_start(batch([1.0, 0.0], iteration=1, prefill=False))
        assert acts is not None and [p.key for p in acts.prefetch] == [0], prefill_k


def test_eviction_ties_go_to_the_oldest_admission_and_lfu_lru_variants():
    m = small_model(2, 4, 1)
    pol = FMoE(prefetch_distance=1)
    pol.reset(context(m, 3))
    pol.on_insert(6)  # layer 1, never searched: p = 0
    pol.on_insert(5)
    assert pol.victim({5, 6}, 9) == 6
    lfu, lru = FMoE(prefetch_distance=1, cache="lfu"), FMoE(prefetch_distance=1, cache="lru")
    for pol in (lfu, lru):
        pol.reset(context(m, 3))
        for k in (1, 2, 3):
            pol.on_insert(k)
        pol.on_access(1, Outcome.HIT)
        pol.on_access(1, Outcome.HIT)
        pol.on_access(3, Outcome.HIT)
    assert lfu.victim({1, 2, 3}, 9) == 2  # visits 3, 1, 2
    assert lru.victim({1, 2, 3}, 9) == 2  # 2 was loaded after 1 but never used since


# -- §4.4: RDY replacement ---------------------------------------------------------------------
def store_of(L: int, d: int) -> ExpertMapStore:
    """Two stored maps of L layers x 2 experts: A always expert 0 with embedding (1, 0),
    B always expert 1 with embedding (0, 1)."""
    s = ExpertMapStore(2, L, 2, 2, d)
    assert s.add(np.tile([1.0, 0.0], (L, 1)), np.array([1.0, 0.0])) == 0
    assert s.add(np.tile([0.0, 1.0], (L, 1)), np.array([0.0, 1.0])) == 1
    return s


def test_rdy_replaces_the_most_redundant_map_weighted_by_d_over_l():
    """New map N = three layers like A and one like B: cosine .75 to A and .25 to B; its
    embedding equals B's (semantic 0 to A, 1 to B).  With L = 4:
    d = 1: RDY_A = .25*0 + .75*.75 = .5625 > RDY_B = .25*1 + .75*.25 = .4375 -> A goes;
    d = 3: RDY_A = .75*0 + .25*.75 = .1875 < RDY_B = .75*1 + .25*.25 = .8125 -> B goes."""
    new = np.array([[1.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    emb = np.array([0.0, 1.0])
    for d, rdy, slot in ((1, (0.5625, 0.4375), 0), (3, (0.1875, 0.8125), 1)):
        s = store_of(4, d)
        assert s.redundancy(new, emb) == pytest.approx(rdy)
        assert s.add(new, emb) == slot
        assert s.size == 2
        np.testing.assert_allclose(s.maps()[slot], new)
        np.testing.assert_allclose(s.embeddings()[slot], emb)
        np.testing.assert_allclose(s.mean_map(), (s.maps()[0] + s.maps()[1]) / 2)


def test_store_scores_match_brute_force_and_refuse_bad_maps():
    rng = np.random.default_rng(0)
    s = ExpertMapStore(50, 5, 6, 4, 2)
    maps = rng.dirichlet(np.ones(6), size=(80, 5))  # (n, L, J): 80 > capacity
    embs = rng.standard_normal((80, 4))
    for m, e in zip(maps, embs, strict=True):
        s.add(m, e)
    assert s.size == 50
    stored, semb = s.maps().astype(np.float64), s.embeddings().astype(np.float64)
    obs = rng.dirichlet(np.ones(6), size=(2, 3))  # (B, l, J)
    for b in range(2):
        want = [
            float((o := obs[b].ravel()) @ (m := stored[i, :3].ravel()))
            / (np.linalg.norm(o) * np.linalg.norm(m))
            for i in range(50)
        ]
        np.testing.assert_allclose(s.trajectory_scores(obs)[b], want, rtol=1e-5)
    q = s.query(2)
    for layer in range(3):
        q.observe(layer, obs[:, layer])
    slots, scores = q.best()
    ref = s.trajectory_scores(obs)
    np.testing.assert_array_equal(slots, ref.argmax(axis=1))
    np.testing.assert_allclose(scores, ref.max(axis=1), rtol=1e-5)
    e = rng.standard_normal(4)
    want = semb @ (e / np.linalg.norm(e))
    np.testing.assert_allclose(s.semantic_scores(e[None])[0], want, rtol=1e-5)
    with pytest.raises(ValueError, match="shape"):
        s.add(np.ones((4, 6)))
    with pytest.raises(ValueError, match="finite and >= 0"):
        s.add(-np.ones((5, 6)))
    assert s.add(np.zeros((5, 6))) == -1
    q = s.query(1)
    q.observe(1, obs[:1, 0])  # a layer left out (an encoder's, decoding) counts nothing
    with pytest.raises(ValueError, match="in order"):
        q.observe(1, obs[:1, 1])  # but a layer comes once, and after the ones before


# -- §4.2: semantic search for layers < d, trajectory search for layer l + d ----------------------
X_ROW, Y_ROW = [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]


def test_semantic_search_guides_the_first_d_layers_and_trajectory_search_the_rest():
    """L = 4, J = 4, top-1, d = 2.  Stored: X (always expert 0, embedding (1, 0)) and Y
    (always expert 3, embedding (0, 1)).  The iteration's embedding is X's, its routing
    Y's.  Iteration start: semantic match X (score 1, δ = 0): prefetch E[0,0] and E[1,0]
    with priorities 1 - .7/1 and 1 - .7/2.  Gate 0: the trajectory matches Y (cosine 1
    vs .16/.52): prefetch layer 2's expert 3, cancel E[0,0] (passed unused), re-rank
    E[1,0]; gate 1: layer 3's expert 3; gate 2: nothing new (2 + d = L)."""
    m = small_model(4, 4, 1)
    pol = FMoE(prefetch_distance=2, match_latency_s=0.005)
    pol.reset(context(m, 16))
    pol.learn([one_iteration(0, [X_ROW] * 4, [1.0, 0.0]), one_iteration(1, [Y_ROW] * 4, [0, 1])])

    def pf(acts) -> list[tuple[int, float]]:
        return [(p.key, round(p.priority, 6)) for p in acts.prefetch]

    a = pol.on_iteration_start(batch([1.0, 0.0]))
    assert a is not None and a.delay_s == 0.005 and list(a.cancel) == []
    assert pf(a) == [(0, 0.3), (4, 0.65)]
    a = pol.on_gate(0, gate(0, Y_ROW))
    assert list(a.cancel) == [0] and a.delay_s == 0.005
    assert pf(a) == [(4, 0.3), (11, 0.65)]
    a = pol.on_gate(1, gate(1, Y_ROW))
    assert list(a.cancel) == [4]
    assert pf(a) == [(11, 0.3), (15, 0.65)]
    a = pol.on_gate(2, gate(2, Y_ROW))  # 11 was used: settled, not cancelled
    assert list(a.cancel) == [] and pf(a) == [(15, 0.3)]
    assert pol.on_gate(3, gate(3, Y_ROW)) is NO_ACTIONS
    pol.on_iteration_end(batch([1.0, 0.0]))
    r = pol.report()
    assert r["semantic_score"][0] == pytest.approx(1.0)
    assert r["trajectory_score"][0] == pytest.approx(1.0)
    assert pol.store is not None and pol.store.size == 3  # learn_online stored the iteration
    np.testing.assert_allclose(pol.store.maps()[2], [Y_ROW] * 4)


def test_the_trajectory_score_counts_the_matches_used_only():
    """One stored map [A, A, B, B], d = 2, the request routes A at every layer: the gates
    of layers 0 and 1 match it over [A] and [A, A] (cosine 1) and prefetch layers 2 and 3;
    the gates of layers 2 and 3 prefetch nothing (2 + d = L). Red if those two unused
    matches (1.2 / 1.56 and 1.36 / 2.08) enter the logged mean: 0.856 instead of 1, a
    score Fig. 8 correlates with the hit rate."""
    A, B = [0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]
    pol = FMoE(prefetch_distance=2, learn_online=False)
    pol.reset(context(small_model(4, 4, 1), 16))
    pol.learn([one_iteration(0, [A, A, B, B], [1.0, 0.0])])
    pol.on_iteration_start(batch([1.0, 0.0]))
    for layer in range(4):
        pol.on_gate(layer, gate(layer, A))
    pol.on_iteration_end(batch([1.0, 0.0]))
    assert pol.report()["trajectory_score"][0] == pytest.approx(1.0)


def test_without_semantic_search_the_first_layers_follow_historical_popularity():
    """Map (T): the mean stored map ((.4, .1, .1, .4) per layer) gives the top-1, expert 0
    (ties to the smaller id), and the semantic score is not logged."""
    m = small_model(4, 4, 1)
    pol = FMoE(prefetch_distance=2, semantic=False, dynamic_threshold=False)
    pol.reset(context(m, 16))
    pol.learn([one_iteration(0, [X_ROW] * 4, [1.0, 0.0]), one_iteration(1, [Y_ROW] * 4, [0, 1])])
    a = pol.on_iteration_start(batch([0.0, 1.0]))
    assert a is not None and [p.key for p in a.prefetch] == [0, 4]
    for layer in range(4):
        pol.on_gate(layer, gate(layer, Y_ROW))
    pol.on_iteration_end(batch([0.0, 1.0]))
    assert math.isnan(pol.report()["semantic_score"][0])


def test_hit_count_guide_stores_request_level_counts():
    m = small_model(2, 4, 1)
    pol = FMoE(prefetch_distance=1, guide="hit_count", semantic=False, dynamic_threshold=False)
    pol.reset(context(m, 4))
    counts = np.array([[[2, 0, 1, 0], [0, 3, 0, 0]], [[1, 0, 0, 0], [0, 0, 0, 1]]], np.int32)
    pol.learn([RequestTrace(0, counts, np.array([3, 1]), None, None)])
    assert pol.store is not None
    # each layer's shares of the counts [[3, 0, 1, 0], [0, 3, 0, 1]]
    np.testing.assert_allclose(pol.store.maps()[0], [[0.75, 0, 0.25, 0], [0, 0.75, 0, 0.25]])


def test_hit_count_p_is_a_share_not_a_count():
    """Two stored requests, one of 10 tokens (layer 0: expert 0 ten times) and one of 2
    (layer 0: expert 1 twice): the first layer's popularity is the mean of their shares,
    [0.5, 0.5], and a prefetch's queue value stays in [0, 1]. Red on raw counts: the
    mean [5, 1] makes the long request's expert a p of 5 in eviction and its prefetch
    a queue value of 1 - 5 = -4, ahead of every share-based pick."""
    m = small_model(3, 2, 1)

    def req(rid: int, routes: list[list[int]]) -> RequestTrace:
        c = np.zeros((len(routes), 3, 2), np.int32)
        for t, r in enumerate(routes):
            for layer, e in enumerate(r):
                c[t, layer, e] = 1
        return RequestTrace(rid, c, np.ones(len(routes), np.int64), None, None)

    pol = FMoE(prefetch_distance=1, guide="hit_count", semantic=False, dynamic_threshold=False)
    pol.reset(context(m, 6))
    pol.learn([req(0, [[0, t % 2, 0] for t in range(10)]), req(1, [[1, 0, 1], [1, 1, 1]])])
    pol.on_request_start(RequestInfo(7, 1, 2, None))
    acts = pol.on_iteration_start(BatchInfo(0, (7,), (0,), 1, False, None))
    assert pol._guide[0:2] == [0.5, 0.5]
    assert acts is not None and all(0 <= p.priority <= 1 for p in acts.prefetch)


# -- the oracle store reaches the demand upper bound ---------------------------------------------


@pytest.fixture(scope="module")
def one_token_trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    """Every iteration one token (prompts of one token), so an iteration's map is one
    token's gate distribution and its top-k is exactly the routed set."""
    path = tmp_path_factory.mktemp("fmoe") / "trace"
    return write_one_token_trace(path, MODEL, 6, 12, embedding_dim=8, seed=5)


def test_store_memory_by_hand(one_token_trace):
    """Fig. 16's number: the store's arrays for its whole capacity, (L, C, J) float32 maps,
    (L, C) float32 norms, (C, D) float32 embeddings and the (L, J) float64 sum: red when a
    part is left out or the capacity's allocation is counted by its fill."""
    pol = FMoE(prefetch_distance=1, store_capacity=500)
    simulate(one_token_trace, MODEL, TINY_HW, pol, 8 * MODEL.expert_size_bytes, timing=False)
    L, J, C, D = MODEL.num_layers, MODEL.num_experts, 500, 8
    want_mb = (L * C * J * 4 + L * C * 4 + C * D * 4 + L * J * 8) / 1e6
    mb = pol.report()["store_mb"]
    assert pol.store is not None and pol.store.size < C  # far from full
    assert mb[-1] == pytest.approx(want_mb, rel=1e-12)


class Oracle(FMoE):
    """fMoE whose store holds the exact maps of every iteration it will serve."""

    trace: Trace

    def reset(self, ctx) -> None:
        super().reset(ctx)
        self.learn(held_in_requests(self.trace, list(range(self.trace.num_requests))))


def oracle(trace: Trace, **kw) -> Oracle:
    pol = Oracle(learn_online=False, store_capacity=10_000, **kw)
    pol.trace = trace
    return pol


def test_oracle_store_hits_every_access_and_beats_belady(one_token_trace):
    tr = one_token_trace
    k = MODEL.top_k
    top = np.argsort(-tr.probs.astype(np.float32), axis=2, kind="stable")[..., :k]
    routed_top = np.take_along_axis(tr.counts, top, axis=2).sum()
    assert routed_top == tr.counts.sum()  # precondition: top-k of each map = the routing
    size = MODEL.expert_size_bytes
    half = 16 * size  # half of the 32 experts
    r = simulate(tr, MODEL, TINY_HW, oracle(tr), half, timing=False, landing="next_step")
    assert r.summary["hit_rate"] == 1.0 and r.summary["misses"] == 0
    bound = simulate(tr, MODEL, TINY_HW, Belady(), half, timing=False).summary["hit_rate"]
    assert bound < 1.0  # demand caching must miss (at least the cold misses)
    for n in (8, 12):  # tighter budgets: still at or above the demand upper bound
        o = simulate(tr, MODEL, TINY_HW, oracle(tr), n * size, timing=False, landing="next_step")
        b = simulate(tr, MODEL, TINY_HW, Belady(), n * size, timing=False)
        assert o.summary["hit_rate"] >= b.summary["hit_rate"]


# -- asynchronous matching (§4.3, Fig. 13) --------------------------------------------------------
def test_matcher_latency_holds_prefetches_back_and_hurts_a_short_distance(one_token_trace):
    """A link fast enough that a transfer (~4 µs) is short next to a layer (~76 µs), and
    a matcher that takes 1.5 layers: at d = 1 the prefetches are released after their
    layer's gate (LATE), at d = 3 well before it."""
    tr, budget = one_token_trace, 16 * MODEL.expert_size_bytes
    hw = dataclasses.replace(TINY_HW, pcie_gbps=1000.0, transfer_overhead_s=1e-6)
    base = simulate(tr, MODEL, hw, LRU(), 32 * MODEL.expert_size_bytes)
    layer_s = base.summary["simulated_s"] / base.metrics.layer_steps  # one layer step
    assert MODEL.expert_size_bytes / hw.pcie_bytes_per_s < 0.1 * layer_s
    lat = 1.5 * layer_s
    runs = {}
    for d in (1, 3):
        for latency in (0.0, lat):
            pol = oracle(tr, prefetch_distance=d, match_latency_s=latency)
            r = simulate(tr, MODEL, hw, pol, budget)
            runs[d, latency] = r
            for t in r.transfers:
                if t.reason != "prefetch":
                    continue
                assert t.release_s == pytest.approx(t.submit_s + latency)
                if not t.escalated and not t.cancelled:
                    assert t.start_s >= t.release_s - 1e-15  # never before the match is done
    late = {key: r.summary["late"] + r.summary["misses"] for key, r in runs.items()}
    assert late[1, lat] > late[1, 0.0]  # d = 1 cannot hide 1.5 layers of matching
    assert late[3, lat] < late[1, lat]  # d = 3 hides it (but for layer 0's semantic match)


# -- offline (7:3) and online modes, the score log ------------------------------------------------
def test_offline_mode_fills_the_store_with_the_held_in_iterations(one_token_trace):
    tr = one_token_trace
    serving = ServingConfig(held_in_fraction=0.7)
    pol = FMoE(learn_online=False)
    r = simulate(tr, MODEL, TINY_HW, pol, 16 * MODEL.expert_size_bytes, serving=serving, seed=4)
    served, held_in = split_requests(tr.num_requests, serving, np.random.default_rng([4, 2]))
    assert len(held_in) == round(0.7 * tr.num_requests)
    assert pol.store is not None
    assert pol.store.size == int(tr.output_tokens[held_in].sum())
    log = r.policy_log
    assert log is not None and len(log["iteration"]) == r.summary["iterations"]
    assert np.isfinite(log["semantic_score"]).all()  # the store is full from the start
    # the log's hits and accesses are the engine's own
    assert log["hits"].sum() == r.summary["hits"]
    assert log["accesses"].sum() == r.summary["accesses"]
    np.testing.assert_allclose(log["hit_rate"], log["hits"] / log["accesses"])
    assert log["prefill"].sum() == len(served)  # batch 1: one prefill per request
    dec = pol.correlations(decode_only=True)["trajectory"]
    keep = ~log["prefill"]
    assert dec == pytest.approx(pearson(log["trajectory_score"][keep], log["hit_rate"][keep]))


def test_online_mode_starts_empty_and_learns_each_iteration(one_token_trace):
    tr = one_token_trace
    pol = FMoE()
    serving = ServingConfig(mode="online", max_batch_size=2, arrivals="poisson", rate_rps=50.0)
    r = simulate(tr, MODEL, TINY_HW, pol, 16 * MODEL.expert_size_bytes, serving=serving)
    log = r.policy_log
    assert log is not None and math.isnan(log["semantic_score"][0])  # nothing to match yet
    assert np.isfinite(log["semantic_score"][1:]).all()
    assert pol.store is not None and pol.store.size == int(tr.output_tokens.sum())
    assert r.summary["hit_rate"] > 0


def test_pearson_hand_values():
    assert pearson([1, 2, 3], [2, 4, 6]) == pytest.approx(1.0)
    assert pearson([1, 2, 3], [3, 2, 1]) == pytest.approx(-1.0)
    assert pearson([1, 2, 3, np.nan], [1, 3, 2, 5]) == pytest.approx(0.5)
    assert math.isnan(pearson([1, 1, 1], [1, 2, 3]))
    assert math.isnan(pearson([1], [2]))


def test_same_seed_same_run(one_token_trace):
    tr = one_token_trace
    serving = ServingConfig(held_in_fraction=0.5)
    a, b = (
        simulate(tr, MODEL, TINY_HW, FMoE(), 10 * MODEL.expert_size_bytes, serving=serving)
        for _ in range(2)
    )
    assert a.summary["tpot_mean_s"] == b.summary["tpot_mean_s"]
    assert a.policy_log is not None and b.policy_log is not None
    for col in ("semantic_score", "trajectory_score", "hits"):
        np.testing.assert_array_equal(a.policy_log[col], b.policy_log[col])


def test_bad_knobs_are_refused():
    with pytest.raises(ValueError, match="guide"):
        FMoE(guide="oracle")
    with pytest.raises(ValueError, match="cache"):
        FMoE(cache="mru")
    with pytest.raises(ValueError, match="match_latency_s"):
        FMoE(match_latency_s=-1.0)
    with pytest.raises(ValueError, match="prefill_k"):
        FMoE(prefill_k="all")
    with pytest.raises(ConfigError, match="'policy.prefetch_distance' = 9: must be at most"):
        FMoE(prefetch_distance=9).reset(context(MODEL, 8))


def test_cli_writes_the_policy_log(tmp_path):
    path = tmp_path / "trace"
    generate(TINY, SyntheticConfig(num_requests=4, embedding_dim=4, seed=1), path)
    out = tmp_path / "out"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "fmoesim.cli.main",
            *tiny_overrides(path, out),
            "policy=fmoe",
            "policy.prefetch_distance=1",
            "serving.held_in_fraction=0.5",
            "output.name=run",
            "output.plot=false",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr
    log = pd.read_parquet(out / "run" / "policy_log.parquet")
    summary = pd.read_parquet(out / "run" / "summary.parquet").iloc[0]
    assert summary["policy"] == "fmoe"
    assert list(log.columns) == [
        "iteration", "prefill", "semantic_score", "trajectory_score", "hits", "accesses",
        "hit_rate", "store_mb",
    ]  # fmt: skip
    assert log["hits"].sum() == summary["hits"]


def test_store_updates_reusing_search_scores_equal_plain_rdy(one_token_trace):
    """The policy hands RDY the cosines its searches computed (perf); replaying the same
    maps into a plain store must replace the same slots."""
    seen: list[tuple[np.ndarray, np.ndarray]] = []

    class Recording(FMoE):
        def on_iteration_end(self, batch: BatchInfo) -> None:
            assert batch.embeddings is not None
            seen.extend((self._rows[i].copy(), batch.embeddings[i]) for i in range(len(self._rows)))
            super().on_iteration_end(batch)

    pol = Recording(store_capacity=7)
    for b in (1, 2):  # one request per iteration, then two
        seen.clear()
        simulate(
            one_token_trace,
            MODEL,
            TINY_HW,
            pol,
            16 * MODEL.expert_size_bytes,
            serving=ServingConfig(batch_size=b),
            timing=False,
        )
        plain = ExpertMapStore(7, MODEL.num_layers, MODEL.num_experts, 8, 3)
        for m, e in seen:
            plain.add(m, e)
        assert pol.store is not None and len(seen) > 7
        np.testing.assert_allclose(pol.store.maps(), plain.maps())


class _CheckedVictim(FMoE):
    """FMoE whose every victim is checked against the scan of every candidate, with a
    count of the calls made while a prefetch was in flight (a parked key)."""

    def reset(self, ctx):
        super().reset(ctx)
        self.checked = 0
        self.with_parked = 0

    def victim(self, candidates, incoming):
        want = self._victim_scan(candidates)
        got = super().victim(candidates, incoming)
        assert got == want, (got, want, sorted(candidates))
        self.checked += 1
        self.with_parked += bool(self._parked)
        return got


@pytest.mark.parametrize("cache", ["fmoe", "lru", "lfu"])
def test_victim_heap_with_parked_keys_equals_the_scan(one_token_trace, cache):
    """The victim heap parks the keys it meets that are no candidates (in flight, in
    use): every victim of a timed run, with prefetches on a slow link and three GPUs
    sharing one policy, equals the scan of every candidate.  Red when a parked key that
    has landed is not put back (a newer, higher-ranked candidate goes instead) or a
    stale parked entry returns."""
    hw = dataclasses.replace(TINY_HW, pcie_gbps=TINY_HW.pcie_gbps / 8)  # prefetches wait
    for gpus, budget in ((1, 10), (3, 4)):
        pol = _CheckedVictim(prefetch_distance=2, cache=cache)
        hw_n = dataclasses.replace(hw, num_gpus=gpus)
        simulate(one_token_trace, MODEL, hw_n, pol, budget * MODEL.expert_size_bytes)
        assert pol.checked > 50 and pol.with_parked > 2, (gpus, pol.checked, pol.with_parked)
