"""What the benchmark scripts share on their command line: one-line errors for bad
flags (run ``main`` under :func:`fmoesim.errors.run_or_exit`; presets are checked by
:func:`fmoesim.config.build.check_preset_names`) and the build line."""

from __future__ import annotations

import argparse

from fmoesim.errors import ArgumentParser


def parser(prog: str, description: str) -> ArgumentParser:
    """An argument parser whose usage errors are one line with exit status 2."""
    return ArgumentParser(prog=prog, description=description)


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (``--repeat 0`` would time nothing)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def build_line() -> str:
    """Which build runs: the pure-Python sources or the mypyc extensions."""
    from fmoesim._compiled import is_compiled

    build = "compiled with mypyc (make compiled)" if is_compiled() else "pure Python"
    return f"Engine build: {build}."
