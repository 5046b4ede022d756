"""Bad input to the results and validation commands (``fmoesim-plot``,
``fmoesim-reproduce``, ``fmoesim-regress``, ``fmoesim-min-budget``,
``fmoesim-validate-grid``): each is refused with one line on stderr naming the file or
option, the row where one applies, and the rule broken, exit status 2, and nothing
written.  Every case runs in-process and stops before any simulation."""

from __future__ import annotations

import csv
import io
import shutil
from collections.abc import Callable
from pathlib import Path

import pandas as pd
import pytest

from fmoesim.cli import min_budget, plot_cli, reproduce_cli
from fmoesim.errors import FmoesimError
from fmoesim.results import regress
from replay import campaign as C
from tests.test_cli import ROOT, ROUTES, tiny_overrides, write_sequence_trace


def refused(capsys: pytest.CaptureFixture[str], prog: str, fn: Callable[[], object]) -> str:
    """Run ``fn`` (a command's ``main``); assert exit status 2 and one line on stderr
    starting ``<prog>: error: ``; return that line."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        fn()
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"{prog}: error: "), lines[0]
    return lines[0]


# -- the results store: fmoesim-plot and fmoesim-reproduce -------------------------------
def _zero_bytes(store: Path) -> str:
    (store / "a.parquet").write_bytes(b"")
    return f"{store / 'a.parquet'}: not a readable Parquet file: Parquet file size is 0 bytes"


def _junk(store: Path) -> str:
    (store / "b.parquet").write_text("not parquet at all\n")
    return f"{store / 'b.parquet'}: not a readable Parquet file"


def _no_experiment(store: Path) -> str:
    pd.DataFrame([{"policy": "lru", "config_hash": "c"}]).to_parquet(store / "c.parquet")
    return f"{store / 'c.parquet'}: no column 'experiment'"


@pytest.fixture
def page(tmp_path: Path) -> Path:
    """A copy of the reproduction page (``--docs``)."""
    p = tmp_path / "page.md"
    shutil.copy(ROOT / "docs" / "reproduction.md", p)
    return p


def _plot(store: Path, out: Path, *extra: str) -> Callable[[], None]:
    return lambda: plot_cli.main(["fmoe-fig4", "--store", str(store), "--out", str(out), *extra])


def _reproduce(store: Path, out: Path, page: Path, *extra: str) -> Callable[[], None]:
    argv = ["fmoe", "--store", str(store), "--out", str(out), "--docs", str(page), *extra]
    return lambda: reproduce_cli.main(argv)


@pytest.mark.parametrize("make", [_zero_bytes, _junk, _no_experiment])
def test_a_store_file_that_is_not_a_runs_row_is_one_line(tmp_path, page, capsys, make):
    """A 0-byte, junk or column-less ``.parquet`` in the store: one line naming the file
    (red when pyarrow's ArrowInvalid or a KeyError on 'experiment' escapes)."""
    store = tmp_path / "store"
    store.mkdir()
    pd.DataFrame([{"experiment": "fmoe-fig4", "policy": "lru"}]).to_parquet(store / "ok.parquet")
    want = make(store)
    before = page.read_text()
    for prog, fn in (
        ("fmoesim-plot", _plot(store, tmp_path / "figs")),
        ("fmoesim-reproduce", _reproduce(store, tmp_path / "repro", page)),
    ):
        line = refused(capsys, prog, fn)
        assert want in line and "(rule: a results store holds" in line, line
    assert not (tmp_path / "figs").exists() and not (tmp_path / "repro").exists()
    assert page.read_text() == before


@pytest.mark.parametrize(
    ("where", "fragment"),
    [("missing", "no such folder (rule: the store read exists; "), ("file", "not a folder")],
)
def test_a_store_that_is_not_a_folder_is_one_line(tmp_path, page, capsys, where, fragment):
    """A ``--store`` that does not exist (without ``--run``) or is a file: one line naming
    it, nothing written, the ``--docs`` page unchanged (red when the scoreboard says "50
    not computed" and blanks the page, or the figure says "no runs" without the store)."""
    store = tmp_path / "store"
    if where == "file":
        store.write_text("x")
    before = page.read_text()
    for prog, fn in (
        ("fmoesim-plot", _plot(store, tmp_path / "figs")),
        ("fmoesim-reproduce", _reproduce(store, tmp_path / "repro", page)),
    ):
        assert f"--store {store}: {fragment}" in refused(capsys, prog, fn)
    if where == "file":  # --run makes a missing store, never one in place of a file
        for prog, fn in (
            ("fmoesim-plot", _plot(store, tmp_path / "figs", "--run")),
            ("fmoesim-reproduce", _reproduce(store, tmp_path / "repro", page, "--run")),
        ):
            assert f"--store {store}: not a folder" in refused(capsys, prog, fn)
    assert not (tmp_path / "figs").exists() and not (tmp_path / "repro").exists()
    assert page.read_text() == before


def test_a_store_without_the_runs_asked_for_is_named(tmp_path, page, capsys):
    """A store of other experiments' runs: the figure's error names the store, and the
    scoreboard refuses a store holding no run of the paper's presets rather than blanking
    the page (red when either says nothing of the store, or the page is rewritten)."""
    store = tmp_path / "store"
    store.mkdir()
    pd.DataFrame([{"experiment": "other", "policy": "lru"}]).to_parquet(store / "x.parquet")
    line = refused(capsys, "fmoesim-plot", _plot(store, tmp_path / "figs"))
    assert (
        f"figure fmoe-fig4: no runs of experiment fmoe-fig4 in the store (--store {store}" in line
    )
    before = page.read_text()
    line = refused(capsys, "fmoesim-reproduce", _reproduce(store, tmp_path / "repro", page))
    assert f"--store {store}: holds no run of fmoe's presets (fmoe-fig9" in line
    assert "run: fmoesim-reproduce fmoe --run" in line
    # runs of the presets, all from another code version: every row would score n.a.
    stale = {"experiment": "fmoe-fig9", "policy": "lru", "code_version": "000000000000"}
    pd.DataFrame([stale]).to_parquet(store / "y.parquet")
    line = refused(capsys, "fmoesim-reproduce", _reproduce(store, tmp_path / "repro", page))
    assert f"--store {store}: its runs of fmoe's presets are all from other code versions" in line
    assert page.read_text() == before
    assert not (tmp_path / "figs").exists() and not (tmp_path / "repro").exists()


# -- fmoesim-regress ------------------------------------------------------------------------
HEADER = "policy,budget_gb,hit_rate\n"


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"", "empty (rule: a CSV with columns policy, budget_gb and hit_rate"),
        (HEADER.encode() + b"lru,12,abc\n", "row 1: hit_rate 'abc' is not a number"),
        (HEADER.encode() + b"lru,x,0.5\n", "row 1: budget_gb 'x' is not a number"),
        (HEADER.encode() + b"lru,-3,0.5\n", "row 1: budget_gb must be a positive number"),
        (HEADER.encode() + b",12,0.5\n", "row 1: policy is empty"),
        (HEADER.encode() + b'"lru,12,0.5\n', "not a readable CSV: Error tokenizing data"),
        (b"\x89PNG\r\n\x1a\n\xff\xfe\x00\xd0\xd1", "not UTF-8 text"),
        (
            HEADER.encode() + b"lru,12,0.5\nlru,48,0.6\nlru,12.0,0.5\n",
            "row 3: policy lru at budget_gb 12 again (row 1 has it; rule: one row per "
            "policy and budget)",
        ),
    ],
    ids=["empty", "hit-abc", "budget-x", "budget-neg", "no-policy", "quote", "binary", "dup"],
)
def test_a_bad_golden_file_is_one_line_before_any_run(tmp_path, capsys, monkeypatch, content,
                                                      fragment):  # fmt: skip
    """Red when pandas' EmptyDataError, ParserError or UnicodeDecodeError, a TypeError or
    ValueError on a non-number escapes, or a duplicate row is accepted; the golden file
    is read before the hit rates are computed."""
    golden = tmp_path / "g.csv"
    golden.write_bytes(content)
    monkeypatch.setattr(regress, "compute_table", lambda *a, **k: pytest.fail("ran first"))
    for argv in ([], ["--update"]):  # --update of some policies keeps the others' rows
        line = refused(
            capsys,
            "fmoesim-regress",
            lambda: regress.main(["--policies", "lru", "--golden", str(golden), *argv]),  # noqa: B023
        )
        assert f"{golden}: {fragment}" in line, line
    assert golden.read_bytes() == content


