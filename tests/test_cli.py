"""The command-line tools: a real run, and every error path (one line, exit 2, nothing written)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fmoesim.specs.model import ModelSpec
from tests.test_engine_lru import ROUTES
from tests.tiny import TINY, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]


def run(module: str, *args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        cwd=cwd or ROOT,
        timeout=300,
    )


def fmoesim(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return run("fmoesim.cli.main", *args, cwd=cwd)


SHAPE = ("name", "num_layers", "num_experts", "top_k", "hidden_size", "expert_intermediate_size")


def model_overrides(m: ModelSpec, fields: tuple[str, ...] = SHAPE) -> list[str]:
    """``model.<field>=<value>`` for ``fields`` of ``m``."""
    return [f"model.{f}={getattr(m, f)}" for f in fields]


def tiny_overrides(trace: Path, out: Path) -> list[str]:
    return [
        f"workload.path={trace}",
        f"output.dir={out}",
        f"store.dir={out}/store",
        "progress=false",
        *model_overrides(TINY),
        f"cache.budget_gb={2 * TINY.expert_size_bytes / 1e9}",
    ]


def test_run_writes_summary_with_hand_computed_hit_rate(tmp_path):
    """Red if the hit rate is not the hand count (5 of 12), a run file is missing, or the
    summary does not note weights above the GPU's memory (the budget is unchecked)."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    out = tmp_path / "out"
    p = fmoesim(*tiny_overrides(trace, out), "output.name=tiny-run")
    assert p.returncode == 0, p.stderr
    assert "expert hit rate" in p.stdout and "41.67%" in p.stdout  # 5 / 12
    run_dir = out / "tiny-run"
    row = pd.read_parquet(run_dir / "summary.parquet").iloc[0]
    assert row["hit_rate"] == pytest.approx(5 / 12)
    assert row["policy"] == "lru" and row["model"] == "tiny"
    assert '"budget_gb"' in row["config_json"] and len(row["config_hash"]) == 16
    assert (run_dir / "hit_rate.png").stat().st_size > 1000
    assert (run_dir / "config.yaml").is_file()
    assert not list(out.glob(".*tmp*")), "temporary directory left behind"
    assert "note " not in p.stdout  # the tiny model's weights fit the GPU
    # a GPU of 0.01 GB: the weights' peak is above it, and the summary says so
    p = fmoesim(*tiny_overrides(trace, out), "hardware.gpu_memory_gb=0.01", "output.write=false")
    assert p.returncode == 0, p.stderr
    assert "note       VRAM (weights) exceeds the GPU's 0.01 GB: cache.budget_gb counts" in p.stdout


BAD = [
    (["policy=nope"], "policy=nope: unknown policy; valid: "),
    (["model=nope"], "valid: arctic, deepseek-v2-lite, deepseek-v3, gpt-oss-120b"),
    # the measured profiles live in a subfolder: named with their count, listed when asked
    (["hardware=nope"], "rtx3090-pcie4; measured/<name> ("),
    (["hardware=measured/nope"], "hardware=measured/nope: unknown hardware; valid in measured/: "),
    (["hardware=measured/nope"], "measured/h100-3, measured/h100-3-host-launch,"),
    (["hardware=nope/x"], "hardware=nope/x: unknown hardware; valid: a5000-pcie4"),
    # a group's typed schema is no preset: it would run unnamed, every value its default
    (["hardware=hardware_schema"], "hardware=hardware_schema: unknown hardware; valid: a5000"),
    (["workload=workload_schema"], "workload=workload_schema: unknown workload; valid: bundled"),
    (["cache.budgt_gb=3"], "config key 'cache.budgt_gb': unknown key"),
    (["cache.budget_gb=0"], "config key 'cache.budget_gb' = 0.0: must be > 0"),
    (["cache.budget_gb=-2"], "config key 'cache.budget_gb' = -2.0: must be > 0"),
    (["cache.budget_gb=0.5"], "must hold one layer's top-2 experts of mixtral-8x7b"),
    (["hardware.pcie_gbps=0"], "config key 'hardware.pcie_gbps' = 0.0: must be a positive number"),
    (["hardware.pcie_gbps=-3"], "hardware.pcie_gbps"),
    (["serving.batch_size=0"], "serving.batch_size"),
    (["workload.path=/no/such/trace"], "workload.path '/no/such/trace': trace directory not found"),
    (["workload.path=README.md"], "workload.path 'README.md': a file, not a trace directory"),
    (["policy=lru,"], "override 'policy=lru,': mismatched input '<EOF>'"),
    (["model=qwen1.5-moe-a2.7b", "cache.budget_gb=4"], "config key 'model.num_layers' = 24: trace"),
    (["cache.budget_gb=abc"], "config key 'cache.budget_gb'"),
]


