"""``engine.reserve``: when a prefetch takes its bytes of the budget.  ``submit`` (the
default) reserves them, evicting to make room, when the prefetch is queued; ``start``
when its copy starts, as MoE-Infinity's public code evicts for a prefetch task when its
I/O thread takes it off the queue.  Hand-traced on :data:`TINY` (2 layers x 4 experts,
top-1; key = layer x 4 + expert) with LRU caching on one GPU."""

from __future__ import annotations

from dataclasses import replace

import pytest

from fmoesim.engine import simulate
from fmoesim.engine.cache import ExpertCache
from fmoesim.errors import ConfigError
from policies.base import NO_ACTIONS, Actions, GateView, Outcome, Prefetch
from policies.lru import LRU
from tests._engine_helpers import Req, ScheduledPrefetch, write_trace
from tests.tiny import TINY, TINY_HW

SIZE = TINY.expert_size_bytes
H, L_, M = Outcome.HIT, Outcome.LATE, Outcome.MISS


class _PrefetchThenCancel(LRU):
    """LRU that prefetches ``prefetch`` at layer step 2 (iteration 1's first gate) and
    cancels ``cancel`` at step 3."""

    name = "prefetch-then-cancel"

    def __init__(self, prefetch: list[tuple[int, float]], cancel: list[int]) -> None:
        super().__init__()
        self.prefetch, self.cancel = prefetch, cancel

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """The schedule above."""
        if gate.step == 2:
            return Actions(prefetch=[Prefetch(k, p) for k, p in self.prefetch])
        if gate.step == 3 and self.cancel:
            return Actions(cancel=list(self.cancel))
        return NO_ACTIONS


def _run(tmp_path, policy, budget_experts, routes, reserve):  # type: ignore[no-untyped-def]
    tr = write_trace(tmp_path / f"t-{reserve}", TINY, [Req(0, 1, routes)])
    return simulate(
        tr, TINY, TINY_HW, policy, budget_experts * SIZE, access_log=True, reserve=reserve
    )


@pytest.mark.parametrize(("reserve", "last", "evictions"), [("submit", M, 2), ("start", H, 1)])
def test_a_prefetch_cancelled_while_queued_evicts_nothing_when_reserving_at_start(
    tmp_path, reserve, last, evictions
):
    """Three experts of budget.  Iteration 0 loads keys 0 and 4.  Iteration 1's layer 0
    misses key 1 (the third slot), and its gate prefetches keys 5 and 6 behind that
    load; layer 1's gate cancels key 6, still queued behind key 5.  Reserving when
    queued, key 5 evicts key 0 and key 6 evicts key 4 (both at the gate), so iteration
    2's key 4 misses (loaded into the slot key 6's cancellation freed: two evictions).
    Reserving at the start, key 5 evicts key 0 when its copy starts (key 1 landed and
    in use) and key 6 evicts nothing before it is cancelled, so key 4 hits (one
    eviction).  Red if a queued prefetch reserves (or evicts) before its copy starts, or
    if a cancelled one that held nothing frees bytes it never took."""
    routes = [[[0], [0]], [[1], [1]], [[1], [0]]]  # iteration -> layer -> expert
    r = _run(tmp_path, _PrefetchThenCancel([(5, 1.0), (6, 2.0)], [6]), 3, routes, reserve)
    s = r.summary
    assert list(r.accesses["outcome"]) == [M, M, M, L_, H, last]
    assert s["evictions"] == evictions
    assert s["cancelled_transfers"] == 1 and s["prefetch_dropped"] == 0
    six = [t for t in r.transfers if t.key == 6]
    assert len(six) == 1 and six[0].cancelled and six[0].moved_bytes == 0
    assert s["peak_expert_bytes"] == 3 * SIZE


@pytest.mark.parametrize("reserve", ["submit", "start"])
def test_a_queued_prefetch_needed_before_its_start_loads_on_demand(tmp_path, reserve):
    """As above without the cancel, layer 1 of iteration 1 routes key 6, queued behind
    key 5 (running).  Reserving when queued it is escalated and lands after key 5;
    reserving at the start its queued prefetch is cancelled and an on-demand load takes
    its place (MoE-Infinity's public code replaces the task the same way), queued next,
    so it starts when key 5 lands, as the escalated one does.  Both count the access
    LATE.  Red if an unreserved prefetch is escalated (it would start without room), if
    the access counts as a miss, or if the on-demand load waits behind anything but the
    running copy."""
    routes = [[[0], [0]], [[1], [2]], [[1], [2]]]
    pol = _PrefetchThenCancel([(5, 1.0), (6, 2.0)], [])
    r = _run(tmp_path, pol, 3, routes, reserve)
    assert list(r.accesses["outcome"]) == [M, M, M, L_, H, H]
    five = next(t for t in r.transfers if t.key == 5)
    moved = [t for t in r.transfers if t.key == 6 and not t.cancelled]
    assert len(moved) == 1 and moved[0].start_s == pytest.approx(five.end_s)
    if reserve == "start":
        assert moved[0].reason == "on_demand"
        assert [t.cancelled for t in r.transfers if t.key == 6] == [True, False]
        assert r.summary["cancelled_transfers"] == 1
    else:
        assert moved[0].reason == "prefetch" and moved[0].escalated
        assert r.summary["cancelled_transfers"] == 0


