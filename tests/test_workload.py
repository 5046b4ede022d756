"""The synthetic workload model: determinism, validity, knob directions, CSV input, configs."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest

from fmoesim.errors import ConfigError, FmoesimError
from fmoesim.specs import ModelSpec
from fmoesim.trace import Trace, read_trace
from fmoesim.trace import schema as S
from fmoesim.workload import SyntheticConfig, SyntheticWorkload, generate, read_azure_csv
from fmoesim.workload.synthetic import (
    GENERATOR,
    GENERATOR_CODE,
    TYPE_KNOBS,
    _child,
    synthetic_params,
)

MODEL = ModelSpec(
    name="tiny-moe",
    num_layers=4,
    num_experts=16,
    top_k=2,
    hidden_size=64,
    expert_intermediate_size=64,
)
BASE = SyntheticConfig(
    num_requests=12,
    num_topics=4,
    embedding_dim=16,
    prompt_tokens_median=16,
    prompt_tokens_max=64,
    output_tokens_median=32,
    output_tokens_max=64,
)
SEEDS = (0, 1, 2)


def _gen(tmp_path: Path, name: str, model: ModelSpec = MODEL, **knobs: object) -> Trace:
    cfg = dataclasses.replace(BASE, **knobs)
    return read_trace(generate(model, cfg, tmp_path / name))


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


# -- statistics the knob tests measure -------------------------------------------------------
def activation_entropy(tr: Trace) -> float:
    """Mean over layers of the normalised entropy of the layer's total expert counts."""
    freq = tr.counts.sum(axis=0, dtype=np.float64)  # (L, E)
    p = freq / freq.sum(axis=1, keepdims=True)
    plogp = np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0)
    return float((-plogp.sum(axis=1) / math.log(tr.num_experts)).mean())


def next_token_reuse(tr: Trace) -> float:
    """Mean fraction of the k experts of decode token n also selected at token n+1."""
    overlaps = []
    for r in range(tr.num_requests):
        decode = list(tr.request_iterations(r))[1:]  # one token each
        for a, b in zip(decode[:-1], decode[1:], strict=True):
            both = (tr.counts[a] > 0) & (tr.counts[b] > 0)  # (L, E)
            overlaps.append(both.sum(axis=1) / tr.top_k)
    return float(np.mean(overlaps))


def test_statistics_on_hand_made_counts() -> None:
    """The two statistics themselves, on a 2-request trace computed by hand."""
    counts = np.zeros((5, 1, 4), dtype=np.int32)
    counts[0, 0] = [2, 2, 2, 2]  # prefill, 4 tokens: not a decode step
    counts[1, 0] = [1, 1, 0, 0]
    counts[2, 0] = [1, 0, 1, 0]  # 1 of 2 reused
    counts[3, 0] = [1, 0, 0, 1]  # prefill of request 1
    counts[4, 0] = [1, 0, 0, 1]  # only decode of request 1: no pair
    starts = [0, 3, 5]  # request 0: iterations 0-2, request 1: iterations 3-4
    tr = SimpleNamespace(
        counts=counts,
        num_experts=4,
        top_k=2,
        num_requests=2,
        request_iterations=lambda r: range(starts[r], starts[r + 1]),
    )
    assert next_token_reuse(tr) == 0.5
    # totals [6, 3, 3, 4] of 16
    p = np.array([6, 3, 3, 4]) / 16
    assert activation_entropy(tr) == pytest.approx(-(p * np.log(p)).sum() / math.log(4))


# -- determinism -------------------------------------------------------------------------
def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path) -> None:
    cfg = dataclasses.replace(BASE, seed=3)
    a = _files(generate(MODEL, cfg, tmp_path / "a"))
    b = _files(generate(MODEL, cfg, tmp_path / "b"))
    assert sorted(a) == sorted([S.MANIFEST, S.REQUESTS, S.ITERATIONS, S.ROUTING])
    assert a == b  # every file, trace.json included, byte for byte

    c = _files(generate(MODEL, dataclasses.replace(cfg, seed=4), tmp_path / "c"))
    assert c[S.ROUTING] != a[S.ROUTING]
    assert json.loads(c[S.MANIFEST])["source"]["seed"] == 4


def test_writing_twice_from_one_workload_gives_same_bytes(tmp_path: Path) -> None:
    wl = SyntheticWorkload(MODEL, dataclasses.replace(BASE, num_requests=4))
    assert _files(wl.write(tmp_path / "a")) == _files(wl.write(tmp_path / "b"))


