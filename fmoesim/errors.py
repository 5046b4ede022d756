"""Errors that reach the user as one line: what, where, and which rule was broken."""

from __future__ import annotations


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
