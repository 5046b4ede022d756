"""A policy that breaks the engine's contract, or a preset that names no class, is refused
in one line naming the policy, the hook (or the key) and the rule; results tell variants
of one policy apart (``policy_args``)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from omegaconf import OmegaConf

from fmoesim._compiled import is_compiled
from fmoesim.config.build import policy_args, target_class
from fmoesim.engine.simulate import simulate
from fmoesim.errors import FmoesimError, PolicyError
from fmoesim.results import load_results
from fmoesim.trace.reader import read_trace
from policies.base import NO_ACTIONS, Actions, Prefetch, PrefetchBatch
from policies.lru import LRU
from tests.test_engine_lru import ROUTES
from tests.tiny import TINY, TINY_HW, write_sequence_trace

ROOT = Path(__file__).resolve().parents[1]
#: key 6 = layer 1, expert 2: never routed by ROUTES, so never resident when prefetched
NEVER = 6


class Bad(LRU):
    """LRU with one contract violation of its ``mode`` at every gate (or victim)."""

    name = "bad"

    def __init__(self, mode: str = "none") -> None:
        super().__init__()
        self.mode = mode

    def on_gate(self, layer, gate):  # noqa: ANN001 - the protocol's arguments
        made = {  # made when asked: a compiled Prefetch refuses a float key when built
            "none": lambda: None,
            "list": lambda: [NEVER],
            "int": lambda: Actions(prefetch=[NEVER]),
            "float-key": lambda: Actions(prefetch=[Prefetch(float(NEVER))]),
            "range": lambda: Actions(prefetch=[Prefetch(10**6)]),
            "negative": lambda: Actions(prefetch=[Prefetch(-1)]),
            "nan": lambda: Actions(prefetch=[Prefetch(NEVER, math.nan)]),
            "inf": lambda: Actions(prefetch=[Prefetch(NEVER, -math.inf)]),
            "generator-nan": lambda: Actions(prefetch=(p for p in [Prefetch(NEVER, math.nan)])),
            "batch-nan": lambda: Actions(
                prefetch=PrefetchBatch([NEVER - 1, NEVER], [1.0, math.nan])
            ),
            "batch-range": lambda: Actions(prefetch=PrefetchBatch([NEVER, 99], [1.0, 2.0])),
            "array-nan": lambda: Actions(
                prefetch=PrefetchBatch(np.array([NEVER - 1, NEVER]), np.array([1.0, math.nan]))
            ),
            "array-range": lambda: Actions(
                prefetch=PrefetchBatch(np.array([NEVER, 99]), np.array([1.0, 2.0]))
            ),
            "array-float": lambda: Actions(
                prefetch=PrefetchBatch(np.array([6.0, 7.0]), np.array([1.0, 2.0]))
            ),
            "delay": lambda: Actions(prefetch=[Prefetch(NEVER)], delay_s=math.nan),
            "abort": lambda: Actions(abort=[1.5]),
        }
        return made[self.mode]() if self.mode in made else NO_ACTIONS

    def victim(self, candidates, incoming):  # noqa: ANN001
        if self.mode == "victim":
            return 10**6
        if self.mode == "victim-list":
            return [next(iter(candidates))]
        return super().victim(candidates, incoming)


@pytest.fixture
def seq_trace(tmp_path):
    return read_trace(write_sequence_trace(tmp_path / "seq", ROUTES))


@pytest.mark.parametrize(
    ("mode", "said"),
    [
        ("none", "on_gate: returned NoneType, not Actions (rule: return Actions"),
        ("list", "on_gate: returned list, not Actions"),
        ("int", "on_gate: Actions.prefetch[0] is int (rule: Actions.prefetch is a sequence"),
        pytest.param(
            "float-key",
            "on_gate: Actions.prefetch[0]: key 6.0 is float (rule: a key is an integer)",
            marks=pytest.mark.skipif(
                is_compiled(), reason="a compiled Prefetch refuses a float key as it is built"
            ),
        ),
        ("range", "on_gate: Actions.prefetch: key 1000000 (rule: a key is an integer in [0, 8))"),
        ("negative", "on_gate: Actions.prefetch: key -1 (rule: a key is an integer in [0, 8))"),
        ("nan", "Actions.prefetch: key 6: priority nan (rule: a priority is a finite number"),
        ("inf", "Actions.prefetch: key 6: priority -inf (rule: a priority is a finite number"),
        ("generator-nan", "Actions.prefetch: key 6: priority nan (rule: a priority is a"),
        ("batch-nan", "on_gate: PrefetchBatch: key 6: priority nan (rule: a priority is a finite"),
        ("batch-range", "on_gate: PrefetchBatch: key 99 (rule: a key is an integer in [0, 8))"),
        ("array-nan", "on_gate: PrefetchBatch: key 6: priority nan (rule: a priority is a finite"),
        ("array-range", "on_gate: PrefetchBatch: key 99 (rule: a key is an integer in [0, 8))"),
        (
            "array-float",
            "on_gate: PrefetchBatch: keys of dtype float64 and shape (2,) (rule: keys are a "
            "1-D array of integers, or a list)",
        ),
        ("delay", "on_gate: Actions.delay_s = nan (rule: a finite number of seconds)"),
        ("abort", "on_gate: Actions.abort[0]: key 1.5 is float (rule: a key is an integer)"),
        ("victim", "victim: chose 1000000 on GPU 0, not one of the candidates (rule:"),
        ("victim-list", "(rule: a victim is one of the candidates it is given"),
    ],
)
def test_a_broken_contract_is_one_policy_error(seq_trace, mode, said):
    """Red if a policy's bad return value runs on (a NaN priority silently reordered the
    link's queue, a -inf one jumped ahead as if on demand) or fails deep in the engine
    (``'NoneType' object has no attribute 'abort'``) instead of naming the rule."""
    with pytest.raises(PolicyError) as info:
        simulate(seq_trace, TINY, TINY_HW, Bad(mode), 2 * TINY.expert_size_bytes)
    assert said in str(info.value)
    assert str(info.value).startswith("policy 'bad': ") and "\n" not in str(info.value)
    assert isinstance(info.value, FmoesimError)  # the CLI's one line and exit status 2


def test_a_hook_s_own_error_is_not_blamed_on_its_actions(seq_trace):
    """Red if a policy's own bug inside a hook the engine calls while carrying out its
    actions (``on_insert`` here) is reported as a broken rule of those actions (a cancel
    of a key outside the model, which the engine ignores), hiding the real traceback."""

    class OwnBug(LRU):
        name = "own-bug"

        def on_gate(self, layer, gate):  # noqa: ANN001
            return Actions(prefetch=[Prefetch(NEVER)], cancel=[-1], delay_s=-1e-4)

        def on_insert(self, key):  # noqa: ANN001
            if key == NEVER:
                raise AttributeError("its own bug")
            super().on_insert(key)

    with pytest.raises(AttributeError, match="its own bug"):
        simulate(seq_trace, TINY, TINY_HW, OwnBug(), 2 * TINY.expert_size_bytes)


def test_a_valid_policy_is_not_refused(seq_trace):
    """Red if the checks refuse what the protocol allows: NO_ACTIONS (at layer 1), a
    prefetch of a resident key (expert 3 of layer 0), an integer priority."""

    class Fine(LRU):
        name = "fine"

        def on_gate(self, layer, gate):  # noqa: ANN001
            if layer:
                return NO_ACTIONS
            return Actions(prefetch=[Prefetch(NEVER, 0.5), Prefetch(3, 1)])

    r = simulate(seq_trace, TINY, TINY_HW, Fine(), 3 * TINY.expert_size_bytes)
    assert r.summary["accesses"] == 12


def test_the_cli_says_it_in_one_line(tmp_path):
    """Red if a policy's contract violation reaches the user as Hydra's traceback (exit
    status 1) rather than one line with exit status 2, or leaves a store row behind."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", "policy=lru",
         "policy._target_=tests.test_policy_errors.Bad", "+policy.mode=none",
         f"workload.path={trace}", f"output.dir={tmp_path}/out", f"store.dir={tmp_path}/store",
         "progress=false", *[f"model.{f}={getattr(TINY, f)}" for f in (
             "name", "num_layers", "num_experts", "top_k", "hidden_size",
             "expert_intermediate_size")],
         f"cache.budget_gb={2 * TINY.expert_size_bytes / 1e9}"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr
    assert p.stderr == (
        "fmoesim: error: policy 'bad': on_gate: returned NoneType, not Actions (rule: return "
        "Actions, or NO_ACTIONS for nothing to do)\n"
    )
    assert not list((tmp_path / "store").glob("*.parquet")) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("target", "said"),
    [
        ("policies.lfu.LFx", "'policies.lfu' has no 'LFx'"),
        ("policies.lfu", "'policies.lfu' is a module, not a class (rule: _target_ is a class,"),
        ("nosuchpkg.X", "no module 'nosuchpkg' can be imported"),
        ("policies.nosuch.X", "'policies' has no 'nosuch'"),
        ("lfu", "not a dotted path to a class"),
        ("policies.lfu.LFU", None),
    ],
)
def test_target_class_names_the_missing_part(target, said):
    """Red if a ``_target_`` typo is reported with Hydra's advice (set
    HYDRA_FULL_ERROR=1, which changes nothing) instead of the part that is missing."""
    why = target_class(target)
    assert why == said or (said is not None and why is not None and why.startswith(said))


