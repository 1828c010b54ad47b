"""How ``run`` and ``drive`` stop on Ctrl-C or ``kill``: what is done kept, and one line that
says how many records were kept where and the command that goes on from there.

:func:`sigterm_as_interrupt` makes SIGTERM stop a command as Ctrl-C does (the job's tasks
cancelled: each keeps what it has), also where SIGINT is ignored, as it is for a job a script
started with ``&``; :func:`report_stop` prints the line :func:`stopped_line` makes and gives
the exit code.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = ["exit_code", "report_stop", "sigterm_as_interrupt", "stopped_line"]


def sigterm_as_interrupt(stopped_by: list[str]) -> Callable[[], object]:
    """Make SIGTERM stop the command as Ctrl-C does, noting ``"SIGTERM"`` in ``stopped_by``;
    returns what puts the old handler back. Outside the main thread, nothing is changed."""
    import asyncio
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_sigterm(signum: int, frame: Any) -> None:
        stopped_by.append("SIGTERM")
        on_sigint = signal.getsignal(signal.SIGINT)
        if callable(on_sigint):  # asyncio.run's own Ctrl-C path (a clean cancel), or Python's
            on_sigint(signal.SIGINT, frame)
            return
        # SIGINT ignored (a job started with `&` from a script) or left to the system: SIGTERM
        # must stop the command all the same. Raised here, the interrupt could land in whatever
        # the main thread runs now, a finalizer too, which prints it as ignored and drops it
        # (the job went on); in a running loop it is raised by the loop itself, between
        # callbacks
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop yet (a model loading): here, as Python's Ctrl-C
            raise KeyboardInterrupt from None
        loop.call_soon_threadsafe(_interrupt)

    old = signal.signal(signal.SIGTERM, on_sigterm)
    return lambda: signal.signal(signal.SIGTERM, old)


def _interrupt() -> None:
    """A loop callback that stops the loop as Ctrl-C would: ``asyncio.run`` then cancels the
    job's tasks (each keeps what is done) and the interrupt reaches the command."""
    raise KeyboardInterrupt


def exit_code(signame: str) -> int:
    """The shell's code for a command stopped by ``signame``: 128 + the signal's number."""
    return 143 if signame == "SIGTERM" else 130


def stopped_line(signame: str, out: Path | None, argv: Sequence[str]) -> str:
    """What a stopped command tells its user: the records committed in ``out`` (its output
    folder, None where it cannot be told), and the command ``argv`` (without the program) to go
    on from there, or, with nothing committed, the same command again."""
    import shlex

    from batchline._commands import program

    kept = 0
    if out is not None and (out / "_manifest.json").exists():
        from batchline.datasets.manifest import Manifest

        kept = Manifest.load(out).records_kept  # committed chunks, and what the stop flushed
    args = [a for a in argv if a != "--overwrite"]
    if kept:
        if "--resume" not in args:
            args.append("--resume")
        where = f"{kept:,} record(s) kept in {out}"
    else:  # the writer removed the output it began: the same command starts afresh
        where = "no record was done yet, so nothing was left behind"
    return f"interrupted ({signame}): {where}; to go on, run: {program()} {shlex.join(args)}"


def report_stop(
    command: str, stopped_by: Sequence[str], out: Path | None, args: argparse.Namespace
) -> int:
    """Print ``batchline COMMAND: interrupted (...)`` for a command stopped by Ctrl-C or by the
    SIGTERM ``stopped_by`` noted, writing to ``out``, run as ``args.argv`` says; return its
    exit code."""
    signame = stopped_by[0] if stopped_by else "SIGINT"
    argv = getattr(args, "argv", None) or sys.argv[1:]
    print(f"batchline {command}: {stopped_line(signame, out, argv)}", file=sys.stderr)
    return exit_code(signame)
