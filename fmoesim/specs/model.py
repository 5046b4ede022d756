"""The shape of an MoE model: what the simulator needs to size experts and time layers."""

from __future__ import annotations

from dataclasses import dataclass

from fmoesim.errors import ConfigError

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1, "int4": 0.5, "int2": 0.25}


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
    """

    name: str = "unnamed"
    num_layers: int = 32
    num_experts: int = 8
    top_k: int = 2
    num_shared_experts: int = 0
    shared_expert_intermediate_size: int = 0
    dense_layers: int = 0
    dense_intermediate_size: int = 0
    hidden_size: int = 4096
    expert_intermediate_size: int = 14336
    num_attention_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    vocab_size: int = 32000
    dtype: str = "bfloat16"
    source: str = ""
    hf_model_id: str = ""

    @property
    def dtype_bytes(self) -> float:
        """Bytes per weight element for ``dtype``."""
        return DTYPE_BYTES[self.dtype]

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down projections)."""
        return 3 * self.hidden_size * self.expert_intermediate_size

    @property
    def expert_size_bytes(self) -> int:
        """Bytes of one routed expert's weights."""
        return int(self.expert_params * self.dtype_bytes)

    @property
    def layer_topk_bytes(self) -> int:
        """Bytes of one layer's top-k experts: the smallest budget that can run a token."""
        return self.top_k * self.expert_size_bytes

    @property
    def total_expert_bytes(self) -> int:
        """Bytes of all routed experts of the model."""
        return self.num_layers * self.num_experts * self.expert_size_bytes

    def validate(self, prefix: str = "model") -> ModelSpec:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""
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
        ):
            value = getattr(self, key)
            if not isinstance(value, int) or value < 0:
                raise ConfigError(f"{prefix}.{key}", value, "must be a non-negative integer")
        if self.top_k > self.num_experts:
            raise ConfigError(
                f"{prefix}.top_k", self.top_k, f"must be <= num_experts ({self.num_experts})"
            )
        if self.dtype not in DTYPE_BYTES:
            raise ConfigError(
                f"{prefix}.dtype", self.dtype, f"must be one of {sorted(DTYPE_BYTES)}"
            )
        return self
