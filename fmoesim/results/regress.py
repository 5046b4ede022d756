"""``fmoesim-regress``: the hit-rate regression guard.

``results/golden/hit_rates.csv`` holds the hit rate of every policy preset on the
bundled trace at fixed budgets, in hit-rate-only mode (no clock: the numbers depend on
the policies' decisions only, so they are exact and fast to recompute).  The test suite
(``tests/test_regress.py``) recomputes the table and fails when any hit rate moved by
more than :data:`TOLERANCE_POINTS`, unless the golden file changed in the same commit
(``fmoesim-regress --update`` rewrites it; commit it with the change that moved it).

Usage in any CI::

    fmoesim-regress                      # exit 1 and an old/new table when something moved
    fmoesim-regress --update             # accept the new numbers
    fmoesim-regress --update --policies promoe   # ... of one policy, keeping the other rows
    fmoesim-regress --policies lru,lfu --golden my/golden.csv
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fmoesim.config.schema import PROJECT_ROOT as ROOT
from fmoesim.errors import ArgumentParser, FmoesimError, counted, names_of, run_or_exit

PROG = "fmoesim-regress"
GOLDEN = ROOT / "results" / "golden" / "hit_rates.csv"
#: largest accepted move of a hit rate, in percentage points.  The runs are
#: deterministic, so on one platform nothing moves at all; the slack covers tie-breaking
#: differences across numpy versions (one access of the 16,384 is 0.006 points).
TOLERANCE_POINTS = 0.1
BUDGETS_GB = (12.0, 48.0)  # Mixtral-8x7B: 34 and 136 of its 256 experts
MAX_REQUESTS = 4  # the first 4 requests of traces/default (260 iterations)
TRACE = "traces/default"


def compute_table(
    policies: list[str] | None = None,
    budgets_gb: tuple[float, ...] = BUDGETS_GB,
    max_requests: int = MAX_REQUESTS,
    trace: str = TRACE,
) -> Any:
    """Hit rates of ``policies`` (default: every preset) at each budget, with the default
    model and hardware of ``conf/config.yaml``, hit-rate-only mode, seed 0."""
    import pandas as pd
    from hydra.utils import instantiate

    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run, preset_names, simulate_spec
    from fmoesim.engine.simulate import GB
    from fmoesim.trace.reader import read_trace

    names = policies or preset_names("policy")
    tr = read_trace(ROOT / trace if not Path(trace).is_absolute() else trace)
    rows = []
    for name in names:
        cfg = compose_config(
            [f"policy={name}", f"serving.max_requests={max_requests}", "engine.timing=false"]
        )
        spec = build_run(cfg)
        for gb in budgets_gb:
            r = simulate_spec(
                spec,
                tr,
                policy=instantiate(cfg.policy),  # a fresh policy object per run
                budget_bytes=int(gb * GB),
                timing=False,
                access_log=False,
                progress=False,
            ).summary
            rows.append(
                {
                    "policy": name,
                    "budget_gb": gb,
                    "model": spec.model.name,
                    "trace": trace,
                    "requests": max_requests,
                    "accesses": int(r["accesses"]),
                    "hit_rate": round(float(r["hit_rate"]), 6),
                }
            )
    return pd.DataFrame(rows)


#: the columns that say what a golden hit rate was measured on (optional in the file)
SETTING = ("model", "trace", "requests", "accesses")


def _canon(v: Any) -> str:
    """A setting's cell as text: a whole number without its ``.0``, a missing cell ``""``."""
    if v is None or (isinstance(v, float) and v != v):
        return ""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    return str(int(f)) if f.is_integer() else repr(f)


def compare(old: Any, new: Any, tolerance_points: float = TOLERANCE_POINTS) -> Any:
    """Old and new hit rates side by side: ``status`` is ``ok``, ``MOVED`` (beyond the
    tolerance), ``SETTING`` (the golden row names another model, trace, number of
    requests or of accesses: its hit rate measured something else; an empty cell is not
    compared), ``NEW`` (not in the golden file) or ``GONE`` (no longer computed)."""
    keys = ["policy", "budget_gb"]
    setting = [c for c in SETTING if c in old.columns and c in new.columns]
    # as canonical text before the merge: a missing cell (a row on one side only, a
    # golden row without them) makes a column float, and 4 would then read 4.0
    m = old[[*keys, "hit_rate"]].assign(**{c: old[c].map(_canon) for c in setting}).merge(
        new[[*keys, "hit_rate"]].assign(**{c: new[c].map(_canon) for c in setting}),
        on=keys, how="outer", suffixes=("_old", "_new"),
    )  # fmt: skip
    m["delta_points"] = 100 * (m["hit_rate_new"] - m["hit_rate_old"])
    status, changed = [], []
    for _, r in m.iterrows():
        moved = [c for c in setting if r[f"{c}_old"] not in ("", r[f"{c}_new"])]  # "": none
        if r["hit_rate_old"] != r["hit_rate_old"]:  # NaN
            status.append("NEW")
        elif r["hit_rate_new"] != r["hit_rate_new"]:
            status.append("GONE")
        elif moved:
            status.append("SETTING")
        elif abs(r["delta_points"]) > tolerance_points:
            status.append("MOVED")
        else:
            status.append("ok")
        shown = [f"{c} {r[f'{c}_old']} -> {r[f'{c}_new']}" for c in moved]
        changed.append(", ".join(shown) if status[-1] == "SETTING" else "")
    m["status"] = status
    m["changed"] = changed  # what a SETTING row measured differently
    return m.sort_values(keys).reset_index(drop=True)