def test_a_golden_path_that_is_a_folder_is_refused(tmp_path, capsys, monkeypatch):
    """Red if ``--update --golden <folder>`` is answered "golden file not found (--update
    makes it)", or an empty ``--golden`` names the working folder."""
    monkeypatch.setattr(regress, "compute_table", lambda *a, **k: pytest.fail("ran first"))
    for golden in (str(tmp_path), ""):
        line = refused(capsys, "fmoesim-regress",
                       lambda: regress.main(["--update", "--golden", golden]))  # noqa: B023  # fmt: skip
        assert line.endswith(f"--golden {golden!r}: a directory or no name (rule: a CSV file)")


@pytest.mark.parametrize("tol", ["nan", "-1", "inf"])
def test_a_tolerance_that_turns_the_guard_off_is_refused(tmp_path, capsys, tol):
    """``--tolerance-points nan`` passed every move (exit 0) and -1 failed every one
    (exit 1): both, and inf, are refused with exit 2."""
    golden = tmp_path / "g.csv"
    golden.write_text(HEADER + "lru,12,0.5\n")
    line = refused(
        capsys,
        "fmoesim-regress",
        lambda: regress.main(
            ["--policies", "lru", "--golden", str(golden), f"--tolerance-points={tol}"]
        ),  # fmt: skip
    )
    assert f"--tolerance-points {tol}: must be a finite number >= 0" in line


