"""The running batch's KV store: the window moves back to the left within its buffers when there
is room, writing nothing the old window held, and reallocates only to grow (to twice what the
window needs, so that it moves within its buffers from then on)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation.kv_slots import Geometry, SlotStore  # noqa: E402


def _store(rows: int, width: int) -> SlotStore:
    """A store of ``rows`` live rows whose window ends near the end of 64 columns."""
    store = SlotStore(Geometry(2, 1, 4, torch.float32, torch.device("cpu")))
    store.reserve(rows=rows, left=width, right=1)
    assert store.capacity == 64
    store.rows, store.lo = rows, store.hi - width  # as the engine sets them after a prefill
    # slide the window right as decode steps do, writing each new column as a step would
    while store.hi + 1 < store.capacity:
        for buf in (*store.keys, *store.values):
            buf[:rows, :, store.hi] = float(store.hi)
        store.hi += 1
        store.lo += 1
    return store


def test_the_window_moves_left_in_place_and_the_old_columns_stay() -> None:
    store = _store(rows=3, width=20)
    buffers = [*store.keys, *store.values]
    before = store.state()
    old = [buf[:, :, store.lo : store.hi].clone() for buf in buffers]
    lo, hi = store.lo, store.hi
    store.reserve(rows=3, left=5, right=8)  # past the end: the window must move
    now = [*store.keys, *store.values]
    assert all(a is b for a, b in zip(now, buffers, strict=True))  # the same, not new ones
    assert (store.lo, store.hi) == (0, 20)
    for buf, window in zip(buffers, old, strict=True):
        assert torch.equal(buf[:3, :, store.lo : store.hi], window[:3])  # moved
        assert torch.equal(buf[:, :, lo:hi], window)  # a rolled-back step finds it as it was
    store.set_state(before)
    assert (store.lo, store.hi) == (lo, hi)


def test_a_window_that_needs_more_room_takes_new_buffers_twice_as_wide() -> None:
    store = _store(rows=2, width=20)  # lo = 43
    buffers = [*store.keys, *store.values]
    old = store.keys[0][:2, :, store.lo : store.hi].clone()
    store.reserve(rows=2, left=50, right=8)  # a prompt of 50: the window must end at 50
    assert store.capacity == 128  # twice the 58 columns it needs, rounded up
    assert all(new is not was for new, was in zip(store.keys, buffers, strict=False))
    assert (store.lo, store.hi) == (30, 50)
    assert torch.equal(store.keys[0][:2, :, 30:50], old)


def test_however_rows_join_the_store_grows_to_what_positions_with_said() -> None:
    """Slots and columns are powers of two: rows joining a few at a time end in the buffers
    they would have at once, so an admission can tell ahead of the steps what a set of rows
    will take (the scheduler bounds it: ``continuous.KV_STORE_FACTOR``)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    joins = st.lists(st.tuples(st.integers(1, 9), st.integers(1, 300)), min_size=1, max_size=8)

    @settings(max_examples=60, deadline=None)
    @given(joins)
    def grows_as_said(batches: list[tuple[int, int]]) -> None:
        store = SlotStore(Geometry(1, 1, 2, torch.float32, torch.device("cpu")))
        rows = longest = 0
        for more, length in batches:
            rows, longest = rows + more, max(longest, length)
            said = store.positions_with(rows, longest + 1)  # its prompt and one new token
            store.reserve(rows=rows, left=longest, right=1)
            store.rows, store.lo = rows, store.hi - longest  # as the engine sets them
            assert store.slots * store.capacity == said
            assert store.slots & (store.slots - 1) == 0  # a power of two
        at_once = SlotStore(Geometry(1, 1, 2, torch.float32, torch.device("cpu")))
        at_once.reserve(rows=rows, left=longest, right=1)
        assert at_once.slots == store.slots

    grows_as_said()
