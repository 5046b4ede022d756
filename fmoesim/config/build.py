"""Turn a composed Hydra config into checked objects, and load presets by name."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from fmoesim.atomic import is_plain_name
from fmoesim.config.schema import CONF_DIR, EngineConfig, OutputConfig, WorkloadConfig
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import (
    GB,
    LANDINGS,
    check_budget,
    check_experts_per_layer,
    check_link_order,
    check_reserve,
    simulate,
)
from fmoesim.errors import ConfigError, FmoesimError, one_line
from fmoesim.specs.hardware import HardwareSpec
from fmoesim.specs.model import ModelSpec
from policies.base import Policy

T = TypeVar("T")


def preset_names(group: str) -> list[str]:
    """Names of the YAML presets of a config group (``model``, ``hardware``, ``policy``...)."""
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def check_preset_names(group: str, names: list[str], flag: str) -> None:
    """Each of ``names`` (the value of command-line option ``flag``) is a preset of
    ``group``: one line naming the first that is not, with the valid ones."""
    known = preset_names(group)
    for name in names:
        if name not in known:
            raise FmoesimError(f"{flag} {name}: unknown {group}; valid: {', '.join(known)}")


def valid_presets(group: str) -> str:
    """A group's preset names, then each subfolder of presets as ``sub/<name>`` with its
    count (``measured/<name> (21 presets)``): the subfolders' names are too many to list."""
    names = ", ".join(preset_names(group)) or "(none)"
    folder = CONF_DIR / group
    subs = sorted(d for d in folder.iterdir() if d.is_dir()) if folder.is_dir() else []
    for sub in subs:
        count = len(preset_names(f"{group}/{sub.name}"))
        if count:
            names += f"; {sub.name}/<name> ({count} presets in conf/{group}/{sub.name})"
    return names


#: the fields a preset of the group sets itself (a model's shape, a machine's numbers):
#: the schema's defaults are one model's and one GPU's, so a preset that leaves one out
#: would run on them without a word
PRESET_FIELDS = {
    "model": ("name", "num_layers", "num_experts", "top_k", "hidden_size",
              "expert_intermediate_size", "num_attention_heads", "num_kv_heads", "head_dim",
              "vocab_size", "dtype"),
    # every field of a machine but its measured coefficients (a profile's own)
    "hardware": tuple(f.name for f in fields(HardwareSpec) if f.name != "measured"),
}  # fmt: skip


def check_preset_fields(group: str, path: Path, folders: tuple[Path, ...] = (CONF_DIR,)) -> None:
    """A ``model`` or ``hardware`` preset file ``path`` sets every field of
    :data:`PRESET_FIELDS` itself or through the presets its ``defaults`` list extends
    (``parent``, ``parent@_here_``, ``/model/parent``: looked for as Hydra does, in each
    of ``folders``); one line naming the file and the first field left out otherwise.
    Other groups, a file that does not load as a mapping and a parent that is not found
    (Hydra reports each) pass."""
    need = PRESET_FIELDS.get(group)
    if need is None:
        return
    keys: set[str] = set()
    todo, seen = [path], set()
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            raw = OmegaConf.to_container(OmegaConf.load(p))
        except Exception:  # noqa: BLE001 - not YAML: left to the loader, which says so
            return
        if not isinstance(raw, dict):
            return
        keys |= {str(k) for k in raw}
        for entry in raw.get("defaults") or []:
            parent = _parent_preset(entry, group, p, folders)
            if parent is False:
                return  # a parent Hydra will not find either: its error, not ours
            if parent is not None:
                todo.append(parent)
    missing = [k for k in need if k not in keys]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        what = f"its shape ({', '.join(need)})" if group == "model" else "each field but measured"
        raise FmoesimError(
            f"{path}: sets no {missing[0]}{more} (rule: a {group} preset sets {what} itself; "
            f"the schema's defaults are no {group}'s)"
        )


