"""The hardware profiler: fits by hand, and a CPU run that writes a profile the
simulator loads and uses."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from omegaconf import OmegaConf

from fmoesim.engine.compute import ComputeModel
from fmoesim.errors import FmoesimError
from fmoesim.specs import HardwareSpec
from replay.profile import fit_linear, profile, write_profile
from tests.tiny import TINY


def test_fit_linear_recovers_exact_lines_and_clips_negative_terms():
    x = np.array([1.0, 2, 4, 8])
    assert fit_linear(x, 3 + 0.5 * x) == pytest.approx((3.0, 0.5))
    X = np.array([[1.0, 0], [0, 1], [1, 1], [2, 3]])
    assert fit_linear(X, 1 + 2 * X[:, 0] + 4 * X[:, 1]) == pytest.approx((1.0, 2.0, 4.0))
    # a falling line has no physical meaning: the slope is clipped, the intercept refitted
    assert fit_linear(x, 10 - x) == pytest.approx((np.mean(10 - x), 0.0))


def test_a_cpu_profile_is_a_loadable_hardware_preset_the_compute_model_uses(tmp_path):
    pytest.importorskip("torch", reason="the profiler needs torch")
    spec = profile(
        TINY,
        "cpu",
        repeats=2,
        sizes_bytes=(1 << 16, 1 << 18, 1 << 20),
        tokens=(1, 4, 16),
        attention_points=((1, 17), (1, 65), (4, 68), (8, 36), (16, 288)),
        name="cpu-test",
    )
    assert spec.gpu == "cpu" and "meaningless" in spec.source
    assert spec.pcie_gbps > 0 and spec.transfer_overhead_s >= 0
    # every timed copy size is kept beside the fit
    assert set(spec.measured["link"]) == {f"h2d_{n}_s" for n in (1 << 16, 1 << 18, 1 << 20)}
    coef = spec.measured[TINY.name]
    # every coefficient the replay's operators give (TINY has no shared or dense layers)
    assert set(coef) == {
        "expert_a_s",
        "expert_b_s",
        "expert_launch_s",
        "attn_a_s",
        "attn_b_s",
        "attn_kv_s",
        "attn_pair_s",
        "router_a_s",
        "router_b_s",
        "lm_head_a_s",
        "lm_head_b_s",
    }
    assert all(v >= 0 for v in coef.values()) and coef["expert_a_s"] + coef["expert_b_s"] > 0
    path = write_profile(spec, tmp_path / "measured" / "cpu-test.yaml")
    raw = OmegaConf.load(path)
    del raw["defaults"]
    loaded = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HardwareSpec), raw))
    assert isinstance(loaded, HardwareSpec)
    assert dataclasses.asdict(loaded) == dataclasses.asdict(spec)
    c = ComputeModel.from_specs(TINY, loaded)
    assert (c.expert_a_s, c.expert_b_s) == (coef["expert_a_s"], coef["expert_b_s"])
    assert c.expert_launch_s == coef["expert_launch_s"] <= coef["expert_a_s"]
    assert c.attention_s(1, 10, 11) == pytest.approx(
        coef["attn_a_s"] + coef["attn_b_s"] + 10 * coef["attn_kv_s"] + 11 * coef["attn_pair_s"]
    )


def test_the_launch_share_is_twice_the_half_widths_fixed_cost_less_the_wholes():
    """``whole = launch + read`` and ``part = launch + fraction * read``: 100 and 60 us at
    a half give 20 us of launches, as do 100 and 40 us at a quarter; noise that would
    give less than 0 or more than the whole is kept within them.  Red if the two fixed
    costs are swapped, the fraction is ignored or the share is not clipped."""
    from replay.profile import launch_share

    assert launch_share(100e-6, 60e-6) == pytest.approx(20e-6)
    assert launch_share(100e-6, 100e-6) == pytest.approx(100e-6)  # all launches
    assert launch_share(100e-6, 40e-6) == 0.0
    assert launch_share(100e-6, 120e-6) == 100e-6
    # a quarter of the rows: 20 us of launches and 80 of read give 40 us
    assert launch_share(100e-6, 40e-6, 0.25) == pytest.approx(20e-6)
    with pytest.raises(ValueError, match="must lie in"):
        launch_share(100e-6, 40e-6, 1.0)  # no segment: the whole FFN


def test_each_number_is_the_median_over_passes_so_one_slow_pass_sets_none(monkeypatch):
    """Three passes by hand: the third finds the link at half its bandwidth, the second
    every operator twice as slow (a lent machine's slow stretches).  The profile takes each
    copy's and each coefficient's median, so it is the fast passes' numbers exactly, and
    the log has one line per pass.  Red if a pass's numbers are averaged in, only the
    last pass counts, or the link is fitted on one pass's copies."""
    pytest.importorskip("torch", reason="the profiler needs torch")
    import replay.profile as P

    sizes = (1 << 16, 1 << 20, 1 << 24)
    calls = {"link": 0, "model": 0}

    def link(torch, device, sizes_bytes, timer):
        calls["link"] += 1
        slow = 2.0 if calls["link"] == 3 else 1.0
        h2d = {f"h2d_{n}_s": slow * (1e-5 + n / 50e9) for n in sizes_bytes}
        return {"transfer_overhead_s": slow * 1e-5, "per_byte_s": slow / 50e9, **h2d}

    def model(torch, device, m, timer, dtype, tokens, points):
        calls["model"] += 1
        slow = 2.0 if calls["model"] == 2 else 1.0 + 0.01 * calls["model"]
        return {"expert_a_s": slow * 80e-6, "expert_b_s": slow * 1e-7}

    monkeypatch.setattr(P, "measure_link", link)
    monkeypatch.setattr(P, "model_coefficients", model)
    lines: list[str] = []
    spec = P.profile(TINY, "cpu", sizes_bytes=sizes, passes=3, log=lines.append)
    assert calls == {"link": 3, "model": 3} and len(lines) == 3
    assert "pass 3/3: link 25.0 GB/s" in lines[2]
    assert spec.pcie_gbps == pytest.approx(50.0)
    assert spec.transfer_overhead_s == pytest.approx(1e-5)
    assert spec.measured["link"]["h2d_16777216_s"] == pytest.approx(1e-5 + (1 << 24) / 50e9)
    # the third pass (1.03x) is the median of 1.01x, 2x and 1.03x
    assert spec.measured[TINY.name]["expert_a_s"] == pytest.approx(1.03 * 80e-6)
    with pytest.raises(FmoesimError, match="--passes 0"):
        P.profile(TINY, "cpu", sizes_bytes=sizes, passes=0)


def test_the_command_refuses_a_bad_device_or_destination_before_measuring(tmp_path, capsys):
    """Red if ``--device tpu`` reaches torch (a RuntimeError traceback), or a
    ``--diagnostics`` file that cannot be written is found only after the profile was
    written (a half-written result and a pandas traceback)."""
    pytest.importorskip("torch", reason="the profiler needs torch")
    from replay.profile import main

    (tmp_path / "plain").write_text("x")
    out = tmp_path / "p.yaml"
    base = ["--model", "olmoe-1b-7b", "--out", str(out)]
    for extra, line in (
        (["--device", "tpu"], "--device tpu: must be 'cpu' or 'cuda[:N]'"),
        (["--device", "cpu", "--diagnostics", str(tmp_path / "plain" / "d.csv")],
         f"--diagnostics {tmp_path / 'plain' / 'd.csv'}: cannot be made: "
         f"{tmp_path / 'plain'} is a file"),
        (["--device", "cpu", "--diagnostics", str(tmp_path)],
         f"--diagnostics {tmp_path}: is a folder (rule: a file to write)"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            main([*base, *extra])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"fmoesim-profile: error: {line}"]
        assert not out.exists()


def test_a_profile_is_named_after_its_file_and_a_bad_model_names_the_flag(
    tmp_path, capsys, monkeypatch
):
    """Red if every profile of one GPU gets the same default name (``measured-cpu``), so
    that runs on two different profiles share one hardware name in the results store,
    or if ``--model nosuch`` is reported as a config key the user never gave."""
    pytest.importorskip("torch", reason="the profiler needs torch")
    import yaml

    import replay.profile as P
    from fmoesim.specs import HardwareSpec

    monkeypatch.setattr(P, "profile", lambda models, device, name, **kw: HardwareSpec(name=name))
    P.main(["--device", "cpu", "--model", "olmoe-1b-7b", "--out", str(tmp_path / "my-gpu.yaml")])
    assert yaml.safe_load((tmp_path / "my-gpu.yaml").read_text())["name"] == "my-gpu"
    capsys.readouterr()
    with pytest.raises(SystemExit):
        P.main(["--device", "cpu", "--model", "nosuch", "--out", str(tmp_path / "x.yaml")])
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("fmoesim-profile: error: --model nosuch: unknown model preset; valid:")


def test_an_existing_profile_is_kept_and_a_name_is_a_plain_one(tmp_path, capsys, monkeypatch):
    """Red if a second profile silently replaces an existing one (minutes of a GPU's
    measurement lost), if ``--force`` does not replace it, or if ``--name a/b`` is
    written into a preset that ``hardware=measured/<name>`` cannot name."""
    pytest.importorskip("torch", reason="the profiler needs torch")
    import yaml

    import replay.profile as P
    from fmoesim.specs import HardwareSpec

    monkeypatch.setattr(P, "profile", lambda models, device, name, **kw: HardwareSpec(name=name))
    out = tmp_path / "gpu.yaml"
    out.write_text("kept\n")
    base = ["--device", "cpu", "--model", "olmoe-1b-7b", "--out", str(out)]
    for extra, line in (
        ([], f"--out {out}: exists (--force replaces it)"),
        (["--force", "--name", "a/b"], "--name a/b: not a preset's name (rule: no '/', '\\' "
         "or '..', not empty, not starting with '.')"),
    ):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            P.main([*base, *extra])
        assert exc.value.code == 2
        assert capsys.readouterr().err.strip().splitlines() == [f"fmoesim-profile: error: {line}"]
        assert out.read_text() == "kept\n"
    P.main([*base, "--force"])
    assert yaml.safe_load(out.read_text())["name"] == "gpu"
