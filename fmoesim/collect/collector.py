"""Record the gate distributions of a Hugging Face MoE model into a trace.

Hooks on each MoE layer's router module (:mod:`fmoesim.collect.routing` says which
module, how its output is read and how its scoring rule is determined): a forward
*pre*-hook keeps the router's input ``h``, a forward hook keeps the experts the model
itself picked (and their weights where the router returns them).  Full probabilities
are recomputed from ``h`` and the router's weights under the model's scoring rule
(``softmax(W h + b)``, or ``sigmoid(W h)`` normalised to sum 1 for routers that score
with sigmoids), so it does not matter whether a transformers version returns logits,
already-softmaxed scores or only the top-k.  The manifest's ``source.routing`` names
the rule, how it was read from the model, and what ``probs``, ``expert_counts`` and
``topk_weights`` hold under it.  Per (request, iteration, layer): token counts of the
model's own choices, mean probabilities, and ``spec_probs`` = the router of layer ``l``
applied to layer ``l-1``'s router input (layer 0: the previous iteration's last MoE
router input; null in the prefill).  Per iteration: the mean of the embedding layer's
output over its tokens, optionally reduced by a seeded Gaussian projection.

Generation is greedy (``model.generate``), ``batch_size`` requests at a time
(left-padded); each forward pass is one iteration of every request still generating
(the prefill, then one per generated token).  Finished requests are kept as ``.npz``
parts in ``<out>.parts/`` with a ``state.json`` of the collection's arguments and the
model's fingerprint (:mod:`fmoesim.collect.state`), so an interrupted run resumes where
it stopped and a resume with other arguments or another model is refused; the trace is
assembled from the parts at the end (streaming row groups) and moved into place
atomically.  Everything that can be refused (arguments, destination, prompts, routers
and their rule, a stopped collection) is checked before ``<out>.parts/`` is made.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.atomic import save_npz_atomic
from fmoesim.collect.routing import (
    ROUTER_PATHS,
    Routing,
    decoder_layers,
    find_routers,
    num_experts_of,
    read_routing,
    router_logits,
    split_router_output,
    top_k_of,
)
from fmoesim.collect.state import (
    check_resume,
    collection_arguments,
    library_versions,
    model_fingerprint,
    write_state,
)
from fmoesim.errors import FmoesimError
from fmoesim.trace.schema import TraceManifest, TraceModel
from fmoesim.trace.writer import TraceWriter

__all__ = [
    "ROUTER_PATHS",
    "Recorder",
    "Routing",
    "check_arguments",
    "check_destination",
    "collect",
    "find_routers",
    "num_experts_of",
    "parts_dir",
    "request_arrays",
    "top_k_of",
]


@dataclass
class _Pass:
    """What one forward pass (iteration) recorded, for every row of the batch."""

    embed: Any = None  # (B, S, hidden) embedding-layer output
    h: dict[int, Any] = field(default_factory=dict)  # MoE layer -> (B * S, hidden) input
    idx: dict[int, Any] = field(default_factory=dict)  # MoE layer -> (B * S, k) chosen
    wts: dict[int, Any] = field(default_factory=dict)  # MoE layer -> (B * S, k) or absent

    def row(self, r: int, keep: Any) -> _Pass:
        """Batch row ``r``'s tokens where ``keep`` (S,) is true."""
        B, S = self.embed.shape[0], self.embed.shape[1]
        return _Pass(
            self.embed[r][keep],
            {j: h.reshape(B, S, -1)[r][keep] for j, h in self.h.items()},
            {j: i.reshape(B, S, -1)[r][keep] for j, i in self.idx.items()},
            {j: w.reshape(B, S, -1)[r][keep] for j, w in self.wts.items()},
        )