# -- fmoesim-min-budget ---------------------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "extra", "fragment"),
    [
        ("inf", (), "--target-tpot-ms inf: must be a finite number > 0"),
        ("nan", (), "--target-tpot-ms nan: must be a finite number > 0"),
        ("100", ("engine.timing=false",), "config key 'engine.timing' = False: "
         "fmoesim-min-budget searches by TPOT, which needs timed runs"),
        # ignored (the same answer as without it), or refused at the first run
        ("100", ("cache.experts_per_layer=1",), "config key 'cache.experts_per_layer' = 1: "
         "fmoesim-min-budget searches a global cache.budget_gb: drop it"),
        ("100", ("cache.preload=true",), "config key 'cache.preload' = True: "
         "fmoesim-min-budget searches a global cache.budget_gb: drop it"),
        # a sweep list got Hydra's "add --multirun" (a flag this command refuses); a
        # budget was taken and silently replaced by the search's
        ("100", ("policy=lru,lfu",), "policy=lru,lfu: fmoesim-min-budget searches one "
         "configuration (rule: one value per key; run it once per value)"),
        ("100", ("cache.budget_gb=12",), "cache.budget_gb=12: fmoesim-min-budget searches the "
         "budget (rule: leave it out)"),
    ],
)  # fmt: skip
def test_min_budget_refuses_an_infinite_target_and_untimed_runs(tmp_path, capsys, target,
                                                                extra, fragment):  # fmt: skip
    """Red when an infinite target is searched for, ``engine.timing=false`` runs timed all
    the same, a per-layer cache is ignored or a preload fails at the first run."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    over = [o for o in tiny_overrides(trace, tmp_path / "out") if not o.startswith("cache.")]
    line = refused(
        capsys,
        "fmoesim-min-budget",
        lambda: min_budget.main(["--target-tpot-ms", target, *over, *extra]),
    )
    assert fragment in line


# -- fmoesim-validate-grid: replay.csv files ------------------------------------------------
def _replay_csv(rows: int = 2) -> str:
    """A replay.csv of ``rows`` runs: the key, the overrides and the compared metrics."""
    metrics = [f"replay_{m[0]}" for m in C.METRICS]
    header = [*C.KEY, "repeat", *metrics, "overrides"]  # the replay's order: overrides last
    out = io.StringIO()
    w = csv.writer(out)
    w.writerow(header)
    for i, pol in enumerate(("lru", "fmoe")[:rows]):
        values = {"model": "olmoe-1b-7b", "budget_gb": 3.2, "mode": "batch1", "policy": pol,
                  "compute_repeat": 1,
                  "overrides": f"model=olmoe-1b-7b cache.budget_gb=3.2 policy={pol}",
                  "replay_ttft_mean_s": 0.05, "replay_tpot_mean_s": 0.01 + i,
                  "replay_stall_s": 0.0, "replay_pcie_bytes": 1e6, "replay_hit_rate": 0.5,
                  "replay_late_rate": 0.1, "replay_miss_rate": 0.4, "repeat": 0}  # fmt: skip
        w.writerow([values[c] for c in header])
    return out.getvalue()


def _set(column: str, value: str) -> Callable[[str], str]:
    """``text`` with the second row's ``column`` set to ``value``."""

    def edit(text: str) -> str:
        df = pd.read_csv(io.StringIO(text), dtype=str)
        df.loc[1, column] = value
        return df.to_csv(index=False)

    return edit


