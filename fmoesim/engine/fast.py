"""Exact fast paths for hit-rate-only runs of demand-only policies.

A hit-rate-only run (``timing=False``) of a policy that never prefetches is a pure
cache simulation over the sequence of layer steps, so it needs none of the Runner's
machinery.  Each kernel here replays exactly what the Runner + cache + policy do (same
access order, same pinning of the current step's experts, same victims) and is tested
for equality with the generic path (``tests/test_engine_fast.py``).

perf: the generic path costs several microseconds per layer step (policy hooks,
cache entries, transfer records); the LRU kernel below is a tight loop over an
``OrderedDict`` and processes a few million accesses per second.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np


class NotApplicable(Exception):
    """The fast path cannot reproduce the generic path for this input; use the Runner."""


def lru_hit_only(
    keys: np.ndarray, ptr: np.ndarray, num_layers: int, num_experts: int, capacity: int
) -> tuple[list[list[int]], int]:
    """Global LRU over layer steps: step ``s`` accesses ``keys[ptr[s]:ptr[s+1]]``.

    Matches :class:`policies.lru.LRU` driven by the Runner: hits move to the most
    recent end in ascending key order, then each miss evicts the least recently used
    entry and is inserted as most recent.  The least recently used entry is never one
    of the current step's (pinned) experts as long as a step needs at most
    ``capacity`` experts; otherwise :class:`NotApplicable` is raised.

    Returns ``(acc, evictions)`` with ``acc`` (L, 3) counts of HIT, LATE (always 0)
    and MISS per layer.
    """
    sizes = np.diff(ptr)  # (S,) accesses per step
    if len(sizes) and int(sizes.max()) > capacity:
        raise NotApplicable("a layer step needs more experts than the cache holds")
    order: OrderedDict[int, None] = OrderedDict()
    move, popitem = order.move_to_end, order.popitem
    key_list = keys.tolist()
    bounds = ptr.tolist()
    misses_per_step = [0] * len(sizes)
    evictions = 0
    s = 0
    for a, b in zip(bounds, bounds[1:]):  # noqa: B905 - bounds[1:] is one shorter by design
        missing = None
        for k in key_list[a:b]:
            if k in order:
                move(k)
            elif missing is None:
                missing = [k]
            else:
                missing.append(k)
        if missing is not None:
            misses_per_step[s] = len(missing)
            for k in missing:
                if len(order) >= capacity:
                    popitem(last=False)
                    evictions += 1
                order[k] = None
        s += 1
    # per-layer totals, vectorised once at the end
    nonempty = sizes > 0
    layer = keys[ptr[:-1][nonempty]] // num_experts  # (S',) layer of each non-empty step
    miss = np.bincount(layer, np.asarray(misses_per_step)[nonempty], minlength=num_layers)
    total = np.bincount(layer, sizes[nonempty], minlength=num_layers)
    acc = [[int(t - m), 0, int(m)] for t, m in zip(total, miss, strict=True)]
    return acc, evictions
