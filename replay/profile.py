"""``fmoesim-profile``: measure a machine and write a hardware profile for the simulator.

Measures, on ``--device`` (``cuda`` on a GPU; ``cpu`` runs the same code so CI exercises
it, but its numbers describe the CPU, and the profile says so):

- host-to-device copies (pinned host memory, ``copy_(non_blocking=True)``) over transfer
  sizes: a least-squares line ``time = overhead + size / bandwidth`` gives
  ``transfer_overhead_s`` and ``pcie_gbps``;
- one expert FFN (SwiGLU of the model's shapes) against routed token counts:
  ``expert_a_s + expert_b_s * tokens``;
- attention (projections and scaled dot-product attention of the model's shapes) against
  new tokens and cached context: ``attn_a_s + attn_b_s * tokens + attn_kv_s * kv +
  attn_pair_s * pairs``.

The fitted coefficients go into ``measured[<model name>]`` of a ``conf/hardware/`` YAML
(:class:`fmoesim.engine.compute.ComputeModel` uses them instead of the roofline), with the
device name, driver, torch version and date.  Written atomically.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.errors import FmoesimError, run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec

PROG = "fmoesim-profile"


def fit_linear(x: np.ndarray, y: np.ndarray) -> tuple[float, ...]:
    """Least squares ``y = c0 + c1 x1 + ...`` for ``x`` ``(n,)`` or ``(n, m)``; negative
    coefficients (noise) are clipped to 0 and the others refitted."""
    X = np.atleast_2d(np.asarray(x, dtype=np.float64).T).T  # (n, m)
    y = np.asarray(y, dtype=np.float64)
    keep = np.ones(X.shape[1] + 1, dtype=bool)
    while True:
        A = np.column_stack([np.ones(len(y)), X])[:, keep]
        coef, *_ = np.linalg.lstsq(A, y, rcond=None)
        full = np.zeros(len(keep))
        full[keep] = coef
        if (full >= 0).all():
            return tuple(float(c) for c in full)
        keep &= full > 0
        if not keep.any():
            return tuple(0.0 for _ in full)


class Timer:
    """Wall time of a callable on ``device``: CUDA events on a GPU, perf_counter on CPU;
    the median of ``repeats`` after one warm-up."""

    def __init__(self, torch: Any, device: str, repeats: int) -> None:
        self.torch, self.device, self.repeats = torch, device, repeats

    def __call__(self, fn: Callable[[], Any]) -> float:
        torch = self.torch
        fn()
        times = []
        for _ in range(self.repeats):
            if self.device.startswith("cuda"):
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            else:
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
        return float(np.median(times))


def measure_h2d(torch: Any, device: str, sizes: Sequence[int], timer: Timer) -> list[float]:
    """Seconds per host-to-device copy of each size in bytes."""
    pin = device.startswith("cuda")
    out = []
    for n in sizes:
        src = torch.empty(n, dtype=torch.uint8, pin_memory=pin)
        dst = torch.empty(n, dtype=torch.uint8, device=device)

        def copy(src: Any = src, dst: Any = dst) -> Any:
            return dst.copy_(src, non_blocking=True)

        out.append(timer(copy))
    return out


def measure_expert(
    torch: Any, device: str, model: ModelSpec, tokens: Sequence[int], timer: Timer, dtype: Any
) -> list[float]:
    """Seconds of one SwiGLU expert of the model's shapes per token count."""
    h, f = model.hidden_size, model.expert_intermediate_size
    w1 = torch.randn(f, h, device=device, dtype=dtype)
    w3 = torch.randn(f, h, device=device, dtype=dtype)
    w2 = torch.randn(h, f, device=device, dtype=dtype)
    F = torch.nn.functional
    out = []
    for t in tokens:
        x = torch.randn(t, h, device=device, dtype=dtype)

        def ffn(x: Any = x) -> Any:
            return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)

        out.append(timer(ffn))
    return out


