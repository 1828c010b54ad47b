"""The running cap measured, not assumed: :class:`RowCost`'s fit, and the continuous
scheduler's cap moving with it, on a manual clock whose every step costs what a given
function of its rows says (no real-clock timing anywhere)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchline import ManualClock
from batchline.models.generation.admission import RowCost
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams, StepOutput
from batchline.models.generation.fake import FakeEngine

from .gen_helpers import TOK

# -- the fit -------------------------------------------------------------------------------


def measured(cost: Callable[[int], float], rows: Sequence[int], samples: int = 8) -> RowCost:
    found = RowCost()
    for n in rows:
        for _ in range(samples):
            found.observe(n, cost(n))
    return found


def test_a_row_pays_while_the_step_has_a_fixed_part_to_share() -> None:
    # 10 ms of weights, 0.5 ms a row: at 16 rows an average row costs 1.125 ms
    cost = measured(lambda n: 0.010 + 0.0005 * n, range(12, 17))
    slope, average = cost.marginal(16) or (0.0, 0.0)
    assert slope == pytest.approx(0.0005)
    assert average == pytest.approx(0.018 / 16)
    assert cost.pays(16) is True


def test_a_row_does_not_pay_once_it_costs_what_an_average_row_does() -> None:
    # no fixed part: every row costs the same, and a bigger step only delays the others
    assert measured(lambda n: 0.001 * n, range(12, 17)).pays(16) is False
    # a fixed part small beside the rows: the marginal row is 0.95 of an average one
    assert measured(lambda n: 0.0008 + 0.001 * n, range(12, 17)).pays(16) is False


def test_nothing_is_said_until_the_counts_below_are_measured_and_spread() -> None:
    line = lambda n: 0.010 + 0.0005 * n  # noqa: E731
    assert RowCost().pays(16) is None
    assert measured(line, [16]).pays(16) is None  # one count: no slope
    assert measured(line, [15, 16]).pays(16) is None  # a slope over one row is noise
    assert measured(line, [12, 16], samples=7).pays(16) is None  # too few steps each
    assert measured(line, [12, 16]).pays(16) is True
    # counts above count where those below do not say enough (a cap that fell back has its
    # measures above it); counts far from it never
    assert measured(line, [16, 20]).pays(16) is True
    assert measured(line, [16, 20]).pays(20) is True
    assert measured(line, [2, 16]).pays(16) is None
    assert measured(line, [16, 30]).pays(16) is None


def test_the_counts_below_decide_where_they_can_those_past_a_knee_do_not() -> None:
    # a fixed 20 ms and 0.5 ms a row to 40 rows, then 4 ms a row: at 36 the counts 24-36 say
    # a row pays; a fit through 42-48 as well would say it does not
    def knee(n: int) -> float:
        return (20 + 0.5 * min(n, 40) + 4.0 * max(0, n - 40)) / 1000

    cost = measured(knee, range(24, 49, 2))
    assert cost.pays(36) is True
    assert cost.pays(46) is False


def test_each_count_follows_its_recent_steps() -> None:
    cost = RowCost(weight=0.5)  # 8 samples before a stall is clipped: none here
    cost.observe(8, 0.010)
    cost.observe(8, 0.020)  # a plain mean while the count is young
    assert cost.step_seconds(8) == pytest.approx(0.015)
    cost.observe(8, 0.035)  # then weighted: half way to the newest
    assert cost.step_seconds(8) == pytest.approx(0.025)
    cost.observe(8, 0.0)  # not a step: ignored
    cost.observe(0, 0.5)
    assert cost.step_seconds(8) == pytest.approx(0.025)
    assert cost.step_seconds(0) is None


def test_a_stall_moves_a_measured_count_no_more_than_a_step_of_one_and_a_half() -> None:
    cost = RowCost(weight=0.5, min_samples=2)
    cost.observe(8, 0.010)
    cost.observe(8, 0.010)
    cost.observe(8, 0.090)  # a 90 ms stall counts as 15 ms
    assert cost.step_seconds(8) == pytest.approx(0.0125)
    young = RowCost(min_samples=2)
    young.observe(8, 0.010)
    young.observe(8, 0.030)  # before min_samples a count takes every step as it is
    assert young.step_seconds(8) == pytest.approx(0.020)


@given(
    fixed_ms=st.floats(0.0, 50.0),
    row_ms=st.floats(0.05, 5.0),
    rows=st.integers(6, 200),
)
def test_on_a_line_a_row_pays_exactly_while_the_fixed_part_is_large_enough(
    fixed_ms: float, row_ms: float, rows: int
) -> None:
    # t = a + b n: b <= 0.8 (a + b n) / n  <=>  n <= 4 a / b
    cost = measured(lambda n: (fixed_ms + row_ms * n) / 1000, range(rows - 4, rows + 1))
    bound = 4 * fixed_ms / row_ms
    if abs(rows - bound) > 1e-6 * max(1.0, bound):  # not on the edge, where rounding decides
        assert cost.pays(rows) is (rows <= bound)


def test_bad_settings_are_refused() -> None:
    for bad in ({"ratio": 0.0}, {"ratio": 1.5}, {"weight": 0.0}, {"min_span": 5, "span": 4}):
        with pytest.raises(ValueError, match=r"must be|need"):
            RowCost(**bad)  # type: ignore[arg-type]


# -- the scheduler's cap ---------------------------------------------------------------------


class CostedEngine(FakeEngine):
    """A FakeEngine whose each step moves ``clock`` by ``cost(rows)``, and records its rows."""

    def __init__(self, clock: ManualClock, cost: Callable[[int], float]) -> None:
        super().__init__()
        self.clock = clock
        self.cost = cost
        self.rows: list[int] = []

    def step(self) -> Sequence[StepOutput]:
        rows = len(self._seqs)
        self.rows.append(rows)
        self.clock.advance(self.cost(rows))
        return super().step()


async def run_all(
    cost: Callable[[int], float], *, requests: int = 400, max_tokens: int = 48, **options: int
) -> tuple[CostedEngine, ContinuousGenerator]:
    """``requests`` queued at once through a generator on ``cost``; all of them finished."""
    clock = ManualClock()
    engine = CostedEngine(clock, cost)
    gen = ContinuousGenerator(engine, TOK, clock=clock, max_waiting=requests, **options)
    async with gen:
        streams = [
            gen.submit(TOK.encode(f"q{i}"), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            for i in range(requests)
        ]
        done = await asyncio.gather(*(s.result() for s in streams))
    assert [d.completion_tokens for d in done] == [max_tokens] * requests  # nothing lost
    return engine, gen


@pytest.mark.anyio
async def test_the_cap_rises_while_rows_pay_and_stops_where_the_step_turns_compute_bound() -> None:
    # 20 ms fixed, 0.5 ms a row up to 40 rows, then 4 ms a row: a row pays up to 40 rows
    # (0.5 <= 0.8 x 40 / 40 ms) and never beyond (4 > 0.8 x (40 + 4 k) / (40 + k))
    def cost(n: int) -> float:
        return (20 + 0.5 * min(n, 40) + 4.0 * max(0, n - 40)) / 1000

    engine, gen = await run_all(cost, max_running=64, start_running=16)
    assert max(engine.rows) <= 64
    # past the knee by no more than the rows a fit of 4 to 12 counts takes to see it
    assert 40 <= max(engine.rows) <= 44
    assert 40 <= gen.stats.running_cap <= 44
    assert max(engine.rows[:5]) == 16  # it started at start_running


@pytest.mark.anyio
async def test_the_cap_stays_at_its_start_where_no_row_pays() -> None:
    engine, gen = await run_all(lambda n: 0.001 * n, max_running=64, start_running=16)
    # it measured 16..20 to learn that, then came back down
    assert max(engine.rows) <= 20
    assert gen.stats.running_cap == 16


@pytest.mark.anyio
async def test_the_cap_reaches_max_running_where_every_row_pays_and_never_passes_it() -> None:
    engine, gen = await run_all(lambda n: (30 + 0.1 * n) / 1000, max_running=32, start_running=8)
    assert max(engine.rows) == 32
    assert gen.stats.running_cap == 32


@pytest.mark.anyio
async def test_without_a_start_below_max_running_the_cap_is_fixed() -> None:
    engine, gen = await run_all(lambda n: (30 + 0.1 * n) / 1000, requests=60, max_running=12)
    assert max(engine.rows) == 12
    assert gen.stats.running_cap == 12


@pytest.mark.anyio
async def test_the_cap_does_not_rise_while_nothing_waits() -> None:
    # 10 requests under a start of 16: nobody waits for a row, so the cap has no reason to move
    engine, gen = await run_all(lambda n: (30 + 0.1 * n) / 1000, requests=10, max_running=64)
    assert gen.stats.running_cap == 64  # start_running unset: fixed at max_running
    assert max(engine.rows) == 10
    engine, gen = await run_all(
        lambda n: (30 + 0.1 * n) / 1000, requests=10, max_running=64, start_running=16
    )
    assert gen.stats.running_cap == 16
    assert max(engine.rows) == 10


@pytest.mark.anyio
async def test_a_cap_that_fell_back_on_a_transient_grows_again_from_the_measures_above_it() -> None:
    # every row pays (a fixed 30 ms), but the first steps at 20 rows take 60 ms more (another
    # process had the core): the cap falls back to 16 with nothing measured below it, then
    # the counts above, as their means recover, say that rows pay after all
    slow = {"left": 10}

    def cost(n: int) -> float:
        if n == 20 and slow["left"] > 0:
            slow["left"] -= 1
            return 0.090 + 0.0001 * n
        return 0.030 + 0.0001 * n

    engine, gen = await run_all(cost, requests=600, max_running=32, start_running=16)
    assert slow["left"] == 0  # the transient happened
    fell = next(i for i in range(1, len(engine.rows)) if engine.rows[i] < engine.rows[i - 1] - 2)
    assert max(engine.rows[:fell]) <= 21  # it fell back from around 20
    assert gen.stats.running_cap == 32
    assert max(engine.rows) == 32
