"""Collection runs that must not mislead or crash: resuming with other arguments or
another model, the destination and stopped collections checked before the model loads,
load and tokenizer errors in one line, and no empty ``<out>.parts/`` left behind."""

from __future__ import annotations

import json
import socket
import time

import pytest

torch = pytest.importorskip("torch", reason="the collector needs torch (extra 'collect')")
T = pytest.importorskip("transformers", reason="the collector needs transformers (extra 'collect')")

from fmoesim.cli.collect_cli import main  # noqa: E402
from fmoesim.collect.collector import collect  # noqa: E402
from fmoesim.errors import FmoesimError  # noqa: E402
from fmoesim.trace import read_trace  # noqa: E402
from tests.test_collector import COMMON, FAMILIES, PROMPTS, tiny  # noqa: E402


def stopped(model, out, **kw) -> None:  # type: ignore[no-untyped-def]
    """Collect ``PROMPTS`` into ``out`` and stop after request 0 is saved."""

    def stop(i: int) -> None:
        if i == 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        collect(model, PROMPTS, out, on_request=stop, **kw)
    assert (out.with_name(out.name + ".parts") / "00000000.npz").exists()


def parts_of(out) -> list[str]:  # type: ignore[no-untyped-def]
    return sorted(p.name for p in out.with_name(out.name + ".parts").iterdir())


def test_a_resume_with_other_arguments_is_refused(tmp_path):
    """Red when a stopped collection resumes without comparing its saved arguments:
    ``max_new_tokens`` 6 after 3 gives a trace whose request 0 has 3 tokens under a
    manifest that says 6 (and other prompts or projection seeds mix the same way)."""
    model = tiny("olmoe")
    out = tmp_path / "t"
    stopped(model, out, max_new_tokens=3)
    with pytest.raises(FmoesimError, match=r"other arguments \(max_new_tokens 3 there, 6 now\)"):
        collect(model, PROMPTS, out, max_new_tokens=6)
    with pytest.raises(FmoesimError, match="prompts_sha256"):
        collect(model, PROMPTS[::-1], out, max_new_tokens=3)
    with pytest.raises(FmoesimError, match="projection_seed 0 there, 1 now"):
        collect(model, PROMPTS, out, max_new_tokens=3, projection_seed=1)
    assert parts_of(out) == ["00000000.npz", "state.json"]  # untouched
    tr = read_trace(collect(model, PROMPTS, out, max_new_tokens=6, overwrite=True))
    assert tr.manifest.source["max_new_tokens"] == 6
    assert tr.output_tokens.tolist() == [6, 6]  # request 0 generated again, not resumed


def test_a_resume_with_another_model_is_refused(tmp_path):
    """Red when the model is compared by its expert count only: other router weights,
    another config with the same experts, or another end-of-sequence token resume into a
    trace that mixes two models."""
    out = tmp_path / "t"
    stopped(tiny("mixtral"), out, max_new_tokens=2)
    other_weights = tiny("mixtral")
    with torch.no_grad():
        other_weights.model.layers[1].mlp.gate.weight.mul_(2)
    with pytest.raises(FmoesimError, match=r"another model \(router_weights_sha256 differ\)"):
        collect(other_weights, PROMPTS, out, max_new_tokens=2)
    cfg_name, model_name, kw = FAMILIES["mixtral"]
    torch.manual_seed(0)
    deeper = getattr(T, model_name)(
        getattr(T, cfg_name)(**{**COMMON, **kw, "num_hidden_layers": 3})
    )
    with pytest.raises(FmoesimError, match="another model.*config_sha256.*weight_shapes_sha256"):
        collect(deeper, PROMPTS, out, max_new_tokens=2)
    other_eos = tiny("mixtral")
    other_eos.generation_config.eos_token_id = 7
    with pytest.raises(FmoesimError, match=r"another model \(eos_token_ids differ\)"):
        collect(other_eos, PROMPTS, out, max_new_tokens=2)
    seen: list[int] = []
    collect(tiny("mixtral"), PROMPTS, out, max_new_tokens=2, batch_size=2, on_request=seen.append)
    assert seen == [1]  # the same model (a new object) with another batch size resumes


def test_a_parts_directory_without_state_is_refused(tmp_path):
    """Red when parts of unknown arguments (no state.json) are taken as this run's."""
    parts = tmp_path / "t.parts"
    parts.mkdir()
    (parts / "00000000.npz").write_bytes(b"")
    model = tiny("mixtral")
    with pytest.raises(FmoesimError, match="holds no state.json.*--force to discard"):
        collect(model, PROMPTS, tmp_path / "t", max_new_tokens=2)
    read_trace(collect(model, PROMPTS, tmp_path / "t", max_new_tokens=2, overwrite=True))
    assert not parts.exists()


