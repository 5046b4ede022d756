"""The documentation works as written.

- README.md: every command of its ```bash blocks runs, in order, and every ```python
  block runs (except :data:`README_NOT_RUN`, each with its reason, and ``make run``,
  replaced by what it runs: :data:`README_INSTEAD`).
- docs/*.md: the commands of :data:`DOCS_RUN` run, in page order, with the page's
  ```python blocks; every other ``fmoesim`` command (and the overrides of
  ``fmoesim-min-budget`` / ``fmoesim-validate``) is composed and checked
  (``compose_config`` + ``build_run``: no simulation), every point of a sweep; every
  remaining command must match :data:`NOT_RUN`, which says why it is not run.  A command
  in none of these lists fails the test: classify it here when you add it to a page.
- Every relative link of README.md and docs/*.md points to a file of the repository (and
  an anchor into a Markdown page to one of its headings); no page mentions ``../shared``,
  work items ("issue"), sessions or "this machine".
- README.md has at most 250 lines.

Commands run in a temporary copy of the repository (the files ``git ls-files`` lists,
tracked or not ignored), with this interpreter's bin directory first on PATH, the copy on
PYTHONPATH (so the commands run the copy's code) and ``.venv`` in the copy linked to this
interpreter's environment.  A command whose comment says ``exits N`` must exit with N.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
MAX_README_LINES = 250
TIMEOUT_S = 300

#: README.md commands replaced by what they run, with the reason
README_INSTEAD = {
    "make run": ("fmoesim", "make run sets up .venv (the test runs in one), then runs fmoesim"),
}
#: README.md commands not run, with the reason
README_NOT_RUN = {
    "make test": "the test suite itself",
    "pip install -e '.[plot]'": "installs packages; the test environment (make test) has the plot "
    "extra already",
}

#: docs/ commands that run, per page, in page order (exactly as written, comment aside)
DOCS_RUN = {
    "install.md": [".venv/bin/python fmoesim/_compiled.py status"],
    "usage.md": [
        "fmoesim --cfg job",
        "fmoesim serving.mode=online serving.arrivals=csv"
        " serving.arrivals_csv=examples/arrivals.csv serving.max_batch_size=4",
        "fmoesim-trace arrivals examples/arrivals.csv",
        "fmoesim output.access_log=true output.name=lru-with-accesses",
        "fmoesim cache.budget_gb=-1",
        "fmoesim-min-budget --target-tpot-ms 300,400 policy=lfu serving.max_requests=4",
    ],
    "traces.md": [
        "fmoesim-trace validate traces/default",
        "fmoesim-trace inspect traces/default",
        "fmoesim-trace synth --model qwen1.5-moe-a2.7b --requests 16 --seed 1 out/qwen-synth",
        "fmoesim-trace synth --model mixtral-8x7b --requests 8 --set skew=2.0 --set locality=0.8"
        " out/skewed",
        "fmoesim-trace synth --model mixtral-8x7b --requests 32 --arrivals examples/arrivals.csv"
        " out/azure",
        "fmoesim workload.path=out/azure serving.mode=online serving.arrivals=trace"
        " serving.max_batch_size=4",
        "fmoesim-trace import vllm-routes examples/vllm-routes.jsonl out/routes"
        " --model mixtral-8x7b",
        "fmoesim-trace import vllm-routes examples/vllm-routes.jsonl out/routes-p4"
        " --model mixtral-8x7b --prompt-tokens 4",
        "fmoesim workload.path=out/routes-p4 policy=lfu engine.timing=false",
        "fmoesim-trace import table examples/route-table.csv out/table --model mixtral-8x7b",
        "fmoesim workload.path=out/table engine.timing=false",
        'python -c "import numpy as np; from fmoesim.config.build import load_preset;'
        " from fmoesim.specs import ModelSpec; from fmoesim.trace import from_arrays;"
        " m = load_preset('model', 'mixtral-8x7b', ModelSpec); rng = np.random.default_rng(0);"
        " ids = np.argsort(rng.random((2, 20, 32, 8)), axis=3)[..., :2];"
        " from_arrays(list(ids), 'out/arrays', m, prompt_tokens=4, overwrite=True)\"",
        "fmoesim workload.path=out/arrays engine.timing=false",
        'mkdir -p out && python -c "import numpy as np; rng = np.random.default_rng(0);'
        " ids = np.argsort(rng.random((3, 32, 5, 8)), axis=3)[..., :2]; np.save('out/eamc.npy',"
        ' (np.arange(8) == ids[..., None]).sum(axis=(2, 3)))"',
        "fmoesim-trace import eamc out/eamc.npy out/eamc --model mixtral-8x7b",
        'mkdir -p out && printf \'{"prompt": "What is 12 times 7?"}\\n{"prompt": "Name three'
        " prime numbers.\"}\\n' > out/prompts.jsonl",
        'python -c "import torch, transformers as T; torch.manual_seed(0);'
        " T.MixtralForCausalLM(T.MixtralConfig(vocab_size=128, hidden_size=64,"
        " intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,"
        " num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2))"
        ".save_pretrained('out/tiny-mixtral')\"",
        'printf \'{"input_ids": [1, 5, 9, 2]}\\n{"input_ids": [3, 7]}\\n\''
        " > out/tiny-prompts.jsonl",
        "fmoesim-collect out/tiny-mixtral out/tiny-prompts.jsonl out/tiny-trace --max-new-tokens 8",
        "fmoesim workload.path=out/tiny-trace model.name=tiny-mixtral model.num_layers=4"
        " cache.budget_gb=2.8 engine.timing=false",
    ],
    "experiments.md": [
        "fmoesim -v -m policy=lru,belady engine.timing=false serving.max_requests=8",
        "fmoesim -m policy=lru,lfu cache.budget_gb=6,12 engine.timing=false hydra/launcher=joblib"
        " hydra.launcher.n_jobs=2",
        "fmoesim-plot --list",
        "fmoesim-plot crossover --models olmoe-1b-7b --policies fmoe --compute 1,32 --bandwidth 1"
        " --requests 1 --jobs 1 --out out/figures",
        "jupyter execute notebooks/trace_analysis.ipynb",
        "fmoesim-regress --policies lru,lfu",
    ],
    "reproduction.md": ["fmoesim-reproduce --list | grep -i promoe"],
    "validation.md": ["fmoesim-validate-grid render results/validation/h100-3-cross-check-link"],
    "development.md": [
        "mkdir -p out && .venv/bin/python -m cProfile -o out/lfu.prof -m benchmarks.engine"
        " --policies lfu --repeat 1 --skip-scaling",
        ".venv/bin/python -c \"import pstats; pstats.Stats('out/lfu.prof').sort_stats('tottime')"
        '.print_stats(20)"',
    ],
    "performance.md": [
        "python -m benchmarks.engine --policies lru --repeat 1 --skip-scaling",
        ".venv/bin/python fmoesim/_compiled.py status",
    ],
}

#: docs/ commands not run (regex on the command), with the reason; ``fmoesim`` commands
#: need no entry: they are composed and checked instead
NOT_RUN = [
    (r"^make run$", "sets up .venv and runs fmoesim: README.md's check runs it"),
    (r"^make test\b", "the whole test suite, this test included"),
    (r"^make (lint|bench|figures|compiled|pure|clean)\b", "minutes, or changes the checkout"),
    (r"^python3 -m venv ", "creates an environment; the test runs in one"),
    (r"\bpip install ", "installs packages; the test environment (make test) has them"),
    (r"^\. \.venv/bin/activate$", "the test puts the environment's bin first on PATH itself"),
    (
        r"^fmoesim-collect Qwen/",
        "needs a Hugging Face model's weights (tens of GB) and the collect extra",
    ),
    (r"^fmoesim-profile --device cuda ", "needs a CUDA GPU"),
    (
        r"^fmoesim-trace arrivals AzureLLMInferenceTrace_conv\.csv ",
        "needs Azure's trace, which the repository does not ship; tests/test_arrival_logs.py "
        "runs --sample on examples/arrivals.csv",
    ),
    (
        r"^python -m fmoesim\.validation\.engine_log LOG\.csv ",
        "needs an engine's route log and metrics; tests/test_layer_sizes.py runs both "
        "comparisons on a hand-built log and on the BigMoeOnEdge one",
    ),
    (r"^fmoesim-validate --device cuda ", "needs a CUDA GPU and a profile measured on it"),
    (r"^bash replay/gpu_validation\.sh ", "needs a CUDA GPU (and nine minutes of it)"),
    (
        r"^fmoesim-validate-grid (score|host-fit|cross-check|events) ",
        "up to two minutes of simulation, or a GPU's replays; tests/test_campaign.py scores "
        "a CPU replay end to end and cross-checks synthetic runs by hand, and "
        "tests/test_events.py compares a CPU replay's event logs end to end",
    ),
    (
        r"^fmoesim-validate --device cpu ",
        "about 40 s of CPU replay; tests/test_validate.py "
        "covers the CPU path (its overrides are composed here)",
    ),
    (
        r"^fmoesim-plot moe-infinity-tab5 --run\b",
        "a minute of timed runs; README.md's check runs the same path (moe-infinity-tab2-3)",
    ),
    (
        r"^fmoesim-regress$",
        "recomputes every golden hit rate; tests/test_regress.py runs it, "
        "and the run list above runs it for two policies",
    ),
    (r"^\.venv/bin/python -m pytest ", "runs part of the test suite, possibly this test"),
    (
        r"^(valgrind|callgrind_annotate) ",
        "profiling: minutes, and valgrind is not installed by make",
    ),
    (r"^python -m benchmarks\.", "benchmarks take minutes; performance.md's quick one runs"),
]
#: commands not even composed (regex), with the reason
NOT_COMPOSED = [
    (r"hardware=measured/my-gpu", "the preset is written by fmoesim-profile on a GPU"),
]

#: what no page may say (case-insensitive): development history belongs in git log
FORBIDDEN = re.compile(r"\.\./shared|\bissue|\bsession|\bthis machine\b", re.IGNORECASE)
#: words the pattern above would catch that are fine
ALLOWED_WORDS: set[str] = set()

COMPOSED_PROGS = ("fmoesim", "fmoesim-min-budget", "fmoesim-validate")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


# -- extraction ------------------------------------------------------------------------


def blocks(text: str) -> list[tuple[str, str]]:
    """The fenced code blocks of a Markdown text, as ``(language, body)``, in order
    (a fence may be indented, e.g. inside a list)."""
    out, lang, body, indent = [], None, [], ""
    for line in text.splitlines():
        m = re.match(r"^(\s*)```(\S*)\s*$", line)
        if lang is None and m:
            indent, lang, body = m.group(1), m.group(2), []
        elif lang is not None and re.match(r"^\s*```\s*$", line):
            out.append((lang, "\n".join(body)))
            lang = None
        elif lang is not None:
            body.append(line[len(indent) :] if line.startswith(indent) else line)
    return out


def strip_comment(cmd: str) -> str:
    """``cmd`` without a trailing ``# comment`` (a ``#`` outside quotes, after a space)."""
    quote = None
    for i, ch in enumerate(cmd):
        if quote:
            if ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or cmd[i - 1].isspace()):
            return cmd[:i].rstrip()
    return cmd.rstrip()


