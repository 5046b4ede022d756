"""How the validation reports write their numbers (``fmoesim-validate``,
``fmoesim-validate-grid``): each quantity in a unit chosen by its magnitude, to three
significant figures, so that a small stall or a rare late access keeps its digits, and a
simulator-against-replay error that stays defined where the replay's value is zero or
negligible.

The kinds of quantity (:data:`KINDS`): ``"s"`` seconds (written in s, ms, us or ns),
``"bytes"`` (B, kB, MB, GB or TB, powers of 1000) and ``"share"`` (a fraction of 1,
written in percent, its differences in percentage points).  NaN is written ``n/a``.
The CSV files beside a report keep the raw numbers; only the Markdown uses these.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

#: the kinds of quantity, each with its units from the largest down: (factor, name)
UNITS: dict[str, tuple[tuple[float, str], ...]] = {
    "s": ((1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns")),
    "bytes": ((1e12, "TB"), (1e9, "GB"), (1e6, "MB"), (1e3, "kB"), (1.0, "B")),
}
KINDS = (*UNITS, "share")
#: significant figures of a quantity
DIGITS = 3
#: below this, a quantity (in its base unit: seconds, bytes, a share of 1) or a
#: difference of two is the floating point's rounding, no measurement, and is written as
#: 0: a share of 1e-12 is one access in a million million, a time of 1e-12 s a picosecond
ROUNDING = 1e-12
#: a stall is negligible, and its relative error says nothing, where the replay's stall
#: is at most this share of the replay's wall time: it moves the run's latency by less
#: than the 0.1% it is, far inside the replay's own run-to-run spread
NEGLIGIBLE_STALL_SHARE = 1e-3


def sig(x: float, digits: int = DIGITS) -> str:
    """``x`` to ``digits`` significant figures in plain notation (no exponent; the
    digits before the point are all kept: 1234.4 is ``1234``); ``0`` for zero."""
    if x != x:
        return "n/a"
    if x == 0:
        return "0"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    text = f"{x:.{decimals}f}"
    # rounding can gain a digit (9.996 -> 10.00): one decimal fewer then
    if decimals > 0 and len(text.lstrip("-").replace(".", "").lstrip("0")) > digits:
        text = f"{x:.{decimals - 1}f}"
    return text


def quantity(v: float, kind: str) -> str:
    """``v`` of ``kind`` (:data:`KINDS`) with its unit: ``1.20 ms``, ``91.7 GB``,
    ``0.0052%``; zero (below :data:`ROUNDING`) is ``0 s``, ``0 B``, ``0%``."""
    if kind == "share":
        return share(v)
    units = UNITS[kind]
    if v != v:
        return "n/a"
    if abs(v) < ROUNDING:
        return f"0 {units[-1 if kind == 'bytes' else 0][1]}"
    rounded = float(f"{v:.{DIGITS}g}")  # 0.9996 s is 1.00 s, not 1000 ms
    factor, name = next(((f, n) for f, n in units if abs(rounded) >= f), units[-1])
    return f"{sig(v / factor)} {name}"


def share(x: float) -> str:
    """A fraction of 1 in percent: ``62.21%``, ``0.0052%`` (a rare event keeps two
    significant figures), ``99.99960%`` (so does its complement); ``0%`` and ``100%``
    where it is within :data:`ROUNDING` of them."""
    if x != x:
        return "n/a"
    if abs(x) < ROUNDING or abs(1 - x) < ROUNDING:
        return f"{100 * round(x):.0f}%"
    p = 100 * x
    near = min(abs(p), abs(100 - p))  # the share, or its complement where that is smaller
    return f"{p:.{max(2, 1 - math.floor(math.log10(near)))}f}%"


def points(d: float, signed: bool = True) -> str:
    """A difference of two shares in percentage points: ``+0.12 pt``, ``-0.0052 pt``;
    ``0 pt`` where they are equal (to :data:`ROUNDING`)."""
    if d != d:
        return "n/a"
    if abs(d) < ROUNDING:
        return "0 pt"
    p = 100 * d
    decimals = max(2, 1 - math.floor(math.log10(abs(p))))
    return f"{p:{'+' if signed else ''}.{decimals}f} pt"


def difference(d: float, kind: str) -> str:
    """A signed difference of two quantities of ``kind``: ``+150 ms``, ``-1.62 ms``,
    ``+3.66 GB``, ``-0.12 pt``; ``0 s`` (or ``0 B``, ``0 pt``) where they are equal (to
    :data:`ROUNDING`)."""
    if kind == "share":
        return points(d)
    if d != d:
        return "n/a"
    if abs(d) < ROUNDING:
        return quantity(0.0, kind)
    return ("+" if d > 0 else "-") + quantity(abs(d), kind)


def error(sim: float, ref: float, kind: str, negligible: float = 0.0) -> str:
    """The simulator's error against the reference ``ref`` (the replay): the relative
    error ``(sim - ref) / ref`` as ``+20.0%``; where ``ref`` is zero (below
    :data:`ROUNDING`) or at most ``negligible``, a ratio to it says nothing and the
    signed difference is written instead (:func:`difference`: ``-1.62 ms``, ``0 s``
    where both are equal).  Shares are compared by their difference in points always."""
    if sim != sim or ref != ref:
        return "n/a"
    if kind == "share" or abs(ref) < ROUNDING or abs(ref) <= negligible:
        return difference(sim - ref, kind)
    return f"{100 * (sim - ref) / ref:+.1f}%"


def negligible_below(key: str, row: Mapping[str, Any]) -> float:
    """The reference value of metric ``key`` at or below which :func:`error` writes a
    difference, for a report row with ``replay_<key>`` and ``replay_wall_s``: a stall
    (``stall_s``) of at most :data:`NEGLIGIBLE_STALL_SHARE` of the replay's wall time;
    zero for every other metric, and for a row without a wall time."""
    if key != "stall_s":
        return 0.0
    wall = row.get("replay_wall_s", math.nan)
    if not isinstance(wall, (int, float)) or not wall > 0:
        return 0.0
    return NEGLIGIBLE_STALL_SHARE * float(wall)


def pair(row: Mapping[str, Any], key: str, kind: str) -> tuple[str, str, str]:
    """A report row's ``sim_<key>`` and ``replay_<key>`` as written, and the simulator's
    error (:func:`error`, with :func:`negligible_below`)."""
    s, g = float(row[f"sim_{key}"]), float(row[f"replay_{key}"])
    return quantity(s, kind), quantity(g, kind), error(s, g, kind, negligible_below(key, row))
