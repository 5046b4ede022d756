"""Errors that reach the user as one line: what, where, and which rule was broken."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any


class FmoesimError(Exception):
    """Base class of every error fmoesim reports to a user (one line, non-zero exit)."""


class ConfigError(FmoesimError):
    """A configuration value breaks a rule.

    ``key`` is the dotted config key (``cache.budget_gb``), ``rule`` the rule broken.
    """

    def __init__(self, key: str, value: object, rule: str) -> None:
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"config key '{key}' = {value!r}: {rule}")


class TraceError(FmoesimError):
    """A trace file breaks a rule of the trace format.

    The message names the file, the row (0-based, within that file) when one applies,
    and the rule broken, e.g.
    ``routing.parquet row 17: probs sum to 0.93 (rule: probabilities sum to 1 within 0.01)``.
    """

    def __init__(
        self, path: object, rule: str, *, row: int | None = None, detail: str = ""
    ) -> None:
        self.path, self.rule, self.row, self.detail = str(path), rule, row, detail
        where = self.path if row is None else f"{self.path} row {row}"
        what = f"{detail} (rule: {rule})" if detail else f"rule: {rule}"
        super().__init__(f"{where}: {what}")


def run_or_exit(prog: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)``; an :class:`FmoesimError` becomes one line on stderr
    (``<prog>: error: ...``) and exit status 2 (the console commands' contract)."""
    try:
        return fn(*args)
    except FmoesimError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
