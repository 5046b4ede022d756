"""Encoder-decoder MoE models in the engine (Switch Transformers, NLLB-MoE).

The first ``encoder_layers`` MoE layers run once per request over its prompt (prefill);
every iteration runs the decoder's MoE layers over one token per request.  The
expectations are written out from that rule and the model shape, not read from the
Runner: which layers each iteration runs and with how many tokens, the modelled time of
a run with every expert resident, the compute coefficients of a two-matrix FFN in an MoE
layer that stands for two blocks, and the future an oracle policy is handed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from fmoesim.config.build import load_preset, preset_names
from fmoesim.config.schema import CONF_DIR
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.serving import ServingConfig, static_batches
from fmoesim.engine.simulate import future_accesses, simulate
from fmoesim.errors import ConfigError
from fmoesim.specs import ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter, read_trace
from fmoesim.trace.reader import Trace
from fmoesim.workload.synthetic import SyntheticConfig, generate
from policies.base import NO_ACTIONS, Actions, GateView, Policy
from policies.lru import LRU
from tests.test_compute_by_hand import FLOPS, HAND_HW, K0, MEM

#: 2 encoder + 2 decoder MoE layers of 4 two-matrix experts, top-1, each MoE layer
#: standing for 2 blocks (a dense block of the same FFN width between MoE blocks).
ED = ModelSpec(
    name="ed",
    num_layers=4,
    encoder_layers=2,
    moe_layer_period=2,
    expert_matrices=2,
    num_experts=4,
    top_k=1,
    hidden_size=64,
    expert_intermediate_size=128,
    dense_intermediate_size=128,
    num_attention_heads=4,
    num_kv_heads=4,
    head_dim=16,
    vocab_size=1000,
    dtype="bfloat16",
)
#: Round numbers (5e13 FLOP/s and 8e11 B/s achieved, 2 us a kernel launch)
HW = HAND_HW

#: (request_id, prompt_tokens, expert of each iteration and layer)
REQS = [
    (0, 3, [[0, 1, 2, 3], [9, 9, 1, 2], [9, 9, 3, 0]]),  # 9: the encoder does not run
    (1, 2, [[2, 3, 0, 1], [9, 9, 2, 2]]),
]


def write_ed_trace(path: Path) -> Trace:
    """:data:`REQS` as a trace: at iteration 0 an encoder layer routes the whole prompt
    to its expert and a decoder layer one token; after it only the decoder routes."""
    L, E, n = ED.num_layers, ED.num_experts, ED.encoder_layers
    man = TraceManifest(
        model=TraceModel.of(ED),
        embedding_dim=0,
        source={"kind": "synthetic", "generator": "tests/test_encoder_decoder.py"},
        has_probs=False,
        has_spec_probs=False,
    )
    with TraceWriter(path, man, overwrite=True) as w:
        for rid, p, routes in REQS:
            w.add_request(rid, p, len(routes))
        for rid, p, routes in REQS:
            for j, route in enumerate(routes):
                layer_tokens = np.array([p if j == 0 else 0] * n + [1] * (L - n))
                counts = np.zeros((L, E), np.int32)
                for layer, e in enumerate(route):
                    if layer_tokens[layer]:
                        counts[layer, e] = layer_tokens[layer]
                w.add_iteration(rid, j, p if j == 0 else 1, None, counts, layer_tokens=layer_tokens)
    return read_trace(path)


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    return write_ed_trace(tmp_path_factory.mktemp("ed") / "trace")


class Gates(LRU):
    """LRU recording (layer, tokens, step) of every gate it is shown."""

    name = "gates"

    def on_gate(self, layer: int, gate: GateView) -> Actions:
        self.seen.append((layer, gate.num_tokens, gate.step))
        return NO_ACTIONS

    def reset(self, ctx):  # type: ignore[no-untyped-def]
        super().reset(ctx)
        self.seen: list[tuple[int, int, int]] = []


def test_the_encoder_runs_at_prefill_and_the_decoder_at_every_iteration(trace: Trace) -> None:
    # red if a decoding iteration runs the encoder's layers, if a decoder layer is shown
    # the prompt's tokens, or if the global step skips the layers an iteration leaves out
    policy = Gates()
    r = simulate(trace, ED, HW, policy, 16 * ED.expert_size_bytes)
    prefill = [(0, 3), (1, 3), (2, 1), (3, 1)]  # request 0: prompt of 3 tokens
    decode = [(2, 1), (3, 1)]
    expected = prefill + decode + decode + [(0, 2), (1, 2), (2, 1), (3, 1)] + decode
    assert [(layer, tok) for layer, tok, _ in policy.seen] == expected
    assert [step for *_, step in policy.seen] == list(range(len(expected)))
    assert r.summary["layer_steps"] == len(expected) == 14
    # one access per layer run (top-1, one request per batch)
    assert r.summary["accesses"] == 14


def test_an_encoder_decoder_run_with_every_expert_resident_takes_the_hand_sum(
    trace: Trace,
) -> None:
    # red if the encoder's attention is timed as causal, if a decoder layer leaves out
    # the cross-attention over the prompt, or if decoding times the encoder's layers
    c = ComputeModel.from_specs(ED, HW)
    total = 0.0
    for _, p, routes in REQS:
        for j in range(len(routes)):
            if j == 0:  # the encoder: p tokens, bidirectional (p * p pairs), no KV read
                total += 2 * (c.attention_s(p, 0, p * p) + c.router_s(p) + c.expert_s(p))
            # the decoder's token: j predecessors and itself, and the p encoder states
            total += 2 * (c.attention_s(1, j + p, j + 1 + p) + c.router_s(1) + c.expert_s(1))
            total += c.lm_head_s(1)
    r = simulate(trace, ED, HW, LRU(), 16 * ED.expert_size_bytes, preload=True)
    assert r.summary["stall_s"] == 0
    assert r.summary["simulated_s"] == pytest.approx(total, rel=1e-12)


def test_the_compute_coefficients_of_two_matrix_ffns_and_two_blocks_by_hand() -> None:
    # red if an expert of expert_matrices = 2 is sized or timed as three matrices, if the
    # attention of the block without experts is left out, or if its dense FFN is
    h, inter, attn = 64, 128, 4 * 64 * 64  # q, k, v, o of 4 heads x 16
    ffn = 2 * h * inter
    c = ComputeModel.from_specs(ED, HW)
    assert ED.expert_size_bytes == 2 * 64 * 128 * 2
    assert c.expert_a_s == pytest.approx(2 * K0 + ffn * 2 / MEM)
    assert c.expert_b_s == pytest.approx(2 * ffn / FLOPS)
    assert c.attn_a_s == pytest.approx(2 * (6 * K0 + attn * 2 / MEM))
    assert c.attn_b_s == pytest.approx(2 * 2 * attn / FLOPS)
    assert c.attn_kv_s == pytest.approx(2 * (2 * 4 * 16) * 2 / MEM)
    assert c.attn_pair_s == pytest.approx(2 * (4 * 4 * 16) / FLOPS)
    assert c.residual_a_s == pytest.approx(2 * K0 + ffn * 2 / MEM)
    assert c.residual_b_s == pytest.approx(2 * ffn / FLOPS)
    # the resident weights: embedding and LM head, 2 blocks' attention and 1 dense FFN
    # per MoE layer, the routers
    assert ED.resident_params == 2 * 1000 * h + 4 * (2 * attn + ffn + h * 4)


def test_an_oracle_is_handed_the_steps_the_runner_runs(trace: Trace) -> None:
    # red if the future counts the encoder's layers of decoding iterations as steps: the
    # oracle's step numbers would then drift from the gates' after the first prefill
    served = list(range(trace.num_requests))
    for b in (1, 2):
        serving = ServingConfig(mode="static", batch_size=b)
        r = simulate(
            trace, ED, HW, LRU(), 16 * ED.expert_size_bytes, serving=serving, access_log=True
        )
        log = r.accesses
        assert log is not None
        fut = future_accesses(
            trace, static_batches(served, b), trace.iter_start, trace.output_tokens, 2
        )
        steps = np.repeat(np.arange(len(fut.ptr) - 1), np.diff(fut.ptr))
        assert steps.tolist() == log["step"].tolist()
        keys = (log["layer"] * ED.num_experts + log["expert"]).tolist()
        assert fut.keys.tolist() == keys
    belady = simulate(
        trace,
        ED,
        HW,
        instantiate(OmegaConf.load(CONF_DIR / "policy" / "belady.yaml")),
        2 * ED.expert_size_bytes,
    )
    assert belady.summary["accesses"] == 14


def test_the_model_refuses_an_encoder_without_a_decoder() -> None:
    # red if a model whose every MoE layer is the encoder's (nothing runs at decode) passes
    with pytest.raises(ConfigError, match="encoder_layers"):
        dataclasses.replace(ED, encoder_layers=4).validate()
    with pytest.raises(ConfigError, match="expert_matrices"):
        dataclasses.replace(ED, expert_matrices=1).validate()
    with pytest.raises(ConfigError, match="moe_layer_period"):
        dataclasses.replace(ED, moe_layer_period=0).validate()


def test_the_paper_models_have_the_expert_sizes_moe_infinity_states() -> None:
    # MoE-Infinity §2.1: "Switch-128x0.2B ... each expert handling 33MB"; §7.2: NLLB's
    # expert fetches in 2.5 ms over 32 GB/s, 67 MB in 16-bit
    switch = load_preset("model", "switch-large-128", ModelSpec)
    nllb = load_preset("model", "nllb-moe-54b", ModelSpec)
    assert switch.expert_size_bytes == 2 * 1024 * 4096 * 4 == 33_554_432
    assert nllb.expert_size_bytes == 2 * 2048 * 8192 * 2 == 67_108_864
    assert (switch.encoder_layers, switch.num_layers - switch.encoder_layers) == (12, 12)
    assert (nllb.encoder_layers, nllb.num_layers - nllb.encoder_layers) == (6, 6)


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory: pytest.TempPathFactory) -> Trace:
    path = tmp_path_factory.mktemp("ed-syn") / "trace"
    model = dataclasses.replace(ED, num_experts=8, top_k=2)
    cfg = SyntheticConfig(
        num_requests=4,
        embedding_dim=8,
        prompt_tokens_median=8,
        prompt_tokens_max=16,
        output_tokens_median=6,
        output_tokens_max=10,
        arrival_rate_rps=20.0,
        seed=5,
    )
    generate(model, cfg, path, overwrite=True)
    return read_trace(path)


@pytest.mark.parametrize("name", preset_names("policy"))
def test_every_policy_preset_serves_an_encoder_decoder_model(synthetic: Trace, name: str) -> None:
    # red if a policy assumes every iteration starts at layer 0 (it would crash, or
    # count accesses of layers that never ran)
    model = dataclasses.replace(ED, num_experts=8, top_k=2)
    policy = instantiate(OmegaConf.load(CONF_DIR / "policy" / f"{name}.yaml"))
    assert isinstance(policy, Policy)
    r = simulate(
        synthetic,
        model,
        HW,
        policy,
        6 * model.expert_size_bytes,
        serving=ServingConfig(mode="static", batch_size=2),
    )
    expected = 0
    for start in (0, 2):
        batch = [start, start + 1]
        for j in range(max(int(synthetic.output_tokens[q]) for q in batch)):
            rows = [
                int(synthetic.iter_start[q]) + j for q in batch if synthetic.output_tokens[q] > j
            ]
            counts = synthetic.counts[rows].sum(axis=0)[0 if j == 0 else 2 :]
            expected += int(np.count_nonzero(counts))
    assert r.summary["accesses"] == expected
