"""The compute model's times against numbers worked out by hand from the model shape.

Nothing here is taken from :class:`ComputeModel`: every FLOP count, byte count and
kernel launch is written out from the shape of :data:`HAND` (or a preset) and the
hardware's round numbers, then timed with the documented rule (docs/concepts.md "The
timing model", ``fmoesim/engine/compute.py``): an operator costs its kernel launches
plus its weights read from GPU memory plus its FLOPs, a *sum* (not a max)::

    t = launches * kernel_overhead_s
        + bytes / (hbm_gbps * 1e9 * memory_efficiency)
        + flops / (peak_tflops * 1e12 * compute_efficiency)

The launch counts (3 per SwiGLU FFN, 6 per attention: Q, K, V, O projections and the
score and value products, 1 per router and LM head) are the code's modelling choice; no
docstring states them, so they are pinned as read from ``compute.py``.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from fmoesim.config.build import load_preset
from fmoesim.engine import simulate
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.serving import ServingConfig
from fmoesim.specs import HardwareSpec, ModelSpec
from policies.lru import LRU
from tests._engine_helpers import Req, write_trace

REL = 1e-9

#: 2 MoE layers of 4 experts (top-2) after 1 dense layer; 1 shared expert; GQA (4 query
#: heads, 2 KV heads of 16) so that query and key/value widths differ.
HAND = ModelSpec(
    name="hand",
    num_layers=2,
    num_experts=4,
    top_k=2,
    num_shared_experts=1,
    shared_expert_intermediate_size=256,
    dense_layers=1,
    dense_intermediate_size=512,
    hidden_size=64,
    expert_intermediate_size=128,
    num_attention_heads=4,
    num_kv_heads=2,
    head_dim=16,
    vocab_size=1000,
    dtype="bfloat16",
)
#: Round numbers, efficiencies below 1 so that dropping one shows.
HAND_HW = HardwareSpec(
    name="hand-hw",
    peak_tflops=100.0,
    compute_efficiency=0.5,  # 5e13 FLOP/s achieved
    hbm_gbps=1000.0,
    memory_efficiency=0.8,  # 8e11 bytes/s achieved
    kernel_overhead_s=2e-6,
    pcie_gbps=4.9152,  # one 49,152-byte expert: 1e-5 s of bytes
    transfer_overhead_s=1e-5,
)
FLOPS = 5e13  # 100e12 x 0.5
MEM = 8e11  # 1000e9 x 0.8
K0 = 2e-6
BPE = 2  # bfloat16

# -- the operators of HAND, by hand ------------------------------------------------------
# expert FFN (SwiGLU): gate 64x128, up 64x128, down 128x64
EXPERT_PARAMS = 64 * 128 + 64 * 128 + 128 * 64  # 24,576
EXPERT_BYTES = EXPERT_PARAMS * BPE  # 49,152
EXPERT_FLOPS = 2 * EXPERT_PARAMS  # per token: 2 x m x n x k with m = 1
EXPERT_LAUNCHES = 3
# the shared expert: the same three matrices at intermediate 256
SHARED_PARAMS = 3 * 64 * 256  # 49,152
SHARED_BYTES = SHARED_PARAMS * BPE  # 98,304
SHARED_FLOPS = 2 * SHARED_PARAMS
# the dense layer's MLP: intermediate 512
DENSE_PARAMS = 3 * 64 * 512  # 98,304
DENSE_BYTES = DENSE_PARAMS * BPE
DENSE_FLOPS = 2 * DENSE_PARAMS
# attention: q width 4 x 16 = 64, k/v width 2 x 16 = 32
Q_DIM, KV_DIM = 4 * 16, 2 * 16
ATTN_PARAMS = 64 * Q_DIM + 64 * KV_DIM + 64 * KV_DIM + Q_DIM * 64  # Wq, Wk, Wv, Wo: 12,288
ATTN_BYTES = ATTN_PARAMS * BPE  # 24,576
ATTN_FLOPS = 2 * ATTN_PARAMS  # per new token (the projections)
ATTN_LAUNCHES = 6
KV_BYTES = (KV_DIM + KV_DIM) * BPE  # per cached token read: its K and V rows, 128 bytes
# per (query, key) pair: q.k over 4 heads x 16 (2 x 64 FLOPs) and p x v (2 x 64 FLOPs)
PAIR_FLOPS = 2 * 4 * 16 + 2 * 4 * 16  # 256
# router: 64 x 4
ROUTER_PARAMS = 64 * 4
ROUTER_BYTES = ROUTER_PARAMS * BPE
ROUTER_FLOPS = 2 * ROUTER_PARAMS
# LM head: 64 x 1000, for the last token of each sequence only
LM_PARAMS = 64 * 1000
LM_BYTES = LM_PARAMS * BPE
LM_FLOPS = 2 * LM_PARAMS


def op_s(launches: int, weight_bytes: float, flops: float) -> float:
    """The documented rule: launches + weights read + FLOPs (a sum)."""
    return launches * K0 + weight_bytes / MEM + flops / FLOPS


def expert_s(tokens: int) -> float:
    return op_s(EXPERT_LAUNCHES, EXPERT_BYTES, EXPERT_FLOPS * tokens)


def shared_s(tokens: int) -> float:
    return op_s(3, SHARED_BYTES, SHARED_FLOPS * tokens)


def dense_s(tokens: int) -> float:
    return op_s(3, DENSE_BYTES, DENSE_FLOPS * tokens)


def attention_s(tokens: int, kv_tokens: int, pairs: int) -> float:
    return op_s(
        ATTN_LAUNCHES, ATTN_BYTES + KV_BYTES * kv_tokens, ATTN_FLOPS * tokens + PAIR_FLOPS * pairs
    )


def router_s(tokens: int) -> float:
    return op_s(1, ROUTER_BYTES, ROUTER_FLOPS * tokens)


def lm_head_s(sequences: int) -> float:
    return op_s(1, LM_BYTES, LM_FLOPS * sequences)


C = ComputeModel.from_specs(HAND, HAND_HW)


def test_hand_shape_numbers():
    """The hand counts themselves, as literals (and the expert size the cache uses).
    Red when: ``ModelSpec.expert_params`` counts two matrices (``2 * h * inter``)."""
    assert (EXPERT_PARAMS, EXPERT_BYTES, EXPERT_FLOPS) == (24_576, 49_152, 49_152)
    assert (SHARED_BYTES, DENSE_BYTES) == (98_304, 196_608)
    assert (ATTN_PARAMS, ATTN_BYTES, KV_BYTES, PAIR_FLOPS) == (12_288, 24_576, 128, 256)
    assert (ROUTER_BYTES, LM_BYTES) == (512, 128_000)
    assert HAND.expert_size_bytes == EXPERT_BYTES


@pytest.mark.parametrize("tokens", [1, 5, 37, 4096])
def test_expert_ffn_by_hand(tokens):
    """Expert FFN: ``3 k0 + 3 h I bpe / mem + tokens * 2 * 3 h I / flops``, coefficients
    and the composed time.  Red when: the FFN counts 2 matrices instead of 3; either
    efficiency is dropped; the launch count changes."""
    assert C.expert_a_s == pytest.approx(3 * K0 + 49_152 / MEM, rel=REL)
    assert C.expert_b_s == pytest.approx(49_152 / FLOPS, rel=REL)
    assert C.expert_s(tokens) == pytest.approx(expert_s(tokens), rel=REL)


def segment_s(tokens: int, fraction: float) -> float:
    """A segment computed on its own: every launch, its share of the bytes and FLOPs."""
    return op_s(EXPERT_LAUNCHES, fraction * EXPERT_BYTES, fraction * EXPERT_FLOPS * tokens)


@pytest.mark.parametrize("tokens", [1, 37])
def test_a_segment_pays_every_launch_and_its_share_of_the_rest_by_hand(tokens):
    """A 40% segment: 3 launches + 40% of the weights read + 40% of the FLOPs; at 100% the
    whole expert.  A measured profile's ``expert_a_s`` without ``expert_launch_s``
    leaves its fixed cost less the roofline's read of the weights as the launch share
    (never below 0 nor above ``a``); a measured ``expert_launch_s`` is taken.  Red if a
    segment pays only its fraction of the launches (0.4 x the whole expert), the read is
    not taken off a measured ``a``, or the measured share is ignored."""
    assert C.expert_launch_s == pytest.approx(EXPERT_LAUNCHES * K0, rel=REL)
    assert C.segment_s(tokens, 0.4) == pytest.approx(segment_s(tokens, 0.4), rel=REL)
    assert C.segment_s(tokens, 1.0) == pytest.approx(expert_s(tokens), rel=REL)
    assert C.segment_s(tokens, 0.4) > 0.4 * expert_s(tokens)

    def measured(**coeffs):
        return ComputeModel.from_specs(HAND, replace(HAND_HW, measured={"hand": coeffs}))

    assert measured(expert_a_s=1e-3).expert_launch_s == pytest.approx(1e-3 - EXPERT_BYTES / MEM)
    assert measured(expert_a_s=1e-9).expert_launch_s == 0.0  # under the read: noise
    assert measured(expert_a_s=1e-3, expert_launch_s=2e-4).expert_launch_s == 2e-4
    assert measured(expert_a_s=1e-3, expert_launch_s=5e-3).expert_launch_s == 1e-3


@pytest.mark.parametrize("tokens", [1, 7, 4096])
def test_shared_experts_by_hand(tokens):
    """All shared experts of a layer as one SwiGLU FFN of the total intermediate size
    (``shared_expert_intermediate_size``, e.g. DeepSeek-V2-Lite's 2 x 1408 = 2816, as HF's
    DeepseekV2MLP builds it): splitting the same total over 2 experts costs the same; a
    model without shared experts costs 0.  Red when: the shared FFN counts 2 matrices,
    or scales with ``num_shared_experts`` on top of the total."""
    assert C.shared_a_s == pytest.approx(3 * K0 + SHARED_BYTES / MEM, rel=REL)
    assert C.shared_b_s == pytest.approx(SHARED_FLOPS / FLOPS, rel=REL)
    assert C.shared_s(tokens) == pytest.approx(shared_s(tokens), rel=REL)
    two = ComputeModel.from_specs(replace(HAND, num_shared_experts=2), HAND_HW)
    assert two.shared_s(tokens) == pytest.approx(shared_s(tokens), rel=REL)
    none = ComputeModel.from_specs(
        replace(HAND, num_shared_experts=0, shared_expert_intermediate_size=0), HAND_HW
    )
    assert none.shared_s(tokens) == 0.0


def test_attention_coefficients_by_hand():
    """Attention's four coefficients: weights (Wq, Wk, Wv, Wo with GQA widths) + 6
    launches; projections per new token; K and V rows per cached token; 4 x q_dim FLOPs
    per (query, key) pair.  Red when: the pair cost is halved; only K (or only V) is read
    per cached token; the query and KV widths are swapped in the projections."""
    assert C.attn_a_s == pytest.approx(6 * K0 + 24_576 / MEM, rel=REL)
    assert C.attn_b_s == pytest.approx(24_576 / FLOPS, rel=REL)
    assert C.attn_kv_s == pytest.approx(128 / MEM, rel=REL)
    assert C.attn_pair_s == pytest.approx(256 / FLOPS, rel=REL)


@pytest.mark.parametrize("p", [1, 7, 512])
def test_attention_prefill_by_hand(p):
    """Prefill of a prompt of ``p``: ``p`` new tokens, no KV read, ``p (p + 1) / 2``
    causal pairs (p = 512: 131,328 pairs).  Red when: the pair cost is halved; the
    projections are costed per pair or not per token."""
    pairs = p * (p + 1) // 2
    assert C.attention_s(p, 0, pairs) == pytest.approx(attention_s(p, 0, pairs), rel=REL)
    want = 6 * K0 + 24_576 / MEM + (24_576 * p + 256 * pairs) / FLOPS
    assert C.attention_s(p, 0, pairs) == pytest.approx(want, rel=REL)


@pytest.mark.parametrize(("p", "j"), [(1, 1), (7, 3), (4000, 96)])
def test_attention_decode_by_hand(p, j):
    """Decode iteration ``j`` after a prompt of ``p``: 1 new token reading ``p + j - 1``
    cached K/V rows and attending over ``p + j`` keys.  Red when: the KV read costs only
    K (``kv_dim`` per token) or the pair cost is halved."""
    kv, pairs = p + j - 1, p + j
    want = 6 * K0 + (24_576 + 128 * kv) / MEM + (24_576 + 256 * pairs) / FLOPS
    assert C.attention_s(1, kv, pairs) == pytest.approx(want, rel=REL)


@pytest.mark.parametrize("tokens", [1, 5, 4096])
def test_router_dense_and_lm_head_by_hand(tokens):
    """Router (h x E, 1 launch), dense MLP (SwiGLU at intermediate 512, 3 launches) and LM
    head (h x vocab, 1 launch, per sequence).  Red when: the router is sized by top_k
    instead of num_experts; the dense MLP counts 2 matrices; the LM head is free of its
    weight read."""
    assert C.router_s(tokens) == pytest.approx(K0 + 512 / MEM + 512 * tokens / FLOPS, rel=REL)
    assert C.router_s(tokens) == pytest.approx(router_s(tokens), rel=REL)
    assert C.dense_mlp_s(tokens) == pytest.approx(dense_s(tokens), rel=REL)
    assert C.lm_head_s(tokens) == pytest.approx(lm_head_s(tokens), rel=REL)
    assert C.lm_head_s(tokens) == pytest.approx(
        K0 + 128_000 / MEM + 128_000 * tokens / FLOPS, rel=REL
    )


def test_mixtral_expert_on_h100_preset_by_hand():
    """The presets as shipped: a Mixtral-8x7B expert (config.json: 3 x 4096 x 14336 bf16
    = 352,321,536 bytes) on the H100 preset (989 TFLOP/s dense bf16 x 0.6, 3350 GB/s x
    0.8, 4 us a launch): a = 3 x 4e-6 + 352,321,536 / 2.68e12 (~0.1315 ms, weight-bound
    at decode); b = 2 x 176,160,768 / 593.4e12.  Attention: q 4096, kv 8 x 128 = 1024.
    Red when: any coefficient of the expert or attention changes."""
    m = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "h100-pcie5", HardwareSpec)
    c = ComputeModel.from_specs(m, hw)
    flops, mem = 989e12 * 0.6, 3350e9 * 0.8
    params = 3 * 4096 * 14336
    assert params * 2 == 352_321_536 == m.expert_size_bytes
    assert c.expert_s(1) == pytest.approx(
        3 * 4e-6 + 352_321_536 / mem + 2 * params / flops, rel=REL
    )
    attn = 4096 * 4096 + 2 * 4096 * 1024 + 4096 * 4096  # 41,943,040
    assert attn == 41_943_040
    assert c.attention_s(1, 99, 100) == pytest.approx(
        6 * 4e-6 + (attn * 2 + 99 * 2 * 1024 * 2) / mem + (2 * attn + 100 * 4 * 4096) / flops,
        rel=REL,
    )


def test_a_measured_coefficient_replaces_only_its_own():
    """``hardware.measured[<model>]`` overrides the coefficients it names and no other.
    Red when: a measured profile is ignored, or applied to another model's name."""
    hw = replace(HAND_HW, measured={"hand": {"expert_a_s": 1e-3}, "other": {"attn_a_s": 9.0}})
    c = ComputeModel.from_specs(HAND, hw)
    assert c.expert_a_s == 1e-3
    assert c.expert_s(5) == pytest.approx(1e-3 + 5 * 49_152 / FLOPS, rel=REL)
    assert c.attn_a_s == pytest.approx(6 * K0 + 24_576 / MEM, rel=REL)


