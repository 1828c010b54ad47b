"""``batchline run``: argument parsing, the progress bar and the summary table.

Only the standard library is imported at the top: ``batchline --help`` must work without
the ``jobs`` extra.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._errors import InputError
from batchline.datasets.selection import add_dataset_arguments, dataset_options
from batchline.jobs.stopping import report_stop, sigterm_as_interrupt
from batchline.knobs import parse_set_options
from batchline.models.config import (
    SHARED_HELP,
    Knobs,
    add_generation_knob_arguments,
    add_knob_arguments,
    generation_knobs_typed,
)
from batchline.models.selection import add_model_arguments, model_options

if TYPE_CHECKING:
    from rich.console import Console

    from batchline.jobs.display import RateBar
    from batchline.jobs.job import Job
    from batchline.jobs.options import RunOptions

__all__ = ["add_parser", "given_flags"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "run",
        help="batch inference over a dataset file (or the built-in demo corpus), resumable",
        description=(
            "Offline batch inference: run every record of INPUT through the model and write "
            "the results to OUTPUT, a directory of Parquet/JSONL chunks plus _manifest.json. "
            "Without INPUT, embeds the built-in demo corpus (Python standard library "
            "docstrings). A killed run continues with --resume."
        ),
    )
    p.add_argument(
        "input",
        nargs="?",
        type=Path,
        help=".jsonl, .csv, .parquet, .txt or .npy (tensors) file; a folder of pictures; .tar "
        "shards (a file, a folder, or a brace pattern: shards/{00000..00099}.tar)",
    )
    add_model_arguments(p, several=True)
    add_dataset_arguments(p, suffix="embeddings (STEM.results for other tasks)")
    p.add_argument(
        "--input-column",
        action="append",
        default=[],
        dest="input_columns",
        metavar="NAME",
        help="predict: a column of tensors (list values) named as the model input it feeds "
        "(repeatable); for a .npy input, the model input's name (default: the model's only one); "
        "score: the query column, then the document column (default: query and document)",
    )
    p.add_argument("--chunk-size", type=int, default=10_000, help="records per output chunk")
    p.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="keep results in DIR across runs, and take those an earlier run computed for the "
        "same model files, options and input (a re-run after editing a few records computes "
        "only those); embed, classify, score and generate jobs (greedy or seeded prompts: "
        "sampling without a seed is computed every time)",
    )
    p.add_argument(
        "--cache-size",
        metavar="SIZE",
        default="1GiB",
        help="with --cache: at most this much (default 1GiB); past it, the least recently used "
        "results go first",
    )
    p.add_argument(
        "--no-dedupe",
        dest="dedupe",
        action="store_false",
        help=SHARED_HELP["--no-dedupe"] + ". An input is a text, a score pair, or a prompt with "
        "greedy or seeded settings; a module:factory model's records are always computed",
    )
    add_knob_arguments(p)
    p.add_argument("--quiet", action="store_true", help=SHARED_HELP["--quiet"])
    _add_image_arguments(p)
    _add_generation_arguments(p)
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local (default): this process; ray: model replicas on a Ray cluster",
    )
    p.add_argument("--address", help="with --engine ray: 'auto' or HOST:PORT (default: start Ray)")
    p.add_argument("--replicas", type=int, help="with --engine ray: model replicas (default: 2)")
    p.add_argument(
        "--cpus-per-replica",
        type=float,
        help="with --engine ray: CPUs each replica reserves, and on CPU its threads (default 1; "
        "on a node of C cores, replicas x CPUs per replica = C)",
    )
    p.set_defaults(func=_main)


#: Generation flags beside the knobs' (``generation_knobs_typed``): argparse destination ->
#: flag (None when not given).
_GENERATION_FLAGS = {
    "max_tokens": "--max-tokens",
    "temperature": "--temperature",
    "top_p": "--top-p",
    "seed": "--seed",
    "n": "--n",
    "logprobs": "--logprobs",
    "stop": "--stop",
    "no_chat_template": "--no-chat-template",
    "no_prefix_ordering": "--no-prefix-ordering",
    "prompt_column": "--prompt-column",
    "response_format": "--response-format",
}


def _add_generation_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "text generation (--task generate; --model smollm2 or PATH/)",
        "Without INPUT: the built-in math word problems. Prompts come from --prompt-column "
        "(default: each record's prompt, else its messages, else its text, so a file may mix "
        "them): text, or a list of {role, content} chat messages. The output's text column "
        "holds each completion.",
    )
    g.add_argument(
        "--max-tokens",
        type=int,
        help="tokens to generate per prompt, at most (256); a record's own max_tokens wins",
    )
    g.add_argument("--temperature", type=float, help="0 (default): greedy; > 0: sample")
    g.add_argument("--top-p", type=float, help="nucleus sampling mass, in (0, 1] (default 1)")
    g.add_argument(
        "--seed", type=int, help="sampling seed: record i draws from SEED + i (repeatable)"
    )
    g.add_argument(
        "--n",
        type=int,
        metavar="N",
        help="completions per prompt (default 1): a row lists them in texts and "
        "finish_reasons, text is the first; one prefill serves the N (with --seed, sample j "
        "of record i draws from SEED + i*N + j)",
    )
    g.add_argument(
        "--logprobs",
        type=int,
        metavar="K",
        help="keep each completion's token log-probabilities, with the K most likely "
        "alternatives of each token (0-20), in a logprobs column: JSON text in the shape of "
        "OpenAI's completions logprobs (a list of them with --n)",
    )
    g.add_argument(
        "--response-format",
        metavar="JSON",
        help="constrain every completion (structured outputs): an OpenAI response_format "
        '(\'{"type": "json_object"}\', \'{"type": "json_schema", "json_schema": {"schema": '
        "...}}') or a bare JSON schema, as JSON text or @FILE; a record's own response_format, "
        "guided_json, guided_regex or guided_choice field wins",
    )
    g.add_argument(
        "--stop",
        action="append",
        metavar="TEXT",
        help="end a completion where TEXT appears, TEXT left out (repeatable)",
    )
    g.add_argument(
        "--no-chat-template",
        action="store_true",
        default=None,
        help="encode text prompts as they are, not as a chat message through the template",
    )
    g.add_argument("--prompt-column", metavar="NAME", help="the column holding the prompts")
    g.add_argument(
        "--no-prefix-ordering",
        action="store_true",
        default=None,
        help="submit prompts in input order (default: each window of 2,048 prompts grouped by "
        "shared prefix, so that the prefix cache serves them; outputs stay in input order)",
    )
    add_generation_knob_arguments(g)


def add_torch_generation_arguments(g: argparse._ActionsContainer) -> None:
    """``--dtype`` and ``--max-step-tokens`` alone (the name other commands used; the knob
    flags now come from :func:`batchline.models.config.add_generation_knob_arguments`)."""
    add_generation_knob_arguments(g, ("dtype", "max_step_tokens"))


def _add_image_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "pictures (INPUT a folder of pictures, .tar shards, or a file with --image-column)",
        "Pictures are decoded and preprocessed in worker processes while the model runs.",
    )
    g.add_argument(
        "--image-column",
        metavar="NAME",
        help="the CSV, JSONL or Parquet column holding pictures: paths (relative to the file) "
        "or bytes (default for an image model: image)",
    )
    g.add_argument(
        "--image-size",
        type=int,
        metavar="N",
        help="a plain .onnx image model: the side of its square input (default: the graph's); "
        "pictures are resized to N/0.875 on the shorter side and center-cropped to N",
    )
    g.add_argument(
        "--mean", type=_three_floats, metavar="R,G,B", help="normalization mean (ImageNet's)"
    )
    g.add_argument(
        "--std", type=_three_floats, metavar="R,G,B", help="normalization std (ImageNet's)"
    )
    g.add_argument(
        "--decode-workers",
        type=int,
        metavar="N",
        help="decode worker processes (default: one per core, as many decoding at once as "
        "keep up with the model, measured on the first pictures)",
    )
    g.add_argument(
        "--no-draft",
        dest="draft",
        action="store_false",
        help="decode every JPEG at full size (default: at 1/2, 1/4 or 1/8 scale when the "
        "model's input is that much smaller)",
    )
    g.add_argument(
        "--max-image-pixels",
        type=int,
        metavar="N",
        help="refuse pictures declaring more pixels than this (default 178,956,970)",
    )
    g.add_argument(
        "--decode-memory",
        metavar="SIZE",
        default="256MiB",
        help="pictures in flight at most, files and decoded inputs (default 256MiB): the "
        "reader waits past it",
    )


def _three_floats(text: str) -> tuple[float, float, float]:
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected three numbers R,G,B, got {text!r}") from None
    if len(values) != 3:
        raise argparse.ArgumentTypeError(f"expected three numbers R,G,B, got {text!r}")
    return values[0], values[1], values[2]


def _decode_options(args: argparse.Namespace) -> Any:
    from batchline.models.image import DEFAULT_MAX_PIXELS, DecodeOptions

    given = args.max_image_pixels
    if given is not None and given < 1:  # 0 is not "no limit": a picture bomb stays refused
        raise InputError(f"--max-image-pixels must be >= 1, got {given}")
    try:
        return DecodeOptions(
            workers=args.decode_workers,
            draft=args.draft,
            max_pixels=DEFAULT_MAX_PIXELS if given is None else given,
            max_bytes_in_flight=_size(args.decode_memory, "--decode-memory"),
        )
    except ValueError as exc:
        raise InputError(str(exc)) from None


def given_flags(args: argparse.Namespace, flags: dict[str, str]) -> list[str]:
    """Which of ``flags`` (argparse destination -> flag) the command line gave."""
    return [flag for dest, flag in flags.items() if getattr(args, dest) is not None]


def _knobs(args: argparse.Namespace) -> Knobs:
    """The knobs of ``--config`` (or the defaults), updated with ``--set`` and then with every
    flag named after a knob."""
    from batchline.knobs import check_setting_names

    knobs = Knobs.load(args.config) if args.config else Knobs()
    names = {f.name for f in dataclasses.fields(Knobs)}
    changes = parse_set_options(args.set)
    check_setting_names(changes, names, where="--set")
    if "sessions" in changes and "max_concurrent_batches" not in changes:
        changes["max_concurrent_batches"] = changes["sessions"]
    changes.update({k: v for k, v in vars(args).items() if k in names and v is not None})
    if args.sessions is not None and args.max_concurrent_batches is None:
        changes["max_concurrent_batches"] = args.sessions
    return knobs.replace(**changes)


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from batchline.jobs.display import print_summary
    from batchline.jobs.run import RunOptions, run

    if args.chunk_size < 1:
        raise InputError(f"--chunk-size must be >= 1, got {args.chunk_size}")
    models = args.model or ["default"]
    options = RunOptions(
        # --model repeats for an OpenAI batch file only (_resolve); the first is the job's
        **{**model_options(args), "model": models[0]},
        **{
            **dataset_options(args),
            # an OpenAI batch file is JSONL underneath (a generate job: _resolve)
            "input_format": "jsonl" if args.input_format == "openai-batch" else args.input_format,
        },
        input_columns=args.input_columns,
        chunk_size=args.chunk_size,
        dedupe=args.dedupe,
        cache=args.cache,
        cache_bytes=_cache_bytes(args.cache_size),
        knobs=_knobs(args),
        image_column=args.image_column,
        image_size=args.image_size,
        mean=args.mean,
        std=args.std,
        decode=_decode_options(args),
    )
    ray_flags = (args.address, args.replicas, args.cpus_per_replica)
    if args.engine != "ray" and any(flag is not None for flag in ray_flags):
        raise InputError("--address, --replicas and --cpus-per-replica go with --engine ray")
    if args.engine == "ray" and args.cache is not None:
        raise InputError("--cache goes with the local engine; --engine ray runs without it")
    job = _resolve(args, options)
    options, generating = job.options, job.generates
    console = Console(stderr=True)
    show = not args.quiet and console.is_terminal
    bar = (_generation_bar(console) if generating else _bar(console)) if show else None
    stopped_by: list[str] = []
    restore = sigterm_as_interrupt(stopped_by)
    said = None if args.quiet else _say_model_loads()
    try:
        # --engine ray is dispatched from the top (batchline.__main__): no command imports
        # integrations/
        summary = run(job, bar) if args.engine == "local" else args.on_ray(job, args, bar)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        return report_stop("run", stopped_by, _output_dir(job), args)
    finally:
        restore()
        if said is not None:
            for name in _LOAD_LOGGERS:
                logger = logging.getLogger(name)
                logger.removeHandler(said)
                logger.propagate = True
        if bar is not None:
            bar.close()
    if summary.empty_texts and options.on_bad_record == "fail" and not args.quiet:
        print(
            f"batchline run: warning: {summary.empty_texts:,} record(s) had empty text and ran "
            "as such; --on-bad-record skip lists them in _skipped.jsonl instead",
            file=sys.stderr,
        )
    if not args.quiet:
        print_summary("batchline run", summary.rows())
    return 0


def _cache_bytes(text: str) -> int:
    return _size(text, "--cache-size")


def _size(text: str, flag: str) -> int:
    from batchline._residency import parse_bytes

    try:
        size = parse_bytes(text)
    except ValueError as exc:
        raise InputError(f"{flag}: {exc}") from None
    if size < 1:
        raise InputError(f"{flag} must be positive, got {text!r}")
    return size


#: The loggers whose lines say what a model was found to be and what runs it: a predict model's
#: and a generator's (its dtype, weights and kernels, the bytes a step reads, and why).
_LOAD_LOGGERS = ("batchline.models", "batchline.generation")


def _say_model_loads() -> logging.Handler:
    """Print what a model folder was found to be, and what runs it, as ``serve`` logs it
    (``emb: sentence-transformers folder (BertModel, mean pooling, ...) -> ONNX (...)``; a
    generator's load line, from its engine process too)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("batchline run: %(message)s"))
    handler.setLevel(logging.INFO)
    for name in _LOAD_LOGGERS:
        logger = logging.getLogger(name)
        logger.addHandler(handler)
        # said here alone: ONNX Runtime's quantizer logs through the root logger
        # (logging.info), which gives the root a handler of its own, and each line would be
        # printed twice
        logger.propagate = False
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)
    return handler


