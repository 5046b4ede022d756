"""The catalogs of the papers' claims: one YAML file per paper in ``claims/``.

A claim compares two sides, A and B, on one metric of one experiment preset's rows
(``conf/experiment/<experiment>.yaml``), and says which way the comparison goes
(``direction``: A lower or higher than B) and, where the paper gives one, by how much
(``paper_value``: the signed percentage change of A against B), or, for a bound
(``at_most``, ``at_least``), that A's metric stays under (over) the paper's number in the
claim's ``unit`` (the metric times ``scale``: 100 for a fraction in %, 1000 for seconds
in ms), or, for ``min_budget``, how much less (more) of the swept resource A
needs than B to meet the paper's ``targets``, or, for ``at_point``, how A's metric at one
value ``at`` of another of its columns ``x`` (read off its sweep) compares with B's.  A
metric that is a per-layer list column is reduced to one number per run by ``layers``
(side B by ``b_layers``, the same unless given).  A ``model`` claim is a statistic of a
model preset's shape (``model``: a ``conf/model/`` name; ``metric``: one of
:data:`MODEL_METRICS`), arithmetic on the configuration rather than a serving result.  A
claim that no preset computes has no ``experiment`` and says why in ``reason``.  The
kinds of comparison are defined in :mod:`fmoesim.reproduce.score`.

A latency claim (``relative`` or ``mean_relative``, A lower than B) may name a
``floor``: an experiment preset that serves the same requests on the same testbed with
every expert resident (one run per value of the claim's ``per`` key, or one run).  Its
latency is what no policy can beat there, so ``floor`` against B is the largest change
any policy could show: a paper's number beyond it cannot be reached on that testbed,
whatever the policy's hit rate (:func:`fmoesim.reproduce.score.resident_effect`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fmoesim.errors import FmoesimError

CLAIMS_DIR = Path(__file__).resolve().parent / "claims"
#: the papers of the scoreboard, by command-line name: the catalog's file stem
PAPERS = {"fmoe": "fmoe", "moe-infinity": "moe-infinity", "moepic": "moepic"}
KINDS = (
    "relative",
    "mean_relative",
    "every_point",
    "most_points",
    "at_most",
    "at_least",
    "diminishing",
    "min_budget",
    "at_point",
    "trend",
    "best_reached",
    "model",
)
#: the statistics of a ``model`` claim, in percent: the routed experts' share of all the
#: model's parameters, and the share of routed experts a token uses (top-k of E)
MODEL_METRICS = ("expert_param_share", "active_expert_share")
#: the kinds whose number is A's metric against the paper's number, not a change
BOUNDS = {"at_most": "lower", "at_least": "higher"}
AGGREGATES = ("one", "min", "max", "mean", "range")
#: reductions of a per-layer list column (``layer_hit_rate``...) to one number per run
#: (:func:`fmoesim.reproduce.score.reduce_layers`)
LAYER_REDUCTIONS = ("min", "max", "range", "mean", "head_tail", "middle")
DIRECTIONS = ("lower", "higher")

#: a row filter: ``policy`` or a dotted config key, to one value or a list of values
Filter = dict[str, Any]


def sides_of(flt: Filter | tuple[Filter, ...]) -> tuple[Filter, ...]:
    """The filters of a side: one, or (side B of a ``relative`` claim given as a list in
    the catalog) several, whose matching rows together are the side."""
    return flt if isinstance(flt, tuple) else (flt,)


@dataclass(frozen=True)
class Pair:
    """One averaged comparison of a ``mean_relative`` claim: A against ``b`` on
    ``metric``."""

    metric: str
    b: Filter


@dataclass(frozen=True)
class Claim:
    """One quantitative claim of a paper, and how fmoesim's number for it is computed."""

    id: str
    paper: str
    where: str
    claim: str
    quote: str
    direction: str
    paper_value: float | None = None
    unit: str = "% change"
    setting: str = ""
    experiment: str | None = None
    metric: str | None = None
    kind: str = "relative"
    a: Filter = field(default_factory=dict)
    b: Filter | tuple[Filter, ...] = field(default_factory=dict)
    c: Filter = field(default_factory=dict)
    a_agg: str = "one"
    b_agg: str = "one"
    over: str | None = None
    per: str | None = None
    among: tuple[str, ...] = ()
    pairs: tuple[Pair, ...] = ()
    targets: tuple[float, ...] = ()
    size: str | None = None
    scale: float = 1.0
    x: str | None = None
    at: float | None = None
    layers: str | None = None
    b_layers: str | None = None
    model: str | None = None
    tolerance: float | None = None
    floor: str | None = None
    reason: str = ""
    note: str = ""

    @property
    def metrics(self) -> tuple[str, ...]:
        """The store columns the claim reads."""
        if self.kind == "model":
            return ()
        if self.kind == "mean_relative":
            return tuple(dict.fromkeys(p.metric for p in self.pairs))
        return tuple(m for m in (self.metric, self.size, self.x) if m)

    def check(self) -> None:
        """Raise :class:`FmoesimError` naming the claim and the field when a field breaks
        the catalog's rules (the module docstring and :mod:`fmoesim.reproduce.score`)."""
        bad = f"claim {self.id}"
        if self.direction not in DIRECTIONS:
            raise FmoesimError(f"{bad}: direction {self.direction!r}; valid: {DIRECTIONS}")
        for name in ("where", "claim", "quote"):
            if not getattr(self, name):
                raise FmoesimError(f"{bad}: {name} is empty")
        if self.kind == "model" or self.model is not None:
            if self.kind != "model" or self.experiment is not None or not self.model:
                raise FmoesimError(f"{bad}: model goes with kind model, without experiment")
            if self.metric not in MODEL_METRICS:
                raise FmoesimError(
                    f"{bad}: metric {self.metric!r}; valid for kind model: "
                    f"{', '.join(MODEL_METRICS)}"
                )
            if self.paper_value is None:
                raise FmoesimError(f"{bad}: kind model needs paper_value")
            return
        if self.experiment is None:
            if not self.reason:
                raise FmoesimError(f"{bad}: no experiment and no reason why")
            return
        if self.kind not in KINDS:
            raise FmoesimError(f"{bad}: kind {self.kind!r}; valid: {', '.join(KINDS)}")
        if self.a_agg not in AGGREGATES or self.b_agg not in AGGREGATES:
            raise FmoesimError(f"{bad}: a_agg/b_agg must be one of {', '.join(AGGREGATES)}")
        if not self.a.get("policy"):
            raise FmoesimError(f"{bad}: side a names no policy")
        if self.kind == "mean_relative":
            if not self.pairs:
                raise FmoesimError(f"{bad}: mean_relative needs pairs")
        elif not self.metric:
            raise FmoesimError(f"{bad}: no metric")
        side = BOUNDS.get(self.kind)
        if side and (self.paper_value is None or self.direction != side):
            raise FmoesimError(f"{bad}: {self.kind} needs paper_value (the bound) and {side}")
        if side and self.per:
            raise FmoesimError(f"{bad}: {self.kind} takes a_agg over the swept values, not per")
        if self.scale != 1.0 and not side:
            raise FmoesimError(f"{bad}: scale (the metric into the claim's unit) is for bounds")
        b_named = all(side.get("policy") for side in sides_of(self.b))
        if isinstance(self.b, tuple) and self.kind not in ("relative", "min_budget"):
            raise FmoesimError(f"{bad}: side b as a list of filters: relative, min_budget only")
        if self.kind == "diminishing" and not (b_named and self.c.get("policy")):
            raise FmoesimError(f"{bad}: diminishing needs sides b and c, each naming a policy")
        if self.kind == "diminishing" and self.per:
            raise FmoesimError(f"{bad}: diminishing compares three fixed points, not per")
        if self.kind in ("relative", "every_point", "min_budget", "at_point") and not b_named:
            raise FmoesimError(f"{bad}: side b names no policy")
        if (self.kind == "best_reached") != (self.tolerance is not None):
            raise FmoesimError(f"{bad}: tolerance (of the best) goes with best_reached only")
        if self.tolerance is not None and not self.tolerance >= 0:
            raise FmoesimError(f"{bad}: tolerance {self.tolerance!r} must be >= 0")
        if self.kind == "best_reached" and (self.per or not b_named or self.b_agg != "one"):
            raise FmoesimError(f"{bad}: best_reached compares two policies' sweeps, not per")
        kinds_over = ("every_point", "most_points", "min_budget", "trend", "best_reached")
        if self.kind in kinds_over and not self.over:
            raise FmoesimError(f"{bad}: {self.kind} needs over (the swept key)")
        if self.kind == "most_points" and len(self.among) < 2:
            raise FmoesimError(f"{bad}: most_points needs among (two policies or more)")
        if self.kind == "trend" and self.a["policy"] not in self.among:
            raise FmoesimError(f"{bad}: trend needs among (the policies), side a's among them")
        if (self.kind == "min_budget") != bool(self.targets):
            raise FmoesimError(f"{bad}: targets (the metric's bounds) go with min_budget only")
        if self.kind == "min_budget" and self.per:
            raise FmoesimError(f"{bad}: min_budget reads one sweep of over, not per")
        if (self.kind == "at_point") != (self.x is not None and self.at is not None):
            raise FmoesimError(f"{bad}: x and at (where A's sweep is read) go with at_point only")
        for name in ("layers", "b_layers"):
            value = getattr(self, name)
            if value is not None and value not in LAYER_REDUCTIONS:
                raise FmoesimError(f"{bad}: {name} {value!r}; valid: {', '.join(LAYER_REDUCTIONS)}")
        if self.b_layers is not None and self.layers is None:
            raise FmoesimError(f"{bad}: b_layers without layers")
        if self.layers is not None and self.kind not in ("relative", "every_point", *BOUNDS):
            raise FmoesimError(f"{bad}: layers goes with relative, every_point and bounds")
        if self.floor is not None:
            from fmoesim.reproduce.score import is_latency

            if self.kind not in ("relative", "mean_relative") or self.direction != "lower":
                raise FmoesimError(f"{bad}: floor goes with relative and mean_relative, lower")
            if not all(is_latency(m) for m in self.metrics) or self.layers is not None:
                raise FmoesimError(f"{bad}: floor needs latency metrics, without layers")


