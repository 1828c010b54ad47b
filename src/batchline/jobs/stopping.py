"""How ``run`` and ``drive`` stop on Ctrl-C or ``kill``: what is done kept, and one line that
says how many records were kept where and the command that goes on from there.

:func:`sigterm_as_interrupt` makes SIGTERM stop a command as Ctrl-C does (the job's tasks
cancelled: each keeps what it has), also where SIGINT is ignored, as it is for a job a script
started with ``&``; :func:`report_stop` prints the line :func:`stopped_line` makes and gives
the exit code.

A stop signal sent again while the stop runs (a double Ctrl-C; GNU ``timeout``, which signals
the command and then its process group) had raised a second ``KeyboardInterrupt`` in the
middle of the stop's own cleanup, and the process then hung for good, asleep, without its
line. :func:`run_stoppable` runs a command's coroutine so that a repeat within
:data:`REPEAT_S` of the first signal is absorbed. In a command (one that called
:func:`sigterm_as_interrupt`), a later one ends the process at once (``os._exit``: what is
committed stays committed, ``--resume`` goes on from it). A program that calls ``run`` or
``drive`` itself is not ended: a later Ctrl-C raises ``KeyboardInterrupt`` there, as Python's
own does.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, TypeVar

__all__ = [
    "REPEAT_S",
    "exit_code",
    "report_stop",
    "run_stoppable",
    "sigterm_as_interrupt",
    "stopped_line",
]

T = TypeVar("T")

#: Seconds after a command's first stop signal in which another is the same stop sent again
#: (absorbed); one after that asks to stop at once.
REPEAT_S = 2.0
#: When this process's stop began (``time.monotonic``), once it has.
_stop_began: list[float] = []
#: Set while a command runs (:func:`sigterm_as_interrupt`): a late repeat of its stop signal
#: ends the process. A program calling ``run`` itself keeps its process.
_is_command: list[bool] = []


def _first_stop(signame: str) -> bool:
    """Whether this signal begins the stop (or, outside a command, acts as it would without
    this module); False for a repeat within :data:`REPEAT_S`; in a command, a later one ends
    the process here, with its exit code."""
    now = time.monotonic()
    if not _stop_began:
        _stop_began.append(now)
        return True
    if now - _stop_began[0] < REPEAT_S:
        return False
    if not _is_command:
        return True
    print(
        f"batchline: {signame} again: stopped at once; what was committed is kept, and "
        "--resume goes on from it",
        file=sys.stderr,
        flush=True,
    )
    os._exit(exit_code(signame))


class _Repeats:
    """SIGINT's handler over ``asyncio.run``'s own (``inner``, which cancels the main task the
    first time and raises ``KeyboardInterrupt`` wherever the main thread is after that)."""

    def __init__(self, inner: Callable[[int, Any], object]) -> None:
        self.inner = inner

    def __call__(self, signum: int, frame: Any) -> None:
        if _first_stop("SIGINT"):
            self.inner(signum, frame)


async def _guarded(main: Coroutine[Any, Any, T]) -> T:
    """``main``, with ``asyncio.run``'s SIGINT handler (installed by now) under
    :class:`_Repeats`."""
    if threading.current_thread() is threading.main_thread():
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler) and not isinstance(handler, _Repeats):
            signal.signal(signal.SIGINT, _Repeats(handler))
    return await main


def run_stoppable(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` for a command that a signal stops (see the module): its first
    Ctrl-C or SIGTERM (:func:`sigterm_as_interrupt`) cancels it as ``asyncio.run`` does, a
    repeat within :data:`REPEAT_S` is absorbed, a later one ends the process at once in a
    command, and acts as SIGINT's handler would outside one. SIGINT's handler is what it was
    afterwards."""
    _stop_began.clear()
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        return asyncio.run(_guarded(main))
    finally:
        if main_thread and isinstance(signal.getsignal(signal.SIGINT), _Repeats):
            with contextlib.suppress(ValueError, TypeError):
                signal.signal(signal.SIGINT, before)


def sigterm_as_interrupt(stopped_by: list[str]) -> Callable[[], object]:
    """Make SIGTERM stop the command as Ctrl-C does, noting ``"SIGTERM"`` in ``stopped_by``,
    and a late repeat of either end the process (:func:`_first_stop`); returns what puts the
    old handler back. Outside the main thread, nothing is changed."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    _stop_began.clear()  # a new command: no stop begun
    _is_command[:] = [True]

    def on_sigterm(signum: int, frame: Any) -> None:
        if not _first_stop("SIGTERM"):
            return  # the stop under way (or ended here, for a late repeat)
        stopped_by.append("SIGTERM")
        on_sigint = signal.getsignal(signal.SIGINT)
        if isinstance(on_sigint, _Repeats):  # the stop is begun here: asyncio.run's own
            on_sigint = on_sigint.inner
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

    def restore() -> None:
        _is_command.clear()
        signal.signal(signal.SIGTERM, old)

    return restore


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