def test_adding_requests_keeps_earlier_requests(tmp_path: Path) -> None:
    """The docstring's promise: request r does not change when more requests are added."""
    small = _gen(tmp_path, "r3", num_requests=3, arrival_rate_rps=2.0)
    big = _gen(tmp_path, "r5", num_requests=5, arrival_rate_rps=2.0)
    assert big.prompt_tokens[:3].tolist() == small.prompt_tokens.tolist()
    assert big.output_tokens[:3].tolist() == small.output_tokens.tolist()
    np.testing.assert_array_equal(big.arrival_s[:3], small.arrival_s)
    n = small.num_iterations
    np.testing.assert_array_equal(big.counts[:n], small.counts)
    np.testing.assert_array_equal(big.probs[:n], small.probs)
    np.testing.assert_array_equal(big.embedding[:n], small.embedding)


# -- validity and shape --------------------------------------------------------------------
def test_generated_trace_is_valid_and_consistent(tmp_path: Path) -> None:
    tr = _gen(tmp_path, "t", seed=5)  # read_trace validated every rule
    m = tr.manifest
    assert m.source == {
        "kind": "synthetic",
        "generator": GENERATOR,
        "code": GENERATOR_CODE,
        "params": synthetic_params(dataclasses.replace(BASE, seed=5)),
        "seed": 5,
    }
    # without token types their knobs stay out (the manifest of every earlier trace)
    assert not set(TYPE_KNOBS) & set(m.source["params"])
    assert m.created_at is None
    assert (m.model.num_layers, m.model.num_experts, m.model.top_k) == (4, 16, 2)
    assert m.num_requests == tr.num_requests == 12
    assert m.num_iterations == tr.num_iterations == int(tr.output_tokens.sum())
    assert tr.request_id.tolist() == list(range(12))
    assert ((tr.prompt_tokens >= 1) & (tr.prompt_tokens <= 64)).all()
    assert ((tr.output_tokens >= 1) & (tr.output_tokens <= 64)).all()
    assert np.isnan(tr.arrival_s).all()  # no arrival process: a static batch
    assert set(tr.dataset.tolist()) == {"synthetic"}

    prefill = tr.iteration == 0
    np.testing.assert_array_equal(tr.num_tokens[prefill], tr.prompt_tokens)
    assert (tr.num_tokens[~prefill] == 1).all()
    assert (tr.counts.sum(axis=2) == tr.num_tokens[:, None] * 2).all()
    np.testing.assert_allclose(tr.probs.astype(np.float64).sum(axis=2), 1.0, atol=1e-2)
    # spec_probs: null exactly on layer 0 of each prefill
    expected = np.ones((tr.num_iterations, 4), dtype=bool)
    expected[prefill, 0] = False
    np.testing.assert_array_equal(tr.spec_valid, expected)
    assert tr.embedding.shape == (tr.num_iterations, 16)


def test_request_arrays(tmp_path: Path) -> None:
    wl = SyntheticWorkload(MODEL, BASE)
    g = wl.request(0, prompt=5, output=4, seed=np.random.SeedSequence(11))
    assert g["counts"].shape == g["probs"].shape == g["spec_probs"].shape == (4, 4, 16)
    assert g["num_tokens"].tolist() == [5, 1, 1, 1]
    np.testing.assert_array_equal(
        g["counts"].sum(axis=2), np.array([[10] * 4, [2] * 4, [2] * 4, [2] * 4])
    )
    assert g["counts"].max() <= 5
    assert (g["counts"][1:] <= 1).all()  # one token picks k distinct experts
    np.testing.assert_allclose(g["probs"].sum(axis=2), 1.0, atol=1e-12)
    assert np.isnan(g["spec_probs"][0, 0]).all()
    assert not np.isnan(g["spec_probs"][1:]).any() and not np.isnan(g["spec_probs"][0, 1:]).any()
    assert g["embedding"].shape == (4, 16)
    assert 0 <= g["topic"] < BASE.num_topics


def test_no_embeddings_and_single_layer_without_spec(tmp_path: Path) -> None:
    tr = _gen(tmp_path, "noemb", embedding_dim=0)
    assert tr.embedding.shape == (tr.num_iterations, 0)
    assert "embedding" not in pq.read_schema(tmp_path / "noemb" / S.ITERATIONS).names

    # one layer and one output token per request: no layer has a speculative prediction
    one = dataclasses.replace(MODEL, num_layers=1)
    tr = _gen(tmp_path, "nospec", model=one, output_tokens_max=1, num_requests=4)
    assert not tr.manifest.has_spec_probs
    assert tr.spec_probs is None and tr.spec_valid is None
    assert tr.probs is not None and (tr.output_tokens == 1).all()