class Recorder:
    """Hooks on a model's routers and embedding layer; :meth:`take` returns the passes
    recorded since the last call.  Use as a context manager (hooks removed on exit).

    Constructing one finds the routers and reads their scoring rule (``routing``), and
    refuses a model without routers or with a rule it cannot determine."""

    def __init__(self, model: Any) -> None:
        import torch

        self.torch = torch
        self.model = model
        if getattr(model.config, "is_encoder_decoder", False):
            raise FmoesimError(
                f"{type(model).__name__}: an encoder-decoder model; the collector records "
                "decoder-only models (simulate encoder-decoder ones on the synthetic workload: "
                "model=switch-large-128, model=nllb-moe-54b)"
            )
        self.routers = find_routers(model)
        self.E, self.K = num_experts_of(model.config), top_k_of(model.config)
        self.routing: Routing = read_routing(model, self.routers, self.K)
        self._passes: list[_Pass] = []
        self._handles: list[Any] = []

    def __enter__(self) -> Recorder:
        emb = self.model.get_input_embeddings()
        self._handles.append(emb.register_forward_hook(self._on_embed))
        for j, (_, mod) in enumerate(self.routers):
            self._handles.append(mod.register_forward_pre_hook(self._pre(j)))
            self._handles.append(mod.register_forward_hook(self._post(j)))
        return self

    def __exit__(self, *exc: object) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _on_embed(self, mod: Any, args: Any, out: Any) -> None:
        self._passes.append(_Pass(embed=out.detach().float()))

    def _pre(self, j: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any) -> None:
            h = args[0]
            self._passes[-1].h[j] = h.detach().float().reshape(-1, h.shape[-1])

        return hook

    def _post(self, j: int) -> Callable[..., None]:
        def hook(mod: Any, args: Any, out: Any) -> None:
            idx, wts = split_router_output(out, self.E)
            if idx is None:  # logits only: the model takes their top-k (read_routing)
                logits = out[0] if isinstance(out, (tuple, list)) else out
                idx = self.torch.topk(logits.float(), self.K, dim=-1).indices
            elif wts is not None:
                self._passes[-1].wts[j] = wts.detach().float().reshape(-1, self.K)
            self._passes[-1].idx[j] = idx.detach().long().reshape(-1, self.K)

        return hook

    def probs(self, j: int, h: Any) -> Any:
        """Full routing distribution of MoE layer ``j`` for inputs ``h`` (tokens, hidden),
        under the model's scoring rule."""
        return self.routing.probs(router_logits(self.routers[j][1], h))

    def take(self) -> list[_Pass]:
        """The passes recorded since the last call."""
        out, self._passes = self._passes, []
        return out


def request_arrays(
    rec: Recorder, passes: list[_Pass], projection: np.ndarray | None
) -> dict[str, np.ndarray]:
    """One request's ``counts (T, L, E)``, ``probs``, ``spec_probs`` (NaN where null; layer
    0 predicted from the previous pass's last-layer router input of its final token),
    ``embedding (T, D)``, ``num_tokens (T,)`` and per-token ``topk_ids`` / ``topk_weights``."""
    torch = rec.torch
    L, E = len(rec.routers), rec.E
    T = len(passes)
    counts = np.zeros((T, L, E), np.int32)
    topk: list[tuple[np.ndarray, np.ndarray]] = []  # per iteration: (n, L, k) ids, weights
    probs = np.zeros((T, L, E), np.float64)
    spec = np.full((T, L, E), np.nan)
    ntok = np.zeros(T, np.int64)
    embs = []
    last = None
    with torch.no_grad():
        for t, p in enumerate(passes):
            n = p.h[0].shape[0]
            ntok[t] = n
            ids_t = np.zeros((n, L, rec.K), np.int64)
            wts_t = np.zeros((n, L, rec.K), np.float64)
            for j in range(L):
                idx = p.idx[j].cpu().numpy()
                np.add.at(counts[t, j], idx.reshape(-1), 1)
                full = rec.probs(j, p.h[j])  # (n, E)
                probs[t, j] = full.mean(dim=0).cpu().numpy()
                ids_t[:, j] = idx
                if j in p.wts:  # the router's own weights
                    wts_t[:, j] = p.wts[j].cpu().numpy()
                else:  # the chosen experts' probabilities, renormalised
                    sel = np.take_along_axis(full.cpu().numpy(), idx, axis=1)
                    wts_t[:, j] = sel / np.maximum(sel.sum(axis=1, keepdims=True), 1e-12)
                if j > 0:
                    spec[t, j] = rec.probs(j, p.h[j - 1]).mean(dim=0).cpu().numpy()
            topk.append((ids_t, wts_t))
            if t > 0 and last is not None:
                spec[t, 0] = rec.probs(0, last[None]).mean(dim=0).cpu().numpy()
            last = p.h[L - 1][-1]
            e = p.embed.reshape(-1, p.embed.shape[-1]).mean(dim=0).cpu().numpy()
            embs.append(e if projection is None else e @ projection)
    return {
        "counts": counts,
        "probs": probs,
        "spec_probs": spec,
        "embedding": np.stack(embs),
        "num_tokens": ntok,
        "topk_ids": np.concatenate([a for a, _ in topk]),  # (sum tokens, L, k)
        "topk_weights": np.concatenate([b for _, b in topk]),
    }


