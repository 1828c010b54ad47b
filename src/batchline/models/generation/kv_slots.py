"""The running batch's keys and values: one preallocated buffer per layer, rows written in place.

Used by :class:`~batchline.models.generation.torch_engine.TorchStepEngine`; nothing here knows
about sequences (the engine moves the window and decides which rows live).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

__all__ = ["MIN_CAPACITY", "Geometry", "SlotStore", "StoreState"]

# The fewest columns a buffer is allocated with: a short prompt still gets room for some steps.
MIN_CAPACITY = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# A store's whole state: keys and values per layer, live rows, window start and end.
StoreState = tuple[list[torch.Tensor], list[torch.Tensor], int, int, int]


@dataclass(frozen=True, slots=True)
class Geometry:
    """What every layer's buffer is made of."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def empty(self, columns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Keys and values per layer for one sequence of ``columns`` positions, ``(1,
        kv_heads, columns, head_dim)``, uninitialised (a reader slices what was written)."""
        shape = (1, self.kv_heads, columns, self.head_dim)
        keys = [
            torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(self.layers)
        ]
        return keys, [torch.empty_like(k) for k in keys]


class SlotStore:
    """Preallocated keys and values of the running batch, written in place.

    Per layer, ``keys[l]`` and ``values[l]`` are ``(slots, kv_heads, capacity, head_dim)``.
    Rows ``[0, rows)`` are live; every row ends at column ``hi`` (left padding) and the next
    forward pass attends over columns ``[lo, hi)`` plus what it writes at ``hi``. Columns left
    of a row's own tokens hold zeros or stale values of an earlier row: always finite, and
    always masked out. Nothing here knows about sequences; the engine moves ``lo`` and ``hi``.
    """

    def __init__(self, geometry: Geometry) -> None:
        self.geometry = geometry
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = 0
        self.lo = 0
        self.hi = 0

    @property
    def slots(self) -> int:
        return self.keys[0].shape[0] if self.keys else 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[2] if self.keys else 0

    @property
    def width(self) -> int:
        return self.hi - self.lo

    def state(self) -> StoreState:
        return self.keys, self.values, self.rows, self.lo, self.hi

    def set_state(self, state: StoreState) -> None:
        self.keys, self.values, self.rows, self.lo, self.hi = state

    def clear(self) -> None:
        """No rows left: give the buffers back (the next batch allocates what it needs)."""
        self.keys, self.values = [], []
        self.rows = self.lo = self.hi = 0

    def positions_with(self, rows: int, longest: int) -> int:
        """The positions (slots x columns) the buffers would hold with ``rows`` rows, the longest
        of which holds ``longest`` columns, grown from what they hold now as :meth:`reserve`
        grows them (slots and columns powers of two, the columns twice the window's; neither
        shrinks while a row lives)."""
        slots = _next_pow2(rows) if rows > self.slots else self.slots
        capacity = self.capacity
        if 2 * longest > capacity:
            capacity = max(MIN_CAPACITY, _next_pow2(2 * longest))
        return slots * capacity

    def reserve(self, *, rows: int, left: int, right: int) -> None:
        """Make room for ``rows`` rows, a block of ``left`` columns ending at ``hi`` and
        ``right`` columns from ``hi`` on. Moves the window back to the left and reallocates
        (to powers of two) only when needed; the columns the old window held are left untouched (a
        move within the buffers writes only left of them), so a failure here changes
        nothing."""
        if (
            self.keys
            and rows <= self.slots
            and self.hi >= left
            and self.hi + right <= self.capacity
        ):
            return
        width = self.width
        hi = max(width, left)
        # a power of two: however the rows join, step by step or at once, the slots they end in
        # are the same (what positions_with tells an admission ahead of the steps)
        slots = _next_pow2(rows) if rows > self.slots else self.slots
        capacity = self.capacity
        if 2 * (hi + right) > capacity:
            # twice what the window needs: it slides as far as it is wide before it moves
            # again, and then moves within the buffers (below)
            capacity = max(MIN_CAPACITY, _next_pow2(2 * (hi + right)))
        if self.keys and (slots, capacity) == (self.slots, self.capacity) and hi <= self.lo:
            # The window moves back to the left within the buffers, clear of the columns it
            # leaves (a rolled-back step finds them as they were). New buffers would be zeroed
            # whole: SmolLM2 in float32 with 22 slots of 256 columns, ~260 MB and 30-90 ms.
            for buffers in (self.keys, self.values):
                for buf in buffers:
                    rows_now = buf[: self.rows]
                    rows_now[:, :, hi - width : hi] = rows_now[:, :, self.lo : self.hi]
            self.lo, self.hi = hi - width, hi
            return
        g = self.geometry

        def grown(old: list[torch.Tensor]) -> list[torch.Tensor]:
            new = []
            for layer in range(g.layers):
                shape = (slots, g.kv_heads, capacity, g.head_dim)
                buf = torch.zeros(shape, dtype=g.dtype, device=g.device)
                if self.rows and width:
                    buf[: self.rows, :, hi - width : hi] = old[layer][
                        : self.rows, :, self.lo : self.hi
                    ]
                new.append(buf)
            return new

        self.keys, self.values = grown(self.keys), grown(self.values)
        self.lo, self.hi = hi - width, hi

    def move(self, sources: Sequence[int], targets: Sequence[int]) -> None:
        """Copy rows ``sources`` into slots ``targets`` (disjoint), over the window."""
        if not sources:
            return
        device = self.keys[0].device
        src = torch.tensor(sources, device=device)
        dst = torch.tensor(targets, device=device)
        for buffers in (self.keys, self.values):
            for buf in buffers:
                window = buf.narrow(2, self.lo, self.width)
                window.index_copy_(0, dst, window.index_select(0, src))
