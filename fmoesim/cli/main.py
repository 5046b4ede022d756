"""``fmoesim``: run one simulation (or a Hydra ``--multirun`` sweep) and write its results.

Examples::

    fmoesim                                   # bundled trace, Mixtral-8x7B, RTX 3090, LRU
    fmoesim cache.budget_gb=12 policy=lru model=mixtral-8x7b
    fmoesim workload=synthetic model=qwen1.5-moe-a2.7b cache.budget_gb=4
    fmoesim -m policy=lru,lfu cache.budget_gb=12,24     # a sweep: one line per run
    fmoesim -v -m policy=lru,lfu cache.budget_gb=12,24  # ... and every run's summary
    fmoesim --cfg job                         # print the composed config

Bad input (an unknown preset, a typo'd key, a non-positive budget, a broken trace) gives
one line on stderr naming the key or file and the rule, exit status 2, and no result;
every point of a sweep is checked before its first run.  Ctrl-C gives one line and exit
status 130, a closed stdout a quiet exit with status 141 (:mod:`fmoesim.errors`).
"""

from __future__ import annotations

import copy
import dataclasses
import os
import shutil
import sys
import time
import typing
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from fmoesim.atomic import atomic_dir, clean_stale_temps, unwritable
from fmoesim.config.build import (
    RunSpec,
    build_run,
    check_preset_fields,
    config_to_dict,
    one_line,
    policy_args,
    preset_names,
    synthetic_trace_path,
    valid_presets,
)
from fmoesim.config.schema import CONF_DIR, RunConfig, register_configs, resolve_path
from fmoesim.errors import (
    FmoesimError,
    counted,
    exit_interrupted,
    exit_stdout_closed,
    is_omegaconf_error,
    omegaconf_line,
)

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
#: command-line flags of fmoesim itself, taken out before Hydra parses the rest
VERBOSE_FLAGS = ("-v", "--verbose")
#: what ``-v`` adds: every run's summary, and Hydra's own log lines (launch, job list)
_VERBOSE_OVERRIDES = ("output.verbose=true", "hydra.hydra_logging.root.level=INFO")