def test_poisson_arrivals() -> None:
    cfg = dataclasses.replace(BASE, num_requests=2000, arrival_rate_rps=4.0)
    lens = SyntheticWorkload(MODEL, cfg).lengths()
    gaps = np.diff(np.concatenate([[0.0], lens.arrival_s]))
    assert (gaps > 0).all()
    # mean gap 1/4 s; the sample mean of 2000 exponential gaps has sd 0.25/sqrt(2000) = 0.0056
    assert gaps.mean() == pytest.approx(0.25, abs=0.025)
    # log-normal lengths: the median is the configured median (before clipping at the max)
    assert np.median(lens.prompt) == pytest.approx(16, rel=0.15)
    assert np.median(lens.output) == pytest.approx(32, rel=0.15)


# -- the knobs move the statistics the right way ------------------------------------------
@pytest.mark.parametrize("seed", SEEDS)
def test_more_skew_lowers_activation_entropy(tmp_path: Path, seed: int) -> None:
    flat = activation_entropy(_gen(tmp_path, "flat", skew=0.5, seed=seed))
    steep = activation_entropy(_gen(tmp_path, "steep", skew=2.5, seed=seed))
    assert 0 < steep < flat <= 1
    assert flat - steep > 0.05, (flat, steep)


@pytest.mark.parametrize("seed", SEEDS)
def test_more_locality_raises_next_token_reuse(tmp_path: Path, seed: int) -> None:
    indep = next_token_reuse(_gen(tmp_path, "indep", locality=0.0, seed=seed))
    local = next_token_reuse(_gen(tmp_path, "local", locality=0.9, seed=seed))
    assert local - indep > 0.15, (indep, local)


@pytest.mark.parametrize("seed", SEEDS)
def test_depth_share_links_distant_layers_and_keeps_each_layer(tmp_path: Path, seed: int) -> None:
    """Red if the shared token state is not shared across layers (no dependence at
    distance 3), or if mixing it in changes a layer's own law (the sqrt weights lost:
    next-token reuse and activation entropy move)."""
    from fmoesim.workload.calibrate import depth_dependence

    model = dataclasses.replace(MODEL, num_layers=8, num_experts=8)
    knobs = dict(skew=0.3, locality=0.25, noise=2.0, request_jitter=0.0, seed=seed)
    knobs.update(prompt_tokens_median=1, prompt_tokens_max=1, output_tokens_median=128)
    flat = _gen(tmp_path, "flat", model, **knobs)
    deep = _gen(tmp_path, "deep", model, depth_share=0.8, **knobs)
    assert depth_dependence(flat) < 0.015
    assert depth_dependence(deep) > 0.06
    assert abs(next_token_reuse(deep) - next_token_reuse(flat)) < 0.03
    assert abs(activation_entropy(deep) - activation_entropy(flat)) < 0.02


def test_depth_share_zero_draws_nothing_more(tmp_path: Path) -> None:
    """Red if the depth_share stream shifts the other draws (every earlier trace would
    change) or if a positive share leaves the routing as it was."""
    a = _gen(tmp_path, "a", depth_share=0.0)
    assert _files(a.path) == _files(_gen(tmp_path, "a0").path)  # the default: 0
    wl = SyntheticWorkload(MODEL, dataclasses.replace(BASE, depth_share=0.5))
    assert wl.rotation is not None
    eye = np.eye(MODEL.num_experts)
    for q in wl.rotation:  # orthogonal: the token state keeps unit variance per expert
        np.testing.assert_allclose(q @ q.T, eye, atol=1e-12)
    flat = SyntheticWorkload(MODEL, BASE)
    assert flat.rotation is None
    np.testing.assert_array_equal(wl.base, flat.base)
    np.testing.assert_array_equal(wl.centroids, flat.centroids)
    b = _gen(tmp_path, "b", depth_share=0.5)
    assert not np.array_equal(a.counts, b.counts)