def test_target_class_names_a_module_that_fails_its_import(tmp_path, monkeypatch):
    """Red if a policy module whose own import fails is reported as a missing class
    ('Are you sure that X is importable?') instead of the import's error."""
    pkg = tmp_path / "brokenpkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "pol.py").write_text("import numpyy\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert target_class("brokenpkg.pol.Policy") == (
        "importing module 'brokenpkg.pol' failed: No module named 'numpyy'"
    )


def test_policy_args_are_what_a_run_changes_from_its_preset():
    """Red if a knob set on the command line does not show, a preset's own values do, or
    a policy without a preset of its name is stored without its settings (two variants
    of one class would then share one row label)."""
    fmoe = OmegaConf.load(ROOT / "conf" / "policy" / "fmoe.yaml")
    assert policy_args(fmoe, "fmoe") == ""
    fmoe.prefetch_distance = 2
    fmoe.semantic = False
    assert policy_args(fmoe, "fmoe") == "prefetch_distance=2 semantic=false"
    lru_label = OmegaConf.load(ROOT / "conf" / "policy" / "fmoe-lru.yaml")
    assert policy_args(lru_label, "fmoe-lru") == ""
    mine = OmegaConf.create({"_target_": "my.Policy", "top_n": 1, "mode": "a"})
    assert policy_args(mine, "mine") == "_target_=my.Policy mode=a top_n=1"


