"""MoEpic Fig. 3 (``002`` §2): two consecutive layers of one decoding token under a
cache-based policy, a prefetch-based one and MoEpic, hand-timed, and the engine's split
expert against the paper's eq. 5-7.

Every time is a round number: a layer's attention (and router) takes ``ATT`` = 1.5 ms, an
expert's FFN ``T`` = 2 ms (a segment of share ``f`` takes ``f T``), the LM head ``HEAD`` =
1 ms, and a whole expert crosses the link in ``X`` = 4 ms (no fixed cost per transfer).
A token's iteration with every expert resident takes ``2 ATT + 2 T + HEAD`` = 8 ms.

Each trace is one request of two iterations: the prefill of its single prompt token
sets the caches up, the decode step is the token of Fig. 3, and its TPOT is that step's
time.  As in the figure, the first layer's expert is resident; what differs is how the
second layer's expert gets there.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.simulate import simulate
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter, read_trace
from fmoesim.trace.reader import Trace
from policies.lru import LRU
from policies.moepic import MoEpic
from policies.pregated import PreGated
from tests.tiny import TINY_HW, small_model

M = small_model(2, 4, 1)  # two MoE layers of four experts, top-1; a 6 MB expert
S = M.expert_size_bytes
ATT, T, HEAD, X = 1.5e-3, 2.0e-3, 1.0e-3, 4.0e-3
HW = replace(
    TINY_HW,
    pcie_gbps=S / X / 1e9,  # a whole expert in X
    transfer_overhead_s=0.0,
    measured={
        M.name: {
            "expert_a_s": T,
            "expert_b_s": 0.0,
            "attn_a_s": ATT,
            "attn_b_s": 0.0,
            "attn_kv_s": 0.0,
            "attn_pair_s": 0.0,
            "router_a_s": 0.0,
            "router_b_s": 0.0,
            "lm_head_a_s": HEAD,
            "lm_head_b_s": 0.0,
        }
    },
)
ALL_RESIDENT = 2 * ATT + 2 * T + HEAD


def two_steps(path: Path, routes: list[tuple[int, int]], spec: list[tuple[int, int]]) -> Trace:
    """One request: a one-token prefill routed ``routes[0]`` (layer 0, layer 1) and
    decode steps routed ``routes[1:]`` (one in Fig. 3); ``spec[i]`` (layer 0, layer 1)
    is the expert the speculative router (MoEpic eq. 3) ranks first for each layer of
    iteration ``i``, every other expert sharing the rest of the probability."""
    L, E = M.num_layers, M.num_experts
    man = TraceManifest(
        model=TraceModel(
            name=M.name, num_layers=L, num_experts=E, top_k=M.top_k, hidden_size=M.hidden_size
        ),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/test_moepic_fig3.py"},
        has_probs=True,
        has_spec_probs=True,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        w.add_request(0, 1, len(routes))
        for i, (route, guess) in enumerate(zip(routes, spec, strict=True)):
            counts = np.zeros((L, E), np.int32)
            counts[np.arange(L), route] = 1
            probs = np.zeros((L, E))
            probs[np.arange(L), route] = 1.0
            sp = np.full((L, E), 0.1)
            sp[np.arange(L), guess] = 0.7
            w.add_iteration(0, i, 1, None, counts, probs, sp)
    return read_trace(path)


def tpot(result) -> float:  # type: ignore[no-untyped-def]
    """The decode step's time (the request's one TPOT)."""
    return float(result.metrics.request_table()["tpot_s"][0])


class GivenTops(MoEpic):
    """MoEpic with its configuration given instead of searched: ``theta`` per layer and
    the experts whose tops are cached from the start (Fig. 3 draws a configured cache)."""

    def __init__(self, theta: list[float], tops: list[tuple[int, int]], **kw: object) -> None:
        super().__init__(configurator=False, buffer_experts=1, **kw)  # type: ignore[arg-type]
        self.given_theta, self.tops = theta, tops

    def reset(self, ctx):  # type: ignore[no-untyped-def]
        super().reset(ctx)
        self._theta = np.array(self.given_theta)
        self._sizes = self._cache_sizes(self._V, self._theta)

    def _initial_tops(self):  # type: ignore[no-untyped-def]
        from policies.base import Actions, Prefetch

        n, E = self._n, self._E
        return Actions(prefetch=[Prefetch(n + i * E + e, 10.0, "configure") for i, e in self.tops])


def eq5_7(alpha: int, beta: int, gamma: int, theta: float, window_s: float) -> float:
    """MoEpic eq. 5-6 for one layer, with the prefetch window's work already counted:
    the expert loading a layer cannot hide behind the compute of what it holds,
    ``max(0, T_miss - T_hide)``; ``T_miss = (beta (1 - theta) + gamma) X`` less what
    the window (eq. 7) moved before the router."""
    hide = (alpha + beta * theta) * T
    miss = max(0.0, (beta * (1 - theta) + gamma) * X - window_s)
    return max(0.0, miss - hide)


# -- (a) cache-based: a hit computes, a miss loads on demand -----------------------------
def test_cache_based_hit_and_miss(tmp_path):
    """LRU with room for three experts.  Prefill: (e0, e3); decode (e0, e1): layer 0 hits,
    layer 1 misses and waits a whole X; with (e0, e3) again both hit.  Red if a demand
    load overlapped compute it cannot overlap, or a resident expert were charged a load."""
    spec = [(0, 0), (0, 0)]
    miss = two_steps(tmp_path / "m", [(0, 3), (0, 1)], spec)
    hit = two_steps(tmp_path / "h", [(0, 3), (0, 3)], spec)
    assert tpot(simulate(miss, M, HW, LRU(), 3 * S)) == pytest.approx(ALL_RESIDENT + X)
    assert tpot(simulate(hit, M, HW, LRU(), 3 * S)) == pytest.approx(ALL_RESIDENT)
    assert eq5_7(0, 0, 1, 0.0, 0.0) == pytest.approx(X)  # eq. 6 with one expert offloaded


# -- (c) prefetch-based: the next layer's expert loads behind this layer's compute -------
def test_prefetch_based_hides_what_the_window_covers(tmp_path):
    """Pre-gated MoE with room for two experts, keeping what its two layers no longer
    need (``cache_leftovers``), so that the first layer's expert is resident as the
    figure draws it.  At layer 0's gate it prefetches layer 1's predicted expert; the
    window is layer 0's expert and layer 1's attention, ``T + ATT`` = 3.5 ms, against X =
    4 ms: 0.5 ms show.  A wrong guess leaves the whole load to the router's result: the
    GPU waits for the wrong expert's transfer already on the link (0.5 ms: the engine,
    like a copy engine, does not abort a started copy) and then X.  Red if the window left
    out the next layer's attention or a prefetch started before its gate."""
    right = two_steps(tmp_path / "r", [(0, 3), (0, 1)], [(0, 3), (0, 1)])
    wrong = two_steps(tmp_path / "w", [(0, 3), (0, 1)], [(0, 3), (0, 2)])
    window = T + ATT
    keep = PreGated(cache_leftovers=True)
    assert tpot(simulate(right, M, HW, keep, 2 * S)) == pytest.approx(
        ALL_RESIDENT + eq5_7(0, 0, 1, 0.0, window)
    )
    assert tpot(simulate(wrong, M, HW, keep, 2 * S)) == pytest.approx(
        ALL_RESIDENT + (X - window) + X
    )


