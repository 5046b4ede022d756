"""The collector's routing semantics, family by family, on tiny models whose routers are
made far from uniform ("peaked"), so that a wrong rule cannot hide in the tolerance.

References are independent of the collector: the model's own choice and weights are
read where its experts receive them (a pre-hook on each MoE block's ``experts``), the
router inputs by a pre-hook on the router, and the probabilities are recomputed by hand
under each family's rule."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the collector needs torch (extra 'collect')")
pytest.importorskip("transformers", reason="the collector needs transformers (extra 'collect')")

from fmoesim.collect.collector import Recorder, collect, find_routers  # noqa: E402
from fmoesim.errors import FmoesimError  # noqa: E402
from fmoesim.trace import read_trace  # noqa: E402
from fmoesim.trace.reader import read_tokens  # noqa: E402
from tests.test_collector import FAMILIES, PROMPTS, tiny  # noqa: E402

#: the scoring rule of each family, as its transformers modeling code computes it
RULE = {
    "mixtral": "softmax",
    "qwen2_moe": "softmax",
    "qwen3_moe": "softmax",
    "olmoe": "softmax",
    "phimoe": "sparsemixer",
    "gpt_oss": "softmax",
    "deepseek_v3": "sigmoid",
    "glm4_moe": "sigmoid",
    "dots1": "sigmoid",
    "exaone_moe": "sigmoid",
}
#: router logits' spread on the models' normalised hidden states
PEAK_LOGIT_STD = 3.0


def peaked(model):  # type: ignore[no-untyped-def]
    """Give every router weights whose logits spread by about :data:`PEAK_LOGIT_STD`, a
    random bias where it has one, and a selection bias that changes the choice where it
    has ``e_score_correction_bias``."""
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for _, r in find_routers(model):
            E, H = r.weight.shape
            r.weight.copy_(torch.randn(E, H, generator=gen) * PEAK_LOGIT_STD / H**0.5)
            if getattr(r, "bias", None) is not None:
                r.bias.copy_(torch.randn(E, generator=gen))
            if getattr(r, "e_score_correction_bias", None) is not None:
                r.e_score_correction_bias.copy_(torch.randn(E, generator=gen) * 0.5)
    return model


def reference_probs(rule: str, router, h):  # type: ignore[no-untyped-def]
    """The family's per-expert distribution for router inputs ``h``, written out by hand."""
    z = h.float() @ router.weight.detach().float().T
    if getattr(router, "bias", None) is not None:
        z = z + router.bias.detach().float()
    if rule == "sigmoid":  # the correction bias only chooses; it never weights
        s = 1.0 / (1.0 + torch.exp(-z))
        return s / s.sum(dim=-1, keepdim=True)
    e = torch.exp(z - z.max(dim=-1, keepdim=True).values)
    return e / e.sum(dim=-1, keepdim=True)


class Watch:
    """Per forward pass and MoE layer: the router's input, and the chosen experts and
    weights as the experts module receives them."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        layers = model.model.layers
        self.h: list[dict[int, torch.Tensor]] = []
        self.idx: list[dict[int, torch.Tensor]] = []
        self.wts: list[dict[int, torch.Tensor]] = []
        self.handles = []
        for j, (i, router) in enumerate(find_routers(model)):
            block = next(getattr(layers[i], n) for n in ("mlp", "block_sparse_moe")
                         if hasattr(layers[i], n))  # fmt: skip
            self.handles.append(router.register_forward_pre_hook(self._on_router(j, router)))
            self.handles.append(
                block.experts.register_forward_pre_hook(self._on_experts(j), with_kwargs=True)
            )

    def _on_router(self, j, router):  # type: ignore[no-untyped-def]
        def hook(mod, args):  # type: ignore[no-untyped-def]
            if mod is router:  # not the collector's probe copy
                if j == 0:
                    self.h.append({})
                    self.idx.append({})
                    self.wts.append({})
                self.h[-1][j] = args[0].detach().reshape(-1, args[0].shape[-1])

        return hook

    def _on_experts(self, j):  # type: ignore[no-untyped-def]
        def hook(mod, args, kwargs):  # type: ignore[no-untyped-def]
            rest = list(args[1:]) + [kwargs[k] for k in kwargs if k != "hidden_states"]
            idx = next(t for t in rest if not t.is_floating_point())
            wts = next(t for t in rest if t.is_floating_point())
            self.idx[-1][j] = idx.detach().reshape(-1, idx.shape[-1]).long()
            self.wts[-1][j] = wts.detach().reshape(-1, idx.shape[-1])

        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_counts_probs_and_weights_follow_each_familys_rule(tmp_path, family):
    """Counts are the model's own choice, probs and spec_probs follow the family's rule,
    top-k weights are the ones the experts receive, and the manifest names the rule.

    Red when the collector takes a plain top-k instead of the router's indices (sigmoid
    families: bias-corrected, group-limited choice), when it scores by a list of family
    names (glm4_moe, dots1 and exaone_moe recorded as softmax), when it adds
    e_score_correction_bias into the probabilities, or when it recomputes top-k weights
    as renormalised probabilities (sigmoid families' routed_scaling_factor, PhiMoE)."""
    model = peaked(tiny(family))
    routers = [r for _, r in find_routers(model)]
    watch = Watch(model)
    try:
        tr = read_trace(collect(model, PROMPTS[:1], tmp_path / "t", max_new_tokens=3, tokens=True))
    finally:
        watch.close()
    rule = RULE[family]
    assert tr.manifest.source["routing"]["rule"] == rule
    assert len(watch.idx) == tr.num_iterations == 3
    other = "softmax" if rule == "sigmoid" else "sigmoid"
    widest = 0.0  # how far the other rule is from this one: the test's power
    plain_topk_differs = False
    for t in range(3):
        for j, router in enumerate(routers):
            want = np.bincount(watch.idx[t][j].reshape(-1).numpy(), minlength=tr.num_experts)
            np.testing.assert_array_equal(tr.counts[t, j], want)
            p = reference_probs(rule, router, watch.h[t][j])
            np.testing.assert_allclose(tr.probs[t, j], p.mean(0).numpy(), atol=2e-3)
            q = reference_probs(other, router, watch.h[t][j]).mean(0).numpy()
            widest = max(widest, float(np.abs(q - p.mean(0).numpy()).max()))
            plain = torch.topk(p, tr.top_k, dim=-1).indices.sort(-1).values
            plain_topk_differs |= bool((plain != watch.idx[t][j].sort(-1).values).any())
            if j > 0:
                s = reference_probs(rule, router, watch.h[t][j - 1]).mean(0).numpy()
                np.testing.assert_allclose(tr.spec_probs[t, j], s, atol=2e-3)
    assert widest > 0.05  # peaked routers: a wrong rule is far outside the tolerance
    if rule == "sigmoid":  # the bias-corrected, group-limited choice is not a plain top-k
        assert plain_topk_differs
    tok = read_tokens(tr)
    L = tr.num_layers
    ids = np.concatenate([np.stack([watch.idx[t][j].numpy() for j in range(L)], 1)
                          for t in range(3)])  # fmt: skip
    wts = np.concatenate([np.stack([watch.wts[t][j].float().numpy() for j in range(L)], 1)
                          for t in range(3)])  # fmt: skip
    np.testing.assert_array_equal(tok.topk_ids.reshape(ids.shape), ids)
    np.testing.assert_allclose(tok.topk_weights.reshape(wts.shape), wts, rtol=2e-3, atol=2e-3)


def test_the_rule_is_read_from_the_router_not_the_model_type():
    """Red when the scoring rule comes from a list of model types (``model_type``)."""
    sig = tiny("glm4_moe")
    sig.config.model_type = "mixtral"
    soft = tiny("mixtral")
    soft.config.model_type = "deepseek_v3"
    assert Recorder(sig).routing.rule == "sigmoid"
    assert Recorder(soft).routing.rule == "softmax"


class _Router(torch.nn.Module):
    """A router returning ``(logits, weights, indices)`` with weights from ``score``."""

    def __init__(self, hidden: int, experts: int, k: int, score, renormalise=True) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(experts, hidden))
        self.k, self.score, self.renormalise = k, score, renormalise

    def forward(self, h):  # type: ignore[no-untyped-def]
        z = torch.nn.functional.linear(h, self.weight)
        s = self.score(z)
        w, i = torch.topk(s, self.k, dim=-1)
        if self.renormalise:
            w = w / w.sum(-1, keepdim=True)
        return z, w, i


