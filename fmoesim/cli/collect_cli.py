"""``fmoesim-collect``: record a Hugging Face MoE model's gate distributions into a trace.

Examples::

    fmoesim-collect /models/Qwen1.5-MoE-A2.7B ../shared/data/prompts/gsm8k_test_prompts.jsonl \\
        traces/qwen-gsm8k --max-new-tokens 64 --limit 100
    fmoesim-collect mistralai/Mixtral-8x7B-v0.1 prompts.jsonl out/mixtral  # a hub id

Prompts: a JSONL or JSON file of objects with a text field (``--field``, default the first
of ``prompt``, ``text``, ``question``, ``content``) or with ``input_ids``, or a JSON list of
strings.  Text goes through the model's tokenizer and its chat template when it has one.
Needs the extra ``collect`` (torch, transformers).  Rerunning an interrupted command
with the same arguments resumes it; other arguments or another model are refused
(``--force`` discards the stopped collection).  Exit status 2 and one line on stderr for
bad input: options, an existing destination and a stopped collection with other
arguments are refused before the model loads; prompt files, tokenizers, hub ids and
model directories that do not load are reported in one line too.  A hub id is looked up
without waiting on the hub's retries: where the hub cannot be reached (one request, the
hub's ``HF_HUB_ETAG_TIMEOUT``) or offline mode is set, a model in the local cache loads
from it, and one that is not there is refused at once.
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fmoesim.errors import ArgumentParser, FmoesimError, counted, run_or_exit

PROG = "fmoesim-collect"
TEXT_FIELDS = ("prompt", "text", "question", "content")


def read_prompts(path: Path, field: str | None, limit: int | None) -> list[Any]:
    """Prompts as strings or token-id lists; a one-line error names the line and rule."""
    return [p for _, p in read_prompt_lines(path, field, limit)]


def place(path: str | Path, n: int) -> str:
    """Where prompt ``n`` of a prompt file is: its line (JSON lines) or its item (a JSON
    list), counted from 1."""
    return f"{path} {'item' if str(path).endswith('.json') else 'line'} {n}"


def read_prompt_lines(path: Path, field: str | None, limit: int | None) -> list[tuple[int, Any]]:
    """``(line or item number, prompt)`` pairs of a prompt file (see :func:`read_prompts`)."""
    if path.is_dir():
        raise FmoesimError(f"{path}: a directory (rule: a JSON or JSON-lines prompt file)")
    if not path.is_file():
        raise FmoesimError(f"{path}: prompt file not found")
    try:
        raw = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise FmoesimError(f"{path}: not UTF-8 text (byte {exc.start}; rule: a JSON or "
                           "JSON-lines prompt file)") from None  # fmt: skip
    items: list[tuple[int, Any]]
    if path.suffix == ".json":
        try:
            data = json.loads(raw)
        except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep
            raise FmoesimError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, dict):  # e.g. {"prompts": [...]}
            data = next((v for v in data.values() if isinstance(v, list)), None)
        if not isinstance(data, list):
            raise FmoesimError(f"{path}: a JSON prompt file holds a list")
        items = list(enumerate(data, start=1))
    else:
        items = []
        for n, line in enumerate(raw.splitlines(), start=1):
            if line.strip():
                try:
                    items.append((n, json.loads(line)))
                except (ValueError, RecursionError) as exc:
                    raise FmoesimError(f"{path} line {n}: not a JSON object ({exc})") from None
    out: list[tuple[int, Any]] = []
    for n, item in items:
        out.append((n, _prompt_of(path, n, item, field)))
        if limit is not None and len(out) >= limit:
            break
    if not out:
        raise FmoesimError(f"{path}: no prompts")
    return out


def _prompt_of(path: Path, n: int, item: Any, field: str | None) -> Any:
    where = place(path, n)
    if isinstance(item, str):
        return item
    if not isinstance(item, dict):
        raise FmoesimError(f"{where}: a prompt is a string or an object")
    if field is None and "input_ids" in item:
        ids = item["input_ids"]
        whole = all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids or [0])
        if not (isinstance(ids, list) and ids and whole):
            raise FmoesimError(f"{where}: input_ids is a non-empty list of token ids")
        return ids
    keys = (field,) if field else TEXT_FIELDS
    for k in keys:
        v = item.get(k)
        if isinstance(v, str) and v:
            return v
    raise FmoesimError(f"{where}: needs a non-empty string field ({' or '.join(keys)})")


def main(argv: list[str] | None = None) -> None:
    """Console entry point."""
    ap = ArgumentParser(prog=PROG, description=__doc__.splitlines()[0])
    ap.add_argument("model", help="a local model directory or a hub id")
    ap.add_argument("prompts", help="JSONL/JSON prompt file")
    ap.add_argument("out", help="destination trace directory")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=1, help="requests generated together")
    ap.add_argument("--tokens", action="store_true", help="also write tokens.parquet")
    ap.add_argument("--embedding-dim", type=int, default=64, help="0 = keep the full hidden size")
    ap.add_argument("--projection-seed", type=int, default=0)
    ap.add_argument("--field", default=None, help="the prompt text field")
    ap.add_argument("--limit", type=int, default=None, help="first N prompts only")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    ap.add_argument(
        "--force",
        action="store_true",
        help="replace an existing trace; discard a stopped collection that cannot be resumed",
    )
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    run_or_exit(PROG, _run, args)


def _first_line(exc: BaseException) -> str:
    """``Type: first line of the message`` of an exception from a library."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0]}" if text else type(exc).__name__


