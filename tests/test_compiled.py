"""The optional mypyc build (``make compiled``, :mod:`fmoesim._compiled`).

Two promises: a compiled build makes the same decisions and models the same times as
the sources it was built from (checked by building one in a temporary copy of the
package and comparing runs of every policy preset, to the last bit), and a compiled
module whose source changed since is refused at import (checked on fake builds).
"""

from __future__ import annotations

import importlib.machinery
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from fmoesim import _compiled
from fmoesim._compiled import MANIFEST, MODULES, StaleBuildError, check_fresh, clean

ROOT = Path(__file__).resolve().parent.parent
SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def copy_sources(dst: Path) -> None:
    """The sources of :data:`MODULES` under ``dst``, as in the repository."""
    for module in MODULES:
        (dst / module).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / module, dst / module)


def fake_build(root: Path) -> None:
    """What a build leaves behind, without compiling: an (empty) extension per module,
    mypyc's runtime library and the manifest of the sources' hashes."""
    hashes = {}
    for module in MODULES:
        (root / module).with_suffix(SUFFIX).write_bytes(b"")
        hashes[module] = _compiled._sha256(root / module)
    (root / f"fmoesim/native__mypyc{SUFFIX}").write_bytes(b"")
    (root / MANIFEST).write_text(json.dumps(hashes))


