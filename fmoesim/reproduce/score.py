"""fmoesim's number for each claim, from the rows of the claim's experiment preset.

Every comparison is a relative change of side A against side B on the claim's metric,
``effect = A / B - 1``, reported in percent (``-47`` means A is 47% lower than B), the
same unit as the paper's number.  The kinds:

- ``relative``: one effect.  A side matching several rows (a list of values in its
  filter) is aggregated by ``a_agg`` / ``b_agg`` (``min``, ``max``, ``mean``, ``range``:
  the largest minus the smallest; ``one`` requires exactly one row).  Side B may be a
  list of filters: the rows of any of them (two baselines that are different points of
  a sweep, as "the better of Prefetch Only and Cache Only" with ``b_agg: min``).  A B of
  0 against a non-zero A is an infinite effect of A's sign (a hit rate above a cache
  that hits nothing: the direction is known, the size is not finite; the ratio is then
  infinite too).
- ``mean_relative``: the mean of several effects of A, one per ``pairs`` entry (its own
  metric and side B), as a paper's "on average" or headline number.
- ``every_point``: the effect at each value of the swept key ``over``; fmoesim's number
  is the least favourable of them, so the direction holds only when it holds at every
  point.
- ``most_points``: the share (percent) of the values of ``over`` at which A is the best
  (lowest, or highest) of the ``among`` policies, a tie counting for A (values within a
  relative :data:`TIE_REL` of each other, floating-point rounding apart, are equal); the
  direction holds above 50%.
- ``at_most`` (``at_least``): a bound, not a change: fmoesim's number is A's metric
  (aggregated by ``a_agg``) times ``scale``, in the claim's ``unit``; the direction
  holds when it is below (above) the paper's number, and the ratio is the one over the
  other.
- ``min_budget``: "A needs less of the swept resource than B to meet a target" (a
  paper's minimum VRAM footprint per target TPOT): per side, the smallest swept value of
  ``over`` whose run has the metric at or under the target; the side's number is that
  run's ``size`` column (its measured footprint; the swept value itself without
  ``size``), side B given as a list of filters being their ``b_agg`` (``min``: the best of
  several baselines).  The effect is A's number against B's, and 0 when a B side meets
  the target at A's own swept value (the grid cannot order them); with several
  ``targets``, the least favourable one counts.  A side that meets a target at no swept value is
  bounded by its largest swept run (the effect is then a bound, marked in the detail;
  the direction holds when only B misses, fails when only A does), and a target neither
  side meets is skipped.
- ``at_point``: A's metric where another of its columns ``x`` equals ``at`` (TPOT at a
  given hit rate), read off A's rows by linear interpolation between the two runs whose
  ``x`` brackets ``at`` (runs in order of ``x``; ``at`` outside their range: no number),
  against side B's metric (aggregated by ``b_agg``), as a relative change.
- ``trend``: "the metric falls (rises) as the swept key ``over`` grows, for every policy
  of ``among``": the relative change between each two consecutive swept values, per
  policy; fmoesim's number is the least favourable of them all, so the direction holds
  only when every step of every policy goes the claimed way.
- ``best_reached``: "A needs more of the swept resource than B to reach its best" (a
  paper's "needs 4 GPUs to achieve the best possible latency"): per side, the smallest
  swept value of ``over`` whose metric is within ``tolerance`` (relative: 0.05 is 5%)
  of the side's lowest over the sweep; the effect is A's value against B's.
- ``model``: a statistic of a model preset's shape (:func:`model_statistic`), not a
  comparison of runs: fmoesim's number is the statistic in percent; the direction holds
  when, rounded half up to as many decimals as the paper prints, it is the paper's
  number (:func:`rounds_to`), and the ratio is the one over the other.
- ``diminishing``: "beyond B, more adds little": fmoesim's number is the effect of A
  against B (the gain beyond B); the direction holds when it has the claimed sign's
  opposite or is smaller in size than the effect of B against a third side ``c`` (the
  gain up to B), so a gain that keeps growing as fast fails.  The detail gives both.

A metric that is a per-layer list column (``layer_hit_rate``, ``layer_stall_s``,
``layer_spec_recall``) is reduced to one number per run first, by ``layers`` for side A
and ``b_layers`` (else ``layers``) for side B (:func:`reduce_layers`), for ``relative``,
``every_point`` and the bounds.  A metric of :data:`DERIVED` (``used_traffic_share``: the
share of the bytes moved that the GPU used; ``stall_per_iteration_s``: the GPU's wait for
transfers per iteration) is formed from each run's stored columns.

A claim with ``per`` (a swept key, such as ``model`` for a paper's number "across three
models") is scored for each value of that key on its own rows, then combined:
the mean of the effects (``relative``, ``mean_relative``, ``at_point``), the least
favourable (``every_point``, ``trend``) or the mean share (``most_points``).

A latency claim with a ``floor`` (an experiment preset with every expert resident, run
under the same requests and testbed) also gets :attr:`Score.resident`: the change A would
show against B at that floor, formed as the claim's own number
(:func:`resident_effect`).  It is the most any policy could show there; the direction and
the ratio do not read it.

The direction holds ("yes") when the effect has the claimed sign (strictly below 0 for
``lower``, above 0 for ``higher``; above 50% for ``most_points``), "no" otherwise, and
"n.a." when fmoesim has no number.  The magnitude ratio is fmoesim's effect divided by
the paper's (both in percent): 1 is the paper's size, 0.17 a sixth of it, a negative
ratio the opposite direction; it exists for ``relative``, ``mean_relative``,
``min_budget``, ``best_reached``, ``at_most``, ``at_least`` and ``model`` claims with a
paper number.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from fmoesim.errors import AmbiguousRunsError, FmoesimError, counted
from fmoesim.reproduce.claims import BOUNDS, Claim, Filter, Pair, sides_of

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
    #: with the claim's ``floor``: the change A would show against B with every expert
    #: resident (:func:`resident_effect`), percent; None without a floor or its runs
    resident: float | None = None
    #: how many of the points the claim reads the store lacks (:func:`missing_points`;
    #: all of them where it holds no run of the preset), the claim then without a number,
    #: or of its floor's points, the claim then without :attr:`resident`
    missing: int = 0

    @property
    def unit(self) -> str:
        """The unit of :attr:`fmoesim_value`."""
        if self.claim.kind in BOUNDS or self.claim.kind == "model":
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


#: :func:`reduce_layers` ``head_tail`` and ``middle``: the head and the tail are each this
#: share of the layers (at least one layer each)
EDGE_SHARE = 1 / 8


def reduce_layers(values: Any, how: str) -> float:
    """One number of a per-layer list ``(L,)`` (NaN entries, layers without a value, left
    out): ``min``, ``max``, ``range`` (the largest minus the smallest), ``mean``;
    ``head_tail``: the higher of the means of the first and of the last
    ``max(1, round(L * EDGE_SHARE))`` layers; ``middle``: the mean of the layers between
    them.  NaN when nothing is left."""
    import numpy as np

    v = np.asarray(values, dtype=np.float64)  # (L,)
    if how in ("head_tail", "middle"):
        n = max(1, round(len(v) * EDGE_SHARE))
        if len(v) < 2 * n + 1:
            return math.nan
        if how == "middle":
            v = v[n:-n]
        else:
            head, tail = v[:n][~np.isnan(v[:n])], v[-n:][~np.isnan(v[-n:])]
            if not len(head) or not len(tail):
                return math.nan
            return float(max(head.mean(), tail.mean()))
    v = v[~np.isnan(v)]
    if not len(v):
        return math.nan
    return aggregate(v.tolist(), "mean" if how == "middle" else how)


def _used_share(pcie_bytes: float, unused_prefetch_bytes: float) -> float:
    """The share of the bytes moved over the link that the GPU used (NaN when none moved)."""
    return 1.0 - unused_prefetch_bytes / pcie_bytes if pcie_bytes > 0 else math.nan


def _stall_per_iteration(stall_s: float, iterations: float) -> float:
    """Seconds the GPU waited for transfers, per iteration of the run (prefills
    included; NaN for a run of no iteration)."""
    return stall_s / iterations if iterations > 0 else math.nan


#: metrics a claim may read that the store does not hold, each formed from a run's stored
#: columns when the claim is scored: name -> (columns, function of their values)
DERIVED: dict[str, tuple[tuple[str, ...], Callable[..., float]]] = {
    "used_traffic_share": (("pcie_bytes", "unused_prefetch_bytes"), _used_share),
    "stall_per_iteration_s": (("stall_s", "iterations"), _stall_per_iteration),
}


def side_value(
    df: Any,
    flt: Filter | tuple[Filter, ...],
    metric: str,
    agg: str,
    what: str,
    layers: str | None = None,
) -> float:
    """The metric of the rows matching ``flt`` (each a per-layer list reduced by
    ``layers``, :func:`reduce_layers`), aggregated by ``agg``."""
    rows = select(df, flt)
    derived = DERIVED.get(metric)
    if derived is not None and metric not in rows.columns:
        columns, formula = derived
        missing = [c for c in columns if c not in rows.columns]
        if missing:
            raise FmoesimError(f"{what}: the store's rows have no column {missing[0]} ({metric})")
        values = [formula(*(float(row[c]) for c in columns)) for _, row in rows.iterrows()]
    elif metric not in rows.columns:
        raise FmoesimError(f"{what}: the store's rows have no column {metric}")
    elif layers is None:
        values = [float(v) for v in rows[metric]]
    else:
        values = [reduce_layers(v, layers) for v in rows[metric]]
    if not values:
        raise FmoesimError(f"{what}: no run matches {flt}")
    if agg == "one" and len(values) != 1:
        raise FmoesimError(f"{what}: {len(values)} runs match {flt}; the claim needs one")
    if any(math.isnan(v) for v in values):
        raise FmoesimError(f"{what}: {metric} is missing in a run matching {flt}")
    return aggregate(values, agg)


def aggregate(values: Sequence[float], agg: str) -> float:
    """``values`` aggregated by ``agg``: ``min``, ``max``, ``range`` (the largest minus the
    smallest), else the mean (``mean``, and ``one`` of a single value)."""
    if agg == "min":
        return min(values)
    if agg == "max":
        return max(values)
    if agg == "range":
        return max(values) - min(values)
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
    if claim.kind in ("every_point", "trend"):
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
    if claim.kind in BOUNDS:
        assert claim.paper_value is not None  # Claim.check
        value = claim.scale * side_value(df, claim.a, metric, claim.a_agg, what, claim.layers)
        under = value < claim.paper_value
        return value, under if claim.kind == "at_most" else value > claim.paper_value, ""
    if claim.kind == "diminishing":
        b = side_value(df, claim.b, metric, claim.b_agg, what)
        beyond = relative_pct(side_value(df, claim.a, metric, claim.a_agg, what), b, what)
        upto = relative_pct(b, side_value(df, claim.c, metric, "one", what), what)
        sign = -1.0 if claim.direction == "lower" else 1.0
        holds = sign * beyond < abs(upto)
        return beyond, holds, f"up to B: {_fmt(upto)}; beyond B: {_fmt(beyond)}"
    if claim.kind == "min_budget":
        return _min_budget(claim, df, what)
    if claim.kind == "best_reached":
        return _best_reached(claim, df, what)
    b_layers = claim.b_layers or claim.layers
    if claim.kind == "relative":
        a = side_value(df, claim.a, metric, claim.a_agg, what, claim.layers)
        b = side_value(df, claim.b, metric, claim.b_agg, what, b_layers)
        if b == 0 and a != 0:
            # no finite change, but a sign: A above (below) a B of 0
            value = math.copysign(math.inf, a)
            detail = f"B is 0 and A {_num(a)}: no finite change"
            return value, favourable(value, claim.direction), detail
        value = relative_pct(a, b, what)
        return value, favourable(value, claim.direction), ""
    if claim.kind == "at_point":
        return _at_point(claim, df, what)
    assert claim.over is not None
    over = claim.over
    points = _over_values(df, over)
    if not points:
        raise FmoesimError(f"{what}: no runs to compare over {over}")
    if claim.kind == "every_point":
        assert isinstance(claim.b, dict)  # Claim.check: a list of filters is for relative
        effects = [
            relative_pct(
                side_value(df, {**claim.a, over: v}, metric, claim.a_agg, what, claim.layers),
                side_value(df, {**claim.b, over: v}, metric, claim.b_agg, what, b_layers),
                what,
            )
            for v in points
        ]
        worst = max(effects) if claim.direction == "lower" else min(effects)
        pairs = zip(points, effects, strict=True)
        detail = ", ".join(f"{over}={_num(v)}: {_fmt(e)}" for v, e in pairs)
        return worst, favourable(worst, claim.direction), detail
    if claim.kind == "trend":
        steps: list[tuple[float, str]] = []
        for p in claim.among:
            ys = [side_value(df, {"policy": p, over: v}, metric, "one", what) for v in points]
            for i in range(1, len(points)):
                step = f"{p} {_num(points[i - 1])}->{_num(points[i])}"
                steps.append((relative_pct(ys[i], ys[i - 1], what), step))
        if not steps:
            raise FmoesimError(f"{what}: a trend needs two values of {over} or more")
        pick = max if claim.direction == "lower" else min
        worst, where = pick(steps, key=lambda s: s[0])
        bad = sum(not favourable(e, claim.direction) for e, _ in steps)
        detail = f"least favourable step: {where}; {bad} of {len(steps)} steps the other way"
        return worst, favourable(worst, claim.direction), detail
    # most_points
    best_at = []
    for v in points:
        vals = {p: side_value(df, {"policy": p, over: v}, metric, "one", what) for p in claim.among}
        pick = min if claim.direction == "lower" else max
        best = pick(vals, key=lambda p: vals[p])
        # equal up to floating-point rounding (sums of the same times in another order)
        ties = [p for p in vals if math.isclose(vals[p], vals[best], rel_tol=TIE_REL)]
        best_at.append(claim.a["policy"] if claim.a["policy"] in ties else best)
    share = 100.0 * sum(b == claim.a["policy"] for b in best_at) / len(points)
    detail = ", ".join(f"{over}={_num(v)}: {b}" for v, b in zip(points, best_at, strict=True))
    return share, share > 50.0, "best: " + detail


def least_meeting(
    df: Any, flt: Filter, over: str, metric: str, target: float, size: str | None, what: str
) -> tuple[float, bool, float]:
    """``(number, met, at)`` of one side of a ``min_budget`` claim: the ``size`` (else the
    ``over`` value) of the run at the smallest swept ``over`` value ``at`` whose ``metric``
    is at or under ``target``, and True; when no run meets it, that of the largest swept
    value (a lower bound on what the side needs) and False."""
    rows = select(df, flt)
    if rows.empty:
        raise FmoesimError(f"{what}: no run matches {flt}")
    for col in (metric, size):
        if col and col not in rows.columns:
            raise FmoesimError(f"{what}: the store's rows have no column {col}")
    points = [(float(row_value(r, over)), r) for _, r in rows.iterrows()]
    points.sort(key=lambda p: p[0])
    if len({v for v, _ in points}) != len(points):
        raise FmoesimError(f"{what}: several runs match {flt} at one value of {over}")
    if any(math.isnan(float(r[metric])) for _, r in points):
        raise FmoesimError(f"{what}: {metric} is missing in a run matching {flt}")
    meeting = [(v, r) for v, r in points if float(r[metric]) <= target]
    v, r = meeting[0] if meeting else points[-1]
    return (float(r[size]) if size else v), bool(meeting), v


def first_near_best(
    df: Any, flt: Filter, over: str, metric: str, tolerance: float, what: str
) -> tuple[float, float, float]:
    """``(value, its metric, the best metric)`` of one side of a ``best_reached`` claim:
    the smallest swept ``over`` value whose ``metric`` is at most ``1 + tolerance``
    times the side's lowest."""
    rows = select(df, flt)
    if rows.empty:
        raise FmoesimError(f"{what}: no run matches {flt}")
    if metric not in rows.columns:
        raise FmoesimError(f"{what}: the store's rows have no column {metric}")
    points = sorted((float(row_value(r, over)), float(r[metric])) for _, r in rows.iterrows())
    if len({v for v, _ in points}) != len(points):
        raise FmoesimError(f"{what}: several runs match {flt} at one value of {over}")
    if any(math.isnan(m) for _, m in points):
        raise FmoesimError(f"{what}: {metric} is missing in a run matching {flt}")
    best = min(m for _, m in points)
    v, m = next((v, m) for v, m in points if m <= best * (1.0 + tolerance))
    return v, m, best