def test_a_knob_sweep_is_told_apart_in_the_store(tmp_path):
    """Red if two runs of one preset with different knob values come out of the store
    with nothing to tell them apart (a pivot on ``policy`` averages them), or a row
    written without the column does not get it from its config."""
    trace = write_sequence_trace(tmp_path / "seq", ROUTES)
    common = [
        f"workload.path={trace}", f"store.dir={tmp_path}/store", "output.write=false",
        "progress=false", f"cache.budget_gb={2 * TINY.expert_size_bytes / 1e9}",
        *[f"model.{f}={getattr(TINY, f)}" for f in (
            "name", "num_layers", "num_experts", "top_k", "hidden_size",
            "expert_intermediate_size")],
    ]  # fmt: skip
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", "-m", "policy=promoe",
         "policy.stride=1,2", *common],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr
    df = load_results(tmp_path / "store")
    assert sorted(df.policy_args) == ["stride=1", "stride=2"]
    assert set(df.policy) == {"promoe"}
    # a row of an older store, without the column: taken from its config_json
    one = next((tmp_path / "store").glob("*.parquet"))
    row = pd.read_parquet(one).drop(columns=["policy_args"])
    row.to_parquet(one)
    again = load_results(tmp_path / "store")
    assert sorted(again.policy_args) == ["stride=1", "stride=2"]
    assert json.loads(row.config_json.iloc[0])["policy"]["stride"] in (1, 2)


def test_a_sweep_names_the_first_point_when_it_breaks_a_rule(tmp_path):
    """Red if a knob that the first point's policy lacks is reported without the point,
    so the user looks for a typo in the knob of the policy that has it."""
    p = subprocess.run(
        [sys.executable, "-m", "fmoesim.cli.main", "-m", "policy=lru,fmoe",
         "policy.prefetch_distance=3", f"store.dir={tmp_path}/store"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )  # fmt: skip
    assert p.returncode == 2
    assert p.stderr == (
        "fmoesim: error: config key 'policy.prefetch_distance': unknown key "
        "'prefetch_distance' under 'policy' (typo?) (sweep run 1: policy=lru)\n"
    )
