"""A hardware profile: the PCIe link and the GPU's compute and memory speed."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fmoesim.errors import ConfigError

#: the coefficients a model's table of ``measured`` may hold: the compute model's
#: (``fmoesim.engine.compute.ComputeModel``'s fields), the host's costs
#: (``fmoesim.engine.host``) and the references ``fmoesim-validate-grid host-fit``
#: scales them by; any other key is a typo that would run on the roofline's value
MEASURED_MODEL_KEYS = frozenset(
    {
        *(
            f"{op}_{c}_s"
            for op in ("expert", "shared", "attn", "router", "residual", "dense", "lm_head")
            for c in ("a", "b")
        ),  # fmt: skip
        "attn_kv_s",
        "attn_pair_s",
        "expert_launch_s",
        "host_layer_s",
        "host_access_s",
        "host_transfer_s",
        "host_submit_s",
        "host_link_depth",
        "host_decision_s",  # a mapping: policy name -> seconds
        "host_probe_s",
        "host_probe_exponent",
        "host_launch_s",
    }
)
#: ``measured["link"]``: one host-to-device copy's time by its size (``h2d_<bytes>_s``)
MEASURED_LINK_KEY = re.compile(r"h2d_[1-9][0-9]*_s")


@dataclass
class HardwareSpec:
    """One serving GPU (or ``num_gpus`` identical ones) and its host link.

    Units: ``pcie_gbps`` and ``hbm_gbps`` in GB/s (1e9 bytes/s), ``peak_tflops`` in
    dense bf16/fp16 tensor TFLOP/s, times in seconds.  ``pcie_gbps`` is the link's whole
    rate: with ``link_lanes`` n > 1 it is shared by n lanes that move transfers in
    parallel at ``pcie_gbps / n`` each (an engine's reader threads), and
    ``transfer_slices`` s > 1 cuts each transfer into s jobs, one lane each (an engine
    that reads an expert projection by projection); see
    :class:`fmoesim.engine.sim.LaneLink`.  A preset's numbers come from
    published figures (each YAML cites its source); a measured profile written by
    ``fmoesim-profile`` may add fitted coefficients in ``measured``.
    """

    name: str = "unnamed"
    gpu: str = "unknown"
    num_gpus: int = 1
    gpu_memory_gb: float = 24.0
    pcie_gbps: float = 32.0
    transfer_overhead_s: float = 1.0e-5
    chunk_bytes: int = 16 * 2**20
    link_lanes: int = 1
    transfer_slices: int = 1
    peak_tflops: float = 71.0
    hbm_gbps: float = 936.0
    compute_efficiency: float = 0.6
    memory_efficiency: float = 0.8
    kernel_overhead_s: float = 5.0e-6
    source: str = ""
    measured: dict[str, Any] = field(default_factory=dict)

    @property
    def pcie_bytes_per_s(self) -> float:
        """Host-to-device bandwidth in bytes/s."""
        return self.pcie_gbps * 1e9

    def transfer_time_s(self, size_bytes: int) -> float:
        """Time of one transfer of ``size_bytes`` on an idle link: fixed cost +
        size/bandwidth; with lanes or slices, its slices' rounds over the lanes, each
        round a slice's fixed cost and its bytes at one lane's rate (equal slices)."""
        lanes, slices = self.link_lanes, self.transfer_slices
        if lanes == 1 and slices == 1:
            return self.transfer_overhead_s + size_bytes / self.pcie_bytes_per_s
        rounds = -(-slices // lanes)
        lane_bytes_per_s = self.pcie_bytes_per_s / lanes
        return rounds * (self.transfer_overhead_s + size_bytes / slices / lane_bytes_per_s)

    def validate(self, prefix: str = "hardware") -> HardwareSpec:
        """Check every field; raise :class:`ConfigError` naming the first bad one."""
        for key in ("pcie_gbps", "peak_tflops", "hbm_gbps", "gpu_memory_gb"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"{prefix}.{key}", value, "must be a positive number")
        for key in ("compute_efficiency", "memory_efficiency"):
            value = getattr(self, key)
            if not 0 < value <= 1:
                raise ConfigError(f"{prefix}.{key}", value, "must be in (0, 1]")
        for key in ("transfer_overhead_s", "kernel_overhead_s"):
            value = getattr(self, key)
            if not value >= 0:
                raise ConfigError(f"{prefix}.{key}", value, "must be >= 0")
        if not isinstance(self.num_gpus, int) or self.num_gpus < 1:
            raise ConfigError(f"{prefix}.num_gpus", self.num_gpus, "must be an integer >= 1")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes <= 0:
            raise ConfigError(
                f"{prefix}.chunk_bytes", self.chunk_bytes, "must be a positive integer"
            )
        for key in ("link_lanes", "transfer_slices"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{prefix}.{key}", value, "must be an integer >= 1")
        if not isinstance(self.measured, Mapping):
            raise ConfigError(f"{prefix}.measured", self.measured, "must be a mapping")
        lanes = self.link_lanes > 1 or self.transfer_slices > 1
        for name, table in self.measured.items():  # a model's, the link's: name -> number
            if not isinstance(table, Mapping):
                raise ConfigError(
                    f"{prefix}.measured.{name}", table, "must be a mapping of coefficients"
                )
            _check_measured(table, f"{prefix}.measured.{name}")
            for k in table:
                known = (
                    MEASURED_LINK_KEY.fullmatch(str(k))
                    if name == "link"
                    else k in MEASURED_MODEL_KEYS
                )
                if not known:
                    what = (
                        "a link table's keys are h2d_<bytes>_s"
                        if name == "link"
                        else (
                            "not a coefficient the simulator reads (a typo? "
                            "fmoesim.specs.hardware.MEASURED_MODEL_KEYS lists them)"
                        )
                    )
                    raise ConfigError(f"{prefix}.measured.{name}.{k}", table[k], what)
            if name != "link" and lanes and table.get("host_link_depth", 0):
                raise ConfigError(
                    f"{prefix}.measured.{name}.host_link_depth",
                    table["host_link_depth"],
                    "a host-issued link has one lane and whole transfers "
                    "(rule: link_lanes and transfer_slices 1 with it)",
                )
            if name != "link" and not isinstance(table.get("host_decision_s", {}), Mapping):
                raise ConfigError(
                    f"{prefix}.measured.{name}.host_decision_s",
                    table["host_decision_s"],
                    "must be a mapping: policy name -> seconds",
                )
        return self


def _check_measured(node: Any, key: str, is_time: bool = False) -> None:
    """``measured``: mappings down to finite numbers, each time >= 0. A time is a value
    whose key ends in ``_s`` or lies in a mapping whose key does (``host_decision_s``:
    policy name -> seconds)."""
    is_time = is_time or key.endswith("_s")
    if isinstance(node, Mapping):
        for k, v in node.items():
            _check_measured(v, f"{key}.{k}", is_time)
        return
    if isinstance(node, bool) or not isinstance(node, (int, float)) or not math.isfinite(node):
        raise ConfigError(key, node, "must be a finite number (or a mapping of them)")
    if is_time and node < 0:
        raise ConfigError(key, node, "must be >= 0 (a time in seconds)")
