"""The engine layer: any model behind batching, or behind the single-shared-session baseline.

``run``, ``serve``, ``bench``, ``tune`` and the Ray replicas build their batcher here, from one
:class:`~batchline.knobs.Knobs`, so what ``tune`` measures is what ``serve`` runs.

- batching: a ``TokenBatcher`` (``padded`` models: a batch costs ``len(batch) × longest``,
  length-grouped) or a ``DynamicBatcher`` (``additive``), ``target_batch_tokens`` budget,
  ``max_concurrent_batches`` slots, optionally on a shared :class:`batchline.Device`;
- baseline (``batching=False``): a batcher of one record per call, with as many callers at
  once as ``max_concurrent_batches`` on the model's one shared session.

Example::

    model = load_model(parse_spec("default"), knobs)
    async with Engine(model, knobs) as engine:
        items = model.prepare(["hello", "world"])
        vectors = await asyncio.gather(*[await engine.submit(i) for i in items])
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Generic, TypeVar

from batchline._batcher import DynamicBatcher
from batchline._stats import BatchStats
from batchline._tokens import TokenBatcher
from batchline.knobs import DEFAULT_BUCKET_WIDTH, DEFAULT_PADDING_SLACK, Knobs
from batchline.models.protocol import BatchModel

__all__ = ["Engine"]

P = TypeVar("P")
R = TypeVar("R")


class Engine(Generic[P, R]):
    """A model and the batcher that feeds it; see the module docstring."""

    def __init__(
        self,
        model: BatchModel[P, R],
        knobs: Knobs,
        *,
        device: Any = None,
        weight: float = 1.0,
        padding_slack: int = DEFAULT_PADDING_SLACK,
        bucket_width: int = DEFAULT_BUCKET_WIDTH,
        name: str | None = None,
    ) -> None:
        self.model = model
        self.knobs = knobs
        self.batching = knobs.batching
        label = name or model.info.name
        shared: dict[str, Any] = {}
        if device is not None:
            shared = {"device": device, "weight": weight}
        self._padded = knobs.batching and model.info.cost_kind == "padded"
        self._batcher: DynamicBatcher[P, R]
        if not knobs.batching:
            self._batcher = DynamicBatcher(
                model.run_batch,
                max_batch_size=1,
                max_concurrent_batches=knobs.max_concurrent_batches,
                max_queue_size=knobs.max_queue_size,
                name=f"{label}-no-batching",
                **shared,
            )
        elif self._padded:
            self._batcher = TokenBatcher(
                model.run_batch,
                target_batch_tokens=knobs.target_batch_tokens,
                max_batch_size=knobs.max_batch_size,
                min_batch_size=min(knobs.min_batch_size, knobs.max_batch_size),
                batch_timeout_s=knobs.batch_timeout_s,
                max_queue_size=knobs.max_queue_size,
                max_concurrent_batches=knobs.max_concurrent_batches,
                padding_slack=padding_slack,
                bucket_width=bucket_width,
                name=label,
                **shared,
            )
        else:
            self._batcher = DynamicBatcher(
                model.run_batch,
                cost_estimator=model.cost,
                target_batch_cost=knobs.target_batch_tokens,
                max_batch_size=knobs.max_batch_size,
                min_batch_size=min(knobs.min_batch_size, knobs.max_batch_size),
                batch_timeout_s=knobs.batch_timeout_s,
                max_queue_size=knobs.max_queue_size,
                max_concurrent_batches=knobs.max_concurrent_batches,
                name=label,
                **shared,
            )

    @property
    def batcher(self) -> DynamicBatcher[P, R]:
        return self._batcher

    @property
    def stats(self) -> BatchStats:
        return self._batcher.stats

    @property
    def queue_depth(self) -> int:
        return self._batcher.queue_depth

    async def start(self) -> None:
        await self._batcher.start()

    async def stop(self, *, drain: bool = True, timeout_s: float | None = None) -> None:
        await self._batcher.stop(drain=drain, timeout_s=timeout_s)

    async def __aenter__(self) -> Engine[P, R]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def submit(self, item: P) -> asyncio.Future[R]:
        """Queue one prepared item (waits for room in the queue); its result's future."""
        if self._padded:
            return await self._batcher.submit(item, estimated_cost=self.model.cost(item))
        return await self._batcher.submit(item)

    def submit_many_nowait(self, items: Sequence[P]) -> list[asyncio.Future[R]]:
        """Queue every item at once or none (``QueueFullError``): a request is all-or-nothing."""
        costs = [self.model.cost(i) for i in items] if self._padded else None
        return self._batcher.submit_many_nowait(list(items), estimated_costs=costs)