def _fail(msg: str) -> None:
    print(f"{PROG}: error: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _unknown_preset(group: str, name: str) -> str:
    """One line for preset ``name`` missing from ``group`` (``hardware/measured`` for
    ``hardware=measured/<name>``), listing the valid names."""
    top, _, sub = group.partition("/")
    if sub and (CONF_DIR / group).is_dir():  # hardware=measured/<name>
        listed = ", ".join(f"{sub}/{n}" for n in preset_names(group)) or "(none)"
        return f"{top}={sub}/{name}: unknown {top}; valid in {sub}/: {listed}"
    if sub and (CONF_DIR / top).is_dir():  # a subfolder that does not exist
        return f"{top}={sub}/{name}: unknown {top}; valid: {valid_presets(top)}"
    return f"{group}={name}: unknown {group}; valid: {valid_presets(group)}"


def _friendly(exc: BaseException) -> str:
    """One line for a Hydra/OmegaConf composition error, listing valid names on a miss."""
    from hydra.errors import MissingConfigException

    if isinstance(exc, MissingConfigException) and getattr(exc, "missing_cfg_file", None):
        group, _, name = str(exc.missing_cfg_file).rpartition("/")
        if group:
            return _unknown_preset(group, name)
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


def _is_group(key: str) -> bool:
    """Whether an override's key names a config group (``policy=lru``), not a value."""
    return "/" in key or ("." not in key and (CONF_DIR / key).is_dir())


def _unknown_key(key: str) -> str | None:
    """Why ``key`` (dotted) names no field of the typed schema (:class:`RunConfig`), or
    None when it does or lies under an untyped node (``policy``, whose keys are its
    class's keyword arguments, checked when it is made)."""
    node: Any = RunConfig
    parts = key.split(".")
    for i, part in enumerate(parts):
        hints = typing.get_type_hints(node)
        if part not in hints:
            where = ".".join(parts[:i]) or "<root>"
            return (
                f"config key '{'.'.join(parts[: i + 1])}': unknown key '{part}' under "
                f"'{where}' (typo?)"
            )
        nxt = hints[part]
        typed = [t for t in (typing.get_args(nxt) or (nxt,)) if dataclasses.is_dataclass(t)]
        if not typed:
            return None  # a scalar, or Any: nothing further to check here
        node = typed[0]
    return None


def parse_overrides(overrides: list[str]) -> list[Any]:
    """Hydra's parse of ``overrides`` (its ``Override`` objects); a parse error becomes
    one :class:`FmoesimError` line."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parser = OverridesParser.create()
    try:
        return list(parser.parse_overrides(overrides))
    except Exception as exc:  # noqa: BLE001 - Hydra's parse errors, one line
        why = one_line(exc).split(" See https://")[0]  # Hydra's link to its grammar
    for o in overrides:  # the one that does not parse, named
        try:
            parser.parse_overrides([o])
        except Exception:  # noqa: BLE001 - as above
            raise FmoesimError(
                f"override '{o}': {why} (rule: key=value, a sweep's values comma-separated "
                "with none empty)"
            ) from None
    raise FmoesimError(why)  # pragma: no cover - one of them fails on its own


#: the keys a ``~key`` override may remove: the optional group a run can do without
DELETABLE = ("experiment",)


def check_added_keys(overrides: list[str]) -> None:
    """Refuse a ``+key=value`` or ``++key=value`` override whose key is not in the typed
    schema: Hydra adds such a key silently, so a typo (``+cache.budjet_gb=12``) would
    run the defaults.  Keys of ``hydra``, config groups (``+experiment=...``) and keys
    under ``policy`` (its constructor's keyword arguments) are left to Hydra and to the
    policy.  Refuse a ``~key`` override but of :data:`DELETABLE`, a key under ``policy``
    or Hydra's: a run keeps every other key, and Hydra's own answer differs by key (or,
    for ``~workload``, is a run that ignores it).  Refuse too a group's typed schema
    chosen as its preset
    (``hardware=hardware_schema``: every value its default, nothing named).  A preset
    is looked for in ``conf/`` and in the ``file://`` folders of a ``hydra.searchpath``
    (one it cannot look in, a ``pkg://`` one, leaves presets to Hydra)."""
    parsed = parse_overrides(overrides)
    folders = [CONF_DIR]
    for o in parsed:
        if o.key_or_group == "hydra.searchpath" and not o.is_delete():
            value = o.value()
            paths = [value] if isinstance(value, str) else list(value or [])
            if any(not str(p).startswith("file://") for p in paths):
                folders = []  # cannot tell: Hydra's composition decides
                break
            folders += [Path(str(p)[len("file://") :]).expanduser() for p in paths]
    for o in parsed:
        group = o.key_or_group
        if o.is_delete() and not (
            group in DELETABLE
            or group == "hydra"
            or group.startswith(("hydra.", "hydra/", "policy."))
            or o.package is not None
        ):
            # Hydra's own message depends on the key (a missing mandatory value, a typed
            # config that "does not support deletion", an unknown key, or none at all)
            raise FmoesimError(
                f"override '~{group}': a run keeps every key (rule: ~ removes only "
                f"{', '.join(sorted(DELETABLE))}, a policy's own keyword or a Hydra setting; "
                "give the key a value instead)"
            )
        if (
            not (o.is_add() or o.is_force_add() or o.is_delete())
            and _is_group(group)
            and isinstance(o.value(), str)
            and o.value().endswith("_schema")
        ):  # a typed schema of the ConfigStore, not a preset
            raise FmoesimError(
                f"{group}={o.value()}: unknown {group}; valid: {valid_presets(group)}"
            )
        if not o.is_delete() and folders and (CONF_DIR / group).is_dir():
            value = o.value()
            names = [value] if isinstance(value, str) else getattr(value, "list", None) or []
            for name in names:  # Hydra skips an unknown preset of an optional group (experiment)
                if not isinstance(name, str):
                    continue
                if not any((d / group / f"{name}.yaml").is_file() for d in folders):
                    folder, _, leaf = f"{group}/{name}".rpartition("/")
                    raise FmoesimError(_unknown_preset(folder, leaf))
        if not (o.is_add() or o.is_force_add()):
            continue
        key = o.key_or_group
        if key == "hydra" or key.startswith(("hydra.", "hydra/")) or o.package is not None:
            continue
        if _is_group(key):
            continue
        why = _unknown_key(key)
        if why is not None:
            raise FmoesimError(why)


#: Hydra launchers that come with an extra of fmoesim's (pyproject.toml), for the hint
#: when one is chosen without its plugin installed
_LAUNCHER_EXTRAS = {
    "joblib": "sweep",
    "submitit_slurm": "slurm",
    "submitit_local": "slurm",
    "ray": "ray",
    "ray_aws": "ray",
}


def check_hydra_groups(overrides: list[str]) -> None:
    """Refuse a choice in one of Hydra's own groups (``hydra/launcher=...``) that Hydra
    does not have, in one line listing the ones it has, before ``hydra.main`` (which
    prints the miss over several lines): a launcher of an uninstalled plugin names the
    extra that installs it.  With ``hydra.searchpath`` given, Hydra's own check stands
    (the groups may have options in the added folders)."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if not any(o.lstrip("+~").startswith("hydra/") for o in overrides):
        return
    parsed = parse_overrides(overrides)
    if any(o.key_or_group == "hydra.searchpath" for o in parsed):
        return
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            loader = GlobalHydra.instance().config_loader()
            for o in parsed:
                group = o.key_or_group
                if not group.startswith("hydra/") or o.is_delete():
                    continue
                value = o.value()
                names = [value] if isinstance(value, str) else getattr(value, "list", None)
                options = loader.get_group_options(group)
                for name in names or []:
                    if not isinstance(name, str) or name in options:
                        continue
                    listed = ", ".join(options) or "(none)"
                    extra = _LAUNCHER_EXTRAS.get(name) if group == "hydra/launcher" else None
                    hint = f" (pip install -e '.[{extra}]' installs it)" if extra else ""
                    raise FmoesimError(f"{group}={name}: unknown {group}{hint}; valid: {listed}")
    finally:
        GlobalHydra.instance().clear()


def check_launcher_host(overrides: list[str]) -> None:
    """A sweep on ``hydra/launcher=submitit_slurm`` is started where SLURM jobs can be
    submitted (``sbatch`` on PATH): elsewhere submitit stops at its first job with a
    traceback."""
    if "hydra/launcher=submitit_slurm" in overrides and shutil.which("sbatch") is None:
        raise FmoesimError(
            "hydra/launcher=submitit_slurm: no sbatch on PATH (rule: a SLURM sweep starts "
            "on a machine that submits SLURM jobs; hydra/launcher=submitit_local runs the "
            "same jobs here)"
        )


def _compose(overrides: list[str], hydra_config: bool = False) -> Any:
    """Hydra's compose of ``overrides`` (within an initialised Hydra); a composition
    error becomes one :class:`FmoesimError` line."""
    from hydra import compose
    from omegaconf import open_dict

    check_added_keys(overrides)
    try:
        cfg = compose(config_name="config", overrides=overrides, return_hydra_config=True)
    except Exception as exc:  # noqa: BLE001 - every composition error becomes one line
        raise FmoesimError(_friendly(exc)) from None
    _check_chosen_presets(cfg.hydra)
    if not hydra_config:
        with open_dict(cfg):
            del cfg["hydra"]  # as compose leaves it out
    return cfg


def _check_chosen_presets(hydra_cfg: Any) -> None:
    """The model and hardware presets a composition chose (on the command line, by an
    experiment preset or by default) set their own numbers
    (:func:`fmoesim.config.build.check_preset_fields`), looked for where Hydra looked:
    ``conf/`` and the ``file://`` folders of ``hydra.searchpath``."""
    folders = [CONF_DIR]
    for p in hydra_cfg.get("searchpath") or []:
        if str(p).startswith("file://"):
            folders.append(Path(str(p)[len("file://") :]).expanduser())
    choices = hydra_cfg.runtime.choices
    for group in ("model", "hardware"):
        name = choices.get(group)
        found = [d / group / f"{name}.yaml" for d in folders] if name else []
        found = [f for f in found if f.is_file()]
        if found:
            check_preset_fields(group, found[0], tuple(folders))  # the first on the path


def compose_config(overrides: list[str]) -> Any:
    """The composed ``fmoesim`` config for ``overrides`` (Hydra's compose API, outside
    ``hydra.main``); a composition error, or a ``+key`` not in the schema
    (:func:`check_added_keys`), becomes one :class:`FmoesimError` line."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            return _compose(overrides)
    finally:
        GlobalHydra.instance().clear()


def check_dir(key: str, directory: str | os.PathLike[str]) -> Path:
    """``directory`` (the value of config key ``key``) is a writable directory or can be
    made: its nearest existing ancestor is a writable directory.  Returns it as a path."""
    why = unwritable(directory)
    if why is not None:
        raise FmoesimError(f"config key '{key}' = '{directory}': {why}")
    return Path(directory).expanduser()


def _check_destinations(cfg: Any) -> None:
    """Where a run writes (``output.dir``, ``store.dir``) can be written: checked before
    the run, so that a run never ends without its results."""
    if cfg.output.write:
        check_dir("output.dir", cfg.output.dir)
    if cfg.store.enabled:
        check_dir("store.dir", cfg.store.dir)


def _preflight(overrides: list[str]) -> None:
    """Compose and check the config before Hydra runs, so errors are one line."""
    try:
        cfg = compose_config(overrides)
        build_run(cfg)
        _check_destinations(cfg)
    except FmoesimError as exc:
        _fail(str(exc))
    except Exception as exc:  # a '${...}' that does not resolve
        if not is_omegaconf_error(exc):
            raise
        _fail(omegaconf_line(exc))


def sweep_points(overrides: list[str], preset_params: dict[str, Any]) -> list[list[str]]:
    """Every job of a basic sweep over ``overrides`` (comma lists and ranges) and an
    experiment preset's ``hydra.sweeper.params`` (a command-line value replaces a
    preset's for the same key), in Hydra's order: one override list per job."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper

    given = {o.split("=")[0].lstrip("+~") for o in overrides}
    extra = [f"{k}={v}" for k, v in preset_params.items() if k.lstrip("+~") not in given]
    parsed = parse_overrides(overrides + extra)
    return BasicSweeper.split_arguments(parsed, max_batch_size=None)[0]


def experiment_points(experiment: str) -> list[list[str]]:
    """Every run of an experiment preset's sweep (its ``hydra.sweeper.params``), each as
    the override list of a single run (``experiment=<name>`` first), in Hydra's order."""
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    base = [f"experiment={experiment}"]
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            params = _compose(base, hydra_config=True).hydra.sweeper.get("params") or {}
            return sweep_points(base, dict(params))
    finally:
        GlobalHydra.instance().clear()


def _preflight_sweep(overrides: list[str]) -> int:
    """Check every point of a sweep as a single run is checked (composition, every
    value, where it writes, its input files), before any job runs; returns the number of
    points (0 for a sweeper other than Hydra's basic one, whose points are not known in
    advance).

    Cheap: the config is composed once per distinct choice of config groups (``policy``,
    ``model``...), and each point's other overrides are applied to a copy of it, as
    Hydra applies overrides after composing the defaults (with Hydra's own function for
    that; were it gone, each point is composed in full).  Each trace's manifest and
    each arrivals CSV is read once (:func:`_check_inputs`), not the traces' routing.
    """
    from hydra import initialize_config_dir
    from hydra._internal import config_loader_impl
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    apply = getattr(config_loader_impl.ConfigLoaderImpl, "_apply_overrides_to_config", None)

    def composing(o: str) -> bool:  # decides which presets there are to compose
        key = o.split("=")[0].lstrip("+~")
        return key == "hydra.searchpath" or (_is_group(key) and not key.startswith("hydra"))

    own = [o for o in overrides if not o.lstrip("+~").startswith("hydra") or composing(o)]
    parser = OverridesParser.create()
    register_configs()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            try:
                plain = sweep_points(own, {})
                first = plain[0]
            except Exception as exc:  # noqa: BLE001 - Hydra's parse errors, one line
                globbed = next((o for o in own if "glob(" in o), None)
                if globbed is not None:  # Hydra expands glob() against its config loader
                    raise FmoesimError(
                        f"{globbed}: a glob() sweep is not supported (rule: list the values, "
                        "policy=lru,lfu, so that every point is checked before the first run)"
                    ) from None
                raise FmoesimError(one_line(exc)) from None
            try:
                hydra_cfg = _compose(first, hydra_config=True).hydra
                sweeper = hydra_cfg.sweeper
            except FmoesimError as exc:  # the first point's composition: name the point
                varied = [i for i in range(len(first)) if len({p[i] for p in plain}) > 1]
                shown = " ".join(first[i] for i in varied)
                raise FmoesimError(f"{exc} (sweep run 1: {shown})" if shown else str(exc)) from None
            given = [o.split("=", 1)[1] for o in overrides if o.startswith("hydra.sweep.dir=")]
            check_dir("hydra.sweep.dir", given[-1] if given else str(hydra_cfg.sweep.dir))
            if not str(sweeper.get("_target_", "")).endswith(".BasicSweeper"):
                return 0  # points picked as the sweep goes (optuna...): each job checks
            params = sweeper.get("params") or {}
            points = sweep_points(own, dict(params))
            bases: dict[tuple[str, ...], Any] = {}
            inputs: dict[str, Any] = {}
            names: dict[str, int] = {}
            swept = [i for i in range(len(points[0])) if len({p[i] for p in points}) > 1]
            for k, point in enumerate(points):
                shown = " ".join(point[i] for i in swept)
                where = f" (sweep run {k + 1}/{len(points)}: {shown})"
                try:
                    groups = [o for o in point if composing(o)]
                    values = [o for o in point if o not in groups]
                    check_added_keys(values)
                    if apply is None:
                        cfg = _compose(point)
                    else:
                        if tuple(groups) not in bases:
                            bases[tuple(groups)] = _compose(groups)
                        cfg = copy.deepcopy(bases[tuple(groups)])
                        try:
                            apply(parser.parse_overrides(values), cfg)
                        except Exception as exc:  # noqa: BLE001 - as a composition error
                            raise FmoesimError(_friendly(exc)) from None
                    spec = build_run(cfg)
                    _check_destinations(cfg)
                    _check_inputs(spec, inputs)
                except FmoesimError as exc:
                    raise FmoesimError(f"{exc}{where}") from None
                if spec.output.write and spec.output.name is not None:
                    names[spec.output.name] = names.get(spec.output.name, 0) + 1
            for name, n in names.items():
                if n > 1:
                    raise FmoesimError(
                        f"config key 'output.name' = '{name}': the same for {n} runs of "
                        "the sweep (each run needs a directory of its own: leave "
                        "output.name unset or sweep it too)"
                    )
            return len(points)
    finally:
        GlobalHydra.instance().clear()


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``fmoesim``.

    ``argv`` (default ``sys.argv[1:]``) is Hydra's command line, plus ``-v`` /
    ``--verbose`` anywhere in it: every run's full summary table (a sweep prints one
    line per run without it) and Hydra's own log lines; it stands for the overrides
    ``output.verbose=true hydra.hydra_logging.root.level=INFO``.  Ctrl-C ends with one
    line and exit status 130; a closed stdout ends quietly with 141.
    """
    try:
        try:
            _main(list(sys.argv[1:] if argv is None else argv))
        finally:  # a closed stdout shows here, not at the interpreter's exit
            sys.stdout.flush()
    except KeyboardInterrupt:
        exit_interrupted(PROG)
    except BrokenPipeError:
        exit_stdout_closed()


def _main(argv: list[str]) -> None:
    if "--version" in argv:  # fmoesim's, not Hydra's (Hydra's own flag printed its version)
        from importlib.metadata import PackageNotFoundError, version

        try:
            print(f"{PROG} {version('fmoesim')}")
        except PackageNotFoundError:  # a source tree on the path, not installed
            print(f"{PROG} (not installed)")
        return
    if any(a in VERBOSE_FLAGS for a in argv):
        argv = [a for a in argv if a not in VERBOSE_FLAGS] + list(_VERBOSE_OVERRIDES)
    register_configs()
    if not (CONF_DIR / "config.yaml").is_file():
        _fail(
            f"config directory {CONF_DIR} not found (set FMOESIM_CONF_DIR or run from a "
            "source checkout: pip install -e .)"
        )
    if any(a in ("--help", "-h") for a in argv):
        _print_help(argv)
        return
    multirun = any(a in ("-m", "--multirun") for a in argv)
    if multirun:  # Hydra's parser takes flags before the overrides only: -m goes first
        argv = ["-m", *(a for a in argv if a not in ("-m", "--multirun"))]
    special = any(a.split("=")[0] in _HYDRA_FLAGS for a in argv)
    if not special:
        overrides = [a for a in argv if not a.startswith("-")]
        try:
            check_hydra_groups(overrides)
        except FmoesimError as exc:
            _fail(str(exc))
        if multirun:
            try:
                check_launcher_host(overrides)
            except FmoesimError as exc:
                _fail(str(exc))
        if multirun and any(a.startswith("hydra/sweeper=") for a in overrides):
            pass  # another sweeper (optuna...) picks its points as it goes: jobs check
        elif multirun:
            try:
                _preflight_sweep(overrides)
            except FmoesimError as exc:
                _fail(str(exc))
            except Exception as exc:
                if not is_omegaconf_error(exc):
                    raise
                _fail(omegaconf_line(exc))
        else:
            _preflight(overrides)
    _run_hydra(argv)


def _run_hydra(argv: list[str]) -> None:
    """Hydra's entry point on ``argv`` (fmoesim's config, :func:`_task` per run)."""
    import hydra

    sys.argv = [PROG, *argv]
    hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")(_task)()


def _print_help(argv: list[str]) -> None:
    """Hydra's ``--help`` for ``argv``, its lists of each group's presets without the
    typed schemas the ConfigStore holds beside them (``model_schema``...: the presets'
    base, refused as a preset of their own)."""
    import contextlib
    import io

    buf = io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            _run_hydra(argv)
    finally:
        sys.stdout.write(without_schemas(buf.getvalue()))


def without_schemas(help_text: str) -> str:
    """``help_text`` with every entry ending in ``_schema`` left out of the lines of its
    "Configuration groups" section (``group: a, b, model_schema, c``)."""
    out, in_groups = [], False
    for line in help_text.splitlines(keepends=True):
        if line.startswith("== "):
            in_groups = line.startswith("== Configuration groups")
        group, sep, rest = line.partition(": ")
        if in_groups and sep and " " not in group:
            names = [n for n in rest.rstrip("\n").split(", ") if not n.endswith("_schema")]
            line = f"{group}: {', '.join(names)}" + ("\n" if line.endswith("\n") else "")
        out.append(line)
    return "".join(out)


def _task(cfg: Any) -> dict[str, Any]:
    from hydra.core.hydra_config import HydraConfig
    from hydra.types import RunMode

    try:
        return run_config(cfg, multirun=HydraConfig.get().mode == RunMode.MULTIRUN)
    except FmoesimError as exc:
        _fail(str(exc))
        raise  # unreachable
    except BrokenPipeError:  # Hydra would report it as a failed job
        exit_stdout_closed()


def run_config(cfg: Any, multirun: bool = False) -> dict[str, Any]:
    """Run one composed config: load or generate the trace, simulate, print, write results
    and add the summary row to the results store.  In a sweep (or with
    ``store.skip_done=true``) a config already in the store is not run again.

    Before the simulation: ``output.dir`` and ``store.dir`` must be writable
    (:func:`check_dir`), the run directory must not hold another config's run
    (:func:`check_run_dir`), and abandoned temporaries of earlier writes there are
    removed (:func:`fmoesim.atomic.clean_stale_temps`).  After it, the run directory
    appears only together with its store row (:func:`save_results`).  Prints the full
    summary (:func:`format_summary`) when ``output.verbose`` is true, or unset in a
    single run; one line otherwise (a sweep's line is :mod:`fmoesim.cli.sweep`'s).
    The row returned by a skipped run has ``done_already`` set.
    """
    import numpy as np

    import fmoesim
    from fmoesim.config.build import simulate_spec
    from fmoesim.engine.simulate import GB
    from fmoesim.results.store import (
        ResultsStore,
        code_version,
        config_key,
        input_digest,
        policy_code_version,
    )
    from fmoesim.trace.reader import read_trace

    spec = build_run(cfg)
    verbose = spec.output.verbose if spec.output.verbose is not None else not multirun
    resolved = config_to_dict(cfg)
    inputs = [
        resolve_path(spec.workload.path or "") if spec.workload.kind == "trace" else None,
        spec.serving.arrivals_csv if spec.serving.arrivals == "csv" else None,
        # a synthetic trace's lengths and arrivals from a file: its bytes count too
        spec.workload.synthetic.arrivals_csv if spec.workload.kind == "synthetic" else None,
    ]
    versions = {"code_version": code_version(), "input_digest": input_digest(inputs)}
    # a policy kept outside the repository: its code is part of the run too
    own_code = policy_code_version(str(cfg.policy.get("_target_", "")))
    if own_code is not None:
        versions["policy_code_version"] = own_code
    cfg_hash, cfg_json = config_key(resolved, versions)
    store = ResultsStore(check_dir("store.dir", cfg.store.dir)) if cfg.store.enabled else None
    skip = cfg.store.skip_done if cfg.store.skip_done is not None else multirun
    if store is not None and skip and store.has(cfg_hash):
        if verbose or not multirun:
            print(f"done already: {store.path(cfg_hash)} (store.skip_done=false reruns it)")
        return {**store.get(cfg_hash), "done_already": True}
    final = None
    if spec.output.write:
        name = spec.output.name or (
            f"{time.strftime('%Y%m%d-%H%M%S')}-{spec.policy.name}-{spec.model.name}-"
            f"{spec.budget_bytes / GB:g}gb-{cfg_hash[:6]}"
        )
        final = check_dir("output.dir", spec.output.dir) / name
        check_run_dir(final, cfg_hash)
        clean_stale_temps(final.parent)
    if store is not None:
        clean_stale_temps(store.root)
    trace_path = _trace_path(spec)
    trace = read_trace(trace_path)
    result = simulate_spec(spec, trace)
    row = dict(result.summary)
    row.update(
        {
            "trace": str(trace_path),
            "trace_source": trace.manifest.source.get("kind", ""),
            "experiment": cfg.get("experiment_name") or "",
            "policy_args": policy_args(cfg.policy, spec.policy.name),
            "config_hash": cfg_hash,
            "config_json": cfg_json,
            **versions,
            "fmoesim_version": fmoesim.__version__,
            "python": sys.version.split()[0],
            "numpy_version": np.__version__,
        }
    )
    row.update(_row_extras(result, trace))
    # saved before anything is printed: a closed stdout does not cost the run its results
    stored = save_results(final, store, spec, row, resolved, result)
    if verbose:
        per_gpu = spec.model.experts_per_gpu(spec.hardware.num_gpus)
        notes = [unmeasured_note(spec), missing_inputs_note(spec.policy, trace)]
        print(format_summary(row, spec.hardware.gpu_memory_gb, per_gpu, notes))
        if final is not None:
            print(f"results    {final}")
        if stored is not None:
            print(f"stored     {stored}")
    elif not multirun:
        which = f"{row['policy']} at {row['budget_gb']:g} GB: "  # a line among a script's
        print(which + format_line(row) + (f"; results {final}" if final is not None else ""))
    return row


def check_run_dir(final: Path, config_hash: str) -> None:
    """``final`` (``<output.dir>/<output.name>``) may be written by a run of
    ``config_hash``: it does not exist, is an empty directory, or holds a run of that
    same hash (the same config, code and inputs: a rerun replaces its own directory).
    A directory of another config's run, or of anything else, is refused: never
    deleted."""
    if not final.exists() and not final.is_symlink():
        return
    key = f"config key 'output.name' = '{final.name}'"
    if not final.is_dir() or final.is_symlink():
        raise FmoesimError(f"{key}: {final} exists and is not a run directory; pick another name")
    if not any(final.iterdir()):
        return
    summary = final / "summary.parquet"
    try:
        import pyarrow.parquet as pq

        theirs = str(pq.read_table(summary, columns=["config_hash"]).column(0)[0])
    except Exception:  # noqa: BLE001 - missing, unreadable, not a run: not ours to replace
        raise FmoesimError(
            f"{key}: {final} exists and does not hold a fmoesim run; pick another "
            "output.name (or remove that directory)"
        ) from None
    if theirs != config_hash:
        raise FmoesimError(
            f"{key}: {final} holds a run of another config (hash {theirs}; this run "
            f"{config_hash}); pick another output.name, or remove that directory to reuse it"
        )


def save_results(
    final: Path | None, store: Any, spec: RunSpec, row: dict[str, Any], resolved: Any, result: Any
) -> Path | None:
    """Write the run directory ``final`` (if any, :func:`write_run_files`) and add
    ``row`` to ``store`` (if any), all or nothing: the directory is filled under a
    temporary name, the store row is written, and only then the directory takes its
    name; a failure (or Ctrl-C) in between removes both.  Returns the store row's path.
    A file system error becomes one :class:`FmoesimError` line."""
    stored: Path | None = None
    try:
        with atomic_dir(final, replace=True) if final is not None else nullcontext() as tmp:
            if tmp is not None:
                write_run_files(tmp, spec, row, resolved, result)
            if store is not None:
                stored = store.add(row)
    except BaseException as exc:
        if stored is not None:
            stored.unlink(missing_ok=True)
        if isinstance(exc, OSError):
            where = exc.filename or final or store.root
            raise FmoesimError(f"{where}: cannot write results ({exc.strerror or exc})") from None
        raise
    return stored


def _row_extras(result: Any, trace: Any) -> dict[str, Any]:
    """Per-request latencies as list columns (latency CDFs); per MoE layer the hit rate
    (``layer_hit_rate``), the stall (``layer_stall_s``) and the share of routed experts
    the trace's speculative prediction had in its top-k (``layer_spec_recall``,
    :func:`fmoesim.trace.stats.spec_recall`), as list columns of ``L`` values (NaN where
    there is none); and the mean of every numeric column of the policy's own log as
    ``policy_mean_<name>`` (e.g. fMoE's similarity scores)."""
    import numpy as np

    from fmoesim.trace.stats import spec_recall

    req = result.metrics.request_table()
    out: dict[str, Any] = {
        f"request_{k}": [float(x) for x in req[k]] for k in ("ttft_s", "tpot_s", "e2e_s")
    }
    layers = result.metrics.layer_table()
    out["layer_hit_rate"] = [float(x) for x in layers["hit_rate"]]
    out["layer_stall_s"] = [float(x) for x in layers["stall_s"]]
    out["layer_spec_recall"] = [float(x) for x in spec_recall(trace)]
    for k, v in (result.policy_log or {}).items():
        a = np.asarray(v)
        if a.dtype.kind == "f" and a.size and np.isfinite(a).any():
            out[f"policy_mean_{k}"] = float(np.nanmean(a))
    return out


def _check_inputs(spec: RunSpec, seen: dict[str, Any]) -> None:
    """A sweep point's input files, as its run would read them first: the trace directory
    exists and its manifest's shape is the model's; an arrivals CSV reads.  ``seen``
    keeps each file's manifest or ``True`` across the points, so each is read once."""
    from fmoesim.engine.simulate import check_manifest_shape
    from fmoesim.trace.schema import MANIFEST, TraceManifest
    from fmoesim.workload.synthetic import read_arrivals

    w = spec.workload
    if w.kind == "trace":
        path = resolve_path(w.path or "")
        key = f"trace:{path}"
        if key not in seen:
            _check_trace_dir(w.path or "", path)
            seen[key] = TraceManifest.load(path / MANIFEST)
        check_manifest_shape(seen[key], path, spec.model)
    # (file, rows read): a synthetic trace reads its requests' rows, serving the whole file
    csvs: list[tuple[str | None, int | None]] = []
    if w.kind == "synthetic":
        csvs.append((w.synthetic.arrivals_csv, w.synthetic.num_requests))
    if spec.serving.mode == "online" and spec.serving.arrivals == "csv":
        csvs.append((spec.serving.arrivals_csv, None))
    for csv, limit in csvs:
        if csv and f"csv:{csv}:{limit}" not in seen:
            read_arrivals(csv, limit=limit)
            seen[f"csv:{csv}:{limit}"] = True


def _check_trace_dir(given: str, path: Path) -> None:
    """``workload.path`` (``given``, resolved to ``path``) is a folder: one line otherwise."""
    if path.is_dir():
        return
    what = "a file, not a trace directory" if path.exists() else "trace directory not found"
    raise FmoesimError(f"workload.path '{given}': {what}")


def _trace_path(spec: RunSpec) -> Path:
    w = spec.workload
    if w.kind == "trace":
        path = resolve_path(w.path or "")
        _check_trace_dir(w.path or "", path)
        return path
    from fmoesim.workload.synthetic import generate, read_arrivals

    path = synthetic_trace_path(spec.model, w)
    if _cached_by_this_code(path):
        return path
    # one process makes it; the others wait, then find it made (sweep workers share it)
    with _trace_lock(path):
        if not _cached_by_this_code(path):
            if w.synthetic.arrivals_csv:  # a bad file is one line, before the progress line
                read_arrivals(w.synthetic.arrivals_csv, limit=w.synthetic.num_requests)
            print(f"generating synthetic trace -> {path}", file=sys.stderr)
            generate(spec.model, w.synthetic, path, overwrite=True, progress=spec.progress)
    return path


def _cached_by_this_code(path: Path) -> bool:
    """Whether ``path`` holds a synthetic trace made by the generator code this process
    runs (its manifest's ``source["code"]``): a trace cached by other code (an older
    checkout, another numpy) is made again, not read as if this code had made it."""
    import json

    from fmoesim.workload.synthetic import GENERATOR_CODE

    try:
        source = json.loads((path / "trace.json").read_text()).get("source", {})
    except (OSError, ValueError, AttributeError):
        return False
    return isinstance(source, dict) and source.get("code") == GENERATOR_CODE


@contextmanager
def _trace_lock(path: Path) -> typing.Iterator[None]:
    """An exclusive lock on ``<path>.lock`` beside the cached trace ``path`` (POSIX
    ``flock``; none where the platform has no ``fcntl``), held while the trace is made."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _timed(row: dict[str, Any]) -> bool:
    """Whether a row's run simulated time (its ``timing`` column; true when absent)."""
    return bool(row.get("timing", True))


def _time(x: Any, unit: str, timed: bool) -> str:
    """A time for the tables: ``ms`` or ``s``; ``n/a`` for a missing one."""
    if not timed:
        return "n/a (hit-rate-only)"
    if x is None or x != x:
        return "n/a"
    return f"{x * 1e3:.1f} ms" if unit == "ms" else f"{x:.3f} s"


def format_line(row: dict[str, Any]) -> str:
    """One line for a run: hit rate, the share of accesses late (in flight) when there
    were any, mean TTFT and TPOT (``TPOT n/a (hit-rate-only)`` without timing)."""
    timed = _timed(row)
    late = row.get("late_rate") or 0.0
    late = late if late == late else 0.0  # NaN: a run without accesses
    line = f"hit rate {100 * row['hit_rate']:.2f}%" + (f" (late {100 * late:.2f}%)" if late else "")
    if not timed:
        return f"{line}, TPOT {_time(None, 'ms', timed)}"
    ttft, tpot = (
        _time(row.get("ttft_mean_s"), "ms", timed),
        _time(row.get("tpot_mean_s"), "ms", timed),
    )
    return f"{line}, TTFT {ttft}, TPOT {tpot}"


def missing_inputs_note(policy: Any, trace: Any) -> str | None:
    """A note when ``policy`` reads what ``trace`` lacks (a top-k import has no gate
    probabilities, speculative predictions or embeddings; fMoE's semantic search reads
    embeddings), else None."""
    lacks = []
    if getattr(policy, "uses_probs", False) and trace.probs is None:
        lacks.append("gate probabilities")
    if getattr(policy, "uses_spec", False) and trace.spec_probs is None:
        lacks.append("speculative gate predictions")
    if getattr(policy, "semantic", False) and trace.embedding.shape[1] == 0:  # fMoE's search
        lacks.append("embeddings")
    if not lacks:
        return None
    what = ", ".join(lacks[:-1]) + (" and " if len(lacks) > 1 else "") + lacks[-1]
    return (
        f"policy {policy.name} reads {what}, which trace {trace.path} lacks: it runs "
        "without them (docs/policies.md says how)"
    )


def unmeasured_note(spec: RunSpec) -> str | None:
    """A note when a timed run's hardware holds measured coefficients of other models
    only (its compute is then the roofline's), else None."""
    measured = [str(n) for n in spec.hardware.measured or {} if n != "link"]
    if not spec.engine.timing or not measured or spec.model.name in measured:
        return None  # a hit-rate-only run computes nothing
    return (
        f"hardware {spec.hardware.name} holds measured coefficients of "
        f"{', '.join(measured)}, none of {spec.model.name}: its compute is the roofline's "
        "estimate"
    )


def format_summary(
    row: dict[str, Any],
    gpu_memory_gb: float | None = None,
    experts: int | None = None,
    notes: Sequence[str | None] = (),
) -> str:
    """The summary table printed after a run; a hit-rate-only run's times read
    ``n/a (hit-rate-only)``.  With ``gpu_memory_gb`` (the hardware's, per GPU), a note
    follows when the weights' peak is above it: the expert budget is not checked
    against the GPU's memory.  With ``experts`` (the most routed experts one GPU holds,
    :meth:`~fmoesim.specs.ModelSpec.experts_per_gpu`), a budget that holds all of them
    says so instead of a count beyond them.  ``notes`` (None for none) follow it:
    measured coefficients of other models only (:func:`unmeasured_note`), inputs the
    policy reads and the trace lacks (:func:`missing_inputs_note`)."""
    timed = _timed(row)
    gpus = int(row.get("num_gpus", 1))
    held = f"{row['budget_experts']} experts"
    if experts is not None and row["budget_experts"] >= experts:
        held = f"holds all {experts} experts" + (" of a GPU" if gpus > 1 else "")
    w = 20  # width of the value column

    def t(key: str, unit: str) -> str:
        return f"{_time(row[key], unit, timed):>{w}}"

    def gb(key: str) -> str:
        return f"{row[key] / 1e9:>{w - 3}.2f} GB"

    lines = [
        f"policy     {row['policy']}"
        + (f" ({row['policy_args']})" if row.get("policy_args") else "")
        + f"   model {row['model']}   hardware {row['hardware']}   "
        f"budget {row['budget_gb']:.2f} GB ({held})"
        + (f" per GPU x {gpus} GPUs" if gpus > 1 else ""),
        f"trace      {row['trace']} ({row['trace_source']}; "
        f"{counted(row['requests'], 'request')}), "
        f"run in {counted(row['iterations'], 'iteration')}",
        "",
        f"{'metric':<22}{'value':>{w}}",
        "-" * (22 + w),
        f"{'expert hit rate':<22}{row['hit_rate'] * 100:>{w - 1}.2f}%",
        f"{'late (in flight)':<22}{row['late_rate'] * 100:>{w - 1}.2f}%",
        f"{'accesses':<22}{row['accesses']:>{w},}",
        f"{'GPU stall':<22}{t('stall_s', 's')}",
        f"{'TTFT mean':<22}{t('ttft_mean_s', 'ms')}",
        f"{'TPOT mean':<22}{t('tpot_mean_s', 'ms')}",
        f"{'TPOT p99':<22}{t('tpot_p99_s', 'ms')}",
        f"{'end-to-end mean':<22}{t('e2e_mean_s', 's')}",
        f"{'PCIe bytes':<22}{gb('pcie_bytes')}",
        f"{'PCIe wasted':<22}{gb('wasted_bytes')}",
        f"{'peak expert memory':<22}{gb('peak_expert_bytes')}",
        *(
            [f"{'VRAM (weights)':<22}{gb('vram_footprint_bytes')}"]
            if "vram_footprint_bytes" in row
            else []
        ),
        f"{'simulated time':<22}{t('simulated_s', 's')}",
        f"{'wall time':<22}{row['wall_s']:>{w - 2}.3f} s",
    ]
    vram = row.get("vram_footprint_bytes")
    if gpu_memory_gb is not None and vram is not None and vram > gpu_memory_gb * 1e9:
        lines += [
            "",
            f"note       VRAM (weights) exceeds the GPU's {gpu_memory_gb:g} GB: "
            "cache.budget_gb counts routed experts only",
        ]
    for note in notes:
        if note is not None:
            if not lines[-1].startswith("note"):
                lines.append("")
            lines.append(f"note       {note}")
    return "\n".join(lines)


def write_run_files(
    tmp: Path, spec: RunSpec, row: dict[str, Any], resolved: dict[str, Any], result: Any
) -> None:
    """Write a run's files into the directory ``tmp``: ``summary.parquet``,
    ``layers.parquet``, ``transfers.parquet`` (+ ``accesses.parquet``,
    ``policy_log.parquet``), ``config.yaml`` and ``hit_rate.png``."""
    import pandas as pd
    import yaml

    layers = result.metrics.layer_table()
    pd.DataFrame([row]).to_parquet(tmp / "summary.parquet", index=False)
    pd.DataFrame(layers).to_parquet(tmp / "layers.parquet", index=False)
    pd.DataFrame(result.transfer_table()).to_parquet(tmp / "transfers.parquet", index=False)
    if result.accesses is not None:
        pd.DataFrame(result.accesses).to_parquet(tmp / "accesses.parquet", index=False)
    if result.policy_log is not None:
        pd.DataFrame(result.policy_log).to_parquet(tmp / "policy_log.parquet", index=False)
    (tmp / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
    if spec.output.plot and plotting_available():
        from fmoesim.plots.run import plot_run

        plot_run(
            result.metrics.accesses,
            layers["stall_s"],
            f"{row['policy']} · {row['model']} · {row['hardware']} · "
            f"{row['budget_gb']:g} GB · hit rate {row['hit_rate'] * 100:.1f}%",
            tmp / "hit_rate.png",
            trace=row["trace"],
            trace_source=row["trace_source"],
            requests_served=row["requests"],
            held_in_fraction=spec.serving.held_in_fraction,
            timed=_timed(row),
        )


def plotting_available() -> bool:
    """Whether matplotlib (the ``plot`` extra) is installed.  Without it a run writes
    everything but ``hit_rate.png`` and says so once on stderr."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        pass
    else:
        return True
    global _PLOT_NOTED
    if not _PLOT_NOTED:
        print(
            f"{PROG}: note: hit_rate.png skipped: matplotlib is not installed "
            "(pip install -e '.[plot]'; output.plot=false silences this)",
            file=sys.stderr,
        )
        _PLOT_NOTED = True
    return False


_PLOT_NOTED = False


if __name__ == "__main__":
    main()
