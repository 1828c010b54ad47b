"""``batchline run|serve|drive|bench|tune|models``, also ``python -m batchline``.

The one entry point: the ``batchline`` script calls :func:`main` here too, so no module sits
between ``python -m`` and the dispatch. Each subcommand lives with its layer (``jobs/cli.py``,
``server/cli.py``, ...) and exposes ``add_parser(subparsers)``; those modules import only the
standard library at the top, so ``batchline --help`` works whatever extras are installed.
Expected errors become one line on stderr and exit code 2; a missing extra names the
``pip install`` that fixes it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from batchline._errors import BatchlineError
from batchline._extras import EXTRA_OF_MODULE, INCLUDES

if TYPE_CHECKING:
    from batchline.datasets.pipeline import Progress
    from batchline.jobs.options import RunOptions
    from batchline.jobs.summary import RunSummary
    from batchline.server.settings import ServerSettings

__all__ = ["main"]

# The modules that define the subcommands (each ``add_parser(subparsers)``, stdlib imports only).
_COMMAND_MODULES = (
    "batchline.jobs.cli",
    "batchline.server.cli",
    "batchline.driver.cli",
    "batchline.bench.cli",
    "batchline.models.cli",
)

# subcommand -> the extra it needs (models: none, it only runs pip)
_EXTRA_OF_COMMAND = {
    "run": "jobs",
    "serve": "server",
    "drive": "driver",
    "bench": "bench",
    "tune": "bench",
}


class _Parser(argparse.ArgumentParser):
    """A parser that takes only whole flag names. argparse's default reads a flag's unique
    prefix as the flag: ``batchline run --input data.jsonl`` then meant ``--input-column
    data.jsonl`` and ran the built-in data, and a flag added later could turn a prefix that
    worked into an ambiguous one. Commands' subparsers (and theirs) are made of this class."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """As argparse's, but an argument no command takes is reported by the command's own
        parser (its usage, ``batchline run: error: ...``), naming the flags a cut-short one
        could have meant."""
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(parsed)
            hint = _whole_names(parser, extras)
            parser.error(f"unrecognized arguments: {' '.join(extras)}{hint}")
        return parsed

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the (sub)command ``parsed`` names, the deepest one chosen."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(parsed, action.dest, None) or "")
                if isinstance(chosen, _Parser):
                    return chosen._command_parser(parsed)
        return self


def _whole_names(parser: argparse.ArgumentParser, extras: Sequence[str]) -> str:
    """``" (flags are taken only whole: --out could be --output, --output-format)"`` for
    the given flags that begin one or more of the parser's, else ``""``."""
    known = [flag for action in parser._actions for flag in action.option_strings]
    meant = []
    for extra in extras:
        name = extra.split("=", 1)[0]
        if name.startswith("--"):
            begun = [flag for flag in known if flag.startswith(name)]
            if begun:
                meant.append(f"{name} could be {', '.join(begun)}")
    return f" (flags are taken only whole: {'; '.join(meant)})" if meant else ""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="batchline",
        description="Dynamic batching for ML inference.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in _COMMAND_MODULES:
        importlib.import_module(module_name).add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # for a command to repeat
    args.on_ray = _ON_RAY.get(args.command)
    try:
        code: int = args.func(args)
    except BatchlineError as exc:
        print(f"batchline {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        top = (exc.name or "").split(".")[0]
        extra = missing_extra(args.command, top)
        if extra is None:
            raise
        from batchline._commands import install_command

        print(
            f"batchline {args.command}: error: this command needs the '{extra}' extra "
            f"({top} is not installed); run: {install_command(extra)}",
            file=sys.stderr,
        )
        return 2
    except KeyboardInterrupt:
        print(f"batchline {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        said = _disk_failure(exc)
        if said is None:
            raise
        print(f"batchline {args.command}: error: {said}", file=sys.stderr)
        return 2
    return code


def _disk_failure(exc: Exception) -> str | None:
    """One line for a write that failed for the disk's reason where no layer said it better
    (a cache folder that is full or read-only): the file and what to do; else None."""
    from batchline._fsio import disk_errno, disk_phrase

    code = disk_errno(exc)
    if code is None:
        return None
    name = getattr(exc, "filename", None)
    where = f"cannot write {name}" if name else f"a write failed ({exc})"
    return (
        f"{where}: the file system {disk_phrase(code)}; free space or make it writable, then rerun"
    )


def _run_on_ray(
    options: RunOptions, args: argparse.Namespace, progress: Progress | None
) -> RunSummary:
    from batchline.integrations.ray import run_from_args

    return run_from_args(options, args, progress)


def _serve_on_ray(args: argparse.Namespace, settings: ServerSettings) -> int:
    from batchline.integrations.ray_serve import serve_from_args

    return serve_from_args(args, settings)


#: ``--engine ray`` of each command that has it, dispatched from here (``args.on_ray``), so
#: that the command packages never import ``integrations/``, the layer above them.
_ON_RAY: dict[str, Callable[..., object]] = {"run": _run_on_ray, "serve": _serve_on_ray}


def missing_extra(command: str, module: str) -> str | None:
    """The extra to install when ``command`` fails for want of ``module``: the command's own
    extra if it brings that module, else the module's extra (e.g. ``ray`` for ``run --engine
    ray``); ``None`` for a module no extra brings (a real bug, not a missing install)."""
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        return None
    own = _EXTRA_OF_COMMAND.get(command)
    if own is not None and extra in INCLUDES[own]:
        return own
    return extra


if __name__ == "__main__":
    sys.exit(main())
