"""Stopping a command by Ctrl-C or ``kill`` (``batchline.jobs.stopping``): the interrupt raised
where it cannot be lost, and the line that says what was kept and how to go on."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from pathlib import Path

import pytest

from batchline._commands import program
from batchline.datasets.manifest import ChunkInfo, Manifest
from batchline.jobs.stopping import stopped_line


class _StopsInAFinalizer:
    """SIGTERM delivered while the main thread runs a finalizer: an exception raised there
    is printed ("Exception ignored in ...") and dropped, not propagated."""

    def __del__(self) -> None:
        signal.raise_signal(signal.SIGTERM)


def test_sigterm_with_sigint_ignored_stops_the_loop_even_from_a_finalizer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A background run (SIGINT ignored) stopped by SIGTERM while a finalizer runs: the stop
    is neither printed as an ignored exception nor lost; the run's task is cancelled and the
    interrupt comes out of the loop."""
    from batchline.jobs.stopping import sigterm_as_interrupt

    unraisable: list[object] = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    cancelled: list[bool] = []

    async def job() -> str:
        try:
            _StopsInAFinalizer()  # dropped at once: its finalizer runs here
            for _ in range(200):
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return "finished"

    old_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopped_by: list[str] = []
    restore = sigterm_as_interrupt(stopped_by)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(job())
    finally:
        restore()
        signal.signal(signal.SIGINT, old_sigint)
    assert stopped_by == ["SIGTERM"]
    assert unraisable == []
    assert cancelled == [True]


def test_sigterm_with_sigint_ignored_and_no_loop_interrupts_at_once() -> None:
    """Before the loop starts (a model still loading in the main thread), SIGTERM interrupts
    there, as Ctrl-C would."""
    from batchline.jobs.stopping import sigterm_as_interrupt

    old_sigint = signal.signal(signal.SIGINT, signal.SIG_IGN)
    stopped_by: list[str] = []
    restore = sigterm_as_interrupt(stopped_by)
    try:
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    finally:
        restore()
        signal.signal(signal.SIGINT, old_sigint)
    assert stopped_by == ["SIGTERM"]


def test_the_stopped_line_counts_what_is_kept_and_names_the_resume(tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["drive", "in.jsonl", "-o", str(out), "--overwrite"]
    line = stopped_line("SIGTERM", out, argv)  # nothing there: the same command, afresh
    assert line == (
        "interrupted (SIGTERM): no record was done yet, so nothing was left behind; to go on, "
        f"run: {program()} drive in.jsonl -o {out}"
    )
    out.mkdir()
    chunks = {0: ChunkInfo(0, 990, 10, "part-000000.parquet")}
    manifest = Manifest({"input": "in.jsonl"}, chunks, flushed="f.jsonl", flushed_records=500)
    (out / "_manifest.json").write_text(json.dumps(manifest.to_json()))
    line = stopped_line("SIGINT", out, argv)
    assert line == (
        f"interrupted (SIGINT): 1,500 record(s) kept in {out}; to go on, run: {program()} "
        f"drive in.jsonl -o {out} --resume"
    )
    assert stopped_line("SIGINT", out, [*argv, "--resume"]).count("--resume") == 1


def test_a_repeat_of_the_stop_signal_is_absorbed_and_a_late_one_ends_at_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a manual clock: the first signal begins the stop, one within REPEAT_S of it is the
    same stop sent again (absorbed), one after that ends the process at once with the first
    signal's exit code."""
    from batchline.jobs import stopping

    now = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    exits: list[int] = []

    def exit_now(code: int) -> None:
        exits.append(code)
        raise SystemExit(code)

    monkeypatch.setattr(stopping.os, "_exit", exit_now)
    monkeypatch.setattr(stopping, "_stop_began", [])
    monkeypatch.setattr(stopping, "_is_command", [True])
    assert stopping._first_stop("SIGTERM") is True
    now[0] += stopping.REPEAT_S - 0.01
    assert stopping._first_stop("SIGTERM") is False
    assert stopping._first_stop("SIGINT") is False
    assert exits == []
    now[0] += 0.02
    with pytest.raises(SystemExit):
        stopping._first_stop("SIGINT")
    assert exits == [130]


def test_outside_a_command_a_late_repeat_is_not_the_end_of_the_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A program that calls ``run`` itself: a repeat within REPEAT_S is absorbed all the same,
    a later one is left to SIGINT's handler (a KeyboardInterrupt) and never ends the process;
    the command's ``sigterm_as_interrupt`` arms the end, and its restore disarms it."""
    from batchline.jobs import stopping

    now = [100.0]
    monkeypatch.setattr(stopping.time, "monotonic", lambda: now[0])
    exits: list[int] = []
    monkeypatch.setattr(stopping.os, "_exit", exits.append)
    monkeypatch.setattr(stopping, "_stop_began", [])
    monkeypatch.setattr(stopping, "_is_command", [])
    assert stopping._first_stop("SIGINT") is True
    now[0] += stopping.REPEAT_S / 2
    assert stopping._first_stop("SIGINT") is False
    now[0] += stopping.REPEAT_S
    assert stopping._first_stop("SIGINT") is True
    assert exits == []

    restore = stopping.sigterm_as_interrupt([])
    try:
        assert stopping._is_command == [True]
        assert stopping._first_stop("SIGINT") is True  # the command's stop, begun afresh
        now[0] += 2 * stopping.REPEAT_S
        stopping._first_stop("SIGINT")
        assert exits == [130]
    finally:
        restore()
    assert stopping._is_command == []


def test_run_stoppable_gives_sigint_back_and_absorbs_a_double_ctrl_c() -> None:
    """Two SIGINTs at once: the job's task is cancelled once, the interrupt comes out of the
    run (asyncio.run's own handler had raised the second in the middle of the cleanup), and
    SIGINT's handler is Python's again."""
    from batchline.jobs.stopping import run_stoppable

    cleaned: list[str] = []

    async def job() -> str:
        try:
            signal.raise_signal(signal.SIGINT)
            signal.raise_signal(signal.SIGINT)
            for _ in range(200):
                await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            await asyncio.sleep(0.05)  # a cleanup that awaits: where the second had landed
            cleaned.append("cancelled")
            raise
        return "finished"

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_stoppable(job())
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGINT, before)
    assert cleaned == ["cancelled"]
