"""Expert residency and byte accounting, shared by the simulator and the GPU backend.

The cache owns the truth about what is on one GPU: resident entries, in-flight
transfers (their bytes are reserved when the transfer is issued, or, for a prefetch
under ``engine.reserve=start``, when its copy starts), pins (entries in use by the
current layer) and the peak of bytes used.  The policy only chooses victims via
:meth:`policies.base.Policy.victim`; eviction itself happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
from mypy_extensions import mypyc_attr

from fmoesim.errors import PolicyError
from policies.base import Outcome, Policy


class Entry:
    """One cached (or arriving) expert."""

    __slots__ = (
        "size_bytes", "resident", "reason", "pins", "used", "record", "group", "reserved"
    )  # fmt: skip

    def __init__(self, size_bytes: int, reason: str, group: int = 0) -> None:
        self.size_bytes = size_bytes
        # whether size_bytes count against the budget: False while a queued prefetch
        # waits for its copy to start (ExpertCache.admit with reserve=False)
        self.reserved = True
        self.resident = False
        self.reason = reason
        self.pins = 0
        self.used = False
        self.record: Any = None  # the backend's transfer record, whose ``used`` flag we set
        # perf: the budget group (with groups), found once at admission, not per event
        self.group = group


class Evictable(dict):  # type: ignore[type-arg]
    """The resident, unpinned entries of a cache: what ``victim`` may pick (read-only).

    perf: a dict of those keys kept up to date by the cache, so ``key in candidates``
    and ``len`` are C-level lookups; iteration is overridden to follow the cache's
    admission order (oldest first), as the policy protocol promises.
    """

    __slots__ = ("_entries",)

    def __init__(self, entries: dict[int, Entry]) -> None:
        super().__init__()
        self._entries = entries

    def __iter__(self) -> Iterator[int]:
        # perf: the cache's keys filtered by this dict's own membership, all in C (the
        # membership is exactly "resident and not pinned")
        return filter(self.__contains__, self._entries)


class GroupEvictable(Evictable):
    """The evictable entries of one budget group (see :class:`ExpertCache`).

    perf: ``_entries`` is the group's own admission-ordered key dict, so iterating walks
    the group, not the whole cache."""

    __slots__ = ()

    def __iter__(self) -> Iterator[int]:
        return filter(self.__contains__, self._entries)


@mypyc_attr(allow_interpreted_subclasses=True)
class ExpertCache:
    """Byte-budgeted expert cache of one GPU.

    Invariants (checked by the contract tests): ``used_bytes <= budget_bytes``;
    pinned or in-flight entries are never evicted; ``used_bytes`` equals the sum of the
    reserved entries' sizes (every entry is reserved unless it was admitted with
    ``reserve=False``: a queued prefetch that reserves at the start of its copy,
    :meth:`reserve`).

    Budget groups (optional): with ``group_of`` (key -> group id) and
    ``group_budgets_bytes`` (group id -> bytes), every key belongs to a group with its
    own budget, and a group's overflow evicts only within the group (the policy's
    ``victim`` sees that group's candidates): per-layer caches (MoEpic Table 1, "C
    experts per layer"; its cache configurator's per-layer budgets).  The overall
    ``budget_bytes`` still holds.  :meth:`set_group_budget` changes a group's budget
    (shrinking evicts).

    ``release_after_use`` turns caching off: an expert is evicted as soon as its last
    pin is released after a use, so the budget is only a buffer for transfers in flight
    and prefetches waiting to be used (MoE-Infinity §7.2: "we disable the caching of the
    experts in all systems (i.e., experts are released from the buffer immediately after
    being used)").
    """

    def __init__(
        self,
        budget_bytes: int,
        policy: Policy,
        gpu: int = 0,
        group_of: Callable[[int], int] | None = None,
        group_budgets_bytes: dict[int, int] | None = None,
        release_after_use: bool = False,
    ) -> None:
        self.budget_bytes = int(budget_bytes)
        self.release_after_use = release_after_use
        self.policy = policy
        self.gpu = gpu
        self.entries: dict[int, Entry] = {}
        self.evictable = Evictable(self.entries)  # kept up to date by complete/pin/unpin/evict
        self.group_of = group_of
        self.group_budget: dict[int, int] = dict(group_budgets_bytes or {})
        self.group_used: dict[int, int] = dict.fromkeys(self.group_budget, 0)
        self.group_keys: dict[int, dict[int, None]] = {g: {} for g in self.group_budget}
        self.group_evictable: dict[int, GroupEvictable] = {
            g: GroupEvictable(self.group_keys[g])  # type: ignore[arg-type]
            for g in self.group_budget
        }
        if (group_of is None) != (group_budgets_bytes is None):
            raise ValueError("budget groups need both group_of and group_budgets_bytes")
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.evicted_bytes = 0
        self.cancelled = 0
        self.refused_at_start = 0  # prefetches dropped when their copy started (reserve)
        self.wasted_bytes = 0  # prefetched bytes evicted before any use
        # (num_keys,) bool, True where the key is resident; None until track_residency
        self.resident_mask: Any = None
        # the keys evicted while this is a list (None: not logged)
        self.evicted_log: list[int] | None = None

    def track_residency(self, num_keys: int) -> None:
        """Keep :attr:`resident_mask`, a ``(num_keys,)`` bool array of the resident keys,
        up to date from now on (perf: a caller classifies hundreds of keys by one array
        index instead of a dict look-up each)."""
        mask = np.zeros(num_keys, dtype=bool)  # (num_keys,)
        for key, e in self.entries.items():
            if e.resident:
                mask[key] = True
        self.resident_mask = mask

    def outcome(self, key: int) -> Outcome:
        """HIT if ``key`` is resident, LATE if its transfer is in flight, else MISS."""
        e = self.entries.get(key)
        if e is None:
            return Outcome.MISS
        return Outcome.HIT if e.resident else Outcome.LATE

    def is_resident(self, key: int) -> bool:
        """Whether ``key`` is on the GPU and usable."""
        e = self.entries.get(key)
        return e is not None and e.resident

    def admit(self, key: int, size_bytes: int, reason: str, reserve: bool = True) -> bool:
        """Reserve ``size_bytes`` for ``key`` about to be transferred, evicting as needed.

        Returns False when the resident, unpinned entries cannot free enough room (the
        evictions already made stay made).  With ``reserve=False`` the entry is made
        (the policy is told of it) and nothing is reserved or evicted: :meth:`reserve`
        does that when its copy starts.
        """
        if key in self.entries:
            raise ValueError(f"expert {key} is already cached or in flight on GPU {self.gpu}")
        if size_bytes > self.budget_bytes:
            return False
        entries = self.entries
        g = 0
        if self.group_of is not None:
            g = self.group_of(key)
            if g not in self.group_budget:
                raise ValueError(f"key {key} is in group {g}, with no budget on GPU {self.gpu}")
            if size_bytes > self.group_budget[g]:
                return False
        if not reserve:
            e = Entry(size_bytes, reason, g)
            e.reserved = False
            if self.group_of is not None:
                self.group_keys[g][key] = None
            entries[key] = e
            self.policy.on_insert(key)
            return True
        if not self._make_room(key, size_bytes, g):
            return False
        if self.group_of is not None:
            self.group_used[g] += size_bytes
            self.group_keys[g][key] = None
        entries[key] = Entry(size_bytes, reason, g)
        self.used_bytes += size_bytes
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        self.policy.on_insert(key)
        return True

    def reserve(self, key: int) -> bool:
        """Reserve the bytes of ``key``, admitted with ``reserve=False`` and still in
        flight, evicting as :meth:`admit` does; False when the resident, unpinned entries
        cannot free enough room (the evictions already made stay made)."""
        e = self.entries[key]
        if e.reserved:
            return True
        size, g = e.size_bytes, e.group
        if not self._make_room(key, size, g):
            return False
        e.reserved = True
        if self.group_of is not None:
            self.group_used[g] += size
        self.used_bytes += size
        if self.used_bytes > self.peak_bytes:
            self.peak_bytes = self.used_bytes
        return True

    def _make_room(self, key: int, size_bytes: int, g: int) -> bool:
        """Evict the policy's victims until ``size_bytes`` for ``key`` fit in its budget
        group ``g`` (with groups) and in the budget; False when the resident, unpinned
        entries run out first (the evictions made stay made)."""
        if self.group_of is not None:
            cands = self.group_evictable[g]
            while self.group_used[g] + size_bytes > self.group_budget[g]:
                if not cands:
                    return False
                self.evict(self._victim(cands, key))
        evictable = self.evictable
        while self.used_bytes + size_bytes > self.budget_bytes:
            if not evictable:
                return False
            try:  # perf: _victim inlined
                victim = self.policy.victim(evictable, key)
            except TypeError as exc:
                self._returned(exc)
                raise
            try:
                ok = victim in evictable
            except TypeError:  # unhashable
                ok = False
            if not ok:
                raise self._bad_victim(victim)
            self.evict(victim)
        return True

    def _victim(self, candidates: Evictable, incoming: int) -> int:
        """The policy's victim among ``candidates`` (a :class:`PolicyError` if it
        chooses anything else)."""
        try:
            victim = self.policy.victim(candidates, incoming)
        except TypeError as exc:
            self._returned(exc)
            raise
        try:
            ok = victim in candidates
        except TypeError:  # unhashable
            ok = False
        if not ok:
            raise self._bad_victim(victim)
        return victim

    def _bad_victim(self, victim: object) -> PolicyError:
        return PolicyError(
            f"policy {self.policy.name!r}: victim: chose {victim!r} on GPU {self.gpu}, not "
            "one of the candidates (rule: a victim is one of the candidates it is given; "
            "the others are pinned, in flight, absent or in another budget group)"
        )

    def _returned(self, exc: TypeError) -> None:
        """Raise :class:`PolicyError` (from ``exc``) if ``exc`` is the compiled build's
        check of the type ``victim`` returned (``int object expected; got list``)."""
        said = str(exc)
        if said.startswith("int object expected; got "):
            raise PolicyError(
                f"policy {self.policy.name!r}: victim: returned a {said.rsplit('got ', 1)[1]}, "
                "not an int (rule: a victim is one of the candidates it is given, a Python "
                "int)"
            ) from exc

    def set_group_budget(self, group: int, budget_bytes: int) -> bool:
        """Set ``group``'s budget, evicting its entries (policy's choice) to fit; False
        when in-use or in-flight entries keep it above the new budget (the budget is
        then still lowered: nothing more is admitted until it fits)."""
        if self.group_of is None:
            raise ValueError("this cache has no budget groups")
        if group not in self.group_budget:
            self.group_used[group] = 0
            self.group_keys[group] = {}
            self.group_evictable[group] = GroupEvictable(self.group_keys[group])  # type: ignore[arg-type]
        self.group_budget[group] = int(budget_bytes)
        cands = self.group_evictable[group]
        while self.group_used[group] > budget_bytes:
            if not cands:
                return False
            self.evict(self._victim(cands, -1))
        return True

    def complete(self, key: int) -> None:
        """The transfer of ``key`` finished: it is resident now."""
        e = self.entries[key]
        e.resident = True
        if self.resident_mask is not None:
            self.resident_mask[key] = True
        if not e.pins:
            self.evictable[key] = None
            if self.group_of is not None:
                self.group_evictable[e.group][key] = None

    def evict(self, key: int) -> None:
        """Remove a resident, unpinned entry and free its bytes."""
        e = self._remove(key)
        if self.evicted_log is not None:
            self.evicted_log.append(key)
        self.evictions += 1
        self.evicted_bytes += e.size_bytes
        if not e.used and e.reason == "prefetch":
            self.wasted_bytes += e.size_bytes
        self.policy.on_evict(key)

    def _remove(self, key: int) -> Entry:
        """Take a resident, unpinned entry out of the books (its bytes freed)."""
        e = self.entries[key]
        if not e.resident or e.pins:
            raise RuntimeError(f"cannot evict expert {key} on GPU {self.gpu}: in flight or pinned")
        del self.entries[key]
        del self.evictable[key]
        if self.resident_mask is not None:
            self.resident_mask[key] = False
        self.used_bytes -= e.size_bytes
        if self.group_of is not None:
            g = e.group
            del self.group_evictable[g][key]
            del self.group_keys[g][key]
            self.group_used[g] -= e.size_bytes
        return e

    def split(self, key: int, top_key: int, top_bytes: int, bottom_key: int | None) -> bool:
        """A resident, unpinned whole expert becomes two segments already on the GPU: its
        top (``top_bytes``, admitted to the top's budget group, evicting there as the
        policy chooses) and, unless ``bottom_key`` is None (the top is the whole expert),
        its bottom in the whole's place.  Nothing crosses the link and nothing counts as
        evicted; the whole counts as used.  False, with nothing changed but the top
        group's evictions, when that group cannot make room."""
        e = self.entries[key]
        if not e.resident or e.pins or not self.admit(top_key, top_bytes, e.reason):
            return False
        self.complete(top_key)
        e.used = True
        if e.record is not None:
            e.record.used = True
        self._remove(key)
        self.policy.on_evict(key)
        if bottom_key is not None:
            if not self.admit(bottom_key, e.size_bytes - top_bytes, e.reason):
                raise RuntimeError(f"expert {key}: its bottom does not fit in its own place")
            self.complete(bottom_key)
        return True

    def abort(self, key: int) -> None:
        """Drop an in-flight entry whose transfer was cancelled before it started or
        aborted (the link lands nothing of it)."""
        self._drop(key)
        self.cancelled += 1

    def refuse(self, key: int) -> None:
        """Drop an in-flight entry whose bytes :meth:`reserve` could not find room for
        when its copy was to start (the link moves nothing of it)."""
        self._drop(key)
        self.refused_at_start += 1

    def _drop(self, key: int) -> None:
        e = self.entries[key]
        if e.resident or e.pins:
            raise RuntimeError(f"cannot cancel expert {key} on GPU {self.gpu}: resident or pinned")
        del self.entries[key]
        if self.group_of is not None:
            del self.group_keys[e.group][key]
        if e.reserved:
            self.used_bytes -= e.size_bytes
            if self.group_of is not None:
                self.group_used[e.group] -= e.size_bytes
        self.policy.on_evict(key)

    def pin(self, key: int, entry: Entry | None = None) -> None:
        """Mark ``key`` in use (not evictable) and used (``entry``: its entry, when the
        caller has looked it up already; perf: one dict lookup less per access)."""
        e = self.entries[key] if entry is None else entry
        if e.resident and not e.pins:
            del self.evictable[key]
            if self.group_of is not None:
                del self.group_evictable[e.group][key]
        e.pins += 1
        if not e.used:
            e.used = True
            if e.record is not None:
                e.record.used = True

    def unpin(self, key: int) -> None:
        """Release one pin of ``key`` (and, with ``release_after_use``, the expert with
        its last pin)."""
        e = self.entries[key]
        e.pins -= 1
        if e.resident and not e.pins:
            self.evictable[key] = None
            if self.group_of is not None:
                self.group_evictable[e.group][key] = None
            if self.release_after_use and e.used:
                self.evict(key)
