"""Retry timing: exponential backoff with full jitter, ``Retry-After`` parsing, clock sleeps.

Everything here takes its time and randomness from arguments, so the rules are tested on a
``ManualClock`` with a fixed random source, never by sleeping.

    >>> policy = Backoff(base_s=0.25, cap_s=30.0)
    >>> policy.ceiling(1), policy.ceiling(3)         # the upper bound before jitter
    (0.25, 1.0)
    >>> 0.0 <= policy.delay(3) <= 1.0                 # full jitter: uniform in [0, ceiling]
    True
    >>> parse_retry_after("2", now_wall=0.0)
    2.0
"""

from __future__ import annotations

import email.utils
import math
import random
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC

from batchline._clock import sleep

__all__ = ["Backoff", "parse_retry_after", "sleep"]

# 2**60 times any sensible base is far beyond any cap; the exponent stops growing there.
_MAX_DOUBLINGS = 60


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential backoff with full jitter (a uniform draw below an exponential ceiling).

    Retry ``n`` (1-based) waits a uniform random time in ``[min(floor_s, c), c]`` where
    ``c = min(cap_s, base_s * 2 ** (n - 1))``. Full jitter spreads clients that failed together
    so they do not return together; ``floor_s`` keeps a probe loop from spinning.
    """

    base_s: float = 0.25
    cap_s: float = 30.0
    floor_s: float = 0.0

    def __post_init__(self) -> None:
        for name in ("base_s", "cap_s", "floor_s"):
            value = getattr(self, name)
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.cap_s < self.base_s:
            raise ValueError(f"cap_s must be >= base_s, got cap_s={self.cap_s} < {self.base_s}")

    def ceiling(self, attempt: int) -> float:
        """The largest delay retry ``attempt`` (1-based) may wait."""
        if attempt < 1:
            raise ValueError(f"attempt must be >= 1, got {attempt}")
        return min(self.cap_s, self.base_s * 2.0 ** min(attempt - 1, _MAX_DOUBLINGS))

    def delay(self, attempt: int, rng: Callable[[], float] = random.random) -> float:
        """A jittered delay for retry ``attempt``; ``rng()`` returns a float in [0, 1)."""
        top = self.ceiling(attempt)
        low = min(self.floor_s, top)
        return low + rng() * (top - low)


def parse_retry_after(value: str | None, *, now_wall: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` header, or ``None`` if absent or unusable.

    The header holds either delay-seconds (``"120"``; a decimal is accepted too) or an HTTP
    date (``"Wed, 21 Oct 2026 07:28:00 GMT"``), which is turned into a delay from
    ``now_wall`` (Unix seconds). A date in the past means "now" (0.0). Negative, infinite or
    malformed values are ignored rather than trusted.
    """
    if value is None:
        return None
    text = value.strip()
    if not text:
        return None
    if text[0].isdigit() or text[0] in "+-.":
        try:
            seconds = float(text)
        except ValueError:
            return None
        if not math.isfinite(seconds) or seconds < 0:
            return None
        return seconds
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # RFC 9110 dates are GMT; be lenient with ones that omit it
        when = when.replace(tzinfo=UTC)
    return max(0.0, when.timestamp() - now_wall)