def _best_reached(claim: Claim, df: Any, what: str) -> tuple[float, bool, str]:
    """:func:`effect` of a ``best_reached`` claim (the module docstring)."""
    assert claim.over is not None and claim.metric is not None  # Claim.check
    assert claim.tolerance is not None and isinstance(claim.b, dict)
    args = (claim.over, claim.metric, claim.tolerance, what)
    a, a_m, a_best = first_near_best(df, claim.a, *args)
    b, b_m, b_best = first_near_best(df, claim.b, *args)
    value = relative_pct(a, b, what)
    within = f"within {_num(100 * claim.tolerance)}% of its best"
    detail = (
        f"A {within} ({_num(round(a_best, 6))}) at {claim.over} {_num(a)} "
        f"({_num(round(a_m, 6))}); B at {_num(b)} ({_num(round(b_m, 6))}, "
        f"its best {_num(round(b_best, 6))})"
    )
    return value, favourable(value, claim.direction), detail


def _min_budget(claim: Claim, df: Any, what: str) -> tuple[float, bool, str]:
    """:func:`effect` of a ``min_budget`` claim (the module docstring)."""
    assert claim.over is not None and claim.metric is not None  # Claim.check
    over, metric, size = claim.over, claim.metric, claim.size
    lower = claim.direction == "lower"
    # several baselines: their max or mean when asked, else the best (smallest)
    b_agg = claim.b_agg if claim.b_agg in ("max", "mean") else "min"
    found: list[tuple[float, bool]] = []
    parts: list[str] = []
    for t in claim.targets:
        a, a_met, a_at = least_meeting(df, claim.a, over, metric, t, size, what)
        bs = [least_meeting(df, f, over, metric, t, size, what) for f in sides_of(claim.b)]
        met_b = [v for v, m, _ in bs if m]
        if not a_met and not met_b:
            parts.append(f"{_num(t)}: neither side meets it")
            continue
        b = aggregate(met_b, b_agg) if met_b else max(v for v, _, _ in bs)
        e = relative_pct(a, b, what)
        # a B side meeting the target at A's own swept value: the sweep cannot tell them
        # apart, whatever their measured sizes differ by
        same = claim.b_agg != "mean" and any(m and at == a_at for _, m, at in bs)
        if a_met and same and favourable(e, claim.direction):
            e, ok, mark = 0.0, False, f" (same {over})"
        elif a_met and met_b:
            ok, mark = favourable(e, claim.direction), ""
        elif a_met:  # only B misses: A needs less (lower) / more is not the claim (higher)
            ok, mark = lower, " (B: not met, bound)"
        else:
            ok, mark = not lower, " (A: not met, bound)"
        found.append((e, ok))
        parts.append(f"{_num(t)}: A {_num(round(a, 3))}, B {_num(round(b, 3))}, {_fmt(e)}{mark}")
    if not found:
        raise FmoesimError(f"{what}: no side meets any target ({'; '.join(parts)})")
    failed = [e for e, ok in found if not ok]
    pool = failed or [e for e, _ in found]
    worst = max(pool) if lower else min(pool)
    return worst, not failed, "; ".join(parts)