GOOD = _replay_csv()
BAD_REPLAYS = [
    ("empty", lambda t: "", ": empty (rule: a header and a row per replayed run)"),
    ("header-only", lambda t: t.splitlines(True)[0], ": no row (rule: a header and a row"),
    ("no-tpot", lambda t: pd.read_csv(io.StringIO(t)).drop(columns="replay_tpot_mean_s")
     .to_csv(index=False), ": column 'replay_tpot_mean_s' is missing (rule: a replay.csv "
     "has the columns model, budget_gb"),
    ("tpot-abc", _set("replay_tpot_mean_s", "abc"),
     " row 2: replay_tpot_mean_s = 'abc' (rule: a number)"),
    ("tpot-nan", _set("replay_tpot_mean_s", "nan"),
     " row 2: replay_tpot_mean_s = 'nan' (rule: a measured latency: a finite number > 0)"),
    ("tpot-neg", _set("replay_tpot_mean_s", "-1"),
     " row 2: replay_tpot_mean_s = '-1' (rule: a measured latency: a finite number > 0)"),
    ("hit-inf", _set("replay_hit_rate", "inf"),
     " row 2: replay_hit_rate = 'inf' (rule: a finite number >= 0)"),
    ("budget-x", _set("budget_gb", "x"), " row 2: budget_gb = 'x' (rule: a number)"),
    ("budget-0", _set("budget_gb", "0"), " row 2: budget_gb = '0' (rule: a number > 0)"),
    ("repeat-0", _set("compute_repeat", "0"),
     " row 2: compute_repeat = '0' (rule: an integer >= 1)"),
    ("no-policy", _set("policy", ""), " row 2: policy = '' (rule: not empty)"),
    ("cut-in-overrides", lambda t: t[: t.rindex("policy=fmoe") + 4],
     " row 2: no line break at its end (rule: every row ends with one"),
    ("cut-mid-row", lambda t: t[: t.index(",fmoe,") + 5] + "\n",
     " row 2: 4 fields, the header 14 (rule: a field per column"),
    ("open-quote", lambda t: t + '"olmoe,3.2\n',
     " line 4: not CSV: unexpected end of data"),
    # each of these was scored, exit 0: a 106% hit rate, lfu's label on lru's run, a run
    # counted as its own repeat, pandas' renamed second column, host costs left unscaled
    ("hit-1.5", _set("replay_hit_rate", "1.5"),
     " row 2: replay_hit_rate = '1.5' (rule: a share of the accesses, at most 1)"),
    ("policy-not-overrides", _set("policy", "lfu"),
     " row 2: policy = 'lfu' (rule: the policy= of the row's overrides)"),
    ("budget-not-overrides", _set("budget_gb", "6.4"),
     " row 2: budget_gb = '6.4' (rule: the cache.budget_gb= of the row's overrides)"),
    ("same-repeat-twice", lambda t: t + t.splitlines(True)[1],
     " row 3: run olmoe-1b-7b 3.2 batch1 lru 1 repeat 0 again (row 1 has it; rule: a "
     "repeat of a run once)"),
    ("column-twice", lambda t: t.replace("replay_stall_s", "replay_tpot_mean_s", 1),
     ": column 'replay_tpot_mean_s' twice in the header (rule: a column each)"),
    ("probe-0", _set("replay_probe_s", "0"),
     " row 2: replay_probe_s = '0' (rule: empty or a finite number > 0)"),
    ("host-negative", _set("replay_host_expert_calls", "-5"),
     " row 2: replay_host_expert_calls = '-5' (rule: empty or a finite number >= 0)"),
]  # fmt: skip
SUBCOMMANDS = {
    "score": ["--hardware", "h100-pcie5"],
    "events": ["--hardware", "h100-pcie5"],
    "cross-check": ["--base", "h100-pcie5", "--fit-model", "olmoe-1b-7b"],
    "host-fit": ["--base", "h100-pcie5", "--fit-model", "olmoe-1b-7b"],
}