def failure_summary(m: Any, tolerance_points: float) -> str:
    """What a comparison that fails found, for a CI reader: how many rows of each
    status, and the largest move."""
    counts = m.status.value_counts()
    parts = [f"{counts[s]} {s}" for s in ("MOVED", "SETTING", "NEW", "GONE") if s in counts]
    moved = m[m.status == "MOVED"]
    if len(moved):
        r = moved.loc[moved.delta_points.abs().idxmax()]
        parts[0] += (
            f" beyond {tolerance_points:g} points (largest {r.delta_points:+.3f}: {r.policy} "
            f"at {r.budget_gb:g} GB)"
        )
    failing = int(counts.drop("ok", errors="ignore").sum())
    return f"{failing} of {len(m)} rows differ from the golden file: " + ", ".join(parts)


def format_table(m: Any) -> str:
    """The comparison as a Markdown table."""
    lines = [
        "| policy | budget GB | old % | new % | Δ points | status |",
        "|---|---|---|---|---|---|",
    ]
    for _, r in m.iterrows():
        old = "-" if r.hit_rate_old != r.hit_rate_old else f"{100 * r.hit_rate_old:.3f}"
        new = "-" if r.hit_rate_new != r.hit_rate_new else f"{100 * r.hit_rate_new:.3f}"
        d = "-" if r.delta_points != r.delta_points else f"{r.delta_points:+.3f}"
        status = f"{r.status}: {r.changed}" if r.get("changed") else r.status
        lines.append(f"| {r.policy} | {r.budget_gb:g} | {old} | {new} | {d} | {status} |")
    return "\n".join(lines)


#: the golden table's rule (for error messages)
GOLDEN_RULE = "a CSV with columns policy, budget_gb and hit_rate, one row per policy and budget"


def read_golden(path: Path) -> Any:
    """The golden table; one line naming the file (and the row, data rows counted from 1)
    when it is missing, is not a readable CSV, lacks a column, has a policy that
    is empty, a budget that is not a positive number, a hit rate outside [0, 1] or a
    policy and budget twice."""
    import pandas as pd

    if path.is_dir():
        raise FmoesimError(f"{path}: a directory (rule: {GOLDEN_RULE})")
    if not path.is_file():
        raise FmoesimError(f"{path}: golden file not found (fmoesim-regress --update makes it)")
    try:
        df = pd.read_csv(path)
    except pd.errors.EmptyDataError:
        raise FmoesimError(f"{path}: empty (rule: {GOLDEN_RULE})") from None
    except UnicodeDecodeError:
        raise FmoesimError(f"{path}: not UTF-8 text (rule: {GOLDEN_RULE})") from None
    except (pd.errors.ParserError, ValueError) as exc:
        reason = " ".join(str(exc).split())
        raise FmoesimError(f"{path}: not a readable CSV: {reason} (rule: {GOLDEN_RULE})") from None
    missing = {"policy", "budget_gb", "hit_rate"} - set(df.columns)
    if missing:
        raise FmoesimError(f"{path}: missing column(s) {sorted(missing)}")
    for i, v in enumerate(df.policy):
        if not isinstance(v, str) or not v.strip():
            raise FmoesimError(f"{path}: row {i + 1}: policy is empty")
    for col in ("budget_gb", "hit_rate"):
        num = pd.to_numeric(df[col], errors="coerce")
        for i, (raw, v) in enumerate(zip(df[col], num, strict=True)):
            if v != v and raw == raw:  # a value that is not a number (an empty cell is NaN)
                raise FmoesimError(f"{path}: row {i + 1}: {col} {raw!r} is not a number")
        df[col] = num.astype("float64")
    bad = df[~((df.budget_gb > 0) & (df.budget_gb < float("inf")))]
    if len(bad):
        i = int(bad.index[0])
        raise FmoesimError(f"{path}: row {i + 1}: budget_gb must be a positive number")
    bad = df[(df.hit_rate < 0) | (df.hit_rate > 1) | df.hit_rate.isna()]
    if len(bad):
        i = int(bad.index[0])
        raise FmoesimError(f"{path}: row {i + 1}: hit_rate must be in [0, 1]")
    first: dict[tuple[str, float], int] = {}
    for i, key in enumerate(zip(df.policy, df.budget_gb, strict=True)):
        if key in first:
            raise FmoesimError(
                f"{path}: row {i + 1}: policy {key[0]} at budget_gb {key[1]:g} again (row "
                f"{first[key] + 1} has it; rule: one row per policy and budget)"
            )
        first[key] = i
    return df


