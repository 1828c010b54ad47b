"""What the dataset jobs' CLIs (``run``, ``drive``) draw: a progress bar and a summary table."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

__all__ = ["RateBar", "print_summary"]


class RateBar:
    """Records done of the total, records/s, one job-specific field, elapsed time and ETA."""

    def __init__(self, console: Console, label: str) -> None:
        self._progress = Progress(
            TextColumn(f"[bold]{label}"),
            BarColumn(),
            TaskProgressColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]} rec/s"),
            TextColumn("{task.fields[note]}"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=console,
            transient=False,
        )
        self._task: Any = None
        self._started = 0.0
        self._done = 0

    def start(self, total: int | None, already_done: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task(
            "job", total=total, completed=already_done, rate="-", note=""
        )
        self._started = time.perf_counter()

    def step(self, records: int, note: str) -> None:
        """``records`` more are done; ``note`` replaces the job-specific field."""
        self._done += records
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(
            self._task, advance=records, rate=f"{self._done / elapsed:,.0f}", note=note
        )

    def close(self) -> None:
        self._progress.stop()


def print_summary(title: str, rows: Iterable[tuple[str, str]]) -> None:
    """The end-of-job summary as a two-column table on stdout."""
    table = Table(title=title, show_header=False)
    table.add_column(style="bold")
    table.add_column(justify="right")
    for label, value in rows:
        table.add_row(label, value)
    Console().print(table)
