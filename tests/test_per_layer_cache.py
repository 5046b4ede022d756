"""Per-layer caches (``cache.experts_per_layer``, MoEpic Table 1's setting) and LCP
against LRU and LFU on hand traces, checked against brute-force references."""

from __future__ import annotations

import pytest

from fmoesim.engine.simulate import simulate
from fmoesim.errors import ConfigError
from fmoesim.trace import read_trace
from policies.lcp import LCP
from policies.lfu import LFU
from policies.lru import LRU
from tests.tiny import TINY_HW, small_model, write_sequence_trace

ONE = small_model(1, 4, 1)  # one MoE layer of 4 experts, top-1


def reference_hits(seq: list[int], capacity: int, policy: str, omega=128.0, rho=0.25) -> int:
    """Hits of a demand cache of ``capacity`` experts over ``seq`` (one access per pass),
    written from the definitions: LRU evicts the least recently used; LFU the fewest
    accesses (persistent counts), ties to the least recent; LCP the lowest
    ``mu * rho ** (nu / omega)`` (``nu`` = passes since the last access), ties to the
    least recent."""
    cache: set[int] = set()
    count: dict[int, int] = {}
    last: dict[int, int] = {}
    hits = 0
    for t, e in enumerate(seq):
        count[e] = count.get(e, 0) + 1
        if e in cache:
            hits += 1
        else:
            if len(cache) == capacity:

                def rank(k: int, t: int = t) -> tuple[float, int]:
                    if policy == "lru":
                        return (last[k], 0)
                    if policy == "lfu":
                        return (count[k], last[k])
                    return (count[k] * rho ** ((t - last[k]) / omega), last[k])

                cache.remove(min(cache, key=rank))
            cache.add(e)
        last[e] = t
    return hits


def run(tmp_path, seq: list[int], policy, capacity: int, model=ONE) -> int:
    routes = [[e] * model.num_layers for e in seq]
    tr = read_trace(write_sequence_trace(tmp_path / "t", routes, model=model))
    budget = capacity * model.num_layers * model.expert_size_bytes
    r = simulate(tr, model, TINY_HW, policy, budget, timing=False, experts_per_layer=capacity)
    assert r.summary["experts_per_layer"] == capacity
    return int(r.metrics.acc[0][0])  # hits of layer 0


# hot expert 0 every third access among cold 1, 2, 3: LRU lets the scan push 0 out
LONG_TAIL = [0, 1, 2] * 2 + [0, 3, 1, 0, 2, 3] * 6
# expert 1 is hot for 30 passes, then 2 and 3 alternate: LFU clings to the old favourite
RECENCY = [1] * 30 + [2, 3] * 60


@pytest.mark.parametrize(
    ("seq", "worse", "Worse"), [(LONG_TAIL, "lru", LRU), (RECENCY, "lfu", LFU)]
)
def test_lcp_beats_lru_on_a_long_tail_and_lfu_on_a_shift(tmp_path, seq, worse, Worse):
    lcp = run(tmp_path, seq, LCP(), 2)
    other = run(tmp_path, seq, Worse(), 2)
    assert lcp == reference_hits(seq, 2, "lcp")
    assert other == reference_hits(seq, 2, worse)
    assert lcp > other


def test_each_layer_evicts_only_within_itself(tmp_path):
    """On a multi-layer synthetic trace with two experts per layer, every victim is
    chosen among the incoming expert's own layer, no layer ever holds more than two, and
    the per-layer bytes add up."""
    from fmoesim.workload.synthetic import SyntheticConfig, generate
    from tests.test_policy_contract import MODEL

    E, size = MODEL.num_experts, MODEL.expert_size_bytes
    seen: list[tuple[int, int]] = []

    class Checked(LRU):
        def victim(self, candidates, incoming):  # type: ignore[no-untyped-def]
            layers = {k // E for k in candidates}
            assert layers == {incoming // E}, (layers, incoming)
            seen.append((incoming, len(candidates)))
            return super().victim(candidates, incoming)

    path = tmp_path / "t"
    generate(MODEL, SyntheticConfig(num_requests=3, embedding_dim=0, seed=2), path)
    tr = read_trace(path)
    budget = 2 * MODEL.num_layers * size
    r = simulate(tr, MODEL, TINY_HW, Checked(), budget, timing=False, experts_per_layer=2)
    assert seen and all(n <= 2 for _, n in seen)
    cache = r.caches[0]
    assert all(v <= 2 * size for v in cache.group_used.values())
    assert sum(cache.group_used.values()) == cache.used_bytes
    by_layer = {}
    for k, e in cache.entries.items():
        by_layer[k // E] = by_layer.get(k // E, 0) + e.size_bytes
    assert by_layer == {g: v for g, v in cache.group_used.items() if v}


def test_experts_per_layer_is_checked(tmp_path):
    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0], [1]], model=ONE))
    size = ONE.expert_size_bytes
    with pytest.raises(ConfigError, match="experts_per_layer"):
        simulate(tr, ONE, TINY_HW, LRU(), 5 * size, experts_per_layer=5)
    with pytest.raises(ConfigError, match="must be experts_per_layer"):
        simulate(tr, ONE, TINY_HW, LRU(), 3 * size, experts_per_layer=2)


def test_cli_refuses_a_bad_experts_per_layer_in_one_line():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", "cache.experts_per_layer=9", "progress=false"],
        capture_output=True,
        text=True,
        cwd=root,
    )
    assert p.returncode == 2
    assert "cache.experts_per_layer" in p.stderr and "[1, 8]" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
