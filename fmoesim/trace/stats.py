"""Per-layer statistics of a trace (what ``fmoesim-trace inspect`` prints)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fmoesim.trace.reader import Trace


@dataclass
class LayerStats:
    """Statistics of one MoE layer over the whole trace; arrays are ``(L,)``."""

    coarse_entropy: np.ndarray  # normalised entropy of expert frequencies (1 = uniform)
    fine_entropy: np.ndarray  # mean normalised entropy of per-iteration probs (NaN without probs)
    gini: np.ndarray  # Gini coefficient of expert frequencies (0 = uniform)
    max_over_mean: np.ndarray  # frequency of the most popular expert / mean frequency
    next_token_reuse: np.ndarray  # P(an expert of decode token n is also used by token n+1)
    spec_top_k_recall: (
        np.ndarray
    )  # fraction of routed experts among spec_probs' top-k (NaN if none)


def _entropy(p: np.ndarray, axis: int = -1) -> np.ndarray:
    """Shannon entropy in nats of distributions along ``axis`` (rows need not be normalised)."""
    p = np.asarray(p, dtype=np.float64)
    p = p / np.maximum(p.sum(axis=axis, keepdims=True), 1e-300)
    with np.errstate(divide="ignore", invalid="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(axis=axis)
    return h


def gini(freq: np.ndarray) -> np.ndarray:
    """Gini coefficient of non-negative frequencies along the last axis."""
    x = np.sort(np.asarray(freq, dtype=np.float64), axis=-1)
    n = x.shape[-1]
    cum = np.cumsum(x, axis=-1)
    total = cum[..., -1]
    g = (n + 1 - 2 * (cum.sum(axis=-1) / np.maximum(total, 1e-300))) / n
    return np.where(total > 0, g, 0.0)


def next_token_reuse(trace: Trace) -> np.ndarray:
    """Per layer, the mean fraction of experts used by decode token n reused by token n+1.

    Only pairs of consecutive single-token (decode) iterations of the same request count;
    in an encoder-decoder trace, per layer, pairs of consecutive iterations where the
    layer sees one token each (a decoder layer: every iteration; an encoder layer: none,
    NaN).
    """
    active = trace.counts > 0  # (N, L, E)
    same_req = trace.iter_request[1:] == trace.iter_request[:-1]
    if trace.encoder_layers:
        one = trace.layer_tokens == 1  # (N, L)
        pairs = same_req[:, None] & one[1:] & one[:-1]  # (N-1, L)
        a, b = active[:-1], active[1:]  # (N-1, L, E)
        share = (a & b).sum(axis=2) / np.maximum(a.sum(axis=2), 1)  # (N-1, L)
        n = pairs.sum(axis=0)
        with np.errstate(invalid="ignore"):
            return np.where(n > 0, (share * pairs).sum(axis=0) / np.maximum(n, 1), np.nan)
    n_tok = trace.num_tokens
    pair = same_req & (n_tok[1:] == 1) & (n_tok[:-1] == 1)  # (N-1,)
    if not pair.any():
        return np.full(trace.num_layers, np.nan)
    a, b = active[:-1][pair], active[1:][pair]  # (P, L, E)
    shared = (a & b).sum(axis=2)
    return (shared / np.maximum(a.sum(axis=2), 1)).mean(axis=0)


def spec_recall(trace: Trace) -> np.ndarray:
    """Per layer ``(L,)``, the mean fraction of a decode token's routed experts that are
    among the top-k of its speculative probabilities (the prediction made one layer
    early, MoEpic eq. 3): ``k`` times it is how many of the ``k`` experts a next-layer
    prefetcher guesses right (MoEpic Fig. 2(c)).  NaN for a layer without a prediction
    (every layer, in a trace without ``spec_probs``).  In an encoder-decoder trace the
    rows counted at a layer are those where it sees one token (a decoder layer's)."""
    L, k = trace.num_layers, trace.top_k
    if trace.spec_probs is None or trace.spec_valid is None:
        return np.full(L, np.nan)
    # one token at a layer: its routed set is the top-k (decoder-only: the decode rows)
    one = trace.layer_tokens == 1  # (N, L)
    dec = np.flatnonzero(one.any(axis=1))
    valid = trace.spec_valid[dec] & one[dec]  # (D, L)
    spec = trace.spec_probs[dec].astype(np.float32)  # (D, L, E)
    top = np.argpartition(-spec, k - 1, axis=2)[..., :k]  # (D, L, k)
    hit = np.take_along_axis(trace.counts[dec] > 0, top, axis=2).sum(axis=2) / k  # (D, L)
    n = valid.sum(axis=0)
    with np.errstate(invalid="ignore"):
        return np.where(n > 0, (hit * valid).sum(axis=0) / np.maximum(n, 1), np.nan)


def layer_stats(trace: Trace) -> LayerStats:
    """Compute :class:`LayerStats` for every layer of ``trace``."""
    E = trace.num_experts
    freq = trace.counts.sum(axis=0, dtype=np.int64)  # (L, E)
    norm = np.log(E) if E > 1 else 1.0
    coarse = _entropy(freq) / norm
    if trace.probs is not None and trace.encoder_layers:
        # rows where a layer sees no token (encoder layers after iteration 0) left out
        sees = trace.layer_tokens > 0  # (N, L)
        ent = _entropy(trace.probs.astype(np.float32)) / norm  # (N, L)
        fine = (ent * sees).sum(axis=0) / sees.sum(axis=0)
    elif trace.probs is not None:
        fine = (_entropy(trace.probs.astype(np.float32)) / norm).mean(axis=0)
    else:
        fine = np.full(trace.num_layers, np.nan)
    mean = np.maximum(freq.mean(axis=1), 1e-300)
    return LayerStats(
        coarse_entropy=coarse,
        fine_entropy=fine,
        gini=gini(freq),
        max_over_mean=freq.max(axis=1) / mean,
        next_token_reuse=next_token_reuse(trace),
        spec_top_k_recall=spec_recall(trace),
    )


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"


def format_report(trace: Trace) -> str:
    """A human-readable report: shape, sizes and the per-layer statistics table."""
    m, man = trace.manifest.model, trace.manifest
    src = man.source.get("kind", "?")
    lines = [
        f"trace      {trace.path}",
        f"source     {src}"
        + (" (not real routing data)" if src == "synthetic" else "")
        + (f", seed {man.source.get('seed')}" if "seed" in man.source else ""),
        f"model      {m.name}: {m.num_layers} MoE layers x {m.num_experts} experts, top-{m.top_k}"
        + (f", {m.num_shared_experts} shared" if m.num_shared_experts else "")
        + (f", {m.dense_layers} dense layers" if m.dense_layers else "")
        + (f", the first {m.encoder_layers} in the encoder" if m.encoder_layers else ""),
        f"requests   {trace.num_requests}  (prompt tokens mean {trace.prompt_tokens.mean():.1f}, "
        f"output tokens mean {trace.output_tokens.mean():.1f})",
        f"iterations {trace.num_iterations}  ({int(trace.num_tokens.sum())} tokens; "
        f"{trace.num_iterations * m.num_layers} routing rows)"
        + (
            f"; layer gaps: {man.source.get('missing_token_layers', 'some')} (token, layer) "
            "pairs route nothing"
            if man.layer_gaps
            else ""
        ),
        f"columns    probs: {'yes' if trace.probs is not None else 'no (top-k only)'}, "
        f"spec_probs: {'yes' if trace.spec_probs is not None else 'no'}, "
        f"embedding dim: {man.embedding_dim}",
        "files      " + ", ".join(f"{k} {_human(v)}" for k, v in trace.files_bytes().items()),
        "",
    ]
    s = layer_stats(trace)
    head = (
        f"{'layer':>5} {'H_coarse':>9} {'H_fine':>8} {'gini':>6} {'max/mean':>9} "
        f"{'reuse':>6} {'spec_rec':>8}"
    )
    lines += [head, "-" * len(head)]

    def f(x: float, w: int, p: int = 3) -> str:
        return f"{'-':>{w}}" if np.isnan(x) else f"{x:>{w}.{p}f}"

    for layer in range(trace.num_layers):
        lines.append(
            f"{layer:>5} {f(s.coarse_entropy[layer], 9)} {f(s.fine_entropy[layer], 8)} "
            f"{f(s.gini[layer], 6)} {f(s.max_over_mean[layer], 9, 2)} "
            f"{f(s.next_token_reuse[layer], 6)} {f(s.spec_top_k_recall[layer], 8)}"
        )
    lines.append("-" * len(head))

    def mean(a: np.ndarray) -> float:
        return float("nan") if np.isnan(a).all() else float(np.nanmean(a))

    lines.append(
        f"{'mean':>5} {f(mean(s.coarse_entropy), 9)} {f(mean(s.fine_entropy), 8)} "
        f"{f(s.gini.mean(), 6)} {f(s.max_over_mean.mean(), 9, 2)} "
        f"{f(mean(s.next_token_reuse), 6)} {f(mean(s.spec_top_k_recall), 8)}"
    )
    lines += [
        "",
        "H_coarse: entropy of expert frequencies over the whole trace / log(E) (1 = uniform);",
        "H_fine: mean entropy of one iteration's gate probabilities / log(E) (fMoE Fig. 3);",
        "gini, max/mean: skew of expert frequencies; reuse: P(expert of decode token n is",
        "used again by token n+1); spec_rec: share of routed experts in spec_probs' top-k.",
    ]
    return "\n".join(lines)
