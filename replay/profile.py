"""``fmoesim-profile``: measure a machine and write a hardware profile for the simulator.

Measures, on ``--device`` (``cuda`` on a GPU; ``cpu`` runs the same code so CI exercises
it, but its numbers describe the CPU, and the profile says so):

- host-to-device copies (pinned host memory, ``copy_(non_blocking=True)``) from 64 KiB
  to 256 MiB: a least-squares line ``time = overhead + size / bandwidth`` gives
  ``transfer_overhead_s`` and ``pcie_gbps``; every size's time is kept in
  ``measured["link"]``;
- for each ``--model``, the replay's own operators (:class:`replay.weights.Executor`),
  each timed as one call on an idle stream, as the replay issues them (the host's launch
  time counts where it dominates): the expert FFN against routed tokens
  (``expert_a_s + expert_b_s * tokens``) and a half-width segment of it, whose fixed cost
  tells the kernels' launches from the weights' read (``expert_launch_s``,
  :func:`launch_share`), the attention stand-in against new tokens and score pairs
  (``attn_a_s + attn_b_s * tokens + attn_pair_s * pairs``), the router, the LM head per
  sequence, and the shared experts and dense MLP where the model has them.

All of it runs ``--passes`` times (3), one pass after the other; each copy's time and
each coefficient is the median over the passes, so one slow stretch of a lent machine
sets none of them.

The fitted coefficients go into ``measured[<model name>]`` of a ``conf/hardware/`` YAML
(:class:`fmoesim.engine.compute.ComputeModel` uses them instead of the roofline), with the
device name and memory, the CUDA and torch versions and the date; ``--base PRESET`` keeps
that preset's unmeasured terms.  Written atomically.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.atomic import atomic_file, check_file_destination, is_plain_name
from fmoesim.errors import ArgumentParser, ConfigError, FmoesimError, names_of, run_or_exit
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


def measure_ops(points: Sequence[Any], op: Callable[..., Any], timer: Timer) -> list[float]:
    """Seconds of ``op(*point)`` (or ``op(point)``) per point, timed as the replay runs it:
    one call on an idle stream, so the host's launch time counts where it dominates."""
    out = []
    for pt in points:
        args: tuple[Any, ...] = pt if isinstance(pt, tuple) else (pt,)

        def call(args: tuple[Any, ...] = args) -> Any:
            return op(*args)

        out.append(timer(call))
    return out


def measure_link(torch: Any, device: str, sizes: Sequence[int], timer: Timer) -> dict[str, float]:
    """The link fit ``time = overhead + size / bandwidth`` over host-to-device copies of
    ``sizes`` bytes, and the seconds of each copy (``h2d_<size>_s``)."""
    return link_table(sizes, measure_h2d(torch, device, sizes, timer))


def link_table(sizes: Sequence[int], h2d: Sequence[float]) -> dict[str, float]:
    """The link fit ``time = overhead + size / bandwidth`` on copies of ``sizes`` bytes
    that took ``h2d`` seconds, and those seconds (``h2d_<size>_s``)."""
    overhead, per_byte = fit_linear(np.asarray(sizes), np.asarray(h2d))
    out = {"transfer_overhead_s": overhead, "per_byte_s": per_byte}
    out.update({f"h2d_{n}_s": t for n, t in zip(sizes, h2d, strict=True)})
    return out


#: token counts of the expert, router and shared-expert fits
TOKENS = (1, 2, 4, 8, 16, 32, 64, 128)
#: (new tokens, score pairs) of the attention fit: decode at several contexts, prefill
ATTENTION_POINTS = (
    (1, 129), (1, 513), (1, 2049), (4, 2052), (8, 1032), (16, 8208),
    (64, 2080), (128, 8256), (256, 32896),
)  # fmt: skip
#: link transfer sizes in bytes (64 KiB to 256 MiB)
LINK_SIZES = tuple(1 << k for k in range(16, 29, 2))


