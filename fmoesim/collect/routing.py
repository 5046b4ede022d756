"""How the MoE routers of a Hugging Face model score and choose experts.

A router is found on each decoder layer as the first of ``mlp.gate``, ``mlp.router`` or
``block_sparse_moe.gate`` whose weight has one row per routed expert.  Its forward output
is read as the model's own choice: the integer tensor is the chosen experts (``(N, k)``),
a float tensor of the same shape (or an ``(N, E)`` one that is zero outside the chosen
experts) their weights.  A router that returns only ``(N, E)`` logits (a plain linear
layer, the transformers 4.x layout) chooses the top-k of its logits.

The **scoring rule** is read from the router itself, never from the model's name: each
router is run once on a seeded probe input whose logits ``z = W h + b`` are spread out
(standard deviation :data:`PROBE_LOGIT_STD`), and the weights it returns for its chosen
experts are compared with each rule's prediction up to a per-token factor (which
absorbs renormalisation over the top-k, ``norm_topk_prob`` and
``routed_scaling_factor``):

``softmax``
    weights proportional to ``softmax(z)`` at the chosen experts (Mixtral, Qwen-MoE,
    OLMoE, GPT-OSS's softmax over its top-k logits, ...).  Probabilities recorded:
    ``softmax(z)`` over all routed experts.
``sigmoid``
    weights proportional to ``sigmoid(z)`` at the chosen experts (DeepSeek-V3, GLM-4-MoE,
    dots1, EXAONE-MoE: they choose by ``sigmoid(z) + e_score_correction_bias`` within the
    best ``topk_group`` of ``n_group`` expert groups).  Probabilities recorded:
    ``sigmoid(z) / sum(sigmoid(z))``; the correction bias is left out, as the model uses
    it only to choose, never to weight.  The top-k of these probabilities can therefore
    differ from the recorded counts, which are always the model's own choice.
``sparsemixer``
    PhiMoE's masked-softmax multipliers (its eval-mode sparsemixer, with the router's
    ``router_jitter_noise`` as epsilon).  Probabilities recorded: ``softmax(z)``.

A router whose weights fit more than one rule (a top-1 router renormalising its single
weight to 1) takes the config's ``scoring_func`` when it is one of them; one whose
weights fit no rule, or contradict ``scoring_func``, is refused.  A router that returns
no weights takes ``scoring_func`` too, else ``softmax`` -- unless the config or router
shows a choice other than a plain top-k (``e_score_correction_bias``, ``n_group`` > 1, a
``topk_method`` other than ``greedy``): then it is refused, and so is a router returning
only logits under such a choice, as the model's own choice cannot be read from them.
Every layer must follow the same rule.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from fmoesim.errors import FmoesimError

ROUTER_PATHS = (("mlp", "gate"), ("mlp", "router"), ("block_sparse_moe", "gate"))
RULES = ("softmax", "sigmoid", "sparsemixer")
#: spread of the probe's router logits: far enough from uniform that the rules differ
PROBE_LOGIT_STD = 2.0
PROBE_TOKENS = 64
PROBE_SEED = 0
#: share of probe tokens whose weights must fit a rule
PROBE_FIT_SHARE = 0.9

PROBS_TEXT = {
    "softmax": "softmax(W h + b) over the routed experts",
    "sigmoid": "sigmoid(W h) normalised to sum 1 over the routed experts "
    "(e_score_correction_bias left out: the model uses it only to choose)",
    "sparsemixer": "softmax(W h) over the routed experts",
}
WEIGHTS_TEXT = {
    "softmax": "the router's own (proportional to probs at the chosen experts)",
    "sigmoid": "the router's own (sigmoid scores of the chosen experts, renormalised when "
    "norm_topk_prob, times routed_scaling_factor)",
    "sparsemixer": "the router's own (sparsemixer masked-softmax multipliers)",
}
CONFIG_FIELDS = ("norm_topk_prob", "routed_scaling_factor", "n_group", "topk_group")


@dataclass(frozen=True)
class Routing:
    """The scoring rule of a model's routers and what the trace records under it."""

    rule: str  # one of RULES
    evidence: str  # how the rule was read from the model
    returns_weights: bool  # the router returns its top-k weights
    returns_indices: bool  # the router returns its choice (else: top-k of its logits)
    details: dict[str, Any] = field(default_factory=dict)  # config fields, selection bias

    def probs(self, logits: Any) -> Any:
        """Per-expert probabilities ``(N, E)`` from router logits ``(N, E)``."""
        import torch

        if self.rule == "sigmoid":
            s = logits.sigmoid()
            return s / s.sum(dim=-1, keepdim=True)
        return torch.softmax(logits, dim=-1)

    def manifest(self) -> dict[str, Any]:
        """The ``source.routing`` entry of a collected trace's manifest."""
        selection = (
            "tokens per expert among the router's own chosen indices"
            if self.returns_indices
            else "tokens per expert among the top-k of the router's logits (it returns no indices)"
        )
        weights = (
            WEIGHTS_TEXT[self.rule]
            if self.returns_weights
            else "the chosen experts' probs renormalised (the router returns no weights)"
        )
        return {
            "rule": self.rule,
            "evidence": self.evidence,
            "probs": PROBS_TEXT[self.rule],
            "spec_probs": "probs of layer l's router applied to layer l-1's router input",
            "expert_counts": selection,
            "topk_weights": weights,
            **self.details,
        }