@pytest.mark.parametrize(("args", "expected"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_input_one_line_exit_2_nothing_written(tmp_path, args, expected):
    out = tmp_path / "out"
    p = fmoesim(*args, f"output.dir={out}", f"store.dir={out}/store", "progress=false")
    assert p.returncode == 2, (p.stdout, p.stderr)
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("fmoesim: error: ")
    assert expected in lines[0]
    assert not out.exists() or not any(out.iterdir())


def test_broken_trace_refused_naming_file_row_rule(tmp_path):
    import pyarrow.parquet as pq

    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    table = pq.read_table(trace / "routing.parquet")
    pq.write_table(table.slice(0, 5), trace / "routing.parquet")  # drop layers of iteration 2+
    out = tmp_path / "out"
    p = fmoesim(*tiny_overrides(trace, out))
    assert p.returncode == 2
    line = p.stderr.strip()
    assert "routing.parquet row 5" in line and "for all 2 layers" in line
    assert not out.exists()


def test_truncated_parquet_refused(tmp_path):
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    f = trace / "iterations.parquet"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    p = run("fmoesim.cli.trace_cli", "validate", str(trace))
    assert p.returncode == 2
    assert "iterations.parquet" in p.stderr and "truncated or corrupt" in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_inspect_bundled_trace_prints_statistics():
    p = run("fmoesim.cli.trace_cli", "inspect", "traces/default")
    assert p.returncode == 0, p.stderr
    for needle in (
        "32 MoE layers x 8 experts, top-2",
        "synthetic",
        "H_coarse",
        "gini",
        "reuse",
        "spec_rec",
        "routing.parquet",
    ):
        assert needle in p.stdout
    table = [ln for ln in p.stdout.splitlines() if ln.strip()[:2].strip().isdigit()]
    assert len(table) == 32  # one row per layer


def test_synth_cli_writes_valid_trace_and_rejects_unknown_knob(tmp_path):
    """Red if synth writes a trace that does not validate, its count of one request reads
    "1 requests", or a bad knob or model leaves a folder or passes."""
    p = run(
        "fmoesim.cli.trace_cli",
        "synth",
        "--model",
        "olmoe-1b-7b",
        "--requests",
        "1",
        "--set",
        "output_tokens_median=4",
        "--set",
        "prompt_tokens_median=8",
        str(tmp_path / "o"),
    )
    assert p.returncode == 0, p.stderr
    assert "16 x 64, top-8" in p.stdout
    assert ": 1 request, " in p.stdout  # red if a count of one reads "1 requests"
    p = run("fmoesim.cli.trace_cli", "validate", str(tmp_path / "o"))
    assert p.returncode == 0 and "valid (1 request, " in p.stdout, p.stderr
    p = run("fmoesim.cli.trace_cli", "synth", "--set", "skeww=2", str(tmp_path / "x"))
    assert p.returncode == 2 and "unknown knob" in p.stderr
    assert not (tmp_path / "x").exists()
    p = run("fmoesim.cli.trace_cli", "synth", "--model", "nope", str(tmp_path / "y"))
    assert p.returncode == 2 and "valid: arctic, deepseek-v2-lite" in p.stderr


def test_synth_set_types_knobs_by_their_annotation() -> None:
    """Red if a knob whose default is None (``arrivals_csv: str | None``) refuses every
    string ("must be a NoneType"), takes a number as a float it then refuses, or an
    integer knob takes 1.5."""
    from fmoesim.cli.trace_cli import _parse_set
    from fmoesim.errors import ConfigError

    got = _parse_set(["arrivals_csv=a.csv", "arrival_rate_rps=2", "seed=3", "skew=1.5"])
    assert got == {"arrivals_csv": "a.csv", "arrival_rate_rps": 2.0, "seed": 3, "skew": 1.5}
    assert _parse_set(["arrival_rate_rps=null"]) == {"arrival_rate_rps": None}
    for item, rule in (("seed=1.5", "must be an integer"), ("skew=abc", "must be a number"),
                       ("seed=null", "must be an integer")):  # fmt: skip
        with pytest.raises(ConfigError, match=rule):
            _parse_set([item])


def test_a_runs_line_gives_late_share_ttft_and_tpot():
    """Red if a sweep's line per run hides the share of late accesses of a prefetching
    policy or its TTFT (comparing policies from the sweep's output alone would mislead),
    or prints a time for a hit-rate-only run."""
    from fmoesim.cli.main import format_line

    row = {"hit_rate": 0.25, "late_rate": 0.125, "ttft_mean_s": 1.5, "tpot_mean_s": 0.0421,
           "timing": True}  # fmt: skip
    assert format_line(row) == "hit rate 25.00% (late 12.50%), TTFT 1500.0 ms, TPOT 42.1 ms"
    row.update(late_rate=float("nan"), timing=False, ttft_mean_s=float("nan"))  # no access
    assert format_line(row) == "hit rate 25.00%, TPOT n/a (hit-rate-only)"


def test_a_budget_beyond_the_model_says_it_holds_every_expert(tmp_path):
    """Red if a budget larger than the model prints a count of experts the model does not
    have (1 GB of 6 MB experts: '166 experts' for a model of 8)."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    p = fmoesim(*tiny_overrides(trace, tmp_path / "out"), "cache.budget_gb=1", "output.write=false")
    assert p.returncode == 0, p.stderr
    assert "budget 1.00 GB (holds all 8 experts)" in p.stdout
    p = fmoesim(*tiny_overrides(trace, tmp_path / "out"), "output.write=false")
    assert "(2 experts)" in p.stdout  # within the model: the count
    # 3 GPUs: expert e of a layer on GPU e mod 3, so GPU 0 holds 2 of each layer's 4
    size_gb = TINY.expert_size_bytes / 1e9
    for n, said in ((3, "(3 experts) per GPU x 3 GPUs"), (4, "(holds all 4 experts of a GPU)")):
        p = fmoesim(*tiny_overrides(trace, tmp_path / "out"), "output.write=false",
                    "hardware.num_gpus=3", f"cache.budget_gb={n * size_gb}")  # fmt: skip
        assert p.returncode == 0 and said in p.stdout, p.stdout + p.stderr


def test_a_sweep_flag_after_overrides_still_sweeps(tmp_path):
    """Red if ``-m`` after an override is Hydra's usage block and 'unrecognized
    arguments' for overrides that are valid (its parser takes flags first)."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    over = [o for o in tiny_overrides(trace, tmp_path / "out") if not o.startswith("cache.")]
    p = fmoesim("policy=lru", "-m", "cache.budget_gb=0.012,0.018", *over, "output.write=false")
    assert p.returncode == 0, p.stderr
    assert "[sweep 2/2]" in p.stdout and "sweep done: 2 runs" in p.stdout


def test_help_lists_presets_and_not_the_typed_schemas():
    """``fmoesim --help`` lists each group's presets, and not the typed schemas the
    ConfigStore keeps beside them (``model_schema``, ``hardware_schema``,
    ``workload_schema``), which fmoesim refuses as presets.  Red if the help lists a
    schema, drops a real preset with it, or no longer exits 0 with the config."""
    p = fmoesim("--help")
    assert p.returncode == 0, p.stderr
    assert "_schema" not in p.stdout
    lines = {ln.partition(": ")[0]: ln.partition(": ")[2] for ln in p.stdout.splitlines()}
    assert "mixtral-8x7b, mixtral-8x7b-2bit, nllb-moe-54b" in lines["model"]
    assert lines["hardware"].startswith("a5000-pcie4, a6000-pcie4, fmoe-testbed")
    assert lines["workload"].endswith("synthetic, trace")
    assert "== Config ==" in p.stdout and "budget_gb: 24.0" in p.stdout
    rejected = fmoesim("model=model_schema")
    assert rejected.returncode == 2 and "model=model_schema: unknown model" in rejected.stderr


def test_without_schemas_leaves_other_lines_alone():
    """Only the lines of the groups section lose their ``*_schema`` entries; a config
    value ending in ``_schema`` after ``== Config ==`` stays.  Red if the filter reaches
    past its section."""
    from fmoesim.cli.main import without_schemas

    text = ("== Configuration groups ==\nCompose (group=option)\n\nmodel: a, model_schema, b\n"
            "workload: workload_schema\n== Config ==\nname: x_schema\n")  # fmt: skip
    assert without_schemas(text) == (
        "== Configuration groups ==\nCompose (group=option)\n\nmodel: a, b\nworkload: \n"
        "== Config ==\nname: x_schema\n"
    )


def test_a_sweep_line_reaches_stdout_in_one_write(monkeypatch):
    """The joblib launcher's workers share one stdout: each progress line and its newline
    go out in one write, so two workers' lines cannot run together.  Red if the line is
    written by ``print`` (the text and the newline apart: two writes on an unbuffered
    stdout)."""
    from fmoesim.cli import sweep

    class Writes:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def write(self, text: str) -> int:
            self.calls.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    out = Writes()
    monkeypatch.setattr(sys, "stdout", out)
    sweep._say("[sweep 1/4] policy=lru: hit rate 0.00%")
    assert out.calls == ["[sweep 1/4] policy=lru: hit rate 0.00%\n"]


@pytest.mark.parametrize(
    "module",
    ["fmoesim.cli.plot_cli", "fmoesim.cli.reproduce_cli", "fmoesim.cli.min_budget",
     "fmoesim.cli.collect_cli", "fmoesim.results.regress"],
)  # fmt: skip
def test_help_reads_without_rest_quotes(module, capsys) -> None:
    """Red if ``--help`` prints a docstring's reST literal quotes (````fmoesim-plot````:
    the papers' figures ...) to a terminal."""
    import importlib

    with pytest.raises(SystemExit) as info:
        importlib.import_module(module).main(["--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert "usage:" in out and "``" not in out
