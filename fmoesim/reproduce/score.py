"""fmoesim's number for each claim, from the rows of the claim's experiment preset.

Every comparison is a relative change of side A against side B on the claim's metric,
``effect = A / B - 1``, reported in percent (``-47`` means A is 47% lower than B), the
same unit as the paper's number.  The kinds:

- ``relative``: one effect.  A side matching several rows (a list of values in its
  filter) is aggregated by ``a_agg`` / ``b_agg`` (``min``, ``max``, ``mean``; ``one``
  requires exactly one row).  Side B may be a list of filters: the rows of any of them
  (two baselines that are different points of a sweep, as "the better of Prefetch Only
  and Cache Only" with ``b_agg: min``).
- ``mean_relative``: the mean of several effects of A, one per ``pairs`` entry (its own
  metric and side B), as a paper's "on average" or headline number.
- ``every_point``: the effect at each value of the swept key ``over``; fmoesim's number
  is the least favourable of them, so the direction holds only when it holds at every
  point.
- ``most_points``: the share (percent) of the values of ``over`` at which A is the best
  (lowest, or highest) of the ``among`` policies; the direction holds above 50%.
- ``at_most``: a bound, not a change: fmoesim's number is A's metric (aggregated by
  ``a_agg``) in the claim's ``unit``; the direction holds when it is below the paper's
  number, and the ratio is the one over the other.
- ``diminishing``: "beyond B, more adds little": fmoesim's number is the effect of A
  against B (the gain beyond B); the direction holds when it has the claimed sign's
  opposite or is smaller in size than the effect of B against a third side ``c`` (the
  gain up to B), so a gain that keeps growing as fast fails.  The detail gives both.

A claim with ``per`` (a swept key, such as ``model`` for a paper's number "across three
models") is scored for each value of that key on its own rows, then combined:
the mean of the effects (``relative``, ``mean_relative``), the least favourable
(``every_point``) or the mean share (``most_points``).

The direction holds ("yes") when the effect has the claimed sign (strictly below 0 for
``lower``, above 0 for ``higher``; above 50% for ``most_points``), "no" otherwise, and
"n.a." when fmoesim has no number.  The magnitude ratio is fmoesim's effect divided by
the paper's (both in percent): 1 is the paper's size, 0.17 a sixth of it, a negative
ratio the opposite direction; it exists for ``relative``, ``mean_relative`` and
``at_most`` claims with a paper number.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fmoesim.errors import FmoesimError
from fmoesim.reproduce.claims import Claim, Filter, sides_of

YES, NO, NA = "yes", "no", "n.a."


@dataclass(frozen=True)
class Score:
    """fmoesim's result for one claim: its number (percent; ``None`` when it has none),
    whether the claimed direction holds, the magnitude ratio, and a detail (why there is
    no number, or the effect at each point)."""

    claim: Claim
    fmoesim_value: float | None
    holds: str
    ratio: float | None
    detail: str = ""

    @property
    def unit(self) -> str:
        """The unit of :attr:`fmoesim_value`."""
        if self.claim.kind == "at_most":
            return self.claim.unit
        return "% of points" if self.claim.kind == "most_points" else "% change"


def _same(have: Any, want: Any) -> bool:
    """Whether a row's value equals a filter value (numbers compared as numbers)."""
    try:
        return float(have) == float(want)
    except (TypeError, ValueError):
        return str(have) == str(want)


def row_value(row: Any, key: str) -> Any:
    """A stored row's value of ``key``: its column ``policy``, else its config's dotted
    key (:func:`fmoesim.plots.figures.cfg_value`); a config group (``model``,
    ``hardware``...) by its preset's ``name``, as a sweep names it."""
    from fmoesim.plots.figures import sweep_value

    return row["policy"] if key == "policy" else sweep_value(row, key)


def select(df: Any, flt: Filter | tuple[Filter, ...]) -> Any:
    """The rows of ``df`` that match every key of ``flt`` (a list value matches any of
    its items), or, for several filters, any one of them."""
    keep = [any(_matches(r, f) for f in sides_of(flt)) for _, r in df.iterrows()]
    return df[keep]


def _matches(row: Any, flt: Filter) -> bool:
    """Whether ``row`` matches every key of ``flt``."""
    for key, want in flt.items():
        wants = want if isinstance(want, list) else [want]
        if not any(_same(row_value(row, key), w) for w in wants):
            return False
    return True


