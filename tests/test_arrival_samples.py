"""fMoE Fig. 10's arrival log: 64 requests drawn from statistics of Azure's 2023
conversation trace (``fmoesim.workload.arrival_samples``)."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from fmoesim.workload.arrival_samples import (
    CONV_OUTPUT_TOKENS,
    CONV_PROMPT_TOKENS,
    CONV_SPAN_S,
    PERCENTILES,
    azure_conv_sample,
    write_azure_conv_sample,
)
from fmoesim.workload.synthetic import read_arrivals

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "arrivals" / "azure_llm_2023_conv.csv"


def _frame(n: int, seed: int) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(azure_conv_sample(n, seed)))


def test_the_sample_follows_the_quoted_percentiles():
    """Red if the lengths are drawn off the tables (another interpolation, the tables
    misaligned with PERCENTILES, prompt and output swapped): 40,000 draws give back the
    percentiles 5 to 95 within 4%, 1 and 99 within 10%, and the medians within 1%."""
    df = _frame(40_000, 1)
    for col, table in (
        ("ContextTokens", CONV_PROMPT_TOKENS),
        ("GeneratedTokens", CONV_OUTPUT_TOKENS),
    ):
        for lo, hi, rtol in ((5, 95, 0.04), (1, 99, 0.1)):  # the tails are sparser
            qs = [p for p in PERCENTILES if lo <= p <= hi]
            want = [v for p, v in zip(PERCENTILES, table, strict=True) if lo <= p <= hi]
            np.testing.assert_allclose(np.percentile(df[col], qs), want, rtol=rtol)
        assert df[col].median() == pytest.approx(table[PERCENTILES.index(50)], rel=0.01)
        assert df[col].min() >= table[0] and df[col].max() <= table[-1]


def test_the_sample_s_arrivals_spread_over_the_trace_s_hour():
    """Red if the times are not sorted, do not start at 0, or leave the trace's span:
    64 requests drawn at random from an hour arrive about 55 s apart."""
    df = _frame(64, 0)
    t = df.TIMESTAMP.to_numpy()
    assert len(df) == 64 and t[0] == 0.0 and (np.diff(t) >= 0).all() and t[-1] <= CONV_SPAN_S
    assert 40 < np.diff(t).mean() < 70
    assert azure_conv_sample(64, 0) == azure_conv_sample(64, 0) != azure_conv_sample(64, 1)


def test_the_sample_reads_back_as_an_azure_log(tmp_path):
    """Red if the writer's format is not one the Azure reader takes (seconds, sorted,
    positive lengths)."""
    p = write_azure_conv_sample(tmp_path / "a.csv", num_requests=8, seed=2)
    df = _frame(8, 2)
    lens = read_arrivals(p)
    assert lens.prompt.tolist() == df.ContextTokens.tolist()
    assert lens.output.tolist() == df.GeneratedTokens.tolist()
    np.testing.assert_allclose(lens.arrival_s, df.TIMESTAMP.to_numpy())


def test_write_replaces_other_bytes_and_keeps_its_own(tmp_path):
    """Red if a file left by an older writer (other rows) is kept, or the same bytes are
    written again (a sweep's workers read the file while one writes)."""
    p = tmp_path / "azure.csv"
    p.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,128,64\n")
    write_azure_conv_sample(p)
    assert p.read_text() == azure_conv_sample(64, 0)
    old = p.stat().st_mtime_ns - 10**9
    os.utime(p, ns=(old, old))
    write_azure_conv_sample(p)
    assert p.stat().st_mtime_ns == old  # not rewritten


def test_fig10_reads_the_file_its_inputs_are_written_to(tmp_path):
    """Red if fmoesim-plot writes the log to one path and the preset reads another (a
    fresh clone's Fig. 10 would then stop at "arrival file not found")."""
    from fmoesim.cli.main import compose_config
    from fmoesim.cli.plot_cli import AZURE_CSV, prepare_inputs

    prepare_inputs("fmoe-fig10", tmp_path)
    assert (tmp_path / AZURE_CSV).read_text() == azure_conv_sample(64, 0)
    cfg = compose_config(["experiment=fmoe-fig10", "model=mixtral-8x7b", "policy=fmoe"])
    assert cfg.workload.synthetic.arrivals_csv == AZURE_CSV
    assert cfg.serving.arrivals == "trace"  # the times the trace took from the log
    # every length of the log passes unclipped
    assert cfg.workload.synthetic.prompt_tokens_max >= CONV_PROMPT_TOKENS[-1]
    assert cfg.workload.synthetic.output_tokens_max >= CONV_OUTPUT_TOKENS[-1]


@pytest.mark.skipif(
    not REAL.is_file(), reason="../shared/data (Azure conversation trace) is absent"
)
def test_the_quoted_statistics_are_the_real_trace_s():
    """Red if a quoted percentile or the span is not what the real file gives."""
    real = read_arrivals(REAL)
    assert round(float(real.arrival_s[-1]), 6) == CONV_SPAN_S
    for col, table in ((real.prompt, CONV_PROMPT_TOKENS), (real.output, CONV_OUTPUT_TOKENS)):
        got = [int(round(v)) for v in np.percentile(col, PERCENTILES)]
        assert got == list(table)
