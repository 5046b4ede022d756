"""A set of keys kept sorted by a rank, for policies that evict the lowest-ranked entry.

perf: LFU and LCP rank every admitted expert by a tuple that changes only when that
expert is accessed, so a sorted list answers ``victim`` by walking from the front to
the first candidate (usually the first entry), and each access costs one bisect-delete
plus one bisect-insert (O(log n) comparisons and an O(n) memmove done in C).
:class:`IntRankedKeys` does the same for a rank that fits one int (Belady's).
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection
from typing import Any, cast

from mypy_extensions import mypyc_attr

from policies.base import Policy

#: A tuple whose last element is the key (:class:`RankedKeys`), or an int whose
#: remainder by the modulus is the key (:class:`IntRankedKeys`).
Rank = tuple[Any, ...] | int


class RankedKeys:
    """Keys sorted by a rank tuple whose last element is the key itself (so ranks are unique)."""

    __slots__ = ("_items", "ranks")

    def __init__(self) -> None:
        self._items: list[Any] = []  # ascending (tuple ranks)
        #: key -> its current rank (read-only for callers; ``key in ranks`` is the
        #: C-level membership test the policies' per-access hooks use)
        self.ranks: dict[int, Rank] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.ranks

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: int, rank: Rank) -> None:
        """Add ``key`` with ``rank`` (``rank[-1] == key``), or move it there (O(log n))."""
        old = self.ranks.get(key)
        if old is not None:
            del self._items[bisect_left(self._items, old)]
        insort(self._items, rank)
        self.ranks[key] = rank

    def discard(self, key: int) -> None:
        """Remove ``key`` if present (O(log n))."""
        old = self.ranks.pop(key, None)
        if old is not None:
            del self._items[bisect_left(self._items, old)]

    def first_in(self, candidates: Collection[int]) -> int | None:
        """The lowest-ranked key that is in ``candidates``, or None."""
        for rank in self._items:
            if rank[-1] in candidates:
                return int(rank[-1])
        return None


class IntRankedKeys(RankedKeys):
    """Keys sorted by an int rank ``r`` with ``r % modulus == key`` (every key below
    ``modulus``, so ranks are unique): the order a tuple ``(..., key)`` would give when
    what precedes the key is one int ``v``, as ``r = v * modulus + key``.

    perf: Belady re-ranks an expert at every access; with tuple ranks the bisects'
    tuple comparisons were most of its run, and the calls into ``bisect`` (generic
    calls in the compiled build) most of the rest, so the ranks are ints in a typed
    list and the binary search is written out (native int comparisons when compiled;
    counted with callgrind).
    """

    def __init__(self, modulus: int) -> None:
        super().__init__()
        if modulus < 1:
            raise ValueError(f"modulus must be >= 1, got {modulus}")
        self.modulus = modulus
        self._ints: list[int] = []  # ascending

    def __len__(self) -> int:
        return len(self._ints)

    def _index(self, rank: int) -> int:
        """Where ``rank`` is, or would be inserted (the leftmost place, as bisect_left)."""
        a = self._ints
        lo, hi = 0, len(a)
        while lo < hi:
            mid = (lo + hi) >> 1
            if a[mid] < rank:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def put(self, key: int, rank: Rank) -> None:
        """Add ``key`` with the int ``rank`` (``rank % modulus == key``), or move it there."""
        r = cast(int, rank)
        old = self.ranks.get(key)
        if old is not None:
            self._ints.pop(self._index(cast(int, old)))
        self._ints.insert(self._index(r), r)
        self.ranks[key] = r

    def discard(self, key: int) -> None:
        """Remove ``key`` if present (O(log n))."""
        old = self.ranks.pop(key, None)
        if old is not None:
            self._ints.pop(self._index(cast(int, old)))

    def first_in(self, candidates: Collection[int]) -> int | None:
        """The lowest-ranked key that is in ``candidates``, or None."""
        m = self.modulus
        for r in self._ints:
            key = r % m
            if key in candidates:
                return key
        return None


@mypyc_attr(allow_interpreted_subclasses=True)
class RankedPolicy(Policy):
    """A policy that evicts its lowest-ranked admitted expert (LFU, LCP, Belady).

    Subclasses create ``self._ranked = RankedKeys()`` in ``reset``, define :meth:`_rank`
    and call :meth:`_rerank` when an expert's rank changes.
    """

    _ranked: RankedKeys

    def _rank(self, key: int) -> Rank:
        """The rank tuple of ``key`` now; its last element is ``key``."""
        raise NotImplementedError

    def _rerank(self, key: int) -> None:
        """Re-sort ``key`` if it is admitted."""
        if key in self._ranked.ranks:  # perf: a dict lookup, not a __contains__ call
            self._ranked.put(key, self._rank(key))

    def on_insert(self, key: int) -> None:
        """Rank a newly admitted expert."""
        self._ranked.put(key, self._rank(key))

    def on_evict(self, key: int) -> None:
        """Stop ranking ``key``."""
        self._ranked.discard(key)

    def victim(self, candidates: Collection[int], incoming: int) -> int:
        """The lowest-ranked candidate (ranking candidates never seen admitted on the fly)."""
        key = self._ranked.first_in(candidates)
        if key is not None:
            return key
        if not candidates:
            raise ValueError(f"{self.name}.victim called with no candidates")
        return min(candidates, key=self._rank)
