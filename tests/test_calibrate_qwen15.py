"""The calibrated Qwen1.5-MoE-A2.7B preset against the real top-1 transition matrix:
top-1 frequency Gini and top-1 stickiness."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from omegaconf import OmegaConf

from fmoesim.config.build import load_preset
from fmoesim.config.schema import CONF_DIR
from fmoesim.specs import ModelSpec
from fmoesim.workload.calibrate import (
    gini,
    qwen15_stats,
    synthetic_like,
    top1_frequency_skew,
    top1_stickiness,
)

ROOT = Path(__file__).resolve().parents[1]
MATRIX = (
    ROOT.parent / "shared" / "data" / "routing" / "transition-matrices"
    / "qwen_markov_transition_matrix.pt"
)  # fmt: skip
PRESET = Path(CONF_DIR) / "workload" / "routing-qwen1.5-moe-a2.7b.yaml"


def test_qwen15_stats_by_hand(tmp_path):
    torch = pytest.importorskip("torch", reason="transition matrices are torch tensors")
    mat = torch.zeros((2, 3, 3), dtype=torch.float64)
    # layer 0: rows (top-1 at token t) sum to (3, 1, 0), columns to (2, 2, 0); diagonal
    # 2 + 1 = 3 of 4
    mat[0] = torch.tensor([[2.0, 1, 0], [0, 1, 0], [0, 0, 0]])
    # layer 1: rows sum to (2, 1, 2), columns to (3, 1, 1); diagonal 1 of 5
    mat[1] = torch.tensor([[1.0, 1, 0], [0, 0, 1], [2, 0, 0]])
    path = tmp_path / "x_markov_transition_matrix.pt"
    torch.save(mat, path)
    q = qwen15_stats(path)
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


@pytest.mark.skipif(not MATRIX.is_file(), reason="../shared/data (Qwen1.5-MoE matrix) is absent")
def test_qwen15_preset_matches_the_real_top1_statistics(tmp_path):
    pytest.importorskip("torch", reason="transition matrices are torch tensors")
    real = qwen15_stats(MATRIX)
    syn = OmegaConf.to_container(OmegaConf.load(PRESET).synthetic)
    assert isinstance(syn, dict)
    knobs = {k: syn[k] for k in ("skew", "locality", "noise", "request_jitter")}
    model = load_preset("model", "qwen1.5-moe-a2.7b", ModelSpec)
    # the fit's own trace size: 32 requests of about 128 one-token iterations
    tr = synthetic_like(model, knobs, tmp_path / "t", 32, 128, 0)
    # tolerances: seeds 0 and 1 differ by 0.011 in Gini and 0.002 in stickiness
    assert abs(top1_frequency_skew(tr)[0] - real["top1_gini"]) < 0.02
    assert abs(top1_stickiness(tr) - real["top1_stickiness"]) < 0.01
