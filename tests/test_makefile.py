"""The Makefile with an environment other than the clone's ``.venv`` (``VENV=PATH``, or
another one active): what ``make -n`` would run, so nothing is installed or removed.

The environments here are folders with a ``bin/python`` (what make looks at) and the
install stamps set as a test needs them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
STAMPS = (".fmoesim-base", ".fmoesim-build", ".fmoesim-plot", ".fmoesim-dev")

pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(*args: str, active: str | None = None) -> list[str]:
    """The commands ``make -n ARGS`` prints in the repository, with ``active`` as the
    active environment (VIRTUAL_ENV) or none; run from inside a make (``make test``), as
    a top-level make would print them (no "Entering directory" lines)."""
    inherited = ("VIRTUAL_ENV", "VENV", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")
    env = {k: v for k, v in os.environ.items() if k not in inherited}
    if active is not None:
        env["VIRTUAL_ENV"] = active
    out = subprocess.run(
        ["make", "--no-print-directory", "-n", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.splitlines()


def environment(path: Path, *stamps: str) -> Path:
    """An existing environment at ``path`` with the given install stamps, newer than
    pyproject.toml, and a ``bin/python`` newer still."""
    (path / "bin").mkdir(parents=True)
    later = (ROOT / "pyproject.toml").stat().st_mtime + 10
    for stamp in stamps:
        (path / stamp).touch()
        os.utime(path / stamp, (later, later))
    (path / "bin" / "python").touch()
    os.utime(path / "bin" / "python", (later + 10, later + 10))
    return path


def test_an_existing_environment_is_not_recreated(tmp_path: Path) -> None:
    """Red if make runs ``python -m venv`` over an environment given with VENV=: that
    rewrites its pyvenv.cfg (a venv of Python 3.12 then names 3.11 as its version, and
    one made with --system-site-packages loses them) before installing into it."""
    env = environment(tmp_path / "env")
    for target in ("compiled", "test", "run"):
        lines = dry_run(target, f"VENV={env}")
        assert not [line for line in lines if " -m venv " in line], (target, lines)
        assert f"{env}/bin/python -m pip install --quiet -e ." in lines


def test_compiled_installs_what_the_build_needs_once(tmp_path: Path) -> None:
    """Red if ``make compiled`` installs torch and the collect and replay extras (a torch
    build pinned over the environment's own, a gigabyte more), when the build needs only
    the dev extra (mypy, setuptools); or installs again once its stamps are there,
    whatever the age of the environment's Python."""
    env = environment(tmp_path / "env")
    lines = dry_run("compiled", f"VENV={env}")
    assert not [line for line in lines if "torch" in line or "collect" in line], lines
    assert lines == [
        f"{env}/bin/python -m pip install --quiet -e .",
        f"touch {env}/.fmoesim-base",
        f"{env}/bin/python -m pip install --quiet -e '.[dev]'",
        f"touch {env}/.fmoesim-build",
        f"{env}/bin/python fmoesim/_compiled.py build",
    ]
    done = environment(tmp_path / "done", ".fmoesim-base", ".fmoesim-build")
    assert dry_run("compiled", f"VENV={done}") == [f"{done}/bin/python fmoesim/_compiled.py build"]
    tested = environment(tmp_path / "tested", *STAMPS)  # `make test` covers the build too
    assert dry_run("compiled", f"VENV={tested}") == [
        f"{tested}/bin/python fmoesim/_compiled.py build"
    ]


def test_pure_installs_nothing(tmp_path: Path) -> None:
    """Red if ``make pure`` (which only removes files) first creates or installs into an
    environment: with no stamps yet, it did all of ``make run``'s set-up."""
    env = environment(tmp_path / "env")
    assert dry_run("pure", f"VENV={env}") == [f"{env}/bin/python fmoesim/_compiled.py pure"]
    none = tmp_path / "none"  # no environment at all: any python3 removes files
    assert dry_run("pure", f"VENV={none}", "PYTHON=python3") == [
        "python3 fmoesim/_compiled.py pure"
    ]


def test_clean_keeps_an_environment_make_did_not_create(tmp_path: Path) -> None:
    """Red if ``make clean VENV=PATH`` deletes an environment of the user's (``rm -rf``
    of the whole folder); it removes only the stamps there, and the whole of one that
    make created."""
    env = environment(tmp_path / "env", *STAMPS)
    lines = dry_run("clean", f"VENV={env}")
    assert f"rm -rf {env}" not in lines
    assert " ".join(f"{env}/{s}" for s in STAMPS) in lines[-1] and lines[-1].startswith("rm -f ")
    (env / ".fmoesim-made").touch()
    assert dry_run("clean", f"VENV={env}")[-1] == f"rm -rf {env}"
    assert dry_run("clean")[-1] == "rm -rf .venv"


def test_another_active_environment_is_named(tmp_path: Path) -> None:
    """Red if, with another environment active, ``make compiled`` builds for .venv's
    Python without saying that the active one is not used, nor how to use it."""
    env = environment(tmp_path / "env")
    note = f'echo "note: {env} is used and not the active environment {tmp_path / "other"}'
    lines = dry_run("compiled", f"VENV={env}", active=str(tmp_path / "other"))
    assert [line for line in lines if line.startswith(note)]
    assert f"(VENV={tmp_path / 'other'} uses that one)" in lines[-2]
    assert not [
        line for line in dry_run("compiled", f"VENV={env}", active=str(env)) if "note" in line
    ]


@pytest.mark.parametrize(
    ("target", "command"),
    [
        ("reproduce", "fmoesim-reproduce all --run --jobs 2 --docs docs/reproduction.md"),
        ("figures", "fmoesim-plot all --run --jobs 2"),
    ],
)
def test_runs_take_a_build_made_for_them_unless_told_pure(
    tmp_path: Path, target: str, command: str
) -> None:
    """Red if ``make reproduce`` or ``make figures`` runs its simulations straight on the
    sources (about 1.6x slower) or without the dev extra mypyc needs; or if
    ``RUNS_BUILD=pure`` still builds, or a misspelt value is taken for one of the two."""
    env = environment(tmp_path / "env", ".fmoesim-base", ".fmoesim-plot")
    lines = dry_run(target, f"VENV={env}")
    assert f"{env}/bin/python -m pip install --quiet -e '.[dev]'" in lines
    assert lines[-1] == f"{env}/bin/python fmoesim/_compiled.py run -- {env}/bin/{command}"
    assert dry_run(target, f"VENV={env}", "RUNS_BUILD=pure") == [f"{env}/bin/{command}"]
    with pytest.raises(subprocess.CalledProcessError) as err:
        dry_run(target, f"VENV={env}", "RUNS_BUILD=fast")
    assert "RUNS_BUILD=fast: must be compiled or pure" in err.value.stderr