def _at_point(claim: Claim, df: Any, what: str) -> tuple[float, bool, str]:
    """:func:`effect` of an ``at_point`` claim (the module docstring)."""
    assert claim.metric is not None and claim.x is not None and claim.at is not None
    metric, x, at = claim.metric, claim.x, claim.at
    rows = select(df, claim.a)
    for col in (metric, x):
        if col not in rows.columns:
            raise FmoesimError(f"{what}: the store's rows have no column {col}")
    pts = sorted((float(r[x]), float(r[metric])) for _, r in rows.iterrows())
    if any(math.isnan(v) for p in pts for v in p):
        raise FmoesimError(f"{what}: {x} or {metric} is missing in a run matching {claim.a}")
    if len(pts) < 2 or not pts[0][0] <= at <= pts[-1][0]:
        span = f"[{_num(pts[0][0])}, {_num(pts[-1][0])}]" if pts else "no runs"
        raise FmoesimError(f"{what}: {x} = {_num(at)} is outside side A's runs ({span})")
    i = next(i for i in range(1, len(pts)) if pts[i][0] >= at)
    (x0, y0), (x1, y1) = pts[i - 1], pts[i]
    a = y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    b = side_value(df, claim.b, metric, claim.b_agg, what)
    value = relative_pct(a, b, what)
    detail = (
        f"A at {x} = {_num(at)}: {_num(round(a, 6))} (between {x} {_num(round(x0, 4))} and "
        f"{_num(round(x1, 4))}); B: {_num(round(b, 6))}"
    )
    return value, favourable(value, claim.direction), detail