def _run(args: argparse.Namespace) -> None:
    from fmoesim.collect.collector import (
        check_arguments,
        check_destination,
        collect,
        parts_dir,
    )

    embedding_dim = None if args.embedding_dim == 0 else args.embedding_dim
    check_arguments(args.max_new_tokens, args.batch_size, embedding_dim)
    if args.limit is not None and args.limit < 1:
        raise FmoesimError(f"--limit must be >= 1, got {args.limit}")
    if args.projection_seed < 0:  # numpy's generators take none: checked before any state
        raise FmoesimError(f"--projection-seed must be >= 0, got {args.projection_seed}")
    check_destination(args.out, args.force)
    prompts = read_prompt_lines(Path(args.prompts), args.field, args.limit)
    try:
        import torch
        import transformers  # noqa: F401 - the collector's dependency, checked here
    except ImportError:
        raise FmoesimError(
            "the collector needs torch and transformers: pip install '.[collect]'"
        ) from None
    from fmoesim.collect.state import check_resume, collection_arguments, library_versions

    # resolved at the first load: id prompts let a stopped collection be checked first
    options = functools.cache(lambda: load_options(args.model))
    ids = _token_ids(prompts, args.model, args.prompts, options)
    arguments = collection_arguments(ids, args.max_new_tokens, embedding_dim, args.projection_seed)
    check_resume(parts_dir(args.out), arguments, library_versions(), None, args.force)
    vocab = _config_vocab_size(args.model, options())
    for (n, _), p in zip(prompts, ids, strict=True):  # before the weights load (seconds)
        bad = next((t for t in p if vocab is not None and not 0 <= t < vocab), None)
        if bad is not None:
            raise FmoesimError(
                f"{place(args.prompts, n)}: token id {bad} is outside {args.model}'s "
                f"vocabulary (rule: ids in [0, {vocab}))"
            )
    model = _load_model(args.model, getattr(torch, args.dtype), options())
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    if embedding_dim is not None and isinstance(hidden, int) and embedding_dim > hidden:
        print(f"{PROG}: note: --embedding-dim {embedding_dim} exceeds {args.model}'s hidden "
              f"size: the trace keeps the whole hidden state ({hidden} values)",
              file=sys.stderr)  # fmt: skip
    out = collect(
        model,
        ids,
        args.out,
        max_new_tokens=args.max_new_tokens,
        embedding_dim=embedding_dim,
        projection_seed=args.projection_seed,
        model_id=str(args.model),
        overwrite=args.force,
        progress=True,
        batch_size=args.batch_size,
        tokens=args.tokens,
    )
    print(f"wrote {out}: {counted(len(ids), 'request')}")


def load_options(name: str) -> dict[str, Any]:
    """Keyword arguments for ``from_pretrained(name, ...)``: none for a local folder, a
    name that is not a hub id, or a hub id where the hub answers (transformers then does
    as it always does); ``local_files_only`` where the hub cannot be reached but the model
    is in the local cache.  Offline mode (``HF_HUB_OFFLINE``, ``TRANSFORMERS_OFFLINE``)
    asks no hub.  A hub id that is in no cache and cannot be fetched is one
    :class:`FmoesimError` naming the model, the cache, the reason and the fixes, at once
    instead of after the hub's retries (about 28 s for each file)."""
    path = Path(name).expanduser()
    if path.is_dir():
        return {}
    first = path.parts[0] if path.parts else ""
    if name.startswith(("/", ".", "~")) or (len(path.parts) > 1 and Path(first).is_dir()):
        # a path into a folder that exists here is a local model that is not there, not a
        # hub id to ask for
        raise FmoesimError(
            f"{name}: no such folder (rule: a local model folder holding config.json, or "
            "a hub id such as Qwen/Qwen3-30B-A3B)"
        )
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(name)
    except Exception:  # noqa: BLE001 - not a hub id: transformers' own error names it
        return {}
    try:
        cached = isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001 - an unreadable cache holds nothing usable
        cached = False
    if constants.HF_HUB_OFFLINE:
        if cached:
            return {}  # transformers reads the cache in offline mode
        why = "offline mode (HF_HUB_OFFLINE or TRANSFORMERS_OFFLINE) asks no hub"
    else:
        reason = hub_unreachable()
        if reason is None:
            return {}
        if cached:
            print(f"{PROG}: note: the hub ({constants.ENDPOINT}) cannot be reached ({reason}); "
                  f"loading {name} from the local cache", file=sys.stderr)  # fmt: skip
            return {"local_files_only": True}
        why = f"the hub ({constants.ENDPOINT}) cannot be reached ({reason})"
    raise FmoesimError(
        f"{name}: not a local folder and not in the local cache ({constants.HF_HUB_CACHE}), "
        f"and {why}; download it where there is network (hf download {name}) and copy the "
        "cache here, pass a local model folder, or set HF_HOME to a cache that holds it"
    )