def side_value(
    df: Any, flt: Filter | tuple[Filter, ...], metric: str, agg: str, what: str
) -> float:
    """The metric of the rows matching ``flt``, aggregated by ``agg``."""
    rows = select(df, flt)
    if metric not in rows.columns:
        raise FmoesimError(f"{what}: the store's rows have no column {metric}")
    values = [float(v) for v in rows[metric]]
    if not values:
        raise FmoesimError(f"{what}: no run matches {flt}")
    if agg == "one" and len(values) != 1:
        raise FmoesimError(f"{what}: {len(values)} runs match {flt}; the claim needs one")
    if any(math.isnan(v) for v in values):
        raise FmoesimError(f"{what}: {metric} is missing in a run matching {flt}")
    if agg == "min":
        return min(values)
    if agg == "max":
        return max(values)
    return sum(values) / len(values)


def relative_pct(a: float, b: float, what: str) -> float:
    """``100 * (a / b - 1)``: A's change against B in percent."""
    if b == 0:
        raise FmoesimError(f"{what}: side B is 0, no relative change")
    return 100.0 * (a / b - 1.0)


def favourable(effect_pct: float, direction: str) -> bool:
    """Whether an effect has the claimed sign (strictly)."""
    return effect_pct < 0 if direction == "lower" else effect_pct > 0


def magnitude_ratio(fmoesim_pct: float | None, paper_pct: float | None) -> float | None:
    """fmoesim's effect over the paper's (both percent); ``None`` when either is missing
    or the paper's is 0."""
    if fmoesim_pct is None or paper_pct is None or paper_pct == 0:
        return None
    return fmoesim_pct / paper_pct


def _fmt(v: float) -> str:
    return f"{v:+.1f}%"


def _num(v: Any) -> str:
    try:
        return format(float(v), "g")
    except (TypeError, ValueError):
        return str(v)


def _over_values(df: Any, key: str) -> list[Any]:
    """The distinct values of ``key`` in ``df``, in numeric order, else in text order (a
    store's row order depends on which sweep job finished first)."""
    values: list[Any] = []
    for _, r in df.iterrows():
        v = row_value(r, key)
        if not any(_same(v, w) for w in values):
            values.append(v)
    try:
        return sorted(values, key=float)
    except (TypeError, ValueError):
        return sorted(values, key=str)


def effect(claim: Claim, df: Any) -> tuple[float, bool, str]:
    """``(fmoesim's number, whether the direction holds, detail)`` of ``claim`` on the
    experiment's rows ``df`` (the module docstring defines each kind and ``per``)."""
    if claim.per is None:
        return _effect(claim, df)
    per = claim.per
    one = replace(claim, per=None)
    parts = [(v, _effect(one, select(df, {per: v}))) for v in _over_values(df, per)]
    if not parts:
        raise FmoesimError(f"claim {claim.id}: no runs to compare per {per}")
    values = [e[0] for _, e in parts]
    if claim.kind == "every_point":
        value = max(values) if claim.direction == "lower" else min(values)
    else:
        value = sum(values) / len(values)
    holds = value > 50.0 if claim.kind == "most_points" else favourable(value, claim.direction)
    share = claim.kind == "most_points"
    detail = "; ".join(
        f"{_num(v)}: " + (f"{e[0]:.0f}%" if share else _fmt(e[0])) + (f" ({e[2]})" if e[2] else "")
        for v, e in parts
    )
    return value, holds, detail


