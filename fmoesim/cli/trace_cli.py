"""``fmoesim-trace``: inspect, validate and synthesise traces.

Examples::

    fmoesim-trace inspect traces/default
    fmoesim-trace validate /data/my-trace
    fmoesim-trace synth --model qwen1.5-moe-a2.7b --requests 64 --seed 1 out/qwen-synth
    fmoesim-trace synth --model mixtral-8x7b --set skew=2.0 --set locality=0.8 out/skewed
    fmoesim-trace synth --model mixtral-8x7b --arrivals azure_code.csv out/azure
    fmoesim-trace arrivals azure_code.csv
    fmoesim-trace arrivals azure_conv.csv --sample 64 --out azure-conv-64.csv
    fmoesim-trace import table route.csv out/real --model qwen3-30b-a3b --top-k 6
    fmoesim-trace import vllm-routed-experts routed.npz out/vllm --model qwen3-30b-a3b
    fmoesim-trace import vllm-routes routes.jsonl out/real --model mixtral-8x7b
    fmoesim-trace import eamc eamc.npy out/eamc --model mixtral-8x7b
"""

from __future__ import annotations

import argparse

from fmoesim.errors import ArgumentParser, ConfigError, FmoesimError, counted, run_or_exit

PROG = "fmoesim-trace"


#: the ``fmoesim-trace synth`` flags that set a knob of ``SyntheticConfig``
SYNTH_FLAGS = {
    "num_requests": "--requests",
    "seed": "--seed",
    "arrivals_csv": "--arrivals",
    "arrival_rate_rps": "--rate",
}


