"""``batchline bench`` and ``batchline tune``: argument parsing and terminal output.

Only the standard library is imported at the top: ``batchline --help`` must work without the
``bench`` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._flags import flag_name
from batchline.datasets.selection import add_text_column_argument
from batchline.knobs import (
    SHARED_HELP,
    add_deprecated_flag,
    add_device_argument,
    add_generation_knob_arguments,
)
from batchline.models.selection import ModelSelection, add_model_arguments, model_options

if TYPE_CHECKING:
    from batchline.bench.tune import Candidate

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench`` and ``tune`` on the ``batchline`` subcommand parser."""
    _add_bench(sub)
    _add_tune(sub)


def _model_and_inputs(p: argparse.ArgumentParser) -> None:
    """The flags of a ``MeasuredModel`` (``bench/runner.py``): bench's and tune's."""
    add_model_arguments(p)  # the model flags of 'batchline run'
    add_device_argument(p, default="cpu")
    p.add_argument(
        "--inputs",
        type=Path,
        metavar="FILE",
        help="what to send: texts (.jsonl, .csv, .parquet, .txt) for embed/classify; rows of "
        "tensors (.npy, or JSONL/Parquet list columns named as the model's inputs) for predict; "
        "records (JSONL, CSV, Parquet rows) for module:factory. Default: a sample of the demo "
        "corpus, or random tensors shaped from the model's inputs (seeded)",
    )
    add_text_column_argument(p)
    p.add_argument(
        "--lengths",
        choices=["short", "mixed"],
        help="cut texts to ~8-24 (short) or ~8-128 (mixed) tokens; default: mixed for the demo "
        "corpus, as they are for --inputs",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the sample and arrival schedule")


def _add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="measure throughput and latency of batching configurations under load",
        description=(
            "Drive any model 'batchline run' takes (--model default, PATH.onnx with --task, "
            "module:factory) with a closed loop (N concurrent clients) or an open loop (Poisson "
            "arrivals at a rate, latency from the intended send time) and compare, in the same "
            "run: the no-batching baseline, batchline's defaults, your --config files and a "
            "classic timeout batcher. Or drive a server (--target URL). Writes "
            "OUTPUT/report.md with a table and PNG plots. With a text generator (--task "
            "generate, --model smollm2 or PATH/): sequential, static and continuous batching "
            "on the same loaded model (see the text generation options)."
        ),
    )
    _model_and_inputs(p)
    p.add_argument(
        "--target",
        default="inprocess",
        help="'inprocess' (default) or the URL of a batchline server",
    )
    p.add_argument(
        "--protocol",
        dest="route",
        choices=["openai", "oip"],
        default="openai",
        help="with a URL: openai (POST /v1/embeddings, texts; default) or oip (the Open "
        "Inference Protocol, POST /v2/models/NAME/infer with --model NAME)",
    )
    add_deprecated_flag(p, "--route", "--protocol", dest="route", choices=["openai", "oip"])
    p.add_argument(
        "--load",
        action="append",
        metavar="SPEC",
        help="closed:N,N,... (concurrent clients) or open:RATE,... (records/s); repeatable; "
        "default closed:1,8,32,64 (text generation: closed:16; open rates are requests/s)",
    )
    p.add_argument(
        "--duration", type=float, default=5.0, metavar="S", help="seconds per load point (5)"
    )
    p.add_argument(
        "--config",
        action="append",
        type=Path,
        default=[],
        dest="configs",
        metavar="FILE",
        help=SHARED_HELP["--config"] + "; repeatable: each file is one configuration compared",
    )
    p.add_argument(
        "--compare",
        default="baseline,defaults,classic",
        metavar="LIST",
        help="reference configurations to include: baseline, defaults, classic, or none "
        "(default: all three)",
    )
    p.add_argument("--warmup", type=float, default=1.0, metavar="S", help="warm-up per config")
    p.add_argument(
        "-o", "--output", type=Path, default=Path("report"), help="report folder (report/)"
    )
    p.add_argument("--quiet", action="store_true", help=SHARED_HELP["--quiet"])
    _add_generate_arguments(p)
    p.set_defaults(func=_bench_main)


