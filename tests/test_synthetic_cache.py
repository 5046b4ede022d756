"""The cache of synthetic traces (``traces/.cache/``) and the results store follow
everything a synthetic trace is made from: the model, the workload's knobs, the bytes of
the arrival file it reads, and the generator's code."""

from __future__ import annotations

from pathlib import Path

import pytest

from fmoesim.cli.main import _trace_path, compose_config, run_config
from fmoesim.config.build import build_run
from fmoesim.trace.reader import read_trace

# a small model (16 layers x 64 experts) and a short trace: two requests
SMALL = ["model=olmoe-1b-7b", "workload=synthetic", "progress=false"]


def _azure(path: Path, lengths: list[tuple[int, int]]) -> Path:
    """An Azure-format arrival file: one request a second with ``lengths`` (prompt,
    output) each."""
    rows = [f"{i},{p},{o}" for i, (p, o) in enumerate(lengths)]
    path.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n" + "\n".join(rows) + "\n")
    return path


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    """``PROJECT_ROOT`` (where ``traces/.cache`` lives) moved into ``tmp_path``; the code
    version cached meanwhile (over the moved root) is forgotten afterwards, so later
    tests hash the real sources."""
    import fmoesim.config.schema as schema
    from fmoesim.results.store import code_version

    code_version.cache_clear()
    monkeypatch.setattr(schema, "PROJECT_ROOT", tmp_path)
    yield tmp_path
    monkeypatch.undo()
    code_version.cache_clear()


def _spec(csv: Path, *extra: str):
    return build_run(
        compose_config(
            [*SMALL, f"workload.synthetic.arrivals_csv={csv}", "workload.synthetic.num_requests=2",
             *extra]
        )
    )  # fmt: skip


def test_an_edited_arrival_file_makes_another_trace(cache_root, tmp_path):
    """Red if the cache keys a synthetic trace on the arrival file's path alone: the
    trace made from the file's first contents came back after the file changed, with
    the old prompt and output lengths."""
    csv = _azure(tmp_path / "a.csv", [(5, 3), (7, 2)])
    first = _trace_path(_spec(csv))
    tr = read_trace(first)
    assert tr.prompt_tokens.tolist() == [5, 7] and tr.output_tokens.tolist() == [3, 2]
    _azure(csv, [(9, 4), (6, 5)])
    second = _trace_path(_spec(csv))
    assert second != first and second.parent == first.parent == cache_root / "traces" / ".cache"
    tr = read_trace(second)
    assert tr.prompt_tokens.tolist() == [9, 6] and tr.output_tokens.tolist() == [4, 5]


def test_a_trace_cached_by_other_generator_code_is_made_again(cache_root, capsys):
    """Red if a cached trace is read whatever code made it: after an update of the
    generator (another ``source["code"]`` in its manifest, or none, as before the field
    existed) the old trace would be served as if the current generator had made it."""
    import json

    from fmoesim.workload.synthetic import GENERATOR_CODE

    spec = build_run(compose_config([*SMALL, "workload.synthetic.num_requests=2"]))
    path = _trace_path(spec)
    assert read_trace(path).manifest.source["code"] == GENERATOR_CODE
    assert "generating synthetic trace" in capsys.readouterr().err
    assert _trace_path(spec) == path  # the same code: read from the cache
    assert "generating" not in capsys.readouterr().err
    manifest = path / "trace.json"
    for other in ("0123456789abcdef", None):  # made by other code; made before the field
        raw = json.loads(manifest.read_text())
        if other is None:
            del raw["source"]["code"]
        else:
            raw["source"]["code"] = other
        manifest.write_text(json.dumps(raw))
        assert _trace_path(spec) == path
        assert "generating synthetic trace" in capsys.readouterr().err
        assert read_trace(path).manifest.source["code"] == GENERATOR_CODE