def median_keys(runs: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each key's median over ``runs`` (dicts with the same keys), in the first's order."""
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}


def median_link(links: Sequence[dict[str, float]], sizes: Sequence[int]) -> dict[str, float]:
    """:func:`measure_link`'s result from several passes: each copy's median seconds, and
    the link fitted on those."""
    return link_table(sizes, [float(np.median([lk[f"h2d_{n}_s"] for lk in links]))
                              for n in sizes])  # fmt: skip


def launch_share(whole_a_s: float, part_a_s: float, fraction: float = 0.5) -> float:
    """The part of an expert's fixed cost that a segment pays in full (``expert_launch_s``,
    :meth:`fmoesim.engine.compute.ComputeModel.segment_s`), from the fixed costs of the
    whole FFN and of a segment of ``fraction`` of its rows: ``whole = launch + read`` and
    ``part = launch + fraction * read`` give ``launch = (part - fraction * whole) / (1 -
    fraction)`` (at a half, twice the half's less the whole's), kept within ``[0,
    whole]`` (timing noise)."""
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"a segment's fraction of the rows must lie in (0, 1), got {fraction}")
    launch = (part_a_s - fraction * whole_a_s) / (1.0 - fraction)
    return min(max(launch, 0.0), whole_a_s)


def model_coefficients(
    torch: Any,
    device: str,
    model: ModelSpec,
    timer: Timer,
    dtype: Any,
    tokens: Sequence[int] = TOKENS,
    attention_points: Sequence[tuple[int, int]] = ATTENTION_POINTS,
    seed: int = 0,
) -> dict[str, float]:
    """Fitted ``ComputeModel`` coefficients of ``model`` on ``device``, timed on the
    replay's own operators (:class:`replay.weights.Executor`): the expert FFN on an
    ``(f, 3, h)`` weight (``f`` the mean of :func:`replay.weights.expert_rows`: the
    replay's rows for quantized or per-layer sizes), the attention and router stand-ins,
    the LM head, and the shared experts and dense MLP where the model has them."""
    from replay.weights import Executor, expert_rows

    exe = Executor(model, device, dtype, seed)
    rows = expert_rows(model)
    h, f = model.hidden_size, round(sum(rows) / len(rows))
    w = (torch.randn(f, 3, h, device=device) / h**0.5).to(dtype)
    toks = np.asarray(tokens, dtype=np.float64)
    out: dict[str, float] = {}
    exp = measure_ops(tokens, lambda t: exe.ffn(w, t), timer)
    out["expert_a_s"], out["expert_b_s"] = fit_linear(toks, np.asarray(exp))
    rows = f // 2  # a segment: half the intermediate rows (none of a one-row FFN)
    if rows:
        half = w[:rows]
        seg = measure_ops(tokens, lambda t: exe.ffn(half, t), timer)
        part_a_s = fit_linear(toks, np.asarray(seg))[0]
        out["expert_launch_s"] = launch_share(out["expert_a_s"], part_a_s, rows / f)
    att = measure_ops(attention_points, exe.attention, timer)
    # regressors as ComputeModel.attention_s takes them: new tokens and score pairs (the
    # stand-in reads a cache of pairs / tokens positions, so its KV term is in the pairs)
    X = np.array(attention_points, dtype=np.float64)
    out["attn_a_s"], out["attn_b_s"], out["attn_pair_s"] = fit_linear(X, np.asarray(att))
    out["attn_kv_s"] = 0.0
    rt = measure_ops(tokens, exe.router, timer)
    out["router_a_s"], out["router_b_s"] = fit_linear(toks, np.asarray(rt))
    seqs = (1, 2, 4, 8, 16)
    head = measure_ops(seqs, exe.lm_head, timer)
    out["lm_head_a_s"], out["lm_head_b_s"] = fit_linear(np.asarray(seqs, float), np.asarray(head))
    if exe.w_shared is not None:
        sh = measure_ops(tokens, exe.shared, timer)
        out["shared_a_s"], out["shared_b_s"] = fit_linear(toks, np.asarray(sh))
    if exe.w_dense is not None:
        dn = measure_ops(tokens, lambda t: exe.ffn(exe.w_dense, t), timer)
        out["dense_a_s"], out["dense_b_s"] = fit_linear(toks, np.asarray(dn))
    return out


def profile(
    models: ModelSpec | Sequence[ModelSpec],
    device: str = "cuda",
    *,
    repeats: int = 10,
    sizes_bytes: Sequence[int] = LINK_SIZES,
    tokens: Sequence[int] = TOKENS,
    attention_points: Sequence[tuple[int, int]] = ATTENTION_POINTS,
    name: str | None = None,
    base: HardwareSpec | None = None,
    passes: int = 3,
    log: Callable[[str], None] | None = None,
) -> HardwareSpec:
    """Measure the link and each model's operators and fit them; the result is
    ``base`` (or the defaults) with the measured link, the device's name and memory,
    ``measured[<model name>]`` holding each model's coefficients and
    ``measured["link"]`` the seconds of each timed copy (``h2d_<bytes>_s``).

    The whole measurement runs ``passes`` times, one pass after the other, and each
    copy's seconds and each coefficient is the median over the passes (the link fitted
    on the median copies): a lent machine's host and link can slow down for seconds at
    a time, as long as one pass (an H100 profiled at 84 us an expert and 55 GB/s, then
    at 177 us and 45 GB/s a minute later), and a median of three outlasts one slow pass.
    ``log`` gets one line per pass: its link and each model's expert fixed cost."""
    import dataclasses

    from replay.backend import check_device

    torch = check_device(device, "the profiler")
    models = [models] if isinstance(models, ModelSpec) else list(models)
    from replay.weights import torch_dtype

    if passes < 1:
        raise FmoesimError(f"--passes {passes}: must be >= 1")
    if any(m.name == "link" for m in models):
        raise FmoesimError("model name 'link': reserved for the link's table in measured")
    timer = Timer(torch, device, repeats)
    links: list[dict[str, float]] = []
    runs: dict[str, list[dict[str, float]]] = {m.name: [] for m in models}
    for i in range(passes):
        links.append(measure_link(torch, device, sizes_bytes, timer))
        for m in models:
            runs[m.name].append(model_coefficients(
                torch, device, m, timer, torch_dtype(torch, m, device), tokens,
                attention_points,
            ))  # fmt: skip
        if log is not None:
            per_byte = links[-1]["per_byte_s"]
            gbps = 1e-9 / per_byte if per_byte > 0 else math.inf
            experts = ", ".join(f"{n} expert {1e6 * r[-1]['expert_a_s']:.1f} us"
                                for n, r in runs.items())  # fmt: skip
            log(f"pass {i + 1}/{passes}: link {gbps:.1f} GB/s, "
                f"{1e6 * links[-1]['transfer_overhead_s']:.1f} us a copy; {experts}")  # fmt: skip
    link = median_link(links, sizes_bytes)
    measured: dict[str, Any] = {n: median_keys(r) for n, r in runs.items()}
    measured["link"] = {k: v for k, v in link.items() if k.startswith("h2d_")}
    cuda = device.startswith("cuda")
    gpu = torch.cuda.get_device_name(device) if cuda else "cpu"
    memory_gb = torch.cuda.get_device_properties(device).total_memory / 1e9 if cuda else 0.0
    driver = f"cuda {torch.version.cuda}" if cuda else ""
    today = dt.date.today().isoformat()
    spec = base if base is not None else HardwareSpec()
    per_byte = link["per_byte_s"]
    return dataclasses.replace(
        spec,
        name=name or f"measured-{gpu.lower().replace(' ', '-')}",
        gpu=gpu,
        num_gpus=1,
        gpu_memory_gb=memory_gb or spec.gpu_memory_gb,
        pcie_gbps=(1.0 / per_byte) / 1e9 if per_byte > 0 else 1e6,
        transfer_overhead_s=link["transfer_overhead_s"],
        source=(
            f"fmoesim-profile on {gpu} ({driver or 'no CUDA'}), torch {torch.__version__}, "
            f"{today}"
            + (f"; roofline terms not measured from {base.name}" if base else "")
            + ("; CPU numbers: meaningless for a GPU server" if gpu == "cpu" else "")
        ),
        measured=measured,
    )