def test_refusals_and_early_failures_leave_no_parts_directory(tmp_path):
    """Red when ``<out>.parts`` is made before the model and prompts are checked (a
    dense model or a bad prompt leaves an empty one), or kept after a failure that saved
    no request."""
    dense = T.LlamaForCausalLM(T.LlamaConfig(**COMMON, intermediate_size=16))
    dense.config.num_local_experts = 4
    dense.config.num_experts_per_tok = 2
    with pytest.raises(FmoesimError, match="no MoE router found"):
        collect(dense, PROMPTS, tmp_path / "dense")
    model = tiny("mixtral")
    with pytest.raises(FmoesimError, match="prompt 1: token id 100 is outside"):
        collect(model, [[5, 6], [7, 100]], tmp_path / "vocab")
    with pytest.raises(FmoesimError, match="prompt 0: no tokens"):
        collect(model, [[]], tmp_path / "empty")

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise RuntimeError("out of memory")

    model.generate = broken
    with pytest.raises(RuntimeError):
        collect(model, PROMPTS, tmp_path / "oom")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def cli(capfd, *args: str) -> list[str]:  # type: ignore[no-untyped-def]
    """Run ``fmoesim-collect`` in this process; expect exit status 2 and return stderr."""
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in args])
    err = capfd.readouterr().err.strip().splitlines()
    assert e.value.code == 2, err
    assert len(err) == 1, err
    return err


@pytest.fixture
def id_prompts(tmp_path):  # type: ignore[no-untyped-def]
    p = tmp_path / "ids.jsonl"
    p.write_text("".join(json.dumps({"input_ids": q}) + "\n" for q in PROMPTS))
    return p