def _output_dir(job: Job) -> Path | None:
    """The folder a job commits its chunks to (its kind's ``out_dir``; None where it cannot
    be told)."""
    from batchline.jobs.kinds import kind_of

    try:
        out_dir = kind_of(job).out_dir
        return None if out_dir is None else out_dir(job)
    except Exception:  # the message goes out anyway, without the count
        return None


def _resolve(args: argparse.Namespace, options: RunOptions) -> Job:
    """The job ``options`` describe (``resolve_job``, the one decision of what a job is), a
    generation job's with the sampling flags (elsewhere, generation flags are refused).
    ``--model`` repeats for an OpenAI batch file alone."""
    from batchline.jobs.kinds import resolve_job
    from batchline.jobs.options import GenerateOptions, SeveralModelsError

    given = given_flags(args, _GENERATION_FLAGS)
    given += generation_knobs_typed(args, parse_set_options(args.set))
    forced = args.input_format == "openai-batch"
    models = tuple(args.model or ())
    several = models if len(models) > 1 else ()
    if several and options.input is not None and not options.input.exists():
        raise InputError(f"{options.input}: no such file or folder")
    if forced or several:  # an OpenAI batch file is a generation job, whatever its models
        values = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
        options = GenerateOptions(**values, openai_batch=forced, models=several)
    try:
        job = resolve_job(options)
    except SeveralModelsError:
        raise InputError(
            "--model repeats only for an OpenAI batch file (each line's body.model picks "
            "one); run one model at a time on other inputs"
        ) from None
    if not job.generates:
        if given:
            raise InputError(
                f"{given[0]} goes with text generation (--task generate, --model smollm2 or a "
                "Hugging Face model folder PATH/)"
            )
        return job
    if args.input_columns:
        raise InputError(
            "--input-column goes with predict models; generation reads --prompt-column"
        )
    sampling: dict[str, Any] = {  # argparse's values, checked by GenerateOptions.sampling
        name: getattr(args, name)
        for name in ("max_tokens", "temperature", "top_p", "seed", "n", "logprobs", "prompt_column")
        if getattr(args, name) is not None
    }
    if args.stop:
        sampling["stop"] = tuple(args.stop)
    if args.response_format is not None:
        sampling["response_format"] = _json_argument(args.response_format, "--response-format")
    if args.no_chat_template:
        sampling["chat_template"] = False
    if args.no_prefix_ordering:
        sampling["prefix_ordering"] = False
    return dataclasses.replace(job, options=dataclasses.replace(job.options, **sampling))


def _generation_bar(console: Console) -> RateBar:
    from batchline.jobs.display import RateBar

    return RateBar(console, "prompts", "tokens")


def _bar(console: Console) -> RateBar:
    from batchline.jobs.display import RateBar

    return RateBar(console, "records", "utilization")


def _json_argument(value: str, flag: str) -> str:
    """``value``, or the text of the file it names as ``@FILE``."""
    if not value.startswith("@"):
        return value
    try:
        return Path(value[1:]).read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"{flag} {value}: cannot read the file: {exc.strerror}") from None