def _parse_set(items: list[str]) -> dict[str, object]:
    """``key=value`` pairs for SyntheticConfig, values typed like the field (its
    annotation: ``float | None`` takes a number or ``null``)."""
    import typing

    from fmoesim.workload.synthetic import SyntheticConfig

    hints = typing.get_type_hints(SyntheticConfig)
    out: dict[str, object] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError("--set", item, "must be key=value")
        if key not in hints:
            raise ConfigError(
                f"--set {key}", value, f"unknown knob; valid: {', '.join(sorted(hints))}"
            )
        union = typing.get_args(hints[key]) or (hints[key],)  # (str, None) for str | None
        kind = next(t for t in union if t is not type(None))
        if type(None) in union and value.lower() in ("null", "none"):
            out[key] = None
            continue
        try:
            out[key] = int(value) if kind is int else float(value) if kind is float else value
        except ValueError:
            what = "an integer" if kind is int else "a number"
            raise ConfigError(f"--set {key}", value, f"must be {what}") from None
    return out


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``fmoesim-trace``."""
    p = ArgumentParser(
        prog=PROG, description="Inspect, validate and synthesise MoE routing traces."
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ins = sub.add_parser("inspect", help="print shape, sizes and per-layer statistics")
    ins.add_argument("path")
    val = sub.add_parser(
        "validate", help="check every rule of the trace format (tokens.parquet included)"
    )
    val.add_argument("path")
    arr = sub.add_parser(
        "arrivals",
        help="summarise an arrival log (Azure CSV or Mooncake .jsonl): rate, burstiness, lengths",
    )
    arr.add_argument("path", help="the arrival log")
    arr.add_argument("--limit", type=int, default=None, help="read its first N requests only")
    arr.add_argument(
        "--sample",
        type=int,
        default=None,
        metavar="N",
        help="write N requests drawn at random (kept in time order) to --out, as an Azure-format "
        "CSV, and report on them",
    )
    arr.add_argument("--seed", type=int, default=0, help="the draw's seed for --sample (0)")
    arr.add_argument("--out", default=None, help="the CSV --sample writes")
    arr.add_argument("--force", action="store_true", help="replace an existing --out file")
    syn = sub.add_parser("synth", help="generate a synthetic trace (fmoesim/workload/synthetic.py)")
    syn.add_argument("out", help="destination trace directory")
    syn.add_argument(
        "--model", default="mixtral-8x7b", help="model preset (conf/model/; mixtral-8x7b)"
    )
    syn.add_argument("--requests", type=int, default=None, help="number of requests")
    syn.add_argument("--seed", type=int, default=None)
    syn.add_argument(
        "--arrivals",
        default=None,
        help="arrival log for lengths and arrival times: an Azure-format CSV "
        "(TIMESTAMP,ContextTokens,GeneratedTokens; TIMESTAMP: ISO 8601 date-times or numbers "
        "of seconds) or a Mooncake .jsonl trace (timestamp in ms, input_length, output_length)",
    )
    syn.add_argument("--rate", type=float, default=None, help="Poisson arrival rate (req/s)")
    syn.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="any SyntheticConfig knob, e.g. skew=2.0 (repeatable)",
    )
    syn.add_argument("--force", action="store_true", help="replace an existing directory")
    imp = sub.add_parser("import", help="convert a trace of another format (top-k only)")
    imp.add_argument("format", choices=("table", "vllm-routed-experts", "vllm-routes", "eamc"))
    imp.add_argument(
        "src",
        help="table: a CSV/TSV/JSONL/Parquet route table; vllm-routed-experts: .npy/.npz/.json "
        "of (tokens, layers, top_k) expert ids; vllm-routes: a .jsonl route log or a directory "
        "of them; eamc: an EAMC .npy",
    )
    imp.add_argument("out", help="destination trace directory")
    imp.add_argument(
        "--model",
        required=True,
        help="the logged model's preset (conf/model/): a log does not say which model it is",
    )
    imp.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="tokens of each request's prefill (default: what a phase column says, else 1)",
    )
    from fmoesim.trace.table import COLUMNS

    imp.add_argument(
        "--map",
        default="",
        metavar="KEY=COLUMN,...",
        help=f"table, vllm-routes: the column of a key ({', '.join(COLUMNS)}) where its name "
        "is not one of the usual ones; KEY=- for none",
    )
    imp.add_argument(
        "--top-k",
        type=int,
        default=None,
        help="table, vllm-routes: experts per token, for a run made with fewer",
    )
    imp.add_argument("--force", action="store_true", help="replace an existing directory")
    return p


def _mapping(text: str) -> dict[str, str]:
    """``--map request=req,position=tok`` as a dict."""
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, col = part.partition("=")
        if not sep or not key or not col:
            raise ConfigError("--map", part, "KEY=COLUMN pairs separated by commas")
        out[key.strip()] = col.strip()
    return out


def _write_sample(args: argparse.Namespace) -> str:
    """``fmoesim-trace arrivals --sample N --out FILE``: write the sample (atomically;
    an existing file only with ``--force``) and return its path."""
    from pathlib import Path

    from fmoesim.atomic import atomic_file
    from fmoesim.workload.arrival_samples import sample_arrivals
    from fmoesim.workload.synthetic import read_arrivals

    if args.sample is None or args.out is None:
        given, missing = ("--out", "--sample") if args.sample is None else ("--sample", "--out")
        raise ConfigError(missing, None, f"is needed with {given}")
    if args.sample < 1:
        raise ConfigError("--sample", args.sample, "must be an integer >= 1")
    out = Path(args.out)
    if out.exists() and not (args.force and out.is_file()):
        what = "exists (--force replaces it)" if out.is_file() else "exists and is not a file"
        raise FmoesimError(f"{out}: {what}")
    lens = read_arrivals(args.path, args.limit)
    assert lens.arrival_s is not None
    if args.sample > len(lens.arrival_s):
        raise ConfigError(
            "--sample", args.sample, f"more than the {len(lens.arrival_s)} requests of {args.path}"
        )
    text = sample_arrivals(lens.prompt, lens.output, lens.arrival_s, args.sample, args.seed)
    with atomic_file(out) as tmp:
        tmp.write_text(text)
    return str(out)


def format_arrivals(path: str, limit: int | None = None) -> str:
    """``fmoesim-trace arrivals``' report on the arrival log ``path`` (its first
    ``limit`` requests if given): requests, span, rate, the gaps' burstiness, the
    lengths, and the gamma arrivals that follow its rate and burstiness."""
    import math
    from pathlib import Path

    from fmoesim.workload.arrival_samples import arrival_summary
    from fmoesim.workload.synthetic import read_arrivals

    lens = read_arrivals(path, limit)
    assert lens.arrival_s is not None
    s = arrival_summary(lens.prompt, lens.output, lens.arrival_s)
    kind = "Mooncake JSON lines" if Path(path).suffix.lower() == ".jsonl" else "Azure CSV"
    lines = [f"{path} ({kind}): {counted(s['requests'], 'request')} over {s['span_s']:,.1f} s"]
    if math.isnan(s["rate_rps"]):
        lines.append("rate           n/a (every request arrives at once)")
    else:
        lines.append(f"rate           {s['rate_rps']:.4g} requests/s")
        cv = "n/a" if math.isnan(s["gap_cv"]) else f"{s['gap_cv']:.3g}"
        lines.append(f"gaps           mean {s['gap_mean_s']:.4g} s, coefficient of variation {cv}")
    for name in ("prompt", "output"):
        q = s[name]
        lines.append(
            f"{name} tokens  mean {q['mean']:,.0f}, p50 {q['p50']:,.0f}, p90 {q['p90']:,.0f}, "
            f"p99 {q['p99']:,.0f}, max {q['max']:,}"
        )
    if not (math.isnan(s["rate_rps"]) or math.isnan(s["gap_cv"])):
        lines.append(
            "as gamma arrivals: serving.mode=online serving.arrivals=gamma "
            f"serving.rate_rps={s['rate_rps']:.4g} serving.arrival_cv={s['gap_cv']:.3g}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``fmoesim-trace`` (exit contract: :mod:`fmoesim.errors`)."""
    run_or_exit(PROG, lambda: _run(build_parser().parse_args(argv)))


