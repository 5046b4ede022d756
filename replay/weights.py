"""Expert weights in host memory, and the compute the replay runs: expert FFNs and
stand-ins of the right size for attention, router, dense layers and the LM head.

Every expert is one contiguous host tensor of shape ``(f, 3, h)`` (``f`` the expert's
intermediate size, ``h`` the hidden size): row ``i`` holds row ``i`` of the gate
projection (``w1``), of the up projection (``w3``) and column ``i`` of the down
projection (``w2``).  A MoEpic segment, a slice of the intermediate dimension (top = the
first ``θ f`` rows, bottom = the rest), is then one contiguous block that a single
``copy_`` moves, and any chunk of a transfer is too.

An expert's bytes set its rows.  A model in bf16, fp16 or fp32 has ``f`` rows in every
layer.  A model whose expert size differs by layer (``expert_size_bytes_by_layer``) or
whose experts are quantized (GGUF, MXFP4, int4) gets, per layer, the rows of the compute
dtype (bf16 for quantized storage) that hold that layer's expert bytes
(:func:`expert_rows`; an engine runs quantized kernels that dequantize as they go; here:
dense rows of the same bytes, because the replay validates what moves over the link and
what the cache holds, and its expert compute is a stand-in either way).

Weights are random (seeded) by default; :func:`load_checkpoint` reads a local
safetensors checkpoint instead (the per-expert names the Hugging Face hub uses for
Mixtral, PhiMoE, Qwen-MoE, OLMoE, DeepSeek, and the fused ``gate_up_proj``/``down_proj``
tensors of transformers 5).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fmoesim.errors import FmoesimError
from fmoesim.specs.model import ModelSpec

#: Host memory a replay may pin, as a fraction of the machine's physical memory.
HOST_FRACTION = 0.8
#: Device memory the expert cache and the stand-ins may use, as a fraction of free memory.
DEVICE_FRACTION = 0.9


def host_memory_bytes() -> int:
    """Physical memory of this machine in bytes (0 where unknown)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


#: bytes per element of the dtypes the replay computes in
COMPUTE_DTYPES = {"bfloat16": 2, "float16": 2, "float32": 4}


def compute_dtype(model: ModelSpec) -> str:
    """The dtype the replay computes ``model``'s experts in on a GPU: its own where it
    is bf16, fp16 or fp32, bf16 for quantized storage (see the module docstring)."""
    return model.dtype if model.dtype in COMPUTE_DTYPES else "bfloat16"


def expert_rows(model: ModelSpec) -> list[int]:
    """``(num_layers,)`` intermediate rows of each layer's replayed experts: the rows of
    :func:`compute_dtype` that hold the layer's expert bytes, at least 1 (``f`` for a
    model in its own compute dtype with one expert size)."""
    if model.dtype in COMPUTE_DTYPES and model.expert_size_bytes_by_layer is None:
        return [model.expert_intermediate_size] * model.num_layers
    row = 3 * model.hidden_size * COMPUTE_DTYPES[compute_dtype(model)]
    return [max(1, round(b / row)) for b in model.layer_expert_bytes]


def torch_dtype(torch: Any, model: ModelSpec, device: str) -> Any:
    """:func:`compute_dtype` on a GPU; float32 on the CPU (bf16 matmuls are slow
    emulations there, and CPU timings are meaningless anyway)."""
    if device == "cpu":
        return torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[
        compute_dtype(model)
    ]


def check_host_memory(model: ModelSpec, element_bytes: int, have_bytes: int | None = None) -> int:
    """Bytes the host weights need; raise when they exceed :data:`HOST_FRACTION` of the
    machine's memory, naming the numbers."""
    L, E = model.num_layers, model.num_experts
    need = E * sum(expert_rows(model)) * 3 * model.hidden_size * element_bytes
    have = host_memory_bytes() if have_bytes is None else have_bytes
    if have and need > HOST_FRACTION * have:
        raise FmoesimError(
            f"model {model.name}: {L} layers x {E} experts x {need / (L * E) / 1e6:.1f} MB = "
            f"{need / 1e9:.1f} GB of host weights, over {HOST_FRACTION:.0%} of this "
            f"machine's {have / 1e9:.1f} GB; pick a smaller model"
        )
    return need