class _ToyModel(torch.nn.Module):
    """Two decoder layers whose ``mlp.gate`` is ``router()``; the forward runs them."""

    def __init__(self, router, k: int = 2, **config) -> None:  # type: ignore[no-untyped-def]
        super().__init__()
        torch.manual_seed(3)
        self.config = SimpleNamespace(
            num_local_experts=4, num_experts_per_tok=k, hidden_size=8, model_type="toy", **config
        )
        self.embed = torch.nn.Embedding(50, 8)
        self.model = torch.nn.Module()
        self.model.layers = torch.nn.ModuleList()
        for _ in range(2):
            layer = torch.nn.Module()
            layer.mlp = torch.nn.Module()
            layer.mlp.gate = router()
            self.model.layers.append(layer)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed


def _sqrt_softplus(z):  # type: ignore[no-untyped-def]
    return torch.nn.functional.softplus(z).sqrt()


def test_a_router_whose_rule_cannot_be_determined_is_refused(tmp_path):
    """Red when an unknown scoring rule (sqrt-softplus weights), a top-1 router whose
    weight is always 1, or a logits-only router with a selection bias is recorded as
    softmax instead of refused; and when the refusal leaves ``<out>.parts`` behind."""
    odd = _ToyModel(lambda: _Router(8, 4, 2, _sqrt_softplus))
    with pytest.raises(FmoesimError, match="cannot determine its scoring rule.*fit none"):
        collect(odd, PROMPTS, tmp_path / "t")
    assert not (tmp_path / "t.parts").exists()
    top1 = _ToyModel(lambda: _Router(8, 4, 1, torch.sigmoid), k=1)
    with pytest.raises(FmoesimError, match="fit softmax and sigmoid"):
        Recorder(top1)
    declared = _ToyModel(lambda: _Router(8, 4, 1, torch.sigmoid), k=1, scoring_func="sigmoid")
    assert Recorder(declared).routing.rule == "sigmoid"
    with pytest.raises(FmoesimError, match="scoring_func 'sqrtsoftplus'"):
        Recorder(_ToyModel(lambda: _Router(8, 4, 2, torch.sigmoid), scoring_func="sqrtsoftplus"))

    def biased_linear():  # type: ignore[no-untyped-def]
        lin = torch.nn.Linear(8, 4, bias=False)
        lin.register_buffer("e_score_correction_bias", torch.zeros(4))
        return lin

    with pytest.raises(FmoesimError, match="returns only logits.*e_score_correction_bias"):
        Recorder(_ToyModel(biased_linear))


def test_a_router_contradicting_its_config_is_refused():
    """Red when a router's sigmoid weights are recorded as the config's declared softmax."""
    m = _ToyModel(lambda: _Router(8, 4, 2, torch.sigmoid), scoring_func="softmax")
    with pytest.raises(FmoesimError, match="follow sigmoid, the config's scoring_func says"):
        Recorder(m)