def _run(args: argparse.Namespace) -> None:
    from fmoesim.trace.reader import read_trace, validate_trace

    if args.cmd == "inspect":
        from fmoesim.trace.stats import format_report

        print(format_report(read_trace(args.path)))
    elif args.cmd == "validate":
        t = validate_trace(args.path)
        print(
            f"{args.path}: valid ({counted(t.num_requests, 'request')}, "
            f"{counted(t.num_iterations, 'iteration')}, "
            f"{t.num_layers} layers x {t.num_experts} experts)"
        )
    elif args.cmd == "arrivals":
        if args.limit is not None and args.limit < 1:
            raise ConfigError("--limit", args.limit, "must be an integer >= 1")
        if args.sample is None and args.out is None:
            print(format_arrivals(args.path, args.limit))
        else:  # the report is the sample's
            print(format_arrivals(_write_sample(args)))
    elif args.cmd == "import":
        from fmoesim.config.build import load_preset
        from fmoesim.specs.model import ModelSpec
        from fmoesim.trace.importers import import_eamc

        given = {"--map": bool(args.map), "--top-k": args.top_k is not None,
                 "--prompt-tokens": args.prompt_tokens is not None}  # fmt: skip
        uses = {"table": set(given), "vllm-routes": set(given),
                "vllm-routed-experts": {"--prompt-tokens"}, "eamc": set()}  # fmt: skip
        takes = uses[args.format]
        unused = [flag for flag, on in given.items() if on and flag not in takes]
        if unused:  # it would be ignored: the trace would not be what was asked
            of = "of --map, --prompt-tokens and --top-k"
            rule = f"{', '.join(sorted(takes))} alone {of}" if takes else f"none {of}"
            raise FmoesimError(
                f"{unused[0]}: import {args.format} does not use it (rule: it takes {rule})"
            )
        model = load_preset("model", args.model, ModelSpec)
        if args.format in ("table", "vllm-routes"):  # a vLLM route log is a route table
            from fmoesim.trace.table import import_table

            path, rep = import_table(
                args.src, args.out, model, mapping=_mapping(args.map),
                prompt_tokens=args.prompt_tokens, top_k=args.top_k, overwrite=args.force,
                fmt=args.format,
            )  # fmt: skip
            for line in rep.lines():
                print(line)
            note = ""
        elif args.format == "vllm-routed-experts":
            from fmoesim.trace.table import import_routed_experts

            path = import_routed_experts(
                args.src, args.out, model, prompt_tokens=args.prompt_tokens, overwrite=args.force
            )
            note = ""
        else:
            path, note = import_eamc(args.src, args.out, model, overwrite=args.force), ""
        from fmoesim.trace.schema import MANIFEST, TraceManifest

        man = TraceManifest.load(path / MANIFEST)  # the importer read the trace back
        print(
            f"wrote {path}: {counted(man.num_requests, 'request')}, "
            f"{counted(man.num_iterations, 'iteration')} "
            f"({model.name}, top-k only: no probabilities){note}"
        )
    elif args.cmd == "synth":
        from fmoesim.config.build import load_preset
        from fmoesim.specs.model import ModelSpec
        from fmoesim.workload.synthetic import SyntheticConfig, generate

        model = load_preset("model", args.model, ModelSpec)
        knobs = _parse_set(args.set)
        if args.requests is not None:
            knobs["num_requests"] = args.requests
        if args.seed is not None:
            knobs["seed"] = args.seed
        if args.arrivals is not None:
            knobs["arrivals_csv"] = args.arrivals
        if args.rate is not None:
            knobs["arrival_rate_rps"] = args.rate
        cfg = SyntheticConfig(**knobs)  # type: ignore[arg-type]
        try:
            path = generate(model, cfg, args.out, overwrite=args.force, progress=True)
        except ConfigError as e:  # name the flag the knob came from, not the config key
            knob = e.key.removeprefix("workload.synthetic.")
            if knob == e.key:
                raise
            raise ConfigError(SYNTH_FLAGS.get(knob, f"--set {knob}"), e.value, e.rule) from None
        t = read_trace(path)
        print(
            f"wrote {path}: {counted(t.num_requests, 'request')}, "
            f"{counted(t.num_iterations, 'iteration')} "
            f"({model.name}: {model.num_layers} x {model.num_experts}, top-{model.top_k})"
        )


if __name__ == "__main__":
    main()