def _effect(claim: Claim, df: Any) -> tuple[float, bool, str]:
    """:func:`effect` of a claim without ``per``."""
    what = f"claim {claim.id}"
    if claim.kind == "mean_relative":
        parts = [
            relative_pct(
                side_value(df, claim.a, p.metric, claim.a_agg, what),
                side_value(df, p.b, p.metric, claim.b_agg, what),
                what,
            )
            for p in claim.pairs
        ]
        value = sum(parts) / len(parts)
        return value, favourable(value, claim.direction), "mean of " + ", ".join(map(_fmt, parts))
    assert claim.metric is not None
    metric = claim.metric
    if claim.kind == "at_most":
        assert claim.paper_value is not None  # Claim.check
        value = side_value(df, claim.a, metric, claim.a_agg, what)
        return value, value < claim.paper_value, ""
    if claim.kind == "diminishing":
        b = side_value(df, claim.b, metric, claim.b_agg, what)
        beyond = relative_pct(side_value(df, claim.a, metric, claim.a_agg, what), b, what)
        upto = relative_pct(b, side_value(df, claim.c, metric, "one", what), what)
        sign = -1.0 if claim.direction == "lower" else 1.0
        holds = sign * beyond < abs(upto)
        return beyond, holds, f"up to B: {_fmt(upto)}; beyond B: {_fmt(beyond)}"
    if claim.kind == "relative":
        value = relative_pct(
            side_value(df, claim.a, metric, claim.a_agg, what),
            side_value(df, claim.b, metric, claim.b_agg, what),
            what,
        )
        return value, favourable(value, claim.direction), ""
    assert claim.over is not None
    over = claim.over
    points = _over_values(df, over)
    if not points:
        raise FmoesimError(f"{what}: no runs to compare over {over}")
    if claim.kind == "every_point":
        assert isinstance(claim.b, dict)  # Claim.check: a list of filters is for relative
        effects = [
            relative_pct(
                side_value(df, {**claim.a, over: v}, metric, claim.a_agg, what),
                side_value(df, {**claim.b, over: v}, metric, claim.b_agg, what),
                what,
            )
            for v in points
        ]
        worst = max(effects) if claim.direction == "lower" else min(effects)
        pairs = zip(points, effects, strict=True)
        detail = ", ".join(f"{over}={_num(v)}: {_fmt(e)}" for v, e in pairs)
        return worst, favourable(worst, claim.direction), detail
    # most_points
    best_at = []
    for v in points:
        vals = {p: side_value(df, {"policy": p, over: v}, metric, "one", what) for p in claim.among}
        pick = min if claim.direction == "lower" else max
        best = pick(vals, key=lambda p: vals[p])
        ties = [p for p in vals if vals[p] == vals[best]]
        best_at.append(claim.a["policy"] if claim.a["policy"] in ties else best)
    share = 100.0 * sum(b == claim.a["policy"] for b in best_at) / len(points)
    detail = ", ".join(f"{over}={_num(v)}: {b}" for v, b in zip(points, best_at, strict=True))
    return share, share > 50.0, "best: " + detail


def is_latency(metric: str) -> bool:
    """Whether a store column holds a latency (then only timed runs are read)."""
    from fmoesim.engine.metrics import TIME_COLUMNS

    return metric in TIME_COLUMNS


def score_claim(claim: Claim, results: Any) -> Score:
    """fmoesim's :class:`Score` for ``claim`` from the store's DataFrame ``results``:
    the rows of its experiment from the running code version
    (:func:`fmoesim.plots.figures.experiment_rows`).  A claim without a preset, or whose
    rows are missing, has no number and says why in ``detail``."""
    from fmoesim.plots.figures import experiment_rows

    if claim.experiment is None:
        return Score(claim, None, NA, None, claim.reason)
    try:
        df, _ = experiment_rows(
            results,
            claim.experiment,
            timed=any(is_latency(m) for m in claim.metrics),
            what=f"claim {claim.id}",
        )
        value, holds, detail = effect(claim, df)
    except FmoesimError as exc:
        return Score(claim, None, NA, None, str(exc))
    ratio = magnitude_ratio(value, claim.paper_value) if claim.kind in _RATIO_KINDS else None
    return Score(claim, value, YES if holds else NO, ratio, detail)


_RATIO_KINDS = ("relative", "mean_relative", "at_most")


def experiments_of(claims: Sequence[Claim]) -> list[str]:
    """The experiment presets the claims read, in catalog order."""
    return list(dict.fromkeys(c.experiment for c in claims if c.experiment))


def ensure_runs(claims: Sequence[Claim], store: Path, jobs: int) -> None:
    """Run every experiment the claims read into ``store``
    (:func:`fmoesim.cli.plot_cli.run_sweep`: runs already in the store are skipped)."""
    from fmoesim.cli.plot_cli import run_sweep
    from fmoesim.config.schema import PROJECT_ROOT

    for exp in experiments_of(claims):
        dt = run_sweep(exp, store, jobs, PROJECT_ROOT)
        print(f"experiment {exp}: {dt:.0f} s", flush=True)


def scoreboard(claims: Sequence[Claim], results: Any) -> list[Score]:
    """Every claim's :class:`Score`, in catalog order: none is left out, whatever its
    outcome."""
    return [score_claim(c, results) for c in claims]