@pytest.mark.parametrize(("case", "edit", "fragment"), BAD_REPLAYS, ids=[b[0] for b in BAD_REPLAYS])
def test_a_bad_replay_csv_is_one_line_naming_file_row_and_rule(tmp_path, capsys, case, edit,
                                                              fragment):  # fmt: skip
    """Each subcommand that reads replay.csv files: one line naming the file, the row
    (data rows counted from 1) and column, and the rule; nothing written.  Red when
    pandas' EmptyDataError, a KeyError, TypeError or ValueError escapes, a truncated row
    reaches Hydra's override parser, or a header-only file or a NaN or negative latency is
    scored (exit 0, a report of empty means)."""
    good = tmp_path / "good.csv"
    good.write_text(GOOD)
    assert len(C.read_replays([good])) == 2  # the base breaks no rule
    f = tmp_path / "replay.csv"
    f.write_text(edit(GOOD))
    for cmd, opts in SUBCOMMANDS.items():
        out = tmp_path / cmd / ("p.yaml" if cmd == "host-fit" else "")
        line = refused(capsys, C.PROG, lambda: C.main([cmd, str(f), *opts, "--out", str(out)]))  # noqa: B023
        assert f"{f}{fragment}" in line, (cmd, line)
        assert not (tmp_path / cmd).exists(), cmd


def test_a_binary_replay_csv_is_one_line(tmp_path, capsys):
    f = tmp_path / "replay.csv"
    f.write_bytes(b"\x89PNG\r\n\x1a\n\xff\xfe\x00\xd0\xd1")
    line = refused(capsys, C.PROG, lambda: C.main(["score", str(f), "--hardware", "h100-pcie5",
                                                   "--out", str(tmp_path / "o")]))  # fmt: skip
    assert f"{f}: not UTF-8 text" in line
    assert not (tmp_path / "o").exists()


def test_a_bad_override_in_a_replay_csv_names_its_run(tmp_path, capsys):
    """Red if an override the simulator refuses (a negative cache size) or a trace that
    does not fit the row's model is reported without the run whose cell holds it, as if
    the command line had given it."""
    f = tmp_path / "replay.csv"
    f.write_text(GOOD)  # its overrides name no workload: the bundled Mixtral trace
    line = refused(capsys, C.PROG, lambda: C.main(["score", str(f), "--hardware", "h100-pcie5",
                                                   "--out", str(tmp_path / "o")]))  # fmt: skip
    assert "the replayed run olmoe-1b-7b 3.2 batch1 lru 1: its configuration: config key " \
        "'model.num_layers' = 16: trace traces/default has num_layers = 32 (model " \
        "'mixtral-8x7b'); model=mixtral-8x7b matches it" in line  # fmt: skip
    f.write_text(GOOD.replace("model=olmoe-1b-7b cache", "model=olmoe-1b-7b workload=synthetic "
                              "cache").replace("policy=lru", "policy=lru "
                              "cache.experts_per_layer=-1"))  # fmt: skip
    line = refused(capsys, C.PROG, lambda: C.main(["score", str(f), "--hardware", "h100-pcie5",
                                                   "--out", str(tmp_path / "o")]))  # fmt: skip
    assert "the replayed run olmoe-1b-7b 3.2 batch1 lru 1: its configuration: config key " \
        "'cache.experts_per_layer' = -1" in line  # fmt: skip
    assert not (tmp_path / "o").exists()


