"""Arrival logs from two loggers: Azure's LLM inference CSVs and Mooncake's JSON lines
traces, read by hand-made examples, their bad inputs, and the real public files where
``../shared/data/arrivals`` holds them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fmoesim.engine.serving import ServingConfig, arrival_times_s
from fmoesim.errors import FmoesimError
from fmoesim.workload.synthetic import read_arrivals, read_azure_csv, read_mooncake_jsonl

ROOT = Path(__file__).resolve().parents[1]
REAL = ROOT.parent / "shared" / "data" / "arrivals"

# three requests as Mooncake writes them (milliseconds from the trace's start)
MOONCAKE = [
    {"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2]},
    {"timestamp": 250, "input_length": 7322, "output_length": 490, "hash_ids": [0, 3]},
    {"timestamp": 4000, "input_length": 912, "output_length": 3, "hash_ids": []},
]


def _jsonl(path: Path, rows: list[dict] | list[str]) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_read_mooncake_jsonl(tmp_path: Path) -> None:
    """Red if milliseconds are read as seconds, lengths are swapped, or ``limit`` reads
    more rows than asked."""
    p = _jsonl(tmp_path / "m.jsonl", MOONCAKE)
    lens = read_mooncake_jsonl(p)
    assert lens.prompt.tolist() == [6758, 7322, 912]
    assert lens.output.tolist() == [500, 490, 3]
    assert lens.arrival_s.tolist() == [0.0, 0.25, 4.0]
    assert read_mooncake_jsonl(p, limit=2).arrival_s.tolist() == [0.0, 0.25]
    # a trace cut from the middle of a longer one: times count from its first row
    late = [{**r, "timestamp": r["timestamp"] + 60_000} for r in MOONCAKE]
    assert read_mooncake_jsonl(_jsonl(tmp_path / "late.jsonl", late)).arrival_s.tolist() == [
        0.0,
        0.25,
        4.0,
    ]


def test_read_arrivals_picks_the_format_from_the_name(tmp_path: Path) -> None:
    """Red if a ``.jsonl`` file goes to the CSV reader (or a CSV to the JSON one)."""
    m = _jsonl(tmp_path / "m.JSONL", MOONCAKE)
    assert read_arrivals(m).prompt.tolist() == [6758, 7322, 912]
    a = tmp_path / "a.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,5,3\n0.25,7,2\n")
    assert read_arrivals(a).prompt.tolist() == [5, 7]
    assert read_arrivals(a, limit=1).arrival_s.tolist() == [0.0]


def test_online_serving_takes_arrival_times_from_a_mooncake_trace(tmp_path: Path) -> None:
    """Red if ``serving.arrivals=csv`` reads only Azure's format: the same times in
    either file give the same arrivals."""
    m = _jsonl(tmp_path / "m.jsonl", MOONCAKE)
    a = tmp_path / "a.csv"
    a.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n0,1,1\n0.25,1,1\n4,1,1\n")
    rng = np.random.default_rng(0)
    got = {}
    for f in (m, a):
        cfg = ServingConfig(mode="online", arrivals="csv", arrivals_csv=str(f)).validate()
        got[f.suffix] = arrival_times_s(cfg, np.zeros(3), [1, 2], rng).tolist()
    assert got[".jsonl"] == got[".csv"] == [0.0, 0.25]


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        (["{not json"], " line 1: not JSON (Expecting property name enclosed in double quotes"),
        ([MOONCAKE[0], "[1, 2]"], " line 2: not a JSON object (rule: one JSON object a line"),
        ([MOONCAKE[0], "", "{"], " line 3: not JSON ("),  # a blank line is counted
        ([{**MOONCAKE[0], "timestamp": "0"}], " line 1: timestamp = '0' (rule: a number of milli"),
        ([{**MOONCAKE[0], "timestamp": True}], " line 1: timestamp = True (rule: a number of"),
        ([{"input_length": 5, "output_length": 2}], " line 1: timestamp = None (rule: a number"),
        ([{**MOONCAKE[0], "timestamp": -1}], " line 1: timestamp = -1 (rule: milliseconds, finite"),
        (  # json reads it as an int that no float holds: one line, not an OverflowError
            ['{"timestamp": 1' + "0" * 400 + ', "input_length": 1, "output_length": 1}'],
            " line 1: timestamp = 1000000000000000000000000000000000000... (rule: milliseconds",
        ),
        (
            [MOONCAKE[1], MOONCAKE[0]],
            " line 2: timestamp goes backwards (rule: lines sorted by time)",
        ),
        (
            [{**MOONCAKE[0], "output_length": 0}],
            " line 1: output_length = 0 (rule: a positive integer at most 2147483647)",
        ),
        ([{**MOONCAKE[0], "input_length": 2.5}], " line 1: input_length = 2.5 (rule: a positive"),
        ([{**MOONCAKE[0], "input_length": 2**31}], " line 1: input_length = 2147483648 (rule"),
        ([{"timestamp": 0, "output_length": 3}], " line 1: input_length = None (rule: a positive"),
        ([], ": no rows (rule: at least one request)"),
    ],
    ids=[
        "not_json",
        "not_an_object",
        "after_a_blank_line",
        "text_time",
        "bool_time",
        "no_time",
        "negative_time",
        "huge_time",
        "backwards",
        "zero_output",
        "fractional_input",
        "too_long",
        "no_input",
        "empty",
    ],
)
def test_read_mooncake_jsonl_rejects(tmp_path: Path, rows: list, expected: str) -> None:
    """Red if a malformed line is read, or the error misses the file, line or rule (a
    JSON-lines file counts lines, as docs/usage.md says)."""
    p = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(FmoesimError) as info:
        read_mooncake_jsonl(p)
    assert str(info.value).startswith(str(p) + expected), str(info.value)


def test_read_mooncake_jsonl_skips_what_the_csv_reader_skips(tmp_path: Path) -> None:
    """Red if a byte-order mark or a blank line (a trailing one too) is refused where the
    CSV reader reads past it, or ``limit`` counts lines instead of requests."""
    text = "\n".join(json.dumps(r) for r in MOONCAKE)
    p = tmp_path / "m.jsonl"
    p.write_bytes(("\ufeff" + text.replace("\n", "\r\n\r\n", 1) + "\n\n").encode())
    lens = read_mooncake_jsonl(p)
    assert lens.prompt.tolist() == [6758, 7322, 912]
    assert read_mooncake_jsonl(p, limit=2).output.tolist() == [500, 490]


def test_read_mooncake_jsonl_names_a_missing_file_or_bad_bytes(tmp_path: Path) -> None:
    """Red if a missing file, a folder or non-UTF-8 bytes escape as a traceback."""
    with pytest.raises(FmoesimError, match="nope.jsonl: arrival file not found"):
        read_arrivals(tmp_path / "nope.jsonl")
    (tmp_path / "d.jsonl").mkdir()
    with pytest.raises(FmoesimError, match="d.jsonl: a directory, not a JSON lines file"):
        read_arrivals(tmp_path / "d.jsonl")
    (tmp_path / "b.jsonl").write_bytes(b'{"timestamp": 0}\xff\n')
    with pytest.raises(FmoesimError, match="b.jsonl: not UTF-8 text"):
        read_arrivals(tmp_path / "b.jsonl")


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (arrival traces) is absent")
@pytest.mark.parametrize(
    ("name", "rows", "last_s", "prompt_median", "output_median"),
    [
        # Azure/AzurePublicDataset AzureLLMInferenceTrace_{code,conv}.csv (2023-11-16)
        ("azure_llm_2023_code.csv", 8819, 3435.948056, 1469, 13),
        ("azure_llm_2023_conv.csv", 19366, 3501.721937, 1020, 129),
        # kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl
        ("mooncake_conversation_trace.jsonl", 12031, 3536.999, 6909, 350),
    ],
)
def test_the_real_arrival_logs_read_whole(
    name: str, rows: int, last_s: float, prompt_median: int, output_median: int
) -> None:
    """Red if a real file's rows are dropped or misread: the counts are the files'
    published ones (8,819, 19,366 and 12,031 requests), the spans about an hour, the
    medians as the files give them."""
    lens = read_arrivals(REAL / name)
    assert len(lens.prompt) == len(lens.output) == len(lens.arrival_s) == rows
    assert lens.arrival_s[0] == 0.0 and lens.arrival_s[-1] == pytest.approx(last_s, abs=1e-6)
    assert np.median(lens.prompt) == prompt_median and np.median(lens.output) == output_median
    if name.endswith(".csv"):  # the dispatcher gives what the Azure reader gives
        np.testing.assert_array_equal(read_azure_csv(REAL / name).arrival_s, lens.arrival_s)


def test_a_synthetic_trace_takes_lengths_and_arrivals_from_a_mooncake_trace(tmp_path: Path):
    """Red if the generator reads only Azure's format for its lengths, or leaves a
    Mooncake prompt (thousands of tokens) unclipped by ``prompt_tokens_max``."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs.model import ModelSpec
    from fmoesim.trace.reader import read_trace
    from fmoesim.workload.synthetic import SyntheticConfig, generate

    m = _jsonl(tmp_path / "m.jsonl", MOONCAKE)
    model = load_preset("model", "olmoe-1b-7b", ModelSpec)
    cfg = SyntheticConfig(num_requests=3, arrivals_csv=str(m), prompt_tokens_max=1000,
                          output_tokens_max=8)  # fmt: skip
    tr = read_trace(generate(model, cfg, tmp_path / "t"))
    assert tr.prompt_tokens.tolist() == [1000, 1000, 912]
    assert tr.output_tokens.tolist() == [8, 8, 3]
    assert tr.arrival_s.tolist() == [0.0, 0.25, 4.0]


