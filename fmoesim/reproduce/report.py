"""The scoreboard as files: ``<paper>.csv`` and ``<paper>.md`` (one row per claim), the
directory's ``README.md`` index, and the table inside ``docs/reproduction.md`` between
the markers ``<!-- scoreboard:<paper> -->`` and ``<!-- /scoreboard:<paper> -->``.
Every file is written atomically."""

from __future__ import annotations

import csv
import io
import math
import re
from collections.abc import Sequence
from pathlib import Path

from fmoesim.atomic import atomic_file
from fmoesim.errors import FmoesimError, counted
from fmoesim.reproduce.claims import Claim
from fmoesim.reproduce.score import YES, Score

#: the CSV's columns, in order
COLUMNS = (
    "paper", "id", "where", "claim", "quote", "setting", "paper_value", "paper_unit",
    "fmoesim_value", "fmoesim_unit", "holds", "ratio", "resident_value", "preset", "metric",
    "detail", "note",
)  # fmt: skip


def _num(v: float | None, digits: int) -> str:
    return "" if v is None else f"{v:.{digits}f}"


def csv_rows(scores: Sequence[Score]) -> list[dict[str, str]]:
    """The scoreboard's rows as strings, keyed by :data:`COLUMNS`."""
    out = []
    for s in scores:
        c = s.claim
        out.append(
            {
                "paper": c.paper,
                "id": c.id,
                "where": c.where,
                "claim": c.claim,
                "quote": c.quote,
                "setting": c.setting,
                "paper_value": "" if c.paper_value is None else f"{c.paper_value:g}",
                "paper_unit": c.unit if c.paper_value is not None else "",
                "fmoesim_value": _num(s.fmoesim_value, 2),
                "fmoesim_unit": s.unit if s.fmoesim_value is not None else "",
                "holds": s.holds,
                "ratio": _num(s.ratio, 2),
                "resident_value": _num(s.resident, 2),
                "preset": _preset(c),
                "metric": (c.metric or "") if c.kind == "model" else ",".join(c.metrics),
                "detail": s.detail,
                "note": c.note,
            }
        )
    return out


def to_csv(scores: Sequence[Score]) -> str:
    """The scoreboard as CSV text (a header of :data:`COLUMNS`, a row per claim)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(csv_rows(scores))
    return buf.getvalue()


def read_csv(path: Path) -> list[dict[str, str]]:
    """A scoreboard CSV's rows (:func:`to_csv`)."""
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def _paper_cell(s: Score) -> str:
    v = s.claim.paper_value
    if v is None:
        return "direction only"
    return f"{v:+g}%" if s.claim.unit == "% change" else f"{v:g} {s.claim.unit}"


def _fmoesim_cell(s: Score) -> str:
    if s.fmoesim_value is None:
        return f"— ({s.detail})" if s.detail else "—"
    if s.unit == "% of points":
        return f"{s.fmoesim_value:.0f}% of points"
    if math.isinf(s.fmoesim_value):  # side B is 0: the detail gives A
        return f"{'+' if s.fmoesim_value > 0 else '-'}inf ({s.detail})"
    if s.unit != "% change":  # a bound, in the paper's unit: 4 significant digits
        return f"{s.fmoesim_value:.4g} {s.unit}"
    if s.resident is not None:
        return f"{s.fmoesim_value:+.1f}% (every expert resident: {s.resident:+.1f}%)"
    return f"{s.fmoesim_value:+.1f}%"


def summary_line(scores: Sequence[Score]) -> str:
    """How many claims hold, do not, and have no fmoesim number."""
    n = len(scores)
    yes = sum(s.holds == YES for s in scores)
    na = sum(s.fmoesim_value is None for s in scores)
    return (
        f"{counted(n, 'claim')}: the direction holds for {yes}, not for {n - yes - na}; "
        f"{na} not computed"
    )


