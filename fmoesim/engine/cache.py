"""Expert residency and byte accounting, shared by the simulator and the GPU backend.

The cache owns the truth about what is on the GPU: resident entries, in-flight
transfers (their bytes are reserved when the transfer is issued), pins (entries in use
by the current layer) and the peak of bytes used.  The policy only chooses victims via
:meth:`policies.base.Policy.victim`; eviction itself happens here.
"""

from __future__ import annotations

from dataclasses import dataclass

from policies.base import Outcome, Policy


@dataclass(slots=True)
class Entry:
    """One cached (or arriving) expert."""

    size_bytes: int
    resident: bool
    reason: str
    pins: int = 0
    used: bool = False


class ExpertCache:
    """Byte-budgeted expert cache.

    Invariants (checked by the contract tests): ``used_bytes <= budget_bytes``;
    pinned or in-flight entries are never evicted.
    """

    def __init__(self, budget_bytes: int, policy: Policy) -> None:
        self.budget_bytes = int(budget_bytes)
        self.policy = policy
        self.entries: dict[int, Entry] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self.evictions = 0
        self.wasted_bytes = 0  # prefetched bytes evicted before any use

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

    def admit(self, key: int, size_bytes: int, reason: str) -> bool:
        """Reserve ``size_bytes`` for ``key`` about to be transferred, evicting as needed.

        Returns False (and changes nothing but evictions already made) when the
        resident, unpinned entries cannot free enough room.
        """
        if key in self.entries:
            raise ValueError(f"expert {key} is already cached or in flight")
        if size_bytes > self.budget_bytes:
            return False
        while self.used_bytes + size_bytes > self.budget_bytes:
            candidates = {k for k, e in self.entries.items() if e.resident and e.pins == 0}
            if not candidates:
                return False
            victim = self.policy.victim(candidates)
            if victim not in candidates:
                raise RuntimeError(
                    f"policy {self.policy.name!r} chose victim {victim}, "
                    "which is pinned, in flight or absent"
                )
            self.evict(victim)
        self.entries[key] = Entry(size_bytes=size_bytes, resident=False, reason=reason)
        self.used_bytes += size_bytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)
        self.policy.on_insert(key)
        return True

    def complete(self, key: int) -> None:
        """The transfer of ``key`` finished: it is resident now."""
        self.entries[key].resident = True

    def evict(self, key: int) -> None:
        """Remove a resident, unpinned entry and free its bytes."""
        e = self.entries[key]
        if not e.resident or e.pins:
            raise RuntimeError(f"cannot evict expert {key}: in flight or pinned")
        del self.entries[key]
        self.used_bytes -= e.size_bytes
        self.evictions += 1
        if not e.used and e.reason == "prefetch":
            self.wasted_bytes += e.size_bytes
        self.policy.on_evict(key)

    def pin(self, key: int) -> None:
        """Mark ``key`` in use (not evictable) and used."""
        e = self.entries[key]
        e.pins += 1
        e.used = True

    def unpin(self, key: int) -> None:
        """Release one pin of ``key``."""
        self.entries[key].pins -= 1
