"""The hit-rate-only LRU fast path equals the generic Runner path, field for field."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fmoesim.engine.fast import NotApplicable, lru_hit_only
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.specs import ModelSpec
from policies.lru import LRU
from tests._engine_helpers import random_trace
from tests.tiny import TINY_HW

IGNORED = {"wall_s", "speedup_vs_real"}


def _model(L: int, E: int, k: int) -> ModelSpec:
    return ModelSpec(
        name=f"m{L}x{E}k{k}",
        num_layers=L,
        num_experts=E,
        top_k=k,
        hidden_size=64,
        expert_intermediate_size=128,
        num_attention_heads=4,
        num_kv_heads=4,
        head_dim=16,
        vocab_size=100,
    )


@settings(max_examples=40, deadline=None)
@given(
    L=st.integers(1, 3),
    E=st.integers(2, 6),
    k=st.integers(1, 2),
    extra=st.integers(0, 8),
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=4),
    batch=st.integers(1, 3),
    seed=st.integers(0, 10_000),
)
def test_fast_lru_equals_generic(
    L: int, E: int, k: int, extra: int, lengths: list[int], batch: int, seed: int
) -> None:
    k = min(k, E)
    model = _model(L, E, k)
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "t"
        tr = random_trace(path, model, lengths, seed)
    budget = (k + extra) * model.expert_size_bytes
    serving = ServingConfig(batch_size=batch)
    slow = simulate(tr, model, TINY_HW, LRU(), budget, serving=serving, timing=False, fast=False)
    fast = simulate(tr, model, TINY_HW, LRU(), budget, serving=serving, timing=False)
    if batch == 1:  # steps of k <= capacity experts: the fast path must be taken
        assert not fast.transfers, "the fast path was not taken"  # it keeps no transfer log
    a = {key: v for key, v in fast.summary.items() if key not in IGNORED}
    b = {key: v for key, v in slow.summary.items() if key not in IGNORED}
    assert a == pytest.approx(b, nan_ok=True)
    np.testing.assert_array_equal(fast.metrics.accesses, slow.metrics.accesses)


def test_fast_lru_hand_trace() -> None:
    """Capacity 2, one layer of 4 experts, top-1: 0 1 0 2 1 -> M M H M M (LRU evicts 1,
    then 0); evictions 2."""
    keys = np.array([0, 1, 0, 2, 1])
    ptr = np.arange(6)
    acc, ev = lru_hit_only(keys, ptr, 1, 4, 2)
    assert acc == [[1, 0, 4]]
    assert ev == 2


def test_fast_lru_refuses_steps_larger_than_the_cache() -> None:
    with pytest.raises(NotApplicable):
        lru_hit_only(np.array([0, 1, 2]), np.array([0, 3]), 1, 4, 2)
