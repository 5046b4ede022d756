"""Commands the Runner yields to a backend, and what each one answers.

The Runner is a generator: it yields one command at a time and receives the answer.
The simulator backend turns each command into SimPy time; the GPU backend (replay/)
issues it on CUDA streams.  No serving logic lives in a backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Op(str, Enum):
    """Compute operators the Runner asks a backend to run."""

    ATTENTION = "attention"
    ROUTER = "router"
    EXPERT = "expert"
    SHARED = "shared"
    DENSE_MLP = "dense_mlp"
    LM_HEAD = "lm_head"


@dataclass(frozen=True, slots=True)
class Compute:
    """Run ``op`` on the compute stream; answers None when it is done (in order)."""

    op: Op
    layer: int = -1
    tokens: int = 0
    kv_tokens: int = 0
    pairs: int = 0
    key: int = -1  # the expert, for Op.EXPERT


@dataclass(frozen=True, slots=True)
class Transfer:
    """Start copying expert ``key`` (``size_bytes``) host-to-device; answers None at once.

    Lower ``priority`` goes first on the link; on-demand loads use :data:`ON_DEMAND`.
    """

    key: int
    size_bytes: int
    priority: float
    reason: str  # "on_demand" | "prefetch" | "configure"


@dataclass(frozen=True, slots=True)
class WaitAny:
    """Block until one of ``keys`` is resident; answers that key."""

    keys: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Now:
    """Answer the backend's current time in seconds (after all queued compute)."""


#: Priority of an on-demand load: ahead of every prefetch.
ON_DEMAND = float("-inf")
