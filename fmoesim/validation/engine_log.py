"""The simulator's cache against a real engine's logged cache outcomes.

A route log that records, per routed expert, whether the engine found it in its cache
(a ``residency`` column: 1 hit, 0 read from storage) and which phase each step belongs
to is imported with :func:`fmoesim.trace.table.import_table` (the prompt one prefill
iteration, run layer by layer over all its tokens, as a batched prefill is; each decode
step one iteration), served by the simulator with the same policy, budget and per-layer
expert sizes in hit-rate-only mode with an access log, and compared.  Decode accesses
are matched one to one, ``(step, layer, expert)`` of the log against ``(iteration, layer,
expert)`` of the simulation: the logged and simulated hit rates and the share of accesses
where both say the same.  Prefill is reported, not matched: the simulator accesses each
distinct expert of a layer once per prefill iteration, where the log has a row per token
(and an engine may log every prefill access as a miss, whatever its cache held).

The same log's timing: an engine that also writes one row per generated token with its
flash reads and the time its expert kernel blocked on them (``--metrics FILE``, with
columns ``step, io_ms, compute_ms, read_bytes, stall_ms, mgmt_ms``: BigMoeOnEdge's
``qwen.metrics``) is compared token by token.  :func:`calibrate_storage` derives a
``hardware`` preset from that file alone (the storage's read bandwidth and the
per-operator compute; ``conf/hardware/oneplus-15r-flash.yaml`` holds the one for the
BigMoeOnEdge log), :func:`compare_timing` runs the log on it with timing and sets the
simulated per-token stall beside the logged ``stall_ms``.  The stall is never an input.

Run ``python -m fmoesim.validation.engine_log LOG.csv [--metrics FILE]`` (the defaults
are those of the BigMoeOnEdge log: ``--model qwen3-30b-a3b --top-k 6 --budget-mib 4000
--policy lru --hardware oneplus-15r-flash``); ``--calibrate`` prints the preset's numbers
as derived from ``--metrics``; ``--pcie-gbps``, ``--link-lanes`` and ``--transfer-slices``
change the timing's link (what-ifs beside the preset's).
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fmoesim.config.build import policy_from_preset
from fmoesim.engine.compute import ComputeModel
from fmoesim.engine.sim import SimBackend
from fmoesim.errors import ArgumentParser, FmoesimError, run_or_exit
from fmoesim.specs.hardware import HardwareSpec

PROG = "python -m fmoesim.validation.engine_log"
PHASES = {0: "prefill", 1: "decode"}


@dataclass
class PhaseResult:
    """One phase's comparison."""

    phase: str
    logged_accesses: int
    logged_hit_rate: float
    simulated_accesses: int
    simulated_hit_rate: float
    agreement: float | None  # share of matched accesses with the same outcome (decode)