def test_the_manifest_names_the_code_that_ran_not_the_files_on_disk(tmp_path, monkeypatch):
    """Red if the code digest is read from the files when a trace is written: a process
    that loaded the generator before an edit would label its trace with the edited
    code, and a process running the edit would then reuse it."""
    import fmoesim.workload.synthetic as synthetic
    from fmoesim.config.build import load_preset
    from fmoesim.specs.model import ModelSpec

    monkeypatch.setattr(synthetic, "GENERATOR_CODE", "loaded-before-edit")
    model = load_preset("model", "olmoe-1b-7b", ModelSpec)
    path = synthetic.generate(model, synthetic.SyntheticConfig(num_requests=1), tmp_path / "t")
    assert read_trace(path).manifest.source["code"] == "loaded-before-edit"


def test_sweep_workers_make_a_missing_trace_once(cache_root, tmp_path):
    """Red if the workers of a parallel sweep each make the same missing trace at once
    (each replaced the folder the others were reading or writing): with the lock, one
    makes it and the others find it made."""
    import subprocess
    import sys

    overrides = [*SMALL, "workload.synthetic.num_requests=3"]
    script = (
        "import sys; from pathlib import Path; import fmoesim.config.schema as s; "
        f"s.PROJECT_ROOT = Path({str(cache_root)!r}); "
        "from fmoesim.cli.main import _trace_path, compose_config; "
        "from fmoesim.config.build import build_run; "
        f"print(_trace_path(build_run(compose_config({overrides!r}))))"
    )
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]  # fmt: skip
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), [e for _, e in outs]
    assert sum("generating synthetic trace" in e for _, e in outs) == 1, [e for _, e in outs]
    assert len({o.strip() for o, _ in outs}) == 1
    read_trace(outs[0][0].strip())  # whole


def test_generator_digest_follows_the_code(monkeypatch, tmp_path):
    """Red if the digest misses one of the generator's modules (an edit of the trace
    writer would then leave stale traces in the cache) or numpy's version (its random
    streams)."""
    import fmoesim.workload.synthetic as synthetic

    before = synthetic.generator_digest()
    pkg = tmp_path / "fmoesim"
    for rel in synthetic.GENERATOR_SOURCES:
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_bytes((Path(synthetic.__file__).parents[1] / rel).read_bytes())
    monkeypatch.setattr(synthetic, "__file__", str(pkg / "workload" / "synthetic.py"))
    assert synthetic.generator_digest() == before
    monkeypatch.setattr(synthetic.np, "__version__", "0.0.1")
    assert synthetic.generator_digest() != before
    monkeypatch.undo()
    monkeypatch.setattr(synthetic, "__file__", str(pkg / "workload" / "synthetic.py"))
    writer = pkg / "trace" / "writer.py"
    writer.write_text(writer.read_text() + "\n# an edit\n")
    assert synthetic.generator_digest() != before


def test_the_store_reruns_a_run_whose_arrival_file_changed(cache_root, tmp_path):
    """Red if a run's store hash leaves out the workload's arrival file: a sweep (or
    ``store.skip_done=true``) would answer "done already" with the results of the
    file's old contents."""
    csv = _azure(tmp_path / "a.csv", [(5, 3), (7, 2)])
    common = [
        *SMALL, f"workload.synthetic.arrivals_csv={csv}", "workload.synthetic.num_requests=2",
        "engine.timing=false", "output.write=false", f"store.dir={tmp_path}/store",
        "store.skip_done=true", "cache.budget_gb=0.5",
    ]  # fmt: skip
    first = run_config(compose_config(common))
    assert not first.get("done_already")
    assert run_config(compose_config(common))["done_already"]  # unchanged: skipped
    _azure(csv, [(9, 4), (6, 5)])
    again = run_config(compose_config(common))
    assert not again.get("done_already") and again["config_hash"] != first["config_hash"]
    assert len(list((tmp_path / "store").glob("*.parquet"))) == 2
