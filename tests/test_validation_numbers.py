"""How the validation reports write their numbers (:mod:`fmoesim.validation.numbers`):
units by magnitude, significant figures, an error that stays defined where the replay's
value is zero or negligible; and ``fmoesim-validate-grid render``, which writes a
report anew from its validation.csv, as every committed report under
results/validation/ is written."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pandas as pd
import pytest

from fmoesim.validation import numbers as N
from replay import campaign as C
from replay import events as E
from replay import validate as V

ROOT = Path(__file__).resolve().parents[1]
#: the committed reports that ``render`` writes: a report.md beside its validation.csv
REPORTS = sorted(p.parent for p in (ROOT / "results" / "validation").glob("*/validation.csv"))


def test_quantities_keep_three_significant_figures_in_a_unit_by_their_size():
    """Red if a quantity is written with a fixed unit and two decimals (a 274 us stall
    as ``0.00 s``), if rounding up skips the next unit (0.9996 s as ``1000 ms``), if an
    exact zero gets spurious digits, or if a float's rounding residue (5.6e-17) is
    written as a number."""
    cases = [
        (0.0012, "s", "1.20 ms"), (0.0010, "s", "1.00 ms"), (0.15, "s", "150 ms"),
        (274e-6, "s", "274 us"), (544e-9, "s", "544 ns"), (1.348, "s", "1.35 s"),
        (0.9996, "s", "1.00 s"), (1234.4, "s", "1234 s"), (0.0, "s", "0 s"),
        (5.6e-17, "s", "0 s"), (math.nan, "s", "n/a"),
        (91.74e9, "bytes", "91.7 GB"), (1.60943e12, "bytes", "1.61 TB"),
        (512.0, "bytes", "512 B"), (0.0, "bytes", "0 B"),
        (0.6221, "share", "62.21%"), (0.0052, "share", "0.52%"), (0.000052, "share", "0.0052%"),
        (0.999996, "share", "99.99960%"), (0.0, "share", "0%"), (1.0, "share", "100%"),
        (1 - 5.6e-17, "share", "100%"),
    ]  # fmt: skip
    for v, kind, want in cases:
        assert N.quantity(v, kind) == want, (v, kind)
    assert N.sig(9.996) == "10.0" and N.sig(0.09996) == "0.100" and N.sig(-0.5) == "-0.500"


def test_a_small_stall_shows_distinct_numbers_and_its_relative_error():
    """A stall of 1.2 ms simulated against 1.0 ms replayed (0.2% of a 0.5 s run: not
    negligible) reads ``1.20 ms / 1.00 ms (+20.0%)`` in both reports.  Red if the stall
    is written in seconds with two decimals (``0.00 s / 0.00 s``) or its error is lost."""
    assert N.error(0.0012, 0.0010, "s") == "+20.0%"
    row = _row("lru", stall=(0.0012, 0.0010), wall=0.5)
    cells = dict(zip(("TTFT", "TPOT", "stall", "hit"), _validate_cells(row), strict=True))
    assert cells["stall"] == ["1.20 ms", "1.00 ms", "+20.0%"]
    assert cells["TPOT"] == ["38.0 ms", "40.0 ms", "-5.0%"]
    assert "| 1.20 ms / 1.00 ms (+20.0%) |" in _every_run([row])


def test_a_zero_replayed_stall_gives_the_difference_not_minus_100_or_inf():
    """The replay measured no stall: the error is the difference, ``0 s`` where the
    simulator has none either, ``+1.50 ms`` where it has some.  Red if it reads
    ``-100.0%``, ``inf``, ``nan``, or ``n/a`` where the simulator's stall is known."""
    for sim, want in ((0.0, "0 s"), (0.0015, "+1.50 ms")):
        assert N.error(sim, 0.0, "s") == want
        row = _row("lru", stall=(sim, 0.0))
        assert _validate_cells(row)[2][2] == want
        assert f"({want}) |" in _every_run([row])
    assert N.error(3e9, 0.0, "bytes") == "+3.00 GB"  # no PCIe traffic replayed
    text = _every_run([_row("lru", stall=(0.0, 0.0)), _row("lfu", stall=(0.0015, 0.0))])
    assert "-100" not in text and "inf" not in text and "nan" not in text