@pytest.mark.parametrize("reserve", ["submit", "start"])
def test_a_prefetch_with_no_room_is_dropped_at_its_gate_or_at_its_start(tmp_path, reserve):
    """One expert of budget.  Iteration 1's layer 0 misses key 1 (evicting key 4) and
    its gate prefetches key 5 while key 1 is in flight.  Reserving when queued, nothing
    is evictable then and the prefetch is dropped at once (no transfer); reserving at
    the start, it is queued, and when key 1 lands (in use by layer 0) it finds nothing
    to evict and is dropped then (its record cancelled, counted as dropped, not as a
    cancellation).  Red if a prefetch that cannot fit evicts an expert in use, runs over
    the budget, or is counted twice."""
    routes = [[[0], [0]], [[1], [0]]]
    r = _run(tmp_path, ScheduledPrefetch({2: [5]}), 1, routes, reserve)
    s = r.summary
    assert list(r.accesses["outcome"]) == [M, M, M, M]
    assert s["prefetch_dropped"] == 1 and s["cancelled_transfers"] == 0
    assert s["peak_expert_bytes"] == SIZE
    five = [t for t in r.transfers if t.key == 5]
    if reserve == "start":
        assert len(five) == 1 and five[0].cancelled and five[0].moved_bytes == 0
    else:
        assert five == []


def test_reserve_moves_a_queued_entry_s_bytes_into_its_group_and_the_budget():
    """The cache's side, with budget groups (one per layer): a key admitted with
    ``reserve=False`` is in the cache and the policy's view but holds no bytes; its
    :meth:`ExpertCache.reserve` evicts within its group, then counts its bytes there and
    in the budget; cancelled unreserved, it frees nothing.  Red if an unreserved entry
    counts against a budget, or if its reservation evicts outside its group."""
    pol = LRU()
    pol.reset(_ctx())
    c = ExpertCache(4 * SIZE, pol, 0, lambda k: k // 4, {0: SIZE, 1: 2 * SIZE})
    for k in (0, 4):
        assert c.admit(k, SIZE, "on_demand")
        c.complete(k)
    assert c.admit(1, SIZE, "prefetch", reserve=False) and c.admit(5, SIZE, "prefetch", False)
    assert (c.used_bytes, c.group_used) == (2 * SIZE, {0: SIZE, 1: SIZE})
    assert 1 in c.entries and not c.entries[1].reserved
    assert c.reserve(1)  # group 0 holds one expert: key 0 goes, key 4 stays
    assert 0 not in c.entries and 4 in c.entries and c.evictions == 1
    assert (c.used_bytes, c.group_used) == (2 * SIZE, {0: SIZE, 1: SIZE})
    c.abort(5)
    assert (c.used_bytes, c.group_used, c.evictions) == (2 * SIZE, {0: SIZE, 1: SIZE}, 1)


def _ctx():  # type: ignore[no-untyped-def]
    from tests._baseline_helpers import context

    return context(TINY, 4)


@pytest.mark.parametrize(
    ("kwargs", "said"),
    [
        ({"reserve": "later"}, "must be one of submit, start"),
        ({"reserve": "start", "timing": False}, "needs the timed simulator"),
        ({"reserve": "start", "experts_per_layer": 1}, "budget groups"),
    ],
)
def test_reserve_is_refused_where_it_is_not_modelled(tmp_path, kwargs, said):
    """Red if an unknown value, a hit-rate-only run or budget groups run anyway (the
    hit-rate-only backends start no copy; budget groups are not modelled)."""
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [0]]])])
    budget = SIZE * (TINY.num_layers if "experts_per_layer" in kwargs else 2)
    with pytest.raises(ConfigError, match=said) as err:
        simulate(tr, TINY, TINY_HW, LRU(), budget, **kwargs)
    assert "engine.reserve" in str(err.value)


def test_reserve_at_start_is_refused_for_lanes_hosts_and_synchronous_prefetching(tmp_path):
    """Red if a link of several lanes, a host that issues copies ahead (measured host
    costs), or a policy whose layers wait for their prefetches (a prefetch dropped at
    its start would never land) runs with ``reserve=start``."""
    tr = write_trace(tmp_path / "t", TINY, [Req(0, 1, [[[0], [0]]])])
    lanes = replace(TINY_HW, link_lanes=2)
    with pytest.raises(ConfigError, match="several lanes"):
        simulate(tr, TINY, lanes, LRU(), 2 * SIZE, reserve="start")
    host = replace(TINY_HW, measured={TINY.name: {"host_layer_s": 1e-5}})
    with pytest.raises(ConfigError, match="host costs"):
        simulate(tr, TINY, host, LRU(), 2 * SIZE, reserve="start")

    class _Sync(LRU):
        name = "sync-lru"

        def waits_for_prefetches(self) -> bool:
            return True

    with pytest.raises(ConfigError, match="wait for their prefetches"):
        simulate(tr, TINY, TINY_HW, _Sync(), 2 * SIZE, reserve="start")
