"""Small tools shared by the tests."""

from __future__ import annotations

import asyncio
import random
import socket
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

# Ray gives its workers ports 10002-19999 by default; the kernel hands out its ephemeral range
# (net.ipv4.ip_local_port_range, 32768-60999 by default) to every bind to port 0 and every
# outgoing connection. A test that names a port and then waits seconds for a server to bind it
# picks between the two, so that no other process's automatic port can take it meanwhile: with
# the suite on two workers, another worker's Ray took a port picked by binding to 0 (HAProxy:
# "Address already in use").
_OWN_PORTS = (20_000, 32_767)


def free_port() -> int:
    """A port on 127.0.0.1 that is free now, outside every range ports are handed out from
    automatically (else, where the ephemeral range reaches below 20,000, one the kernel picks)."""
    low, high = _OWN_PORTS
    with suppress(OSError, ValueError, IndexError):
        high = min(
            high, int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0]) - 1
        )
    candidates = random.sample(range(low, high + 1), min(64, max(0, high + 1 - low)))
    for port in candidates:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