def test_tokens_of_one_type_route_alike_in_every_request() -> None:
    """With the whole noise from the token's type (``type_share = 1``) and nothing else
    moving the logits (no skew, jitter or cross-layer term), two positions of one type
    route to the same experts at every layer, in the same request or another; positions
    of two types differ somewhere.  Red if a type's profile is drawn per request or per
    position instead of once, or is not the same at every layer of a position."""
    cfg = dataclasses.replace(
        BASE, type_share=1.0, token_types=5, skew=0.0, request_jitter=0.0, cross_layer=0.0
    )
    wl = SyntheticWorkload(MODEL, cfg)
    children = np.random.SeedSequence(3).spawn(2)
    routes, types = [], []
    for r in range(2):
        out = wl.request(r, 1, 40, children[r])
        routes.append(out["counts"])  # (O, L, E), one token per iteration
        t = wl._token_types(children[r], 2, 40)  # the stream request() draws them from
        assert t is not None
        types.append(t)
    counts = np.concatenate(routes)  # (80, L, E)
    kinds = np.concatenate(types)  # (80,)
    assert len(set(kinds.tolist())) >= 3
    for a in range(len(kinds)):
        for b in range(a + 1, len(kinds)):
            same = np.array_equal(counts[a], counts[b])
            assert same == (kinds[a] == kinds[b]), (a, b, kinds[a], kinds[b])


def test_type_share_zero_draws_nothing_more(tmp_path: Path) -> None:
    """Red if the token-type draws shift the other draws (every earlier trace would
    change), if their knobs enter the manifest of a trace made without them, or if a
    positive share leaves the routing as it was."""
    a = _gen(tmp_path, "a", type_share=0.0, token_types=7)
    assert _files(a.path) == _files(_gen(tmp_path, "a0").path)  # the default: 0
    wl = SyntheticWorkload(MODEL, dataclasses.replace(BASE, type_share=0.5, token_types=7))
    assert wl.type_logits is not None and wl.type_logits.shape == (7, 4, 16)
    assert wl.type_freq is not None
    np.testing.assert_allclose(wl.type_freq[0] / wl.type_freq[6], 7.0)  # Zipf: 1 / (w + 1)
    flat = SyntheticWorkload(MODEL, BASE)
    assert flat.type_logits is None
    np.testing.assert_array_equal(wl.base, flat.base)
    np.testing.assert_array_equal(wl.cross, flat.cross)
    b = _gen(tmp_path, "b", type_share=0.5, token_types=7)
    assert not np.array_equal(a.counts, b.counts)
    assert b.manifest.source["params"]["token_types"] == 7


def test_type_repeat_one_gives_every_position_the_first_type() -> None:
    """With ``type_repeat = 1`` every position after the first copies an earlier one, so
    all take position 0's type, the first of the plain draws.  Red if a repeat copies a
    later position's type (the draw is not in [0, n)) or a repeat of a repeat copies the
    type it was drawn with instead of its final one."""
    cfg = dataclasses.replace(BASE, type_share=0.5, token_types=50, type_zipf=0.0)
    seed = np.random.SeedSequence(5)
    plain = SyntheticWorkload(MODEL, cfg)._token_types(seed, 2, 200)
    assert plain is not None and len(set(plain.tolist())) > 30
    wl = SyntheticWorkload(MODEL, dataclasses.replace(cfg, type_repeat=1.0))
    every = wl._token_types(seed, 2, 200)
    assert every is not None
    assert (every == plain[0]).all()


def test_type_repeat_reuses_earlier_types_at_its_rate() -> None:
    """With 1,000 equally frequent types a fresh draw almost never meets an earlier
    position's type (about n / 1000), so the share of positions whose type appeared
    before is about ``type_repeat`` plus that; ``type_repeat = 0`` keeps the draws of a
    trace made before the knob existed.  Red if the repeat probability is applied
    twice, inverted, or the extra draws are taken when it is 0 (the types would change
    for every earlier trace with token types)."""
    cfg = dataclasses.replace(BASE, type_share=0.5, token_types=1000, type_zipf=0.0)
    seeds = np.random.SeedSequence(9).spawn(40)
    base = SyntheticWorkload(MODEL, cfg)
    rep = SyntheticWorkload(MODEL, dataclasses.replace(cfg, type_repeat=0.3))
    seen, fresh_seen, n = 0, 0, 0
    for s in seeds:
        w0, w1 = base._token_types(s, 2, 50), base._token_types(s, 2, 50)
        assert w0 is not None and w1 is not None
        np.testing.assert_array_equal(w0, w1)
        np.testing.assert_array_equal(
            w0, np.random.default_rng(_child(s, 2)).choice(1000, size=50, p=base.type_freq)
        )
        w = rep._token_types(s, 2, 50)
        assert w is not None
        seen += sum(w[i] in w[:i] for i in range(1, 50))
        fresh_seen += sum(w0[i] in w0[:i] for i in range(1, 50))
        n += 49
    assert fresh_seen / n < 0.05
    assert 0.27 < seen / n < 0.36, seen / n


