"""Small tools shared by the tests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any


async def settle(rounds: int = 30) -> None:
    """Let every ready callback and task run (no time passes on any clock)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


class Gate:
    """An async process_fn that records its batches and blocks until opened."""

    def __init__(self, *, open_: bool = False) -> None:
        self.batches: list[list[Any]] = []
        self._event = asyncio.Event()
        if open_:
            self._event.set()

    def open(self) -> None:
        self._event.set()

    def close(self) -> None:
        self._event.clear()

    async def __call__(self, batch: list[Any]) -> Sequence[Any]:
        self.batches.append(list(batch))
        await self._event.wait()
        return [("done", r) for r in batch]


class Overlap:
    """Counts the process_fn calls running at once; ``most`` is the peak seen."""

    def __init__(self) -> None:
        self.running = 0
        self.most = 0

    @contextmanager
    def call(self) -> Iterator[None]:
        self.running += 1
        self.most = max(self.most, self.running)
        try:
            yield
        finally:
            self.running -= 1