#: The generation knobs bench --task generate takes, each the knob's own flag.
_BENCH_KNOBS = ("kv_token_budget", "max_running_sequences", "dtype", "max_step_tokens")
#: bench's text-generation flags: dest -> flag (refused without --task generate)
_GENERATE_FLAGS = {
    "requests": "--requests",
    "sequential_requests": "--sequential-requests",
    "repeats": "--repeats",
    "min_new": "--min-new",
    "max_new": "--max-new",
    "generators": "--generators",
    "threads": "--threads",
    **{name: flag_name(name) for name in _BENCH_KNOBS},
}


def _add_generate_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "text generation (--task generate; implied by --model smollm2 or PATH/)",
        "Sequential, static and continuous batching on the same loaded model, in one run, "
        "and vLLM's engine on the same model beside them (--generators ...,vllm): "
        "the demo math prompts, each generating exactly max_tokens (drawn between --min-new "
        "and --max-new, seeded; ignore_eos), at each --load point (default closed:16), in "
        "interleaved repeats. Prints tokens/s (and its ratio to sequential's), request "
        "latency and TTFT p50/p99 per configuration and point, the dtype each computed in, and "
        "the ratios continuous/static throughput (goal >= 1.3), "
        "p99 latency (<= 0.8), TTFT p99 (<= 0.5) and continuous/sequential throughput "
        "(>= 2.5); writes report.md, results.json and plots into --output.",
    )
    g.add_argument("--requests", type=int, metavar="N", help="requests per batched run (32)")
    g.add_argument(
        "--sequential-requests", type=int, metavar="N", help="requests per sequential run (6)"
    )
    g.add_argument("--repeats", type=int, metavar="N", help="interleaved repeats (2)")
    g.add_argument("--min-new", type=int, metavar="N", help="fewest tokens a request asks for (8)")
    g.add_argument("--max-new", type=int, metavar="N", help="most tokens a request asks for (128)")
    g.add_argument(
        "--generators",
        metavar="LIST",
        help="configurations to compare: sequential, static, continuous (default: these "
        "three), and vllm: the same model, dtype and --max-running-sequences on vLLM's engine, "
        "started for each of its turns (needs vLLM: bash scripts/vllm_env.sh)",
    )
    g.add_argument(
        "--threads",
        type=int,
        metavar="N",
        help="torch intra-op threads on CPU (default: every core in float32, one in bfloat16)",
    )
    add_generation_knob_arguments(
        g,
        _BENCH_KNOBS,
        more={
            "kv_token_budget": "bench: of the batched generators (default: max running "
            "sequences x (longest prompt + --max-new))",
            "max_running_sequences": "bench: continuous's cap (default 16)",
        },
    )


def _add_tune(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "tune",
        help="find the batching knobs with the most throughput within a p99 budget",
        description=(
            "Search the batching knobs (padded tokens per batch, sessions x threads, batches in "
            "flight, holding for company) on the real model (any --model 'batchline run' takes) "
            "and load shape, with this machine's cores (or a GPU's sizes with --device cuda); "
            "report the setting "
            "with the highest throughput whose p99 latency stays within --p99-ms, write it as "
            "a config file for 'batchline run/serve --config', and say so plainly when batching "
            "does not pay or when nothing meets the budget (exit code 1, no file written)."
        ),
    )
    p.add_argument("--p99-ms", type=float, required=True, metavar="N", help="p99 latency budget")
    _model_and_inputs(p)
    p.add_argument(
        "--load",
        action="append",
        metavar="SPEC",
        help="load shape to tune at: closed:N,... or open:RATE,...; default closed:8,32,64",
    )
    p.add_argument(
        "--budget-s", type=float, default=120.0, metavar="S", help="total time to spend (120)"
    )
    p.add_argument(
        "--duration",
        type=float,
        metavar="S",
        help="seconds per load point (default: planned from --budget-s)",
    )
    p.add_argument(
        "--noise",
        type=float,
        default=0.10,
        help="throughput difference treated as noise when comparing with the baseline (0.10)",
    )
    p.add_argument(
        "-o", "--output", type=Path, default=Path("tuned.json"), help="config file (tuned.json)"
    )
    p.add_argument("--quiet", action="store_true", help=SHARED_HELP["--quiet"])
    p.set_defaults(func=_tune_main)


