"""Statistics of the bench: percentiles, throughput, Poisson schedules. (The manual clock:
``tests/test_clock.py``.)"""

from __future__ import annotations

import math
import random
import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchline.bench.stats import (
    Sample,
    censored_latencies,
    percentile,
    poisson_arrivals,
    poisson_schedule,
    summarize,
    throughput,
)

finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, allow_infinity=False)


@given(st.lists(finite, min_size=1, max_size=200), st.floats(min_value=0, max_value=100))
def test_percentile_matches_numpy(values: list[float], q: float) -> None:
    assert percentile(values, q) == pytest.approx(
        float(np.percentile(values, q)), rel=1e-9, abs=1e-6
    )


@given(st.lists(finite, min_size=1, max_size=200))
def test_summary_matches_numpy(values: list[float]) -> None:
    s = summarize(values)
    assert s.count == len(values)
    for q, got in ((50, s.p50_s), (95, s.p95_s), (99, s.p99_s)):
        assert got == pytest.approx(float(np.percentile(values, q)), rel=1e-9, abs=1e-6)
    assert s.max_s == max(values)
    assert s.mean_s == pytest.approx(float(np.mean(values)), rel=1e-9, abs=1e-6)
    assert s.p50_s <= s.p95_s <= s.p99_s <= s.max_s


def test_summary_of_nothing_is_nan() -> None:
    s = summarize([])
    assert s.count == 0
    assert math.isnan(s.p99_s)


def test_throughput() -> None:
    assert throughput(300, 2.0) == 150.0
    assert throughput(10, 0.0) == 0.0
    with pytest.raises(ValueError, match="records"):
        throughput(-1, 1.0)


# -- Poisson schedules ---------------------------------------------------------------------


@given(
    rate=st.floats(min_value=0.5, max_value=2_000),
    duration=st.floats(min_value=0, max_value=20),
    start=st.floats(min_value=-100, max_value=100),
    seed=st.integers(0, 2**32),
)
@settings(max_examples=60, deadline=None)
def test_schedule_is_sorted_inside_the_window_and_seeded(
    rate: float, duration: float, start: float, seed: int
) -> None:
    times = poisson_schedule(rate, duration, seed=seed, start_s=start)
    assert times == sorted(times)
    assert all(start < t < start + duration for t in times)
    assert times == poisson_schedule(rate, duration, seed=seed, start_s=start)


@given(rate=st.floats(min_value=20, max_value=2_000), seed=st.integers(0, 2**32))
@settings(max_examples=40, deadline=None)
def test_schedule_has_the_rate_and_exponential_gaps(rate: float, seed: int) -> None:
    duration = 2_000 / rate  # about 2,000 arrivals
    times = poisson_schedule(rate, duration, seed=seed)
    n = len(times)
    # the count of a Poisson process: mean and variance rate * duration (2,000): 6 sigma
    assert abs(n - 2_000) < 6 * math.sqrt(2_000)
    gaps = np.diff([0.0, *times])
    # exponential gaps: mean 1/rate, and standard deviation equal to the mean
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.15)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.2)
    assert (gaps > 0).all()


def test_schedule_seeds_differ_and_a_generator_works() -> None:
    a = poisson_schedule(100, 5, seed=1)
    b = poisson_schedule(100, 5, seed=2)
    assert a != b
    assert poisson_schedule(100, 5, seed=random.Random(1)) == a


def test_schedule_counts_in_disjoint_windows_are_independent_of_each_other() -> None:
    # the counts in 1-second windows of a rate-50 process: Poisson(50), mean == variance
    times = poisson_schedule(50, 400, seed=7)
    counts = np.bincount(np.floor(times).astype(int), minlength=400)
    assert counts.mean() == pytest.approx(50, rel=0.05)
    assert counts.var() == pytest.approx(50, rel=0.25)


@pytest.mark.parametrize(("rate", "duration"), [(0, 1), (-1, 1), (math.inf, 1), (1, -1)])
def test_schedule_rejects_bad_arguments(rate: float, duration: float) -> None:
    with pytest.raises(ValueError, match="must be"):
        poisson_schedule(rate, duration, seed=0)


def test_arrivals_are_a_fixed_count_of_the_same_draws() -> None:
    times = poisson_arrivals(40, 25, seed=3)
    assert len(times) == 25
    assert times == sorted(times)
    assert times[0] > 0
    # the same process as the windowed schedule: its first arrivals are these
    window = poisson_schedule(40, times[-1] + 1, seed=3)
    assert window[:25] == times
    assert poisson_arrivals(40, 0, seed=3) == []
    with pytest.raises(ValueError, match="count must be"):
        poisson_arrivals(40, -1, seed=3)
    with pytest.raises(ValueError, match="rate_per_s must be"):
        poisson_arrivals(0, 1, seed=3)


# -- samples -------------------------------------------------------------------------------


def test_censored_latencies_count_unanswered_requests_as_a_lower_bound() -> None:
    samples = [
        Sample(0.0, 0.0, 0.010, True),
        Sample(1.0, 1.5, 1.6, True),  # sent late: latency from the intended time
        Sample(2.0, 2.0, 2.001, False),  # a quick error: says nothing about service
        Sample(3.0, 3.0, None, False),  # never answered before the cutoff at 10
    ]
    assert censored_latencies(samples, cutoff_s=10.0) == pytest.approx([0.010, 0.6, 7.0])
    assert samples[1].latency_s == pytest.approx(0.6)
    assert samples[1].service_s == pytest.approx(0.1)
    assert samples[3].latency_s is None


def test_statistics_mean_sanity() -> None:
    # summarize agrees with the statistics module too, on a fixed example
    values = [0.004, 0.002, 0.009, 0.001, 0.1]
    assert summarize(values).mean_s == pytest.approx(statistics.fmean(values))
