"""A long prompt among many short ones: where the engine's KV store is one rectangle of its rows
(``engine.KvRectangle``), admission keeps that rectangle within ``KV_STORE_FACTOR`` times the
budget, and every request still completes."""

from __future__ import annotations

import asyncio

from batchline.models.generation.continuous import KV_STORE_FACTOR, ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.fake import FakeEngine

from .gen_helpers import TOK

BUDGET = 1024


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


class RectangleEngine(FakeEngine):
    """A fake engine whose store is every row as wide as the longest, in powers of two (as the
    torch engine's ``SlotStore`` grows from nothing)."""

    def kv_positions_with(self, rows: int, longest: int) -> int:
        return _pow2(rows) * max(64, _pow2(2 * longest))


def test_rows_beside_a_long_prompt_are_kept_within_the_store_bound() -> None:
    engine = RectangleEngine(max_context_tokens=4096)
    long_prompt, short_prompt = [65] * 700, [66] * 4
    reservations = {"long": 700 + 8}
    reservations.update({f"s{i}": 4 + 8 for i in range(30)})

    async def main() -> list[str]:
        async with ContinuousGenerator(engine, TOK, max_running=32, kv_token_budget=BUDGET) as gen:
            params = SamplingParams(max_tokens=8, ignore_eos=True)
            streams = [gen.submit(long_prompt, params, request_id="long")]
            streams += [gen.submit(short_prompt, params, request_id=f"s{i}") for i in range(30)]
            return [(await s.result()).finish_reason for s in streams]

    assert asyncio.run(main()) == ["length"] * 31  # every one completed
    beside = [len(step.running) for step in engine.steps if "long" in step.running]
    assert beside  # the long prompt ran
    for step in engine.steps:
        rows, longest = len(step.running), max(reservations[r] for r in step.running)
        assert rows == 1 or engine.kv_positions_with(rows, longest) <= KV_STORE_FACTOR * BUDGET
    # without the bound, the sum of reservations alone would have let 27 short ones join it
    assert max(beside) <= 2
    assert max(len(step.running) for step in engine.steps) > 2  # the short ones ran together