def _command(name: str) -> str:
    return shlex.join(["batchline", name, *sys.argv[2:]]) if len(sys.argv) > 1 else ""


def _measured(args: argparse.Namespace) -> dict[str, Any]:
    """The ``MeasuredModel`` fields as :func:`_model_and_inputs` parsed them."""
    from batchline.bench.runner import MeasuredModel

    return {f.name: getattr(args, f.name) for f in dataclasses.fields(MeasuredModel)}


def _generates(args: argparse.Namespace) -> bool:
    """``--task generate``, or a model that generates (``smollm2``, ``PATH/``)."""
    if args.task is not None:
        return bool(args.task == "generate")
    from batchline.models.specs import parse_spec

    return bool(parse_spec(args.model).generates)


def _bench_main(args: argparse.Namespace) -> int:
    from batchline._errors import InputError
    from batchline.jobs.cli import given_flags

    if _generates(args):
        return _bench_generate_main(args)
    given = given_flags(args, _GENERATE_FLAGS)
    if given:
        raise InputError(
            f"{given[0]} goes with text generation: bench --task generate (or --model smollm2 "
            "or a Hugging Face folder PATH/)"
        )
    import matplotlib  # noqa: F401  (the report needs it: fail before measuring, not after)
    from rich.console import Console

    from batchline.bench.loadgen import parse_loads
    from batchline.bench.report import print_table, write_report
    from batchline.bench.runner import DEFAULT_LOAD, BenchOptions, run_bench

    compare = [c.strip() for c in args.compare.split(",") if c.strip()]
    if compare == ["none"]:
        compare = []
    options = BenchOptions(
        **_measured(args),
        target=args.target,
        route=args.route,
        loads=parse_loads(args.load or [DEFAULT_LOAD]),
        duration_s=args.duration,
        configs=list(args.configs),
        compare=compare,
        warmup_s=args.warmup,
        command=_command("bench"),
    )
    err = Console(stderr=True)
    say = None if args.quiet else partial(err.print, highlight=False)
    result = run_bench(options, say)
    files = write_report(result, args.output)
    if not args.quiet:
        print_table(result.points, title="batchline bench")
        err.print(f"report: {files['report']}")
    return 0


def _bench_generate_main(args: argparse.Namespace) -> int:
    import matplotlib  # noqa: F401  (the report needs it: fail before measuring, not after)
    from rich.console import Console

    from batchline._errors import InputError
    from batchline.bench.generate import (
        DEFAULT_GENERATE_LOAD,
        GenerateBenchOptions,
        run_generate_bench,
    )
    from batchline.bench.loadgen import parse_loads
    from batchline.bench.report import print_generate_table, write_generate_report

    refused = [
        ("--target", args.target != "inprocess"),
        ("--protocol", args.route != "openai"),
        ("--config", bool(args.configs)),
        ("--inputs", args.inputs is not None),
    ]
    for flag, given in refused:
        if given:
            raise InputError(
                f"{flag} does not apply to bench --task generate (in process, the demo math "
                "prompts); to load a server's generation, use batchline drive --route generate"
            )
    pick = {k: getattr(args, k) for k in _GENERATE_FLAGS if getattr(args, k) is not None}
    if "generators" in pick:
        pick["generators"] = [g.strip() for g in pick["generators"].split(",") if g.strip()]
    options = GenerateBenchOptions(
        model="smollm2" if args.model == "default" else args.model,
        loads=parse_loads(args.load or [DEFAULT_GENERATE_LOAD]),
        device=args.device,
        seed=args.seed,
        warmup=args.warmup > 0,
        command=_command("bench"),
        **pick,
    )
    err = Console(stderr=True)
    say = None if args.quiet else partial(err.print, highlight=False)
    result = run_generate_bench(options, say)
    files = write_generate_report(result, args.output)
    if not args.quiet:
        print_generate_table(result)
        err.print(f"report: {files['report']}")
    return 0