def hub_unreachable() -> str | None:
    """Why the hub (``HF_ENDPOINT``) does not answer one HEAD request, without retries and
    within the hub's own ``HF_HUB_ETAG_TIMEOUT`` (10 s unless set); None where it answers
    (any HTTP status: an answer is enough)."""
    from huggingface_hub import constants
    from huggingface_hub.utils import get_session

    try:
        get_session().head(constants.ENDPOINT, timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - DNS, refused, timeout, proxy, TLS: all unreachable
        return _first_line(exc)
    return None


def _config_vocab_size(name: str, options: dict[str, Any]) -> int | None:
    """The vocabulary size ``name``'s config gives (its text model's, for a multimodal
    one), or None where the config does not load or say: loading the model reports it,
    and the collector checks the ids against the loaded embeddings.  A config that
    names no routed experts or no experts per token (a dense model) is refused here, in
    one line, before the weights load."""
    from transformers import AutoConfig

    from fmoesim.collect.routing import num_experts_of, top_k_of

    try:
        cfg = AutoConfig.from_pretrained(name, **options)
    except Exception:  # noqa: BLE001 - reported in one line by the model's load
        return None
    try:  # what the collector reads from the loaded model's config
        num_experts_of(cfg)
        top_k_of(cfg)
    except FmoesimError as exc:
        raise FmoesimError(f"{name}: {exc}") from None
    text = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    vocab = getattr(text, "vocab_size", None)
    return vocab if isinstance(vocab, int) and vocab > 0 else None


def _load_model(name: str, dtype: Any, options: dict[str, Any]) -> Any:
    """``AutoModelForCausalLM.from_pretrained``; any failure (hub, files, config, weights)
    is one line naming the model."""
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **options)
    except Exception as exc:  # hub, file, config and weight errors come in many types
        raise FmoesimError(f"{name}: cannot load the model ({_first_line(exc)})") from None


def _token_ids(
    prompts: list[tuple[int, Any]],
    model: str,
    path: str,
    options: Callable[[], dict[str, Any]],
) -> list[list[int]]:
    """Token ids of each prompt: id lists as they are, text through the model's tokenizer
    and its chat template when it has one.  A model whose config does not load is
    reported as the model's failure (input_ids would not help), before its tokenizer.
    ``options`` gives :func:`load_options`' keyword arguments, asked at the first text
    prompt."""
    from transformers import AutoConfig, AutoTokenizer

    ids: list[list[int]] = []
    tok = None
    for n, p in prompts:
        if isinstance(p, list):
            ids.append(p)
            continue
        where = place(path, n)
        if tok is None:
            kwargs = options()  # its own one-line error, not the loaders'
            try:
                AutoConfig.from_pretrained(model, **kwargs)
            except Exception as exc:  # hub, file and config errors come in many types
                raise FmoesimError(f"{model}: cannot load the model ({_first_line(exc)})") from None
            try:
                tok = AutoTokenizer.from_pretrained(model, **kwargs)
            except Exception as exc:  # missing files, hub errors, unknown tokenizer classes
                raise FmoesimError(
                    f"{where}: a text prompt needs {model}'s tokenizer, which does not load "
                    f"({_first_line(exc)}); give input_ids instead"
                ) from None
        try:
            if getattr(tok, "chat_template", None):
                enc = tok.apply_chat_template(
                    [{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True
                )
                # a BatchEncoding (transformers 5) or a plain list of ids (4.x)
                raw: Any = enc
                seq: Any = raw["input_ids"] if hasattr(raw, "keys") else raw
            else:
                seq = tok(p)["input_ids"]
            row = [int(t) for t in seq]
        except Exception as exc:  # a broken chat template or tokenizer
            raise FmoesimError(f"{where}: {model}'s tokenizer fails ({_first_line(exc)})") from None
        if not row:
            raise FmoesimError(
                f"{where}: the text gives no tokens with {model}'s tokenizer (no tokenizer "
                "saved with the model?); give input_ids instead"
            )
        ids.append(row)
    return ids


if __name__ == "__main__":
    main()