def find_routers(model: Any) -> list[tuple[int, Any]]:
    """``(decoder layer index, router module)`` of every MoE layer, in order: the first
    of ``mlp.gate`` / ``mlp.router`` / ``block_sparse_moe.gate`` whose weight has one row
    per routed expert (dense layers and shared-expert gates do not)."""
    layers = decoder_layers(model)
    E = num_experts_of(model.config)
    out = []
    for i, layer in enumerate(layers):
        for parent, child in ROUTER_PATHS:
            mod = getattr(getattr(layer, parent, None), child, None)
            w = getattr(mod, "weight", None)
            if w is not None and w.ndim == 2 and w.shape[0] == E:
                out.append((i, mod))
                break
    if not out:
        raise FmoesimError(
            f"{type(model).__name__}: no MoE router found under "
            f"{', '.join('.'.join(p) for p in ROUTER_PATHS)} (unsupported family or version)"
        )
    return out


def decoder_layers(model: Any) -> Sequence[Any]:
    """The decoder layers at ``model.model.layers`` or ``model.layers``."""
    for path in (("model", "layers"), ("layers",)):
        obj = model
        for name in path:
            obj = getattr(obj, name, None)
        if obj is not None:
            return list(obj)
    raise FmoesimError(f"{type(model).__name__}: no decoder layers at model.layers")


def num_experts_of(config: Any) -> int:
    """Routed experts per layer from a transformers config."""
    for key in ("num_local_experts", "num_experts", "n_routed_experts"):
        v = getattr(config, key, None)
        if isinstance(v, int) and v > 0:
            return v
    raise FmoesimError(
        f"{type(config).__name__}: no expert count in the config (num_local_experts, "
        "num_experts or n_routed_experts): not a mixture-of-experts model?"
    )


def top_k_of(config: Any) -> int:
    """Experts per token from a transformers config."""
    v = getattr(config, "num_experts_per_tok", None)
    if not isinstance(v, int) or v < 1:
        raise FmoesimError(f"{type(config).__name__}: no num_experts_per_tok in the config")
    return v


def router_logits(router: Any, h: Any) -> Any:
    """``W h + b`` of a router in float32, for inputs ``h`` ``(N, hidden)``."""
    import torch.nn.functional as F

    bias = getattr(router, "bias", None)
    return F.linear(h.float(), router.weight.float(), None if bias is None else bias.float())