def _tune_main(args: argparse.Namespace) -> int:
    import asyncio

    from rich.console import Console
    from rich.table import Table

    from batchline.bench.loadgen import parse_loads
    from batchline.bench.report import _wide_console
    from batchline.bench.runner import DEFAULT_TUNE_LOAD, TuneOptions, run_tune
    from batchline.bench.tune import measured_notes, within_budget

    options = TuneOptions(
        p99_budget_ms=args.p99_ms,
        **_measured(args),
        loads=parse_loads(args.load or [DEFAULT_TUNE_LOAD]),
        budget_s=args.budget_s,
        duration_s=args.duration,
        noise=args.noise,
    )
    err = Console(stderr=True)
    say = None if args.quiet else partial(err.print, highlight=False)
    result, inputs = asyncio.run(run_tune(options, say))
    decision = result.decision
    table = Table(
        title=f"batchline tune: p99 budget {args.p99_ms:g} ms",
        caption=f"within budget: no errors and p99 x {1 + decision.noise:.2f} <= {args.p99_ms:g} ms"
        " (the noise margin)",
    )
    table.add_column("setting")
    for header in ("best rec/s within budget", "at load", "p99 ms there", "lowest p99 ms"):
        table.add_column(header, justify="right")
    for trial in result.trials:
        good = [p for p in trial.points if within_budget(p, args.p99_ms, margin=decision.noise)]
        best = max(good, key=lambda p: p.achieved_rps, default=None)
        lows = [p.p99_ms for p in trial.points if not p.failed]
        chosen = decision.recommended is not None and decision.recommended.knobs == trial.knobs
        table.add_row(
            trial.label + (" *" if chosen else ""),
            f"{best.achieved_rps:,.0f}" if best else "-",
            best.point.label if best else "-",
            f"{best.p99_ms:,.0f}" if best else "-",
            f"{min(lows):,.0f}" if lows else "failed",
            style="bold green" if chosen else None,
        )
    out = _wide_console()
    if decision.recommended is None:  # not a success: said even with --quiet
        out.print(table)
        out.print(decision.message, highlight=False)
        out.print("No config file written.")
        return 1
    task = {"task": args.task} if args.task else {}
    notes = measured_notes(result, points=options.loads, model=args.model, **task, inputs=inputs)
    decision.recommended.knobs.dump(args.output, measured=notes)
    if args.quiet:
        return 0
    out.print(table)
    out.print(decision.message, highlight=False)
    model = shlex.join(_model_argv(args))
    model = f" {model}" if model else ""
    out.print(
        f"Wrote {args.output}. Use it with:\n"
        f"  batchline run --config {args.output}{model}\n"
        f"  batchline serve --config {args.output}{model}\n"
        f"Check it:\n  {_check_command(args, decision.recommended)}",
        highlight=False,
        soft_wrap=True,  # commands to copy: never folded
    )
    return 0


def _model_argv(args: argparse.Namespace) -> list[str]:
    """The model flags given to tune, for the commands that use what it wrote."""
    return ModelSelection(**model_options(args)).model_argv()


def _check_command(args: argparse.Namespace, recommended: Candidate) -> str:
    """The ``batchline bench`` command that re-measures the recommendation on the same inputs."""
    argv = ["batchline", "bench", "--config", str(args.output)]
    argv += ["--load", str(recommended.point.point), "--compare", "baseline"]
    argv += _model_argv(args)
    if args.inputs is not None:
        argv += ["--inputs", str(args.inputs), "--text-column", args.text_column]
    if args.lengths is not None:
        argv += ["--lengths", args.lengths]
    if args.seed:
        argv += ["--seed", str(args.seed)]
    if args.device != "cpu":
        argv += ["--device", args.device]
    return shlex.join(argv)