def _parent_preset(entry: Any, group: str, path: Path, folders: tuple[Path, ...]) -> Any:
    """The file of a preset that ``path``'s defaults ``entry`` extends; None for an
    entry that is not one (``_self_``, the group's schema, another group's choice);
    False when it names a preset that is in none of ``folders``."""
    if not isinstance(entry, str):
        return None  # {group: option}, an override: another group's choice
    ref = entry.split("@", 1)[0].strip()  # "parent@_here_": where it goes, not what
    if ref in ("_self_", f"{group}_schema", f"/{group}/{group}_schema"):
        return None
    # absolute from the config tree's root, else relative to the group (as Hydra reads
    # a parent of the option measured/x of group hardware: hardware/<ref>)
    rel = Path(ref.lstrip("/")) if ref.startswith("/") else Path(group) / ref
    found = [d / f"{rel}.yaml" for d in folders if (d / f"{rel}.yaml").is_file()]
    return found[0] if found else False


def load_preset(group: str, name: str, schema: type[T]) -> T:
    """Load ``conf/<group>/<name>.yaml`` into ``schema``; unknown names list the valid ones."""
    path = CONF_DIR / group / f"{name}.yaml"
    if not path.is_file():
        raise ConfigError(group, name, f"unknown {group} preset; valid: {valid_presets(group)}")
    try:
        raw = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - yaml's errors, not UTF-8, OmegaConf's
        raise ConfigError(f"{group}/{name}.yaml", "", f"is not YAML: {one_line(exc)}") from None
    if not isinstance(raw, DictConfig):
        raise ConfigError(f"{group}/{name}.yaml", "", "must be a YAML mapping")
    check_preset_fields(group, path)
    if "defaults" in raw:
        del raw["defaults"]
    try:
        merged = OmegaConf.merge(OmegaConf.structured(schema), raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{group}/{name}.yaml", "", one_line(exc)) from None
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


@dataclass
class RunSpec:
    """A checked run: the objects :func:`fmoesim.engine.simulate` takes."""

    model: ModelSpec
    hardware: HardwareSpec
    policy: Policy
    budget_bytes: int
    serving: ServingConfig
    engine: EngineConfig
    workload: WorkloadConfig
    output: OutputConfig
    seed: int
    progress: bool
    experts_per_layer: int | None = None
    release_after_use: bool = False
    preload: bool = False


def budget_bytes_of(budget_gb: float) -> int:
    """The expert budget in bytes that ``cache.budget_gb`` gives a run (1 GB = 1e9 bytes,
    rounded down to a byte)."""
    return int(budget_gb * GB)


def target_class(path: str) -> str | None:
    """Why ``path`` (a ``_target_``, ``package.module.Class``) names no class (or
    function) that imports, in one line, or None when it does.  Hydra's own lookup
    logs three lines and suggests a flag that changes nothing; this one names the part
    that is missing (the module, or the class in it) or the error importing the module
    raised."""
    import importlib

    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        return "not a dotted path to a class (rule: _target_ is package.module.Class)"
    obj: Any = None
    found = 0  # how many leading parts import as modules
    for i in range(1, len(parts) + 1):
        name = ".".join(parts[:i])
        try:
            obj = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:
                break  # no such module: the rest are attributes of the last one
            return f"importing module '{name}' failed: {one_line(exc)}"
        except Exception as exc:  # noqa: BLE001 - the module's own import error, one line
            return f"importing module '{name}' failed: {one_line(exc)}"
        found = i
    if found == 0:
        return f"no module '{parts[0]}' can be imported (rule: _target_ is package.module.Class)"
    for j in range(found, len(parts)):
        if not hasattr(obj, parts[j]):
            return f"'{'.'.join(parts[:j])}' has no '{parts[j]}'"
        obj = getattr(obj, parts[j])
    if not callable(obj):
        return (
            f"'{path}' is a {type(obj).__name__}, not a class (rule: _target_ is a class, "
            "or a function that makes the object)"
        )
    return None


def policy_args(node: DictConfig | dict[str, Any], name: str) -> str:
    """What a run's policy config ``node`` (or its resolved dict) changes from the preset
    named like its policy (``conf/policy/<name>.yaml`` as it is now, ``name`` being the
    policy's name in results), as ``key=value`` overrides joined by spaces: ``""`` for
    the preset itself, ``prefetch_distance=3`` for a knob set on the command line or by
    an experiment, and every key for a policy without such a preset.  Results name a run
    by its policy's name alone, so two variants of one policy (a knob swept, a second
    YAML of the same class) differ here."""
    import json

    run = _policy_keys(
        node if isinstance(node, dict) else OmegaConf.to_container(node, resolve=True)
    )
    base = _policy_preset(name, _searchpath_folders())

    def shown(v: Any) -> str:
        return v if isinstance(v, str) else json.dumps(v, separators=(",", ":"))

    return " ".join(
        f"{k}={shown(v)}" for k, v in sorted(run.items()) if k not in base or base[k] != v
    )


def _searchpath_folders() -> tuple[Path, ...]:
    """The ``file://`` folders of the running Hydra job's ``hydra.searchpath`` (none
    outside a job, as in the compose API or when reading a store)."""
    try:
        from hydra.core.hydra_config import HydraConfig

        paths = list(HydraConfig.get().searchpath)
    except Exception:  # noqa: BLE001 - no Hydra job: conf/ alone
        return ()
    return tuple(
        Path(str(p)[len("file://") :]).expanduser() for p in paths if str(p).startswith("file://")
    )


@cache
def _policy_preset(name: str, folders: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The keys of the policy preset ``<name>.yaml`` as it is now, from ``conf/policy/``
    or else the first of ``folders``' ``policy/`` that has it (Hydra's search order);
    empty when there is none."""
    if not is_plain_name(name):
        return {}
    for folder in (CONF_DIR, *folders):
        preset = folder / "policy" / f"{name}.yaml"
        if preset.is_file():
            return _policy_keys(OmegaConf.to_container(OmegaConf.load(preset), resolve=True))
    return {}


def policy_from_preset(name: str) -> Any:
    """A fresh policy object from ``conf/policy/<name>.yaml`` (its ``defaults`` list
    left out), outside a Hydra run: for scripts, benchmarks and checks that build
    policies by preset name."""
    from hydra.utils import instantiate

    path = CONF_DIR / "policy" / f"{name}.yaml"
    if not is_plain_name(name) or not path.is_file():
        raise ConfigError("--policy", name, "names a preset of conf/policy/")
    raw = OmegaConf.load(path)
    assert isinstance(raw, DictConfig)
    raw.pop("defaults", None)
    return instantiate(raw)


def _policy_keys(container: Any) -> dict[str, Any]:
    """A policy config's keys and values (its ``defaults`` list left out)."""
    return {str(k): v for k, v in container.items() if str(k) != "defaults"}


def unknown_argument(node: DictConfig) -> str | None:
    """Why ``node``'s ``_target_`` class refuses its keys (Python's own words), or None.

    A class with no ``__init__`` anywhere in its bases takes no arguments; compiled
    (``make compiled``), it ignores them instead of refusing them, so that case is
    checked here, before the class is built.  Every other refusal (an unknown keyword of
    an ``__init__``, a class that cannot be imported) is instantiating's to report."""
    from hydra.utils import get_class

    keys = [str(k) for k in node if not str(k).startswith("_")]
    if not keys:
        return None
    try:
        cls = get_class(str(node.get("_target_")))
    except Exception:  # noqa: BLE001 - instantiate reports it in one line
        return None
    if not any("__init__" in vars(k) for k in cls.__mro__ if k is not object):
        return f"{cls.__name__}() takes no arguments"
    return None


def argument_type_error(node: DictConfig, prefix: str = "policy") -> ConfigError | None:
    """The first of ``node``'s keys whose value is not of the type its ``_target_``
    class's ``__init__`` annotates (``int``, ``float``, ``bool``, ``str``, or one of them
    or None; an argument without an annotation, the type of its default: true or false
    for a bool, a number for an int or a float, a string for a str), as a
    :class:`ConfigError` naming ``<prefix>.<key>``; None when all are, or the annotations
    cannot be read (instantiating reports what remains).  Without it a
    ``prefetch_distance=abc`` fails in ``int()`` naming no key, and ``semantic=maybe``
    (or ``no``) is taken as true."""
    import typing

    from hydra.utils import get_class

    try:
        cls: Any = get_class(str(node.get("_target_")))
        hints = typing.get_type_hints(cls.__init__) or _source_hints(cls)
    except Exception:  # noqa: BLE001 - no class, no source: instantiate reports it
        return None
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}
    hints = {**_default_hints(cls), **hints}
    for key in (str(k) for k in node if not str(k).startswith("_")):
        if key not in hints:
            continue
        kinds = typing.get_args(hints[key]) or (hints[key],)
        if not all(k in names or k is type(None) for k in kinds):
            continue  # a type this check does not know
        value = node.get(key)
        ok = any(
            (k is type(None) and value is None)
            or (k is bool and isinstance(value, bool))
            or (k is int and isinstance(value, int) and not isinstance(value, bool))
            or (k is float and isinstance(value, (int, float)) and not isinstance(value, bool))
            or (k is str and isinstance(value, str))
            for k in kinds
        )
        if not ok:
            rule = " or ".join("null" if k is type(None) else names[k] for k in kinds)
            return ConfigError(f"{prefix}.{key}", value, f"must be {rule}")
    return None