# -- end to end: TTFT and TPOT of a tiny trace -------------------------------------------
T_X = 1e-5 + 49_152 / 4.9152e9  # one expert over the idle link: 2e-5 s


@pytest.mark.parametrize("fast", [True, False])
def test_ttft_and_tpot_of_a_tiny_trace_by_hand(tmp_path, fast):
    """Two requests in one static batch of 2: A (prompt 3, 3 output tokens) and B (prompt
    2, 2 output tokens); every token of both goes to experts {0, 1} in MoE layer 0 and
    {2, 3} in layer 1, with room for all 8 experts.  So the prefill misses all four (each
    layer loads its two on demand, back to back) and every decode hits.

    Iteration 0 (prefill of both): 5 tokens, no KV read, 3*4/2 + 2*3/2 = 9 pairs.  The
    dense layer is attention + dense MLP (no router).  An MoE layer is attention + router;
    its two loads start then, the shared expert computes meanwhile, the GPU waits for load
    1 (T_X), computes expert 0 (5 tokens), waits for load 2 (2 T_X: the link is busier
    than the compute, checked below) and computes expert 1.  LM head for 2 sequences.
    Iteration 1 (decode of both): 2 tokens, KV reads 3 + 2 = 5, pairs 4 + 3 = 7, two
    resident experts of 2 tokens each.  Iteration 2 (A alone): 1 token, KV 4, pairs 5.

    TTFT(A) = TTFT(B) = T0; TPOT(A) = (T1 + T2) / 2; TPOT(B) = T1.
    Red when: the runner counts prefill pairs as p^2 (non-causal) or decode KV as p + j;
    the LM head is costed per token instead of per sequence; the dense layer also runs
    the router; shared experts are skipped; the FFN counts 2 matrices; the attention pair
    cost is halved."""
    assert T_X == pytest.approx(2e-5, rel=1e-12)
    a = Req(0, 3, [[[0, 1], [2, 3]]] * 3)
    b = Req(1, 2, [[[0, 1], [2, 3]]] * 2)
    tr = write_trace(tmp_path / "t", HAND, [a, b])
    # premise of the prefill's closed form: each load outlasts the compute it overlaps
    assert T_X > shared_s(5) + expert_s(5) and T_X > expert_s(5)
    moe0 = attention_s(5, 0, 9) + router_s(5) + 2 * T_X + expert_s(5)
    t0 = attention_s(5, 0, 9) + dense_s(5) + 2 * moe0 + lm_head_s(2)
    stall0 = 2 * ((T_X - shared_s(5)) + (2 * T_X - (T_X + expert_s(5))))
    moe1 = attention_s(2, 5, 7) + router_s(2) + shared_s(2) + 2 * expert_s(2)
    t1 = attention_s(2, 5, 7) + dense_s(2) + 2 * moe1 + lm_head_s(2)
    moe2 = attention_s(1, 4, 5) + router_s(1) + shared_s(1) + 2 * expert_s(1)
    t2 = attention_s(1, 4, 5) + dense_s(1) + 2 * moe2 + lm_head_s(1)

    r = simulate(
        tr, HAND, HAND_HW, LRU(), 8 * 49_152, serving=ServingConfig(batch_size=2), fast=fast
    )
    s = r.summary
    assert (s["hits"], s["late"], s["misses"]) == (2 * 2 * 2, 0, 4)
    req = r.metrics.request_table()
    assert req["request_id"].tolist() == [0, 1]
    assert req["ttft_s"].tolist() == pytest.approx([t0, t0], rel=REL)
    assert req["tpot_s"].tolist() == pytest.approx([(t1 + t2) / 2, t1], rel=REL)
    assert req["e2e_s"].tolist() == pytest.approx([t0 + t1 + t2, t0 + t1], rel=REL)
    assert s["simulated_s"] == pytest.approx(t0 + t1 + t2, rel=REL)
    assert s["stall_s"] == pytest.approx(stall0, rel=REL)
    assert s["gpu_busy_s"] == pytest.approx(t0 + t1 + t2 - stall0, rel=REL)
