"""Top-1 statistics of real transition matrices and of traces, and the calibrated top-1
workloads (Qwen1.5-MoE-A2.7B, Switch) against the real matrices they were fitted to."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from omegaconf import OmegaConf

from fmoesim.config.build import load_preset
from fmoesim.config.schema import CONF_DIR
from fmoesim.specs import ModelSpec
from fmoesim.workload.calibrate import (
    SWITCH_FIXED,
    gini,
    synthetic_like,
    top1_frequency_skew,
    top1_matrix_stats,
    top1_stickiness,
)

MATRICES = (
    Path(__file__).resolve().parents[2] / "shared" / "data" / "routing" / "transition-matrices"
)


def test_top1_matrix_stats_by_hand(tmp_path):
    torch = pytest.importorskip("torch", reason="transition matrices are torch tensors")
    mat = torch.zeros((2, 3, 3), dtype=torch.float64)
    # layer 0: rows (top-1 at token t) sum to (3, 1, 0), columns to (2, 2, 0); diagonal
    # 2 + 1 = 3 of 4
    mat[0] = torch.tensor([[2.0, 1, 0], [0, 1, 0], [0, 0, 0]])
    # layer 1: rows sum to (2, 1, 2), columns to (3, 1, 1); diagonal 1 of 5
    mat[1] = torch.tensor([[1.0, 1, 0], [0, 0, 1], [2, 0, 0]])
    path = tmp_path / "x_markov_transition_matrix.pt"
    torch.save(mat, path)
    q = top1_matrix_stats(path)
    # stickiness is trace / total of each layer, averaged over layers: (3/4 + 1/5) / 2.
    # Red if the diagonal were pooled over layers (4/9) or divided by anything but the
    # layer's own total (e.g. by E = 3).
    assert q["top1_stickiness"] == pytest.approx((3 / 4 + 1 / 5) / 2)
    assert (q["top1_stickiness_min"], q["top1_stickiness_max"]) == (0.2, 0.75)
    # frequency is the row sums: Gini of (3, 1, 0) is (-2*0 + 0*1 + 2*3) / (3*4) = 1/2,
    # of (2, 1, 2) is (-2*1 + 0*2 + 2*2) / (3*5) = 2/15.  Red if the sums ran over the
    # columns instead: (2, 2, 0) and (3, 1, 1) give 1/3 and 4/15.
    assert gini(np.array([3.0, 1, 0])) == pytest.approx(1 / 2)
    assert q["top1_gini"] == pytest.approx((1 / 2 + 2 / 15) / 2)
    assert q["top1_max_over_mean"] == pytest.approx((3 / (4 / 3) + 2 / (5 / 3)) / 2)
    assert q["tokens_per_layer"] == 4.5
    # independent tokens at the row shares: (3/4)^2 + (1/4)^2 = 0.625 and 0.4^2 + 0.2^2 +
    # 0.4^2 = 0.36, averaged.  Red if the shares were the columns' or pooled over layers.
    assert q["top1_independent_stickiness"] == pytest.approx((0.625 + 0.36) / 2)


def test_top1_statistics_read_the_decoder_layers_of_an_encoder_decoder_trace():
    """Red if an encoder layer, which routes the prompt in iteration 0 alone (its later
    rows hold no probabilities, so their argmax is expert 0), enters the statistics.
    One request of 4 one-token iterations, layer 0 the encoder, 3 experts; the decoder's
    top-1 is 1, 2, 2, 1.  Stickiness over the decode iterations 1-3 (2, 2, 1): 1 of 2
    pairs; with the encoder's (0, 0, 0) it would be 3 of 4.  Frequency (0, 2, 2): Gini
    4 / 12 = 1/3; with the encoder's (3, 1, 0), Gini 1/2, the mean would be 5/12."""
    probs = np.zeros((4, 2, 3))  # (iterations, L, E)
    probs[0, 0] = [0.2, 0.5, 0.3]  # the encoder's prompt, iteration 0 only
    for it, top in enumerate((1, 2, 2, 1)):
        probs[it, 1, top] = 0.9
    trace = SimpleNamespace(
        probs=probs, encoder_layers=1, num_requests=1, iter_start=np.array([0]),
        output_tokens=np.array([4]), num_tokens=np.ones(4, dtype=np.int32), num_experts=3,
    )  # fmt: skip
    assert top1_stickiness(trace) == pytest.approx(1 / 2)
    assert top1_frequency_skew(trace)[0] == pytest.approx(1 / 3)
    # a decoder-only trace reads every layer: the same rows with no encoder pool both
    trace.encoder_layers = 0
    assert top1_stickiness(trace) == pytest.approx(3 / 4)
    assert top1_frequency_skew(trace)[0] == pytest.approx(5 / 12)


@pytest.mark.parametrize(
    ("model", "matrix", "preset", "fixed"),
    [
        ("qwen1.5-moe-a2.7b", "qwen", "routing-qwen1.5-moe-a2.7b", {}),
        ("switch-large-128", "switch", "routing-switch", SWITCH_FIXED),
    ],
)
def test_preset_matches_the_real_top1_statistics(tmp_path, model, matrix, preset, fixed):
    """Red if a calibrated preset's knobs no longer give its real matrix's top-1 frequency
    Gini and stickiness (Switch: on the decoder's layers of switch-large-128), or if the
    preset drops a knob its fit held fixed.  Tolerances: seeds 0 and 1 differ by 0.011 in
    Gini and 0.002 in stickiness."""
    path = MATRICES / f"{matrix}_markov_transition_matrix.pt"
    if not path.is_file():
        pytest.skip(f"../shared/data ({path.name}) is absent")
    pytest.importorskip("torch", reason="transition matrices are torch tensors")
    real = top1_matrix_stats(path)
    syn = OmegaConf.to_container(
        OmegaConf.load(Path(CONF_DIR) / "workload" / f"{preset}.yaml").synthetic
    )
    assert isinstance(syn, dict)
    assert {k: syn[k] for k in fixed} == fixed
    names = ("skew", "locality", "noise", "request_jitter", *fixed)
    knobs = {k: syn[k] for k in dict.fromkeys(names)}
    spec = load_preset("model", model, ModelSpec)
    # the fit's own trace size: 32 requests of about 128 one-token iterations
    tr = synthetic_like(spec, knobs, tmp_path / "t", 32, 128, 0)
    assert abs(top1_frequency_skew(tr)[0] - real["top1_gini"]) < 0.02
    assert abs(top1_stickiness(tr) - real["top1_stickiness"]) < 0.01