@pytest.mark.parametrize("knob", ["type_repeat", "type_context"])
def test_type_extras_enter_the_manifest_only_when_set(knob: str) -> None:
    """Red if ``type_repeat`` or ``type_context`` at 0 changes the manifest (and the
    trace cache's name) of a trace made with token types, or a positive value is left
    out of it."""
    cfg = dataclasses.replace(BASE, type_share=0.5)
    assert knob not in synthetic_params(cfg)
    assert "type_share" in synthetic_params(cfg)
    assert synthetic_params(dataclasses.replace(cfg, **{knob: 0.2}))[knob] == 0.2
    assert knob not in synthetic_params(dataclasses.replace(BASE, **{knob: 0.2}))


def test_type_context_makes_a_type_route_alike_within_a_request_only() -> None:
    """With the whole noise from the token's type and the whole type profile the
    request's own (``type_share = type_context = 1``, nothing else moving the logits),
    two positions of one type in one request route to the same experts at every layer,
    and the same type in two requests does not.  Red if the request's part is drawn per
    position (positions of one type would differ within a request) or once for all
    requests (they would match across requests)."""
    cfg = dataclasses.replace(
        BASE, type_share=1.0, type_context=1.0, token_types=4, type_zipf=0.0, skew=0.0,
        request_jitter=0.0, cross_layer=0.0,
    )  # fmt: skip
    wl = SyntheticWorkload(MODEL, cfg)
    children = np.random.SeedSequence(4).spawn(2)
    first: dict[int, list[np.ndarray]] = {}
    for r in range(2):
        counts = wl.request(r, 1, 30, children[r])["counts"]  # (O, L, E)
        types = wl._token_types(children[r], 2, 30)
        assert types is not None
        for w in range(4):
            where = np.flatnonzero(types == w)
            assert len(where) >= 2, (r, w)
            for n in where[1:]:
                np.testing.assert_array_equal(counts[n], counts[where[0]])
            first.setdefault(w, []).append(counts[where[0]])
    for w, (a, b) in first.items():
        assert not np.array_equal(a, b), w


def test_type_repeat_makes_paths_predictable_within_a_request(tmp_path: Path) -> None:
    """Red if repeated types do not carry over to routing: a token's experts three
    layers on are better predicted by the nearest earlier token of its own request with
    repeats than without (at seeds 0-2: 0.29-0.30 without, 0.43-0.45 with)."""
    from fmoesim.validation.real_routing import own_path_predictability

    model = dataclasses.replace(MODEL, num_layers=8, num_experts=8)
    knobs = dict(skew=0.0, locality=0.25, noise=2.0, request_jitter=0.0, type_share=0.9)
    knobs.update(prompt_tokens_median=1, prompt_tokens_max=1, output_tokens_median=64)
    knobs.update(num_requests=4, token_types=256, type_zipf=0.0)
    flat = own_path_predictability(_gen(tmp_path, "flat", model, **knobs))
    rep = own_path_predictability(_gen(tmp_path, "rep", model, type_repeat=0.5, **knobs))
    assert rep - flat > 0.1, (flat, rep)


def test_token_types_too_many_for_memory_are_one_config_error() -> None:
    """Red if a vocabulary of types whose profiles would not fit in memory is allocated
    (a MemoryError after a long wait) instead of refused, naming the knob."""
    cfg = dataclasses.replace(BASE, type_share=0.5, token_types=2**28)
    with pytest.raises(ConfigError) as info:
        SyntheticWorkload(MODEL, cfg)
    assert info.value.key == "workload.synthetic.token_types"


@pytest.mark.parametrize("seed", SEEDS)
def test_type_share_makes_paths_predictable_from_other_requests(tmp_path: Path, seed: int) -> None:
    """Red if the token types do not carry a token's path across layers and requests:
    the nearest token of another request predicts a token's experts three layers on
    far better than the other requests' popular experts do with types, and not without
    them (seeded; at seeds 0-2 the gap is -6.4 to -5.4 points without, 13.2 to 18.0
    with)."""
    from fmoesim.validation.real_routing import path_predictability

    model = dataclasses.replace(MODEL, num_layers=8, num_experts=8)
    knobs = dict(skew=0.3, locality=0.25, noise=2.0, request_jitter=0.0, seed=seed)
    knobs.update(prompt_tokens_median=1, prompt_tokens_max=1, output_tokens_median=64)
    knobs.update(num_requests=4)
    near, pop = path_predictability(_gen(tmp_path, "flat", model, **knobs))
    assert near - pop < 0.02
    near, pop = path_predictability(
        _gen(tmp_path, "typed", model, type_share=0.9, token_types=16, **knobs)
    )
    assert near - pop > 0.10


