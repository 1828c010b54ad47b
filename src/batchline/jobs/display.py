"""What the dataset jobs' CLIs (``run``, ``drive``) draw: a progress bar and a summary table."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Literal

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

__all__ = ["RateBar", "print_summary"]


class RateBar:
    """A dataset job's ``Progress`` (``batchline.datasets.pipeline``) as a bar: records done of
    the total, records/s, a note, elapsed time and ETA. ``note`` says what the note shows:
    ``utilization`` (run), ``failed`` (drive: failures so far) or ``tokens`` (generation: what
    the ``tokens`` hook reports, and the running slots' occupancy)."""

    def __init__(
        self, console: Console, label: str, note: Literal["utilization", "failed", "tokens"]
    ) -> None:
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
        self._note = note
        self._task = TaskID(-1)  # add_task's, once started
        self._started = 0.0
        self._done = 0
        self._failed = 0
        self._tokens = "-"

    def start(self, total: int | None, already_done: int) -> None:
        self._progress.start()
        self._task = self._progress.add_task(
            "job", total=total, completed=already_done, rate="-", note=""
        )
        self._started = time.perf_counter()

    def advance(self, records: int, *, failed: int = 0, utilization: float = 0.0) -> None:
        self._done += records
        self._failed += failed
        if self._note == "failed":
            note = f"{self._failed:,} failed"
        elif self._note == "tokens":
            note = f"{self._tokens}, slots {utilization:.0%}"
        else:
            note = f"util {utilization:.0%}"
        elapsed = max(time.perf_counter() - self._started, 1e-9)
        self._progress.update(
            self._task, advance=records, rate=f"{self._done / elapsed:,.0f}", note=note
        )

    def tokens(self, generated: int, tokens_per_s: float) -> None:
        """Generation's speed (``batchline.jobs.generate.TokenRate``), shown from the next step."""
        self._tokens = f"{generated:,} tok, {tokens_per_s:,.1f} tok/s"

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