def check_tolerance(points: float) -> float:
    """``--tolerance-points``: a finite number of points, 0 or more (NaN would pass
    every move)."""
    if not (0 <= points < float("inf")):
        raise FmoesimError(f"--tolerance-points {points:g}: must be a finite number >= 0")
    return points


def main(argv: list[str] | None = None) -> None:
    """Console entry point (exit contract: :mod:`fmoesim.errors`)."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--golden", default=str(GOLDEN), help="golden CSV (default: %(default)s)")
    ap.add_argument("--update", action="store_true", help="write the new numbers as golden")
    ap.add_argument("--policies", default="", help="comma-separated presets (default: all)")
    ap.add_argument(
        "--tolerance-points",
        type=float,
        default=TOLERANCE_POINTS,
        help="largest accepted move of a hit rate, in points (%(default)s)",
    )
    code = run_or_exit(PROG, lambda: _run(ap.parse_args(sys.argv[1:] if argv is None else argv)))
    raise SystemExit(code)


def _run(args: argparse.Namespace) -> int:
    from fmoesim.atomic import atomic_file, unwritable

    golden = Path(args.golden)
    if not args.golden or golden.is_dir():  # --update would write into the folder's name
        raise FmoesimError(f"--golden {args.golden!r}: a directory or no name (rule: a CSV file)")
    if args.update and (why := unwritable(golden, file=True)) is not None:  # before the runs
        raise FmoesimError(f"--golden {args.golden}: {why} (rule: --update writes it)")
    policies = names_of("--policies", args.policies, empty_ok=True) or None
    check_tolerance(args.tolerance_points)
    # the golden file is checked before the runs: bad input fails at once
    old = read_golden(golden) if not args.update or (policies and golden.exists()) else None
    new = compute_table(policies)
    if args.update:
        rows = new
        before = old
        if before is None and golden.is_file():  # a whole update: what it replaces, if legible
            try:
                before = read_golden(golden)
            except FmoesimError:
                before = None
        if old is not None:
            # only the named policies' rows are replaced; the others stay as they were
            import pandas as pd

            rows = pd.concat([old[~old.policy.isin(policies)], new], ignore_index=True)
            rows = rows.sort_values(["policy", "budget_gb"], kind="stable", ignore_index=True)
        with atomic_file(golden) as tmp:
            rows.to_csv(tmp, index=False)
        dropped = ""
        if before is not None:
            keep = set(zip(rows.policy, rows.budget_gb, strict=True))
            gone = [(p, b) for p, b in zip(before.policy, before.budget_gb, strict=True)
                    if (p, b) not in keep]  # fmt: skip
            if gone:
                first = f"{gone[0][0]} at {gone[0][1]:g} GB"
                dropped = f", {counted(len(gone), 'row')} no longer computed dropped ({first}"
                dropped += " and more)" if len(gone) > 1 else ")"
        print(f"wrote {golden} ({counted(len(new), 'row')} updated, {len(rows)} in all{dropped})")
        return 0
    assert old is not None
    if policies:
        old = old[old.policy.isin(policies)]
    m = compare(old, new, args.tolerance_points)
    print(format_table(m))
    moved = m[m.status != "ok"]
    if len(moved):
        update = f"{PROG} --update --policies {','.join(sorted(set(moved.policy)))}"
        if golden.resolve() != GOLDEN.resolve():
            update += f" --golden {golden}"
        print(
            f"\n{failure_summary(m, args.tolerance_points)}; if intended, run `{update}` "
            f"and commit {golden}",
            file=sys.stderr,
        )
        return 1
    print(f"\nall {len(m)} hit rates within {args.tolerance_points:g} points of {golden}")
    return 0


if __name__ == "__main__":
    main()