@pytest.mark.parametrize("experts", [2, 8])
def test_prefetch_based_keeps_no_cache_whatever_the_budget(tmp_path, experts):
    """Pre-gated MoE as MoEpic §4.2 states it ("there are no cached experts"): the
    prefill's layer-0 expert leaves at layer 1's gate, so the decode step loads it on
    demand (X, nothing to hide it), and layer 1's right guess queues behind that load:
    it lands at ``ATT + 2 X`` where the GPU reaches layer 1 at ``2 ATT + X + T``, so
    ``X - (T + ATT)`` = 0.5 ms show.  The same with room for two experts or for all
    eight; keeping leftovers (``cache_leftovers``) with room for all, layer 0 hits.  Red
    if the leftovers stayed (a hit at layer 0, 8.5 ms) or the budget changed the time."""
    right = two_steps(tmp_path / "r", [(0, 3), (0, 1)], [(0, 3), (0, 1)])
    assert tpot(simulate(right, M, HW, PreGated(), experts * S)) == pytest.approx(
        ALL_RESIDENT + X + (X - (T + ATT))
    )
    kept = tpot(simulate(right, M, HW, PreGated(cache_leftovers=True), 8 * S))
    assert kept == pytest.approx(ALL_RESIDENT + (X - (T + ATT)))