def projection_matrix(hidden: int, dim: int | None, seed: int) -> np.ndarray | None:
    """A seeded Gaussian random projection ``(hidden, dim)`` scaled by ``1/sqrt(dim)``, or
    None to keep the full embedding."""
    if dim is None or dim >= hidden:
        return None
    rng = np.random.default_rng(seed)
    return rng.standard_normal((hidden, dim)) / np.sqrt(dim)


def check_arguments(max_new_tokens: int, batch_size: int, embedding_dim: int | None) -> None:
    """Refuse arguments out of range (one line naming the option)."""
    if max_new_tokens < 1:
        raise FmoesimError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise FmoesimError(f"--batch-size must be >= 1, got {batch_size}")
    if embedding_dim is not None and embedding_dim < 1:
        raise FmoesimError(f"--embedding-dim must be >= 1 (or 0 to keep all), got {embedding_dim}")


def check_destination(out: str | os.PathLike[str], overwrite: bool) -> None:
    """Refuse an existing destination unless ``overwrite``, and even then one that is not
    a trace directory or an empty one (:func:`fmoesim.trace.writer.check_destination`),
    and one whose folder cannot take it: checked before the collection, not only when its
    trace is written."""
    from fmoesim.atomic import unwritable
    from fmoesim.trace.writer import check_destination as check_trace_destination

    if Path(out).exists() and not overwrite:
        raise FmoesimError(f"{out}: already exists (pass --force to replace it)")
    check_trace_destination(out, overwrite)
    # the trace and its finished requests (<out>.parts) are made beside it, before the
    # model loads (minutes for a large one)
    why = unwritable(out, file=True)
    if why is not None:
        raise FmoesimError(f"{out}: {why} (rule: the trace's folder can be written)")


def parts_dir(out: str | os.PathLike[str]) -> Path:
    """Where a collection into ``out`` keeps its finished requests: ``<out>.parts``."""
    out = Path(out)
    return out.with_name(out.name + ".parts")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int | None) -> None:
    """Refuse an empty prompt list, an empty prompt or a token id outside the vocabulary."""
    if not prompts:
        raise FmoesimError("no prompts to collect")
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise FmoesimError(f"prompt {i}: no tokens")
        bad = next((t for t in p if not 0 <= int(t) < (vocab_size or int(t) + 1)), None)
        if bad is not None:
            raise FmoesimError(
                f"prompt {i}: token id {bad} is outside the model's vocabulary "
                f"(0..{(vocab_size or 0) - 1})"
            )


def _vocab_size(model: Any) -> int | None:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None)
    return n if isinstance(n, int) else getattr(model.config, "vocab_size", None)


