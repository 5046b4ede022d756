"""Errors that reach the user as one line: what, where, and which rule was broken.

The console commands share one exit contract: bad input is one line on stderr
(``<prog>: error: ...``) and exit status 2; Ctrl-C is one line (``<prog>:
interrupted``) and exit status 130; a closed stdout (``fmoesim-trace inspect ... |
head -1``) ends the command quietly with exit status 141, as a process killed by
SIGPIPE would.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

#: exit status of a command stopped by Ctrl-C (128 + SIGINT)
EXIT_INTERRUPTED = 130
#: exit status of a command whose stdout was closed by its reader (128 + SIGPIPE)
EXIT_STDOUT_CLOSED = 141


def one_line(exc: BaseException) -> str:
    """An exception's message collapsed to one line."""
    return " ".join(str(exc).split()) or type(exc).__name__


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1, for a message: ``1 request``,
    ``3 requests``; ``plural`` where it is not ``noun`` + s (``2 processes``)."""
    return f"{n} {noun}" if n == 1 else f"{n} {plural or noun + 's'}"


def spans(values: Iterable[int]) -> str:
    """Sorted integers as runs, for a message: ``[1, 2, 3, 7, 9, 10]`` -> ``1-3, 7, 9-10``."""
    vals = sorted(set(values))
    out: list[str] = []
    i = 0
    while i < len(vals):
        j = i
        while j + 1 < len(vals) and vals[j + 1] == vals[j] + 1:
            j += 1
        out.append(str(vals[i]) if i == j else f"{vals[i]}-{vals[j]}")
        i = j + 1
    return ", ".join(out)


def names_of(flag: str, text: str, empty_ok: bool = False) -> list[str]:
    """A comma-separated option's items (``--policies lru,lfu``), each stripped.  An
    empty item (``lru,,lfu``, ``lru,``, ``,``) is refused naming ``flag``: a stray comma
    must not widen or empty a selection.  ``empty_ok``: an empty ``text`` is no items
    (an option whose default means "all")."""
    if not text.strip() and empty_ok:
        return []
    items = [x.strip() for x in text.split(",")]
    if not all(items):
        raise FmoesimError(f"{flag} {text!r}: an empty item (rule: comma-separated names)")
    return items


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose usage errors keep the commands' contract: one line
    (``<prog>: error: <what> (see --help)``) and exit status 2, not the usage text
    followed by the error.  A ``description`` taken from a docstring reads without its
    reST literal quotes (````fmoesim-plot````) in ``--help``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        description = kwargs.get("description")
        if isinstance(description, str):
            kwargs["description"] = description.replace("``", "")
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        """Print ``message`` as one line and exit with status 2."""
        print(f"{self.prog}: error: {' '.join(message.split())} (see --help)", file=sys.stderr)
        raise SystemExit(2)


class FmoesimError(Exception):
    """Base class of every error fmoesim reports to a user (one line, non-zero exit)."""


class ConfigError(FmoesimError):
    """A configuration value breaks a rule.

    ``key`` is the dotted config key (``cache.budget_gb``), ``rule`` the rule broken.
    """

    def __init__(self, key: str, value: object, rule: str) -> None:
        self.key, self.value, self.rule = key, value, rule
        super().__init__(f"config key '{key}' = {value!r}: {rule}")


class PolicyError(FmoesimError, RuntimeError):
    """A policy broke the engine's contract while a run was under way: it returned
    something that is not :class:`~policies.base.Actions`, prefetched a key outside the
    model or with a priority that is not a finite number, named a victim that was not
    among the candidates, or set budgets without groups.  The message names the policy,
    the hook and the rule."""


class AmbiguousRunsError(FmoesimError):
    """A results store holds more than one run for a point of an experiment preset (a
    sweep of the experiment with other overrides wrote into it), so a figure or a claim
    cannot tell which run is the preset's."""


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


def exit_interrupted(prog: str) -> NoReturn:
    """Ctrl-C: one line on stderr and exit status :data:`EXIT_INTERRUPTED`."""
    try:
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
    finally:
        raise SystemExit(EXIT_INTERRUPTED)


def exit_stdout_closed() -> NoReturn:
    """The reader of stdout went away: point stdout at the null device (so that the
    interpreter's final flush raises nothing) and exit quietly with
    :data:`EXIT_STDOUT_CLOSED`."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor behind stdout: nothing to redirect
        pass
    raise SystemExit(EXIT_STDOUT_CLOSED)


def os_error_line(exc: OSError) -> str:
    """One line for an operating-system error on a path the user gave (an output folder
    under a plain file, a file that cannot be read): the path(s) and the system's reason."""
    where = str(exc.filename)
    if exc.filename2 is not None:
        where += f" -> {exc.filename2}"
    if isinstance(exc, (FileExistsError, NotADirectoryError)) and isinstance(
        exc.filename, (str, os.PathLike)
    ):
        probe = os.fspath(exc.filename)
        while probe and not os.path.lexists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        if os.path.isfile(probe):
            what = "is a file" if probe == os.fspath(exc.filename) else f"{probe} is a file"
            return f"{where}: cannot be made as a directory: {what}"
    return f"{where}: {exc.strerror or type(exc).__name__}"


def run_or_exit(prog: str, fn: Callable[..., Any], *args: Any) -> Any:
    """Call ``fn(*args)`` under the console commands' exit contract (module docstring):
    an :class:`FmoesimError` becomes one line on stderr (``<prog>: error: ...``) and exit
    status 2, as does an :class:`OSError` on a named path (:func:`os_error_line`); Ctrl-C
    one line and 130, a closed stdout a quiet exit with 141 (also after ``fn`` exits by
    ``SystemExit``, as argparse's ``--help`` does)."""
    try:
        try:
            return fn(*args)
        finally:  # a closed stdout shows here, not at the interpreter's exit
            sys.stdout.flush()
    except FmoesimError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    except KeyboardInterrupt:
        exit_interrupted(prog)
    except BrokenPipeError:  # before OSError, its base class
        exit_stdout_closed()
    except OSError as exc:
        if exc.filename is None:
            raise
        print(f"{prog}: error: {os_error_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None
    except Exception as exc:
        if not is_omegaconf_error(exc):
            raise
        # a config the user's overrides made unreadable: a '${...}' that does
        # not resolve or resolves to the wrong type
        print(f"{prog}: error: {omegaconf_line(exc)}", file=sys.stderr)
        raise SystemExit(2) from None


def is_omegaconf_error(exc: BaseException) -> bool:
    """Whether ``exc`` is OmegaConf's (checked by module: no import of omegaconf here)."""
    return type(exc).__module__.partition(".")[0] == "omegaconf"


def omegaconf_line(exc: BaseException) -> str:
    """One line for an OmegaConf error: the key it names, then its first line."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    key = getattr(exc, "full_key", None)
    return f"config key '{key}': {first}" if key else first