def test_shift_moves_later_requests_to_the_other_topics(tmp_path: Path) -> None:
    """Red if the requests before the shift draw from the second half of the topics (or
    after it from the first), if the later ones lose their label, or if shift_at = 0
    changes any byte of a trace."""
    a = _gen(tmp_path, "a", shift_at=0)
    assert _files(a.path) == _files(_gen(tmp_path, "a0").path)  # the default: 0
    cfg = dataclasses.replace(BASE, num_topics=4, shift_at=5)
    wl = SyntheticWorkload(MODEL, cfg)
    children = np.random.SeedSequence(7).spawn(12)
    topics = [wl.request(r, 8, 2, children[r])["topic"] for r in range(12)]
    assert all(t < 2 for t in topics[:5]) and all(t >= 2 for t in topics[5:]), topics
    tr = _gen(tmp_path, "s", num_topics=4, shift_at=5)
    assert tr.dataset.tolist() == ["synthetic"] * 5 + ["synthetic-shifted"] * 7


@pytest.mark.parametrize("seed", SEEDS)
def test_same_topic_prefill_embeddings_are_closer(seed: int) -> None:
    cfg = dataclasses.replace(BASE, num_topics=3, embedding_dim=32, seed=seed)
    wl = SyntheticWorkload(MODEL, cfg)
    children = np.random.SeedSequence(100 + seed).spawn(30)
    gens = [wl.request(r, 16, 2, children[r]) for r in range(30)]
    topics = np.array([g["topic"] for g in gens])
    x = np.array([g["embedding"][0] for g in gens])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    cos = x @ x.T
    same = (topics[:, None] == topics[None, :]) & ~np.eye(30, dtype=bool)
    other = topics[:, None] != topics[None, :]
    assert same.any() and other.any()
    assert cos[same].mean() - cos[other].mean() > 0.3, (cos[same].mean(), cos[other].mean())


@pytest.mark.parametrize("seed", SEEDS)
def test_spec_probs_favour_the_selected_experts(tmp_path: Path, seed: int) -> None:
    tr = _gen(tmp_path, "spec", seed=seed)
    spec = tr.spec_probs[:, 1:].astype(np.float64)  # layers >= 1: valid on every row
    counts = tr.counts[:, 1:]
    assert tr.spec_valid[:, 1:].all()
    # mean spec probability at the routed experts, weighted by tokens routed there
    at_selected = (spec * counts).sum() / counts.sum()
    assert at_selected > 2.0 / tr.num_experts, at_selected  # uniform guess: 1/E = 0.0625


# -- Azure CSV ------------------------------------------------------------------------------
AZURE = """TIMESTAMP,ContextTokens,GeneratedTokens
2023-11-16 18:15:46.6805900,374,44
2023-11-16 18:15:50.9951690,396,109
2023-11-16 18:16:01.0000000,879,20
"""


def test_read_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    lens = read_azure_csv(p)
    assert lens.prompt.tolist() == [374, 396, 879]
    assert lens.output.tolist() == [44, 109, 20]
    # 50.9951690 - 46.6805900 = 4.3145790; 61.0 - 46.6805900 = 14.3194100
    np.testing.assert_allclose(lens.arrival_s, [0.0, 4.314579, 14.31941], atol=1e-9)
    assert read_azure_csv(p, limit=2).prompt.tolist() == [374, 396]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "TIMESTAMP,ContextTokens\n2023-11-16 18:15:46,374\n",
            ": missing column(s) ['GeneratedTokens'] (rule: Azure format has columns",
        ),
        (
            AZURE.replace("396,109", "0,109"),
            " row 2: ContextTokens = 0 (rule: a positive integer at most 2147483647)",
        ),
        (
            AZURE.replace("879,20", "879,2.5"),
            " row 3: GeneratedTokens = 2.5 (rule: a positive integer at most 2147483647)",
        ),
        (
            AZURE.replace("879,20", "879,"),
            " row 3: GeneratedTokens = '' (rule: a positive integer at most 2147483647)",
        ),
        (
            AZURE.replace("2023-11-16 18:15:50.9951690", "yesterday"),
            " row 2: TIMESTAMP 'yesterday' is not a time",
        ),
        (AZURE.replace("18:16:01", "18:15:01"), " row 3: TIMESTAMP goes backwards"),
        (  # pandas read the text nan as a missing value, shown as ''
            "TIMESTAMP,ContextTokens,GeneratedTokens\n0,4,2\nnan,4,2\n",
            " row 2: TIMESTAMP 'nan' is not a finite number",
        ),
        ("TIMESTAMP,ContextTokens,GeneratedTokens\n", ": no rows (rule: at least one request)"),
    ],
    ids=[
        "missing_column",
        "zero_tokens",
        "fractional_tokens",
        "empty_cell",
        "bad_time",
        "backwards",
        "nan_time",
        "no_rows",
    ],
)
def test_read_azure_csv_rejects(tmp_path: Path, text: str, expected: str) -> None:
    p = tmp_path / "bad.csv"
    p.write_text(text)
    with pytest.raises(FmoesimError) as info:
        read_azure_csv(p)
    assert str(info.value).startswith(str(p) + expected), str(info.value)