def compare(
    log: str | Path,
    model_name: str = "qwen3-30b-a3b",
    top_k: int | None = 6,
    budget_bytes: int = 4000 * 2**20,
    policy: str = "lru",
) -> list[PhaseResult]:
    """Import ``log``, simulate it with ``policy`` at ``budget_bytes`` and compare
    (module docstring)."""
    import pandas as pd

    from fmoesim.config.build import load_preset
    from fmoesim.engine.simulate import model_for_trace, simulate
    from fmoesim.specs import HardwareSpec, ModelSpec
    from fmoesim.trace import read_trace
    from fmoesim.trace.table import import_table
    from policies.base import Outcome

    path = Path(log)
    model = load_preset("model", model_name, ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)  # no time is reported
    with tempfile.TemporaryDirectory() as tmp:
        tpath, _ = import_table(path, Path(tmp) / "t", model, top_k=top_k)
        trace = read_trace(tpath)
        run_model = model_for_trace(dataclasses.replace(model, top_k=trace.top_k), trace)
        pol = policy_from_preset(policy)
        res = simulate(trace, run_model, hw, pol, budget_bytes, timing=False, access_log=True)
    acc = res.accesses
    assert acc is not None
    sim = pd.DataFrame(
        {
            "step": np.asarray(acc["iteration"], dtype=np.int64),
            "layer": np.asarray(acc["layer"], dtype=np.int64),
            "expert": np.asarray(acc["expert"], dtype=np.int64),
            "sim_hit": np.asarray(acc["outcome"]) == int(Outcome.HIT),
        }
    )
    raw = pd.read_csv(path, comment="#")
    for col in ("phase", "step", "layer", "expert", "residency"):
        if col not in raw.columns:
            raise FmoesimError(f"{path}: has a '{col}' column (rule: a cache log to compare)")
    decode_steps = sorted(raw.loc[raw["phase"] == 1, "step"].unique())
    iteration = {s: i + 1 for i, s in enumerate(decode_steps)}  # the prompt is iteration 0
    logged = pd.DataFrame(
        {
            "step": raw["step"].map(iteration).fillna(0).astype(np.int64),
            "layer": raw["layer"].astype(np.int64),
            "expert": raw["expert"].astype(np.int64),
            "phase": raw["phase"].astype(np.int64),
            "log_hit": raw["residency"].astype(np.int64) == 1,
        }
    )
    out = []
    pre_log, pre_sim = logged[logged["phase"] == 0], sim[sim["step"] == 0]
    if len(pre_log):
        out.append(
            PhaseResult(
                "prefill", len(pre_log), float(pre_log["log_hit"].mean()),
                len(pre_sim), float(pre_sim["sim_hit"].mean()), None,
            )
        )  # fmt: skip
    dec = logged[logged["phase"] == 1]
    both = dec.merge(sim, on=["step", "layer", "expert"], how="left", validate="one_to_one")
    if both["sim_hit"].isna().any():
        row = int(np.flatnonzero(both["sim_hit"].isna().to_numpy())[0])
        raise FmoesimError(f"{path}: decode access {row} has no simulated access to match")
    hit = both["sim_hit"].astype(bool)
    out.append(
        PhaseResult(
            "decode", len(both), float(both["log_hit"].mean()),
            int((sim["step"] > 0).sum()), float(sim.loc[sim["step"] > 0, "sim_hit"].mean()),
            float((both["log_hit"] == hit).mean()),
        )
    )  # fmt: skip
    return out


#: columns a per-token metrics file must have (BigMoeOnEdge's ``qwen.metrics``)
METRIC_COLUMNS = ("step", "io_ms", "compute_ms", "read_bytes", "stall_ms", "mgmt_ms")
#: bytes per weight of a GGUF Q6_K tensor: 256 weights in a 210-byte block (llama.cpp's
#: ``block_q6_K``); llama.cpp's Q4_K_M recipe stores ``output.weight`` (the LM head) as Q6_K
Q6_K_BYTES_PER_WEIGHT = 210 / 256


@dataclass(frozen=True)
class StorageCalibration:
    """A device's storage and compute, derived from a route log's per-layer byte headers
    and the engine's per-token metrics (decode tokens only).

    - ``lane_bytes_per_s``: total ``read_bytes`` over total ``io_ms``.  With reads spread
      over ``lanes`` parallel reader threads, ``io_ms`` sums the lanes' busy times, so the
      storage delivers ``lanes`` times that while every lane reads (``pcie_gbps``), with
      no fixed cost per read.  The simulator's link has the engine's ``lanes``, each at
      ``lane_bytes_per_s``, and cuts each expert into the engine's ``slices`` read jobs
      (:class:`fmoesim.engine.sim.LaneLink`).
    - ``compute_s``: the median per-token ``compute_ms`` (the mean is pulled up by tokens
      whose dense weights were paged back in from flash, ``majflt``).  It is split over the
      operators in proportion to the weight bytes each reads (a CPU decode step is bound by
      memory traffic): per layer the dense bytes (attention, norms, router) and
      ``top_k`` experts' bytes, plus the LM head (``vocab x hidden`` at
      ``head_bytes_per_weight``).  That gives ``attn_a_s``, ``expert_a_s`` and
      ``lm_head_a_s``; the per-token and per-context terms are 0 (decode only, one token
      per step, at most a few hundred tokens of context).
    """

    lanes: int
    slices: int
    lane_bytes_per_s: float
    compute_s: float
    dense_bytes_per_layer: float  # mean over layers
    expert_bytes_per_layer: float  # mean over layers
    lm_head_bytes: int
    top_k: int
    num_layers: int
    tokens: int

    @property
    def pcie_gbps(self) -> float:
        """The storage's aggregate read bandwidth, GB/s."""
        return self.lanes * self.lane_bytes_per_s / 1e9

    @property
    def weight_bytes_per_token(self) -> float:
        """Weight bytes a decode step reads."""
        per_layer = self.dense_bytes_per_layer + self.top_k * self.expert_bytes_per_layer
        return self.num_layers * per_layer + self.lm_head_bytes

    def measured(self) -> dict[str, float]:
        """``hardware.measured[<model>]`` coefficients (seconds)."""
        s_per_byte = self.compute_s / self.weight_bytes_per_token
        out = dict.fromkeys(
            ("expert_b_s", "attn_b_s", "attn_kv_s", "attn_pair_s", "router_a_s",
             "router_b_s", "lm_head_b_s"),
            0.0,
        )  # fmt: skip
        out["expert_a_s"] = s_per_byte * self.expert_bytes_per_layer
        out["attn_a_s"] = s_per_byte * self.dense_bytes_per_layer
        out["lm_head_a_s"] = s_per_byte * self.lm_head_bytes
        return out

    def hardware(self, model_name: str, name: str = "calibrated") -> HardwareSpec:
        """A :class:`HardwareSpec` with these numbers (what ``--calibrate`` prints)."""
        return HardwareSpec(
            name=name,
            gpu="calibrated from an engine's metrics",
            pcie_gbps=self.pcie_gbps,
            link_lanes=self.lanes,
            transfer_slices=self.slices,
            transfer_overhead_s=0.0,
            kernel_overhead_s=0.0,
            measured={model_name: self.measured()},
        )


