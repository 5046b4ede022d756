"""A set of keys kept sorted by a rank, for policies that evict the lowest-ranked entry.

perf: LFU and LCP rank every admitted expert by a tuple that changes only when that
expert is accessed, so a sorted list answers ``victim`` by walking from the front to
the first candidate (usually the first entry), and each access costs one bisect-delete
plus one bisect-insert (O(log n) comparisons and an O(n) memmove done in C).  A rank
that fits one int (Belady's) is stored as that int: an int comparison in the bisect
costs a fraction of a tuple comparison.
"""

from __future__ import annotations

from bisect import bisect_left, insort
from collections.abc import Collection
from typing import Any

from mypy_extensions import mypyc_attr

from policies.base import Policy

#: A tuple whose last element is the key, or an int whose remainder by the
#: ``RankedKeys``' modulus is the key.
Rank = tuple[Any, ...] | int


class RankedKeys:
    """Keys sorted by a rank that ends in the key itself (so ranks are unique): a tuple
    whose last element is the key, or, with ``modulus`` (every key below it), an int
    ``r`` with ``r % modulus == key``."""

    __slots__ = ("_items", "modulus", "ranks")

    def __init__(self, modulus: int = 0) -> None:
        if modulus < 0:
            raise ValueError(f"modulus must be >= 0 (0: tuple ranks), got {modulus}")
        self.modulus = modulus
        self._items: list[Any] = []  # ascending
        #: key -> its current rank (read-only for callers; ``key in ranks`` is the
        #: C-level membership test the policies' per-access hooks use)
        self.ranks: dict[int, Rank] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.ranks

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: int, rank: Rank) -> None:
        """Add ``key`` with ``rank`` (ending in ``key``, see the class), or move it there
        (O(log n))."""
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
        m = self.modulus
        for rank in self._items:
            key: int = rank % m if m else rank[-1]
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
