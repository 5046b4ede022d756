"""The optional compiled build: the engine's hot modules compiled with mypyc.

fmoesim is a pure-Python package.  ``make compiled`` (``python fmoesim/_compiled.py
build``) compiles the modules in :data:`MODULES` with mypyc, from the same sources,
into extension modules next to them, which Python then imports instead of the
``.py`` files: the same decisions and the same modelled times (``tests/
test_compiled.py``), 1.3x to 6x as fast (docs/performance.md).  ``make pure`` removes
them again; ``python fmoesim/_compiled.py status`` says which build is active;
``python fmoesim/_compiled.py run -- COMMAND...`` runs a command on a build made for it
and removed after it (``make reproduce``, ``make figures``).  A build
is for the Python that ran it (its extensions carry that Python's tag, such as
``cpython-311``), and only an interpreter that imports :mod:`fmoesim` from this tree
uses it: the build says so where the one running it does not.

A compiled module silently shadows its source, so an edit to the source would not
take effect.  The build records each source's SHA-256 in :data:`MANIFEST`, and
importing :mod:`fmoesim` (which :mod:`policies` imports first) calls :func:`check_fresh`,
which refuses
(one line naming the file, exit status non-zero) to run a compiled module whose source
has changed since.

This file is run as a script by path, not as ``python -m fmoesim...``: importing the
package would run the very check a rebuild is meant to fix.  It imports nothing from
fmoesim.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from typing import TextIO

#: The repository (or install) root that holds ``fmoesim/`` and ``policies/``.
ROOT = Path(__file__).resolve().parent.parent

#: The modules compiled, relative to :data:`ROOT`: the Runner, the cache, the simulator
#: backend, the policy protocol, the classic caches, the prefetching baselines, fMoE,
#: MoE-Infinity and MoEpic.
MODULES = (
    "fmoesim/engine/backend.py",
    "fmoesim/engine/cache.py",
    "fmoesim/engine/compute.py",
    "fmoesim/engine/metrics.py",
    "fmoesim/engine/runner.py",
    "fmoesim/engine/sim.py",
    "policies/base.py",
    "policies/_ranked.py",
    "policies/lru.py",
    "policies/fifo.py",
    "policies/deepspeed.py",
    "policies/rnd.py",
    "policies/lfu.py",
    "policies/lcp.py",
    "policies/belady.py",
    "policies/_prefetching.py",
    "policies/dependency.py",
    "policies/brainstorm.py",
    "policies/mixtral_offloading.py",
    "policies/adapmoe.py",
    "policies/pregated.py",
    "policies/promoe.py",
    "policies/fmoe.py",
    "policies/moe_infinity.py",
    "policies/moepic_config.py",
    "policies/moepic.py",
)

#: Source hashes of the last build, relative to :data:`ROOT` (ignored by git).
MANIFEST = ".mypyc-manifest.json"

#: mypyc's group name: its shared runtime library becomes ``fmoesim.native__mypyc``, a
#: module inside the package (by default it is a top-level module next to the
#: packages, which an editable install does not put on the import path).
GROUP = "fmoesim.native"

#: Compile with mypyc and build in place (setuptools' ``build_ext --inplace``); argv:
#: the modules.
_SETUP = f"""
import sys
from mypyc.build import mypycify
from setuptools import setup
setup(
    name="fmoesim-native",
    ext_modules=mypycify(sys.argv[1:], group_name={GROUP!r}),
    script_args=["build_ext", "--inplace"],
)
"""


class StaleBuildError(ImportError):
    """A compiled module does not match its source."""


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def extension_of(module: str, root: Path = ROOT) -> Path | None:
    """The compiled extension of ``module`` (a path like ``policies/lru.py``), if built."""
    stem = (root / module).with_suffix("")
    for suffix in EXTENSION_SUFFIXES:
        ext = stem.with_name(stem.name + suffix)
        if ext.exists():
            return ext
    return None


def _runtime_libs(root: Path) -> list[Path]:
    """mypyc's shared runtime library of the build (see :data:`GROUP`)."""
    package, name = GROUP.split(".")
    return sorted((root / package).glob(f"{name}__mypyc*"))


def built_files(root: Path = ROOT) -> list[Path]:
    """Every compiled extension of :data:`MODULES` and mypyc's runtime library, for any
    Python: ``lru.cpython-311-...so`` and ``lru.cpython-312-...so`` alike (a build is
    made for the interpreter that ran it, and only that one imports it)."""
    found: list[Path] = []
    for module in MODULES:
        stem = (root / module).with_suffix("")
        for pattern in (".*.so", ".so", ".*.pyd", ".pyd"):
            found += sorted(stem.parent.glob(stem.name + pattern))
    return found + _runtime_libs(root)


def imported_from() -> Path | None:
    """The root (the folder holding ``fmoesim/``) this interpreter imports :mod:`fmoesim`
    from, found without importing it (that would run :func:`check_fresh`); None where it
    has none."""
    from importlib.util import find_spec  # noqa: PLC0415

    try:
        spec = find_spec("fmoesim")
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent.parent


def compiled_modules(root: Path = ROOT) -> list[str]:
    """The modules of :data:`MODULES` that have a compiled extension next to them."""
    return [m for m in MODULES if extension_of(m, root) is not None]


def check_fresh(root: Path = ROOT) -> None:
    """Raise :class:`StaleBuildError` if a compiled module's source changed since the
    build (or the build is incomplete); do nothing for a pure-Python tree.

    Cost: one ``stat`` per module; the sources are hashed only when a build exists.
    """
    built = compiled_modules(root)
    if not built:
        return
    fix = "run `make compiled` to rebuild or `make pure` to use the sources"
    manifest = root / MANIFEST
    try:
        hashes = json.loads(manifest.read_text())
    except (OSError, ValueError):
        raise StaleBuildError(
            f"{manifest}: missing or unreadable, but {built[0]} is compiled; {fix}"
        ) from None
    for module in MODULES:
        if module not in hashes or extension_of(module, root) is None:
            raise StaleBuildError(f"{root / module}: not part of the compiled build; {fix}")
        if _sha256(root / module) != hashes[module]:
            raise StaleBuildError(f"{root / module}: changed since it was compiled; {fix}")


