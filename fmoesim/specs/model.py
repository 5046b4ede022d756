"""The shape of an MoE model: what the simulator needs to size experts and time layers."""

from __future__ import annotations

from dataclasses import dataclass

from fmoesim.atomic import is_plain_name
from fmoesim.errors import ConfigError

#: bytes per weight of each storage format, block and group scales included
DTYPE_BYTES: dict[str, float] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8": 1,  # FP8 (e4m3 / e5m2) with a per-tensor or per-channel scale: negligible
    "int4": 0.5,  # bare 4-bit weights, scales not counted
    "int2": 0.25,  # bare 2-bit weights, scales not counted
    # GPTQ / AWQ int4 with group size 128: an fp16 scale and a 4-bit zero point per group
    # (AutoGPTQ / AutoAWQ packing): 4 + 20 / 128 bits
    "int4-g128": (4 + 20 / 128) / 8,
    # GGUF block formats (llama.cpp ggml-common.h): block_q8_0 is 34 bytes per 32 weights,
    # block_q4_K 144 bytes and block_q6_K 210 bytes per 256-weight super-block.  Q4_K_M
    # files mix Q4_K and Q6_K by tensor, so their expert size differs by layer: give
    # expert_size_bytes_by_layer (an imported trace that records sizes does).
    # MXFP4 (OCP Microscaling): 4-bit elements sharing one 8-bit scale per 32 (GPT-OSS's
    # experts): 4 + 8 / 32 bits
    "mxfp4": (4 + 8 / 32) / 8,
    # HQQ with quantized meta-data (BaseQuantizeConfig(quant_zero=True, quant_scale=True), as
    # Mixtral-Offloading runs it: 2-bit experts in groups of 16, 4-bit in groups of 64): an
    # 8-bit scale and an 8-bit zero per group, and the scales' own fp16 scale and zero per
    # 128 scales: nbits + 16 / g + 32 / (128 g) bits
    "hqq-2bit-g16": (2 + 16 / 16 + 32 / (128 * 16)) / 8,
    "hqq-4bit-g64": (4 + 16 / 64 + 32 / (128 * 64)) / 8,
    # Mixtral-Offloading's attention (its notebook's attn_config): 4-bit in groups of 64,
    # the scales' own fp16 scale and zero per 256 scales (scale_quant_params group 256)
    "hqq-4bit-g64-s256": (4 + 16 / 64 + 32 / (256 * 64)) / 8,
    "q8_0": 34 / 32,
    "q4_k": 144 / 256,
    "q6_k": 210 / 256,
}

#: the float formats, whose models keep their KV cache at the weights' width; a
#: weight-only quantization (the integer, HQQ, GGUF and MXFP4 formats) keeps it at 16 bits
#: unless ``kv_cache_dtype`` says otherwise
FLOAT_DTYPES = ("float32", "bfloat16", "float16", "float8")