def commands(body: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank lines and
    comment lines skipped."""
    out, cur = [], ""
    for line in body.splitlines():
        if line.rstrip().endswith("\\"):
            cur += line.rstrip()[:-1].rstrip() + " "
            continue
        cur += line
        if cur.strip() and not cur.lstrip().startswith("#"):
            out.append(cur.strip())
        cur = ""
    return out


def expected_status(cmd: str) -> int:
    """The exit status a command's comment announces (``# exits 2``), else 0."""
    m = re.search(r"#.*\bexits (\d+)\b", cmd)
    return int(m.group(1)) if m else 0


def items(page: Path) -> list[tuple[str, str]]:
    """A page's runnable items in order: ``("bash", command)`` and ``("python", code)``."""
    out: list[tuple[str, str]] = []
    for lang, body in blocks(page.read_text()):
        if lang == "bash":
            out += [("bash", c) for c in commands(body)]
        elif lang == "python":
            out.append(("python", body))
    return out


# -- running ---------------------------------------------------------------------------


def repo_files() -> list[str]:
    """The repository's files: tracked, or untracked and not ignored."""
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=ROOT, capture_output=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout (git ls-files) to copy the repository")
    return [f for f in out.decode().split("\0") if f and (ROOT / f).is_file()]


@pytest.fixture(scope="module")
def files() -> list[str]:
    return repo_files()


def make_copy(dest: Path, files: list[str]) -> Path:
    for f in files:
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, dest / f)
    (dest / ".venv").symlink_to(Path(sys.prefix), target_is_directory=True)
    return dest