def to_markdown(scores: Sequence[Score]) -> str:
    """The scoreboard as a Markdown table: where, claim, the paper's number, fmoesim's,
    whether the direction holds, the magnitude ratio and the preset."""
    lines = [
        "| where | claim | paper | fmoesim | holds | ratio | preset |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in scores:
        cells = [
            s.claim.where,
            s.claim.claim,
            _paper_cell(s),
            _fmoesim_cell(s),
            s.holds,
            _num(s.ratio, 2) or "—",
            _preset_cell(s),
        ]
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    return "\n".join(lines)


def _preset(c: Claim) -> str:
    """What computes a claim: its experiment preset, or a model claim's model preset
    (``model=<name>``); empty for neither."""
    return c.experiment or (f"model={c.model}" if c.model else "")


def _preset_cell(s: Score) -> str:
    """The scoreboard's preset column (:func:`_preset`), as code; a dash for none."""
    preset = _preset(s.claim)
    return f"`{preset}`" if preset else "—"


def page(paper: str, scores: Sequence[Score]) -> str:
    """``<paper>.md``: a title, the summary line, how the numbers are formed, the table."""
    name = scores[0].claim.paper if scores else paper
    return "\n".join(
        [
            f"# {name}: reproduction scoreboard",
            "",
            summary_line(scores) + ".",
            "",
            "fmoesim's number is the relative change of A against B in percent (the",
            "paper's unit); 'holds' says whether it has the paper's sign; 'ratio' is",
            "fmoesim's change over the paper's. 'Every expert resident' (latency claims",
            "with a floor preset) is the change A would show with no expert ever loaded:",
            "the most any policy could show on that testbed.",
            f"Regenerate: `fmoesim-reproduce {paper} --run`.",
            "",
            to_markdown(scores),
            "",
        ]
    )


def write_scoreboard(paper: str, scores: Sequence[Score], out_dir: Path) -> list[Path]:
    """Write ``<out_dir>/<paper>.csv`` and ``<paper>.md``, and refresh
    ``<out_dir>/README.md`` (a line per paper's page there); return the paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in ((f"{paper}.csv", to_csv(scores)), (f"{paper}.md", page(paper, scores))):
        path = out_dir / name
        with atomic_file(path) as tmp:
            tmp.write_text(text)
        paths.append(path)
    index = ["# Reproduction scoreboards", ""]
    for md in sorted(out_dir.glob("*.md")):
        if md.name == "README.md":
            continue
        lines = md.read_text().splitlines()
        title = lines[0].lstrip("# ") if lines else md.stem
        count = lines[2] if len(lines) > 2 else ""
        index.append(f"- [{title}]({md.name}) ([CSV]({md.stem}.csv)): {count}")
    readme = out_dir / "README.md"
    with atomic_file(readme) as tmp:
        tmp.write_text("\n".join([*index, ""]))
    paths.append(readme)
    return paths


#: a claim's size counts as the paper's where fmoesim's change over the paper's lies in
#: this band (the reproduction's target)
BAND = (0.7, 1.3)
#: the name of the overview's block in the docs page (:func:`update_overview`)
OVERVIEW = "overview"


def overview(tables: dict[str, list[dict[str, str]]]) -> str:
    """The scoreboards at a glance, one row per paper from its CSV rows (:func:`read_csv`):
    its claims, how many hold in direction, do not, and have no fmoesim number, and of
    the claims with a ratio (the paper gives a number), how many lie within :data:`BAND`
    of the paper's size (the ratio of the two numbers as the CSV gives them, to two
    decimals each)."""
    lo, hi = BAND
    lines = [
        "| paper | claims | the direction holds | does not | not computed | "
        f"the size within {lo:g}-{hi:g}x of the paper's |",
        "|---|---|---|---|---|---|",
    ]
    for rows in tables.values():
        n = len(rows)
        yes = sum(r["holds"] == YES for r in rows)
        na = sum(r["fmoesim_value"] == "" for r in rows)
        # from the two numbers, not the ratio column's two decimals (1.302 prints 1.30)
        ratios = [
            float(r["fmoesim_value"]) / float(r["paper_value"]) for r in rows if r["ratio"] != ""
        ]
        band = sum(lo <= x <= hi for x in ratios)
        name = rows[0]["paper"] if rows else "?"
        lines.append(f"| {name} | {n} | {yes} | {n - yes - na} | {na} | {band} of {len(ratios)} |")
    return "\n".join(lines)


def update_overview(page_path: Path, out_dir: Path, papers: Sequence[str]) -> Path:
    """Write :func:`overview` of the scoreboards in ``out_dir`` (``<paper>.csv`` for each
    of ``papers`` there) into ``page_path`` between the overview's markers; return it."""
    tables = {p: read_csv(out_dir / f"{p}.csv") for p in papers if (out_dir / f"{p}.csv").is_file()}
    new = insert_table(page_path.read_text(), OVERVIEW, overview(tables))
    with atomic_file(page_path) as tmp:
        tmp.write_text(new)
    return page_path


def markers(paper: str) -> tuple[str, str]:
    """The docs page's opening and closing markers of ``paper``'s table."""
    return f"<!-- scoreboard:{paper} -->", f"<!-- /scoreboard:{paper} -->"


def insert_table(text: str, paper: str, table: str) -> str:
    """``text`` with whatever stands between ``paper``'s markers replaced by ``table``;
    the rest of the text is unchanged.  Missing or repeated markers are refused."""
    start, end = markers(paper)
    if text.count(start) != 1 or text.count(end) != 1 or text.index(start) > text.index(end):
        raise FmoesimError(f"the page needs one '{start}' and, after it, one '{end}'")
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    return pattern.sub(lambda _: f"{start}\n{table}\n{end}", text, count=1)


def update_docs(page_path: Path, paper: str, scores: Sequence[Score]) -> Path:
    """Write ``paper``'s summary line and table into ``page_path`` between its markers
    (:func:`insert_table`); return the path."""
    if not page_path.is_file():
        raise FmoesimError(f"{page_path}: no such page")
    block = summary_line(scores) + ".\n\n" + to_markdown(scores)
    new = insert_table(page_path.read_text(), paper, block)
    with atomic_file(page_path) as tmp:
        tmp.write_text(new)
    return page_path