def test_arrival_summary_by_hand():
    """Red if the rate counts requests instead of gaps, the CV uses another spread, or a
    percentile is taken of the wrong column. By hand: arrivals 0, 1, 3 s: 2 gaps over
    3 s, so 0.667 requests/s; gaps 1 and 2, mean 1.5, population sd 0.5, CV 1/3."""
    from fmoesim.workload.arrival_samples import arrival_summary

    s = arrival_summary(np.array([10, 20, 30]), np.array([1, 2, 9]), np.array([0.0, 1.0, 3.0]))
    assert s["requests"] == 3 and s["span_s"] == 3.0
    assert s["rate_rps"] == pytest.approx(2 / 3) and s["gap_mean_s"] == 1.5
    assert s["gap_cv"] == pytest.approx(1 / 3)
    assert s["prompt"] == {"mean": 20.0, "p50": 20.0, "p90": 28.0, "p99": 29.8, "max": 30}
    assert s["output"]["max"] == 9 and s["output"]["p50"] == 2.0
    one = arrival_summary(np.array([5]), np.array([1]), np.array([0.0]))
    assert np.isnan(one["rate_rps"]) and np.isnan(one["gap_cv"])


def test_fmoesim_trace_arrivals_prints_the_log_s_traffic(tmp_path: Path):
    """Red if the report's numbers are not the summary's, the gamma settings it suggests
    do not compose into a run, or a bad --limit or file escapes as a traceback."""
    import subprocess
    import sys

    p = _jsonl(tmp_path / "m.jsonl", MOONCAKE)

    def trace(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fmoesim.cli.trace_cli", "arrivals", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)

    out = trace(str(p))
    assert out.returncode == 0, out.stderr
    # 3 requests over 4 s: 0.5 requests/s; gaps 0.25 and 3.75: mean 2, sd 1.75, CV 0.875
    assert out.stdout.splitlines() == [
        f"{p} (Mooncake JSON lines): 3 requests over 4.0 s",
        "rate           0.5 requests/s",
        "gaps           mean 2 s, coefficient of variation 0.875",
        "prompt tokens  mean 4,997, p50 6,758, p90 7,209, p99 7,311, max 7,322",
        "output tokens  mean 331, p50 490, p90 498, p99 500, max 500",
        "as gamma arrivals: serving.mode=online serving.arrivals=gamma serving.rate_rps=0.5 "
        "serving.arrival_cv=0.875",
    ]
    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run

    suggested = out.stdout.splitlines()[-1].removeprefix("as gamma arrivals: ").split()
    assert build_run(compose_config(suggested)).serving.arrival_cv == 0.875
    one = trace(str(p), "--limit", "1")
    assert "rate           n/a (every request arrives at once)" in one.stdout
    assert "as gamma" not in one.stdout
    bad = trace(str(p), "--limit", "0")
    assert bad.returncode == 2 and bad.stderr.strip().endswith(
        "'--limit' = 0: must be an integer >= 1"
    ), bad.stderr
    missing = trace(str(tmp_path / "none.csv"))
    assert missing.returncode == 2 and "none.csv: arrival CSV not found" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(not REAL.is_dir(), reason="../shared/data (arrival traces) is absent")
def test_the_real_logs_burstiness_as_docs_usage_quotes_it():
    """Red if docs/usage.md's coefficients of variation (1.09, 13.2, 3.03) and rates are
    not what the real logs give."""
    from fmoesim.workload.arrival_samples import arrival_summary

    for name, rate, cv in (
        ("azure_llm_2023_conv.csv", 5.53, 1.09),
        ("azure_llm_2023_code.csv", 2.57, 13.2),
        ("mooncake_conversation_trace.jsonl", 3.40, 3.03),
    ):
        lens = read_arrivals(REAL / name)
        s = arrival_summary(lens.prompt, lens.output, lens.arrival_s)
        assert round(s["rate_rps"], 2) == rate and float(f"{s['gap_cv']:.3g}") == cv


def test_sample_arrivals_draws_rows_of_the_log_in_time_order():
    """Red if the sample invents requests, pairs one request's prompt with another's
    output, leaves time order, or does not start at 0 (the way §6.3's 64 requests would
    be drawn from the real Azure file)."""
    from fmoesim.workload.arrival_samples import sample_arrivals

    n = 200
    prompt = np.arange(1, n + 1) * 10  # request i: prompt 10 (i + 1), output i + 1
    output = np.arange(1, n + 1)
    arrival = np.cumsum(np.full(n, 0.5))  # 0.5, 1.0, ...
    text = sample_arrivals(prompt, output, arrival, 20, seed=3)
    assert text == sample_arrivals(prompt, output, arrival, 20, seed=3)
    assert text != sample_arrivals(prompt, output, arrival, 20, seed=4)
    rows = [line.split(",") for line in text.splitlines()[1:]]
    assert len(rows) == 20
    t = [float(r[0]) for r in rows]
    got = [(int(r[1]), int(r[2])) for r in rows]
    assert t[0] == 0.0 and t == sorted(t) and len(set(got)) == 20
    assert all(p == 10 * o for p, o in got)  # each row one request of the log
    first = got[0][1] - 1  # the first drawn request's index
    assert t == [(o - 1 - first) * 0.5 for _, o in got]
    with pytest.raises(ValueError, match="from 1 to the log's 200 requests"):
        sample_arrivals(prompt, output, arrival, 201)


def test_fmoesim_trace_arrivals_writes_a_sample(tmp_path: Path):
    """Red if --sample writes over a file without --force, writes anything on a refused
    call, or its file is not one the readers take."""
    import subprocess
    import sys

    def trace(*args: str) -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "fmoesim.cli.trace_cli", "arrivals", *args]
        return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)

    out = tmp_path / "s.csv"
    ok = trace("examples/arrivals.csv", "--sample", "8", "--seed", "1", "--out", str(out))
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith(f"{out} (Azure CSV): 8 requests over ")
    assert len(read_arrivals(out).prompt) == 8
    first = out.read_text()
    again = trace("examples/arrivals.csv", "--sample", "8", "--seed", "2", "--out", str(out))
    assert again.returncode == 2 and "s.csv: exists (--force replaces it)" in again.stderr
    assert out.read_text() == first
    forced = trace("examples/arrivals.csv", "--sample", "8", "--seed", "2", "--out", str(out),
                   "--force")  # fmt: skip
    assert forced.returncode == 0 and out.read_text() != first
    for args, message in (
        (["--sample", "33", "--out", str(tmp_path / "a.csv")], "more than the 32 requests of"),
        (["--sample", "0", "--out", str(tmp_path / "a.csv")], "'--sample' = 0: must be"),
        (["--out", str(tmp_path / "a.csv")], "'--sample' = None: is needed with --out"),
        (["--sample", "4"], "'--out' = None: is needed with --sample"),
    ):
        bad = trace("examples/arrivals.csv", *args)
        assert bad.returncode == 2 and message in bad.stderr, bad.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.csv"]
