"""``fmoesim``: run one simulation (or a Hydra ``--multirun`` sweep) and write its results.

Examples::

    fmoesim                                   # bundled trace, Mixtral-8x7B, RTX 3090, LRU
    fmoesim cache.budget_gb=12 policy=lru model=mixtral-8x7b
    fmoesim workload=synthetic model=qwen1.5-moe-a2.7b cache.budget_gb=4
    fmoesim --cfg job                         # print the composed config

Bad input (an unknown preset, a typo'd key, a non-positive budget, a broken trace) gives
one line on stderr naming the key or file and the rule, exit status 2, and no result.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_dir
from fmoesim.config.build import (
    RunSpec,
    build_run,
    config_to_dict,
    one_line,
    preset_names,
    synthetic_trace_path,
)
from fmoesim.config.schema import CONF_DIR, register_configs, resolve_path
from fmoesim.errors import FmoesimError

PROG = "fmoesim"
_HYDRA_FLAGS = {
    "--help",
    "-h",
    "--hydra-help",
    "--cfg",
    "-c",
    "--info",
    "-i",
    "--version",
    "--shell-completion",
    "-sc",
    "--resolve",
    "--package",
    "-p",
}


def _fail(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _friendly(exc: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, listing valid names on a miss."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException) and getattr(exc, "missing_cfg_file", None):
        missing = str(exc.missing_cfg_file)
        group, _, name = missing.rpartition("/")
        if group:
            return (
                f"{group}={name}: unknown {group}; valid: "
                f"{', '.join(preset_names(group)) or '(none)'}"
            )
    cause = exc.__cause__
    full_key = getattr(cause, "full_key", None)
    if full_key is not None:
        first = str(cause).splitlines()[0]
        if first.startswith("Key '"):
            parent, _, leaf = str(full_key).rpartition(".")
            where = parent or "<root>"
            return f"config key '{full_key}': unknown key '{leaf}' under '{where}' (typo?)"
        return f"config key '{full_key}': {first}"
    return one_line(exc)


def compose_config(overrides: list[str]) -> Any:
    """The composed ``fmoesim`` config for ``overrides`` (Hydra's compose API, outside
    ``hydra.main``); a composition error becomes one :class:`FmoesimError` line."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return compose(config_name="config", overrides=overrides)
    except Exception as exc:  # noqa: BLE001 - every composition error becomes one line
        raise FmoesimError(_friendly(exc)) from None
    finally:
        GlobalHydra.instance().clear()