def _claim(paper: str, raw: dict[str, Any]) -> Claim:
    raw = dict(raw)
    pairs = tuple(Pair(p["metric"], dict(p["b"])) for p in raw.pop("pairs", None) or ())
    among = tuple(raw.pop("among", None) or ())
    targets = raw.pop("targets", None)
    targets = [targets] if isinstance(targets, int | float) else targets or []
    value = raw.pop("paper_value", None)
    at = raw.pop("at", None)
    tol = raw.pop("tolerance", None)
    if isinstance(raw.get("b"), list):  # side B: the rows of any of these filters
        raw["b"] = tuple(dict(f) for f in raw["b"])
    try:
        claim = Claim(
            paper=paper,
            pairs=pairs,
            among=among,
            targets=tuple(_number(t, raw.get("id"), "targets") for t in targets),
            scale=_number(raw.pop("scale", 1.0), raw.get("id"), "scale"),
            at=None if at is None else _number(at, raw.get("id"), "at"),
            tolerance=None if tol is None else _number(tol, raw.get("id"), "tolerance"),
            paper_value=None if value is None else float(value),
            **raw,
        )
    except TypeError as exc:
        raise FmoesimError(f"claim {raw.get('id', '?')}: {exc}") from None
    claim.check()
    return claim


def _number(value: Any, claim_id: Any, key: str) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        raise FmoesimError(f"claim {claim_id}: {key} {value!r} is not a number") from None


def catalog_path(paper: str) -> Path:
    """The catalog file of ``paper`` (a key of :data:`PAPERS`)."""
    if paper not in PAPERS:
        raise FmoesimError(f"paper {paper!r}: unknown; valid: all, {', '.join(PAPERS)}")
    return CLAIMS_DIR / f"{PAPERS[paper]}.yaml"


def load_catalog(paper: str) -> list[Claim]:
    """The claims of ``paper``, in catalog order, each checked (:meth:`Claim.check`);
    ids are unique.  A paper without a catalog is one :class:`FmoesimError` line."""
    import yaml

    path = catalog_path(paper)
    if not path.is_file():
        raise FmoesimError(f"paper {paper}: its claims catalog does not exist yet ({path.name})")
    data = yaml.safe_load(path.read_text()) or {}
    name = str(data.get("paper") or paper)
    claims = [_claim(name, c) for c in data.get("claims") or []]
    seen: set[str] = set()
    for c in claims:
        if c.id in seen:
            raise FmoesimError(f"{path.name}: claim id {c.id} appears twice")
        seen.add(c.id)
    return claims
