"""Belady's MIN with future knowledge: the upper bound of demand caching."""

from __future__ import annotations

from bisect import bisect_right
from typing import Final

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.errors import ConfigError
from policies._ranked import IntRankedKeys, RankedPolicy
from policies.base import NO_ACTIONS, Actions, GateView, Outcome, PolicyContext

#: "Never accessed again": later than any step.
NEVER: Final = int(np.iinfo(np.int64).max)


@mypyc_attr(allow_interpreted_subclasses=True)
class Belady(RankedPolicy):
    """Evict the candidate whose next access is farthest in the future.

    paper: Belady's MIN (1966), the optimal offline replacement.  MoE-Infinity §7.3 (Table
    5) compares against an "ideal caching strategy, a theoretical model assuming perfect
    GPU buffer access prediction, serving as a benchmark for optimal caching efficiency".
    here: MIN stands for that ideal (the ``moe-infinity-tab5*`` presets' ideal column)
    because it is the one optimum that needs no timing: an ideal that also prefetches
    would hit as often as its prefetches land in time, which depends on the link, and the
    paper gives no such model.  So the column is a lower bound of the paper's ideal.  The
    engine reveals the whole access sequence (``ctx.future``, static batching
    only) and reports the current global layer step in every gate (``gate.step``).  The
    victim is the candidate whose next access strictly after the current step is
    farthest; one that is never accessed again counts as infinitely far; ties go to the
    smallest key.  The engine must load every missed expert (no bypass), so this is MIN
    without bypass, the optimum among demand-paging policies: it gives the most hits any
    policy that loads only on demand can get at that budget.  It prefetches nothing, so
    it is *not* a bound for prefetching policies, and with timing it may still stall.

    The next access of an admitted expert changes only when it is accessed, so the
    admitted experts stay sorted by it.  This relies on the engine's contract that
    ``ctx.future`` is exactly the access sequence it then reports through
    :meth:`on_access`.

    Cost: :meth:`reset` sorts the future once (O(A log A) for A accesses);
    :meth:`on_access` advances a per-key pointer (amortised O(1)) and re-ranks the key
    (O(log n)); :meth:`victim` walks the ranking from the front.
    """

    name = "belady"
    uses_future = True

    def reset(self, ctx: PolicyContext) -> None:
        """Index the future: for each key, the sorted steps at which it is accessed."""
        super().reset(ctx)
        future = ctx.future
        if future is None:
            raise ConfigError(
                "policy",
                "belady",
                "needs static batching (serving.mode=static): the future must be known",
            )
        n_keys = ctx.model.num_layers * ctx.model.num_experts
        ptr = np.asarray(future.ptr, dtype=np.int64)
        keys = np.asarray(future.keys, dtype=np.int64)
        if len(keys) and (keys.min() < 0 or keys.max() >= n_keys):
            raise ValueError(f"future accesses hold keys outside [0, {n_keys})")
        step_of = np.repeat(np.arange(len(ptr) - 1, dtype=np.int64), np.diff(ptr))
        order = np.argsort(keys, kind="stable")  # stable: steps stay ascending per key
        start = np.zeros(n_keys + 1, dtype=np.int64)
        np.cumsum(np.bincount(keys, minlength=n_keys), out=start[1:])
        # perf: plain lists, whose items the per-access hook reads as Python ints (a
        # numpy scalar read costs several times more)
        self._steps: list[int] = step_of[order].tolist()  # grouped by key, ascending within
        self._start: list[int] = start.tolist()
        self._pos: list[int] = start[:-1].tolist()  # per key: its first access not yet done
        self._next: list[int] = [
            self._steps[lo] if hi > lo else NEVER
            for lo, hi in zip(self._start[:-1], self._start[1:], strict=True)
        ]
        self._step = -1
        # admitted keys by (-next access, key), as the int -min(next, never) * n_keys +
        # key (same order: 0 <= key < n_keys, and "never" is later than every step)
        # perf: an int rank, not a tuple (see IntRankedKeys)
        self._n_keys = n_keys
        self._never = len(ptr)  # a step after the last
        self._ranked = IntRankedKeys(n_keys)

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """Remember the current global layer step."""
        self._step = gate.step
        return NO_ACTIONS

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Move ``key``'s next access past the current step (amortised O(1))."""
        i, end = self._pos[key], self._start[key + 1]
        steps, now = self._steps, self._step
        while i < end and steps[i] <= now:
            i += 1
        self._pos[key] = i
        nxt = steps[i] if i < end else NEVER
        self._next[key] = nxt
        ranked = self._ranked
        if key in ranked.ranks:  # perf: _rerank with _rank inlined (nxt is after now)
            ranked.put(key, key - min(nxt, self._never) * self._n_keys)

    def _rank(self, key: int) -> int:
        """Farthest next access first; ties: smallest key (the int of ``reset``)."""
        return key - min(self.next_access(key), self._never) * self._n_keys

    def next_access(self, key: int) -> int:
        """The first step after the current one at which ``key`` is accessed (or NEVER)."""
        nxt = self._next[key]
        if nxt > self._step:
            return nxt
        # Not refreshed by on_access (e.g. admitted without an access): search its steps.
        lo, hi = self._start[key], self._start[key + 1]
        i = bisect_right(self._steps, self._step, lo, hi)
        return self._steps[i] if i < hi else NEVER