@pytest.fixture
def offline(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """No hub: a hub id cannot be reached (as on a machine without network), and an
    empty local cache."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))


@pytest.fixture
def unreachable(monkeypatch, tmp_path):  # type: ignore[no-untyped-def]
    """A hub that refuses connections (a closed port on this host) and an empty local
    cache; transformers' loaders record their calls instead of asking a hub."""
    import huggingface_hub.constants

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    calls: list[tuple[str, str, dict]] = []  # type: ignore[type-arg]
    for auto in (T.AutoConfig, T.AutoTokenizer, T.AutoModelForCausalLM):

        def record(name, *args, _auto=auto, **kwargs):  # type: ignore[no-untyped-def]
            calls.append((_auto.__name__, str(name), kwargs))
            raise OSError("We couldn't connect to the hub (after its retries)")

        monkeypatch.setattr(auto, "from_pretrained", record)
    return calls


def test_cli_checks_the_destination_before_loading_the_model(tmp_path, capfd, id_prompts):
    """Red when "already exists" comes only after the model loads (then an unloadable
    model is reported instead, and a loadable one is loaded for nothing)."""
    (tmp_path / "out").mkdir()
    (err,) = cli(capfd, tmp_path / "no-such-model", id_prompts, tmp_path / "out")
    assert "out: already exists" in err


def test_cli_refuses_a_resume_with_other_arguments_before_loading(
    tmp_path, capfd, id_prompts, offline
):
    """Red when a stopped collection's arguments are compared only after the model loads
    (here the model cannot load, so the load error shows instead)."""
    stopped(tiny("olmoe"), tmp_path / "out", max_new_tokens=3)
    (err,) = cli(capfd, "fmoesim-test/no-such-model", id_prompts, tmp_path / "out",
                 "--max-new-tokens", "6")  # fmt: skip
    assert "max_new_tokens 3 there, 6 now" in err and "--force" in err


def test_cli_refuses_a_dense_model_before_its_weights_load(
    tmp_path, capfd, id_prompts, monkeypatch
):
    """A saved dense Llama: one line naming the model and the missing expert count,
    before ``AutoModelForCausalLM.from_pretrained`` runs (its weight-loading progress
    bar would come first) and with no output directory.  Red if the config is not
    checked before the load."""
    T.LlamaForCausalLM(T.LlamaConfig(**COMMON, intermediate_size=16)).save_pretrained(
        tmp_path / "dense"
    )
    capfd.readouterr()  # the save's own progress bar

    def no_load(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise AssertionError("the weights were loaded")

    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained", no_load)
    (err,) = cli(capfd, tmp_path / "dense", id_prompts, tmp_path / "out")
    assert err.startswith(f"fmoesim-collect: error: {tmp_path / 'dense'}: LlamaConfig: no ")
    assert "not a mixture-of-experts model?" in err
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out*"))


def test_cli_hub_and_model_load_errors_are_one_line(tmp_path, capfd, id_prompts, offline):
    """Red when ``from_pretrained`` errors reach the user as a traceback (an unreachable
    hub id: a 51-line OSError; a model directory with a broken config), leave
    ``<out>.parts`` behind, or, with text prompts, blame the tokenizer ("give input_ids
    instead", which would fail next on the model)."""
    (err,) = cli(capfd, "fmoesim-test/no-such-model", id_prompts, tmp_path / "o1")
    assert "fmoesim-test/no-such-model: not a local folder and not in the local cache" in err
    assert "offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE) asks no hub" in err
    text = tmp_path / "text.jsonl"  # text prompts: the model is blamed, not its tokenizer
    text.write_text('{"prompt": "What is 12 times 7?"}\n')
    (err,) = cli(capfd, "fmoesim-test/no-such-model", text, tmp_path / "o3")
    assert err.startswith("fmoesim-collect: error: fmoesim-test/no-such-model: not a local")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-family"}')
    (err,) = cli(capfd, bad, id_prompts, tmp_path / "o2")
    assert f"{bad}: cannot load the model (" in err
    assert not list(tmp_path.glob("o*"))


def test_cli_names_a_missing_local_model_folder(tmp_path, capfd, id_prompts, monkeypatch):
    """Red if a path to a model folder that is not there (absolute, or under a folder that
    exists here) is sent to the hub as a model id, with advice to ``hf download`` it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in (str(tmp_path / "models" / "gone"), "models/gone", "./gone"):
        (err,) = cli(capfd, name, id_prompts, tmp_path / "o")
        assert err == (
            f"fmoesim-collect: error: {name}: no such folder (rule: a local model folder "
            "holding config.json, or a hub id such as Qwen/Qwen3-30B-A3B)"
        )
        assert not list(tmp_path.glob("o*"))


@pytest.mark.parametrize("prompts", ["ids", "text"])
def test_cli_unreachable_hub_fails_at_once(tmp_path, capfd, id_prompts, unreachable, prompts):
    """Red if a hub id that is in no local cache, where the hub cannot be reached, goes to
    transformers' loaders anyway: huggingface_hub retries each file about 28 s (51 s with
    id prompts: the config, then the model) before an OSError that names neither the
    cache nor a fix.  It must be one line at once, naming the model, the cache, the
    unreachable hub and the fixes, with nothing written."""
    if prompts == "text":
        path = tmp_path / "text.jsonl"
        path.write_text('{"prompt": "What is 12 times 7?"}\n')
    else:
        path = id_prompts
    start = time.monotonic()
    (err,) = cli(capfd, "fmoesim-test/no-such-model", path, tmp_path / "out")
    assert time.monotonic() - start < 5
    assert unreachable == []  # no loader was asked
    assert err.startswith("fmoesim-collect: error: fmoesim-test/no-such-model: not a local "
                          f"folder and not in the local cache ({tmp_path / 'hub'}), and the "
                          "hub (http://127.0.0.1:")  # fmt: skip
    assert "cannot be reached (ConnectError" in err or "cannot be reached (Connection" in err
    assert "hf download fmoesim-test/no-such-model" in err and "HF_HOME" in err
    assert "local model folder" in err
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.parts").exists()


def test_cli_unreachable_hub_loads_a_cached_model_from_the_cache(
    tmp_path, capfd, id_prompts, unreachable, monkeypatch
):
    """Red if a model in the local cache, where the hub cannot be reached, is loaded
    without ``local_files_only`` (each file then waits on the hub, up to its timeout where
    the network drops packets), or is refused as if it were not cached."""
    snapshot = tmp_path / "hub" / "models--fmoesim-test--tiny" / "snapshots" / ("0" * 40)
    (snapshot.parent.parent / "refs").mkdir(parents=True)
    (snapshot.parent.parent / "refs" / "main").write_text("0" * 40)
    tiny("olmoe").save_pretrained(snapshot)
    capfd.readouterr()  # the progress bar of saving
    real = T.OlmoeForCausalLM.from_pretrained

    def from_cache(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        unreachable.append(("AutoModelForCausalLM", str(name), kwargs))
        return real(snapshot, dtype=kwargs.get("dtype"))

    def config_from_cache(name, *args, **kwargs):  # type: ignore[no-untyped-def]
        unreachable.append(("AutoConfig", str(name), kwargs))
        return T.OlmoeConfig.from_pretrained(snapshot)

    monkeypatch.setattr(T.AutoModelForCausalLM, "from_pretrained", from_cache)
    monkeypatch.setattr(T.AutoConfig, "from_pretrained", config_from_cache)
    main(["fmoesim-test/tiny", str(id_prompts), str(tmp_path / "out"), "--max-new-tokens", "2"])
    err = capfd.readouterr().err
    assert "cannot be reached" in err and "loading fmoesim-test/tiny from the local cache" in err
    assert [c[0] for c in unreachable] == ["AutoConfig", "AutoModelForCausalLM"]
    assert all(c[1] == "fmoesim-test/tiny" and c[2].get("local_files_only") for c in unreachable)
    assert read_trace(tmp_path / "out").num_requests == len(PROMPTS)


def test_cli_text_prompts_without_a_tokenizer_are_one_line(tmp_path, capfd):
    """Red when text prompts reach the model through a tokenizer that cannot tokenize
    them (transformers builds an empty one for a directory without tokenizer files: a
    29-line traceback from generate) or through one that does not load."""
    tiny("olmoe").save_pretrained(tmp_path / "model")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"input_ids": [5, 6]}\n\n{"prompt": "hello"}\n')
    capfd.readouterr()  # the progress bar of saving
    (err,) = cli(capfd, tmp_path / "model", prompts, tmp_path / "out")
    assert f"{prompts} line 3: the text gives no tokens" in err
    (tmp_path / "model" / "tokenizer_config.json").write_text("{not json")
    (err,) = cli(capfd, tmp_path / "model", prompts, tmp_path / "out")
    assert f"{prompts} line 3: a text prompt needs" in err
    assert not (tmp_path / "out.parts").exists()


@pytest.mark.parametrize(
    ("name", "data", "rule"),
    [("p.jsonl", b"\x89PNG\r\n\x1a\n\xff\xfe", "not UTF-8 text (byte 0; rule: a JSON or"),
     ("p.json", b"[" * 100_000 + b"]" * 100_000, "not valid JSON ("),
     ("p.jsonl", b'{"prompt": "a"}\n' + b"[" * 100_000 + b"\n", "line 2: not a JSON object (")],
    ids=["binary", "json-nested-too-deep", "jsonl-nested-too-deep"],
)  # fmt: skip
def test_an_unreadable_prompt_file_is_one_error(tmp_path, name, data, rule):
    """Red if a binary prompt file raises UnicodeDecodeError, or JSON nested past
    Python's recursion limit raises RecursionError, instead of one line naming the file."""
    from fmoesim.cli.collect_cli import read_prompt_lines
    from fmoesim.errors import FmoesimError

    (tmp_path / name).write_bytes(data)
    with pytest.raises(FmoesimError) as info:
        read_prompt_lines(tmp_path / name, None, None)
    sep = " " if rule.startswith("line") else ": "
    assert str(info.value).startswith(f"{tmp_path / name}{sep}{rule}"), str(info.value)


def test_cli_prompt_errors_name_the_file_and_place_before_anything_is_written(tmp_path, capfd):
    """Red if a token id outside the vocabulary is named by its prompt's index alone, a
    boolean id is read as 1, an item of a JSON list is called a line, or a negative
    --projection-seed raises numpy's ValueError after the stopped collection's state was
    written (which then blocks the corrected rerun)."""
    tiny("olmoe").save_pretrained(tmp_path / "model")
    capfd.readouterr()  # the progress bar of saving
    out = tmp_path / "out"
    p = tmp_path / "p.jsonl"
    p.write_text('{"input_ids": [5, 6]}\n{"input_ids": [5, 999999]}\n')
    (err,) = cli(capfd, tmp_path / "model", p, out, "--max-new-tokens", "2")
    assert err.startswith(f"fmoesim-collect: error: {p} line 2: token id 999999 is outside "
                          f"{tmp_path / 'model'}'s vocabulary (rule: ids in [0, "), err  # fmt: skip
    p.write_text('{"input_ids": [5, true]}\n')
    (err,) = cli(capfd, tmp_path / "model", p, out)
    assert err.endswith(f"{p} line 1: input_ids is a non-empty list of token ids")
    j = tmp_path / "p.json"
    j.write_text('[{"input_ids": [5]}, 7]')
    (err,) = cli(capfd, tmp_path / "model", j, out)
    assert err.endswith(f"{j} item 2: a prompt is a string or an object")
    p.write_text('{"input_ids": [5, 6]}\n')
    (err,) = cli(capfd, tmp_path / "model", p, out, "--projection-seed", "-1")
    assert err.endswith("--projection-seed must be >= 0, got -1")
    assert not out.exists() and not (tmp_path / "out.parts").exists()
