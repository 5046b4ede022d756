"""The policy protocol: events in, decisions out.

A policy never reads a clock, never sleeps and never touches SimPy or torch, so the
same object drives the simulator (:mod:`fmoesim.engine`) and the GPU replay
(:mod:`replay`).  Randomness comes only from the ``np.random.Generator`` handed to
:meth:`Policy.reset`.

Experts are identified by an integer key ``layer * num_experts + expert``
(:func:`expert_key`); the cache (:class:`fmoesim.engine.cache.ExpertCache`) does all the
accounting (bytes, residency, pins, in-flight transfers) and calls the policy's hooks;
the policy only chooses.  :meth:`Policy.victim` must be free of side effects: it peeks,
the cache evicts.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from fmoesim.specs.model import ModelSpec


class Outcome(IntEnum):
    """What an expert access found: resident, still in flight, or absent."""

    HIT = 0
    LATE = 1
    MISS = 2


def expert_key(layer: int, expert: int, num_experts: int) -> int:
    """Integer key of ``(layer, expert)``."""
    return layer * num_experts + expert


def split_key(key: int, num_experts: int) -> tuple[int, int]:
    """``(layer, expert)`` of an integer key."""
    return divmod(key, num_experts)


@dataclass(frozen=True)
class PolicyContext:
    """What a policy learns at :meth:`Policy.reset`."""

    model: ModelSpec
    budget_bytes: int
    expert_size_bytes: int
    rng: np.random.Generator

    @property
    def capacity_experts(self) -> int:
        """How many whole experts fit in the budget."""
        return self.budget_bytes // self.expert_size_bytes


@dataclass(frozen=True)
class RequestInfo:
    """A request entering service."""

    request_id: int
    prompt_tokens: int
    output_tokens: int
    embedding: np.ndarray | None = None  # (D,) the prefill iteration's semantic embedding


@dataclass(frozen=True)
class BatchInfo:
    """The requests of one iteration (one forward pass)."""

    iteration: int  # index of this iteration within the batch's lifetime (0 = prefill)
    request_ids: tuple[int, ...]
    num_tokens: int
    embeddings: np.ndarray | None = None  # (B, D) per-request iteration embeddings


@dataclass(frozen=True)
class GateView:
    """The gate output of one layer for the current batch, as revealed by the trace."""

    layer: int
    counts: np.ndarray  # (E,) tokens routed to each expert
    num_tokens: int
    probs: np.ndarray | None = None  # (E,) token-weighted mean gate probability
    spec_next: np.ndarray | None = None  # (E,) speculative probs of layer+1 (None if unknown)


@dataclass(frozen=True)
class Prefetch:
    """Ask the engine to load expert ``key``; lower ``priority`` values go first."""

    key: int
    priority: float = 1.0


@dataclass
class Actions:
    """A policy's answer to an event: prefetches to issue and keys whose prefetch to cancel."""

    prefetch: Sequence[Prefetch] = field(default_factory=tuple)
    cancel: Sequence[int] = field(default_factory=tuple)


NO_ACTIONS = Actions()


class Policy(ABC):
    """Base class of every offloading policy.  Subclasses set ``name`` and implement
    :meth:`victim`; every other hook defaults to doing nothing."""

    name: ClassVar[str] = "policy"
    #: Whether :class:`GateView` must carry ``probs`` / ``spec_next`` (they cost time to build).
    uses_probs: ClassVar[bool] = False
    uses_spec: ClassVar[bool] = False

    def reset(self, ctx: PolicyContext) -> None:
        """Start a fresh run."""
        self.ctx = ctx

    def on_request_start(self, request: RequestInfo) -> None:
        """A request enters service."""

    def on_iteration_start(self, batch: BatchInfo) -> None:
        """An iteration (forward pass) of ``batch`` begins."""

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        """The gate of ``layer`` is known; return prefetches and cancellations."""
        return NO_ACTIONS

    def on_access(self, key: int, outcome: Outcome) -> None:
        """Expert ``key`` is needed now and was found as ``outcome``."""

    def on_insert(self, key: int) -> None:
        """The cache admitted ``key`` (its transfer was issued)."""

    def on_evict(self, key: int) -> None:
        """The cache evicted ``key``."""

    @abstractmethod
    def victim(self, candidates: Collection[int]) -> int:
        """Choose which of ``candidates`` (resident, unpinned) to evict; no side effects."""

    def on_iteration_end(self, iteration: int) -> None:
        """An iteration finished."""