# -- fmoesim-validate-grid replay -----------------------------------------------------------
REPLAY = ["replay", "--models", "olmoe-1b-7b", "--modes", "batch1", "--budgets", "3.2",
          "--no-crossover"]  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "fragment"),
    [
        (["--policies", "lru,nope"], "--policies nope: unknown policy; valid: adapmoe"),
        (["--hardware", "nope"], "--hardware nope: unknown hardware; valid: a5000-pcie4"),
        (["--deadline-s", "-5"], "--deadline-s -5: must be > 0"),
        (["--deadline-s", "nan"], "--deadline-s nan: must be > 0"),
        (["--repeats", "0"], "--repeats 0: must be >= 1"),
        (["--device", "tpu"], "--device tpu: must be 'cpu' or 'cuda[:N]'"),
        (["--device", "cuda"], "--device cuda: CUDA is not available here"),
        (["--models", ","], "--models ',': an empty item (rule: comma-separated names)"),
    ],
)
def test_replay_checks_its_arguments_before_any_run(tmp_path, capsys, monkeypatch, extra,
                                                    fragment):  # fmt: skip
    """Red when an unknown policy or hardware, a negative or NaN deadline, or a missing
    GPU leads to one "failed" line per run, exit 0, "replayed 0 runs -> replay.csv" and an
    empty output folder."""
    torch = pytest.importorskip("torch", reason="the replay needs torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(C, "replay_one", lambda *a, **k: pytest.fail("a run started"))
    argv = [*REPLAY, "--out", str(tmp_path / "o"), *extra]
    if "--models" in extra:
        argv.remove("--budgets")
        argv.remove("3.2")
    if "--device" not in extra:
        argv += ["--device", "cpu"]
    assert fragment in refused(capsys, C.PROG, lambda: C.main(argv))
    assert not (tmp_path / "o").exists()


def test_replay_whose_every_run_fails_exits_2_and_claims_no_file(tmp_path, capsys, monkeypatch):
    """Every run failing: one error line naming the first failure, exit 2, no output
    folder; a deadline that stops the grid before its first run says no file was written
    (red when it prints "replayed 0 runs -> .../replay.csv" and leaves an empty folder)."""
    pytest.importorskip("torch", reason="the replay needs torch")

    def fail(*a, **k):
        raise FmoesimError("boom\nsecond line")

    monkeypatch.setattr(C, "replay_one", fail)
    out = tmp_path / "o"
    argv = [*REPLAY, "--policies", "lru,lfu", "--device", "cpu", "--out", str(out)]
    line = refused(capsys, C.PROG, lambda: C.main(argv))
    assert line.endswith(
        f"every run tried failed (2), none added to {out / 'replay.csv'}; the first: "
        "olmoe-1b-7b 3.2 batch1 lru 1: FmoesimError: boom second line"
    )
    assert not out.exists()
    monkeypatch.setattr(C, "replay_one", lambda *a, **k: time_passes())
    C.main([*argv, "--deadline-s", "1e-9"])
    stdout = capsys.readouterr().out
    assert "deadline: 2 runs left" in stdout
    assert stdout.splitlines()[-1] == f"replayed 0 runs; {out / 'replay.csv'} not written"
    assert not out.exists()


def time_passes() -> dict[str, float]:
    """A warm-up that takes a little time (so the deadline has passed after it)."""
    import time

    time.sleep(0.01)
    return {}


def test_the_committed_gpu_recipes_pass_the_replay_checks(capsys, monkeypatch, tmp_path):
    """Every ``gpu_validation.sh`` command of the measured folders' READMEs reaches its
    replays with the options it names: the checks before any run must not refuse a
    recipe a GPU sitting depends on (red when a check refuses a documented flag or value,
    or the flags stop reaching run_replays)."""
    import re
    import shlex

    torch = pytest.importorskip("torch", reason="the replay needs torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    calls = []

    def fake(runs, device, out, deadline_s, **kw):
        calls.append((runs, device, deadline_s, kw))
        return 0

    monkeypatch.setattr(C, "run_replays", fake)
    root = Path(C.__file__).resolve().parents[1]
    recipes = [
        m.group(1)
        for readme in sorted((root / "results" / "validation").glob("*/README.md"))
        for m in re.finditer(r"gpu_validation\.sh \$OUT (\d+ .*)", readme.read_text())
        if "$" not in m.group(1)  # a recipe spelt with shell variables is left out
    ]
    assert len(recipes) >= 5
    for recipe in recipes:
        seconds, *flags = shlex.split(recipe.strip("`"))
        calls.clear()
        C.main(["replay", "--device", "cuda", "--out", str(tmp_path / "o"),
                "--deadline-s", seconds, *flags])  # fmt: skip
        ((runs, device, deadline_s, kw),) = calls
        assert device == "cuda" and deadline_s == float(seconds) and runs, recipe
        assert kw["host_timers"] == ("--host-timers" in flags), recipe
        assert kw["event_logs"] == ("--event-logs" in flags), recipe
        if "--policies" in flags:
            want = flags[flags.index("--policies") + 1].split(",")
            assert sorted({r.policy for r in runs}) == sorted(want), recipe
    capsys.readouterr()


def test_a_replay_csv_with_a_bom_reads_and_one_given_twice_is_refused(tmp_path):
    """Red if a spreadsheet's byte-order mark makes the first column 'missing', or the
    same file given twice counts each of its runs as two repeats of itself."""
    f = tmp_path / "replay.csv"
    f.write_bytes(b"\xef\xbb\xbf" + GOOD.encode())
    assert [r["policy"] for r in C.read_replays([f])] == ["lru", "fmoe"]
    with pytest.raises(FmoesimError, match=r"replay\.csv: given twice \(rule: each replay"):
        C.read_replays([f, tmp_path])


def test_the_gpu_script_stops_without_the_device_and_fails_when_a_step_fails(tmp_path):
    """Red if ``replay/gpu_validation.sh`` runs every step on a machine without the
    device (three failures, and an output folder of logs) or exits 0 after a step failed
    (here the profile and the replays refuse an unknown model), as it did: a GPU sitting
    then reads as a success."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch", reason="the replay needs torch")
    root = Path(C.__file__).resolve().parents[1]
    # the script runs python3: this interpreter's, as on a machine set up for the replay
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PYTHONPATH": str(root), "PATH": path}
    script = str(root / "replay" / "gpu_validation.sh")
    p = subprocess.run(["bash", script, str(tmp_path / "a"), "20"], cwd=root, env=env,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    if p.returncode != 2:  # a machine with CUDA: the first check passes
        pytest.skip("CUDA is available here")
    assert "--device cuda: CUDA is not available here" in p.stderr
    assert not (tmp_path / "a").exists()
    env.update(FMOESIM_DEVICE="cpu", PROFILE_MODELS="nosuch", SKIP_TESTS="1")
    p = subprocess.run(["bash", script, str(tmp_path / "b"), "20", "--models", "nosuch"],
                       cwd=root, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "failed: profile replays (run.log and pytest-gpu.log say why)" in p.stderr


def test_the_gpu_script_reads_its_seconds_or_its_flags(tmp_path):
    """``gpu_validation.sh OUT 5m`` (or ``08``, octal to bash) is refused in one line
    before anything runs, and ``gpu_validation.sh OUT --models m`` (the seconds left out)
    hands ``--models`` to the replays.  Red if the script takes ``--models`` for the
    seconds and drops it (bash then stops on an unbound variable), or starts the profile
    with a bad number of seconds."""
    import os
    import subprocess
    import sys

    pytest.importorskip("torch", reason="the replay needs torch")
    root = Path(C.__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "PYTHON": sys.executable,
           "FMOESIM_DEVICE": "cpu", "SKIP_PROFILE": "1", "SKIP_TESTS": "1"}  # fmt: skip
    script = str(root / "replay" / "gpu_validation.sh")
    for seconds in ("5m", "08", "0"):  # 08: bash reads a leading 0 as octal, and fails
        p = subprocess.run(["bash", script, str(tmp_path / "a"), seconds], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)  # fmt: skip
        assert p.returncode == 2 and p.stderr.startswith(
            f"gpu_validation.sh: error: SECONDS {seconds}: must be a positive whole number"
        ), p.stderr
        assert not (tmp_path / "a").exists()
    p = subprocess.run(["bash", script, str(tmp_path / "b"), "--models", "nosuch"], cwd=root,
                       env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "replays get 540 s" in p.stdout and "--models nosuch" in p.stdout, p.stdout


def test_a_device_is_cpu_or_an_existing_gpu(monkeypatch):
    """Red if ``--device cudafoo`` or ``cuda:x`` passes the check on a CUDA machine, or
    ``cuda:7`` on a machine of one GPU: each then fails inside torch, after the commands
    have started writing."""
    torch = pytest.importorskip("torch", reason="the replay needs torch")
    from replay.backend import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for bad in ("cudafoo", "cuda:x", "cuda:"):
        with pytest.raises(FmoesimError, match=f"--device {bad}: must be 'cpu' or 'cuda"):
            check_device(bad)
    with pytest.raises(FmoesimError, match=r"--device cuda:7: no such GPU \(rule: N < the 1 GPUs"):
        check_device("cuda:7")
    assert check_device("cuda:0") is torch and check_device("cuda") is torch


def test_host_fit_refuses_a_folder_for_its_profile(tmp_path, capsys):
    """Red if ``host-fit --out DIR`` fits and then fails with "Is a directory" and no
    rule, instead of one line naming --out before the fit."""
    (tmp_path / "plain").write_text("x")
    for out, want in ((tmp_path, f"--out {tmp_path}: is a folder (rule: a file to write)"),
                      (tmp_path / "plain" / "p.yaml",
                       f"--out {tmp_path / 'plain' / 'p.yaml'}: cannot be made: "
                       f"{tmp_path / 'plain'} is a file")):  # fmt: skip
        argv = ["host-fit", "--base", "measured/h100-3", "--fit-model", "olmoe-1b-7b",
                "--host-from", "measured/h100-3-host-speed", "--out", str(out)]  # fmt: skip
        assert refused(capsys, C.PROG, lambda argv=argv: C.main(argv)).endswith(want)


def test_an_out_that_cannot_be_written_is_refused_before_the_runs(tmp_path, capsys):
    """``fmoesim-plot --run``, ``fmoesim-plot crossover`` and ``fmoesim-validate-grid
    replay`` refuse an ``--out`` under a plain file before their sweeps, grid or warm-up.
    Red if the runs go first and the command then fails writing (minutes of simulation,
    or of a GPU, lost)."""
    from fmoesim.cli import plot_cli

    plain = tmp_path / "plain"
    plain.write_text("x")
    out = plain / "figs"
    want = f"--out {out}: cannot be made: {plain} is a file"
    for prog, argv in (
        ("fmoesim-plot", ["fmoe-fig4", "--run", "--store", str(tmp_path / "s"), "--out", str(out)]),
        ("fmoesim-plot", ["crossover", "--requests", "1", "--out", str(out)]),
    ):
        assert want in refused(capsys, prog, lambda argv=argv: plot_cli.main(argv))
    assert not (tmp_path / "s").exists()
    pytest.importorskip("torch", reason="the replay needs torch")
    argv = [*REPLAY, "--policies", "lru", "--device", "cpu", "--out", str(out)]
    assert want in refused(capsys, C.PROG, lambda: C.main(argv))
