"""The progress bars of ``run`` and ``drive`` (the CLI tests run without a TTY and draw none)."""

from __future__ import annotations

import io

from rich.console import Console

from batchline.driver import cli as drive_cli
from batchline.jobs import cli as run_cli
from batchline.jobs.display import print_summary


def draw(module: object, note_arg: float) -> str:
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = module._bar(console)  # type: ignore[attr-defined]
    bar.start(10, 2)
    bar.advance(3, utilization=note_arg)
    bar.close()
    return console.file.getvalue()  # type: ignore[attr-defined]


def test_run_bar_shows_progress_and_utilization() -> None:
    out = draw(run_cli, 0.5)
    assert "5/10" in out
    assert "util 50%" in out


def test_drive_bar_counts_failures_across_calls() -> None:
    console = Console(file=io.StringIO(), force_terminal=True, width=160)
    bar = drive_cli._bar(console)
    bar.start(None, 0)
    bar.advance(4, failed=1)
    bar.advance(4, failed=2)
    bar.close()
    assert "3 failed" in console.file.getvalue()  # type: ignore[attr-defined]


def test_summary_table_lists_every_row(capsys: object) -> None:
    print_summary("batchline run", [("records", "12"), ("wall time", "1.0 s")])
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "batchline run" in out
    assert "records" in out
    assert "1.0 s" in out
