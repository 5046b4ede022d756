"""GPU compute-time model for the simulator backend.

Every operator is a roofline-style sum of a memory term and a compute term plus a
kernel-launch overhead, which makes an expert FFN exactly ``a + b * tokens`` as
DESIGN.md asks: ``a`` = weights read from GPU memory plus the kernels' launches, ``b`` =
FLOPs per token.  A measured hardware profile (``hardware.measured[<model name>]``,
written by the replay profiler) overrides any coefficient it provides.

``expert_launch_s`` is the share of ``a`` that does not shrink with the weights: the
kernels' launches.  A segment of an expert (a slice of its intermediate dimension)
computed on its own reads its share of the weights but launches every kernel, so it
takes ``launch + fraction * (a - launch + b * tokens)``
(:meth:`ComputeModel.segment_s`).  A measured profile without it leaves ``a`` less the
roofline's weight read (never below 0).

Each operator reads its weights at its group's width: the experts, shared experts and
dense MLPs at the model's ``dtype``, attention at ``attention_dtype``, the router and the
LM head at ``embedding_dtype``; attention reads the KV cache at ``kv_cache_dtype``
(:class:`~fmoesim.specs.model.ModelSpec`).
"""

from __future__ import annotations

from dataclasses import dataclass

from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec


@dataclass(frozen=True)
class ComputeModel:
    """Times (seconds) of the operators of one model on one GPU."""

    expert_a_s: float  # fixed cost of one expert FFN
    expert_b_s: float  # per routed token
    shared_a_s: float  # all shared experts of a layer together
    shared_b_s: float
    attn_a_s: float  # weight read + launch per layer
    attn_b_s: float  # per new token (projections)
    attn_kv_s: float  # per KV-cache token read
    attn_pair_s: float  # per (query, key) pair of the score/value products
    router_a_s: float
    router_b_s: float
    residual_a_s: float  # dense MLPs before the router (Arctic; Switch's dense blocks), or 0
    residual_b_s: float
    dense_a_s: float  # a dense (non-MoE) layer's MLP
    dense_b_s: float
    lm_head_a_s: float
    lm_head_b_s: float  # per sequence (only the last token's logits are computed)
    expert_launch_s: float = 0.0  # the part of expert_a_s a segment pays in full

    @classmethod
    def from_specs(cls, model: ModelSpec, hw: HardwareSpec) -> ComputeModel:
        """Derive every coefficient from the model shape and the hardware's roofline."""
        flops = hw.peak_tflops * 1e12 * hw.compute_efficiency  # FLOP/s achieved
        mem = hw.hbm_gbps * 1e9 * hw.memory_efficiency  # bytes/s achieved
        k0 = hw.kernel_overhead_s
        bpe = model.dtype_bytes  # experts, shared experts, dense and residual MLPs
        attn_bpe = model.attention_dtype_bytes
        emb_bpe = model.embedding_dtype_bytes  # embedding, LM head, routers
        kv_bpe = model.kv_cache_dtype_bytes
        h = model.hidden_size

        mats = model.expert_matrices  # 3: SwiGLU (gate, up, down); 2: wi, wo

        def ffn(inter: int) -> tuple[float, float]:
            params = mats * h * inter
            return mats * k0 + params * bpe / mem, 2 * params / flops

        expert_read_s = mats * h * model.expert_intermediate_size * bpe / mem

        exp_a, exp_b = ffn(model.expert_intermediate_size)
        sh_a, sh_b = (
            ffn(model.shared_expert_intermediate_size) if model.num_shared_experts else (0.0, 0.0)
        )
        dn_a, dn_b = ffn(model.dense_intermediate_size) if model.dense_layers else (0.0, 0.0)
        rs = model.residual_intermediate_size
        res_a, res_b = ffn(rs) if rs else (0.0, 0.0)
        # an MoE layer that stands for `period` blocks: every block's attention, and the
        # dense FFNs of the blocks without experts before the router (Switch, NLLB-MoE)
        period = model.moe_layer_period
        if period > 1:
            da, db = ffn(model.dense_intermediate_size)
            res_a += (period - 1) * da
            res_b += (period - 1) * db
        attn_params = model.attention_params
        values = dict(
            expert_a_s=exp_a,
            expert_b_s=exp_b,
            shared_a_s=sh_a,
            shared_b_s=sh_b,
            attn_a_s=period * (6 * k0 + attn_params * attn_bpe / mem),
            attn_b_s=period * 2 * attn_params / flops,
            attn_kv_s=period * model.kv_cache_elems * kv_bpe / mem,
            attn_pair_s=period * model.pair_flops / flops,
            router_a_s=k0 + h * model.num_experts * emb_bpe / mem,
            router_b_s=2 * h * model.num_experts / flops,
            residual_a_s=res_a,
            residual_b_s=res_b,
            dense_a_s=dn_a,
            dense_b_s=dn_b,
            lm_head_a_s=k0 + model.vocab_size * h * emb_bpe / mem,
            lm_head_b_s=2 * model.vocab_size * h / flops,
        )
        measured = (hw.measured or {}).get(model.name, {})
        values.update({k: float(v) for k, v in measured.items() if k in values})
        a = values["expert_a_s"]
        launch = measured.get("expert_launch_s")
        if launch is None:
            launch = a - expert_read_s if "expert_a_s" in measured else mats * k0
        return cls(**values, expert_launch_s=min(max(float(launch), 0.0), a))

    def expert_s(self, tokens: int) -> float:
        """One routed expert's FFN over ``tokens`` tokens."""
        return self.expert_a_s + self.expert_b_s * tokens

    def segment_s(self, tokens: int, fraction: float) -> float:
        """A ``fraction`` of one routed expert's FFN (a segment) computed on its own over
        ``tokens`` tokens: every kernel launched, its share of the weights read and of
        the FLOPs; the whole expert at ``fraction`` 1."""
        launch = self.expert_launch_s
        return launch + fraction * (self.expert_a_s - launch + self.expert_b_s * tokens)

    def shared_s(self, tokens: int) -> float:
        """All always-on shared experts of one layer."""
        return self.shared_a_s + self.shared_b_s * tokens if self.shared_a_s else 0.0

    def attention_s(self, tokens: int, kv_tokens: int, pairs: int) -> float:
        """Attention of one layer: ``tokens`` new tokens reading ``kv_tokens`` cached
        keys/values in total, with ``pairs`` (query, key) score products."""
        return (
            self.attn_a_s
            + self.attn_b_s * tokens
            + self.attn_kv_s * kv_tokens
            + self.attn_pair_s * pairs
        )

    def router_s(self, tokens: int) -> float:
        """The router (gate) of one layer, after the layer's residual dense MLP where the
        model has one (it computes before the router, so a demand load cannot hide
        behind it)."""
        r = self.router_a_s + self.router_b_s * tokens
        if self.residual_a_s:
            r += self.residual_a_s + self.residual_b_s * tokens
        return r

    def dense_mlp_s(self, tokens: int) -> float:
        """The MLP of one dense (non-MoE) layer."""
        return self.dense_a_s + self.dense_b_s * tokens

    def lm_head_s(self, sequences: int) -> float:
        """The LM head for ``sequences`` next-token logits."""
        return self.lm_head_a_s + self.lm_head_b_s * sequences
