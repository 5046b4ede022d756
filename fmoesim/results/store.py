"""The results store: a Parquet dataset with one row per run.

Layout: ``<dir>/<config hash>.parquet``, one single-row file per run, each written
atomically (a temporary file beside it, then renamed).  Because the file name is the
hash of the run's resolved config, concurrent sweep jobs (joblib, SLURM, Ray) never
write the same file, a finished run is recognised by its file, and an interrupted sweep
loses only the runs that had not finished: rerunning it skips what is there and adds
the rest, with nothing lost or duplicated.  :func:`load_results` reads the dataset as
one tidy DataFrame (a row per run, a column per metric and key setting).

The hash covers every key that can change a result; ``progress``, ``output`` and
``store`` (where and how results are written) are left out, so the same run writes the
same row wherever it is written from.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_file

#: config keys that do not change a result
NON_SEMANTIC = ("progress", "output", "store")


def config_key(resolved: dict[str, Any]) -> tuple[str, str]:
    """``(hash, canonical json)`` of a resolved config without :data:`NON_SEMANTIC`
    keys; the hash is 16 hex digits of SHA-256."""
    kept = {k: v for k, v in resolved.items() if k not in NON_SEMANTIC}
    text = json.dumps(kept, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16], text


class ResultsStore:
    """One directory of single-row Parquet files (see the module docstring)."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, config_hash: str) -> Path:
        """The file of one run."""
        return self.root / f"{config_hash}.parquet"

    def has(self, config_hash: str) -> bool:
        """Whether the run is in the store."""
        return self.path(config_hash).is_file()

    def get(self, config_hash: str) -> dict[str, Any]:
        """The stored row of one run."""
        import pandas as pd

        return dict(pd.read_parquet(self.path(config_hash)).iloc[0])

    def add(self, row: dict[str, Any]) -> Path:
        """Write ``row`` (which must hold ``config_hash``) atomically; a rerun of the same
        config replaces its own row."""
        import pandas as pd

        path = self.path(str(row["config_hash"]))
        with atomic_file(path) as tmp:
            pd.DataFrame([row]).to_parquet(tmp, index=False)
        return path


def load_results(root: str | os.PathLike[str] = "results/store") -> Any:
    """Every run in the store as one pandas DataFrame: a row per run, sorted by
    (experiment, policy, budget, seed); temporary files of unfinished writes are
    ignored.  An empty store gives an empty DataFrame."""
    import pandas as pd

    files = sorted(p for p in Path(root).glob("*.parquet") if not p.name.startswith("."))
    if not files:
        return pd.DataFrame()
    df = pd.concat([pd.read_parquet(p) for p in files], ignore_index=True)
    keys = [k for k in ("experiment", "policy", "budget_gb", "seed") if k in df.columns]
    return df.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)
