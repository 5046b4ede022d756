"""Atomic writes: to a temporary file beside the destination, then renamed into place, so
a reader never sees a half-written file and a failure leaves the old one (or none)."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

_UMASK = os.umask(0)
os.umask(_UMASK)  # read once: mkstemp/mkdtemp make private (0600/0700) files


def _as_created(path: str | os.PathLike[str], mode: int) -> None:
    """Give a temporary file or directory the permissions a plain create would have."""
    os.chmod(path, mode & ~_UMASK)


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.stem}.", suffix=path.suffix)
    os.close(fd)
    _as_created(tmp, 0o666)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_dir(path: str | os.PathLike[str], replace: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside ``path``; on success it takes ``path``'s place
    (``path`` must not exist or be an empty directory, unless ``replace``: then an
    existing one is removed first), on failure it is removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    _as_created(tmp, 0o777)
    try:
        yield tmp
        if replace and path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
