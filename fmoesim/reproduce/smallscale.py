"""The regression check of a scoreboard: every claim it marks as holding, rerun at a
smaller size, must still hold.

:func:`points` lists the sweep points a claim reads (its policies and filter values, the
preset's values of its swept keys); :func:`run_points` runs them in this process with
fewer requests (``serving.max_requests``, and a synthetic trace of fewer requests),
writing nothing; :func:`recheck` scores the
claims on those rows with the scoreboard's own rules (:func:`fmoesim.reproduce.score.
score_claim`).  A direction that holds on the full preset can differ at a smaller size;
the size is :data:`SMALL_REQUESTS` unless a caller asks for another.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fmoesim.reproduce.claims import BOUNDS, Claim, Filter, sides_of
from fmoesim.reproduce.report import read_csv
from fmoesim.reproduce.score import YES, Score, score_claim

#: requests served per run of the small check
SMALL_REQUESTS = 4
#: a synthetic trace of the small check holds this many times the requests it serves
TRACE_FACTOR = 3
#: overrides of every small run: nothing written, no progress bars
QUIET = ("store.enabled=false", "output.write=false", "progress=false")


def _values(v: Any) -> list[Any]:
    return list(v) if isinstance(v, list) else [v]


def _raw_keys(experiment: str) -> dict[str, str]:
    """The preset's swept keys without their ``+``/``++`` prefix, to the key as written
    (an override of a key the preset adds must add it the same way)."""
    import yaml

    from fmoesim.config.schema import CONF_DIR

    path = CONF_DIR / "experiment" / f"{experiment}.yaml"
    params = ((yaml.safe_load(path.read_text()).get("hydra") or {}).get("sweeper") or {}).get(
        "params"
    ) or {}
    return {k.lstrip("+"): k for k in params}


def _expand(flt: Filter) -> list[dict[str, Any]]:
    """Every single-valued filter a (possibly list-valued) filter matches."""
    out: list[dict[str, Any]] = [{}]
    for key, want in flt.items():
        out = [{**o, key: v} for o in out for v in _values(want)]
    return out


def points(claim: Claim) -> list[dict[str, Any]]:
    """The sweep points (``{policy or dotted key: value}``) that ``claim`` reads: its
    sides' filters, each swept key a side leaves open at every value the preset sweeps."""
    from fmoesim.plots.figures import sweep_params

    if claim.experiment is None:
        return []
    sides: list[Filter] = [claim.a]
    if claim.kind == "mean_relative":
        sides += [p.b for p in claim.pairs]
    elif claim.kind in ("most_points", "trend"):
        sides = [{"policy": list(claim.among)}]
    elif claim.kind == "diminishing":
        sides += [*sides_of(claim.b), claim.c]
    elif claim.kind not in BOUNDS:  # a bound reads side A only
        sides += sides_of(claim.b)
    # a side that leaves a swept key open reads every value of it (``over``, ``per``, or
    # aggregated by a_agg/b_agg), as on the full preset
    for key, values in sweep_params(claim.experiment).items():
        if key != "policy":
            sides = [s if key in s else {**s, key: list(values)} for s in sides]
    out: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
    for s in sides:
        for p in _expand(s):  # 32000 from a claim and "32000" from a sweep are one point
            out.setdefault(_point_key(p), p)
    return list(out.values())


def _point_key(point: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A point's identity: its keys and values as text, in key order."""
    return tuple(sorted((k, str(v)) for k, v in point.items()))


def overrides(experiment: str, point: dict[str, Any], requests: int) -> list[str]:
    """The ``fmoesim`` overrides of one small run of ``point``."""
    raw = _raw_keys(experiment)
    out = [f"experiment={experiment}"]
    out += [f"{raw.get(k, k)}={v}" for k, v in point.items()]
    return [*out, f"serving.max_requests={requests}", *QUIET]


def small_config(experiment: str, point: dict[str, Any], requests: int) -> Any:
    """The config of one small run of ``point``: :func:`overrides`, and on a synthetic
    workload a trace of :data:`TRACE_FACTOR` times ``requests`` requests (the rest are
    what an offline preset holds in for the policy to learn from)."""
    from fmoesim.cli.main import compose_config

    cfg = compose_config(overrides(experiment, point, requests))
    if cfg.workload.kind == "synthetic":
        cfg.workload.synthetic.num_requests = TRACE_FACTOR * requests
    return cfg


def run_points(experiment: str, pts: Sequence[dict[str, Any]], requests: int) -> Any:
    """Run each point of ``experiment`` with ``requests`` requests in this process
    (nothing written); return the rows as a DataFrame like the store's."""
    import pandas as pd

    from fmoesim.cli.main import run_config
    from fmoesim.cli.plot_cli import prepare_inputs
    from fmoesim.config.schema import PROJECT_ROOT

    prepare_inputs(experiment, PROJECT_ROOT)
    rows = [run_config(small_config(experiment, p, requests), multirun=True) for p in pts]
    return pd.DataFrame(rows)


def holding(catalog: Sequence[Claim], csv_path: Path) -> list[Claim]:
    """The claims of ``catalog`` that the scoreboard at ``csv_path`` marks as holding
    (none when the file does not exist)."""
    if not csv_path.is_file():
        return []
    held = {r["id"] for r in read_csv(csv_path) if r["holds"] == YES}
    return [c for c in catalog if c.id in held]


def recheck(claims: Sequence[Claim], requests: int = SMALL_REQUESTS) -> list[Score]:
    """Each claim's :class:`Score` on small runs of the points it reads (each point run
    once, shared between claims)."""
    import pandas as pd

    frames = []
    for exp in dict.fromkeys(c.experiment for c in claims if c.experiment):
        pts: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        for c in claims:
            if c.experiment == exp:
                for p in points(c):
                    pts.setdefault(_point_key(p), p)
        frames.append(run_points(exp, list(pts.values()), requests))
    results = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return [score_claim(c, results) for c in claims]