def test_a_negligible_replayed_stall_gives_the_difference():
    """A replayed stall of at most 0.1% of the replay's wall time says nothing as a
    denominator: 150 ms simulated against 0.3 ms replayed in a 5 s run is ``+150 ms``
    (not +49900%), none simulated against 1.62 ms in 4.95 s is ``-1.62 ms`` (not
    -100%); a replayed 10 ms of 5 s (0.2%) keeps its relative error.  Red if the
    threshold is ignored, or applied to a metric other than the stall."""
    assert _validate_cells(_row("a", stall=(0.15, 0.0003), wall=5.0))[2][2] == "+150 ms"
    assert _validate_cells(_row("b", stall=(0.0, 0.00162), wall=4.95))[2][2] == "-1.62 ms"
    assert _validate_cells(_row("c", stall=(0.0, 0.010), wall=5.0))[2][2] == "-100.0%"
    assert N.negligible_below("stall_s", {"replay_wall_s": 5.0}) == pytest.approx(0.005)
    assert N.negligible_below("tpot_mean_s", {"replay_wall_s": 5.0}) == 0.0
    assert N.negligible_below("stall_s", {}) == 0.0  # no wall time: only a zero is
    assert N.error(0.0, 1e-6, "s") == "-100.0%"


def test_rare_late_accesses_and_equal_rates_are_written_as_they_are():
    """One late access in 19,291 (0.0052%) against none reads ``0.0052% / 0%
    (+0.0052 pt)``; equal rates read ``0 pt``, and so does a difference of a float's
    rounding (5.6e-17), not ``+0.0000000000000056 pt``.  Red if a rare late access is
    written ``0.00%`` or its difference ``+0.00 pt``."""
    late = 1 / 19291
    assert N.pair({"sim_late_rate": late, "replay_late_rate": 0.0}, "late_rate", "share") == (
        "0.0052%", "0%", "+0.0052 pt",
    )  # fmt: skip
    assert N.points(0.0) == "0 pt" and N.points(5.6e-17) == "0 pt"
    assert N.points(-0.2723) == "-27.23 pt" and N.points(0.0007, signed=False) == "0.070 pt"
    # the event-log comparison writes the outcomes' shares the same way
    share_of = {key: fmt for key, _, _, fmt in E.TABLE_ROWS}
    assert E._fmt(late, 1.0, share_of["late"]) == "0.0052%"
    assert E._fmt(math.nan, 1.0, share_of["late"]) == "n/a"


def test_render_writes_the_report_anew_from_its_csv(tmp_path):
    """``render`` gives what ``score`` / ``cross-check`` write for the same rows: the
    header lines and a cross-check's host costs of each fit (which the CSV does not hold)
    kept, each profile's rows apart, the CSV itself untouched.  Red if render loses the
    header, the fits, a profile, or rewrites the CSV's raw numbers."""
    rows = [_row(p, stall=(0.0012 * i, 0.0010), wall=0.5) for i, p in enumerate(("a", "b"), 1)]
    meta = {"device": "GPU X", "hardware profile": "p1, p2", "scored": "2026-01-02"}
    fits = C.fits_markdown({"a": {"host_layer_s": 3e-6}, "b": {"host_layer_s": 4e-6}})
    # one profile, with a cross-check's fits
    one = tmp_path / "one"
    want = _write_report(one, {"p1": rows}, meta, fits)
    (one / "report.md").write_text(want.replace("1.20 ms", "0.00 s"))  # a stale report
    csv_before = (one / "validation.csv").read_bytes()
    C.main(["render", str(one)])
    assert (one / "report.md").read_text() == want
    assert (one / "validation.csv").read_bytes() == csv_before
    # two profiles: the report of each in turn, as score writes it
    slower = [{**r, "sim_tpot_mean_s": 0.044, "err_tpot_mean_s": 0.1} for r in rows]
    two = tmp_path / "two"
    want = _write_report(two, {"p1": rows, "p2": slower}, meta, "")
    (two / "report.md").write_text(want.split("## Targets")[0])
    C.render(two)
    assert (two / "report.md").read_text() == want
    assert "| 40.0 ms | 38.0 ms (-5.0%, hit 0 pt) | 44.0 ms (+10.0%, hit 0 pt) |" in want