def split_router_output(out: Any, num_experts: int) -> tuple[Any, Any]:
    """``(indices (N, k), weights (N, k))`` of a router's forward output; ``(None, None)``
    for logits only, weights None where the router returns none.  Raises ValueError for
    an output of another form."""
    import torch

    items = out if isinstance(out, (tuple, list)) else (out,)
    tensors = [t for t in items if isinstance(t, torch.Tensor)]
    ints = [t for t in tensors if not t.is_floating_point()]
    floats = [t for t in tensors if t.is_floating_point()]
    if not ints:
        if len(floats) == 1 and floats[0].shape[-1] == num_experts:
            return None, None
        raise ValueError("neither logits (N, E) nor chosen experts")
    if len(ints) > 1:
        raise ValueError(f"{len(ints)} integer tensors")
    idx = ints[0].reshape(-1, ints[0].shape[-1])
    same = [f for f in floats if f.numel() == idx.numel() and f.shape[-1] == idx.shape[-1]]
    if same:  # (N, k) weights: the last such tensor (logits come first)
        return idx, same[-1].reshape(idx.shape)
    for f in floats:  # (N, E) scores that are zero outside the chosen experts
        if f.shape[-1] == num_experts and f.numel() == idx.shape[0] * num_experts:
            full = f.reshape(-1, num_experts)
            chosen = full.gather(1, idx)
            if bool(torch.isclose(full.abs().sum(-1), chosen.abs().sum(-1)).all()):
                return idx, chosen
    return idx, None


def _sparsemixer(z: Any, eps: float) -> tuple[Any, Any]:
    """Eval-mode sparsemixer on logits ``z`` ``(N, E)``: ``(weights, indices)`` of its two
    picks, each the softmax over the logits within ``2 eps`` (relative) of the pick."""
    import torch

    picks_w, picks_i = [], []
    src = z
    for _ in range(2):
        top, i = src.max(dim=-1, keepdim=True)
        far = (top - z) / z.abs().clamp(min=top) > 2 * eps
        picks_w.append(torch.softmax(src.masked_fill(far, float("-inf")), dim=-1).gather(1, i))
        picks_i.append(i)
        src = src.scatter(1, i, float("-inf"))
    return torch.cat(picks_w, dim=1), torch.cat(picks_i, dim=1)


def _fit_share(w: Any, expected: Any, tol: float) -> float:
    """Share of rows where ``w`` is ``expected`` times one factor, within ``tol``."""
    r = w.float() / expected
    spread = (r.max(dim=-1).values - r.min(dim=-1).values) / r.abs().max(dim=-1).values
    return float((spread <= tol).float().mean())


def _rules_fitting(router: Any, z: Any, idx: Any, w: Any) -> list[str]:
    tol = 1e-3
    expected = {"softmax": z.softmax(dim=-1).gather(1, idx), "sigmoid": z.sigmoid().gather(1, idx)}
    eps = getattr(router, "router_jitter_noise", None)
    if isinstance(eps, (int, float)) and idx.shape[-1] == 2:
        sw, si = _sparsemixer(z, float(eps))
        if bool((si == idx).all()):
            expected["sparsemixer"] = sw
    return [r for r, e in expected.items() if _fit_share(w, e, tol) >= PROBE_FIT_SHARE]


def _probe_input(router: Any, hidden: int) -> Any:
    import torch

    gen = torch.Generator().manual_seed(PROBE_SEED)
    h = torch.randn(PROBE_TOKENS, hidden, generator=gen)
    w = router.weight.detach().float().cpu()
    std = float((h @ w.T).std())
    if std > 0:
        h = h * (PROBE_LOGIT_STD / std)
    return h.to(device=router.weight.device, dtype=router.weight.dtype)


def _where(layer: int, router: Any) -> str:
    return f"the router of layer {layer} ({type(router).__name__})"


