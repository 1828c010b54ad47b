"""``batchline serve``: serve one or more models over HTTP.

Only the standard library is imported here, so ``batchline --help`` works without the
``server`` extra; FastAPI and uvicorn are imported when the command runs.
"""

from __future__ import annotations

import argparse
from argparse import _SubParsersAction
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.knobs import add_deprecated_flag
from batchline.models.config import add_generation_knob_arguments, add_knob_arguments
from batchline.models.selection import TASK_HELP, add_model_spec_argument

if TYPE_CHECKING:
    from batchline.server.settings import ServerSettings

__all__ = ["add_parser", "run"]


def add_parser(subparsers: _SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Add ``serve`` to the ``batchline`` command's subparsers."""
    p = subparsers.add_parser(
        "serve",
        help="serve models over HTTP, each behind one shared batcher",
        description=(
            "Serve one or more models over HTTP: embed models on /v1/embeddings "
            "(OpenAI-compatible), classify models on /classify, predict models on the Open "
            "Inference Protocol (/v2/models/NAME/infer), generate models on /generate, "
            "/v1/completions and /v1/chat/completions (OpenAI-compatible, streaming); "
            "/v1/models, /health, /ready, /metrics. Every request feeds its model's shared "
            "batcher (a generate model's: its text generator); several models share the "
            "device's slots fairly. A text longer than its model's limit (its tokenizer's "
            "max length) is cut to it, as most embedding APIs do; --set truncate=false answers "
            "it with 413 instead. Flags override --set, which overrides the --config file "
            "(--print-config shows every setting, serve's own such as model_weights too); "
            "SIGTERM drains in-flight "
            "work and exits 0. Example: batchline serve --model emb=default "
            "--model clf=clf.onnx --task clf=predict --model gen=smollm2"
        ),
    )
    add_model_spec_argument(
        p,
        several=True,
        more="; repeatable: each is served, NAME being what clients send as 'model'",
    )
    p.add_argument(
        "--task",
        action="append",
        metavar="[NAME=]TASK",
        help=TASK_HELP + "; repeatable: NAME=TASK names the model with several",
    )
    p.add_argument(
        "--tokenizer", help="a single text model's tokenizer.json (default: beside the .onnx)"
    )
    p.add_argument(
        "--labels",
        type=lambda text: [x.strip() for x in text.split(",")],
        help="a single classify model's comma-separated labels (default: config.json's "
        "id2label beside the model)",
    )
    p.add_argument(
        "--pooling", choices=["mean", "cls", "none"], help="a single embed model's pooling"
    )
    p.add_argument(
        "--normalize",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="a single embed model: L2-normalise the vectors",
    )
    p.add_argument(
        "--modality",
        action="append",
        metavar="[NAME=]MODALITY",
        help="text or image: a two-tower image folder's (CLIP, SigLIP) tower to serve "
        "(default: text; --labels serve images, zero-shot), or image for a plain .onnx that "
        "takes pictures (NCHW); repeatable: NAME=MODALITY names the model with several",
    )
    p.add_argument(
        "--allow-url-fetch",
        metavar="HOST[,HOST]",
        help="fetch http(s) image URLs from these hosts only (default: none; images come as "
        "data URIs or base64)",
    )
    p.add_argument(
        "--max-image-bytes",
        type=_size,
        metavar="SIZE",
        help="refuse larger images, with 413 (20MiB, 500KB or bytes; default 10MiB); unless "
        "max_body_bytes is set, a request body may hold one such image in base64",
    )
    p.add_argument(
        "--max-image-pixels",
        type=int,
        help="refuse images declaring more pixels (default 50,000,000), with 413",
    )
    p.add_argument("--host", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default 8000)")
    p.add_argument(
        "--api-key",
        help="require 'Authorization: Bearer KEY' on model routes; prefer the "
        "BATCHLINE_API_KEY environment variable (command lines are visible to other users)",
    )
    p.add_argument(
        "--allowed-hosts",
        metavar="NAMES",
        help="comma-separated names clients may send in the Host header besides the bind "
        "address's own (localhost, 127.0.0.1, [::1]); *.example.com for subdomains, * for "
        "any (default with --host 0.0.0.0); others get 421",
    )
    p.add_argument(
        "--cors-origins",
        metavar="ORIGINS",
        help="comma-separated browser origins sent CORS headers (https://app.example, or *); "
        "default none: web pages of other origins cannot read answers",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="a file of API keys, one per line (BATCHLINE_API_KEY may also hold several, "
        "comma-separated); the Batch API's files and batches belong to the key that made them",
    )
    p.add_argument(
        "--data-dir",
        type=Path,
        help="the Batch API's files and metadata (/v1/files, /v1/batches; default: batch-api "
        "in batchline's cache folder); a restart on it resumes unfinished batches; one server "
        "holds it at a time (a second is refused, naming the first's pid)",
    )
    p.add_argument(
        "--max-stored-bytes",
        type=_size,
        metavar="SIZE",
        help="the Batch API's quota per API key (and for a keyless server): bytes of files "
        "kept (10GiB, 500MB or bytes; default 10GiB); an upload past it gets 403",
    )
    p.add_argument(
        "--max-stored-files",
        type=int,
        metavar="N",
        help="the Batch API's quota per API key: files kept (default 1000); past it, 403",
    )
    add_knob_arguments(p)
    # the old spelling of --max-queue-size (a knob's flag is its field's name)
    add_deprecated_flag(p, "--max-queue", "--max-queue-size", dest="max_queue_size", type=int)
    p.add_argument(
        "--request-timeout-s",
        type=float,
        help="per-request timeout; beyond: 504 (a generate request: the wait for its next token)",
    )
    add_generation_knob_arguments(p.add_argument_group("text generation (generate models)"))
    p.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="memory the server process may hold, its models included (6GiB, 512MB, or a "
        "fraction of RAM: 0.5, 50%%); models then load on their first request and idle ones "
        "are evicted, least recently used first, when a load needs room",
    )
    p.add_argument(
        "--preload",
        action="append",
        metavar="NAME",
        help="with --memory-budget: load this model at startup (repeatable)",
    )
    p.add_argument(
        "--pin",
        action="append",
        metavar="NAME",
        help="with --memory-budget: load this model at startup and never evict it (repeatable)",
    )
    p.add_argument(
        "--keep-alive",
        type=float,
        dest="keep_alive_s",
        metavar="SECONDS",
        help="with --memory-budget: unload an idle model this long after its last use "
        "(default 300; per model: --set 'model_keep_alive_s={\"a\": 60}')",
    )
    p.add_argument(
        "--log-level", choices=["critical", "error", "warning", "info", "debug"], default=None
    )
    p.add_argument(
        "--engine",
        choices=["local", "ray"],
        default="local",
        help="local (default): this process; ray: replicas of the same app on Ray Serve, "
        "autoscaled, behind Serve's proxy on --host:--port",
    )
    p.add_argument(
        "--replicas",
        metavar="MIN-MAX",
        help="with --engine ray: replicas, N or MIN-MAX (MIN may be 0: scale to zero; default 1)",
    )
    p.add_argument(
        "--target-ongoing",
        type=int,
        metavar="N",
        help="with --engine ray: requests in flight per replica that Serve scales on "
        "(default 10); drive with --concurrency MAX x N",
    )
    p.add_argument("--address", help="with --engine ray: 'auto' or HOST:PORT (default: start Ray)")
    p.add_argument(
        "--ray-ingress",
        choices=["proxy", "haproxy"],
        default=None,
        help="with --engine ray: haproxy (the default where Ray ships HAProxy: Linux): HAProxy "
        "on --host:--port sends requests straight to the replicas' own HTTP ports; proxy (the "
        "default on a cluster, --address): Serve's Python proxy forwards each request to a "
        "replica over Ray, ~8 ms more per request (docs/ray.md)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective settings (without the API key) as JSON and exit",
    )
    p.set_defaults(func=run)
    return p