class HostExperts:
    """All routed experts' weights on the host: ``tensor(key)`` is expert ``key % (L E)``
    (layer-major, as the simulator's keys) as a ``(rows, 3, h)`` tensor (``rows`` its
    layer's :func:`expert_rows`), pinned when the replay copies to a GPU."""

    def __init__(
        self,
        model: ModelSpec,
        device: str = "cpu",
        seed: int = 0,
        checkpoint: str | os.PathLike[str] | None = None,
    ) -> None:
        import torch

        self.model = model
        self.dtype = torch_dtype(torch, model, device)
        pin = device.startswith("cuda")
        check_host_memory(model, torch.empty(0, dtype=self.dtype).element_size())
        L, E = model.num_layers, model.num_experts
        h = model.hidden_size
        self.n = L * E
        self.rows = expert_rows(model)  # (L,)
        if checkpoint is not None and self.rows != [model.expert_intermediate_size] * L:
            raise FmoesimError(
                f"model {model.name}: a checkpoint's experts have "
                f"{model.expert_intermediate_size} rows, its expert sizes want {self.rows[0]} "
                "(rule: a checkpoint replays a model in its own dtype, one size per expert)"
            )
        self.row_bytes = 3 * h * torch.empty(0, dtype=self.dtype).element_size()
        # element offset of each expert in the one allocation (L E + 1,)
        self._start = [0] * (self.n + 1)
        for i in range(self.n):
            self._start[i + 1] = self._start[i] + self.rows[i // E] * 3 * h
        # one allocation for all experts, page-locked as it is (cudaHostRegister) on a GPU:
        # pin_memory=True per tensor would round each up to a power of two (up to 2x)
        # (where torch.cuda.cudart is missing: one pinned allocation instead)
        cudart: Any = None
        if pin:
            try:
                cudart = torch.cuda.cudart()
            except (AttributeError, RuntimeError):
                cudart = None
        register = cudart is not None
        self._all = torch.empty(
            self._start[-1], dtype=self.dtype, pin_memory=pin and not register
        )  # (sum over experts of rows x 3 x h,)
        if checkpoint is None:
            # perf: one seeded random pool of two experts' size (std 1/sqrt(h) keeps outputs
            # finite), each expert a window of it at its own offset: a copy per expert
            # instead of a random draw per expert (a draw takes minutes for 58 GB)
            big = max(self.rows) * 3 * h
            gen = torch.Generator().manual_seed(seed)
            pool = (torch.randn(2 * big, generator=gen) / h**0.5).to(self.dtype)
            for i in range(self.n):
                per = self._start[i + 1] - self._start[i]
                off = (i * 104729) % per
                self._all[self._start[i] : self._start[i + 1]].copy_(pool[off : off + per])
        else:
            loaded = load_checkpoint(checkpoint, model)
            for i in range(self.n):
                self.tensor(i).copy_(loaded(i // E, i % E))
        self.pinned = False
        if register:
            nbytes = self._all.numel() * self._all.element_size()
            err = cudart.cudaHostRegister(self._all.data_ptr(), nbytes, 0)
            if int(err) != 0:
                raise FmoesimError(
                    f"pinning {nbytes / 1e9:.1f} GB of host weights failed (cudaHostRegister "
                    f"error {int(err)}); check the locked-memory limit (ulimit -l)"
                )
            self.pinned = True

    def tensor(self, key: int) -> Any:
        """The ``(rows, 3, h)`` host tensor of ``key``'s expert."""
        i = key % self.n
        return self._all[self._start[i] : self._start[i + 1]].view(-1, 3, self.model.hidden_size)

    def __del__(self) -> None:
        if getattr(self, "pinned", False):
            try:
                import torch

                torch.cuda.cudart().cudaHostUnregister(self._all.data_ptr())
            except ImportError:  # the interpreter is shutting down: the OS unpins
                pass


_SHARED: dict[tuple[str, str, int, str], HostExperts] = {}


def shared_host_experts(
    model: ModelSpec,
    device: str = "cpu",
    seed: int = 0,
    checkpoint: str | os.PathLike[str] | None = None,
) -> HostExperts:
    """The :class:`HostExperts` of these arguments, built once per process and kept for
    the next replay of the same model (a sweep over policies and budgets builds, and on a
    GPU pins, the host weights once); a different model replaces the kept one."""
    key = (repr(model), device, seed, str(checkpoint))
    host = _SHARED.get(key)
    if host is None:
        _SHARED.clear()  # frees (and unpins) the previous model's weights first
        host = _SHARED[key] = HostExperts(model, device, seed, checkpoint)
    return host


def _checkpoint_names(path: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, over every ``*.safetensors`` file of ``path`` (a
    directory or one file)."""
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors")) if path.is_dir() else [path]
    if not files:
        raise FmoesimError(f"{path}: no *.safetensors file")
    names: dict[str, Path] = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    names[k] = file
        except Exception as exc:  # noqa: BLE001 - any unreadable file is one line
            raise FmoesimError(f"{file}: not a readable safetensors file ({exc})") from None
    return names


def load_checkpoint(path: str | os.PathLike[str], model: ModelSpec) -> Any:
    """A function ``(layer, expert) -> (f, 3, h) tensor`` reading the routed experts of a
    local safetensors checkpoint.  MoE layer ``l`` is decoder layer ``l + dense_layers``
    (dense layers come first, as in DeepSeek).  Each tensor is read when asked for."""
    import torch
    from safetensors import safe_open

    p = Path(path)
    names = _checkpoint_names(p)
    f_, h = model.expert_intermediate_size, model.hidden_size
    layouts = (
        ("block_sparse_moe.experts.{e}.w1.weight", "block_sparse_moe.experts.{e}.w3.weight",
         "block_sparse_moe.experts.{e}.w2.weight"),
        ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
         "mlp.experts.{e}.down_proj.weight"),
    )  # fmt: skip
    fused = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
    fused_sparse = ("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.experts.down_proj")

    def get(name: str, index: int | None = None) -> Any:
        if name not in names:
            raise FmoesimError(f"{p}: tensor {name!r} is missing")
        with safe_open(str(names[name]), framework="pt") as f:
            if index is None:
                return f.get_tensor(name)
            return f.get_slice(name)[index]  # perf: one expert of a fused (E, ...) tensor

    def read(layer: int, expert: int) -> Any:
        pre = f"model.layers.{layer + model.dense_layers}."
        for w1n, w3n, w2n in layouts:
            if pre + w1n.format(e=expert) in names:
                w1, w3 = get(pre + w1n.format(e=expert)), get(pre + w3n.format(e=expert))
                w2 = get(pre + w2n.format(e=expert))
                break
        else:
            for gu_n, down_n in (fused, fused_sparse):
                if pre + gu_n in names:
                    gate_up = get(pre + gu_n, expert)  # (2f, h)
                    if tuple(gate_up.shape) != (2 * f_, h):
                        raise FmoesimError(
                            f"{p}: layer {layer} expert {expert} {gu_n} has shape "
                            f"{tuple(gate_up.shape)}, model {model.name} says {(2 * f_, h)}"
                        )
                    w1, w3 = gate_up[:f_], gate_up[f_:]
                    w2 = get(pre + down_n, expert)  # (h, f)
                    break
            else:
                raise FmoesimError(
                    f"{p}: no expert {expert} of layer {layer + model.dense_layers} under any "
                    f"known name (e.g. {pre + layouts[0][0].format(e=expert)})"
                )
        want = {"w1": (f_, h), "w3": (f_, h), "w2": (h, f_)}
        for nm, t in (("w1", w1), ("w3", w3), ("w2", w2)):
            if tuple(t.shape) != want[nm]:
                raise FmoesimError(
                    f"{p}: layer {layer} expert {expert} {nm} has shape {tuple(t.shape)}, "
                    f"model {model.name} says {want[nm]}"
                )
        return torch.stack([w1, w3, w2.T], dim=1)  # (f, 3, h)

    return read


def checkpoint_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The ``config.json`` next to a checkpoint (empty when there is none)."""
    p = Path(path)
    cfg = (p if p.is_dir() else p.parent) / "config.json"
    return json.loads(cfg.read_text()) if cfg.exists() else {}


class Executor:
    """The compute of one GPU (or the CPU): expert FFNs on resident weights, and
    stand-ins of the right size for the rest of the model.

    Stand-ins (paper: the real model's layers; here: operators of the same shapes with
    one set of random weights shared by all layers, because only their time matters and
    every layer has the same shapes): attention = q/k/v/o projections of ``tokens`` new
    tokens plus scaled dot-product attention whose score count is ``pairs`` (queries
    against a random key/value cache of ``pairs / tokens`` positions); router = one
    ``h x E`` projection; dense layer = attention + a SwiGLU MLP; LM head = ``h x V``.
    An MLA model (DeepSeek) runs the grouped-query stand-in of ``num_attention_heads``
    heads of ``head_dim``: the profiler measures its time, and the simulator then reads
    that measurement, not the shape.
    """

    def __init__(self, model: ModelSpec, device: str, dtype: Any, seed: int = 0) -> None:
        import torch

        self.torch, self.F = torch, torch.nn.functional
        self.model, self.device, self.dtype = model, device, dtype
        h, hd = model.hidden_size, model.head_dim
        nq, nkv = model.num_attention_heads, model.num_kv_heads
        gen = torch.Generator(device=device).manual_seed(seed)

        def rnd(*shape: int) -> Any:
            return (torch.randn(*shape, generator=gen, device=device) / shape[-1] ** 0.5).to(dtype)

        self.wq, self.wkv, self.wo = rnd(nq * hd, h), rnd(2 * nkv * hd, h), rnd(h, nq * hd)
        self.w_router = rnd(model.num_experts, h)
        fs = model.num_shared_experts * model.shared_expert_intermediate_size
        self.w_shared = rnd(fs, 3, h) if fs else None
        fd = model.dense_intermediate_size
        self.w_dense = rnd(fd, 3, h) if model.dense_layers and fd else None
        fr = model.residual_intermediate_size
        self.w_residual = rnd(fr, 3, h) if fr else None
        self._head: Any = None
        self._x: Any = rnd(1, h)
        self._kv: Any = rnd(2, nq, 1, hd)

    def standin_bytes(self, max_tokens: int, max_kv: int) -> int:
        """Device bytes of the stand-ins at ``max_tokens`` and ``max_kv`` (an estimate
        for the memory check, LM head included)."""
        m = self.model
        el = self.torch.empty(0, dtype=self.dtype).element_size()
        h = m.hidden_size
        weights = (2 * m.num_attention_heads + 2 * m.num_kv_heads) * m.head_dim * h
        weights += m.num_experts * h + m.vocab_size * h
        weights += 3 * h * (m.num_shared_experts * m.shared_expert_intermediate_size)
        weights += 3 * h * (m.dense_intermediate_size + m.residual_intermediate_size)
        acts = 8 * max_tokens * max(h, m.expert_intermediate_size)
        kv = 2 * m.num_attention_heads * max_kv * m.head_dim
        return int((weights + acts + kv) * el)

    def release(self) -> None:
        """Drop the device tensors of the stand-ins (the executor is unusable after)."""
        self.wq = self.wkv = self.wo = self.w_router = self.w_shared = self.w_dense = None
        self.w_residual = None
        self._head = self._x = self._kv = None

    def _tokens(self, t: int) -> Any:
        if self._x.shape[0] < t:
            self._x = self.torch.randn(
                2 * t, self.model.hidden_size, device=self.device, dtype=self.dtype
            )
        return self._x[:t]

    def ffn(self, w: Any, tokens: int) -> Any:
        """SwiGLU of an ``(f, 3, h)`` weight on ``tokens`` token states."""
        F, x = self.F, self._tokens(max(tokens, 1))
        return F.linear(F.silu(F.linear(x, w[:, 0])) * F.linear(x, w[:, 1]), w[:, 2].T)

    def attention(self, tokens: int, pairs: int) -> Any:
        """The attention stand-in (see the class docstring)."""
        torch, F, m = self.torch, self.F, self.model
        t = max(tokens, 1)
        nq, hd = m.num_attention_heads, m.head_dim
        ctx = max(1, round(pairs / t))
        if self._kv.shape[2] < ctx:
            self._kv = torch.randn(2, nq, 2 * ctx, hd, device=self.device, dtype=self.dtype)
        x = self._tokens(t)
        q = F.linear(x, self.wq).view(1, t, nq, hd).transpose(1, 2)  # (1, nq, t, hd)
        F.linear(x, self.wkv)  # the new keys and values (their values are not needed)
        kv = self._kv[:, None, :, :ctx]  # (2, 1, nq, ctx, hd): 4-D, so fused kernels apply
        o = F.scaled_dot_product_attention(q, kv[0], kv[1])
        return F.linear(o[0].transpose(0, 1).reshape(t, nq * hd), self.wo)

    def router(self, tokens: int) -> Any:
        """The gate's projection, after the layer's residual dense MLP where the model has
        one (Arctic)."""
        if self.w_residual is not None:
            self.ffn(self.w_residual, tokens)
        return self.F.linear(self._tokens(max(tokens, 1)), self.w_router)

    def shared(self, tokens: int) -> None:
        """The always-on shared experts (resident, outside the budget)."""
        if self.w_shared is not None:
            self.ffn(self.w_shared, tokens)

    def dense(self, tokens: int, pairs: int) -> None:
        """A dense decoder layer: attention and a SwiGLU MLP."""
        self.attention(tokens, pairs)
        if self.w_dense is not None:
            self.ffn(self.w_dense, tokens)

    def lm_head(self, sequences: int) -> None:
        """The LM head for ``sequences`` next tokens (weights made on first use)."""
        if self._head is None:
            m = self.model
            self._head = self.torch.randn(
                m.vocab_size, m.hidden_size, device=self.device, dtype=self.dtype
            )
        self.F.linear(self._tokens(max(sequences, 1)), self._head)
