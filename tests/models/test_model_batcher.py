"""``ModelBatcher``'s batch target by input kind: an image model's pictures count
``PICTURE_TOKENS`` each toward ``target_batch_tokens``, a text model's items their cost."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence

import pytest

from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.image import PICTURE_TOKENS
from batchline.models.protocol import InputKind, ModelInfo


class _Recorder:
    """A model whose batches are recorded; every item costs 1."""

    def __init__(self, input_kind: InputKind) -> None:
        self.info = ModelInfo(name="rec", task="embed", input_kind=input_kind)
        self.sizes: list[int] = []

    def prepare(self, inputs: Sequence[object]) -> list[object]:
        return list(inputs)

    def cost(self, item: object) -> int:
        return 1

    def run_batch(self, batch: list[object]) -> list[object]:
        self.sizes.append(len(batch))
        return list(batch)

    def encode(self, result: object) -> object:
        return result

    def close(self) -> None:
        pass


def _sizes(input_kind: InputKind, knobs: Knobs, items: int) -> list[int]:
    model = _Recorder(input_kind)

    async def go() -> None:
        async with ModelBatcher(model, knobs) as engine:
            # submitting does not yield to the batcher: all are queued before the first batch
            futures = [await engine.submit(i) for i in range(items)]
            assert await asyncio.gather(*futures) == list(range(items))

    asyncio.run(go())
    return model.sizes


@pytest.mark.parametrize("tokens", [512, 2048])
def test_an_image_model_batches_target_tokens_over_picture_tokens(tokens: int) -> None:
    knobs = Knobs(sessions=1, max_concurrent_batches=1, target_batch_tokens=tokens)
    per_batch = tokens // PICTURE_TOKENS
    sizes = _sizes("image", knobs, 3 * per_batch + 1)
    assert sizes == [per_batch] * 3 + [1]


def test_a_text_model_of_the_same_costs_fills_the_token_target() -> None:
    knobs = Knobs(sessions=1, max_concurrent_batches=1, target_batch_tokens=64)
    assert _sizes("text", knobs, 130) == [64, 64, 2]


def test_an_image_models_bulk_lane_reads_its_tokens_as_pictures_too() -> None:
    """The Batch API's lane (priority below 0) closes at ``bulk_batch_tokens`` over
    ``PICTURE_TOKENS`` pictures, as live batches close at ``target_batch_tokens``'s."""
    knobs = Knobs(
        sessions=1,
        max_concurrent_batches=1,
        target_batch_tokens=256,
        bulk_batch_tokens=1024,
        bulk_slots=1,
    )
    model = _Recorder("image")
    per_batch = 1024 // PICTURE_TOKENS

    async def go() -> None:
        async with ModelBatcher(model, knobs) as engine:
            futures = engine.submit_many_nowait(list(range(2 * per_batch)), priority=-1)
            assert await asyncio.gather(*futures) == list(range(2 * per_batch))

    asyncio.run(go())
    assert model.sizes == [per_batch, per_batch]


def test_the_knobs_policy_is_passed_to_the_batcher_whole() -> None:
    knobs = Knobs(sessions=1, max_concurrent_batches=2, target_batch_tokens=300, bulk_slots=1)
    text = _Recorder("text")
    text.info = dataclasses.replace(text.info, cost_kind="padded")
    padded = ModelBatcher(text, knobs)
    assert padded.batcher.policy == knobs.policy(
        padding_slack=4, bucket_width=2, padding_aware=True
    )
    image = ModelBatcher(_Recorder("image"), knobs.replace(bulk_batch_tokens=900))
    assert image.batcher.policy.target_batch_cost == 300 // PICTURE_TOKENS
    assert image.batcher.policy.bulk_batch_cost == 900 // PICTURE_TOKENS
    assert image.batcher.policy.padding_aware is False  # additive: a plain DynamicBatcher
    baseline = ModelBatcher(_Recorder("text"), knobs.replace(batching=False)).batcher.policy
    assert (baseline.max_batch_size, baseline.max_concurrent_batches) == (1, 2)