def _size(text: str) -> int:
    from batchline._sizes import parse_bytes

    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def run(args: argparse.Namespace) -> int:
    """Build the settings from ``--config`` and the flags, check them, then serve."""
    import json

    from batchline._errors import InputError
    from batchline.knobs import check_setting_names, parse_set_options
    from batchline.server.settings import SETTING_NAMES, ServerSettings, load_config

    # every flag named after a setting (its argparse destination) overrides the file
    overrides = {k: v for k, v in vars(args).items() if k in SETTING_NAMES}
    data = load_config(args.config) if args.config is not None else {}
    given = parse_set_options(args.set)
    check_setting_names(given, SETTING_NAMES, where="--set")
    settings = ServerSettings.build({**data, **given}, **overrides)
    if args.print_config:
        print(json.dumps(settings.to_dict(), indent=2, sort_keys=True))
        return 0
    _check_models(settings)
    _check_generation_knobs(settings, args, given)
    if args.engine == "ray":
        # dispatched from the top (batchline.__main__): no command imports integrations/
        code: int = args.on_ray(args, settings)
        return code
    ray_flags = (args.replicas, args.target_ongoing, args.address, args.ray_ingress)
    if any(flag is not None for flag in ray_flags):
        raise InputError(
            "--replicas, --target-ongoing, --address and --ray-ingress go with --engine ray"
        )

    from batchline.server.runner import serve

    return serve(settings)


def _check_generation_knobs(
    settings: ServerSettings, args: argparse.Namespace, typed: dict[str, object]
) -> None:
    """Refuse a generation knob the command line gave (its flag, or a ``--set``) where no
    model served generates: it would change nothing. A ``--config`` file may hold them for
    other servers, so its keys are not refused."""
    from batchline._errors import InputError
    from batchline.models.config import generation_knobs_typed

    if any(spec.generates for spec in settings.specs):
        return
    given = generation_knobs_typed(args, typed)
    if given:
        raise InputError(
            f"{given[0]} goes with a generate model (--model smollm2, a causal-LM folder PATH/ "
            "or a GGUF file); no model served here generates"
        )


def _check_models(settings: ServerSettings) -> None:
    """Fail before serving, with one line (exit 2), when a model cannot be loaded as given: a
    malformed spec, a missing file, a built-in model not pulled, a text model without its
    tokenizer (read as the backend that claims the model reads it: ``Backend.tokenizer``)."""
    from batchline.models.builtin import BUILTIN_MODELS
    from batchline.models.loader import resolve_task, text_tokenizer

    for spec in settings.specs:
        if spec.kind == "builtin":  # the catalogue's, whichever backend loads it
            BUILTIN_MODELS[spec.source].package_dir()  # not pulled: names the pull command
        if spec.generates:
            continue
        task = resolve_task(spec)  # one no backend can tell: pass --task
        text_tokenizer(spec.with_options(task=task))  # as loaded: a picture model has none
