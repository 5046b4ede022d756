"""Digests of a policy's runs (fMoE by default), to check that a change to the policy or
the engine keeps every decision: the summary (less its wall-clock fields), the transfer
table, the access log and the policy's own table, hashed per setting.

Run ``python -m benchmarks.fmoe_digests --write FILE`` on a reference tree and
``python -m benchmarks.fmoe_digests --check FILE`` on the changed one (exit 1 on a
difference); ``--policy moe-infinity`` (or any preset) digests that policy instead.
Settings: Mixtral (bundled trace, RTX 3090) timed at 6 and 24 GB, offline
(``held_in_fraction=0.7``) and online (empty store); online serving (arrivals, continuous
batching); every ``conf/policy/<policy>-*.yaml`` preset at 24 GB; Qwen3-30B-A3B timed (8
synthetic requests, a quarter of the experts); hit-rate-only runs (offline and online,
and one without the access log, where LRU takes its numpy path); batch size 3; caching
off (``release_after_use``) at 13.7 GB.  ``--check`` names the settings that differ and
which digests, refuses a file written for another policy, and counts as a difference a
setting of the file that did not run and a setting the file lacks (not checked).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks._cli import build_line, parser
from fmoesim.atomic import atomic_file, check_file_destination
from fmoesim.config.build import check_preset_names, load_preset, policy_from_preset
from fmoesim.config.schema import CONF_DIR, PROJECT_ROOT
from fmoesim.engine.serving import ServingConfig
from fmoesim.engine.simulate import simulate
from fmoesim.errors import FmoesimError, run_or_exit
from fmoesim.specs import HardwareSpec, ModelSpec
from fmoesim.trace import read_trace
from fmoesim.workload.synthetic import SyntheticConfig, generate

GB = 1e9
_WALL = ("wall_s", "speedup_vs_real")


def _h(obj: Any) -> str:
    h = hashlib.sha256()

    def feed(x: Any) -> None:
        if isinstance(x, dict):
            for k in sorted(x):
                h.update(repr(k).encode())
                feed(x[k])
        elif isinstance(x, np.ndarray):
            h.update(str(x.dtype).encode() + str(x.shape).encode())
            h.update(np.ascontiguousarray(x).tobytes() if x.dtype != object else repr(x).encode())
        elif isinstance(x, float):
            h.update(x.hex().encode())
        else:
            h.update(repr(x).encode())

    feed(obj)
    return h.hexdigest()[:16]


def qwen3_setting(workdir: Path) -> tuple[Any, ModelSpec, int]:
    """Trace, model and budget (a quarter of the experts) of the Qwen3 setting."""
    model = load_preset("model", "qwen3-30b-a3b", ModelSpec)
    path = workdir / "qwen3-8"
    if not path.exists():
        generate(model, SyntheticConfig(num_requests=8), path)
    budget = int(0.25 * model.num_layers * model.num_experts) * model.expert_size_bytes
    return read_trace(path), model, budget


def runs(workdir: Path, policy: str = "fmoe") -> Iterator[tuple[str, dict[str, Any], float]]:
    """(name, digests, wall s) per setting of ``policy``."""
    trace = read_trace(PROJECT_ROOT / "traces" / "default")
    mixtral = load_preset("model", "mixtral-8x7b", ModelSpec)
    hw = load_preset("hardware", "rtx3090-pcie4", HardwareSpec)
    offline = ServingConfig(held_in_fraction=0.7)
    cases: list[tuple[str, Any, Any, str, float, dict[str, Any]]] = []
    pol = policy
    for gb in (6, 24):
        cases.append((f"mixtral-{gb}gb-online", trace, mixtral, pol, gb * GB, {}))
        cases.append(
            (f"mixtral-{gb}gb-offline", trace, mixtral, pol, gb * GB, {"serving": offline})
        )
    for p in sorted(CONF_DIR.glob(f"policy/{pol}-*.yaml")):
        cases.append((f"mixtral-24gb-{p.stem}", trace, mixtral, p.stem, 24 * GB, {}))
    arriving = ServingConfig(mode="online", arrivals="poisson", rate_rps=2.0, max_batch_size=4)
    cases.append(
        ("mixtral-24gb-serving-online", trace, mixtral, pol, 24 * GB, {"serving": arriving})
    )
    cases.append(("mixtral-12gb-hit-only", trace, mixtral, pol, 12 * GB, {"timing": False}))
    # without an access log: LRU's hit-rate-only run then takes its numpy path
    cases.append(
        ("mixtral-12gb-hit-only-no-log", trace, mixtral, pol, 12 * GB,
         {"timing": False, "access_log": False})
    )  # fmt: skip
    cases.append(
        ("mixtral-12gb-hit-only-offline", trace, mixtral, pol, 12 * GB,
         {"timing": False, "serving": offline})
    )  # fmt: skip
    cases.append(
        ("mixtral-12gb-batch3", trace, mixtral, pol, 12 * GB,
         {"serving": ServingConfig(batch_size=3)})
    )  # fmt: skip
    cases.append(
        ("mixtral-39-slots-caching-off", trace, mixtral, pol, 39 * mixtral.expert_size_bytes,
         {"serving": offline, "release_after_use": True})
    )  # fmt: skip
    qt, qm, qb = qwen3_setting(workdir)
    cases.append(("qwen3-quarter", qt, qm, pol, qb, {}))
    for name, tr, model, pol, budget, kw in cases:
        policy = policy_from_preset(pol)
        r = simulate(tr, model, hw, policy, int(budget), **({"access_log": True} | kw))
        summary = {k: v for k, v in r.summary.items() if k not in _WALL}
        d = {
            "summary": _h(summary),
            "transfers": _h(r.transfer_table()),
            "accesses": _h(r.accesses),
            "policy_log": _h(r.policy_log),
        }
        yield name, d, r.summary["wall_s"]


def main() -> None:
    """Write or check the digests (one line and exit status 2 on bad input)."""
    ap = parser("python -m benchmarks.fmoe_digests", __doc__.splitlines()[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", type=Path, help="file to write the digests to")
    g.add_argument("--check", type=Path, help="digests written before, to compare with")
    ap.add_argument("--workdir", type=Path, default=None, help="where the Qwen3 trace is kept")
    ap.add_argument("--policy", default="fmoe", help="policy preset to digest (fmoe)")
    args = ap.parse_args()
    sys.exit(run_or_exit(ap.prog, _main, args))


def _reference(path: Path, policy: str) -> dict[str, dict[str, str]]:
    """The settings' digests in ``path`` (written by ``--write`` for ``policy``)."""
    try:
        ref = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise FmoesimError(f"--check {path}: cannot be read ({exc})") from None
    if not isinstance(ref, dict) or not isinstance(ref.get("settings"), dict):
        raise FmoesimError(f"--check {path}: not a digests file (rule: written by --write)")
    if ref.get("policy") != policy:
        raise FmoesimError(
            f"--check {path}: digests of policy {ref.get('policy')!r}, not {policy!r} "
            f"(rule: check with the --policy it was written for)"
        )
    return ref["settings"]