def test_read_azure_csv_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FmoesimError, match="arrival CSV not found"):
        read_azure_csv(tmp_path / "nope.csv")


def test_generate_from_azure_csv(tmp_path: Path) -> None:
    p = tmp_path / "azure.csv"
    p.write_text(AZURE)
    tr = _gen(
        tmp_path,
        "az",
        num_requests=3,
        arrivals_csv=str(p),
        prompt_tokens_max=512,
        output_tokens_max=64,
    )
    assert tr.prompt_tokens.tolist() == [374, 396, 512]  # 879 clipped at prompt_tokens_max
    assert tr.output_tokens.tolist() == [44, 64, 20]  # 109 clipped at output_tokens_max
    np.testing.assert_allclose(tr.arrival_s, [0.0, 4.314579, 14.31941], atol=1e-9)

    cfg = dataclasses.replace(BASE, num_requests=4, arrivals_csv=str(p))
    with pytest.raises(
        ConfigError, match=r"'workload\.synthetic\.num_requests' = 4: .* only 3 rows"
    ):
        generate(MODEL, cfg, tmp_path / "too-many")
    assert not (tmp_path / "too-many").exists()


# -- configuration checks ------------------------------------------------------------------
@pytest.mark.parametrize(
    ("knobs", "key"),
    [
        ({"num_requests": 0}, "num_requests"),
        ({"num_topics": 2.5}, "num_topics"),
        ({"output_tokens_max": -1}, "output_tokens_max"),
        ({"embedding_dim": -1}, "embedding_dim"),
        ({"skew": -0.1}, "skew"),
        ({"noise": math.inf}, "noise"),
        ({"spec_noise": math.nan}, "spec_noise"),
        ({"topic_share": 1.5}, "topic_share"),
        ({"depth_share": 1.5}, "depth_share"),
        ({"depth_share": -0.1}, "depth_share"),
        ({"type_share": 1.5}, "type_share"),
        ({"type_share": -0.1}, "type_share"),
        ({"type_repeat": 1.5}, "type_repeat"),
        ({"type_repeat": -0.1}, "type_repeat"),
        ({"type_context": 2.0}, "type_context"),
        ({"token_types": 0}, "token_types"),
        ({"type_zipf": -1.0}, "type_zipf"),
        ({"locality": 1.0}, "locality"),
        ({"locality": -0.1}, "locality"),
        ({"locality": math.nan}, "locality"),
        ({"temperature": 0.0}, "temperature"),
        ({"arrival_rate_rps": 0.0}, "arrival_rate_rps"),
        ({"arrival_rate_rps": math.inf}, "arrival_rate_rps"),
        ({"arrival_rate_rps": 1.0, "arrivals_csv": "a.csv"}, "arrivals_csv"),
        ({"seed": -1}, "seed"),
        ({"shift_at": -1}, "shift_at"),
        ({"shift_at": 1.5}, "shift_at"),
        ({"shift_at": 4, "num_topics": 1}, "shift_at"),
    ],
)
def test_synthetic_config_rejects(knobs: dict, key: str) -> None:
    cfg = dataclasses.replace(SyntheticConfig(), **knobs)
    with pytest.raises(ConfigError) as info:
        cfg.validate()
    assert info.value.key == f"workload.synthetic.{key}"
    assert f"config key 'workload.synthetic.{key}' = " in str(info.value)


def test_synthetic_config_defaults_and_edges_are_valid() -> None:
    assert SyntheticConfig().validate() == SyntheticConfig()
    SyntheticConfig(
        locality=0.0, topic_share=1.0, embedding_dim=0, skew=0.0, arrival_rate_rps=0.5
    ).validate()
    with pytest.raises(ConfigError, match="'gen.locality'"):
        SyntheticConfig(locality=2.0).validate(prefix="gen")


