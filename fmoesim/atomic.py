"""Atomic writes: to a temporary file beside the destination, then renamed into place, so
a reader never sees a half-written file and a failure leaves the old one (or none).

A temporary name says who made it: ``.<name>.tmp-<host>-<pid>-<random>`` (a file keeps
its suffix).  A process killed outright (SIGKILL, a power cut) cannot remove its
temporary; :func:`clean_stale_temps` removes those whose creating process is gone.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import socket
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: mkstemp/mkdtemp make private (0600/0700) files

#: this machine in temporary names: the host name with anything but letters, digits
#: and ``_`` replaced by ``_`` (so the ``-`` that separates host and pid stays unique)
HOST = re.sub(r"[^A-Za-z0-9_]", "_", socket.gethostname()) or "localhost"
#: a temporary of this module: the host and the pid of the process that made it
_TEMP = re.compile(r"\..+\.tmp-(?P<host>[A-Za-z0-9_]+)-(?P<pid>\d+)-[^/]*")
#: a temporary directory of an older layout, without host and pid (``mkdtemp``'s suffix)
_TEMP_UNOWNED = re.compile(r"\..+\.tmp-[a-z0-9_]{8}")
#: age after which any recognised temporary counts as abandoned (no write takes so long)
STALE_AGE_S = 24 * 3600.0


def is_plain_name(name: object) -> bool:
    """A name that stays one folder inside its parent: text, not empty, no ``/``, ``\\``
    or ``..``, not starting with ``.`` (the hidden files and temporaries here do)."""
    return (
        isinstance(name, str)
        and bool(name)
        and not any(c in name for c in "/\\")
        and ".." not in name
        and not name.startswith(".")
    )


def writable_ancestor(path: str | os.PathLike[str]) -> tuple[Path, str | None]:
    """The nearest existing folder at or above ``path`` (where it would be made), and why
    it cannot take a new entry (``"is a file"``, ``"is not writable"``) or None.  A folder
    is made and removed there: the mode bits do not tell (root, /proc, read-only mounts)."""
    probe = Path(path).expanduser()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        return probe, "is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fmoesim-probe-", dir=probe))
        writable = os.access(probe, os.W_OK | os.X_OK)
    except OSError:
        writable = False
    return probe, None if writable else "is not writable"


def unwritable(path: str | os.PathLike[str], *, file: bool = False) -> str | None:
    """Why ``path`` cannot be written, in words to follow it in an error line, or None
    when it can: a folder that can take new entries or be made (``file=False``), or a file
    whose folder can (``file=True``).  The words are "is not a folder" or "is not
    writable" for a folder that exists, "is a folder" for a file's path that is one, else
    "cannot be made: <ancestor> is a file" or "... is not writable" for the nearest
    existing folder above it."""
    path = Path(path).expanduser()
    if file and path.is_dir():
        return "is a folder"
    probe, problem = writable_ancestor(path.parent if file else path)
    if problem is None:
        return None
    if probe == path:
        return "is not a folder" if problem == "is a file" else problem
    return f"cannot be made: {probe} {problem}"


def check_file_destination(flag: str, path: Path, force: bool = False) -> None:
    """``path`` (the value of ``flag``) can be written as a file: not a folder, not an
    existing file unless ``force`` (what it holds took minutes to measure), and its
    folder can be made or written (checked before the work that fills it)."""
    from fmoesim.errors import FmoesimError

    why = unwritable(path, file=True)
    if why == "is a folder":
        raise FmoesimError(f"{flag} {path}: is a folder (rule: a file to write)")
    if path.exists() and not force:
        raise FmoesimError(f"{flag} {path}: exists (--force replaces it)")
    if why is not None:
        raise FmoesimError(f"{flag} {path}: {why}")


def temp_prefix(name: str) -> str:
    """The start of a temporary name for ``name`` made by this process (host and pid
    in it, so :func:`clean_stale_temps` can tell when its writer is gone)."""
    return f".{name}.tmp-{HOST}-{os.getpid()}-"


def as_created(path: str | os.PathLike[str], mode: int) -> None:
    """Give a temporary file or directory the permissions a plain create would have: the
    umask's, and the set-group-ID bit a directory takes from a parent that has it (so
    the files written into it keep the shared folder's group)."""
    kept = os.stat(path).st_mode & stat.S_ISGID
    os.chmod(path, (mode & ~_UMASK) | kept)


def save_npz_atomic(path: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` of ``arrays`` to ``path`` (no pickle needed to read it back)."""
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **arrays)  # type: ignore[arg-type]


@contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write to; on success it is renamed to
    ``path``, on failure removed.  The suffix is kept (writers that pick a format from it,
    as matplotlib and pandas do, still work)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        prefix = temp_prefix(path.stem)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=prefix, suffix=path.suffix)
    except OSError as exc:
        raise _about(exc, path) from None
    os.close(fd)
    as_created(tmp, 0o666)
    try:
        yield Path(tmp)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _about(exc, path) from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _about(exc: OSError, path: Path) -> OSError:
    """``exc``, raised on a temporary beside ``path`` or on its rename to ``path``, as
    an error about ``path`` itself (the user named it, not the temporary)."""
    reason = exc.strerror or type(exc).__name__
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason += f" (rule: {path.parent} takes new files)"
    return OSError(exc.errno, reason, os.fspath(path))  # the errno's subclass, as raised


@contextmanager
def atomic_dir(path: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it takes ``path``'s place
    (``path`` must not exist or be an empty directory, unless ``replace``: then an
    existing one is removed first), on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=temp_prefix(path.name), dir=path.parent))
    except OSError as exc:
        raise _about(exc, path) from None
    as_created(tmp, 0o777)
    try:
        yield tmp
        if replace and path.exists():
            shutil.rmtree(path)
        try:
            os.replace(tmp, path)
        except OSError as exc:
            raise _about(exc, path) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine (one of another user counts)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True
    return True


def clean_stale_temps(directory: str | os.PathLike[str]) -> list[Path]:
    """Remove the abandoned temporaries of :func:`atomic_file` and :func:`atomic_dir`
    in ``directory`` (not below it) and return them.

    A temporary is abandoned when it was made on this host by a process that no longer
    exists, or when it is older than :data:`STALE_AGE_S` (any host, and the older names
    without host and pid).  A live writer's temporary (its process exists, even if its
    pid was reused) and anything else in ``directory`` are left alone; errors (a
    temporary that another process removes first) are ignored.
    """
    d = Path(directory)
    removed: list[Path] = []
    try:
        entries = list(d.iterdir())
    except OSError:
        return removed
    now = time.time()
    for p in entries:
        m = _TEMP.fullmatch(p.name)
        if m is None and _TEMP_UNOWNED.fullmatch(p.name) is None:
            continue
        try:
            old = now - p.lstat().st_mtime > STALE_AGE_S
        except OSError:
            continue
        dead = m is not None and m["host"] == HOST and not _alive(int(m["pid"]))
        if not (dead or old):
            continue
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError:
            continue
        removed.append(p)
    return removed