def environment(copy: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(copy)
    env["MPLBACKEND"] = "Agg"
    for k in ("FMOESIM_CONF_DIR", "HYDRA_FULL_ERROR", "FMOESIM_NOTEBOOK_STORE"):
        env.pop(k, None)
    return env


def run(kind: str, code: str, copy: Path, where: str) -> None:
    """Run a bash command or a Python block in ``copy``; fail with its output unless it
    exits as announced."""
    if kind == "python":
        script = copy / "out" / ".docs-block.py"
        script.parent.mkdir(exist_ok=True)
        script.write_text(code)
        argv, want = [str(BIN / "python"), str(script)], 0
    else:
        argv, want = ["bash", "-c", code], expected_status(code)
    try:
        p = subprocess.run(
            argv, cwd=copy, env=environment(copy), capture_output=True, text=True,
            timeout=TIMEOUT_S,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where}: timed out after {TIMEOUT_S} s:\n{code}")
    if p.returncode != want:
        tail = (p.stdout[-1500:] + "\n--- stderr ---\n" + p.stderr[-2500:]).strip()
        pytest.fail(f"{where}: exit status {p.returncode} (expected {want}):\n{code}\n\n{tail}")


# -- composing -------------------------------------------------------------------------


def overrides_of(cmd: str) -> list[str]:
    """The config overrides of a ``fmoesim``-style command: its ``key=value`` words
    (flags and their values left out)."""
    import shlex

    words = shlex.split(strip_comment(cmd))[1:]
    return [w for w in words if "=" in w and not w.startswith("-")]


def sweep_points(overrides: list[str]) -> list[list[str]]:
    """Every job of the sweep over ``overrides``, as ``fmoesim`` expands it
    (:func:`fmoesim.cli.main.sweep_points`), with Hydra's own keys (launchers,
    ``hydra.*``) left out."""
    from fmoesim.cli.main import sweep_points as expand

    kept = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    return expand(kept, {})


def compose_check(cmd: str) -> None:
    """Compose and check every point of ``cmd``'s config, as ``fmoesim`` does before it
    runs (no trace is read, nothing is simulated)."""
    from fmoesim.cli.main import compose_config
    from fmoesim.config.build import build_run
    from fmoesim.errors import FmoesimError

    want = expected_status(cmd)
    for point in sweep_points(overrides_of(cmd)):
        try:
            build_run(compose_config(point))
        except FmoesimError as exc:
            if want == 2:
                return
            pytest.fail(f"{cmd}\n  point {point}: {exc}")
    if want == 2:
        pytest.fail(f"{cmd}\n  announced exit status 2, but its config composes and checks")


def reason(cmd: str, table: list[tuple[str, str]]) -> str | None:
    bare = strip_comment(cmd)
    return next((why for pat, why in table if re.search(pat, bare)), None)


# -- the checks ------------------------------------------------------------------------


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; at most {MAX_README_LINES}"


def test_readme_runs(tmp_path: Path, files: list[str]) -> None:
    """Every command and Python block of README.md, in order, in a fresh copy."""
    copy = make_copy(tmp_path / "repo", files)
    seen = set()
    for kind, code in items(README):
        bare = strip_comment(code) if kind == "bash" else code
        if kind == "bash" and bare in README_NOT_RUN:
            seen.add(bare)
            continue
        if kind == "bash" and bare in README_INSTEAD:
            seen.add(bare)
            code = README_INSTEAD[bare][0]
        run(kind, code, copy, "README.md")
    stale = (set(README_NOT_RUN) | set(README_INSTEAD)) - seen
    assert not stale, f"README.md no longer has these listed commands: {sorted(stale)}"


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_commands(page: str, tmp_path: Path, files: list[str]) -> None:
    """A page's listed commands run (in page order, with its Python blocks); its other
    fmoesim commands compose; every other command has a reason not to run."""
    path = DOCS / page
    to_run = [" ".join(c.split()) for c in DOCS_RUN.get(page, [])]
    page_items = items(path)
    bash = [" ".join(strip_comment(c).split()) for k, c in page_items if k == "bash"]
    missing = [c for c in to_run if c not in bash]
    assert not missing, f"docs/{page} no longer has these commands of DOCS_RUN: {missing}"
    copy = None
    unclassified = []
    for kind, code in page_items:
        bare = " ".join(strip_comment(code).split()) if kind == "bash" else ""
        if kind == "python" or bare in to_run:
            if copy is None:
                copy = make_copy(tmp_path / "repo", files)
            run(kind, code, copy, f"docs/{page}")
            continue
        if reason(code, NOT_COMPOSED):
            continue
        prog = bare.split()[0]
        if prog in COMPOSED_PROGS:
            if prog != "fmoesim" and not reason(code, NOT_RUN):
                unclassified.append(bare)
            compose_check(code)
        elif not reason(code, NOT_RUN):
            unclassified.append(bare)
    assert not unclassified, (
        f"docs/{page}: commands neither run (DOCS_RUN) nor listed with a reason (NOT_RUN) in "
        f"tests/test_docs.py: {unclassified}"
    )


def test_exclusion_lists_are_current() -> None:
    """Every NOT_RUN / NOT_COMPOSED pattern still matches a command of the docs."""
    cmds = [strip_comment(c) for p in pages() for k, c in items(p) if k == "bash"]
    stale = [pat for pat, _ in NOT_RUN + NOT_COMPOSED if not any(re.search(pat, c) for c in cmds)]
    assert not stale, f"patterns in tests/test_docs.py that match no command any more: {stale}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    s = re.sub(r"[`*]", "", heading.strip().lower())
    s = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", s)
    s = "".join(ch for ch in s if ch.isalnum() or ch in " -_")
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    out: set[str] = set()
    for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.MULTILINE):
        slug = _slug(h)
        n = 0
        while (slug if n == 0 else f"{slug}-{n}") in out:
            n += 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages()])
def test_links_resolve(page: str, files: list[str]) -> None:
    """Every relative link points to a file of the repository, an anchor to a heading."""
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL)
    known = set(files)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        try:
            rel = dest.relative_to(ROOT).as_posix()
        except ValueError:
            broken.append(f"{target} (outside the repository)")
            continue
        if dest.is_dir():
            if not any(f.startswith(rel + "/") for f in known):
                broken.append(f"{target} (no file of the repository there)")
        elif rel not in known:
            broken.append(f"{target} (not a file of the repository)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading '#{anchor}' in {rel})")
    assert not broken, f"{page}: broken links: {broken}"


@pytest.mark.parametrize("page", [p.relative_to(ROOT).as_posix() for p in pages()])
def test_pages_stay_on_topic(page: str) -> None:
    """No development history: no ../shared, work items, sessions or 'this machine'."""
    hits = []
    for n, line in enumerate((ROOT / page).read_text().splitlines(), start=1):
        for m in FORBIDDEN.finditer(line):
            word = re.match(r"[\w./]+", line[m.start() :]).group(0)  # type: ignore[union-attr]
            if word.lower() not in ALLOWED_WORDS:
                hits.append(f"line {n}: {line.strip()}")
    assert not hits, f"{page} mentions what belongs in git log:\n" + "\n".join(hits)


def test_readme_shows_what_make_run_prints(tmp_path: Path) -> None:
    """The output README.md shows for ``make run`` is what ``fmoesim`` prints: every line
    of that block but the elided ``...`` and the run's own paths appears verbatim.  Red
    when the summary's format or the default run's numbers change without the README."""
    text = README.read_text()
    shown = text[text.index("and prints:\n\n```\n") + len("and prints:\n\n```\n") :]
    shown = shown[: shown.index("```")]
    lines = [
        ln
        for ln in shown.splitlines()
        if ln.strip() and ln != "..." and not ln.startswith(("results ", "stored "))
    ]
    assert len(lines) >= 8
    p = subprocess.run(
        [str(BIN / "fmoesim"), f"output.dir={tmp_path / 'runs'}", f"store.dir={tmp_path / 's'}"],
        cwd=README.parent, capture_output=True, text=True, timeout=TIMEOUT_S,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    printed = set(p.stdout.splitlines())
    missing = [ln for ln in lines if ln not in printed]
    assert not missing, f"README.md shows lines fmoesim does not print: {missing}"