def _default_hints(cls: type) -> dict[str, Any]:
    """The types :func:`argument_type_error` reads off the defaults of ``cls.__init__``'s
    arguments that have no annotation: ``bool``, ``float`` for an int or a float (a
    knob written ``3`` may be meant to take ``0.5``), ``str``; none for other defaults."""
    import inspect

    try:
        params = inspect.signature(cls.__init__).parameters.values()  # type: ignore[misc]
    except (TypeError, ValueError):
        return {}
    out: dict[str, Any] = {}
    for p in params:
        if p.annotation is not inspect.Parameter.empty or p.default is inspect.Parameter.empty:
            continue
        kind = type(p.default)
        if kind in (bool, str):
            out[p.name] = kind
        elif kind in (int, float):
            out[p.name] = float
    return out


def module_source(name: str) -> Path:
    """The source file of module ``name``, found by its name in its top-level package's
    folder: a compiled module's ``__file__`` is its extension, the library of its group
    of modules, or None."""
    import sys

    parts = name.split(".")
    top = sys.modules[parts[0]]
    if not hasattr(top, "__path__"):  # a module of its own, not a package
        return Path(top.__file__ or "").with_suffix(".py")
    folder = Path(top.__path__[0])
    source = folder.joinpath(*parts[1:]).with_suffix(".py") if parts[1:] else folder
    return source if source.is_file() else folder.joinpath(*parts[1:], "__init__.py")