@pytest.mark.parametrize(
    ("fields", "key", "rule"),
    [
        ({"num_layers": 0}, "num_layers", "must be a positive integer"),
        ({"num_experts": 8.0}, "num_experts", "must be a positive integer"),
        ({"top_k": 9}, "top_k", "must be <= num_experts (8)"),
        ({"dense_layers": -1}, "dense_layers", "must be a non-negative integer"),
        ({"dtype": "fp7"}, "dtype", "must be one of"),
        ({"q_lora_rank": 512}, "q_lora_rank", "is MLA's: set kv_lora_rank too"),
        ({"kv_lora_rank": -1}, "kv_lora_rank", "must be a non-negative integer"),
        ({"kv_lora_rank": 512}, "qk_nope_head_dim", "needs query/key heads"),
    ],
)
def test_model_spec_rejects(fields: dict, key: str, rule: str) -> None:
    spec = dataclasses.replace(ModelSpec(num_experts=8, top_k=2), **fields)
    with pytest.raises(ConfigError) as info:
        spec.validate()
    assert info.value.key == f"model.{key}"
    assert str(info.value).startswith(f"config key 'model.{key}' = ")
    assert rule in str(info.value)


def test_generate_validates_model_and_config(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"'model\.top_k' = 17"):
        generate(dataclasses.replace(MODEL, top_k=17), BASE, tmp_path / "x")
    with pytest.raises(ConfigError, match=r"'workload\.synthetic\.locality' = 1\.5"):
        generate(MODEL, dataclasses.replace(BASE, locality=1.5), tmp_path / "x")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize(
    ("knob", "value"),
    [
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("topic_share", "a"),
        ("locality", "x"),
    ],
)
def test_synthetic_config_refuses_non_numbers_and_infinite_temperature(knob, value):
    cfg = dataclasses.replace(BASE, **{knob: value})
    with pytest.raises(ConfigError, match=f"workload.synthetic.{knob}"):
        cfg.validate()


def test_spec_recall_against_a_loop(tmp_path: Path) -> None:
    """Red when :func:`spec_recall` counts prefill iterations, takes the top-k on the
    wrong axis or averages over rows without a prediction: checked against a plain loop
    over decode tokens and layers, and the noisier first layer (its prediction is made
    from the previous token's last layer) scoring lower than the rest, as the generator
    makes it."""
    from fmoesim.trace.stats import spec_recall

    tr = _gen(tmp_path, "spec", num_requests=6, spec_noise=0.6, spec_noise_first_layer=3.0)
    assert tr.spec_probs is not None and tr.spec_valid is not None
    k, L = tr.top_k, tr.num_layers
    want = np.zeros(L)
    for layer in range(L):
        got = []
        for i in range(tr.num_iterations):
            if tr.num_tokens[i] != 1 or not tr.spec_valid[i, layer]:
                continue
            spec = tr.spec_probs[i, layer].astype(np.float32)
            top = set(np.argsort(-spec, kind="stable")[:k].tolist())
            got.append(len(top & set(np.flatnonzero(tr.counts[i, layer]).tolist())) / k)
        want[layer] = np.mean(got)
    np.testing.assert_allclose(spec_recall(tr), want)
    assert want[0] < want[1:].min()
    # a trace without predictions: NaN on every layer
    one = dataclasses.replace(MODEL, num_layers=1)
    nospec = _gen(tmp_path, "nospec", model=one, output_tokens_max=1, num_requests=4)
    assert np.isnan(spec_recall(nospec)).all()


def test_a_trace_folder_has_the_permissions_of_a_plain_mkdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red if a trace folder keeps ``mkdtemp``'s mode 0700 (the writer builds it as a
    temporary folder and renames it), unreadable by the group where ``mkdir`` gives 0755
    under umask 022; or loses the set-group-ID bit of a shared parent folder (its files
    would then take the user's group, not the folder's)."""
    import os
    import stat

    import fmoesim.atomic

    monkeypatch.setattr(fmoesim.atomic, "_UMASK", 0o022)
    path = generate(MODEL, SyntheticConfig(num_requests=1), tmp_path / "t")
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o2775)
    if not shared.stat().st_mode & stat.S_ISGID:
        pytest.skip("this file system keeps no set-group-ID bit on folders")
    path = generate(MODEL, SyntheticConfig(num_requests=1), shared / "t")
    assert stat.S_IMODE(path.stat().st_mode) == 0o2755


def test_no_progress_bar_off_a_terminal(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Red if a progress bar writes to a stderr that is no terminal (a sweep's log file
    filled with carriage-return fragments of bars)."""
    generate(MODEL, SyntheticConfig(num_requests=2), tmp_path / "t", progress=True)
    assert capsys.readouterr().err == ""
