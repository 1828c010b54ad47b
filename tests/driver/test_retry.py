"""Backoff bounds and Retry-After parsing: no real time passes. (``retry.sleep`` is
``batchline._clock.sleep``, tested in ``tests/test_clock.py``.)"""

from __future__ import annotations

import email.utils
from datetime import UTC, datetime

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchline.driver.retry import Backoff, parse_retry_after


def test_the_ceiling_doubles_from_base_up_to_the_cap() -> None:
    b = Backoff(base_s=0.25, cap_s=3.0)
    assert [b.ceiling(n) for n in range(1, 7)] == [0.25, 0.5, 1.0, 2.0, 3.0, 3.0]
    assert b.ceiling(10_000) == 3.0  # no overflow on absurd attempt numbers


def test_full_jitter_spans_zero_to_the_ceiling() -> None:
    b = Backoff(base_s=1.0, cap_s=8.0)
    assert b.delay(3, rng=lambda: 0.0) == 0.0
    assert b.delay(3, rng=lambda: 0.5) == 2.0
    assert b.delay(3, rng=lambda: 1.0) == 4.0


def test_a_floor_keeps_a_delay_from_being_zero() -> None:
    b = Backoff(base_s=0.25, cap_s=5.0, floor_s=0.1)
    assert b.delay(1, rng=lambda: 0.0) == pytest.approx(0.1)
    assert b.delay(1, rng=lambda: 1.0) == pytest.approx(0.25)
    tiny = Backoff(base_s=0.05, cap_s=5.0, floor_s=0.1)
    assert tiny.delay(1, rng=lambda: 0.0) == pytest.approx(0.05)  # never above the ceiling


@given(
    base=st.floats(0.0, 10.0),
    extra=st.floats(0.0, 100.0),
    floor=st.floats(0.0, 5.0),
    attempt=st.integers(1, 500),
    u=st.floats(0.0, 1.0, exclude_max=True),
)
def test_every_delay_lies_within_its_bounds(
    base: float, extra: float, floor: float, attempt: int, u: float
) -> None:
    b = Backoff(base_s=base, cap_s=base + extra, floor_s=floor)
    top = b.ceiling(attempt)
    assert top <= b.cap_s
    assert top == min(b.cap_s, base * 2.0 ** min(attempt - 1, 60))
    delay = b.delay(attempt, rng=lambda: u)
    assert min(floor, top) <= delay <= top


@pytest.mark.parametrize(
    "kwargs",
    [{"base_s": -1.0}, {"cap_s": float("inf")}, {"base_s": 2.0, "cap_s": 1.0}, {"floor_s": -0.1}],
)
def test_bad_settings_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        Backoff(**kwargs)


def test_attempts_count_from_one() -> None:
    with pytest.raises(ValueError, match="attempt must be >= 1"):
        Backoff().ceiling(0)


@pytest.mark.parametrize(
    ("header", "seconds"),
    [
        ("1", 1.0),
        (" 120 ", 120.0),
        ("0", 0.0),
        ("1.5", 1.5),
        ("-1", None),
        ("inf", None),
        ("nan", None),
        ("", None),
        ("   ", None),
        (None, None),
        ("soon", None),
        ("1e400", None),
        ("12abc", None),
    ],
)
def test_retry_after_in_seconds(header: str | None, seconds: float | None) -> None:
    assert parse_retry_after(header, now_wall=1_000_000.0) == seconds


def test_retry_after_as_an_http_date() -> None:
    now = datetime(2026, 11, 3, 12, 0, 0, tzinfo=UTC).timestamp()
    later = email.utils.format_datetime(datetime(2026, 11, 3, 12, 0, 30, tzinfo=UTC), usegmt=True)
    assert later == "Tue, 03 Nov 2026 12:00:30 GMT"
    assert parse_retry_after(later, now_wall=now) == pytest.approx(30.0)
    # a date in the past means "now", not a negative wait
    assert parse_retry_after("Tue, 03 Nov 2026 11:59:00 GMT", now_wall=now) == 0.0
    # the obsolete formats RFC 9110 asks recipients to accept, and a date without its zone
    assert parse_retry_after("Tuesday, 03-Nov-26 12:01:00 GMT", now_wall=now) == pytest.approx(60)
    assert parse_retry_after("Tue Nov  3 12:00:10 2026", now_wall=now) == pytest.approx(10.0)
    assert parse_retry_after("Tue, 32 Nov 2026 12:00:00 GMT", now_wall=now) is None