def measure_attention(
    torch: Any,
    device: str,
    model: ModelSpec,
    points: Sequence[tuple[int, int]],
    timer: Timer,
    dtype: Any,
) -> list[float]:
    """Seconds of one attention layer (q/k/v/o projections + SDPA against a cache) per
    ``(new tokens, cached tokens)``."""
    h, hd = model.hidden_size, model.head_dim
    nq, nkv = model.num_attention_heads, model.num_kv_heads
    wq = torch.randn(nq * hd, h, device=device, dtype=dtype)
    wkv = torch.randn(2 * nkv * hd, h, device=device, dtype=dtype)
    wo = torch.randn(h, nq * hd, device=device, dtype=dtype)
    F = torch.nn.functional
    out = []
    for t, kv in points:
        x = torch.randn(t, h, device=device, dtype=dtype)
        cache = torch.randn(2, nq, kv, hd, device=device, dtype=dtype)

        def step(x: Any = x, cache: Any = cache, t: int = t) -> Any:
            q = F.linear(x, wq).view(t, nq, hd).transpose(0, 1)
            k_new, v_new = F.linear(x, wkv).view(t, 2, nkv, hd).unbind(1)
            rep = nq // nkv
            k = torch.cat([cache[0], k_new.transpose(0, 1).repeat_interleave(rep, 0)], dim=1)
            v = torch.cat([cache[1], v_new.transpose(0, 1).repeat_interleave(rep, 0)], dim=1)
            o = F.scaled_dot_product_attention(q, k, v)
            return F.linear(o.transpose(0, 1).reshape(t, nq * hd), wo)

        out.append(timer(step))
    return out


def profile(
    model: ModelSpec,
    device: str = "cuda",
    *,
    repeats: int = 10,
    sizes_bytes: Sequence[int] = (1 << 20, 4 << 20, 16 << 20, 64 << 20, 256 << 20),
    tokens: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128),
    attention_points: Sequence[tuple[int, int]] = (
        (1, 128),
        (1, 512),
        (1, 2048),
        (4, 512),
        (16, 512),
        (64, 0),
        (256, 0),
        (128, 256),
    ),  # fmt: skip
    name: str | None = None,
) -> HardwareSpec:
    """Measure and fit; the result is a :class:`HardwareSpec` whose ``measured`` holds the
    model's coefficients."""
    try:
        import torch
    except ImportError:
        raise FmoesimError("the profiler needs torch (pip install torch)") from None
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise FmoesimError(f"--device {device}: CUDA is not available here")
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(model.dtype, torch.float32)
    if device == "cpu":
        dtype = torch.float32  # CPU bf16 matmuls are slow emulations
    timer = Timer(torch, device, repeats)
    h2d = measure_h2d(torch, device, sizes_bytes, timer)
    overhead, per_byte = fit_linear(np.asarray(sizes_bytes), np.asarray(h2d))
    exp = measure_expert(torch, device, model, tokens, timer, dtype)
    exp_a, exp_b = fit_linear(np.asarray(tokens), np.asarray(exp))
    att = measure_attention(torch, device, model, attention_points, timer, dtype)
    # regressors as ComputeModel.attention_s takes them: new tokens, cached tokens read,
    # (query, key) score pairs (here every new token scores the cache and the new tokens)
    X = np.array([(t, kv, t * (kv + t)) for t, kv in attention_points], dtype=np.float64)
    a0, a1, a_kv, a_pair = fit_linear(X, np.asarray(att))
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    driver = ""
    if device.startswith("cuda"):
        driver = f"cuda {torch.version.cuda}"
    today = dt.date.today().isoformat()
    return HardwareSpec(
        name=name or f"measured-{gpu.lower().replace(' ', '-')}",
        gpu=gpu,
        num_gpus=1,
        pcie_gbps=(1.0 / per_byte) / 1e9 if per_byte > 0 else 1e6,
        transfer_overhead_s=overhead,
        source=(
            f"fmoesim-profile on {gpu} ({driver or 'no CUDA'}), torch {torch.__version__}, "
            f"{today}" + ("; CPU numbers: meaningless for a GPU server" if gpu == "cpu" else "")
        ),
        measured={
            model.name: {
                "expert_a_s": exp_a,
                "expert_b_s": exp_b,
                "attn_a_s": a0,
                "attn_b_s": a1,
                "attn_kv_s": a_kv,
                "attn_pair_s": a_pair,
            }
        },
    )


def write_profile(spec: HardwareSpec, path: str | os.PathLike[str]) -> Path:
    """Write ``spec`` as a ``conf/hardware/`` YAML, atomically."""
    import dataclasses

    import yaml

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"defaults": ["hardware_schema", "_self_"], **dataclasses.asdict(spec)}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".yaml")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(f"# {spec.source}\n")
            yaml.safe_dump(data, f, sort_keys=False)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b", help="model preset whose shapes to time")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--out", required=True, help="destination YAML (conf/hardware/measured/)")
    ap.add_argument("--name", default=None)
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    from fmoesim.config.build import load_preset

    model = load_preset("model", args.model, ModelSpec)
    spec = profile(model, args.device, repeats=args.repeats, name=args.name)
    print(f"wrote {write_profile(spec, args.out)}")


if __name__ == "__main__":
    main()