def is_latency(metric: str) -> bool:
    """Whether a store column holds a latency (then only timed runs are read)."""
    from fmoesim.engine.metrics import LIST_TIME_COLUMNS, TIME_COLUMNS

    return metric in TIME_COLUMNS or metric in LIST_TIME_COLUMNS


def resident_effect(claim: Claim, df: Any, floor_df: Any) -> tuple[float, str]:
    """The change (percent) A would show against B if A had every expert resident: the
    ``floor`` preset's latency (``floor_df``, one run per value of ``per``) against side
    B's, formed as :func:`effect` forms the claim's number (per value of ``per``, then
    the mean; a ``mean_relative`` claim's pairs averaged).  No policy can do better on
    that testbed, so a paper's number beyond it is out of reach whatever the hit rate.
    Returns it and, with ``per``, a detail of each value's."""
    what = f"claim {claim.id}: floor {claim.floor}"
    keys = [None] if claim.per is None else _over_values(df, claim.per)
    pairs = claim.pairs or (Pair(claim.metric or "", claim.b),)  # type: ignore[arg-type]
    values = []
    for v in keys:
        rows = df if v is None else select(df, {claim.per: v})
        floor_rows = floor_df if v is None else select(floor_df, {claim.per: v})
        if len(floor_rows) != 1:
            raise FmoesimError(f"{what}: {len(floor_rows)} runs match where one is needed")
        parts = []
        for p in pairs:
            floor = float(floor_rows[p.metric].iloc[0])
            b = side_value(rows, p.b, p.metric, claim.b_agg, what)
            parts.append(relative_pct(floor, b, what))
        values.append(sum(parts) / len(parts))
    detail = ", ".join(f"{_num(k)} {_fmt(x)}" for k, x in zip(keys, values, strict=True))
    return sum(values) / len(values), "" if claim.per is None else detail


