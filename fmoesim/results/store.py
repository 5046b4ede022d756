"""The results store: a Parquet dataset with one row per run.

Layout: ``<dir>/<config hash>.parquet``, one single-row file per run, each written
atomically (a temporary file beside it, then renamed).  Because the file name is the
hash of the run's resolved config, concurrent sweep jobs (joblib, SLURM, Ray) never
write the same file, a finished run is recognised by its file, and an interrupted sweep
loses only the runs that had not finished: rerunning it skips what is there and adds
the rest, with nothing lost or duplicated.  :func:`load_results` reads the dataset as
one tidy DataFrame (a row per run, a column per metric and key setting).

The hash covers everything that can change a result: the resolved config without
``progress``, ``output`` and ``store`` (where and how results are written, so the same
run writes the same row wherever it is written from), the code (:func:`code_version`,
so a sweep rerun after a change to the simulator or a policy runs again rather than
reusing stale rows) and the input files a config names only by path
(:func:`input_digest`: a recorded trace, an arrivals CSV).  ``experiment_name`` is part
of the config and so of the hash: figures select their rows by it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_file
from fmoesim.errors import FmoesimError

#: config keys that do not change a result
NON_SEMANTIC = ("progress", "output", "store")


def config_key(resolved: dict[str, Any], extra: dict[str, Any] | None = None) -> tuple[str, str]:
    """``(hash, canonical json)`` of a resolved config without :data:`NON_SEMANTIC`
    keys; ``extra`` (code version, input digests) joins the hash but not the json.  The
    hash is 16 hex digits of SHA-256."""
    kept = {k: v for k, v in resolved.items() if k not in NON_SEMANTIC}
    text = json.dumps(kept, sort_keys=True, default=str)
    keyed = text + json.dumps(extra or {}, sort_keys=True, default=str)
    return hashlib.sha256(keyed.encode()).hexdigest()[:16], text


#: sources that only read, score or draw stored results: a change to them leaves every
#: run's result as it was, so they stay out of :func:`code_version`
REPORTING_ONLY = (
    "fmoesim/plots/",
    "fmoesim/reproduce/",
    "fmoesim/cli/plot_cli.py",
    "fmoesim/cli/reproduce_cli.py",
)


@lru_cache(maxsize=1)
def code_version() -> str:
    """12 hex digits of SHA-256 over the simulator's and the policies' Python sources
    (paths and contents), so any change to them changes every run's hash; the modules
    that only report on stored runs (:data:`REPORTING_ONLY`) are left out."""
    from fmoesim.config.schema import PROJECT_ROOT

    files = [
        (rel, f)
        for pkg in ("fmoesim", "policies")
        for f in (PROJECT_ROOT / pkg).rglob("*.py")
        if not (rel := f.relative_to(PROJECT_ROOT).as_posix()).startswith(REPORTING_ONLY)
    ]
    return _sources_digest(files)


def _sources_digest(files: Sequence[tuple[str, Path]]) -> str:
    """12 hex digits of SHA-256 over ``files`` (name, path) in name order: each name and
    the file's bytes."""
    h = hashlib.sha256()
    for rel, f in sorted(files):
        h.update(rel.encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def policy_code_version(target: str) -> str | None:
    """12 hex digits of SHA-256 over the Python sources (paths and contents) of the
    top-level package, or lone module, that holds a policy's ``_target_`` (dotted
    ``module.Class``), when it lies outside the project's ``fmoesim/`` and ``policies/``:
    a policy kept outside the repository is code a run depends on that
    :func:`code_version` does not cover.  None for the project's own policies and for a
    module that cannot be found (the run then fails on its own).  Found without importing
    the module."""
    import importlib.util

    from fmoesim.config.schema import PROJECT_ROOT

    top = target.split(".")[0]
    try:
        spec = importlib.util.find_spec(top)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    if spec.submodule_search_locations:  # a package (a namespace package too)
        roots = [Path(p) for p in spec.submodule_search_locations]
        files = [(f.relative_to(r).as_posix(), f) for r in roots for f in r.rglob("*.py")]
    elif spec.origin and spec.origin.endswith(".py"):
        roots = [Path(spec.origin).parent]
        files = [(Path(spec.origin).name, Path(spec.origin))]
    else:
        return None
    own = [(PROJECT_ROOT / d).resolve() for d in ("fmoesim", "policies")]
    if all(r.resolve() in own for r in roots):
        return None
    return _sources_digest(files)


def input_digest(paths: Sequence[str | os.PathLike[str] | None]) -> str:
    """12 hex digits over the input files a config names by path: a trace directory
    (its ``trace.json`` and every file's size) or a file (its bytes); missing paths
    count as absent (the run then fails on its own)."""
    h = hashlib.sha256()
    for p in paths:
        if p is None:
            continue
        path = Path(p)
        h.update(str(p).encode())
        if path.is_dir():
            manifest = path / "trace.json"
            if manifest.is_file():
                h.update(manifest.read_bytes())
            for f in sorted(path.iterdir()):
                if f.is_file():
                    h.update(f"{f.name}:{f.stat().st_size}".encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()[:12]


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
        """The stored row of one run (its ``timing`` and time columns as
        :func:`load_results` gives them)."""
        import pandas as pd

        return dict(_with_timing(pd.read_parquet(self.path(config_hash))).iloc[0])

    def add(self, row: dict[str, Any]) -> Path:
        """Write ``row`` (which must hold ``config_hash``) atomically; a rerun of the same
        config replaces its own row."""
        import pandas as pd

        path = self.path(str(row["config_hash"]))
        with atomic_file(path) as tmp:
            pd.DataFrame([row]).to_parquet(tmp, index=False)
        return path


def _timing_of(config_json: Any) -> bool:
    """A stored run's ``engine.timing`` from its ``config_json`` (true, the default,
    when the json is missing or does not say)."""
    try:
        engine = json.loads(config_json).get("engine") or {}
    except (TypeError, ValueError, AttributeError):
        return True
    return bool(engine.get("timing", True))


def _policy_args_of(config_json: Any, policy: Any) -> str:
    """A stored run's ``policy_args`` (:func:`fmoesim.config.build.policy_args`) from its
    ``config_json``, for rows written before the column existed (``""`` when the json
    has no policy)."""
    from fmoesim.config.build import policy_args

    try:
        node = json.loads(config_json).get("policy")
    except (TypeError, ValueError, AttributeError):
        return ""
    if not isinstance(node, dict):
        return ""
    return policy_args(node, str(policy))


def _with_policy_args(df: Any) -> Any:
    """``df`` (store rows) with a ``policy_args`` string in every row: rows written
    without one take it from their ``config_json``."""
    if "config_json" not in df.columns or "policy" not in df.columns:
        return df
    if "policy_args" not in df.columns:
        df["policy_args"] = None
    todo = df["policy_args"].isna()
    if todo.any():
        df.loc[todo, "policy_args"] = [
            _policy_args_of(c, p)
            for c, p in zip(df.loc[todo, "config_json"], df.loc[todo, "policy"], strict=True)
        ]
    df["policy_args"] = df["policy_args"].astype(str)  # one dtype, old rows or new
    return df


def _with_timing(df: Any) -> Any:
    """``df`` (store rows) with a boolean ``timing`` column (rows without one take it from
    their ``config_json``) and the time columns of untimed rows as missing values."""
    import numpy as np
    import pandas as pd

    from fmoesim.engine.metrics import LIST_TIME_COLUMNS, TIME_COLUMNS

    derived = (
        df["config_json"].map(_timing_of)
        if "config_json" in df.columns
        else pd.Series(True, index=df.index)
    )
    if "timing" in df.columns:
        derived = df["timing"].where(df["timing"].notna(), derived)
    df["timing"] = derived.astype(bool)
    if (~df["timing"]).any():
        for col in TIME_COLUMNS:
            if col in df.columns:
                df[col] = df[col].astype("float64").where(df["timing"])
        for col in LIST_TIME_COLUMNS:
            if col in df.columns:
                df[col] = [
                    np.full(len(v), np.nan) if not t and v is not None else v
                    for v, t in zip(df[col], df["timing"], strict=True)
                ]
    return df


def load_results(
    root: str | os.PathLike[str] = "results/store", columns: Sequence[str] = ()
) -> Any:
    """Every run in the store as one pandas DataFrame: a row per run, sorted by
    (experiment, policy, budget, seed); temporary files of unfinished writes are
    ignored.  An empty store gives an empty DataFrame.  A file that is not a readable
    Parquet file (empty, cut short, another format), or that lacks one of ``columns``,
    is a :class:`~fmoesim.errors.FmoesimError` naming the file.

    ``policy_args`` says what a run changed from its policy's preset (``""`` for the
    preset itself; :func:`fmoesim.config.build.policy_args`): two variants of one
    policy share ``policy`` and differ there.  The boolean column ``timing`` says
    whether a run simulated time (rows written
    without it take it from their ``config_json``'s ``engine.timing``).  The time
    columns of a hit-rate-only run (:data:`fmoesim.engine.metrics.TIME_COLUMNS`, the
    per-request latency and per-layer stall lists) are missing values, also in rows
    written when they were stored as zeros, so an average over timed and untimed runs
    takes in only the timed ones."""
    import pandas as pd

    files = sorted(p for p in Path(root).glob("*.parquet") if not p.name.startswith("."))
    if not files:
        return pd.DataFrame()
    df = pd.concat([_read_row(p, columns) for p in files], ignore_index=True)
    df = _with_policy_args(_with_timing(df))
    keys = [k for k in ("experiment", "policy", "budget_gb", "seed") if k in df.columns]
    return df.sort_values(keys, kind="stable", na_position="first").reset_index(drop=True)


def check_store_dir(root: str | os.PathLike[str], hint: str, run: bool = False) -> Path:
    """``root`` as a results store to read: a folder that exists, or, with ``run`` (the
    command's ``--run`` makes it), a folder or nothing yet.  One line naming it when it
    is not one (``hint``, where it does not exist: how to make it, e.g. that ``--run``)."""
    path = Path(root)
    if path.is_dir() or (run and not os.path.lexists(path)):
        return path
    if path.exists():
        raise FmoesimError(f"--store {path}: not a folder (rule: a results store is a folder)")
    raise FmoesimError(f"--store {path}: no such folder (rule: the store read exists; {hint})")


#: the rule a store's files follow (for error messages)
STORE_RULE = "rule: a results store holds one Parquet file per run, as fmoesim writes it"


def _read_row(path: Path, columns: Sequence[str]) -> Any:
    """One store file as a DataFrame; one line naming the file when it cannot be read
    as Parquet or lacks one of ``columns``."""
    import pandas as pd
    import pyarrow as pa

    try:
        df = pd.read_parquet(path)
    except (pa.ArrowException, ValueError, OSError) as exc:
        reason = " ".join(str(exc).split()) or type(exc).__name__
        if reason.startswith("Could not open Parquet input source") and "': " in reason:
            reason = reason.split("': ", 1)[1]  # the path, already named, left out
        raise FmoesimError(
            f"{path}: not a readable Parquet file: {reason} ({STORE_RULE})"
        ) from None
    missing = [c for c in columns if c not in df.columns]
    if missing:
        raise FmoesimError(f"{path}: no column {missing[0]!r} ({STORE_RULE})")
    return df
