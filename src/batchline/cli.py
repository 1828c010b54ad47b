"""``batchline run|serve|drive|bench|tune``.

Each subcommand lives with its layer (``jobs/cli.py``, ``server/cli.py``, ...) and exposes
``add_parser(subparsers)``; those modules import only the standard library at the top, so
``batchline --help`` works whatever extras are installed. Expected errors become one line
on stderr and exit code 2; a missing extra names the ``pip install`` that fixes it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from batchline._errors import BatchlineError

__all__ = ["main"]

# subcommand module -> the extra that its imports need
_COMMANDS: tuple[tuple[str, str], ...] = (
    ("batchline.jobs.cli", "jobs"),
    ("batchline.server.cli", "server"),
    ("batchline.driver.cli", "driver"),
    ("batchline.bench.cli", "bench"),
)

_EXTRA_OF_MODULE = {
    "onnxruntime": "onnx",
    "onnx": "onnx",
    "tokenizers": "onnx",
    "safetensors": "onnx",
    "numpy": "onnx",
    "platformdirs": "onnx",
    "pyarrow": "jobs",
    "rich": "jobs",
    "fastapi": "server",
    "uvicorn": "server",
    "pydantic": "server",
    "prometheus_client": "server",
    "httpx": "driver",
    "matplotlib": "bench",
    "ray": "ray",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchline",
        description="Dynamic batching for ML inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name, _extra in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.startswith("batchline"):
                continue  # that layer is not built yet
            raise
        module.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except BatchlineError as exc:
        print(f"batchline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        extra = _EXTRA_OF_MODULE.get(top)
        if extra is None:
            raise
        print(
            f"batchline {args.command}: error: this command needs the '{extra}' extra "
            f"({top} is not installed); run: pip install 'batchline[{extra}]'",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"batchline {args.command}: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