def missing_points(claim: Claim, df: Any) -> list[dict[str, Any]]:
    """The points ``claim`` reads (:func:`fmoesim.reproduce.smallscale.points`) that no
    row of its experiment's rows ``df`` matches.  A claim whose side reads several
    points (a list of policies, a mean over a swept key) is scored only on all of them:
    on part of them its number would be another claim's.  A ``min_budget`` claim reads
    a chain of budgets that stops at the first that meets its target, so it is not
    checked here (its sides read what was run)."""
    from fmoesim.reproduce.smallscale import points

    if claim.kind == "min_budget":
        return []
    return absent_points(points(claim), df)


def absent_points(want: Sequence[dict[str, Any]], df: Any) -> list[dict[str, Any]]:
    """The points of ``want`` (``{policy or dotted key: value}``) that no row of ``df``
    matches."""
    from fmoesim.plots.figures import point_value

    keys = sorted({k for p in want for k in p})
    have = {tuple(point_value(row_value(r, k)) for k in keys) for _, r in df.iterrows()}
    out = []
    for p in want:
        if len(p) == len(keys):
            if tuple(point_value(p[k]) for k in keys) not in have:
                out.append(p)
        elif select(df, p).empty:  # pragma: no cover - every point has the swept keys
            out.append(p)
    return out