def diagnostics(model: ModelSpec, device: str = "cuda", repeats: int = 20) -> dict[str, float]:
    """Host and contention costs the fitted profile does not hold, for explaining a gap
    between the simulator and the replay: the host's seconds to issue one expert FFN, a
    timing event and an event query; the round trip of draining an idle stream; the
    back-to-back (GPU-bound) seconds of one FFN; and a 256 MiB copy's and an FFN's
    seconds alone and while the other runs on another stream."""
    import torch

    from replay.weights import Executor, torch_dtype

    cuda = device.startswith("cuda")
    dtype = torch_dtype(torch, model, device)
    exe = Executor(model, device, dtype)
    h, f = model.hidden_size, model.expert_intermediate_size
    w = (torch.randn(f, 3, h, device=device) / h**0.5).to(dtype)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    out: dict[str, float] = {}
    n = 50 * repeats
    sync()
    t0 = time.perf_counter()
    for _ in range(n):
        exe.ffn(w, 1)
    out["host_issue_ffn_s"] = (time.perf_counter() - t0) / n
    sync()
    out["ffn_back_to_back_s"] = (time.perf_counter() - t0) / n
    if not cuda:
        return out
    t0 = time.perf_counter()
    evs = []
    for _ in range(n):
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        evs.append(ev)
    out["host_event_record_s"] = (time.perf_counter() - t0) / n
    sync()
    t0 = time.perf_counter()
    for ev in evs:
        ev.query()
    out["host_event_query_s"] = (time.perf_counter() - t0) / n
    t0 = time.perf_counter()
    for _ in range(repeats):
        ev = torch.cuda.Event()
        ev.record()
        while not ev.query():
            pass
    out["host_drain_idle_s"] = (time.perf_counter() - t0) / repeats
    size = 256 << 20
    src = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(size, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device=device)

    def timed(fn: Callable[[], Any], stream: Any) -> float:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            a.record()
            fn()
            b.record()
        b.synchronize()
        return float(a.elapsed_time(b)) / 1e3

    def ffns(k: int = 400) -> None:
        for _ in range(k):
            exe.ffn(w, 1)

    def copy() -> None:
        dst.copy_(src, non_blocking=True)

    main = torch.cuda.current_stream(device)
    copy_alone = float(np.median([timed(copy, side) for _ in range(5)]))
    ffn_alone = float(np.median([timed(ffns, main) for _ in range(5)])) / 400
    both_copy, both_ffn = [], []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        c, d = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            a.record()
            copy()
            b.record()
        c.record()
        ffns()
        d.record()
        sync()
        both_copy.append(float(a.elapsed_time(b)) / 1e3)
        both_ffn.append(float(c.elapsed_time(d)) / 1e3 / 400)
    out["copy_256MiB_alone_s"] = copy_alone
    out["copy_256MiB_under_ffn_s"] = float(np.median(both_copy))
    out["ffn_alone_s"] = ffn_alone
    out["ffn_under_copy_s"] = float(np.median(both_ffn))
    return out