def is_compiled() -> bool:
    """Whether this process runs the compiled engine (checked on the imported module)."""
    import fmoesim.engine.runner as runner  # noqa: PLC0415 - only when asked

    return not str(runner.__file__).endswith(".py")


def clean(root: Path = ROOT) -> list[Path]:
    """Remove the compiled extensions (for any Python), mypyc's runtime library and the
    manifest."""
    removed = built_files(root)
    if (root / MANIFEST).exists():
        removed.append(root / MANIFEST)
    for path in removed:
        path.unlink()
    return removed


def build(root: Path = ROOT, log: TextIO | None = None) -> None:
    """Compile :data:`MODULES` in place with mypyc and record their sources' hashes
    (mypyc's and the compiler's messages to ``log``, else to this process's output).

    The old build is removed first, and the manifest is written (temp file, then
    rename) only after mypyc succeeded, so an interrupted build is refused at import.
    """
    clean(root)
    hashes = {m: _sha256(root / m) for m in MODULES}
    subprocess.run(
        [sys.executable, "-c", _SETUP, *MODULES], cwd=root, check=True, stdout=log, stderr=log
    )
    if any(_sha256(root / m) != h for m, h in hashes.items()):
        raise SystemExit("a source changed while it was being compiled; build again")
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(hashes, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / MANIFEST)


def run_compiled(command: list[str], root: Path = ROOT) -> int:
    """Run ``command`` (an argv) on the compiled build and leave the tree as it was; its
    exit status.

    A tree without compiled files (of any Python) is built for the run and made pure
    again after it, whatever the command's outcome (an interrupt of the build or of the
    command too); mypyc's messages go to ``build/mypyc.log``.  A tree built for this
    Python is used as it is (a stale build stops the command at its import, with the
    line that says how to fix it).  A tree holding a partial build or one of another
    Python, and a tree this Python would not import, runs as it is, after a note.
    Where the build fails (no C compiler, no mypy), the command runs on the sources
    after a note naming the log: the results are the same either way
    (``tests/test_compiled.py``), only slower.
    """
    made = False
    note = unused_build_note(root)
    if note is not None:
        print(f"{note}; the runs take the sources", file=sys.stderr)
    elif not built_files(root):
        log = root / "build" / "mypyc.log"
        log.parent.mkdir(exist_ok=True)
        print(
            f"compiling {len(MODULES)} modules with mypyc for these runs (log: {log})", flush=True
        )
        try:
            with log.open("w") as out:
                build(root, log=out)
            made = True
        except (subprocess.CalledProcessError, SystemExit):
            clean(root)
            print(
                f"note: the compiled build failed (its messages: {log}); the runs take the "
                "sources, with the same results, about 1.6x slower",
                file=sys.stderr,
            )
        except BaseException:  # an interrupt: nothing of the build stays behind
            clean(root)
            raise
    elif compiled_modules(root) != list(MODULES):
        print("note: the tree holds another build (`make pure` removes it)", file=sys.stderr)
    try:
        return subprocess.run(command).returncode
    finally:
        if made:
            clean(root)


def unused_build_note(root: Path = ROOT) -> str | None:
    """A note where this interpreter would not import a build made in ``root``: it
    imports :mod:`fmoesim` from another folder (another clone, a non-editable install) or
    not at all.  None where it imports it from ``root``."""
    home = imported_from()
    if home == root.resolve():
        return None
    where = f"fmoesim from {home}" if home is not None else "no fmoesim"
    return (
        f"note: {sys.executable} imports {where}, not from {root}, so it runs without "
        f"this build; `pip install -e {root}` into its environment makes it use it"
    )


def _python() -> str:
    """This interpreter and its version: a build is for it alone."""
    v = sys.version_info
    return f"{sys.executable} ({sys.implementation.name} {v.major}.{v.minor})"


def main(argv: list[str] | None = None) -> int:
    """``build`` | ``pure`` | ``status`` | ``run -- COMMAND...``."""
    args = sys.argv[1:] if argv is None else argv
    if args[:2] == ["run", "--"] and len(args) > 2:
        return run_compiled(args[2:])
    if args not in (["build"], ["pure"], ["status"]):
        print(
            "usage: python fmoesim/_compiled.py build|pure|status|run -- COMMAND...",
            file=sys.stderr,
        )
        return 2
    if args == ["build"]:
        try:
            build()
        except subprocess.CalledProcessError:
            print("mypyc failed (its messages are above); the tree is pure Python", file=sys.stderr)
            clean()  # whatever it built before failing
            return 1
        print(f"compiled {len(MODULES)} modules with mypyc for {_python()}")
        note = unused_build_note()
        if note is not None:
            print(note, file=sys.stderr)
    elif args == ["pure"]:
        print(f"removed {len(clean())} compiled files")
    else:
        built = compiled_modules()
        if not built:
            others = built_files()
            print(f"pure Python: no module is compiled for {_python()}" + (
                f" ({len(others)} compiled files of another Python are there: `make pure` "
                "removes them, `make compiled` builds for this one)" if others else ""
            ))  # fmt: skip
            return 0
        try:
            check_fresh()
        except StaleBuildError as e:
            print(f"compiled, stale: {e}")
            return 1
        print(f"compiled for {_python()}: {len(built)} of {len(MODULES)} modules, up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
