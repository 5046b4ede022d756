"""Atomic writes: to a temporary file beside the destination, then renamed into place, so
a reader never sees a half-written file and a failure leaves the old one (or none)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np


def save_npz_atomic(path: str | os.PathLike[str], arrays: dict[str, np.ndarray]) -> None:
    """``np.savez`` of ``arrays`` to ``path`` (no pickle needed to read it back)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)  # type: ignore[arg-type]
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