def _points_read(claim: Claim) -> int:
    """How many points of its preset ``claim`` reads (at least one)."""
    from fmoesim.reproduce.smallscale import points

    return max(1, len(points(claim)))


def absent_text(absent: Sequence[dict[str, Any]]) -> str:
    """What a claim's missing points are, for its detail: how many, and the first."""
    first = " ".join(f"{k}={_num(v)}" for k, v in absent[0].items())
    more = f" and {len(absent) - 1} more" if len(absent) > 1 else ""
    return f"not in the store: the run at {first}{more}"


def score_claim(claim: Claim, results: Any, all_runs: bool = False) -> Score:
    """fmoesim's :class:`Score` for ``claim`` from the store's DataFrame ``results``:
    the rows of its experiment from the running code version
    (:func:`fmoesim.plots.figures.experiment_rows`).  A claim without a preset, or whose
    rows are missing, has no number and says why in ``detail``; with ``all_runs``, so
    does a claim of which the store lacks any point of its preset that it reads
    (:func:`missing_points`), and a claim whose ``floor`` lacks a run has none of that
    (:attr:`Score.missing` counts both)."""
    from fmoesim.plots.figures import experiment_rows, without_run_hint

    if claim.kind == "model":
        return _model_score(claim)
    if claim.experiment is None:
        return Score(claim, None, NA, None, claim.reason)
    try:
        df, _ = experiment_rows(
            results,
            claim.experiment,
            timed=any(is_latency(m) for m in claim.metrics),
            what=f"claim {claim.id}",
        )
    except AmbiguousRunsError:
        raise  # a store that holds two runs for a point scores nothing: the command stops
    except FmoesimError as exc:  # none of the preset's runs (of this code, timed)
        # without the hint to run the preset into the default store: the command that
        # scores says how to run what is missing into its own
        why = without_run_hint(str(exc))
        return Score(claim, None, NA, None, why, missing=_points_read(claim) * all_runs)
    try:
        absent = missing_points(claim, df) if all_runs else []
        if absent:
            return Score(claim, None, NA, None, absent_text(absent), missing=len(absent))
        value, holds, detail = effect(claim, df)
    except AmbiguousRunsError:
        raise  # a store that holds two runs for a point scores nothing: the command stops
    except FmoesimError as exc:
        return Score(claim, None, NA, None, str(exc))
    ratio = magnitude_ratio(value, claim.paper_value) if claim.kind in _RATIO_KINDS else None
    resident, short = None, 0
    if claim.floor is not None:
        from fmoesim.reproduce.smallscale import floor_points

        why = ""  # why there is no floor: the claim's own number stands without it
        try:
            floor_df, _ = experiment_rows(
                results, claim.floor, timed=True, what=f"claim {claim.id}"
            )
        except AmbiguousRunsError:
            raise
        except FmoesimError as exc:  # none of the floor's runs (of this code)
            why = without_run_hint(str(exc))
            short = max(1, len(floor_points(claim))) if all_runs else 0
        else:
            gone = absent_points(floor_points(claim), floor_df) if all_runs else []
            if gone:
                why, short = f"{claim.floor}: {absent_text(gone)}", len(gone)
        if not why:
            try:
                resident, per_value = resident_effect(claim, df, floor_df)
                if per_value:
                    detail = "; ".join(
                        filter(None, [detail, f"every expert resident: {per_value}"])
                    )
            except AmbiguousRunsError:
                raise
            except FmoesimError as exc:
                why = str(exc)
        if why:
            detail = "; ".join(filter(None, [detail, f"no floor: {why}"]))
    return Score(claim, value, YES if holds else NO, ratio, detail, resident, missing=short)


