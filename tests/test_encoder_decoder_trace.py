"""Encoder-decoder traces (``model.encoder_layers > 0``): the format's per-layer
``num_tokens`` rule, the writer, the synthetic generator, the statistics, and the
byte-identity of decoder-only synthetic traces.

Each test names, in a comment, the bug that turns it red.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest

from fmoesim.errors import FmoesimError, TraceError
from fmoesim.specs import ModelSpec
from fmoesim.trace import TraceManifest, TraceModel, TraceWriter, read_trace
from fmoesim.trace import schema as S
from fmoesim.trace.reader import read_tokens
from fmoesim.trace.stats import layer_stats
from fmoesim.workload import SyntheticConfig, SyntheticWorkload, generate
from fmoesim.workload.synthetic import _child
from tests._trace_helpers import edit_manifest, rewrite_rows

CFG = SyntheticConfig(
    num_requests=4,
    num_topics=4,
    embedding_dim=8,
    prompt_tokens_median=6,
    prompt_tokens_max=12,
    output_tokens_median=5,
    output_tokens_max=9,
    seed=3,
)


def _model(encoder_layers: int = 0) -> ModelSpec:
    kw: dict[str, Any] = {"encoder_layers": encoder_layers} if encoder_layers else {}
    return ModelSpec(
        name="tiny-moe",
        num_layers=4,
        num_experts=8,
        top_k=2,
        hidden_size=64,
        expert_intermediate_size=64,
        **kw,
    )


# -- the synthetic generator ------------------------------------------------------------------
@pytest.mark.parametrize("depth_share", [0.0, 0.5])
def test_synthetic_encoder_decoder_trace_reads_back(tmp_path: Path, depth_share: float) -> None:
    # red if: the generator spreads the encoder's routing over the iterations (counts at
    # iterations > 0), routes the prompt through the decoder layers, the writer writes the
    # iteration's num_tokens on every row or non-null probs on idle encoder rows (the
    # reader then refuses the trace), or the manifest loses encoder_layers
    n, k = 2, 2
    cfg = dataclasses.replace(CFG, depth_share=depth_share)
    tr = read_trace(generate(_model(n), cfg, tmp_path / "ed"))
    assert tr.encoder_layers == n
    assert json.loads((tr.path / S.MANIFEST).read_text())["model"]["encoder_layers"] == n
    assert TraceManifest.load(tr.path / S.MANIFEST).model.encoder_layers == n
    first = tr.iteration == 0
    enc, dec = tr.counts[:, :n], tr.counts[:, n:]  # (N, n, E), (N, L - n, E)
    np.testing.assert_array_equal(enc[~first], 0)
    np.testing.assert_array_equal(
        enc[first].sum(axis=2), np.repeat(tr.prompt_tokens, n).reshape(-1, n) * k
    )
    np.testing.assert_array_equal(dec.sum(axis=2), k)
    assert dec.max() == 1  # one token: k distinct experts
    # the iteration's num_tokens is unchanged: the prompt at iteration 0, 1 after
    np.testing.assert_array_equal(tr.num_tokens[first], tr.prompt_tokens)
    np.testing.assert_array_equal(tr.num_tokens[~first], 1)
    # routing rows carry the tokens each layer sees
    want = np.ones((tr.num_iterations, 4), np.int64)
    want[:, :n] = np.where(first, tr.num_tokens, 0)[:, None]
    np.testing.assert_array_equal(tr.layer_tokens, want)
    rows = pq.read_table(tr.path / S.ROUTING)
    np.testing.assert_array_equal(rows.column("num_tokens").to_numpy().reshape(-1, 4), want)
    probs_null = rows.column("probs").is_null().to_numpy(zero_copy_only=False).reshape(-1, 4)
    np.testing.assert_array_equal(probs_null, want == 0)
    assert tr.probs is not None
    np.testing.assert_array_equal(tr.probs[~first, :n], 0)  # null rows read as zeros
    # a decoder layer routes one token: its top-k probabilities are its experts
    top = np.argsort(-tr.probs[:, n:].astype(np.float32), axis=2)[..., :k]
    assert (np.take_along_axis(dec, top, axis=2) == 1).mean() > 0.99  # float16 ties aside
    # speculative probabilities: none at the encoder's first layer; the other encoder
    # layer at iteration 0 only; the decoder's first layer after iteration 0; the others
    # at every iteration
    assert tr.spec_valid is not None
    np.testing.assert_array_equal(tr.spec_valid[:, 0], False)
    np.testing.assert_array_equal(tr.spec_valid[:, 1], first)
    np.testing.assert_array_equal(tr.spec_valid[:, 2], ~first)
    np.testing.assert_array_equal(tr.spec_valid[:, 3], True)


def test_request_arrays_of_an_encoder_decoder_model() -> None:
    # red if: the per-layer token array disagrees with the counts, the encoder's probs are
    # not the mean over the prompt, or the decoder's first layer keeps a cross-layer link
    # to the encoder's last layer (its logits then depend on the encoder's choices)
    wl = SyntheticWorkload(_model(2), dataclasses.replace(CFG, embedding_dim=0))
    g = wl.request(0, prompt=7, output=5, seed=np.random.SeedSequence(11))
    assert g["layer_tokens"].shape == (5, 4)
    np.testing.assert_array_equal(g["counts"].sum(axis=2), g["layer_tokens"] * 2)
    np.testing.assert_array_equal(g["num_tokens"], [7, 1, 1, 1, 1])
    np.testing.assert_allclose(g["probs"][0].sum(axis=1), 1.0)
    np.testing.assert_array_equal(g["probs"][1:, :2], 0.0)
    np.testing.assert_allclose(g["probs"][:, 2:].sum(axis=2), 1.0)
    assert np.isnan(g["spec_probs"][1:, :2]).all()
    # no cross-layer link into the first decoder layer: removing the cross matrix of
    # that layer changes nothing
    wl2 = SyntheticWorkload(_model(2), dataclasses.replace(CFG, embedding_dim=0))
    wl2.cross[2] = 0.0
    g2 = wl2.request(0, prompt=7, output=5, seed=np.random.SeedSequence(11))
    np.testing.assert_array_equal(g2["probs"], g["probs"])
    wl2.cross[3] = 0.0  # ... the link between decoder layers stays
    g3 = wl2.request(0, prompt=7, output=5, seed=np.random.SeedSequence(11))
    assert not np.array_equal(g3["probs"][:, 3], g["probs"][:, 3])


def test_encoder_and_decoder_have_token_states_of_their_own() -> None:
    # red if: the decoder's token state z is drawn from the encoder's stream (child 0 of
    # the request's seed), so that the first decoder position repeats the first prompt
    # position's state
    wl = SyntheticWorkload(_model(2), dataclasses.replace(CFG, depth_share=0.5))
    calls: list[tuple[int, int]] = []
    state = wl._token_state

    def spy(seed: np.random.SeedSequence, stream: int, T: int) -> np.ndarray | None:
        calls.append((stream, T))
        return state(seed, stream, T)

    wl._token_state = spy  # type: ignore[method-assign]
    wl.request(0, prompt=7, output=5, seed=np.random.SeedSequence(11))
    assert calls == [(0, 7), (1, 5)]
    # decoder-only: one state over the prompt and the outputs, child 0 as before
    calls.clear()
    wl1 = SyntheticWorkload(_model(), dataclasses.replace(CFG, depth_share=0.5))
    state = wl1._token_state
    wl1._token_state = spy  # type: ignore[method-assign]
    wl1.request(0, prompt=7, output=5, seed=np.random.SeedSequence(11))
    assert calls == [(0, 11)]


def test_encoder_decoder_statistics_skip_idle_rows(tmp_path: Path) -> None:
    # red if: the statistics count an encoder layer's idle rows (zero counts, zero probs)
    # after iteration 0: reuse 0 instead of NaN, a fine entropy pulled towards 0
    tr = read_trace(generate(_model(2), CFG, tmp_path / "ed"))
    s = layer_stats(tr)
    assert np.isnan(s.next_token_reuse[:2]).all()
    assert np.isfinite(s.next_token_reuse[2:]).all()
    assert np.isnan(s.spec_top_k_recall[:2]).all()
    assert tr.probs is not None
    p0 = tr.probs[tr.iteration == 0, 0].astype(np.float64)
    p0 /= p0.sum(axis=1, keepdims=True)
    h = -(np.where(p0 > 0, p0 * np.log(np.where(p0 > 0, p0, 1)), 0)).sum(axis=1) / np.log(8)
    assert s.fine_entropy[0] == pytest.approx(h.mean(), rel=1e-4)


# -- a hand-made encoder-decoder trace: L = 3 (layer 0 the encoder's), E = 4, top_k = 2 -------
#: (request_id, prompt_tokens, output_tokens)
HAND_REQUESTS = [(0, 3, 3), (1, 2, 2)]
#: (request_id, iteration, num_tokens) in file order; routing row 3 * i + layer
HAND_ITERATIONS = [(0, 0, 3), (0, 1, 1), (0, 2, 1), (1, 0, 2), (1, 1, 1)]


def _hand_made(path: Path) -> None:
    L, E = 3, 4
    rng = np.random.default_rng(5)
    man = TraceManifest(
        model=TraceModel("tiny-ed", L, E, 2, 16, encoder_layers=1),
        embedding_dim=0,
        source={"kind": "importer", "format": "hand-built", "original": "tests"},
        has_probs=True,
        has_spec_probs=True,
    )
    with TraceWriter(path, man) as w:
        for rid, prompt, output in HAND_REQUESTS:
            w.add_request(rid, prompt, output)
        for rid, it, ntok in HAND_ITERATIONS:
            counts = np.array([[0, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1]], np.int32)
            counts[0] = [ntok, ntok, 0, 0] if it == 0 else 0
            spec = rng.dirichlet(np.ones(E), size=L)
            spec[0] = np.nan  # nothing precedes the encoder's first layer
            if it == 0:
                spec[1] = np.nan  # the decoder's first layer at iteration 0
            w.add_iteration(
                rid,
                it,
                ntok,
                None,
                counts,
                rng.dirichlet(np.ones(E), size=L),  # the writer nulls layer 0 after it 0
                spec,
                layer_tokens=np.array([ntok if it == 0 else 0, 1, 1]),
            )


@pytest.fixture
def hand_dir(tmp_path: Path) -> Path:
    path = tmp_path / "hand"
    _hand_made(path)
    return path


def test_hand_made_trace_is_valid(hand_dir: Path) -> None:
    # red if: the writer ignores layer_tokens (the reader refuses the iteration's
    # num_tokens at the decoder rows of iteration 0) or writes probs on idle rows
    tr = read_trace(hand_dir)
    rows = pq.read_table(hand_dir / S.ROUTING).to_pylist()
    assert [r["num_tokens"] for r in rows] == [3, 1, 1, 0, 1, 1, 0, 1, 1, 2, 1, 1, 0, 1, 1]
    assert [r["probs"] is None for r in rows] == [r["num_tokens"] == 0 for r in rows]
    assert tr.layer_tokens.reshape(-1).tolist() == [r["num_tokens"] for r in rows]


def _set(row: int, **cells: Any) -> Any:
    def edit(rows: list[dict[str, Any]]) -> None:
        rows[row].update(cells)

    return edit


ENC_RULE = (
    "rule: num_tokens is the tokens the layer sees: an encoder layer (layer < "
    "encoder_layers = 1) the iteration's num_tokens at iteration 0 and 0 after, a "
    "decoder layer 1"
)

BROKEN = [
    # encoder counts at an iteration > 0 (row 3: request 0, iteration 1, layer 0), with
    # the row's num_tokens saying one token
    (
        "encoder_tokens_after_prefill",
        _set(3, num_tokens=1, expert_counts=[1, 1, 0, 0]),
        3,
        "num_tokens 1 at layer 0, iteration 1, expected 0 (" + ENC_RULE,
    ),
    # encoder counts at an iteration > 0 with num_tokens 0
    (
        "encoder_counts_after_prefill",
        _set(6, expert_counts=[1, 1, 0, 0], probs=None),
        6,
        "sum 2 != 0 * 2 (rule: expert_counts sum to num_tokens * top_k (top_k = 2))",
    ),
    # a decoder row with num_tokens = P (row 1: request 0, iteration 0, layer 1)
    (
        "decoder_row_with_the_prompt",
        _set(1, num_tokens=3, expert_counts=[3, 3, 0, 0]),
        1,
        "num_tokens 3 at layer 1, iteration 0, expected 1 (" + ENC_RULE,
    ),
    # an encoder row of the prefill with one token (row 9: request 1, iteration 0)
    (
        "encoder_prefill_with_one_token",
        _set(9, num_tokens=1, expert_counts=[1, 1, 0, 0]),
        9,
        "num_tokens 1 at layer 0, iteration 0, expected 2 (" + ENC_RULE,
    ),
    # an idle encoder row with probabilities
    (
        "idle_row_with_probs",
        _set(12, probs=[0.25, 0.25, 0.25, 0.25]),
        12,
        "probs is not null (rule: probs and spec_probs are null where the layer sees no "
        "token (an encoder layer after iteration 0))",
    ),
    (
        "idle_row_with_spec_probs",
        _set(3, spec_probs=[0.25, 0.25, 0.25, 0.25]),
        3,
        "spec_probs is not null (rule: probs and spec_probs are null",
    ),
    # has_probs, and a decoder row without probs
    (
        "decoder_row_without_probs",
        _set(4, probs=None),
        4,
        "probs is null (rule: probs present on every row whose layer sees tokens "
        "(trace.json says has_probs))",
    ),
    # a counted expert above the tokens the layer sees
    (
        "expert_above_layer_tokens",
        _set(5, expert_counts=[2, 0, 0, 0]),
        5,
        "rule: no expert gets more tokens than the layer sees (num_tokens)",
    ),
]


@pytest.mark.parametrize(
    ("edit", "row", "expected"), [c[1:] for c in BROKEN], ids=[c[0] for c in BROKEN]
)
def test_broken_encoder_decoder_rows_are_refused(
    hand_dir: Path, edit: Any, row: int, expected: str
) -> None:
    # red if: the reader applies the decoder-only rule (or none) to encoder-decoder rows,
    # or its message loses the file, the row or the rule
    read_trace(hand_dir)  # the untouched trace is valid
    rewrite_rows(hand_dir / S.ROUTING, edit)
    with pytest.raises(TraceError) as info:
        read_trace(hand_dir)
    msg = str(info.value)
    assert msg.startswith(f"{hand_dir / S.ROUTING} row {row}: "), msg
    assert expected in msg, msg
    assert info.value.row == row


def test_decoder_only_rule_and_message_stay(hand_dir: Path) -> None:
    # red if: a decoder-only manifest gets the encoder-decoder rule: with encoder_layers
    # removed, the per-layer num_tokens of the hand-made trace break today's rule
    def drop(raw: dict[str, Any]) -> None:
        del raw["model"]["encoder_layers"]

    edit_manifest(hand_dir / S.MANIFEST, drop)
    with pytest.raises(TraceError) as info:
        read_trace(hand_dir)
    assert str(info.value) == (
        f"{hand_dir / S.ROUTING} row 1: 1 != 3 (rule: num_tokens equals the iteration's num_tokens)"
    )


@pytest.mark.parametrize("value", [3, 4, -1, True, "1", 1.0])
def test_manifest_refuses_encoder_layers_out_of_range(hand_dir: Path, value: Any) -> None:
    # red if: trace.json's encoder_layers is read without its range check (no decoder
    # layer left, negative, or not an integer)
    edit_manifest(hand_dir / S.MANIFEST, lambda raw: raw["model"].update(encoder_layers=value))
    with pytest.raises(TraceError) as info:
        read_trace(hand_dir)
    assert str(info.value) == (
        f"{hand_dir / S.MANIFEST}: encoder_layers={value!r}, num_layers=3 "
        "(rule: model.encoder_layers is an integer in [0, model.num_layers))"
    )


def test_manifest_writes_encoder_layers_only_when_nonzero() -> None:
    # red if: decoder-only manifests gain an encoder_layers key (their bytes change)
    man = TraceManifest(
        model=TraceModel("m", 2, 4, 1, 8),
        embedding_dim=0,
        source={},
        has_probs=False,
        has_spec_probs=False,
    )
    assert "encoder_layers" not in man.to_json()
    man.model.encoder_layers = 1
    assert json.loads(man.to_json())["model"]["encoder_layers"] == 1
    assert TraceModel.of(_model(2)).encoder_layers == 2
    # an object without the field (an older model spec) is decoder-only
    shape = {f: getattr(_model(), f) for f in ("name", "num_layers", "num_experts", "top_k")}
    plain = type(
        "Plain", (), {**shape, "hidden_size": 64, "num_shared_experts": 0, "dense_layers": 0}
    )
    assert TraceModel.of(plain).encoder_layers == 0


def test_writer_refuses_bad_layer_tokens(tmp_path: Path) -> None:
    # red if: the writer accepts a layer_tokens array of the wrong shape, negative
    # counts, or per-token top-k for layers that see other than num_tokens tokens
    man = TraceManifest(
        model=TraceModel("m", 2, 3, 1, 8, encoder_layers=1),
        embedding_dim=0,
        source={},
        has_probs=False,
        has_spec_probs=False,
    )
    counts = np.array([[2, 0, 0], [1, 0, 0]], np.int32)
    cases = [
        ({"layer_tokens": np.array([2, 1, 1])}, r"layer_tokens .* have shape \(3,\)"),
        ({"layer_tokens": np.array([-1, 1])}, r"layer_tokens .* are \[-1, 1\] \(rule: >= 0\)"),
        (
            {
                "layer_tokens": np.array([2, 1]),
                "tokens": (np.zeros((2, 2, 1), np.int16), np.ones((2, 2, 1))),
            },
            "rule: tokens.parquet holds num_tokens tokens at every layer",
        ),
    ]
    for kw, match in cases:
        dest = tmp_path / "t"
        with pytest.raises(FmoesimError, match=match):
            with TraceWriter(dest, man) as w:
                w.add_request(0, 2, 1)
                w.add_iteration(0, 0, 2, None, counts, **kw)
        assert not dest.exists()


def test_read_tokens_refuses_encoder_decoder_traces(hand_dir: Path) -> None:
    # red if: tokens.parquet, laid out as num_tokens tokens at every layer, is read for an
    # encoder-decoder trace whose layers see different numbers of tokens
    edit_manifest(hand_dir / S.MANIFEST, lambda raw: raw.update(has_tokens=True))
    with pytest.raises(TraceError, match=r"rule: tokens.parquet is read for decoder-only"):
        read_tokens(read_trace(hand_dir))


# -- decoder-only synthetic traces: the same draws, the same files ------------------------------
def _request_digest(wl: SyntheticWorkload) -> str:
    """sha256 of every request's arrays, as ``SyntheticWorkload.write`` draws them (the
    floats rounded to float32, so that the last bits of another platform's BLAS or libm
    do not count; another draw changes them all)."""
    lens = wl.lengths()
    h = hashlib.sha256()
    for r in range(wl.cfg.num_requests):
        g = wl.request(r, int(lens.prompt[r]), int(lens.output[r]), _child(wl._request_seq, r))
        for key in ("counts", "num_tokens"):
            h.update(np.ascontiguousarray(g[key], dtype=np.int64).tobytes())
        for key in ("probs", "spec_probs", "embedding"):
            h.update(np.ascontiguousarray(g[key], dtype=np.float32).tobytes())
    return h.hexdigest()


def _files_digest(path: Path) -> str:
    """sha256 of trace.json's bytes and of every Parquet file's schema and values (not of
    the Parquet bytes, which carry the writing pyarrow's version). trace.json's line
    ``source.code`` is left out: it labels the code and the numpy that made the trace
    (it changes with any edit of the generator's files), not what the trace holds."""
    manifest, n = re.subn(
        r'\n    "code": "[0-9a-f]{16}",', "", (path / S.MANIFEST).read_text(), count=1
    )
    assert n == 1, "trace.json has no source.code line"
    h = hashlib.sha256(manifest.encode())
    for name in (S.REQUESTS, S.ITERATIONS, S.ROUTING):
        table = pq.read_table(path / name)
        h.update(str(table.schema).encode())
        h.update(repr(table.to_pydict()).encode())
    return h.hexdigest()


def _stats_digest(path: Path) -> str:
    """sha256 of the per-layer statistics of the trace at ``path`` (float32)."""
    s = layer_stats(read_trace(path))
    h = hashlib.sha256()
    for f in dataclasses.fields(s):
        h.update(np.ascontiguousarray(getattr(s, f.name), dtype=np.float32).tobytes())
    return h.hexdigest()


#: knobs of the golden traces: the plain path, and the token state z (depth_share)
GOLDEN_KNOBS: dict[str, dict[str, Any]] = {
    "plain": {},
    "depth": {"depth_share": 0.5, "arrival_rate_rps": 2.0},
    # outputs of 1 token (no speculative draw at layer 0), no embeddings, a shift
    "short": {
        "num_requests": 6,
        "output_tokens_median": 2,
        "output_tokens_sigma": 1.0,
        "embedding_dim": 0,
        "shift_at": 3,
    },
    # token types, neither their request context nor repeats
    "types": {"type_share": 0.5, "token_types": 16, "type_zipf": 0.5},
}

#: digests of the decoder-only traces (requests' arrays, files, statistics), computed by
#: ``_golden_digests`` on commit a93f4eb, whose generator knows no encoder ("types": on
#: commit 482f2db, whose generator knows no type_context or type_repeat)
GOLDEN = {
    "plain": (
        "c979749ab1a970926a76265bf17da0f077f1d124e70c19d267749d36417e0a69",
        "1818021aeabeda9c7e998ec1e99be76e3e69dee0d1832150fdea86f6ad31dce2",
        "96e09782f1485da70185b9c46023dfdf2744a03cd19d3d9fe61c4cd1b786a360",
    ),
    "short": (
        "5191bb189215d2bf3bf346fca9080661f739f03d4b977f945008ca211ed80875",
        "a1274da8d84f9b0864a14f6f606e30ec8cac05fd2e2f694f644390afea5370f8",
        "52c5d289c82a7d91ea0b8172da6c309e0d0c508c2b37be1fc91877c7d46ba2ea",
    ),
    "depth": (
        "b949f52684d76261e32f6ddb502d169b0bb4a73c78cda252e8845dc131c60772",
        "2081b7bc3778d7ca4172bae63621415c19d1dafbc7b0a088703e965767b903bc",
        "148adfb584237c9cd0a17332a75ce62facea19ffdabc91908d17eb6fa21b8d44",
    ),
    "types": (
        "5e7b48504ea75224665ccfc2d93d082bd93e963a3b4ee6620dffd15259e99445",
        "5a9e01e8cccf4b698756c344d8c3336dbd276517ee8925b54014c2f6b2fdecbd",
        "ec050373f15fe724dff52c085d66edcd58eea039e31f18fa86e9ca3bed6c619e",
    ),
}


def _golden_digests(tmp: Path) -> dict[str, tuple[str, str, str]]:
    out = {}
    for name, knobs in GOLDEN_KNOBS.items():
        cfg = dataclasses.replace(CFG, **knobs)
        path = generate(_model(), cfg, tmp / name)
        out[name] = (
            _request_digest(SyntheticWorkload(_model(), cfg)),
            _files_digest(path),
            _stats_digest(path),
        )
    return out


def test_decoder_only_synthetic_traces_are_unchanged(tmp_path: Path) -> None:
    # red if: the decoder-only generator draws other numbers or in another order (token
    # types' context or repeats drawn at 0 included), the writer or the manifest writes
    # other values (e.g. an encoder_layers key, or a type knob at 0), or the statistics
    # of decoder-only traces change
    assert _golden_digests(tmp_path) == GOLDEN
