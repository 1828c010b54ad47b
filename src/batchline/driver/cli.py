"""``batchline drive``: argument parsing, the progress bar and the summary table.

Only the standard library is imported at the top: ``batchline --help`` must work without
the ``driver`` extra.

Exit codes: 0 every record has a result (bad input skipped on request does not count);
1 some records failed and are listed in ``OUTPUT/_failures.jsonl``; 2 bad input or settings,
or the job could not go on (wrong URL or key, no endpoint ready in time: rerun with
``--resume``); 130 interrupted.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.datasets.selection import add_dataset_arguments
from batchline.knobs import add_deprecated_flag
from batchline.models.config import SHARED_HELP

if TYPE_CHECKING:
    from rich.console import Console

    from batchline.driver.options import DriveOptions
    from batchline.jobs.display import RateBar

#: ``--records-per-request`` by route: a generation request of 50 prompts would take minutes
#: on a CPU server, past its request timeout (serve's default: 30 s)
RECORDS_PER_REQUEST = {"embeddings": 50, "classify": 50, "generate": 8}
#: ... and for pictures (data URIs of ~100 KB-1 MB each: a request stays under serve's 8 MiB
#: body limit, and under the 32 images per request infinity takes)
PICTURES_PER_REQUEST = 4

__all__ = ["add_parser"]


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "drive",
        help="send a dataset file to serving replicas, exactly once, resumably",
        description=(
            "Split INPUT into requests of --records-per-request records and POST them to the "
            "replicas (--endpoint, repeatable) with at most --concurrency requests in "
            "flight, each to the replica with the fewest in flight (--route generate: prompts "
            "that share a long prefix go together to one replica while it is not overloaded, "
            "so its prefix cache serves them). Connection errors, "
            "timeouts, 429 and 5xx are retried with backoff (Retry-After honoured); a replica "
            "that keeps failing is set aside and re-probed via GET /ready. Results go to "
            "OUTPUT exactly as `batchline run` writes them; records refused with another 4xx, "
            "or whose request used up --max-attempts, are listed in OUTPUT/_failures.jsonl "
            "(exit code 1). A killed drive continues with --resume."
        ),
        epilog=(
            "exit codes: 0 every record has a result; 1 some records failed (see "
            "OUTPUT/_failures.jsonl); 2 bad input or settings, or the drive stopped (wrong "
            "URL or key, no replica ready in time): fix it and rerun with --resume"
        ),
    )
    p.add_argument(
        "input", nargs="?", type=Path, help=".jsonl, .csv, .parquet or .txt file (default: demo)"
    )
    p.add_argument(
        "--endpoint",
        dest="endpoints",
        action="append",
        required=True,
        metavar="URL",
        help="a replica's base URL, e.g. http://127.0.0.1:8000 (repeatable)",
    )
    p.add_argument(
        "--route",
        choices=["embeddings", "classify", "generate"],
        default="embeddings",
        help="the server route records go to: /v1/embeddings, /v1/classify or /generate (a "
        "folder of pictures or .tar shards goes as data URIs to embeddings or classify)",
    )
    p.add_argument(
        "--request-model",
        dest="model",
        metavar="NAME",
        help="the served model's name, sent as 'model' with each request (default: the server's)",
    )
    add_deprecated_flag(p, "--model", "--request-model", dest="model")
    p.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY' ($BATCHLINE_API_KEY)")
    add_dataset_arguments(p, suffix="embeddings (or STEM.results with --route generate)")
    p.add_argument(
        "--records-per-request",
        dest="chunk_size",
        type=int,
        metavar="N",
        help=f"records per request (default: {RECORDS_PER_REQUEST['embeddings']}; "
        f"{RECORDS_PER_REQUEST['generate']} with --route generate, whose requests take "
        "seconds per prompt on a CPU)",
    )
    add_deprecated_flag(p, "--chunk-size", "--records-per-request", dest="chunk_size", type=int)
    p.add_argument(
        "--output-chunk-size",
        type=int,
        default=10_000,
        help="records per output file, the unit of --resume (default: 10000)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=10,
        help="chunks in flight across all replicas (default: 10)",
    )
    p.add_argument(
        "--max-attempts",
        type=int,
        default=8,
        help="attempts per chunk before its records fail (default: 8)",
    )
    p.add_argument(
        "--connect-timeout-s", type=float, default=10.0, help="per attempt (default: 10)"
    )
    p.add_argument(
        "--read-timeout-s",
        type=float,
        default=120.0,
        help="per attempt, for the answer (default: 120: a cold replica may be slow)",
    )
    p.add_argument(
        "--give-up-after-s",
        type=float,
        default=600.0,
        help="stop when no replica has been ready for this long (default: 600)",
    )
    p.add_argument(
        "--dim",
        type=int,
        help="expected vector length; answers of another length are server errors "
        "(default: the first answer's, or the output's when resuming)",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        help="with --route generate: tokens to generate per prompt (default: the server's)",
    )
    p.add_argument(
        "--no-chat-template",
        action="store_true",
        help="with --route generate: send each prompt as it is, not through the model's chat "
        "template (as run --no-chat-template)",
    )
    p.add_argument(
        "--encoding",
        choices=["base64", "float"],
        default="base64",
        help="embeddings' encoding_format (default: base64, exact and compact)",
    )
    p.add_argument(
        "--no-prefix-affinity",
        dest="prefix_affinity",
        action="store_false",
        help="with --route generate: send prompts in input order, each request to the least "
        "busy replica (default: each window of 2,048 prompts sent grouped by shared prefix, a "
        "prefix's requests to one replica while it holds at most one more in flight than the "
        "least busy and none is idle; outputs stay in input order)",
    )
    p.add_argument(
        "--no-dedupe",
        dest="dedupe",
        action="store_false",
        help=SHARED_HELP["--no-dedupe"] + ". An input is a record's text; a repeated one is not "
        "sent",
    )
    p.add_argument("--quiet", action="store_true", help=SHARED_HELP["--quiet"])
    p.set_defaults(func=_main)


def options_from(args: argparse.Namespace) -> DriveOptions:
    """The drive's options from its parsed flags (``InputError`` for an unusable one)."""
    from batchline.driver.drive import DriveOptions

    fields = {f.name for f in dataclasses.fields(DriveOptions)}  # each flag named after one
    given = {k: v for k, v in vars(args).items() if k in fields}
    if given.get("chunk_size") is None:
        from batchline.datasets.sources import holds_pictures

        given["chunk_size"] = RECORDS_PER_REQUEST[args.route]
        if args.input is not None and holds_pictures(Path(args.input), args.input_format):
            given["chunk_size"] = PICTURES_PER_REQUEST
    return DriveOptions(**given, chat_template=not args.no_chat_template)