def _main(args: argparse.Namespace) -> int:
    check_preset_names("policy", [args.policy], "--policy")
    ref = _reference(args.check, args.policy) if args.check else None
    if args.write:
        check_file_destination("--write", args.write, force=True)
    print(build_line(), flush=True)
    out: dict[str, dict[str, str]] = {}
    bad = 0
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        workdir = args.workdir or Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        for name, d, wall in runs(workdir, args.policy):
            out[name] = d
            status = ""
            if ref is not None and name not in ref:  # unchecked: the reference is older
                bad += 1
                status = "NOT IN THE REFERENCE (write it again before the change)"
            elif ref is not None:
                parts = [k for k in d if ref[name].get(k) != d[k]]
                bad += bool(parts)
                status = "same" if not parts else f"DIFFERENT: {', '.join(parts)}"
            print(f"{name:40s} {wall:7.2f} s  {status}", flush=True)
    if args.write:
        text = json.dumps({"policy": args.policy, "settings": out}, indent=1, sort_keys=True)
        with atomic_file(args.write) as tmp_path:
            tmp_path.write_text(text)
        print(f"wrote {args.write}")
    print(f"({time.perf_counter() - t0:.0f} s)")
    if ref is None:
        return 0
    lost = [name for name in ref if name not in out]
    for name in lost:
        print(f"{name:40s} in the reference, not run now")
    bad += len(lost)
    print("all identical" if not bad else f"{bad} settings differ")
    return 1 if bad else 0


if __name__ == "__main__":
    main()