def model_statistic(model: str, metric: str) -> tuple[float, str]:
    """``(value in percent, detail)`` of a ``model`` claim's ``metric`` on the
    ``conf/model/`` preset ``model``: ``expert_param_share``, the routed experts'
    parameters over the model's (:attr:`fmoesim.specs.ModelSpec.resident_params` plus
    the routed experts'); ``active_expert_share``, top-k over the routed experts of a
    layer."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs import ModelSpec

    m = load_preset("model", model, ModelSpec).validate()
    if metric == "expert_param_share":
        experts = m.num_layers * m.num_experts * m.expert_params
        total = experts + m.resident_params
        detail = f"{model}: {experts / 1e9:.1f}B routed-expert parameters of {total / 1e9:.1f}B"
        return 100.0 * experts / total, detail
    if metric == "active_expert_share":
        return 100.0 * m.top_k / m.num_experts, f"{model}: top-{m.top_k} of {m.num_experts}"
    raise FmoesimError(f"model statistic {metric!r}: unknown")  # pragma: no cover - checked


def rounds_to(value: float, printed: float) -> bool:
    """Whether ``value`` rounded half up to as many decimals as ``printed`` has (as
    the catalog holds it: 97.45 has 2) is ``printed`` (3.125 is 3.13, as papers round)."""
    from decimal import ROUND_HALF_UP, Decimal

    text = repr(float(printed))
    places = 0 if text.endswith(".0") else len(text.partition(".")[2])
    step = Decimal(1).scaleb(-places)
    return Decimal(repr(value)).quantize(step, rounding=ROUND_HALF_UP) == Decimal(text)


def _model_score(claim: Claim) -> Score:
    """:func:`score_claim` of a ``model`` claim."""
    assert claim.model is not None and claim.metric is not None and claim.paper_value
    try:
        value, detail = model_statistic(claim.model, claim.metric)
    except FmoesimError as exc:
        return Score(claim, None, NA, None, str(exc))
    holds = rounds_to(value, claim.paper_value)
    return Score(claim, value, YES if holds else NO, value / claim.paper_value, detail)


#: ``most_points``: values this close (relative) to the best are ties, as rounding apart
TIE_REL = 1e-9

_RATIO_KINDS = ("relative", "mean_relative", "min_budget", "best_reached", "at_point", *BOUNDS)


def experiments_of(claims: Sequence[Claim]) -> list[str]:
    """The experiment presets the claims read (their floors too), in catalog order."""
    return list(dict.fromkeys(e for c in claims for e in (c.experiment, c.floor) if e))


def ensure_runs(claims: Sequence[Claim], store: Path, jobs: int) -> None:
    """Run the points the claims read into ``store``, as one queue on ``jobs`` processes
    (:func:`fmoesim.reproduce.smallscale.plan`: each point once, a minimum-budget side's
    budgets in ascending order up to the first that meets its strictest target, so the
    scores are those of every point of the presets; runs already in the store are
    skipped)."""
    import time

    from fmoesim.reproduce.smallscale import plan, run_jobs

    jobs_list = plan(claims)
    n = sum(len(pts) for _, pts, _ in jobs_list)
    exps = counted(len(experiments_of(claims)), "experiment")
    procs = counted(jobs, "process", "processes")
    print(f"runs: at most {counted(n, 'point')} of {exps} on {procs}", flush=True)
    t0 = time.perf_counter()
    rows = run_jobs(jobs_list, None, jobs, store=store)
    held = sum(bool(r.get("done_already")) for r in rows)
    print(
        f"all runs: {len(rows)} points ({len(rows) - held} run, {held} in the store already) in "
        f"{(time.perf_counter() - t0) / 60:.1f} min",
        flush=True,
    )


def scoreboard(claims: Sequence[Claim], results: Any) -> list[Score]:
    """Every claim's :class:`Score`, in catalog order: none is left out, whatever its
    outcome.  A claim is scored only on every point of its preset that it reads: one
    the store lacks leaves it without a number (:attr:`Score.missing`)."""
    return [score_claim(c, results, all_runs=True) for c in claims]