def test_a_pure_tree_passes_the_check(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    check_fresh(tmp_path)
    assert _compiled.compiled_modules(tmp_path) == []


def test_a_fresh_build_passes_and_an_edited_source_is_refused(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    fake_build(tmp_path)
    check_fresh(tmp_path)
    assert _compiled.compiled_modules(tmp_path) == list(MODULES)
    src = tmp_path / "policies/lru.py"
    src.write_text(src.read_text() + "\n# edited\n")
    with pytest.raises(StaleBuildError, match=r"policies/lru\.py: changed since it was compiled"):
        check_fresh(tmp_path)


def test_a_build_without_its_manifest_is_refused(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    fake_build(tmp_path)
    (tmp_path / MANIFEST).unlink()
    with pytest.raises(StaleBuildError, match=r"\.mypyc-manifest\.json: missing"):
        check_fresh(tmp_path)


def test_a_partial_build_is_refused(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    fake_build(tmp_path)
    (tmp_path / "fmoesim/engine/sim.py").with_suffix(SUFFIX).unlink()
    with pytest.raises(StaleBuildError, match=r"engine/sim\.py: not part of the compiled build"):
        check_fresh(tmp_path)


def test_clean_removes_every_built_file_and_nothing_else(tmp_path: Path) -> None:
    copy_sources(tmp_path)
    fake_build(tmp_path)
    removed = clean(tmp_path)
    assert len(removed) == len(MODULES) + 2  # the extensions, the runtime, the manifest
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*.*")) == sorted(
        MODULES
    )
    check_fresh(tmp_path)


def test_a_stale_build_stops_the_import_with_one_line(tmp_path: Path) -> None:
    """End to end: ``import fmoesim`` or ``import policies`` in a tree whose build is
    stale exits non-zero with the check's message, in one line (fake extensions: the
    check runs before any is loaded).  Red if the message comes at the end of an import
    traceback."""
    shutil.copytree(ROOT / "fmoesim", tmp_path / "fmoesim", ignore=_ignore_builds)
    shutil.copytree(ROOT / "policies", tmp_path / "policies", ignore=_ignore_builds)
    fake_build(tmp_path)
    (tmp_path / "fmoesim/engine/cache.py").write_text("# edited\n")
    for package in ("fmoesim", "policies"):
        out = subprocess.run(
            [sys.executable, "-c", f"import {package}"],
            cwd=tmp_path,
            env={**os.environ, "PYTHONPATH": str(tmp_path)},
            capture_output=True,
            text=True,
        )
        assert out.returncode == 2, package
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1, out.stderr  # not a traceback through fmoesim/__init__.py
        assert "engine/cache.py: changed since it was compiled; run `make compiled`" in lines[0]


def _ignore_builds(directory: str, names: list[str]) -> set[str]:
    return {n for n in names if n.endswith(".so") or n == "__pycache__"}


#: Runs every policy preset in several settings and prints one JSON line per run: the
#: summary without wall-clock fields and digests of the per-layer, per-request and
#: transfer tables (and of the access log in the static setting).  Run once against the
#: sources and once against the compiled copy.
RUNS = r"""
import hashlib, json, sys
from dataclasses import replace
from pathlib import Path
from hydra.utils import instantiate
from omegaconf import OmegaConf
from fmoesim._compiled import is_compiled
from fmoesim.config.build import load_preset
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from policies.lru import LRU

class Interpreted(LRU):
    '''A user's policy: an interpreted subclass of a compiled one.'''
    name = "user-lru"
    def victim(self, candidates, incoming):
        keys = [k for k in self._order if k in candidates]
        return keys[len(keys) // 2]

repo = Path(sys.argv[1])
trace = read_trace(repo / "traces" / "default")
model = load_preset("model", "mixtral-8x7b", ModelSpec)
hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
names = sorted(p.stem for p in (repo / "conf" / "policy").glob("*.yaml"))
def digest(table):
    h = hashlib.sha256()
    for col in sorted(table):
        h.update(col.encode()); h.update(repr(list(table[col])).encode())
    return h.hexdigest()
settings = [
    ("static", dict(serving=ServingConfig(max_requests=1), access_log=True), 1, 12e9),
    ("hit-only", dict(serving=ServingConfig(max_requests=1), timing=False), 1, 12e9),
    ("batch-3", dict(serving=ServingConfig(batch_size=3, max_requests=3)), 1, 12e9),
    ("online-2gpu", dict(serving=ServingConfig(mode="online", arrivals="poisson", rate_rps=2.0,
                                               max_requests=3)), 2, 6e9),
]
for label, kw, gpus, budget in settings:
    for name in names + ["user-lru"]:
        if name == "belady" and label == "online-2gpu":
            continue  # needs the future: static batching only
        policy = Interpreted() if name == "user-lru" else instantiate(
            OmegaConf.load(repo / "conf" / "policy" / f"{name}.yaml"))
        r = simulate(trace, model, replace(hw, num_gpus=gpus), policy, int(budget), **kw)
        s = {k: v for k, v in r.summary.items() if k not in ("wall_s", "speedup_vs_real")}
        s["layers"] = digest(r.metrics.layer_table())
        s["requests"] = digest(r.metrics.request_table())
        s["transfers"] = digest(r.transfer_table())
        s["accesses"] = None if r.accesses is None else digest(r.accesses)
        print(json.dumps({"run": f"{label}/{name}", "compiled": is_compiled(), "s": s},
                         sort_keys=True, default=repr))
"""


def _c_compiler() -> str | None:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc)


def _runs(code_root: Path) -> list[dict[str, object]]:
    out = subprocess.run(
        [sys.executable, "-c", RUNS, str(ROOT)],
        cwd=code_root,
        env={**os.environ, "PYTHONPATH": str(code_root)},
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, f"{code_root}: {out.stderr[-3000:]}"
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.skipif(_c_compiler() is None, reason="no C compiler: mypyc cannot build here")
def test_the_compiled_build_makes_the_same_runs_as_the_sources(tmp_path: Path) -> None:
    """Build the compiled modules in a copy of the package (about a minute) and compare
    every policy preset, and an interpreted subclass of a compiled policy, in four
    settings (static, hit-rate-only, batch 3, online on two GPUs) against the sources:
    summaries and the digests of every per-layer, per-request and transfer table must
    be identical."""
    for pkg in ("fmoesim", "policies", "conf"):
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=_ignore_builds)
    shutil.copy(ROOT / "pyproject.toml", tmp_path)  # mypy's settings, which mypyc reads
    built = subprocess.run(
        [sys.executable, "fmoesim/_compiled.py", "build"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tmp_path)},  # as the runs below import it
        capture_output=True,
        text=True,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    assert "note:" not in built.stderr  # this Python imports the copy: no "runs without"
    assert _compiled.compiled_modules(tmp_path) == list(MODULES)

    pure_root = tmp_path.parent / f"{tmp_path.name}-pure"
    for pkg in ("fmoesim", "policies", "conf"):
        shutil.copytree(ROOT / pkg, pure_root / pkg, ignore=_ignore_builds)
    pure, compiled = _runs(pure_root), _runs(tmp_path)
    assert all(not r["compiled"] for r in pure) and all(r["compiled"] for r in compiled)
    assert len(pure) == len(compiled) > 60
    for a, b in zip(pure, compiled, strict=True):
        assert a["run"] == b["run"]
        assert a["s"] == b["s"], a["run"]


def test_pure_removes_a_build_of_another_python(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    """Red if ``make pure`` (or a new build) run by one Python leaves the extensions
    another Python built (``lru.cpython-312-...so`` next to the sources, which
    that Python keeps importing), or if ``status`` calls such a tree plain pure Python
    without a word about them."""
    copy_sources(tmp_path)
    other = ".cpython-399-x86_64-linux-gnu.so"  # no interpreter here imports these
    for module in MODULES:
        (tmp_path / module).with_suffix(other).write_bytes(b"")
    (tmp_path / f"fmoesim/native__mypyc{other}").write_bytes(b"")
    assert _compiled.compiled_modules(tmp_path) == []  # not this Python's build
    assert len(_compiled.built_files(tmp_path)) == len(MODULES) + 1
    removed = clean(tmp_path)
    assert len(removed) == len(MODULES) + 1
    assert not list(tmp_path.rglob("*.so"))


def test_a_build_this_python_will_not_use_is_noted(tmp_path: Path) -> None:
    """Red if building in a tree that the running Python does not import fmoesim from
    (another clone, a non-editable install: a venv set up elsewhere) passes without a
    word, though that Python goes on running the sources."""
    assert _compiled.imported_from() == ROOT  # the tests import this tree
    assert _compiled.unused_build_note(ROOT) is None
    note = _compiled.unused_build_note(tmp_path)
    assert note is not None
    assert f"imports fmoesim from {ROOT}, not from {tmp_path}" in note
    assert f"pip install -e {tmp_path}" in note


#: a command that exits 0 when ``argv[1]`` holds compiled files and 3 when it does not
SEES_BUILD = (
    "import pathlib, sys; sys.exit(0 if list(pathlib.Path(sys.argv[1]).rglob('*"
    + SUFFIX
    + "')) else 3)"
)


def _run_here(monkeypatch: pytest.MonkeyPatch, root: Path, build=None) -> list[Path]:  # type: ignore[no-untyped-def]
    """Point :func:`_compiled.run_compiled` at ``root`` as if this Python imported it,
    with ``build`` (default: :func:`fake_build`) for mypyc; the roots it built."""
    built: list[Path] = []

    def fake(where: Path, log=None) -> None:  # type: ignore[no-untyped-def]
        built.append(where)
        (build or fake_build)(where)

    monkeypatch.setattr(_compiled, "build", fake)
    monkeypatch.setattr(_compiled, "unused_build_note", lambda r=None: None)
    return built


def test_a_run_on_a_pure_tree_builds_for_it_and_leaves_it_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red if ``run`` (``make reproduce``, ``make figures``) runs the command without
    building first (it exits 3 on a tree with no compiled files), leaves the build behind
    (later edits of a source would then be refused at import), or loses the command's
    exit status."""
    copy_sources(tmp_path)
    built = _run_here(monkeypatch, tmp_path)
    assert _compiled.run_compiled([sys.executable, "-c", SEES_BUILD, str(tmp_path)], tmp_path) == 0
    assert built == [tmp_path]
    assert _compiled.built_files(tmp_path) == [] and not (tmp_path / MANIFEST).exists()
    failing = [sys.executable, "-c", "import sys; sys.exit(7)"]
    assert _compiled.run_compiled(failing, tmp_path) == 7
    assert _compiled.built_files(tmp_path) == []


def test_an_interrupted_run_leaves_the_tree_pure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Red if Ctrl-C during the build or during the runs leaves the build (or the part
    of it made so far) behind: the next import would refuse it."""
    copy_sources(tmp_path)

    def interrupted_build(root: Path) -> None:
        (root / "policies/lru.py").with_suffix(SUFFIX).write_bytes(b"")  # half a build
        raise KeyboardInterrupt

    _run_here(monkeypatch, tmp_path, interrupted_build)
    with pytest.raises(KeyboardInterrupt):
        _compiled.run_compiled(["anything"], tmp_path)
    assert _compiled.built_files(tmp_path) == []

    _run_here(monkeypatch, tmp_path)

    def interrupted(*args, **kwargs):  # type: ignore[no-untyped-def]
        assert _compiled.built_files(tmp_path)  # the command starts on the build
        raise KeyboardInterrupt

    monkeypatch.setattr(_compiled.subprocess, "run", interrupted)
    with pytest.raises(KeyboardInterrupt):
        _compiled.run_compiled(["anything"], tmp_path)
    assert _compiled.built_files(tmp_path) == []


def test_a_failed_build_runs_the_command_on_the_sources_after_a_note(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Red if a machine without a C compiler (mypyc fails) gets no runs at all, a
    traceback, no word of the slower build, or the failed build's leftovers."""
    copy_sources(tmp_path)

    def no_compiler(root: Path) -> None:
        (root / "policies/lru.py").with_suffix(SUFFIX).write_bytes(b"")  # half a build
        raise subprocess.CalledProcessError(1, "gcc")

    _run_here(monkeypatch, tmp_path, no_compiler)
    assert _compiled.run_compiled([sys.executable, "-c", SEES_BUILD, str(tmp_path)], tmp_path) == 3
    err = capsys.readouterr().err
    assert f"note: the compiled build failed (its messages: {tmp_path / 'build/mypyc.log'})" in err
    assert "the runs take the sources" in err
    assert _compiled.built_files(tmp_path) == []


def test_a_compiled_tree_is_used_and_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Red if ``run`` rebuilds a tree the user compiled (a minute for nothing) or removes
    that build after the runs."""
    copy_sources(tmp_path)
    fake_build(tmp_path)
    built = _run_here(monkeypatch, tmp_path)
    assert _compiled.run_compiled([sys.executable, "-c", SEES_BUILD, str(tmp_path)], tmp_path) == 0
    assert built == []
    assert _compiled.compiled_modules(tmp_path) == list(MODULES)
    assert (tmp_path / MANIFEST).exists()


def test_run_in_a_tree_this_python_does_not_import_builds_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Red if ``run`` compiles a tree whose build the command's Python would not import
    (a minute for nothing, and a build left for another environment) or says nothing."""
    copy_sources(tmp_path)
    assert _compiled.run_compiled([sys.executable, "-c", SEES_BUILD, str(tmp_path)], tmp_path) == 3
    assert f"not from {tmp_path}" in capsys.readouterr().err
    assert _compiled.built_files(tmp_path) == []