def read_routing(model: Any, routers: Sequence[tuple[int, Any]], top_k: int) -> Routing:
    """The scoring rule of ``routers`` (module docstring), the same for every layer;
    one-line :class:`FmoesimError` when it cannot be determined."""
    import torch

    cfg = model.config
    E = num_experts_of(cfg)
    hidden = int(routers[0][1].weight.shape[1])
    declared = getattr(cfg, "scoring_func", None)
    if declared is not None and declared not in ("softmax", "sigmoid"):
        raise FmoesimError(
            f"{type(model).__name__}: config scoring_func {declared!r} is not one of "
            "softmax, sigmoid (the rules the collector records)"
        )
    details = {k: getattr(cfg, k) for k in CONFIG_FIELDS if hasattr(cfg, k)}
    biased = any(getattr(r, "e_score_correction_bias", None) is not None for _, r in routers)
    details["e_score_correction_bias"] = biased
    grouped = (getattr(cfg, "n_group", None) or 1) > 1
    method = getattr(cfg, "topk_method", None)
    sign = (
        "e_score_correction_bias"
        if biased
        else "n_group > 1"
        if grouped
        else f"topk_method {method!r}"
        if method not in (None, "greedy")
        else ""
    )  # a choice other than a plain top-k
    rules: dict[str, str] = {}  # rule -> how it was read, from the first layer that has it
    has_w = has_idx = True
    for layer, router in routers:
        probe = copy.deepcopy(router).float()  # float32: 16-bit rounding blurs the rules
        probe._forward_hooks.clear()  # hooks copied from the router stay off the probe
        probe._forward_pre_hooks.clear()
        h = _probe_input(probe, hidden)
        try:
            with torch.no_grad():
                out = probe(h)
            idx, w = split_router_output(out, E)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise FmoesimError(
                f"{_where(layer, router)}: its output is not logits, chosen experts and "
                f"weights ({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})"
            ) from None
        if idx is None and sign:
            raise FmoesimError(
                f"{_where(layer, router)}: returns only logits, and the model chooses by "
                f"another rule than their top-k ({sign}): cannot read its choice"
            )
        if idx is not None and idx.shape[-1] != top_k:
            raise FmoesimError(
                f"{_where(layer, router)}: chooses {idx.shape[-1]} experts per token, "
                f"the config's num_experts_per_tok is {top_k}"
            )
        has_w, has_idx = has_w and w is not None, has_idx and idx is not None
        if w is not None:
            fits = _rules_fitting(probe, router_logits(probe, h), idx.long(), w)
            if len(fits) == 1:
                rule, evidence = fits[0], "the router's weights on a probe input"
                if declared is not None and declared != rule and rule != "sparsemixer":
                    raise FmoesimError(
                        f"{_where(layer, router)}: its weights follow {rule}, the config's "
                        f"scoring_func says {declared}"
                    )
            elif declared in fits:
                rule, evidence = declared, "the config's scoring_func"
            else:
                what = "fit " + " and ".join(fits) if fits else "fit none of " + ", ".join(RULES)
                said = (
                    f"the config's scoring_func says {declared}"
                    if declared
                    else "no scoring_func in the config"
                )
                raise FmoesimError(
                    f"{_where(layer, router)}: cannot determine its scoring rule (its weights "
                    f"on a probe input {what}; {said})"
                )
        elif declared is not None:
            rule, evidence = declared, "the config's scoring_func"
        elif sign:
            raise FmoesimError(
                f"{_where(layer, router)}: returns no weights, and the model shows a rule "
                f"other than a softmax top-k ({sign}): cannot determine its scoring rule"
            )
        else:
            rule, evidence = "softmax", "a router returning no weights, no sign of another rule"
        rules.setdefault(rule, evidence)
    if len(rules) != 1:
        raise FmoesimError(
            f"{type(model).__name__}: its routers follow different rules "
            f"({', '.join(sorted(rules))}); the collector records one rule per trace"
        )
    ((rule, evidence),) = rules.items()
    return Routing(rule, evidence, has_w, has_idx, details)
