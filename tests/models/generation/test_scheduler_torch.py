"""The schedulers over the real torch step engine (a tiny random Llama): sequences join and
leave a running batch mid-way, and greedy outputs must not change. Skipped without torch."""

from __future__ import annotations

import asyncio
from typing import Any

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.static import SequentialGenerator, StaticGenerator
from batchline.models.generation.stream import TextGenerator

from .gen_helpers import TOK

# prompts of different lengths and outputs of different lengths: in continuous batching,
# short ones leave and waiting ones are prefilled while long ones keep decoding
WORK = [
    ([5 + (i * 13 + k) % 200 for k in range(3 + (i * 5) % 17)], 4 + (i * 7) % 23) for i in range(10)
]


def run(make: Any, engine: Any) -> list[tuple[tuple[int, ...], str]]:
    async def go() -> list[tuple[tuple[int, ...], str]]:
        gen: TextGenerator = make(engine)
        async with gen:
            streams = [
                gen.submit(prompt, SamplingParams(max_tokens=n, ignore_eos=True))
                for prompt, n in WORK
            ]
            done = [await s.result() for s in streams]
        return [(c.token_ids, c.finish_reason) for c in done]

    return asyncio.run(go())


def test_greedy_outputs_are_the_same_one_at_a_time_static_and_continuous(tiny_llama: Any) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    engine = TorchStepEngine(tiny_llama)
    alone = run(lambda e: SequentialGenerator(e, TOK), engine)
    static = run(lambda e: StaticGenerator(e, TOK, max_batch_size=4), engine)
    continuous = run(lambda e: ContinuousGenerator(e, TOK, max_running=3), engine)
    assert [len(ids) for ids, _ in alone] == [n for _, n in WORK]
    assert static == alone
    assert continuous == alone
    assert not engine.has_unfinished()
    assert engine.kv_tokens_in_use() == 0


def test_abort_and_stop_strings_free_torch_engine_slots(tiny_llama: Any) -> None:
    from batchline.models.generation.torch_engine import TorchStepEngine

    engine = TorchStepEngine(tiny_llama)

    async def go() -> None:
        async with ContinuousGenerator(engine, TOK, max_running=2) as gen:
            a = gen.submit(WORK[0][0], SamplingParams(max_tokens=60, ignore_eos=True))
            b = gen.submit(WORK[1][0], SamplingParams(max_tokens=5, ignore_eos=True))
            first = await a.__anext__()
            a.abort()
            c = gen.submit(WORK[2][0], SamplingParams(max_tokens=5, ignore_eos=True))
            done = await asyncio.gather(a.result(), b.result(), c.result())
        assert first.token_ids
        assert [d.finish_reason for d in done] == ["abort", "length", "length"]

    asyncio.run(go())
    assert not engine.has_unfinished()
    assert engine.kv_tokens_in_use() == 0