def _source_hints(cls: type) -> dict[str, Any]:
    """The annotations of ``cls.__init__``'s arguments read from its module's source
    (a compiled class's ``__init__`` keeps none), evaluated in the module's namespace;
    empty where the source or the method is not found."""
    import ast
    import sys

    module = sys.modules[cls.__module__]
    owner = next((c for c in cls.__mro__ if "__init__" in vars(c)), cls)
    if owner is not cls:
        return _source_hints(owner) if owner is not object else {}
    source = module_source(cls.__module__)
    if not source.is_file():
        return {}
    for c in ast.walk(ast.parse(source.read_text())):
        if isinstance(c, ast.ClassDef) and c.name == cls.__name__:
            for f in c.body:
                if isinstance(f, ast.FunctionDef) and f.name == "__init__":
                    args = [*f.args.args, *f.args.kwonlyargs]
                    return {
                        a.arg: eval(ast.unparse(a.annotation), vars(module))  # noqa: S307
                        for a in args
                        if a.annotation is not None
                    }
    return {}


def build_run(cfg: DictConfig) -> RunSpec:
    """Check every value of a composed config and instantiate the policy (no I/O)."""
    from hydra.utils import instantiate

    model: ModelSpec = OmegaConf.to_object(cfg.model)  # type: ignore[assignment]
    hardware: HardwareSpec = OmegaConf.to_object(cfg.hardware)  # type: ignore[assignment]
    model.validate()
    hardware.validate()
    per_layer = cfg.cache.get("experts_per_layer")
    if per_layer is not None:
        check_experts_per_layer(model, hardware, per_layer)
        budget_bytes = per_layer * sum(model.layer_expert_bytes)
    else:
        budget_gb = cfg.cache.budget_gb
        if not math.isfinite(budget_gb):
            raise ConfigError("cache.budget_gb", budget_gb, "must be a finite number")
        budget_bytes = budget_bytes_of(budget_gb)
        check_budget(model, budget_bytes, num_gpus=hardware.num_gpus)
    serving: ServingConfig = OmegaConf.to_object(cfg.serving)  # type: ignore[assignment]
    serving.validate()
    engine: EngineConfig = OmegaConf.to_object(cfg.engine)  # type: ignore[assignment]
    if serving.mode == "online" and not engine.timing:
        raise ConfigError("engine.timing", False, "hit-rate-only mode needs serving.mode=static")
    if engine.landing not in LANDINGS:
        raise ConfigError("engine.landing", engine.landing, f"must be one of {', '.join(LANDINGS)}")
    check_link_order(engine.link_order, engine.timing)
    check_reserve(engine.reserve, engine.timing)
    workload: WorkloadConfig = OmegaConf.to_object(cfg.workload)  # type: ignore[assignment]
    if workload.kind not in ("trace", "synthetic"):
        raise ConfigError("workload.kind", workload.kind, "must be 'trace' or 'synthetic'")
    if workload.kind == "trace" and not workload.path:
        raise ConfigError("workload.path", workload.path, "a trace directory is required")
    if workload.kind == "synthetic":
        workload.synthetic.validate()
        if workload.fitted_to and model.name not in workload.fitted_to:
            raise ConfigError(
                "workload.fitted_to",
                list(workload.fitted_to),
                f"the workload's knobs are fitted to these models, not to model "
                f"'{model.name}' (rule: model= one of them; workload.fitted_to=[] runs "
                "the knobs on another model)",
            )
    if "_target_" not in cfg.policy:
        raise ConfigError("policy", OmegaConf.to_container(cfg.policy), "needs a _target_ class")
    missing = target_class(str(cfg.policy.get("_target_")))
    if missing is not None:
        raise ConfigError("policy._target_", cfg.policy.get("_target_"), missing)
    unknown = unknown_argument(cfg.policy)
    if unknown is not None:
        raise ConfigError("policy", cfg.policy.get("_target_"), unknown)
    wrong = argument_type_error(cfg.policy)
    if wrong is not None:
        raise wrong
    try:
        policy = instantiate(cfg.policy)
    except Exception as exc:  # noqa: BLE001 - hydra wraps import/TypeError; report one line
        if isinstance(exc.__cause__, FmoesimError):  # the policy's own check of a value
            raise exc.__cause__ from None
        why = one_line(exc.__cause__) if exc.__cause__ is not None else ""
        knob = why.split(" ", 1)[0]
        if knob.isidentifier() and knob != "_target_" and knob in cfg.policy:
            # a constructor's check that names its knob ("prefetch_distance must be >= 1")
            raise ConfigError(f"policy.{knob}", cfg.policy[knob], why) from None
        raise ConfigError("policy", cfg.policy.get("_target_"), one_line(exc)) from None
    if not isinstance(policy, Policy):
        raise ConfigError("policy._target_", cfg.policy._target_, "is not a policies.base.Policy")
    output: OutputConfig = OmegaConf.to_object(cfg.output)  # type: ignore[assignment]
    check_output_name(output.name)
    if not 0 <= cfg.seed < 2**63:  # an int64 seed (numpy's generators take no negative one)
        raise ConfigError("seed", cfg.seed, "must be an integer in [0, 2**63)")
    return RunSpec(
        model,
        hardware,
        policy,
        budget_bytes,
        serving,
        engine,
        workload,
        output,
        int(cfg.seed),
        bool(cfg.progress),
        per_layer,
        bool(cfg.cache.get("release_after_use", False)),
        bool(cfg.cache.get("preload", False)),
    )


