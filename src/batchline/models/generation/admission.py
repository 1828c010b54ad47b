"""What one more running row costs a decode step, measured: the rule by which
:class:`~batchline.models.generation.continuous.ContinuousGenerator` runs more sequences than
its ``max_running`` where they pay.

A decode step's time grows with its rows, but not in proportion: each step streams every
weight once whatever its rows, so on a CPU or a GPU a step of 16 rows costs far less than 16
steps of one. The fixed part shrinks per row as rows are added, until the step is bound by its
arithmetic and a row costs about what an average row does. SmolLM2-135M, bf16, one thread on
this project's 2-core AVX-512 host: 16 rows 23.2 ms a step (1.45 ms a row), 32 rows 35.5 ms
(+0.77 ms a row), 64 rows 61.7 ms (+0.82 ms a row); tokens/s 690, 901, 1,037 (2026-11-28).

:class:`RowCost` keeps the mean time of the decode-only steps at each row count it has seen,
fits a line through the counts around the one asked about, and calls one more row worth
running while its marginal cost (the slope) is at most ``ratio`` times the average row's cost
(the fitted step time over the rows). Past that point a row adds almost as much time to every
running sequence's next token as it adds tokens to the step: latency for little throughput.
The rule assumes nothing of the device: it is the same on a GPU, where the fixed part lasts
to hundreds of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RowCost"]


@dataclass(slots=True)
class _Mean:
    seconds: float
    count: int
    last: int  # the observation that last moved it (RowCost's count of all of them)


class RowCost:
    """The measured cost of decode steps by row count, and whether one more row pays.

    >>> cost = RowCost(min_samples=1, min_span=2)
    >>> for rows in (14, 15, 16):
    ...     cost.observe(rows, 0.010 + 0.0005 * rows)   # a fixed 10 ms, then 0.5 ms a row
    >>> cost.pays(16)   # 0.5 ms against 0.8 x (18 ms / 16 rows)
    True

    Args:
        ratio: a row pays while its marginal cost is at most this share of an average row's.
        weight: how much each new step moves its row count's mean (an exponentially weighted
            mean, so the figures follow a device that slows or speeds up).
        min_samples: steps a row count needs before it counts in a fit.
        min_span: rows the fitted counts must cover; less, and :meth:`pays` says it does not
            know (a slope over one row is mostly noise: a step's time varies by ~5 %).
        span: the fit takes the counts from ``rows - span`` to ``rows`` (and to ``rows +
            span`` where those do not say enough).
        max_age: a count above the one asked about counts only if one of the last ``max_age``
            steps moved it; an older one starts afresh at its next step. A cap that fell back
            on a transient (another process had the core) no longer runs those counts, so their
            means would never recover: this way they are measured again.
    """

    def __init__(
        self,
        *,
        ratio: float = 0.8,
        weight: float = 0.1,
        min_samples: int = 8,
        min_span: int = 4,
        span: int = 12,
        max_age: int = 256,
    ) -> None:
        if not 0 < ratio <= 1:
            raise ValueError(f"ratio must be in (0, 1], got {ratio!r}")
        if not 0 < weight <= 1:
            raise ValueError(f"weight must be in (0, 1], got {weight!r}")
        if min_samples < 1 or min_span < 1 or span < min_span:
            raise ValueError(
                f"need min_samples >= 1 and 1 <= min_span <= span, got {min_samples}, "
                f"{min_span}, {span}"
            )
        self.ratio = ratio
        self._weight = weight
        self._min_samples = min_samples
        self._min_span = min_span
        self._span = span
        self._max_age = max_age
        self._means: dict[int, _Mean] = {}
        self._observed = 0

    def observe(self, rows: int, seconds: float) -> None:
        """One decode-only step (no prompt tokens in it) of ``rows`` rows took ``seconds``."""
        if rows < 1 or not seconds > 0:
            return
        self._observed += 1
        mean = self._means.get(rows)
        if mean is None or self._observed - mean.last > self._max_age:
            self._means[rows] = _Mean(seconds, 1, self._observed)
            return
        mean.last = self._observed
        if mean.count >= self._min_samples:
            # a stall (the KV store growing, a collection) is not what a row costs: it moves
            # the mean as a step of 1.5x would, no more
            seconds = min(seconds, 1.5 * mean.seconds)
        mean.count += 1
        # a plain mean over the first 1/weight steps, then exponentially weighted
        mean.seconds += (seconds - mean.seconds) * max(self._weight, 1.0 / mean.count)

    def step_seconds(self, rows: int) -> float | None:
        """The mean time of a decode-only step of ``rows`` rows, where measured."""
        mean = self._means.get(rows)
        return None if mean is None else mean.seconds

    def measured(self, rows: int) -> bool:
        """Whether steps of ``rows`` rows are measured enough to count in a fit."""
        mean = self._means.get(rows)
        return mean is not None and mean.count >= self._min_samples

    def marginal(self, rows: int) -> tuple[float, float] | None:
        """The fitted cost of one more row at ``rows`` rows and the average row's cost there,
        in seconds; None until enough row counts near ``rows`` are measured. The counts at
        and below ``rows`` first (those above may lie past a knee where rows stop paying),
        and those above too where the ones below do not say enough (a cap that fell back)."""
        near = [
            (n, mean.seconds, min(mean.count, round(1 / self._weight)))
            for n, mean in self._means.items()
            if abs(n - rows) <= self._span
            and self.measured(n)
            and (n <= rows or self._observed - mean.last <= self._max_age)
        ]
        for points in ([p for p in near if p[0] <= rows], near):
            counts = [n for n, _, _ in points]
            if len(points) >= 2 and max(counts) - min(counts) >= self._min_span:
                return self._fit(points, rows)
        return None

    @staticmethod
    def _fit(points: list[tuple[int, float, int]], rows: int) -> tuple[float, float] | None:
        # weighted least squares of seconds on rows (each count weighs by its samples)
        total = sum(w for _, _, w in points)
        mean_n = sum(n * w for n, _, w in points) / total
        mean_t = sum(t * w for _, t, w in points) / total
        spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
        slope = sum(w * (n - mean_n) * (t - mean_t) for n, t, w in points) / spread
        fitted = mean_t + slope * (rows - mean_n)
        if not fitted > 0:
            return None
        return slope, fitted / rows

    def pays(self, rows: int) -> bool | None:
        """Whether a step of ``rows + 1`` rows is worth it against one of ``rows``; None while
        the counts up to ``rows`` are not measured enough to say."""
        found = self.marginal(rows)
        if found is None:
            return None
        slope, average = found
        return slope <= self.ratio * average
