"""A generative workload model for synthetic MoE routing traces.

Not i.i.d. noise: the model has the structure the offloading papers exploit.

For request ``r`` of semantic topic ``t``, token position ``n`` and MoE layer ``l`` the
router logits over the ``E`` experts are::

    x[n, l] = base[t, l] + jitter[r, l]
              + noise * (sqrt(1 - type_share) * v[n, l] + sqrt(type_share) * W[w[n], l])
              + cross_layer * C[l] @ sel[n, l-1] / sqrt(k)
    v[n, l] = sqrt(1 - depth_share) * u[n, l] + sqrt(depth_share) * Q[l] @ z[n]

- ``base[t, l] = skew * (sqrt(1 - topic_share) * G[l] + sqrt(topic_share) * T[t, l])`` with
  ``G, T ~ N(0, I)``: each layer has a popularity profile shared by all requests (``G``)
  and one per topic (``T``).  ``skew`` scales the spread of log-popularities: more skew,
  lower activation entropy.
- ``jitter[r, l] ~ N(0, request_jitter^2 I)``: each request deviates from its topic.
- ``u[., l]`` is an AR(1) process along the token axis with coefficient ``locality``
  (stationary variance 1): consecutive tokens see correlated noise, so they tend to
  reuse experts (temporal locality).  ``locality = 0`` makes tokens independent.
- ``z[n]`` is one more such AR(1) process, drawn once per token and shared by every
  layer through a fixed random rotation ``Q[l]`` per layer: the part of a token's state
  that persists through the residual stream, so a layer's choice tells about the
  choices several layers later, not only the next one (real Mixtral-8x7B routing
  depends on layer ``l`` nearly as much at ``l + 6`` as at ``l + 1``:
  ``traces/calibration.md``).
  ``depth_share`` is its share of the noise variance; as ``Q[l] @ z[n]`` has the law of
  ``u[n, l]``, each layer's routing alone has the same law whatever ``depth_share``.
- ``w[n]`` is the token's type, drawn for each position from ``token_types`` types with
  frequencies ``P(w) ~ 1 / (w + 1)^type_zipf`` (1: Zipf's law of word frequencies; 0:
  every type equally frequent), the same for every request; ``W[w, l] ~ N(0, I)`` is a
  fixed logit profile per type and layer, and ``v[n, l]`` the noise of the terms above.
  A token's type decides a share ``type_share`` of the noise variance at every layer,
  so tokens of one type, in any request, follow much the same path across the layers,
  as a real router's choices depend on the token itself: a token's experts at the first
  layers then tell which of other requests' tokens its later experts will match (what
  fMoE's trajectory search exploits; path predictability in
  :mod:`fmoesim.validation.real_routing`).  ``type_share = 0`` (the default) leaves the
  model as it is without types, draws included.
- ``type_context``: the share of a type's profile that is the request's own, ``W[w, l]``
  becoming ``sqrt(1 - type_context) * W[w, l] + sqrt(type_context) * V[r, w, l]`` with
  ``V[r, w, l] ~ N(0, I)`` drawn per request, as a word's meaning leans on its context:
  a type's tokens route more alike within a request than across requests (real routing
  predicts a token's later experts from an earlier token of its own request better than
  from another request's; :func:`fmoesim.validation.real_routing.own_path_predictability`).
  0 (the default) draws nothing more.
- ``type_repeat``: the chance that a position takes the type of an earlier position of
  its request (drawn uniformly), as text repeats its own words beyond their frequency
  in the language; 0 (the default) draws nothing more.
- ``C[l]`` is a fixed random ``E x E`` matrix and ``sel[n, l-1]`` the 0/1 vector of the
  experts chosen at the previous layer: the expert chosen at layer ``l-1`` shifts the
  odds at layer ``l`` (cross-layer correlation, the "trajectory" fMoE searches on).
- probabilities ``softmax(x / temperature)``; the top-k of them are the routed experts.
- speculative probabilities of layer ``l`` (``spec_probs``, MoEpic eq. 3): the same
  computation on a noisy copy of the state, ``x[n, l] + spec_noise * eps``; for layer 0
  the prediction comes from the previous iteration's last layer, so it uses the larger
  ``spec_noise_first_layer``, and it is null in the prefill (nothing precedes it).

Semantic embeddings: topic centroids ``c[t] ~ N(0, I/D)``; a request's embedding is
``c[t] + topic_spread * N(0, I/D)``; each token's embedding adds ``token_noise *
N(0, I/D)``; an iteration's embedding is the mean over its tokens (fMoE §4.2), so the
prefill embedding sits close to the request's and decode embeddings are noisier.

A workload shift (``shift_at > 0``, MoE-Infinity §7.5's task shift): requests before
request ``shift_at`` draw their topic from the first half of the topics, the others from
the second half, and the later ones carry the dataset label ``<dataset>-shifted``.

Encoder-decoder models (``model.encoder_layers = n > 0``): the encoder layers
``0..n-1`` route the ``P`` prompt positions, all in iteration 0; the decoder layers
``n..L-1`` route ``O`` positions, one per iteration (the decoder's start token at iteration
0, then each output token but the last).  The encoder's positions and the decoder's have
token states ``z`` of their own (children 0 and 1 of the request's seed), and token types
of their own where ``type_share > 0`` (children 2 and 3; the request's own part of their
profiles, children 4 and 5), and the first decoder layer has no cross-layer term
(nothing links it to the encoder's last layer).
Speculative probabilities: none for the encoder's first layer; the other encoder layers
have them at iteration 0 only; the decoder's first layer is predicted as layer 0 of a
decoder-only model (``spec_noise_first_layer``, null at iteration 0), the other decoder
layers with ``spec_noise``.  Embeddings are computed as for a decoder-only model (the
prompt positions, then the output positions).

Lengths: prompt and output token counts from log-normal distributions (clipped), or
from an arrival log (``arrivals_csv``: an Azure-format CSV,
``TIMESTAMP,ContextTokens,GeneratedTokens``, or a Mooncake JSON lines trace,
:func:`read_arrivals`), clipped the same way.  Arrivals: none (static batches), a
Poisson process of ``arrival_rate_rps``, or the log.

Every request draws from its own child of ``SeedSequence(seed)``, so the same seed
gives the same bytes, and request ``r`` does not change when more requests are added.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fmoesim.errors import ConfigError, FmoesimError
from fmoesim.specs.model import ModelSpec
from fmoesim.trace.schema import MAX_TOKENS, TraceManifest, TraceModel
from fmoesim.trace.writer import TraceWriter

GENERATOR = "fmoesim.workload.synthetic/1"

#: the modules (under the ``fmoesim`` package) whose code decides a generated trace's
#: bytes, with numpy's version (its random streams): :func:`generator_digest`
GENERATOR_SOURCES = ("workload/synthetic.py", "trace/writer.py", "trace/schema.py")


@dataclass
class SyntheticConfig:
    """Knobs of the synthetic workload model (see the module docstring for the model)."""

    num_requests: int = 32
    num_topics: int = 8
    embedding_dim: int = 64
    topic_spread: float = 0.35
    token_noise: float = 1.0
    skew: float = 1.5
    topic_share: float = 0.6
    request_jitter: float = 0.3
    locality: float = 0.6
    noise: float = 1.0
    cross_layer: float = 1.0
    depth_share: float = 0.0
    type_share: float = 0.0
    token_types: int = 1024
    type_zipf: float = 1.0
    type_context: float = 0.0
    type_repeat: float = 0.0
    temperature: float = 1.0
    spec_noise: float = 0.6
    spec_noise_first_layer: float = 1.2
    prompt_tokens_median: int = 128
    prompt_tokens_sigma: float = 0.8
    prompt_tokens_max: int = 1024
    output_tokens_median: int = 64
    output_tokens_sigma: float = 0.5
    output_tokens_max: int = 256
    arrival_rate_rps: float | None = None
    arrivals_csv: str | None = None
    dataset: str = "synthetic"
    shift_at: int = 0
    seed: int = 0

    def validate(self, prefix: str = "workload.synthetic") -> SyntheticConfig:
        """Check every knob; raise :class:`ConfigError` naming the first bad one."""
        positive_int = (
            "num_requests",
            "num_topics",
            "prompt_tokens_median",
            "prompt_tokens_max",
            "output_tokens_median",
            "output_tokens_max",
            "token_types",
        )
        for key in positive_int:
            v = getattr(self, key)
            if not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{prefix}.{key}", v, "must be a positive integer")
            if v > MAX_TOKENS:  # a trace's columns are int32
                raise ConfigError(f"{prefix}.{key}", v, "must be below 2**31")
        if not isinstance(self.embedding_dim, int) or self.embedding_dim < 0:
            raise ConfigError(
                f"{prefix}.embedding_dim", self.embedding_dim, "must be an integer >= 0"
            )
        for key in (
            "topic_spread",
            "token_noise",
            "skew",
            "request_jitter",
            "noise",
            "cross_layer",
            "spec_noise",
            "spec_noise_first_layer",
            "type_zipf",
            "prompt_tokens_sigma",
            "output_tokens_sigma",
        ):
            v = getattr(self, key)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ConfigError(f"{prefix}.{key}", v, "must be a finite number >= 0")
        if not (isinstance(self.topic_share, (int, float)) and 0 <= self.topic_share <= 1):
            raise ConfigError(f"{prefix}.topic_share", self.topic_share, "must be in [0, 1]")
        if not (isinstance(self.depth_share, (int, float)) and 0 <= self.depth_share <= 1):
            raise ConfigError(f"{prefix}.depth_share", self.depth_share, "must be in [0, 1]")
        if not (isinstance(self.type_share, (int, float)) and 0 <= self.type_share <= 1):
            raise ConfigError(f"{prefix}.type_share", self.type_share, "must be in [0, 1]")
        if not (isinstance(self.type_context, (int, float)) and 0 <= self.type_context <= 1):
            raise ConfigError(f"{prefix}.type_context", self.type_context, "must be in [0, 1]")
        if not (isinstance(self.type_repeat, (int, float)) and 0 <= self.type_repeat <= 1):
            raise ConfigError(f"{prefix}.type_repeat", self.type_repeat, "must be in [0, 1]")
        if not (isinstance(self.locality, (int, float)) and 0 <= self.locality < 1):
            raise ConfigError(f"{prefix}.locality", self.locality, "must be in [0, 1)")
        if not (isinstance(self.temperature, (int, float)) and 0 < self.temperature < math.inf):
            raise ConfigError(f"{prefix}.temperature", self.temperature, "must be finite and > 0")
        if self.arrival_rate_rps is not None and not 0 < self.arrival_rate_rps < math.inf:
            raise ConfigError(
                f"{prefix}.arrival_rate_rps",
                self.arrival_rate_rps,
                "must be a finite number > 0, or null",
            )
        if self.arrival_rate_rps is not None and self.arrivals_csv is not None:
            raise ConfigError(
                f"{prefix}.arrivals_csv",
                self.arrivals_csv,
                "set either arrival_rate_rps or arrivals_csv, not both",
            )
        if isinstance(self.shift_at, bool) or not isinstance(self.shift_at, int):
            raise ConfigError(f"{prefix}.shift_at", self.shift_at, "must be an integer >= 0")
        if self.shift_at < 0:
            raise ConfigError(f"{prefix}.shift_at", self.shift_at, "must be an integer >= 0")
        if self.shift_at and self.num_topics < 2:
            raise ConfigError(
                f"{prefix}.shift_at", self.shift_at, "a shift needs num_topics >= 2 (two halves)"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"{prefix}.seed", self.seed, "must be an integer >= 0")
        return self


#: the most logits the token types' profiles may hold (``token_types x L x E``; 2 GB)
MAX_TYPE_LOGITS = 2**28
#: knobs that only matter with ``type_share > 0``: left out of :func:`synthetic_params`
#: without it
TYPE_KNOBS = ("type_share", "token_types", "type_zipf", "type_context", "type_repeat")
#: type knobs whose 0 leaves the model as it was without them: left out of
#: :func:`synthetic_params` at 0
TYPE_EXTRAS = ("type_context", "type_repeat")


def synthetic_params(cfg: SyntheticConfig) -> dict[str, object]:
    """The knobs of ``cfg`` as a trace's manifest and the trace cache's key record them:
    every field, less :data:`TYPE_KNOBS` where ``type_share`` is 0 and less each of
    :data:`TYPE_EXTRAS` where it is 0, so a trace made without token types, or without
    those, keeps the manifest and the cache name it had before the model had them."""
    params = dataclasses.asdict(cfg)
    if not cfg.type_share:
        for key in TYPE_KNOBS:
            del params[key]
    else:
        for key in TYPE_EXTRAS:
            if not params[key]:
                del params[key]
    return params


def _ar1(eps: np.ndarray, rho: float) -> np.ndarray:
    """The AR(1) process ``u[t] = sqrt(1 - rho^2) eps[t] + rho u[t-1]`` (``u[-1] = 0``)
    along axis 0 of ``eps`` (T, E): unit variance when ``eps[0]`` is scaled to the
    stationary law.  The same floating-point operations, in the same order, as
    ``scipy.signal.lfilter([sqrt(1 - rho^2)], [1, -rho], eps, axis=0)``."""
    u = math.sqrt(1 - rho * rho) * eps  # (T, E)
    prev = u[0]
    for t in range(1, len(u)):
        row = u[t]
        row += rho * prev
        prev = row
    return u


@dataclass
class _Types:
    """A request's token types: ``w (T,)`` per position; with ``type_context > 0``,
    ``inv (T,)`` each position's index among the request's types and ``own (U, L, E)``
    the request's own part of each type's profile."""

    w: np.ndarray
    inv: np.ndarray | None
    own: np.ndarray | None


@dataclass
class _Lengths:
    prompt: np.ndarray  # (R,) int
    output: np.ndarray  # (R,) int
    arrival_s: np.ndarray | None  # (R,) float


#: a number of seconds in a TIMESTAMP cell (``nan`` and ``inf`` included, to be refused)
_NUMBER = re.compile(r"[+-]?((\d+\.?\d*|\.\d+)([eE][+-]?\d+)?|inf|infinity|nan)", re.IGNORECASE)
_TIME_RULE = "TIMESTAMP is an ISO 8601 date-time or a number of seconds"


def _arrival_times_s(p: Path, cells: list[str]) -> np.ndarray:
    """Seconds since the first row of the TIMESTAMP ``cells`` of the CSV ``p``
    (the formats and the rules of :func:`read_azure_csv`)."""
    import pandas as pd

    text = [c.strip() for c in cells]
    is_num = np.array([_NUMBER.fullmatch(c) is not None for c in text], dtype=bool)
    stamps = pd.Series([None if n else c for c, n in zip(text, is_num, strict=True)], dtype=object)
    try:
        parsed = pd.to_datetime(stamps, errors="coerce", format="ISO8601")
    except (ValueError, TypeError) as exc:  # e.g. time zones mixed with naive times
        raise FmoesimError(
            f"{p}: TIMESTAMP: {str(exc).splitlines()[0]} (rule: {_TIME_RULE})"
        ) from None
    not_time = ~is_num & parsed.isna().to_numpy()
    mixed = is_num != is_num[0]
    bad = np.flatnonzero(not_time | mixed)
    if len(bad):
        row = int(bad[0])
        if not_time[row]:
            raise FmoesimError(
                f"{p} row {row + 1}: TIMESTAMP {cells[row]!r} is not a time (rule: {_TIME_RULE})"
            )
        first = "a number" if is_num[0] else "a date-time"
        raise FmoesimError(
            f"{p} row {row + 1}: TIMESTAMP {cells[row]!r} mixes numbers and date-times (row 1 "
            f"is {first}; rule: all date-times or all numbers of seconds)"
        )
    if is_num[0]:
        seconds = np.array([float(c) for c in text])
        bad = np.flatnonzero(~np.isfinite(seconds) | (seconds < 0))
        if len(bad):
            row = int(bad[0])
            what = "is not a finite number" if not np.isfinite(seconds[row]) else "is negative"
            raise FmoesimError(
                f"{p} row {row + 1}: TIMESTAMP {cells[row]!r} {what} "
                "(rule: a numeric TIMESTAMP is seconds, finite and >= 0)"
            )
        arrival = seconds - seconds[0]
    else:
        arrival = (parsed - parsed.iloc[0]).dt.total_seconds().to_numpy(dtype=np.float64)
    back = np.flatnonzero(np.diff(arrival) < 0)
    if len(back):
        row = int(back[0]) + 2  # the later of the two rows, counted from 1
        raise FmoesimError(f"{p} row {row}: TIMESTAMP goes backwards (rule: rows sorted by time)")
    return arrival


def read_azure_csv(path: str | os.PathLike[str], limit: int | None = None) -> _Lengths:
    """Read an Azure LLM inference trace (``TIMESTAMP,ContextTokens,GeneratedTokens``),
    its first ``limit`` rows if given.

    ``TIMESTAMP`` takes one of two formats, the same in every row:

    - ISO 8601 date-times, as in the Azure traces (``2023-11-16 18:17:03.9799600``;
      a ``T`` or a space between date and time, fractional seconds optional);
    - plain numbers, read as seconds (``0``, ``10.5``, ``2e3``): finite and >= 0.

    Arrival times are seconds since the first row (so a numeric column need not start
    at 0), and rows must be sorted by time.  The token columns hold positive integers
    of at most ``2**31 - 1`` (a trace's token columns are int32).
    Raises :class:`FmoesimError` naming the file, the row (data rows counted from 1) and
    the rule on a malformed file: an unparseable time, a column mixing numbers and
    date-times, a negative or non-finite number, times going backwards.
    """
    import pandas as pd  # local: keeps pandas out of the generator's import cost

    p = Path(path)
    if not p.is_file():
        what = "a directory, not a CSV file" if p.is_dir() else "arrival CSV not found"
        raise FmoesimError(f"{p}: {what}")
    try:
        # every cell as written (no "nan" or "" turned into a missing value unseen)
        df = pd.read_csv(p, nrows=limit, dtype={"TIMESTAMP": str}, keep_default_na=False)
    except Exception as exc:  # noqa: BLE001 - pandas raises many types; report one line
        raise FmoesimError(f"{p}: not a readable CSV ({str(exc).splitlines()[0]})") from None
    need = ["TIMESTAMP", "ContextTokens", "GeneratedTokens"]
    missing = [c for c in need if c not in df.columns]
    if missing:
        raise FmoesimError(
            f"{p}: missing column(s) {missing} (rule: Azure format has columns {need})"
        )
    if len(df) == 0:
        raise FmoesimError(f"{p}: no rows (rule: at least one request)")
    cells = [c if isinstance(c, str) else "" for c in df["TIMESTAMP"].to_list()]  # NA: ""
    arrival = _arrival_times_s(p, cells)
    out = []
    for col in need[1:]:
        vals = pd.to_numeric(df[col], errors="coerce").to_numpy(dtype=np.float64, na_value=np.nan)
        bad = ~np.isfinite(vals) | (vals < 1) | (vals != np.floor(vals)) | (vals > MAX_TOKENS)
        if bad.any():
            row = int(np.flatnonzero(bad)[0])
            raise FmoesimError(
                f"{p} row {row + 1}: {col} = {df[col].to_list()[row]!r} (rule: a positive integer "
                f"at most {MAX_TOKENS})"
            )
        out.append(vals.astype(np.int64))
    return _Lengths(prompt=out[0], output=out[1], arrival_s=arrival)


def read_mooncake_jsonl(path: str | os.PathLike[str], limit: int | None = None) -> _Lengths:
    """Read a Mooncake request trace (JSON lines, as kvcache-ai/Mooncake publishes its
    traces: ``{"timestamp": ms, "input_length": n, "output_length": m, ...}``), its first
    ``limit`` requests if given.

    ``timestamp`` is milliseconds (a finite number >= 0), lines sorted by it; arrival
    times are seconds since the first request.  ``input_length`` and ``output_length`` are
    positive integers of at most ``2**31 - 1``; other keys (``hash_ids``) are ignored.
    Blank lines and a byte-order mark are skipped, as the CSV reader skips them; ``limit``
    counts requests.
    Raises :class:`FmoesimError` naming the file, the line (counted from 1) and the rule
    on a malformed file.
    """
    import json

    p = Path(path)
    if not p.is_file():
        what = "a directory, not a JSON lines file" if p.is_dir() else "arrival file not found"
        raise FmoesimError(f"{p}: {what}")
    rule = 'rule: one JSON object a line, {"timestamp": ms, "input_length": n, "output_length": m}'
    times: list[float] = []
    cols: dict[str, list[int]] = {"input_length": [], "output_length": []}
    try:
        # utf-8-sig: a byte-order mark is not part of the first line
        with p.open(encoding="utf-8-sig") as f:
            for row, line in enumerate(f, start=1):
                if len(times) == limit:
                    break
                if not line.strip():
                    continue  # a blank line (a trailing one too) holds no request
                try:
                    obj = json.loads(line)
                except ValueError as exc:
                    why = str(exc).splitlines()[0]
                    raise FmoesimError(f"{p} line {row}: not JSON ({why}; {rule})") from None
                if not isinstance(obj, dict):
                    raise FmoesimError(f"{p} line {row}: not a JSON object ({rule})")
                t = obj.get("timestamp")
                if isinstance(t, bool) or not isinstance(t, (int, float)):
                    raise FmoesimError(
                        f"{p} line {row}: timestamp = {_short_repr(t)} (rule: a number of "
                        "milliseconds)"
                    )
                try:
                    t = float(t)  # an integer too large for a float: not finite
                except OverflowError:
                    t = math.inf
                if not (math.isfinite(t) and t >= 0):
                    raise FmoesimError(
                        f"{p} line {row}: timestamp = {_short_repr(obj['timestamp'])} (rule: "
                        "milliseconds, finite and >= 0)"
                    )
                if times and t / 1000.0 < times[-1]:
                    raise FmoesimError(
                        f"{p} line {row}: timestamp goes backwards (rule: lines sorted by time)"
                    )
                times.append(t / 1000.0)
                for key, vals in cols.items():
                    v = obj.get(key)
                    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_TOKENS:
                        raise FmoesimError(
                            f"{p} line {row}: {key} = {_short_repr(v)} (rule: a positive integer "
                            f"at most {MAX_TOKENS})"
                        )
                    vals.append(v)
    except UnicodeDecodeError as exc:
        raise FmoesimError(f"{p}: not UTF-8 text ({exc.reason}; {rule})") from None
    if not times:
        raise FmoesimError(f"{p}: no rows (rule: at least one request)")
    arrival = np.asarray(times, dtype=np.float64)
    return _Lengths(
        prompt=np.asarray(cols["input_length"], dtype=np.int64),
        output=np.asarray(cols["output_length"], dtype=np.int64),
        arrival_s=arrival - arrival[0],
    )


def _short_repr(value: object, width: int = 40) -> str:
    """``repr(value)``, cut to ``width`` characters with an ellipsis (a number of a
    thousand digits stays one readable line)."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def read_arrivals(path: str | os.PathLike[str], limit: int | None = None) -> _Lengths:
    """Read an arrival log, its first ``limit`` requests if given: a Mooncake trace
    (``.jsonl``: :func:`read_mooncake_jsonl`) or an Azure LLM inference trace (any other
    name: :func:`read_azure_csv`).  Prompt and output lengths per request, arrival times
    in seconds since the first request."""
    if Path(path).suffix.lower() == ".jsonl":
        return read_mooncake_jsonl(path, limit)
    return read_azure_csv(path, limit)


class SyntheticWorkload:
    """The generative model of the module docstring, for one model shape and config."""

    def __init__(self, model: ModelSpec, cfg: SyntheticConfig) -> None:
        self.model = model.validate()
        self.cfg = cfg.validate()
        L, E, D = model.num_layers, model.num_experts, cfg.embedding_dim
        ss = np.random.SeedSequence(cfg.seed)
        self._model_seed, self._length_seed, self._request_seq = ss.spawn(3)
        rng = np.random.default_rng(self._model_seed)
        ts = cfg.topic_share
        shared = rng.standard_normal((1, L, E))
        topical = rng.standard_normal((cfg.num_topics, L, E))
        self.base = cfg.skew * (math.sqrt(1 - ts) * shared + math.sqrt(ts) * topical)  # (T, L, E)
        self.cross = rng.standard_normal((L, E, E)) / math.sqrt(model.top_k)  # (L, E_prev, E)
        self.centroids = rng.standard_normal((cfg.num_topics, D)) / math.sqrt(max(D, 1))  # (T, D)
        # drawn last, so the draws above do not depend on depth_share
        self.rotation = _rotations(rng, L, E) if cfg.depth_share else None  # (L, E, E)
        # and these after it, so nothing above depends on type_share
        self.type_logits: np.ndarray | None = None  # (V, L, E) W of the module docstring
        self.type_freq: np.ndarray | None = None  # (V,) P(w)
        if cfg.type_share:
            if cfg.token_types * L * E > MAX_TYPE_LOGITS:
                raise ConfigError(
                    "workload.synthetic.token_types",
                    cfg.token_types,
                    f"token_types x layers x experts ({L} x {E}) must be at most "
                    f"{MAX_TYPE_LOGITS:,} (the types' logit profiles, 8 bytes each)",
                )
            self.type_logits = rng.standard_normal((cfg.token_types, L, E))
            zipf = 1.0 / np.arange(1, cfg.token_types + 1) ** cfg.type_zipf
            self.type_freq = zipf / zipf.sum()

    # -- lengths and arrivals ----------------------------------------------------------
    def lengths(self) -> _Lengths:
        """Prompt/output lengths and arrival times of all requests.

        Prompt lengths, output lengths and inter-arrival gaps come from three separate
        streams, so the first ``r`` requests keep their lengths when more are added.
        """
        cfg, R = self.cfg, self.cfg.num_requests
        if cfg.arrivals_csv:
            lens = read_arrivals(cfg.arrivals_csv, limit=R)
            if len(lens.prompt) < R:
                raise ConfigError(
                    "workload.synthetic.num_requests",
                    R,
                    f"{cfg.arrivals_csv} has only {len(lens.prompt)} rows",
                )
            lens.prompt = np.minimum(lens.prompt, cfg.prompt_tokens_max)
            lens.output = np.minimum(lens.output, cfg.output_tokens_max)
            return lens

        def lognormal(stream: int, median: int, sigma: float, hi: int) -> np.ndarray:
            rng = np.random.default_rng(_child(self._length_seed, stream))
            v = np.exp(np.log(median) + sigma * rng.standard_normal(R))
            return np.clip(np.rint(v), 1, hi).astype(np.int64)

        prompt = lognormal(
            0, cfg.prompt_tokens_median, cfg.prompt_tokens_sigma, cfg.prompt_tokens_max
        )
        output = lognormal(
            1, cfg.output_tokens_median, cfg.output_tokens_sigma, cfg.output_tokens_max
        )
        arrival = None
        if cfg.arrival_rate_rps:
            rng = np.random.default_rng(_child(self._length_seed, 2))
            arrival = np.cumsum(rng.exponential(1.0 / cfg.arrival_rate_rps, R))
        return _Lengths(prompt, output, arrival)

    # -- one request ------------------------------------------------------------------
    def request(self, r: int, prompt: int, output: int, seed: np.random.SeedSequence) -> dict:
        """Generate one request's iterations.

        Returns a dict of arrays: ``counts (O, L, E)``, ``probs (O, L, E)`` (zero rows
        where a layer sees no token), ``spec_probs (O, L, E)`` (NaN rows where null),
        ``embedding (O, D)``, ``num_tokens (O,)`` (each iteration's: the prompt at
        iteration 0, 1 after), ``layer_tokens (O, L)`` (the tokens each layer sees: the
        iteration's at every layer of a decoder-only model; for an encoder-decoder model
        the prompt at iteration 0 and 0 after at an encoder layer, 1 at a decoder
        layer) and ``topic``.
        """
        cfg, m = self.cfg, self.model
        L, E, D = m.num_layers, m.num_experts, cfg.embedding_dim
        rng = np.random.default_rng(seed)
        if cfg.shift_at:  # a workload shift: one half of the topics before it, one after
            half = cfg.num_topics // 2
            if r < cfg.shift_at:
                topic = int(rng.integers(half))
            else:
                topic = half + int(rng.integers(cfg.num_topics - half))
        else:
            topic = int(rng.integers(cfg.num_topics))
        T = prompt + output - 1  # token positions fed to the model
        # iteration of each position: prompt -> 0, then one position per decode iteration
        it_of_pos = np.concatenate([np.zeros(prompt, np.int64), np.arange(1, output)])
        jitter = cfg.request_jitter * rng.standard_normal((L, E))
        ntok = np.bincount(it_of_pos, minlength=output).astype(np.float64)  # (O,)
        if m.encoder_layers:
            counts, probs, spec = self._encoder_decoder_layers(
                rng, seed, topic, jitter, prompt, output
            )
            layer_tokens = np.ones((output, L), np.int64)
            layer_tokens[:, : m.encoder_layers] = 0
            layer_tokens[0, : m.encoder_layers] = prompt
        else:
            counts, probs, spec = self._decoder_layers(rng, seed, topic, jitter, it_of_pos, ntok)
            layer_tokens = np.repeat(ntok.astype(np.int64)[:, None], L, axis=1)
        # embeddings: request near its topic centroid, tokens around the request
        emb = np.zeros((output, D))
        if D:
            scale = 1.0 / math.sqrt(D)
            req_emb = self.centroids[topic] + cfg.topic_spread * scale * rng.standard_normal(D)
            tok = req_emb + cfg.token_noise * scale * rng.standard_normal((T, D))
            np.add.at(emb, it_of_pos, tok)
            emb /= ntok[:, None]
        return {
            "counts": counts,
            "probs": probs,
            "spec_probs": spec,
            "embedding": emb,
            "num_tokens": ntok.astype(np.int64),
            "layer_tokens": layer_tokens,
            "topic": topic,
        }

    def _token_state(self, seed: np.random.SeedSequence, stream: int, T: int) -> np.ndarray | None:
        """The token state ``z (T, E)`` shared by all layers, from child ``stream`` of the
        request's seed; None when ``depth_share`` is 0."""
        if self.rotation is None:
            return None
        rho = self.cfg.locality
        eps_z = np.random.default_rng(_child(seed, stream)).standard_normal(
            (T, self.model.num_experts)
        )
        eps_z[0] /= math.sqrt(1 - rho * rho)
        return _ar1(eps_z, rho)

    def _token_types(self, seed: np.random.SeedSequence, stream: int, T: int) -> np.ndarray | None:
        """The type ``w (T,)`` of each of ``T`` token positions, from child ``stream`` of
        the request's seed; None when ``type_share`` is 0.  With ``type_repeat = r > 0``
        each position after the first, with probability ``r``, takes the type of an
        earlier position of the same request, drawn uniformly (drawn after the types, so
        ``r = 0`` draws nothing more)."""
        if self.type_freq is None:
            return None
        rng = np.random.default_rng(_child(seed, stream))
        w = rng.choice(len(self.type_freq), size=T, p=self.type_freq)  # (T,)
        r = self.cfg.type_repeat
        if r and T > 1:
            repeat = rng.random(T) < r  # (T,) which positions repeat
            source = np.floor(rng.random(T) * np.arange(T)).astype(np.int64)  # (T,) in [0, n)
            for n in np.flatnonzero(repeat[1:]) + 1:
                w[n] = w[source[n]]  # in order: a repeat of a repeat copies the final type
        return w

    def _types(self, seed: np.random.SeedSequence, stream: int, T: int) -> _Types | None:
        """The token types of ``T`` positions (:meth:`_token_types`, child ``stream``)
        with, where ``type_context > 0``, the request's own profile ``V (U, L, E)`` of
        each of the ``U`` types it holds (child ``stream + 2``, in the order of the type
        numbers); None when ``type_share`` is 0."""
        w = self._token_types(seed, stream, T)
        if w is None:
            return None
        if not self.cfg.type_context:
            return _Types(w, None, None)
        held, inv = np.unique(w, return_inverse=True)  # (U,), (T,)
        rng = np.random.default_rng(_child(seed, stream + 2))
        shape = (len(held), self.model.num_layers, self.model.num_experts)
        return _Types(w, inv, rng.standard_normal(shape))

    def _type_rows(self, types: _Types, layer: int) -> np.ndarray:
        """The type profiles ``(T, E)`` of the positions of ``types`` at ``layer``: ``W[w,
        l]``, or ``sqrt(1 - c) W[w, l] + sqrt(c) V[r, w, l]`` with the request's own part
        at ``c = type_context``."""
        assert self.type_logits is not None
        rows = self.type_logits[types.w, layer]  # (T, E)
        if types.own is None:
            return rows
        assert types.inv is not None
        c = self.cfg.type_context
        return math.sqrt(1 - c) * rows + math.sqrt(c) * types.own[types.inv, layer]

    def _logits(
        self,
        rng: np.random.Generator,
        topic: int,
        layer: int,
        jitter: np.ndarray,
        z: np.ndarray | None,
        prev_sel: np.ndarray | None,
        T: int,
        types: _Types | None = None,
    ) -> np.ndarray:
        """Router logits ``x (T, E)`` of ``T`` token positions at ``layer`` (module
        docstring), ``prev_sel (T, E)`` the experts chosen at the layer before, ``types
        (T,)`` the positions' token types (:meth:`_types`; None without them)."""
        cfg, E = self.cfg, self.model.num_experts
        rho, h = cfg.locality, cfg.depth_share
        eps = rng.standard_normal((T, E))
        eps[0] /= math.sqrt(1 - rho * rho)  # start the AR(1) in its stationary law
        u = _ar1(eps, rho)  # (T, E)
        if z is not None:
            assert self.rotation is not None
            u = math.sqrt(1 - h) * u + math.sqrt(h) * (z @ self.rotation[layer].T)
        if types is not None:
            assert self.type_logits is not None
            g = cfg.type_share
            u = math.sqrt(1 - g) * u + math.sqrt(g) * self._type_rows(types, layer)
        x = self.base[topic, layer] + jitter[layer] + cfg.noise * u
        if prev_sel is not None and cfg.cross_layer:
            x += cfg.cross_layer * (prev_sel @ self.cross[layer])
        return x

    def _select(self, p: np.ndarray) -> np.ndarray:
        """The top-k experts of each row of ``p (T, E)`` as a 0/1 array ``(T, E)``."""
        k = self.model.top_k
        top = np.argpartition(-p, k - 1, axis=1)[:, :k]  # (T, k)
        sel = np.zeros(p.shape)
        np.put_along_axis(sel, top, 1.0, axis=1)
        return sel

    def _decoder_layers(
        self,
        rng: np.random.Generator,
        seed: np.random.SeedSequence,
        topic: int,
        jitter: np.ndarray,
        it_of_pos: np.ndarray,
        ntok: np.ndarray,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``counts, probs, spec_probs (O, L, E)`` of a decoder-only model: every layer
        routes the ``T`` positions, position ``t`` in iteration ``it_of_pos[t]``."""
        cfg, m = self.cfg, self.model
        L, E = m.num_layers, m.num_experts
        T, output = len(it_of_pos), len(ntok)
        counts = np.zeros((output, L, E), np.int32)
        probs = np.zeros((output, L, E), np.float64)
        spec = np.full((output, L, E), np.nan)
        prev_sel: np.ndarray | None = None  # (T, E) 0/1 experts chosen at layer l-1
        z = self._token_state(seed, 0, T)  # (T, E) the token state shared by all layers
        types = self._types(seed, _TYPE_STREAM, T)  # (T,) types or None
        for layer in range(L):
            x = self._logits(rng, topic, layer, jitter, z, prev_sel, T, types)
            p = _softmax(x / cfg.temperature)  # (T, E)
            sel = self._select(p)
            np.add.at(counts[:, layer, :], it_of_pos, sel.astype(np.int32))
            np.add.at(probs[:, layer, :], it_of_pos, p)
            # speculative prediction of this layer, made one layer early
            if layer == 0:
                sp = None
                if output > 1:
                    # predicted from the previous position's last-layer state (decode only)
                    sp_noise = cfg.spec_noise_first_layer
                    sp = x + sp_noise * rng.standard_normal((T, E))
            else:
                sp = x + cfg.spec_noise * rng.standard_normal((T, E))
            if sp is not None:
                sq = _softmax(sp / cfg.temperature)
                acc = np.zeros((output, E))
                np.add.at(acc, it_of_pos, sq)
                acc /= ntok[:, None]
                if layer == 0:
                    acc[0] = np.nan  # prefill: nothing precedes layer 0
                spec[:, layer, :] = acc
            prev_sel = sel
        probs /= ntok[:, None, None]
        return counts, probs, spec

    def _encoder_decoder_layers(
        self,
        rng: np.random.Generator,
        seed: np.random.SeedSequence,
        topic: int,
        jitter: np.ndarray,
        prompt: int,
        output: int,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``counts, probs, spec_probs (O, L, E)`` of an encoder-decoder model (module
        docstring): the encoder layers route the ``prompt`` positions in iteration 0,
        the decoder layers one position per iteration."""
        cfg, m = self.cfg, self.model
        L, E, n = m.num_layers, m.num_experts, m.encoder_layers
        counts = np.zeros((output, L, E), np.int32)
        probs = np.zeros((output, L, E), np.float64)
        spec = np.full((output, L, E), np.nan)
        z_enc = self._token_state(seed, 0, prompt)  # (P, E)
        z_dec = self._token_state(seed, _DECODER_STREAM, output)  # (O, E)
        types_enc = self._types(seed, _TYPE_STREAM, prompt)  # (P,) types or None
        types_dec = self._types(seed, _TYPE_STREAM + 1, output)  # (O,) types or None
        prev_sel: np.ndarray | None = None
        for layer in range(L):
            encoder = layer < n
            if layer == n:
                prev_sel = None  # no cross-layer link from the encoder to the decoder
            T = prompt if encoder else output
            x = self._logits(
                rng, topic, layer, jitter, z_enc if encoder else z_dec, prev_sel, T,
                types_enc if encoder else types_dec,
            )  # fmt: skip
            p = _softmax(x / cfg.temperature)  # (T, E)
            sel = self._select(p)
            # speculative prediction of this layer, made one layer early; nothing precedes
            # the encoder's first layer, and the decoder's first layer is predicted from
            # the previous position's last-layer state (decode only)
            sp = None
            if layer == n:
                if output > 1:
                    sp = x + cfg.spec_noise_first_layer * rng.standard_normal((T, E))
            elif layer != 0:
                sp = x + cfg.spec_noise * rng.standard_normal((T, E))
            if encoder:  # all positions in iteration 0
                counts[0, layer] = sel.sum(axis=0)
                probs[0, layer] = p.sum(axis=0) / prompt
                if sp is not None:
                    spec[0, layer] = _softmax(sp / cfg.temperature).sum(axis=0) / prompt
            else:  # position j in iteration j
                counts[:, layer] = sel
                probs[:, layer] = p
                if sp is not None:
                    spec[:, layer] = _softmax(sp / cfg.temperature)
                    if layer == n:
                        spec[0, layer] = np.nan  # iteration 0: nothing precedes it
            prev_sel = sel
        return counts, probs, spec

    def dataset_of(self, r: int) -> str:
        """The dataset label of request ``r``: ``<dataset>-shifted`` after a shift."""
        cfg = self.cfg
        return f"{cfg.dataset}-shifted" if 0 < cfg.shift_at <= r else cfg.dataset

    # -- whole trace ------------------------------------------------------------------
    def write(
        self, path: str | os.PathLike[str], *, overwrite: bool = False, progress: bool = False
    ) -> Path:
        """Generate the whole trace into ``path`` (streaming, atomic)."""
        cfg, m = self.cfg, self.model
        lens = self.lengths()
        params = synthetic_params(cfg)
        first_layers = 2 if m.encoder_layers else 1
        manifest = TraceManifest(
            model=TraceModel.of(m),
            embedding_dim=cfg.embedding_dim,
            source={
                "kind": "synthetic",
                "generator": GENERATOR,
                "code": GENERATOR_CODE,
                "params": params,
                "seed": cfg.seed,
            },
            has_probs=True,
            # a decode predicts the (decoder's) first layer; the prefill predicts every
            # layer but the first (the encoder's and the decoder's first, for an
            # encoder-decoder model)
            has_spec_probs=bool(lens.output.max() > 1 or m.num_layers > first_layers),
            created_at=None,
            notes="Synthetic trace from fmoesim's workload model; not real routing data.",
        )
        # not self._request_seq.spawn(): spawn() is stateful, a second write() would differ
        seeds = [_child(self._request_seq, r) for r in range(cfg.num_requests)]
        with TraceWriter(path, manifest, overwrite=overwrite) as w:  # checks the path first
            it = range(cfg.num_requests)
            if progress:
                from tqdm import tqdm

                it = tqdm(it, desc="synth", unit="req", disable=None)  # a terminal only
            for r in it:
                n_prompt, n_out = int(lens.prompt[r]), int(lens.output[r])
                arrival = None if lens.arrival_s is None else float(lens.arrival_s[r])
                w.add_request(r, n_prompt, n_out, arrival, self.dataset_of(r))
                g = self.request(r, n_prompt, n_out, seeds[r])
                for i in range(n_out):
                    w.add_iteration(
                        r,
                        i,
                        int(g["num_tokens"][i]),
                        g["embedding"][i] if cfg.embedding_dim else None,
                        g["counts"][i],
                        g["probs"][i],
                        g["spec_probs"][i],
                        layer_tokens=g["layer_tokens"][i] if m.encoder_layers else None,
                    )
        return Path(path)


#: child of a request's seed that draws the decoder's token state (encoder-decoder
#: models; child 0 draws the encoder's, or the decoder-only model's)
_DECODER_STREAM = 1
#: the child of a request's seed that draws its token types (the next one: an
#: encoder-decoder model's decoder positions; two on, the request's own part of their
#: profiles)
_TYPE_STREAM = 2


def _rotations(rng: np.random.Generator, L: int, E: int) -> np.ndarray:
    """``L`` random orthogonal ``E x E`` matrices ``(L, E, E)``, Haar-distributed (QR of
    a Gaussian matrix with the signs of R's diagonal folded in)."""
    q, r = np.linalg.qr(rng.standard_normal((L, E, E)))
    return q * np.sign(np.diagonal(r, axis1=1, axis2=2))[:, None, :]


def _child(seq: np.random.SeedSequence, i: int) -> np.random.SeedSequence:
    """Child ``i`` of ``seq``, as ``seq.spawn`` would make it, without mutating ``seq``."""
    return np.random.SeedSequence(
        seq.entropy, spawn_key=(*seq.spawn_key, i), pool_size=seq.pool_size
    )


def _softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of a (T, E) array."""
    z = x - x.max(axis=1, keepdims=True)
    np.exp(z, out=z)
    z /= z.sum(axis=1, keepdims=True)
    return z


def generator_digest() -> str:
    """16 hex digits of SHA-256 over the code of :data:`GENERATOR_SOURCES` (paths and
    contents, as the files are now) and numpy's version: equal digests, equal bytes for
    the same model, knobs and arrival file."""
    import hashlib

    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for rel in GENERATOR_SOURCES:
        h.update(rel.encode())
        h.update((root / rel).read_bytes())
    h.update(np.__version__.encode())
    return h.hexdigest()[:16]


#: :func:`generator_digest` of the code this process loaded (taken at import, so an
#: edit of the files afterwards does not relabel what the loaded code makes); every
#: generated trace's manifest carries it as ``source["code"]``
GENERATOR_CODE = generator_digest()


def arrivals_digest(cfg: SyntheticConfig) -> str | None:
    """16 hex digits of SHA-256 over the bytes of ``cfg.arrivals_csv``; None without one
    or where it cannot be read (reading it then fails with its own one-line error)."""
    import hashlib

    if not cfg.arrivals_csv:
        return None
    try:
        return hashlib.sha256(Path(cfg.arrivals_csv).read_bytes()).hexdigest()[:16]
    except OSError:
        return None


def generate(
    model: ModelSpec,
    cfg: SyntheticConfig,
    path: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> Path:
    """Generate a synthetic trace for ``model`` with ``cfg`` into ``path``."""
    return SyntheticWorkload(model, cfg).write(path, overwrite=overwrite, progress=progress)