def shared_experts(config: Any) -> int:
    """Shared (always active) experts per MoE layer that a Hugging Face config declares:
    ``n_shared_experts`` (DeepSeek, GLM-4.5, dots.llm1), ``num_shared_experts`` (EXAONE),
    one for Qwen2-MoE's ``shared_expert_intermediate_size`` and for Llama 4."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(cfg, "model_type", "") in ("llama4", "llama4_text"):
        return 1
    for key in ("n_shared_experts", "num_shared_experts"):
        n = getattr(cfg, key, None)
        if isinstance(n, int) and n > 0:
            return n
    return 1 if getattr(cfg, "shared_expert_intermediate_size", None) else 0


def collect(
    model: Any,
    prompts: Sequence[Sequence[int]],
    out: str | os.PathLike[str],
    *,
    max_new_tokens: int = 32,
    embedding_dim: int | None = 64,
    projection_seed: int = 0,
    model_id: str = "",
    overwrite: bool = False,
    progress: bool = False,
    on_request: Callable[[int], None] | None = None,
    batch_size: int = 1,
    tokens: bool = False,
) -> Path:
    """Generate greedily for each prompt (token ids) and write the trace to ``out``.

    ``batch_size`` prompts are generated together (left-padded; a request's iterations
    end with the pass that produced its end-of-sequence token).  Finished requests are
    saved as parts in ``<out>.parts/``; calling again with the same prompts,
    ``max_new_tokens``, ``embedding_dim``, ``projection_seed`` and model after an
    interruption skips them (resume); other ones are refused, or with ``overwrite`` the
    stopped collection is discarded.  ``on_request(i)`` is called after request ``i`` is
    saved (progress, tests).  ``tokens`` also writes ``tokens.parquet``: each token's
    top-k ids and weights (the router's own weights where it returns them, else the chosen
    experts' probabilities renormalised).
    """
    out = Path(out)
    check_arguments(max_new_tokens, batch_size, embedding_dim)
    check_destination(out, overwrite)
    check_prompts(prompts, _vocab_size(model))
    model.eval()
    rec = Recorder(model)  # refuses a model without routers or with an unknown rule
    parts = parts_dir(out)
    arguments = collection_arguments(prompts, max_new_tokens, embedding_dim, projection_seed)
    versions = library_versions()
    fingerprint = model_fingerprint(model, [m for _, m in rec.routers])
    check_resume(parts, arguments, versions, fingerprint, overwrite)
    if not parts.exists():
        parts.mkdir(parents=True)
        write_state(parts, arguments, versions, fingerprint)
    proj = projection_matrix(int(model.config.hidden_size), embedding_dim, projection_seed)
    try:
        _generate(rec, prompts, parts, max_new_tokens, proj, batch_size, progress, on_request)
    except BaseException:
        if not any(parts.glob("*.npz")):  # nothing to resume from
            shutil.rmtree(parts, ignore_errors=True)
        raise
    cfg = model.config
    hidden = int(cfg.hidden_size)
    L, E, K = len(rec.routers), rec.E, rec.K
    D = hidden if proj is None else proj.shape[1]
    routing = rec.routing.manifest()
    man = TraceManifest(
        model=TraceModel(
            name=model_id or getattr(cfg, "model_type", "model"),
            num_layers=L,
            num_experts=E,
            top_k=K,
            hidden_size=hidden,
            dense_layers=len(decoder_layers(model)) - L,
            num_shared_experts=shared_experts(cfg),
        ),
        embedding_dim=D,
        source={
            "kind": "collector",
            "model_id": model_id,
            "model_type": getattr(cfg, "model_type", ""),
            "versions": versions,
            "probs": routing["probs"],
            "routing": routing,
            "model_fingerprint": fingerprint,
            "max_new_tokens": max_new_tokens,
        },
        has_probs=True,
        has_spec_probs=True,
        created_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        embedding_projection=None
        if proj is None
        else {"input_dim": hidden, "seed": projection_seed},
    )
    with TraceWriter(out, man, overwrite=overwrite) as w:
        for i in range(len(prompts)):
            with np.load(parts / f"{i:08d}.npz") as z:
                T = len(z["num_tokens"])
                w.add_request(i, prompt_tokens=int(z["prompt_tokens"]), output_tokens=T)
                ends = np.cumsum(z["num_tokens"])
                for t in range(T):
                    sl = slice(int(ends[t] - z["num_tokens"][t]), int(ends[t]))
                    w.add_iteration(
                        i,
                        t,
                        int(z["num_tokens"][t]),
                        z["embedding"][t],
                        z["counts"][t],
                        z["probs"][t],
                        z["spec_probs"][t],
                        (z["topk_ids"][sl], z["topk_weights"][sl]) if tokens else None,
                    )
    shutil.rmtree(parts)
    return out


def _generate(
    rec: Recorder,
    prompts: Sequence[Sequence[int]],
    parts: Path,
    max_new_tokens: int,
    proj: np.ndarray | None,
    batch_size: int,
    progress: bool,
    on_request: Callable[[int], None] | None,
) -> None:
    """Generate the requests that have no part in ``parts`` yet and save their parts."""
    import torch

    model = rec.model
    cfg = model.config
    starts: Iterable[int] = range(0, len(prompts), batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(starts, desc="collect", unit="batch", disable=None)  # a terminal only
    pad = getattr(cfg, "pad_token_id", None) or 0
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    with rec:
        for start in starts:
            todo = [
                i
                for i in range(start, min(start + batch_size, len(prompts)))
                if not (parts / f"{i:08d}.npz").exists()
            ]
            if not todo:
                continue
            S = max(len(prompts[i]) for i in todo)
            ids = torch.full((len(todo), S), pad, dtype=torch.long)
            mask = torch.zeros((len(todo), S), dtype=torch.long)
            for r, i in enumerate(todo):  # left padding, as generation needs
                p = list(prompts[i])
                ids[r, S - len(p) :] = torch.tensor(p)
                mask[r, S - len(p) :] = 1
            with torch.no_grad():
                seqs = model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=pad,
                )
            passes = rec.take()
            for r, i in enumerate(todo):
                gen = seqs[r, S:].tolist()
                n = next((t + 1 for t, tok in enumerate(gen) if tok in eos_ids), len(gen))
                rows = [passes[0].row(r, mask[r].bool())]
                rows += [p.row(r, torch.ones(1, dtype=torch.bool)) for p in passes[1:n]]
                arrays = request_arrays(rec, rows, proj)
                arrays["prompt_tokens"] = np.array(len(prompts[i]))
                save_npz_atomic(parts / f"{i:08d}.npz", arrays)
                if on_request is not None:
                    on_request(i)
