"""Experts whose size differs by layer (quantized models): the cache and the link account
each layer's own size, and a real engine's cache log is reproduced access by access."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.simulate import model_for_trace, simulate
from fmoesim.errors import ConfigError
from fmoesim.specs.model import DTYPE_BYTES
from fmoesim.trace import read_trace
from policies.base import Outcome
from policies.lru import LRU
from tests.tiny import TINY_HW, small_model, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]
EDGE = ROOT.parent / "shared" / "data" / "routing" / "bigmoeonedge-qwen3-30b-a3b"
M = dataclasses.replace(small_model(2, 4, 1), expert_size_bytes_by_layer=[100, 300])


def test_model_sizes_by_layer() -> None:
    """Red if the per-layer sizes are not what the budget checks and totals use."""
    assert M.layer_expert_bytes == [100, 300] and M.expert_size_bytes == 200
    assert M.total_expert_bytes == 4 * 400 and M.layer_topk_bytes == 300
    assert not M.uniform_experts and small_model(2, 4, 1).uniform_experts
    with pytest.raises(ConfigError, match="2 positive integers"):
        dataclasses.replace(M, expert_size_bytes_by_layer=[100]).validate()
    # the GGUF block formats: 144 bytes per 256 weights (Q4_K), 210 (Q6_K), 34 per 32 (Q8_0)
    assert DTYPE_BYTES["q4_k"] * 8 == 4.5 and DTYPE_BYTES["q6_k"] * 8 == 6.5625
    assert DTYPE_BYTES["q8_0"] * 8 == 8.5


@pytest.mark.parametrize("timing", [False, True])
def test_lru_counts_each_layers_bytes(tmp_path: Path, timing: bool) -> None:
    """Red if a layer's expert takes another layer's size in the cache (the budget of 400
    bytes holds layer 0's e0 and layer 1's e0, 100 + 300, and nothing more) or on the
    link, or if the LRU fast path (which counts experts) runs for such a model.

    Tokens route (layer 0, layer 1): (0, 0) (1, 0) (0, 0).  Token 2's layer-0 expert 1
    (100 bytes) evicts the least recent, L0e0 (100): L1e0 stays and hits; token 3's L0e0
    evicts L0e1 and L1e0 hits again: MISS MISS / MISS HIT / MISS HIT."""
    tr = read_trace(write_sequence_trace(tmp_path / "t", [[0, 0], [1, 0], [0, 0]], M))
    res = simulate(tr, M, TINY_HW, LRU(), 400, timing=timing, access_log=True)
    acc = res.accesses
    assert acc is not None
    assert np.asarray(acc["outcome"]).tolist() == [
        int(o) for o in (Outcome.MISS, Outcome.MISS, Outcome.MISS, Outcome.HIT,
                         Outcome.MISS, Outcome.HIT)
    ]  # fmt: skip
    assert res.summary["pcie_bytes"] == 100 + 300 + 100 + 100
    if timing:
        sizes = res.transfer_table()["size_bytes"].tolist()
        assert sizes == [100, 300, 100, 100]
    else:
        # without the access log the LRU fast path would run, were it allowed: it counts
        # the budget in experts of the mean size (500 // 200 = 2), where 500 bytes hold
        # L1e0 and both layer-0 experts: layer 0 alternating e0, e1 then hits from token 3
        tr2 = read_trace(write_sequence_trace(tmp_path / "t2", [[0, 0], [1, 0]] * 2, M))
        fast = simulate(tr2, M, TINY_HW, LRU(), 500, timing=False)
        assert (fast.summary["hits"], fast.summary["accesses"]) == (5, 8)


def test_trace_sizes_reach_the_model(tmp_path: Path) -> None:
    """Red if a trace that records per-layer sizes does not pass them to a model preset
    without them, or overrides a model that gives its own."""
    path = write_sequence_trace(tmp_path / "t", [[0, 0]], small_model(2, 4, 1))
    man = path / "trace.json"
    raw = man.read_text().replace('"kind": "synthetic"', '"expert_bytes_by_layer": [7, 9],\n'
                                  '    "kind": "synthetic"')  # fmt: skip
    man.write_text(raw)
    tr = read_trace(path)
    assert model_for_trace(small_model(2, 4, 1), tr).layer_expert_bytes == [7, 9]
    assert model_for_trace(M, tr).layer_expert_bytes == [100, 300]


@pytest.mark.skipif(not EDGE.is_dir(), reason="../shared/data (BigMoeOnEdge route log) is absent")
def test_real_engine_cache_log_is_reproduced() -> None:
    """A real on-device engine's cache (LRU over 4000 MiB, Qwen3-30B-A3B Q4_K_M with two
    expert sizes, 6 experts per token): in decode the simulator's hit or miss is the
    engine's on at least 99% of the 36,864 accesses, and its hit rate within 0.5 point
    of the engine's 80.29%.  Red if per-layer sizes are lost, the prompt is not one
    batched prefill (token-by-token prefill leaves another cache: 98.8%), or the importer
    shifts a step."""
    from fmoesim.validation.engine_log import compare

    res = {r.phase: r for r in compare(EDGE / "qwen.route.csv")}
    dec = res["decode"]
    assert dec.logged_accesses == dec.simulated_accesses == 36864
    assert dec.agreement is not None and dec.agreement >= 0.99
    assert abs(dec.simulated_hit_rate - dec.logged_hit_rate) <= 0.005
    assert abs(dec.logged_hit_rate - 0.8029) < 5e-5
