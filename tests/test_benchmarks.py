"""The benchmark scripts' command lines: bad flags refused in one line before any run,
and the digest check that guards a speed change (``benchmarks/fmoe_digests.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fmoesim.config.schema import PROJECT_ROOT


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["benchmarks.engine", "--repeat", "0"], "argument --repeat: 0 must be >= 1 (see --help)"),
        (["benchmarks.engine", "--policies", "lru,"], "--policies 'lru,': an empty item"),
        (["benchmarks.fmoe", "--part", "speed", "--policy", "nope"],
         "--policy nope: unknown policy; valid: adapmoe, "),
        (["benchmarks.fmoe_digests", "--check", "no/such.json"],
         "--check no/such.json: cannot be read"),
        (["benchmarks.eamc", "--repeat", "x"], "argument --repeat: 'x' is not an integer"),
    ],
)  # fmt: skip
def test_a_bad_flag_is_one_line_before_any_run(argv: list[str], message: str) -> None:
    """Red if ``--repeat 0`` times nothing and ends in a traceback (``min()`` of an empty
    list), or an unknown preset or an unreadable reference fails with a traceback, after
    minutes of runs for the digests."""
    p = subprocess.run(
        [sys.executable, "-m", *argv], capture_output=True, text=True, cwd=PROJECT_ROOT
    )
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert lines[0].startswith(f"python -m {argv[0]}: error: {message}"), lines[0]


def test_the_digest_check_names_what_differs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A reference written into a folder that does not exist yet, then checked against
    runs whose transfers changed in one setting and which lost another.  Red if the
    write fails after the runs (no such folder), if a changed setting is reported without
    the digest that changed, if a setting of the reference that no longer runs, or one
    the reference lacks, passes as identical, or if a file written for another policy
    is compared at all."""
    import benchmarks.fmoe_digests as D

    digests: dict[str, dict[str, str]] = {
        "a": {"summary": "1", "transfers": "2", "accesses": "3", "policy_log": "4"},
        "b": {"summary": "5", "transfers": "6", "accesses": "7", "policy_log": "8"},
        "c": {"summary": "9", "transfers": "0", "accesses": "1", "policy_log": "2"},
    }

    def fake_runs(workdir: Path, policy: str) -> Any:
        for name, d in digests.items():
            yield name, dict(d), 0.5

    monkeypatch.setattr(D, "runs", fake_runs)
    ref = tmp_path / "new" / "lru.json"
    monkeypatch.setattr(sys, "argv", ["x", "--policy", "lru", "--write", str(ref)])
    with pytest.raises(SystemExit) as exc:
        D.main()
    assert exc.value.code == 0
    assert json.loads(ref.read_text()) == {"policy": "lru", "settings": digests}

    digests["b"]["transfers"] = "changed"
    del digests["c"]
    digests["d"] = dict(digests["a"])  # a setting the reference lacks: not checked
    capsys.readouterr()
    monkeypatch.setattr(sys, "argv", ["x", "--policy", "lru", "--check", str(ref)])
    with pytest.raises(SystemExit) as exc:
        D.main()
    out = capsys.readouterr().out
    assert exc.value.code == 1
    assert "DIFFERENT: transfers\n" in out and "c " in out and "not run now" in out
    assert "NOT IN THE REFERENCE" in out
    assert out.rstrip().endswith("3 settings differ"), out

    monkeypatch.setattr(sys, "argv", ["x", "--check", str(ref)])  # written for lru
    with pytest.raises(SystemExit) as exc:
        D.main()
    assert exc.value.code == 2
    assert "digests of policy 'lru', not 'fmoe'" in capsys.readouterr().err