def write_profile(spec: HardwareSpec, path: str | os.PathLike[str]) -> Path:
    """Write ``spec`` as a ``conf/hardware/`` YAML, atomically."""
    import dataclasses

    import yaml

    path = Path(path)
    data = {"defaults": ["hardware_schema", "_self_"], **dataclasses.asdict(spec)}
    with atomic_file(path) as tmp, open(tmp, "w") as f:
        f.write(f"# {spec.source}\n")
        yaml.safe_dump(data, f, sort_keys=False)
    return path


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="mixtral-8x7b", help="model presets whose shapes "
                    "to time, comma-separated (%(default)s)")  # fmt: skip
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (%(default)s)")
    ap.add_argument("--repeats", type=int, default=10, help="timings per point (%(default)s)")
    ap.add_argument("--passes", type=int, default=3, help="whole measurements, one after "
                    "the other; each number is the median over them")  # fmt: skip
    ap.add_argument("--out", required=True, help="destination YAML (conf/hardware/measured/)")
    ap.add_argument("--name", default=None, help="the profile's name in results (default: "
                    "--out's file name without .yaml, the name hardware=measured/<name> "
                    "selects)")  # fmt: skip
    ap.add_argument("--diagnostics", default=None, help="also write the host and "
                    "contention costs (diagnostics()) of each model to this CSV")  # fmt: skip
    ap.add_argument("--base", default=None, help="hardware preset whose unmeasured "
                    "terms (peak FLOP/s, HBM bandwidth, chunk size) the profile keeps")  # fmt: skip
    ap.add_argument("--force", action="store_true", help="replace an existing --out or "
                    "--diagnostics")  # fmt: skip
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _run(args: argparse.Namespace) -> None:
    from fmoesim.config.build import load_preset

    if args.repeats < 1:
        raise FmoesimError(f"--repeats {args.repeats}: must be >= 1")
    names = names_of("--model", args.model, empty_ok=True)
    if not names:
        raise FmoesimError("--model: give at least one model preset")
    try:
        models = [load_preset("model", n, ModelSpec) for n in names]
    except ConfigError as exc:  # the flag the user gave, not a config key
        raise FmoesimError(f"--model {exc.value}: {exc.rule}") from None
    base = load_preset("hardware", args.base, HardwareSpec) if args.base else None
    for flag, dest in (("--out", args.out), ("--diagnostics", args.diagnostics)):
        if dest is not None:
            check_file_destination(flag, Path(dest), args.force)
    name = args.name or Path(args.out).stem
    if not is_plain_name(name):  # it names the preset: hardware=measured/<name>
        flag = "--name" if args.name else f"--out {args.out}: its file name gives"
        raise FmoesimError(
            f"{flag} {name}: not a preset's name (rule: no '/', '\\' or '..', not empty, "
            "not starting with '.')"
        )
    spec = profile(models, args.device, repeats=args.repeats, name=name, base=base,
                   passes=args.passes, log=print)  # fmt: skip
    rows = []
    if args.diagnostics:  # measured before anything is written: both files or neither
        rows = [{"model": m.name, **diagnostics(m, args.device, args.repeats)} for m in models]
    print(f"wrote {write_profile(spec, args.out)}")
    if args.diagnostics:
        import pandas as pd

        from fmoesim.atomic import atomic_file

        with atomic_file(args.diagnostics) as tmp:
            pd.DataFrame(rows).to_csv(tmp, index=False)
        print(f"wrote {args.diagnostics}")


if __name__ == "__main__":
    main()