def check_output_name(name: str | None) -> None:
    """``output.name`` is one plain directory name: not empty, no ``/``, ``\\`` or
    ``..``, not starting with ``.`` (the results' temporaries and hidden files do), so a
    run writes only inside ``output.dir``."""
    if name is not None and not is_plain_name(name):
        raise ConfigError(
            "output.name",
            name,
            "must be one directory name inside output.dir (no '/', '\\' or '..', "
            "not empty, not starting with '.')",
        )


def simulate_spec(
    spec: RunSpec,
    trace: Any,
    *,
    policy: Policy | None = None,
    budget_bytes: int | None = None,
    **overrides: Any,
) -> Any:
    """:func:`fmoesim.engine.simulate.simulate` with a checked run's settings (serving,
    seed, engine, output, progress, per-layer caches); ``policy``, ``budget_bytes`` and
    keyword ``overrides`` (``timing``, ``make_backend``...) replace the spec's.  A trace
    that records its experts' sizes per layer gives them to a model preset without them
    (:func:`fmoesim.engine.simulate.model_for_trace`)."""
    from fmoesim.engine.simulate import model_for_trace

    model = model_for_trace(spec.model, trace)
    if budget_bytes is None and spec.experts_per_layer is not None:
        budget_bytes = spec.experts_per_layer * sum(model.layer_expert_bytes)
    kwargs: dict[str, Any] = {
        "serving": spec.serving,
        "seed": spec.seed,
        "timing": spec.engine.timing,
        "preempt": spec.engine.preempt,
        "landing": spec.engine.landing,
        "link_order": spec.engine.link_order,
        "reserve": spec.engine.reserve,
        "access_log": spec.output.access_log,
        "progress": spec.progress,
        "experts_per_layer": spec.experts_per_layer,
        "release_after_use": spec.release_after_use,
        "preload": spec.preload,
        **overrides,
    }
    return simulate(
        trace,
        model,
        spec.hardware,
        spec.policy if policy is None else policy,
        spec.budget_bytes if budget_bytes is None else budget_bytes,
        **kwargs,
    )


def synthetic_trace_path(model: ModelSpec, workload: WorkloadConfig) -> Path:
    """Cache location of the synthetic trace for ``model`` and the workload's knobs, and
    the contents of the arrival file they name, if any (so an edited file is another
    trace, not the old one again)."""
    import hashlib
    import json
    from dataclasses import asdict

    from fmoesim.workload.synthetic import arrivals_digest, synthetic_params

    synthetic = synthetic_params(workload.synthetic)
    parts: dict[str, Any] = {"model": asdict(model), "synthetic": synthetic}
    csv = arrivals_digest(workload.synthetic)
    if csv is not None:
        parts["arrivals_sha256"] = csv
    key = json.dumps(parts, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    from fmoesim.config.schema import PROJECT_ROOT

    return PROJECT_ROOT / "traces" / ".cache" / f"{model.name}-{digest}"


def config_to_dict(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain data (for the results row)."""
    return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