# -- (d) MoEpic: cached tops, prefetched bottoms, tops computing while bottoms load -------
THETA = 0.25  # layer 1's split ratio: a 1 ms top and a 3 ms bottom (X); T / 4 and 3T / 4


def moepic(tops: list[tuple[int, int]]) -> GivenTops:
    """Layer 0 caches whole experts (θ = 1), layer 1 splits at :data:`THETA`; with a
    budget of three experts: a buffer of one expert (one bottom of layer 1, or one whole
    expert), one whole expert for layer 0 and four tops for layer 1."""
    return GivenTops([1.0, THETA], tops)


def test_moepic_right_guess_hides_the_bottom(tmp_path):
    """Layer 1's top is cached and the guess is right: at layer 0's gate only the bottom
    (3 ms) is prefetched, and the 3.5 ms window covers it: a hit, nothing shows, where
    the prefetch-based policy showed 0.5 ms (Fig. 3(c) against (d)).  Red if a cached
    top's expert were prefetched whole (4 ms: 0.5 ms would show)."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1)], [(0, 3), (0, 1)])
    r = simulate(tr, M, HW, moepic([(0, 0), (1, 1)]), 3 * S)
    assert tpot(r) == pytest.approx(ALL_RESIDENT)
    assert eq5_7(1, 0, 0, THETA, T + ATT) == 0.0


@pytest.mark.parametrize(
    ("chunks", "abort", "left_s"),
    [
        (10, True, 0.1e-3),  # stops at its 9th chunk boundary, 3.6 ms
        (4, True, 0.5e-3),  # its next boundary, 4 ms, is its end: it lands
        (10, False, X - (T + ATT)),  # a started copy finishes: 0.5 ms more
        (1, True, X - (T + ATT)),  # one chunk: nothing to stop between
    ],
)
def test_moepic_wrong_guess_top_computes_while_the_bottom_loads(tmp_path, chunks, abort, left_s):
    """Layer 1's top is cached, the guess names expert 2 (no top: its whole expert is
    prefetched into the buffer, 4 ms from layer 0's gate, in ``chunks`` chunks).  At
    layer 1's router (3.5 ms) MoEpic "terminates the prefetch operation": the wrong copy
    stops at its next chunk boundary, ``left_s`` after the router (with
    ``abort_wrong=False``, or when its next boundary is its end, it runs on, 0.5 ms), its room
    in the buffer free; then expert 1's bottom takes 3 ms while the top computes T/4 from
    3.5 ms.  Eq. 5-6 (beta = 1) give ``(1 - θ) X - θ T`` = 2.5 ms; the engine adds
    ``left_s``.  Red if the top waited for its bottom before computing (3.5 ms), the
    abort stopped a copy between chunk boundaries, or it never stopped one."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1)], [(0, 3), (0, 2)])
    hw = replace(HW, chunk_bytes=-(-S // chunks))
    pol = GivenTops([1.0, THETA], [(0, 0), (1, 1)], abort_wrong=abort)
    r = simulate(tr, M, hw, pol, 3 * S)
    paper = eq5_7(0, 1, 0, THETA, 0.0)
    assert paper == pytest.approx((1 - THETA) * X - THETA * T)
    assert tpot(r) == pytest.approx(ALL_RESIDENT + paper + left_s)
    assert r.summary["misses"] == 1  # the decode step's layer 1 (its bottom was missing)
    wrong = [t for t in r.transfers if t.key == 1 * 4 + 2]
    assert len(wrong) == 1
    stopped = abort and chunks == 10
    assert wrong[0].aborted == stopped and r.summary["aborted_transfers"] == int(stopped)
    moved = round((T + ATT + left_s) / X * S) if stopped else S
    assert wrong[0].moved_bytes == pytest.approx(moved, abs=chunks)
    assert r.summary["aborted_bytes"] == (wrong[0].moved_bytes if stopped else 0)


def test_moepic_top_cached_nothing_prefetched(tmp_path):
    """As eq. 5-6 with beta = 1 and an empty window: layer 1's top is cached, no prefetch
    (``prefetch="none"``): its bottom loads on demand (3 ms) while its top computes
    (0.5 ms): 2.5 ms show, against X = 4 ms for the cache-based miss of (a).  Red if the
    whole expert were loaded for a cached top (4 ms)."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1)], [(0, 3), (0, 1)])
    pol = GivenTops([1.0, THETA], [(0, 0), (1, 1)], prefetch="none")
    r = simulate(tr, M, HW, pol, 3 * S)
    assert tpot(r) == pytest.approx(ALL_RESIDENT + eq5_7(0, 1, 0, THETA, 0.0))


def test_moepic_nothing_cached_loads_top_then_bottom(tmp_path):
    """Layer 1's expert has no top and no prefetch: eq. 6 with gamma = 1 charges a whole
    X.  The engine loads the missing expert as its top (1 ms) and then its bottom (3 ms),
    and the top computes while the bottom loads ("processes ... top segments that are
    already residing in VRAM"): 4 - T/4 = 3.5 ms show, eq. 6 less the top's compute.
    Red if the bottom went over the link before the top (the top could not compute early)."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1)], [(0, 3), (0, 1)])
    pol = GivenTops([1.0, THETA], [(0, 0)], prefetch="none")
    r = simulate(tr, M, HW, pol, 3 * S)
    assert tpot(r) == pytest.approx(ALL_RESIDENT + eq5_7(0, 0, 1, THETA, 0.0) - THETA * T)


def test_a_used_prefetched_expert_joins_the_cache(tmp_path):
    """Two decode steps route layer 1 to expert 1, whose top is not cached; the guess is
    right both times.  Step 1: the whole expert is prefetched into the buffer (4 ms
    against a 3.5 ms window: late), computes, and then, as a missed one would (§3.3,
    "replaces it with the newly loaded expert"), its top joins layer 1's cache and its
    bottom takes its place in the buffer, with nothing over the link.  Step 2: the
    guess's top is cached and its bottom already in the buffer, where it counts against
    the buffer's room, so nothing is prefetched and nothing pushes it out: a hit, with
    no transfer at all.  Red if a used prefetched expert stayed whole and out of the
    cache, the split moved bytes over the link, or the prefetcher evicted the guess's
    own bottom for a lower-scored expert (step 2 then loads it again)."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1), (0, 1)], [(0, 3), (0, 1), (0, 1)])
    r = simulate(tr, M, HW, moepic([(0, 0)]), 3 * S)
    n = M.num_layers * M.num_experts
    whole, top = 1 * 4 + 1, n + 5
    moved = [(t.key, t.reason) for t in r.transfers]
    assert moved == [(n + 0, "configure"), (1 * 4 + 3, "prefetch"), (whole, "prefetch")]
    assert r.transfers[-1].used
    assert top in r.caches[0].entries and whole not in r.caches[0].entries
    s = r.summary  # the prefill finds both its experts in flight
    assert (s["hits"], s["late"], s["misses"]) == (3, 3, 0)
    assert tpot(r) == pytest.approx((ALL_RESIDENT + (X - T - ATT) + ALL_RESIDENT) / 2)


def test_caching_off_releases_a_used_prefetched_expert_instead_of_splitting_it(tmp_path):
    """With caching off (``release_after_use``) a used prefetched whole expert leaves the
    GPU at once, so it has nothing left to split: the run goes on and expert 1's top never
    enters the cache.  Red if the engine split an expert that caching off already released
    (a KeyError)."""
    tr = two_steps(tmp_path / "t", [(0, 3), (0, 1), (0, 1)], [(0, 3), (0, 1), (0, 1)])
    r = simulate(tr, M, HW, moepic([(0, 0)]), 3 * S, release_after_use=True)
    n = M.num_layers * M.num_experts
    assert n + 5 not in r.caches[0].entries and 1 * 4 + 5 not in r.caches[0].entries