def test_render_refuses_what_is_not_a_report(tmp_path, capsys):
    """Red if a folder without a validation.csv or report.md, or a report.md of another
    kind, gives a traceback instead of one line and exit status 2."""
    (tmp_path / "empty").mkdir()
    other = tmp_path / "other"
    _write_report(other, {"p": [_row("a")]}, {"device": "d"}, "")
    (other / "report.md").write_text("# Event logs\n")
    for folder, why in ((tmp_path / "empty", "no report.md"), (other, "first line")):
        with pytest.raises(SystemExit) as exc:
            C.main(["render", str(folder)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def test_render_names_a_hand_edited_or_cut_row(tmp_path, capsys):
    """Red if a validation.csv with a number edited into text, or cut inside a row,
    gives pandas' traceback (or a misleading "column is missing") instead of one line
    naming the file, the row and the rule, with the report left as it was."""
    edited, cut = tmp_path / "edited", tmp_path / "cut"
    for folder in (edited, cut):
        report = _write_report(folder, {"p": [_row("a"), _row("b")]}, {"device": "d"}, "")
        (folder / "report.md").write_text(report)
    text = (cut / "validation.csv").read_text()
    df = pd.read_csv(edited / "validation.csv")
    df["sim_tpot_mean_s"] = df["sim_tpot_mean_s"].astype(object)
    df.loc[1, "sim_tpot_mean_s"] = "abc"
    df.to_csv(edited / "validation.csv", index=False)
    (cut / "validation.csv").write_text(text[: len(text) - 7])
    for folder, why in (
        (edited, "validation.csv: row 2: sim_tpot_mean_s = 'abc' (rule: a number)"),
        (cut, "validation.csv: ends inside a row, cut short"),
    ):
        before = (folder / "report.md").read_bytes()
        with pytest.raises(SystemExit) as exc:
            C.main(["render", str(folder)])
        assert exc.value.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err
        assert (folder / "report.md").read_bytes() == before


@pytest.mark.parametrize("report", REPORTS, ids=lambda p: p.name)
def test_the_committed_reports_are_written_as_render_writes_them(report, tmp_path):
    """Every committed report under results/validation/ with a validation.csv is what
    ``render`` writes from it today.  Red if one still shows the old fixed two-decimal
    cells (a stall of ``0.00 s / 0.00 s (-100.0%)``), i.e. was not written anew after a
    change of the report's presentation."""
    copy = tmp_path / report.name
    shutil.copytree(report, copy)
    C.render(copy)
    assert (copy / "report.md").read_text() == (report / "report.md").read_text()
    assert "0.00 s /" not in (report / "report.md").read_text()


# -- helpers ---------------------------------------------------------------------------


def _row(
    policy: str, stall: tuple[float, float] = (0.0, 0.0), wall: float = 1.0
) -> dict[str, object]:
    """A scored row (:func:`replay.campaign.score_rows`'s keys) of one run: TPOT 38 ms
    simulated against 40 ms replayed, TTFT 0.2 s both, equal hit rates, the given
    stall (simulated, replayed) and replay wall time."""
    r: dict[str, object] = {
        "model": "m", "budget_gb": 1.0, "mode": "batch1", "policy": policy,
        "compute_repeat": 1, "replay_layer_steps": 100, "replay_wall_s": wall,
        "replay_gpu_busy_s": 0.5 * wall, "replay_policy_host_s": 0.01, "sim_gpu_busy_s": 0.4,
    }  # fmt: skip
    values = {"ttft_mean_s": (0.2, 0.2), "tpot_mean_s": (0.038, 0.040), "stall_s": stall,
              "pcie_bytes": (2e9, 2e9), "hit_rate": (0.6, 0.6), "late_rate": (0.0, 0.0),
              "miss_rate": (0.4, 0.4)}  # fmt: skip
    for key, _, kind in C.METRICS:
        s, g = values[key]
        r[f"sim_{key}"], r[f"replay_{key}"] = s, g
        r[f"err_{key}"] = s - g if kind == "share" else V.rel_err(s, g)
    return r


def _validate_cells(row: dict[str, object]) -> list[list[str]]:
    """``fmoesim-validate``'s report row of ``row``: per metric, [sim, replay, err]."""
    text = V.report_markdown([row], {"device_name": "d", "date": "t", "device": "cuda"})
    line = next(x for x in text.splitlines() if x.startswith(f"| {row['policy']} |"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    return [cells[i : i + 3] for i in range(0, len(cells), 3)]


def _every_run(rows: list[dict[str, object]]) -> str:
    """The "Every run" section of ``fmoesim-validate-grid``'s report of ``rows``."""
    text = C.report_markdown(rows, {"device": "d"})
    return text.split("## Every run")[1].split("## Where")[0]


def _write_report(
    out: Path, by_profile: dict[str, list[dict[str, object]]], meta: dict[str, str], fits: str
) -> str:
    """Write ``out/validation.csv`` as score does and return the report.md it writes
    (with ``fits`` after it, as cross-check's); report.md itself is left unwritten."""
    out.mkdir()
    frames = [pd.DataFrame(rs).assign(hardware=hw) for hw, rs in by_profile.items()]
    pd.concat(frames, ignore_index=True).to_csv(out / "validation.csv", index=False)
    last = list(by_profile.values())[-1]
    text = C.report_markdown(last, meta, by_profile if len(by_profile) > 1 else None)
    return text + ("\n" + fits if fits else "")
