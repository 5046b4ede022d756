"""The calibrated Switch workload against the real top-1 transition matrix, and the top-1
statistics of an encoder-decoder trace (its decoder's layers alone)."""

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
    qwen15_stats,
    synthetic_like,
    top1_frequency_skew,
    top1_stickiness,
)

ROOT = Path(__file__).resolve().parents[1]
MATRIX = (
    ROOT.parent / "shared" / "data" / "routing" / "transition-matrices"
    / "switch_markov_transition_matrix.pt"
)  # fmt: skip
PRESET = Path(CONF_DIR) / "workload" / "routing-switch.yaml"


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


@pytest.mark.skipif(not MATRIX.is_file(), reason="../shared/data (Switch matrix) is absent")
def test_switch_preset_matches_the_real_top1_statistics(tmp_path):
    """Red if routing-switch's knobs no longer give the real matrix's top-1 frequency
    Gini and stickiness on the decoder's layers of switch-large-128 (or if the preset
    drops a knob the fit held)."""
    pytest.importorskip("torch", reason="transition matrices are torch tensors")
    real = qwen15_stats(MATRIX)
    syn = OmegaConf.to_container(OmegaConf.load(PRESET).synthetic)
    assert isinstance(syn, dict)
    assert {k: syn[k] for k in SWITCH_FIXED} == SWITCH_FIXED
    knobs = {k: syn[k] for k in ("skew", "locality", *SWITCH_FIXED)}
    model = load_preset("model", "switch-large-128", ModelSpec)
    tr = synthetic_like(model, knobs, tmp_path / "t", 32, 128, 0)  # the fit's trace size
    assert abs(top1_frequency_skew(tr)[0] - real["top1_gini"]) < 0.02
    assert abs(top1_stickiness(tr) - real["top1_stickiness"]) < 0.01