def read_metrics(path: str | Path) -> Any:
    """The per-token metrics file as a DataFrame (``#`` lines skipped); one line naming
    the file, row and rule on a bad one."""
    import pandas as pd

    path = Path(path)
    try:
        df = pd.read_csv(path, comment="#")
    except (OSError, ValueError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise FmoesimError(f"{path}: cannot be read as CSV ({first})") from None
    for col in METRIC_COLUMNS:
        if col not in df.columns:
            raise FmoesimError(f"{path}: has a '{col}' column (rule: per-token engine metrics)")
    for col in METRIC_COLUMNS:
        values = pd.to_numeric(df[col], errors="coerce")
        bad = np.flatnonzero(~(values >= 0).to_numpy())
        if len(bad):
            raise FmoesimError(
                f"{path}: row {int(bad[0]) + 1}: '{col}' is {df[col].iloc[bad[0]]!r} "
                "(rule: a number >= 0)"
            )
        df[col] = values
    steps = df["step"].to_numpy()
    if len(steps) and not (np.diff(steps) > 0).all():
        row = int(np.flatnonzero(np.diff(steps) <= 0)[0]) + 2
        raise FmoesimError(f"{path}: row {row}: 'step' (rule: increases row by row)")
    return df


def _layer_headers(path: Path) -> tuple[dict[int, int], dict[int, int]]:
    """Layer -> expert bytes and layer -> dense bytes from ``# layer=N expert_bytes=B
    dense_bytes=D`` header lines."""
    import re

    experts: dict[int, int] = {}
    dense: dict[int, int] = {}
    pat = {k: re.compile(rf"\b{k}=(\d+)\b") for k in ("layer", "expert_bytes", "dense_bytes")}
    with path.open() as f:
        for line in f:
            if not line.startswith("#"):
                break
            m = {k: p.search(line) for k, p in pat.items()}
            if m["layer"] is None:
                continue
            layer = int(m["layer"].group(1))
            if m["expert_bytes"] is not None:
                experts[layer] = int(m["expert_bytes"].group(1))
            if m["dense_bytes"] is not None:
                dense[layer] = int(m["dense_bytes"].group(1))
    return experts, dense


def calibrate_storage(
    log: str | Path,
    metrics: str | Path,
    model_name: str = "qwen3-30b-a3b",
    top_k: int = 6,
    lanes: int = 4,
    slices: int = 3,
    head_bytes_per_weight: float = Q6_K_BYTES_PER_WEIGHT,
) -> StorageCalibration:
    """Derive the storage and compute of the device behind ``log`` and ``metrics`` (see
    :class:`StorageCalibration`).  ``lanes`` is the engine's number of reader threads
    (BigMoeOnEdge's ``--io-threads``), ``slices`` the read jobs it cuts an expert into
    (BigMoeOnEdge reads one job per projection: gate, up and down)."""
    from fmoesim.config.build import load_preset
    from fmoesim.specs import ModelSpec

    path = Path(log)
    model = load_preset("model", model_name, ModelSpec)
    experts, dense = _layer_headers(path)
    layers = range(model.num_layers)
    for name, table in (("expert_bytes", experts), ("dense_bytes", dense)):
        missing = [layer for layer in layers if layer not in table]
        if missing:
            raise FmoesimError(
                f"{path}: has no '# layer={missing[0]} {name}=B' header "
                "(rule: every layer's bytes, to split the compute)"
            )
    for flag, n in (("--lanes", lanes), ("--slices", slices)):
        if n < 1:
            raise FmoesimError(f"{flag}: {n} (rule: an integer >= 1)")
    df = read_metrics(metrics)
    io_s = float(df["io_ms"].sum()) / 1e3
    if not io_s > 0 or len(df) == 0:
        raise FmoesimError(f"{metrics}: no row with io_ms > 0 (rule: reads to time)")
    return StorageCalibration(
        lanes=lanes,
        slices=slices,
        lane_bytes_per_s=float(df["read_bytes"].sum()) / io_s,
        compute_s=float(df["compute_ms"].median()) / 1e3,
        dense_bytes_per_layer=float(np.mean([dense[layer] for layer in layers])),
        expert_bytes_per_layer=float(np.mean([experts[layer] for layer in layers])),
        lm_head_bytes=round(model.vocab_size * model.hidden_size * head_bytes_per_weight),
        top_k=top_k,
        num_layers=model.num_layers,
        tokens=len(df),
    )


@dataclass
class TimingResult:
    """Per decode token, the engine's logged timing beside the simulator's
    (``tokens``: a DataFrame with ``step``, ``logged_stall_ms``, ``sim_stall_ms``,
    ``logged_read_bytes``, ``sim_read_bytes``, ``logged_compute_ms``,
    ``sim_compute_ms``, ``logged_mgmt_ms``)."""

    tokens: Any
    hardware: str

    def summary(self) -> dict[str, float]:
        """Totals, means, the per-token correlation and mean absolute error of the stall."""
        t = self.tokens
        log, sim = t["logged_stall_ms"].to_numpy(), t["sim_stall_ms"].to_numpy()
        return {
            "tokens": float(len(t)),
            "logged_stall_ms_mean": float(log.mean()),
            "sim_stall_ms_mean": float(sim.mean()),
            "stall_ratio": float(sim.sum() / log.sum()),
            "stall_corr": float(np.corrcoef(log, sim)[0, 1]),
            "stall_mae_ms": float(np.abs(sim - log).mean()),
            "logged_read_mib": float(t["logged_read_bytes"].sum() / 2**20),
            "sim_read_mib": float(t["sim_read_bytes"].sum() / 2**20),
            "logged_compute_ms_median": float(t["logged_compute_ms"].median()),
            "sim_compute_ms_median": float(t["sim_compute_ms"].median()),
        }


def compare_timing(
    log: str | Path,
    metrics: str | Path,
    hardware: str | HardwareSpec = "oneplus-15r-flash",
    model_name: str = "qwen3-30b-a3b",
    top_k: int | None = 6,
    budget_bytes: int = 4000 * 2**20,
    policy: str = "lru",
) -> TimingResult:
    """Run ``log`` with timing on the ``hardware`` preset and set each decode token's
    simulated stall (the time its experts waited on reads) beside the logged
    ``stall_ms`` of ``metrics`` (one row per decode step, in order).  ``hardware`` is a
    preset's name or a :class:`HardwareSpec`."""
    import pandas as pd

    from fmoesim.config.build import load_preset
    from fmoesim.engine.simulate import model_for_trace, simulate
    from fmoesim.specs import ModelSpec
    from fmoesim.trace import read_trace
    from fmoesim.trace.table import import_table

    path = Path(log)
    model = load_preset("model", model_name, ModelSpec)
    if isinstance(hardware, str):
        hw = load_preset("hardware", hardware, HardwareSpec)
    else:
        hw = hardware
    df = read_metrics(metrics)
    with tempfile.TemporaryDirectory() as tmp:
        tpath, _ = import_table(path, Path(tmp) / "t", model, top_k=top_k)
        trace = read_trace(tpath)
    run_model = model_for_trace(dataclasses.replace(model, top_k=trace.top_k), trace)
    decode = trace.num_iterations - 1  # iteration 0 is the batched prompt
    if len(df) != decode:
        raise FmoesimError(
            f"{metrics}: {len(df)} rows for {decode} decode steps of {path} "
            "(rule: one row per decode step)"
        )
    recorded: list[_TokenRecorder] = []

    def make(caches: list[Any]) -> _TokenRecorder:
        recorded.append(_TokenRecorder(hw, ComputeModel.from_specs(run_model, hw), caches))
        return recorded[0]

    simulate(
        trace, run_model, hw, policy_from_preset(policy), budget_bytes, timing=True, fast=False,
        make_backend=make,
    )  # fmt: skip
    be = recorded[0]
    tokens = pd.DataFrame(
        {
            "step": df["step"].to_numpy(dtype=np.int64),
            "logged_stall_ms": df["stall_ms"].to_numpy(dtype=float),
            "sim_stall_ms": 1e3 * np.asarray(be.stall_s[1:]),
            "logged_read_bytes": df["read_bytes"].to_numpy(dtype=np.int64),
            "sim_read_bytes": np.asarray(be.read_bytes[1:], dtype=np.int64),
            "logged_compute_ms": df["compute_ms"].to_numpy(dtype=float),
            "sim_compute_ms": 1e3 * np.asarray(be.compute_s[1:]),
            "logged_mgmt_ms": df["mgmt_ms"].to_numpy(dtype=float),
        }
    )
    return TimingResult(tokens, hw.name)


class _TokenRecorder(SimBackend):
    """:class:`SimBackend` that keeps, per iteration (closed by its LM head), the stall,
    the bytes submitted to the link and the compute seconds."""

    def __init__(self, hw: Any, compute: ComputeModel, caches: Any) -> None:
        super().__init__(hw, compute, caches)
        # set on the instance (no class attribute here): in the compiled build the Runner
        # reads the compiled base's attribute, which a class attribute of this interpreted
        # subclass would shadow for Python only
        self.closed_form_demand = False
        self.stall_s: list[float] = []
        self.read_bytes: list[int] = []
        self.compute_s: list[float] = []
        self._stall = 0.0
        self._n_transfers = 0
        self._busy = 0.0

    def end_experts(self) -> float:
        wait = super().end_experts()
        self._stall += wait
        return wait

    def lm_head(self, sequences: int) -> None:
        super().lm_head(sequences)
        self.stall_s.append(self._stall)
        new = self.transfers[self._n_transfers :]
        self.read_bytes.append(sum(r.moved_bytes for r in new))
        self.compute_s.append(self.busy_compute_s - self._busy)
        self._stall, self._n_transfers, self._busy = 0.0, len(self.transfers), self.busy_compute_s


def format_report(results: list[PhaseResult]) -> str:
    """A Markdown table of the comparison."""
    lines = [
        "| phase | engine: accesses | engine: hit rate | simulator: accesses "
        "| simulator: hit rate | same outcome |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        same = "n.a." if r.agreement is None else f"{100 * r.agreement:.2f}%"
        lines.append(
            f"| {r.phase} | {r.logged_accesses:,} | {100 * r.logged_hit_rate:.2f}% "
            f"| {r.simulated_accesses:,} | {100 * r.simulated_hit_rate:.2f}% | {same} |"
        )
    return "\n".join(lines)


def format_timing(result: TimingResult) -> str:
    """A Markdown table of the timing comparison's summary."""
    s = result.summary()
    return "\n".join(
        [
            f"| decode, {int(s['tokens'])} tokens, on {result.hardware} | engine | simulator |",
            "|---|---|---|",
            f"| stall per token, mean | {s['logged_stall_ms_mean']:.1f} ms "
            f"| {s['sim_stall_ms_mean']:.1f} ms |",
            f"| stall, simulator / engine | | {s['stall_ratio']:.2f} |",
            f"| stall, per-token correlation | | {s['stall_corr']:.3f} |",
            f"| stall, mean absolute error | | {s['stall_mae_ms']:.1f} ms |",
            f"| expert reads | {s['logged_read_mib']:,.0f} MiB | {s['sim_read_mib']:,.0f} MiB |",
            f"| compute per token, median | {s['logged_compute_ms_median']:.1f} ms "
            f"| {s['sim_compute_ms_median']:.1f} ms |",
        ]
    )


def format_calibration(cal: StorageCalibration, model_name: str) -> str:
    """The ``hardware`` preset's numbers as YAML lines (see :class:`StorageCalibration`)."""
    lines = [
        f"pcie_gbps: {cal.pcie_gbps!r}  # {cal.lanes} lanes x {cal.lane_bytes_per_s:,.0f} B/s",
        f"link_lanes: {cal.lanes}",
        f"transfer_slices: {cal.slices}",
        "transfer_overhead_s: 0.0",
        "measured:",
        f"  {model_name}:",
    ]
    lines += [f"    {k}: {v!r}" for k, v in cal.measured().items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Command line: print the comparison tables (or, with ``--calibrate``, the numbers of
    a ``hardware`` preset derived from ``--metrics``)."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("log", help="route log with phase, step, layer, expert and residency")
    ap.add_argument("--model", default="qwen3-30b-a3b", help="model preset (%(default)s)")
    ap.add_argument("--top-k", type=int, default=6, help="experts per token logged (%(default)s)")
    ap.add_argument(
        "--budget-mib", type=float, default=4000.0, help="the expert cache (%(default)g MiB)"
    )
    ap.add_argument("--policy", default="lru", help="policy preset (%(default)s)")
    ap.add_argument("--metrics", help="the engine's per-token metrics (compares the timing)")
    ap.add_argument(
        "--hardware", default="oneplus-15r-flash", help="preset for the timing (%(default)s)"
    )
    ap.add_argument(
        "--pcie-gbps",
        type=float,
        default=None,
        help="the timing's link rate in GB/s instead of the preset's (what-if: one reader "
        "of the phone's four is 0.789)",
    )
    ap.add_argument(
        "--link-lanes",
        type=int,
        default=None,
        help="the timing's link lanes instead of the preset's (what-if: 1, with "
        "--transfer-slices 1, is one server at the whole rate)",
    )
    ap.add_argument(
        "--transfer-slices",
        type=int,
        default=None,
        help="the timing's read jobs per expert instead of the preset's",
    )
    ap.add_argument(
        "--lanes", type=int, default=None, help="--calibrate: the engine's reader threads (4)"
    )
    ap.add_argument(
        "--slices",
        type=int,
        default=None,
        help="--calibrate: the engine's read jobs per expert (3: one per projection)",
    )
    ap.add_argument(
        "--calibrate", action="store_true", help="print the preset derived from --metrics"
    )
    args = ap.parse_args(argv)

    def run() -> None:
        for flag, n in (("--lanes", args.lanes), ("--slices", args.slices)):
            if n is not None and not args.calibrate:
                raise FmoesimError(
                    f"{flag} {n}: only with --calibrate (rule: the timing reads its link "
                    "from --hardware; --pcie-gbps, --link-lanes and --transfer-slices "
                    "change it)"
                )
        link = (
            ("--pcie-gbps", args.pcie_gbps),
            ("--link-lanes", args.link_lanes),
            ("--transfer-slices", args.transfer_slices),
        )
        for flag, v in link:
            if v is not None and (args.metrics is None or args.calibrate):
                raise FmoesimError(
                    f"{flag} {v:g}: only with --metrics, without --calibrate "
                    "(rule: it changes the timing comparison's link)"
                )
        if args.pcie_gbps is not None and not 0 < args.pcie_gbps < math.inf:
            raise FmoesimError(f"--pcie-gbps {args.pcie_gbps:g}: must be a number > 0")
        for flag, n in (*link[1:], ("--lanes", args.lanes), ("--slices", args.slices)):
            if n is not None and n < 1:
                raise FmoesimError(f"{flag} {n}: must be an integer >= 1")
        if not args.budget_mib > 0:
            raise FmoesimError(f"--budget-mib {args.budget_mib:g}: must be a number > 0")
        for flag, f in (("LOG", args.log), ("--metrics", args.metrics)):
            if f is not None and not Path(f).is_file():
                what = "a folder" if Path(f).is_dir() else "no such file"
                raise FmoesimError(f"{flag} {f}: {what} (rule: one CSV file)")
        if args.calibrate:
            if args.metrics is None:
                raise FmoesimError("--calibrate: needs --metrics (rule: the numbers come from it)")
            lanes = 4 if args.lanes is None else args.lanes
            slices = 3 if args.slices is None else args.slices
            cal = calibrate_storage(args.log, args.metrics, args.model, args.top_k, lanes, slices)
            print(format_calibration(cal, args.model))
            return
        budget = int(args.budget_mib * 2**20)
        timing = None
        if args.metrics is not None:  # first, so a bad file prints nothing but its error
            hw: str | HardwareSpec = args.hardware
            changes = {
                field: v
                for field, (_, v) in zip(
                    ("pcie_gbps", "link_lanes", "transfer_slices"), link, strict=True
                )
                if v is not None
            }
            if changes:
                from fmoesim.config.build import load_preset

                hw = load_preset("hardware", args.hardware, HardwareSpec)
                hw = dataclasses.replace(hw, **changes)
            timing = compare_timing(
                args.log, args.metrics, hw, args.model, args.top_k, budget, args.policy
            )
        res = compare(args.log, args.model, args.top_k, budget, args.policy)
        print(format_report(res))
        if timing is not None:
            print()
            print(format_timing(timing))

    run_or_exit(PROG, run)


if __name__ == "__main__":
    main()
