"""``fmoesim-reproduce``: the papers' claims against fmoesim's numbers, as a scoreboard.

Examples::

    fmoesim-reproduce fmoe --run --jobs 2    # run the fMoE claims' points the store lacks
    fmoesim-reproduce fmoe                   # score from what the store holds
    fmoesim-reproduce fmoe --docs docs/reproduction.md   # also refresh the docs' table
    fmoesim-reproduce --list | grep promoe   # the claims, with the scoreboard's outcomes
    fmoesim-reproduce fmoe --run --claims fig9-tpot-promoe   # one claim: run, score, print

For each claim of the paper's catalog (``fmoesim/reproduce/claims/<paper>.yaml``) it
computes fmoesim's number from the rows of the claim's experiment preset and writes
``<out>/<paper>.csv`` and ``<paper>.md`` (one row per claim: the paper's number,
fmoesim's, whether the direction holds, the magnitude ratio, the preset) and
``<out>/README.md``.  ``--run`` first runs the points of the presets that the claims
read (:func:`fmoesim.reproduce.smallscale.plan`: a minimum-budget side's budgets in
ascending order up to the first that meets its strictest target), all papers' points in
one queue on ``--jobs`` processes (runs already in the store are skipped).  ``--docs
PAGE`` writes each paper's table into PAGE between ``<!-- scoreboard:<paper> -->`` and
``<!-- /scoreboard:<paper> -->``.  ``--claims ID,...`` takes those claims alone (with
``--run``, their points alone) and prints their rows and notes instead of writing
anything.  Exit status 2 and one line on stderr for bad input,
before anything is written: a ``--store`` that is no folder (without ``--run``, which
makes it), an ``--out`` (or, with ``--run``, a ``--store``) that cannot be written, a
store file that is not a run's row, or a store holding no run of a paper's presets, or
none from the running code's version (a mistyped ``--store``, or a store of older runs,
would otherwise blank the scoreboards).  A claim whose points the store lacks in part
has no number (n.a., saying which run is missing; a line on stderr counts them), and
``--docs`` is then refused: the docs' scoreboard is scored on every point.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from fmoesim.errors import ArgumentParser, FmoesimError, counted, names_of, run_or_exit

PROG = "fmoesim-reproduce"


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    from fmoesim.reproduce.claims import PAPERS

    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("paper", nargs="?", help=f"one of: all, {', '.join(PAPERS)} (all with --list)")
    ap.add_argument(
        "--list",
        action="store_true",
        help="list the claims (id, section, preset, the outcome in --out's scoreboard)",
    )
    ap.add_argument(
        "--run", action="store_true", help="run the claims' points missing from the store"
    )
    ap.add_argument("--jobs", type=int, default=2, help="local cores for --run (%(default)s)")
    ap.add_argument("--out", default="results/reproduction", help="output dir (%(default)s)")
    ap.add_argument("--store", default="results/store", help="results store (%(default)s)")
    ap.add_argument("--docs", default=None, help="docs page to write the tables into")
    ap.add_argument(
        "--claims",
        default=None,
        help="comma-separated claim ids (--list shows them): run and score these alone, "
        "printing their rows instead of writing the scoreboards",
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    from fmoesim.reproduce.claims import PAPERS, load_catalog
    from fmoesim.reproduce.report import (
        OVERVIEW,
        insert_table,
        summary_line,
        update_docs,
        update_overview,
        write_scoreboard,
    )
    from fmoesim.reproduce.score import ensure_runs, experiments_of, scoreboard
    from fmoesim.results.store import check_store_dir, code_version, load_results

    args.out, args.store = (str(Path(p).expanduser()) for p in (args.out, args.store))
    if args.list and (args.run or args.docs):
        raise FmoesimError("--list: lists the claims only (rule: no --run or --docs with it)")
    if args.paper is None:
        if not args.list:
            raise FmoesimError(f"a paper is required: one of all, {', '.join(PAPERS)}")
        args.paper = "all"
    if args.paper != "all" and args.paper not in PAPERS:
        raise FmoesimError(f"paper {args.paper!r}: unknown; valid: all, {', '.join(PAPERS)}")
    if args.jobs < 1:
        raise FmoesimError(f"--jobs {args.jobs}: must be >= 1")
    names = list(PAPERS) if args.paper == "all" else [args.paper]
    catalogs = {}
    for name in names:
        try:
            catalogs[name] = load_catalog(name)
        except FmoesimError:
            if args.paper != "all":
                raise
            print(f"{name}: its claims catalog does not exist yet; left out", flush=True)
    if not catalogs:
        raise FmoesimError("no paper has a claims catalog")
    if args.claims is not None:
        if args.docs or args.list:
            raise FmoesimError("--claims: scores a few claims only (rule: no --docs or --list)")
        catalogs = _chosen(catalogs, names_of("--claims", args.claims))
    if args.list:
        _list(catalogs, Path(args.out))
        return
    docs = Path(args.docs) if args.docs else None
    if docs is not None and not docs.is_file():
        raise FmoesimError(f"--docs {docs}: no such page")
    if docs is not None:  # every block's markers, before anything runs or is written
        text = docs.read_text()
        for block in (*catalogs, OVERVIEW):
            try:
                insert_table(text, block, "")
            except FmoesimError as e:
                raise FmoesimError(f"--docs {docs}: {e}") from None
    check_store_dir(args.store, f"{PROG} {args.paper} --run makes it and runs the claims", args.run)
    if args.claims is None:  # before any run: the scoreboards go there
        _writable("--out", Path(args.out))
    if args.run:
        _writable("--store", Path(args.store))
    store = Path(args.store).resolve()
    others = [p for p in PAPERS if p not in catalogs]  # the overview reads them from --out
    if args.run:  # one queue over every paper's runs
        _check_overview(docs, Path(args.out), others)
        ensure_runs([c for claims in catalogs.values() for c in claims], store, args.jobs)
    results = load_results(store, columns=("experiment",))
    held = set(results["experiment"]) if len(results) else set()
    current = results
    if len(results) and "code_version" in results.columns:
        current = results[results["code_version"] == code_version()]
    held_now = set(current["experiment"]) if len(current) else set()
    for name, claims in catalogs.items():  # a store of none of a paper's presets: a typo?
        exps = experiments_of(claims)
        if exps and not held & set(exps):
            raise FmoesimError(
                f"--store {args.store}: holds no run of {name}'s presets ({', '.join(exps)}) "
                f"(rule: scores come from stored runs; run: {_run_command(name, args)})"
            )
        if exps and not held_now & set(exps):  # stale runs would score every row n.a.
            raise FmoesimError(
                f"--store {args.store}: its runs of {name}'s presets are all from other code "
                f"versions than this one ({code_version()}) (rule: scores come from runs of "
                f"the running code; run: {_run_command(name, args)})"
            )
    if not args.run:  # after the store's own checks, whose errors come first
        _check_overview(docs, Path(args.out), others)
    boards = {name: scoreboard(claims, results) for name, claims in catalogs.items()}
    if args.claims is not None:  # a few rows: shown, the scoreboards left as they are
        from fmoesim.reproduce.report import to_markdown

        for name, scores in boards.items():
            print(f"{name}: {summary_line(scores)}")
            print(to_markdown(scores))
            for sc in scores:
                if sc.claim.note:
                    print(f"note {sc.claim.id}: {sc.claim.note}")
        return
    for name, scores in boards.items():  # a partial store: said, and kept out of the docs
        short = [s for s in scores if s.missing]
        if not short:
            continue
        run = _run_command(name, args)
        first = f"first: claim {short[0].claim.id}, {short[0].detail}"
        if docs is not None:
            raise FmoesimError(
                f"--store {args.store}: lacks runs that {counted(len(short), 'claim')} of "
                f"{name} read ({first}) (rule: the docs' scoreboard is scored on every "
                f"point; run: {run})"
            )
        print(
            f"{PROG}: {name}: {counted(len(short), 'claim')} "
            f"{'lacks' if len(short) == 1 else 'lack'} runs in the store "
            f"({first}); run: {run}",
            file=sys.stderr,
        )
    for name, scores in boards.items():  # written once every paper is scored
        paths = write_scoreboard(name, scores, Path(args.out))
        print(f"{name}: {summary_line(scores)} -> {paths[0]} (+ .md)")
        if docs is not None:
            print(f"{name}: table written into {update_docs(docs, name, scores)}")
    if docs is not None:
        update_overview(docs, Path(args.out), list(PAPERS))
        print(f"the overview of every paper's scoreboard written into {docs}")


def _run_command(paper: str, args: argparse.Namespace) -> str:
    """The command that runs what ``paper``'s claims (those of ``--claims``) read into
    the store given."""
    claims = f" --claims {args.claims}" if args.claims else ""
    return f"{PROG} {paper} --run{claims} --store {args.store}"


def _chosen(catalogs: dict[str, list[Any]], ids: list[str]) -> dict[str, list[Any]]:
    """The claims of ``catalogs`` whose ids are ``ids``, per paper (papers without one
    left out); an id of no catalog is refused."""
    known = {c.id for claims in catalogs.values() for c in claims}
    unknown = [i for i in ids if i not in known]
    if unknown:
        raise FmoesimError(f"--claims {unknown[0]}: no such claim (rule: an id of {PROG} --list)")
    out = {name: [c for c in claims if c.id in ids] for name, claims in catalogs.items()}
    return {name: claims for name, claims in out.items() if claims}


def _writable(flag: str, folder: Path) -> None:
    """``folder`` (the value of ``flag``) is a folder that can take files, or can be made
    as one: one line naming the flag otherwise."""
    from fmoesim.atomic import unwritable

    why = unwritable(folder)
    if why is not None:
        raise FmoesimError(f"{flag} {folder}: {why} (rule: {flag} names a folder to write into)")


def _check_overview(docs: Path | None, out: Path, others: list[str]) -> None:
    """The docs page's overview counts every paper: the papers not scored now are read
    from ``out``, so each must have its scoreboard there (checked before runs and writes:
    without it, the overview would lose that paper's row)."""
    absent = [p for p in others if not (out / f"{p}.csv").is_file()]
    if docs is not None and absent:
        raise FmoesimError(
            f"--docs {docs}: its overview counts every paper's claims, and --out {out} holds "
            f"no {absent[0]}.csv (rule: score every paper, or into the --out that holds the "
            "others' scoreboards)"
        )


def _list(catalogs: dict[str, list[Any]], out: Path) -> None:
    """One line per claim, tab-separated: paper, id, section, preset, whether the
    direction holds in ``out``'s scoreboard (``yes``, ``no``, ``n.a.`` when not computed,
    ``-`` when the scoreboard has no row), the claim."""
    from fmoesim.reproduce.report import read_csv

    for paper, claims in catalogs.items():
        board = out / f"{paper}.csv"
        if not board.is_file():
            print(f"{PROG}: no {board}: outcomes shown as -", file=sys.stderr)
        rows = read_csv(board) if board.is_file() else []
        held = {r["id"]: r["holds"] or "n.a." for r in rows}
        for c in claims:
            outcome = held.get(c.id, "-")
            print(f"{paper}\t{c.id}\t{c.where}\t{c.experiment or '-'}\t{outcome}\t{c.claim}")


if __name__ == "__main__":
    main()