@dataclass
class ModelSpec:
    """Shape of an MoE model.

    ``num_layers`` counts the MoE layers only (the ones with a router); ``dense_layers``
    is how many leading decoder layers have a dense MLP instead (DeepSeek's
    ``first_k_dense_replace``); they cost compute but are never offloaded.

    An expert is a SwiGLU FFN with three ``hidden_size x expert_intermediate_size``
    matrices, so ``expert_size_bytes = 3 * hidden * intermediate * bytes(dtype)``
    (a Mixtral-8x7B expert in bf16: 3 x 4096 x 14336 x 2 = 352,321,536 bytes).
    Shared (always-on) experts are resident and outside the expert budget.
    ``residual_intermediate_size`` is a dense SwiGLU MLP in every MoE layer, computed
    before the layer's router and resident like a shared expert (Snowflake Arctic's
    residual MLP beside its MoE: ``parallel_attn_mlp_res``); 0 for none.

    Attention is grouped-query attention (``num_attention_heads`` query heads and
    ``num_kv_heads`` key/value heads of ``head_dim``) unless ``kv_lora_rank`` is set:
    then it is DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 §2.1): queries
    through a ``q_lora_rank`` down-projection (0: a direct projection), keys and values
    from a ``kv_lora_rank`` latent, query/key heads of ``qk_nope_head_dim +
    qk_rope_head_dim``, value heads of ``head_dim`` (``v_head_dim``); the KV cache holds
    the latent and the shared RoPE key (:attr:`kv_cache_elems`).

    ``expert_size_bytes_by_layer`` (one size per MoE layer) replaces that size where a
    model's quantization differs by layer (GGUF Q4_K_M keeps some layers' down
    projections in Q6_K); ``expert_size_bytes`` is then their mean, for reporting, and
    the cache and the link use each layer's own size.

    Encoder-decoder models (Switch Transformers, NLLB-MoE): the first
    ``encoder_layers`` of the ``num_layers`` MoE layers are the encoder's.  They run once
    per request, over its prompt, at prefill; the decoder's MoE layers run at every
    iteration, over one token per request (at prefill, the decoder's start token).
    ``moe_layer_period`` is how many transformer blocks each MoE layer stands for (the
    sparse step: Switch 2, NLLB-MoE 4): every block's attention, and the dense FFN of the
    ``moe_layer_period - 1`` blocks without experts (``dense_intermediate_size`` wide),
    compute in the MoE layer's step before its router.  A decoder block's
    cross-attention is timed as attention over the prompt's encoder states (read like
    cached keys), its projections not counted twice.  ``expert_matrices`` is 3 for a
    SwiGLU FFN (gate, up, down) and 2 for a two-matrix FFN (``wi``, ``wo``: Switch,
    NLLB-MoE); the dense FFNs of the model have the same form.

    Widths: ``dtype`` is the routed experts' storage format, and also that of the shared
    experts and the dense and residual MLPs.  ``attention_dtype`` is the attention
    projections' and ``embedding_dtype`` the embedding's, the LM head's and the routers'
    (each empty: ``dtype``); a mixed-precision model sets them (MoEpic's Mixtral-8x7B:
    2-bit experts, 4-bit attention, a 16-bit embedding and LM head).  ``kv_cache_dtype``
    is the KV cache's (empty: ``dtype`` when it is a float format, else ``bfloat16``: a
    weight-only quantization keeps 16-bit activations).  They set the resident weights'
    bytes and each operator's weight and cache reads in the compute model.
    """

    name: str = "unnamed"
    num_layers: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0
    dense_intermediate_size: int = 0
    residual_intermediate_size: int = 0
    hidden_size: int = 4096
    expert_intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    vocab_size: int = 32000
    dtype: str = "bfloat16"
    attention_dtype: str = ""  # empty: dtype
    embedding_dtype: str = ""  # embedding, LM head and routers; empty: dtype
    kv_cache_dtype: str = ""  # empty: dtype if a float format, else bfloat16
    source: str = ""
    hf_model_id: str = ""
    expert_size_bytes_by_layer: list[int] | None = None
    encoder_layers: int = 0
    moe_layer_period: int = 1
    expert_matrices: int = 3

    @property
    def dtype_bytes(self) -> float:
        """Bytes per weight element for ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def attention_dtype_bytes(self) -> float:
        """Bytes per weight of the attention projections (``attention_dtype``, or
        ``dtype``)."""
        return DTYPE_BYTES[self.attention_dtype or self.dtype]

    @property
    def embedding_dtype_bytes(self) -> float:
        """Bytes per weight of the embedding, the LM head and the routers
        (``embedding_dtype``, or ``dtype``)."""
        return DTYPE_BYTES[self.embedding_dtype or self.dtype]

    @property
    def kv_cache_dtype_bytes(self) -> float:
        """Bytes per element of the KV cache (``kv_cache_dtype``; else ``dtype`` when it
        is a float format, else 2: a weight-only quantization keeps 16-bit
        activations)."""
        if self.kv_cache_dtype:
            return DTYPE_BYTES[self.kv_cache_dtype]
        return DTYPE_BYTES[self.dtype if self.dtype in FLOAT_DTYPES else "bfloat16"]

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections, or ``wi`` and
        ``wo`` with ``expert_matrices = 2``)."""
        return self.expert_matrices * self.hidden_size * self.expert_intermediate_size

    @property
    def expert_size_bytes(self) -> int:
        """Bytes of one routed expert's weights (the mean over layers when they differ)."""
        if self.expert_size_bytes_by_layer:
            sizes = self.expert_size_bytes_by_layer
            return int(round(sum(sizes) / len(sizes)))
        return int(self.expert_params * self.dtype_bytes)

    @property
    def layer_expert_bytes(self) -> list[int]:
        """Bytes of one routed expert of each MoE layer ``(num_layers,)``."""
        if self.expert_size_bytes_by_layer:
            return [int(b) for b in self.expert_size_bytes_by_layer]
        return [self.expert_size_bytes] * self.num_layers

    @property
    def uniform_experts(self) -> bool:
        """Whether every layer's experts have one size."""
        return len(set(self.layer_expert_bytes)) == 1

    @property
    def layer_topk_bytes(self) -> int:
        """Bytes of one layer's top-k experts (the largest layer's): the smallest budget
        that can run a token."""
        return self.top_k * max(self.layer_expert_bytes)

    def gpu_topk_experts(self, num_gpus: int) -> int:
        """The most routed experts one of ``num_gpus`` GPUs computes in a token's layer
        step: ``min(top_k, ceil(E / N))``, since expert ``e`` lives on GPU ``e mod N``."""
        return min(self.top_k, -(-self.num_experts // num_gpus))

    def gpu_topk_bytes(self, num_gpus: int) -> int:
        """Bytes of :meth:`gpu_topk_experts` experts of the largest layer. One GPU's is
        :attr:`layer_topk_bytes`."""
        return self.gpu_topk_experts(num_gpus) * max(self.layer_expert_bytes)

    def experts_per_gpu(self, num_gpus: int) -> int:
        """The most routed experts one of ``num_gpus`` GPUs holds: expert ``e`` of every
        layer lives on GPU ``e mod num_gpus``, so GPU 0 holds ``ceil(E / N)`` a layer."""
        return self.num_layers * -(-self.num_experts // num_gpus)

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of the model."""
        return self.num_experts * sum(self.layer_expert_bytes)

    @property
    def attention_params(self) -> int:
        """Weights of one decoder layer's attention projections (norms left out).
        Grouped-query: q, k, v and o.  MLA: the query down- and up-projections (or one
        direct projection), the joint key-value down-projection with the RoPE key, the
        key-value up-projection and o.  DeepSeek-V3: 187,105,280."""
        h, heads = self.hidden_size, self.num_attention_heads
        if not self.kv_lora_rank:
            q_dim = heads * self.head_dim
            kv_dim = self.num_kv_heads * self.head_dim
            return h * (q_dim + 2 * kv_dim) + q_dim * h
        qk = heads * (self.qk_nope_head_dim + self.qk_rope_head_dim)
        r = self.q_lora_rank
        q = h * r + r * qk if r else h * qk
        kv = h * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank * heads * (
            self.qk_nope_head_dim + self.head_dim
        )
        return q + kv + heads * self.head_dim * h

    @property
    def kv_cache_elems(self) -> int:
        """Elements one token adds to one layer's KV cache: keys and values of every
        key/value head, or with MLA the latent and the shared RoPE key (as serving
        engines cache it)."""
        if self.kv_lora_rank:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return 2 * self.num_kv_heads * self.head_dim

    @property
    def pair_flops(self) -> int:
        """FLOPs of one (query, key) pair of one layer: the score over the query/key
        head dimensions and the weighted sum over the value head dimensions, every
        head."""
        heads = self.num_attention_heads
        if self.kv_lora_rank:
            return 2 * heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.head_dim)
        return 4 * heads * self.head_dim

    @property
    def resident_params_by_width(self) -> tuple[int, int, int]:
        """:attr:`resident_params` in the three groups that may differ in width:
        ``(embedding, attention, other)``.  Embedding: the embedding, the LM head and the
        routers (``embedding_dtype``); attention: every decoder block's projections
        (``attention_dtype``); other: the shared experts, the residual MLPs and the dense
        MLPs (``dtype``)."""
        h, f = self.hidden_size, self.expert_matrices
        attention = self.attention_params
        period = self.moe_layer_period  # the blocks each MoE layer stands for
        embedding = 2 * self.vocab_size * h + self.num_layers * h * self.num_experts
        attentions = (self.num_layers * period + self.dense_layers) * attention
        per_moe_layer = f * h * self.residual_intermediate_size
        if self.num_shared_experts:
            per_moe_layer += f * h * self.shared_expert_intermediate_size
        # the dense FFNs of the blocks without experts that each MoE layer stands for
        per_moe_layer += (period - 1) * f * h * self.dense_intermediate_size
        other = (
            self.num_layers * per_moe_layer
            + self.dense_layers * f * h * self.dense_intermediate_size
        )
        return embedding, attentions, other

    @property
    def resident_params(self) -> int:
        """Parameters that stay in GPU memory whatever the policy: the embedding and the
        LM head (untied, as in every preset model), attention (:attr:`attention_params`)
        in every decoder layer, the routers, the shared experts, the residual MLPs and the
        dense layers' MLPs.  Norms and biases are left out (under 0.1% of any preset
        model).  Qwen1.5-MoE-A2.7B: 1,858,404,352, which with its 12,457,082,880
        routed-expert parameters is the 14.3B of its model card."""
        return sum(self.resident_params_by_width)

    @property
    def resident_weight_bytes(self) -> int:
        """Bytes of :attr:`resident_params`, each group at its width
        (:attr:`resident_params_by_width`)."""
        embedding, attention, other = self.resident_params_by_width
        return int(
            embedding * self.embedding_dtype_bytes
            + attention * self.attention_dtype_bytes
            + other * self.dtype_bytes
        )

    def validate(self, prefix: str = "model") -> ModelSpec:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""
        if not is_plain_name(self.name):  # it names run folders and trace caches
            raise ConfigError(
                f"{prefix}.name", self.name,
                "must be a plain name (not empty, no '/', '\\' or '..', not starting with '.')",
            )  # fmt: skip
        for key in (
            "num_layers",
            "num_experts",
            "top_k",
            "hidden_size",
            "expert_intermediate_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"{prefix}.{key}", value, "must be a positive integer")
        for key in (
            "num_shared_experts",
            "shared_expert_intermediate_size",
            "dense_layers",
            "dense_intermediate_size",
            "residual_intermediate_size",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{prefix}.{key}", value, "must be a non-negative integer")
        if self.num_kv_heads > self.num_attention_heads:  # grouped-query attention shares them
            raise ConfigError(
                f"{prefix}.num_kv_heads",
                self.num_kv_heads,
                f"must be <= num_attention_heads ({self.num_attention_heads})",
            )
        mla = ("q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim")
        if not self.kv_lora_rank:
            for key in mla:
                if getattr(self, key):
                    raise ConfigError(
                        f"{prefix}.{key}", getattr(self, key), "is MLA's: set kv_lora_rank too"
                    )
        elif not self.qk_nope_head_dim + self.qk_rope_head_dim:
            raise ConfigError(
                f"{prefix}.qk_nope_head_dim",
                self.qk_nope_head_dim,
                "MLA (kv_lora_rank set) needs query/key heads: qk_nope_head_dim + "
                "qk_rope_head_dim > 0",
            )
        if not 0 <= self.encoder_layers < self.num_layers:
            raise ConfigError(
                f"{prefix}.encoder_layers",
                self.encoder_layers,
                f"must be in [0, num_layers = {self.num_layers}): the decoder has MoE layers",
            )
        if not isinstance(self.moe_layer_period, int) or self.moe_layer_period < 1:
            raise ConfigError(
                f"{prefix}.moe_layer_period", self.moe_layer_period, "must be an integer >= 1"
            )
        if self.expert_matrices not in (2, 3):
            raise ConfigError(
                f"{prefix}.expert_matrices",
                self.expert_matrices,
                "must be 3 (SwiGLU: gate, up, down) or 2 (wi, wo)",
            )
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"{prefix}.top_k", self.top_k, f"must be <= num_experts ({self.num_experts})"
            )
        sizes = self.expert_size_bytes_by_layer
        if sizes is not None and (
            len(sizes) != self.num_layers
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in sizes)
        ):
            raise ConfigError(
                f"{prefix}.expert_size_bytes_by_layer",
                sizes,
                f"must be null or {self.num_layers} positive integers (one per MoE layer)",
            )
        for key in ("dtype", "attention_dtype", "embedding_dtype", "kv_cache_dtype"):
            value = getattr(self, key)
            if value not in DTYPE_BYTES and not (key != "dtype" and value == ""):
                empty = "" if key == "dtype" else " (or empty: the default)"
                raise ConfigError(
                    f"{prefix}.{key}", value, f"must be one of {sorted(DTYPE_BYTES)}{empty}"
                )
        return self