def _preflight(overrides: list[str]) -> None:
    """Compose and check the config before Hydra runs, so errors are one line."""
    try:
        build_run(compose_config(overrides))
    except FmoesimError as exc:
        _fail(str(exc))


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``fmoesim``."""
    import hydra

    argv = list(sys.argv[1:] if argv is None else argv)
    register_configs()
    if not (CONF_DIR / "config.yaml").is_file():
        _fail(
            f"config directory {CONF_DIR} not found (set FMOESIM_CONF_DIR or run from a "
            "source checkout: pip install -e .)"
        )
    multirun = any(a in ("-m", "--multirun") for a in argv)
    special = any(a.split("=")[0] in _HYDRA_FLAGS for a in argv)
    if not multirun and not special:
        _preflight([a for a in argv if not a.startswith("-")])
    sys.argv = [PROG, *argv]
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_task)()


def _task(cfg: Any) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return run_config(cfg, multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
    except FmoesimError as exc:
        _fail(str(exc))
        raise  # unreachable


def run_config(cfg: Any, multirun: bool = False) -> dict[str, Any]:
    """Run one composed config: load or generate the trace, simulate, print, write results
    and add the summary row to the results store.  In a sweep (or with
    ``store.skip_done=true``) a config already in the store is not run again."""
    import numpy as np

    import fmoesim
    from fmoesim.config.build import simulate_spec
    from fmoesim.results.store import ResultsStore, code_version, config_key, input_digest
    from fmoesim.trace.reader import read_trace

    spec = build_run(cfg)
    resolved = config_to_dict(cfg)
    inputs = [
        resolve_path(spec.workload.path or "") if spec.workload.kind == "trace" else None,
        spec.serving.arrivals_csv if spec.serving.arrivals == "csv" else None,
    ]
    versions = {"code_version": code_version(), "input_digest": input_digest(inputs)}
    cfg_hash, cfg_json = config_key(resolved, versions)
    store = ResultsStore(resolve_out(cfg.store.dir)) if cfg.store.enabled else None
    skip = cfg.store.skip_done if cfg.store.skip_done is not None else multirun
    if store is not None and skip and store.has(cfg_hash):
        print(f"done already: {store.path(cfg_hash)} (store.skip_done=false reruns it)")
        return store.get(cfg_hash)
    trace_path = _trace_path(spec)
    trace = read_trace(trace_path)
    result = simulate_spec(spec, trace)
    row = dict(result.summary)
    row.update(
        {
            "trace": str(trace_path),
            "trace_source": trace.manifest.source.get("kind", ""),
            "experiment": cfg.get("experiment_name") or "",
            "config_hash": cfg_hash,
            "config_json": cfg_json,
            **versions,
            "fmoesim_version": fmoesim.__version__,
            "python": sys.version.split()[0],
            "numpy_version": np.__version__,
        }
    )
    row.update(_row_extras(result))
    print(format_summary(row))
    if spec.output.write:
        out = write_results(spec, row, resolved, result)
        print(f"results    {out}")
    if store is not None:
        print(f"stored     {store.add(row)}")
    return row


def _row_extras(result: Any) -> dict[str, Any]:
    """Per-request latencies as list columns (latency CDFs), and the mean of every
    numeric column of the policy's own log as ``policy_mean_<name>`` (e.g. fMoE's
    similarity scores)."""
    import numpy as np

    req = result.metrics.request_table()
    out: dict[str, Any] = {
        f"request_{k}": [float(x) for x in req[k]] for k in ("ttft_s", "tpot_s", "e2e_s")
    }
    for k, v in (result.policy_log or {}).items():
        a = np.asarray(v)
        if a.dtype.kind == "f" and a.size and np.isfinite(a).any():
            out[f"policy_mean_{k}"] = float(np.nanmean(a))
    return out


def _trace_path(spec: RunSpec) -> Path:
    w = spec.workload
    if w.kind == "trace":
        path = resolve_path(w.path or "")
        if not path.exists():
            raise FmoesimError(f"workload.path '{w.path}': trace directory not found")
        return path
    from fmoesim.workload.synthetic import generate

    path = synthetic_trace_path(spec.model, w)
    if not (path / "trace.json").is_file():
        print(f"generating synthetic trace -> {path}", file=sys.stderr)
        generate(spec.model, w.synthetic, path, overwrite=True, progress=spec.progress)
    return path


def format_summary(row: dict[str, Any]) -> str:
    """The summary table printed after a run."""

    def ms(x: float) -> str:
        return f"{x * 1e3:.1f} ms"

    lines = [
        f"policy     {row['policy']}   model {row['model']}   hardware {row['hardware']}   "
        f"budget {row['budget_gb']:.2f} GB ({row['budget_experts']} experts)"
        + (f" per GPU x {row['num_gpus']} GPUs" if row.get("num_gpus", 1) > 1 else ""),
        f"trace      {row['trace']} ({row['trace_source']}; {row['requests']} requests, "
        f"{row['iterations']} iterations)",
        "",
        f"{'metric':<22}{'value':>16}",
        "-" * 38,
        f"{'expert hit rate':<22}{row['hit_rate'] * 100:>15.2f}%",
        f"{'late (in flight)':<22}{row['late_rate'] * 100:>15.2f}%",
        f"{'accesses':<22}{row['accesses']:>16,}",
        f"{'GPU stall':<22}{row['stall_s']:>14.3f} s",
        f"{'TTFT mean':<22}{ms(row['ttft_mean_s']):>16}",
        f"{'TPOT mean':<22}{ms(row['tpot_mean_s']):>16}",
        f"{'TPOT p99':<22}{ms(row['tpot_p99_s']):>16}",
        f"{'end-to-end mean':<22}{row['e2e_mean_s']:>14.3f} s",
        f"{'PCIe bytes':<22}{row['pcie_bytes'] / 1e9:>13.2f} GB",
        f"{'PCIe wasted':<22}{row['wasted_bytes'] / 1e9:>13.2f} GB",
        f"{'peak expert memory':<22}{row['peak_expert_bytes'] / 1e9:>13.2f} GB",
        f"{'simulated time':<22}{row['simulated_s']:>14.3f} s",
        f"{'wall time':<22}{row['wall_s']:>14.3f} s",
    ]
    return "\n".join(lines)


def write_results(
    spec: RunSpec, row: dict[str, Any], resolved: dict[str, Any], result: Any
) -> Path:
    """Write ``summary.parquet``, ``layers.parquet``, ``transfers.parquet`` (+
    ``accesses.parquet``, ``policy_log.parquet``, ``config.yaml``, ``hit_rate.png``) atomically."""
    import pandas as pd
    import yaml

    cfg_hash = row["config_hash"]
    name = spec.output.name or (
        f"{time.strftime('%Y%m%d-%H%M%S')}-{row['policy']}-{row['model']}-"
        f"{row['budget_gb']:g}gb-{cfg_hash[:6]}"
    )
    final = resolve_out(spec.output.dir) / name
    with atomic_dir(final, replace=True) as tmp:
        pd.DataFrame([row]).to_parquet(tmp / "summary.parquet", index=False)
        pd.DataFrame(result.metrics.layer_table()).to_parquet(tmp / "layers.parquet", index=False)
        pd.DataFrame(result.transfer_table()).to_parquet(tmp / "transfers.parquet", index=False)
        if result.accesses is not None:
            pd.DataFrame(result.accesses).to_parquet(tmp / "accesses.parquet", index=False)
        if result.policy_log is not None:
            pd.DataFrame(result.policy_log).to_parquet(tmp / "policy_log.parquet", index=False)
        (tmp / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        if spec.output.plot:
            from fmoesim.plots.run import plot_run

            m = result.metrics
            caption = (
                f"trace: {row['trace']} ({row['trace_source']}"
                + (", synthetic: not real routing" if row["trace_source"] == "synthetic" else "")
                + ")"
            )
            plot_run(
                m.accesses,
                m.stall_per_layer_s,
                f"{row['policy']} · {row['model']} · {row['hardware']} · "
                f"{row['budget_gb']:g} GB · hit rate {row['hit_rate'] * 100:.1f}%",
                tmp / "hit_rate.png",
                caption,
            )
    return final


def resolve_out(d: str) -> Path:
    """Output directory: absolute as given, else relative to the working directory."""
    return Path(d).expanduser()


if __name__ == "__main__":
    main()