def _main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from batchline.driver.drive import drive, drive_output
    from batchline.jobs.display import print_summary
    from batchline.jobs.stopping import report_stop, sigterm_as_interrupt

    options = options_from(args)
    console = Console(stderr=True)
    bar = _bar(console) if not args.quiet and console.is_terminal else None
    handler = _StderrHandler()
    driver_log = logging.getLogger("batchline.driver")
    driver_log.addHandler(handler)
    if driver_log.level == logging.NOTSET:
        driver_log.setLevel(logging.WARNING)
    stopped_by: list[str] = []
    restore = sigterm_as_interrupt(stopped_by)  # `kill` stops it as Ctrl-C does
    try:
        summary = drive(options, bar)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
            bar = None
        return report_stop("drive", stopped_by, drive_output(options), args)
    finally:
        restore()
        driver_log.removeHandler(handler)
        if bar is not None:
            bar.close()
    if not args.quiet or summary.exit_code:
        print_summary("batchline drive", summary.rows())
    if summary.exit_code:
        print(
            f"batchline drive: {summary.failed_total:,} record(s) failed; "
            f"see {summary.output / '_failures.jsonl'}",
            file=sys.stderr,
        )
    return summary.exit_code


class _StderrHandler(logging.Handler):
    """Endpoint events (set aside, back) as lines on stderr, found at each call: a running
    progress bar has replaced ``sys.stderr`` with a proxy that prints above the bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            print(f"batchline drive: {record.getMessage()}", file=sys.stderr)
        except Exception:
            self.handleError(record)


def _bar(console: Console) -> RateBar:
    from batchline.jobs.display import RateBar

    return RateBar(console, "driving", "failed")
