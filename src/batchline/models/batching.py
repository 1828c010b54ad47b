"""``ModelBatcher``: any model behind batching, or behind the single-shared-session baseline.

``run``, ``serve``, ``bench``, ``tune`` and the Ray replicas build their batcher here, from one
:class:`~batchline.knobs.Knobs`, so what ``tune`` measures is what ``serve`` runs: the knobs'
:meth:`~batchline.knobs.Knobs.policy` goes to the batcher whole (a ``BatchPolicy``).

- batching: a ``TokenBatcher`` (``padded`` models: a batch costs ``len(batch) × longest``,
  length-grouped) or a ``DynamicBatcher`` (``additive``), ``target_batch_tokens`` budget (an
  image model's pictures count ``PICTURE_TOKENS`` each toward it: batches of 8 by default),
  ``max_concurrent_batches`` slots, optionally on a shared :class:`batchline.Device`;
- baseline (``batching=False``): a batcher of one record per call, with as many callers at
  once as ``max_concurrent_batches`` on the model's one shared session.

``thread_nice`` (default 0) lowers the priority of the worker threads that run a sync
model's batches by that much (Linux), so that an event loop in the same process (a server)
keeps its CPU; ``name`` labels the batcher.

Example::

    model = load_model(parse_spec("default"), knobs)
    async with ModelBatcher(model, knobs) as batcher:
        items = model.prepare(["hello", "world"])
        vectors = await asyncio.gather(*[await batcher.submit(i) for i in items])
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from batchline._batcher import DynamicBatcher, ProcessFn
from batchline._device import Device
from batchline._policy import BatchPolicy
from batchline._stats import BatchStats
from batchline._threads import lower_thread_priority
from batchline._tokens import TokenBatcher
from batchline.knobs import DEFAULT_BUCKET_WIDTH, DEFAULT_PADDING_SLACK, Knobs
from batchline.models.protocol import BatchModel, ModelInfo

__all__ = ["ModelBatcher", "lower_thread_priority"]

P = TypeVar("P")
R = TypeVar("R")


class ModelBatcher(Generic[P, R]):
    """A model and the batcher that feeds it; see the module docstring."""

    def __init__(
        self,
        model: BatchModel[P, R],
        knobs: Knobs,
        *,
        device: Device | None = None,
        weight: float = 1.0,
        padding_slack: int = DEFAULT_PADDING_SLACK,
        bucket_width: int = DEFAULT_BUCKET_WIDTH,
        name: str | None = None,
        thread_nice: int = 0,
    ) -> None:
        if isinstance(thread_nice, bool) or not isinstance(thread_nice, int) or thread_nice < 0:
            raise ValueError(f"thread_nice must be an int >= 0, got {thread_nice!r}")
        self.model = model
        self.knobs = knobs
        label = name or model.info.name
        attach: dict[str, Any] = {} if device is None else {"device": device, "weight": weight}
        self._padded = knobs.batching and model.info.cost_kind == "padded"
        run: ProcessFn[P, R] = model.run_batch
        if thread_nice and not inspect.iscoroutinefunction(run):
            run = _niced(run, thread_nice)
        self._batcher: DynamicBatcher[P, R]
        if not knobs.batching:
            # the baseline: one record per call, on as many slots as the knobs say
            baseline = BatchPolicy(
                max_batch_size=1,
                max_concurrent_batches=knobs.max_concurrent_batches,
                max_queue_size=knobs.max_queue_size,
            )
            self._batcher = DynamicBatcher(
                run, policy=baseline, name=f"{label}-no-batching", **attach
            )
            return
        bulk = knobs.bulk_batch_tokens
        policy = knobs.policy(
            bulk_batch_cost=None if bulk is None else _batch_cost(model.info, bulk),
            padding_slack=padding_slack,
            bucket_width=bucket_width,
        )
        if self._padded:
            self._batcher = TokenBatcher(run, policy=policy, name=label, **attach)
        else:
            self._batcher = DynamicBatcher(
                run,
                policy=policy.replace(
                    target_batch_cost=_batch_cost(model.info, knobs.target_batch_tokens)
                ),
                cost_estimator=model.cost,
                name=label,
                **attach,
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

    async def __aenter__(self) -> ModelBatcher[P, R]:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    async def submit(self, item: P) -> asyncio.Future[R]:
        """Queue one prepared item (waits for room in the queue); its result's future."""
        if self._padded:
            return await self._batcher.submit(item, estimated_cost=self.model.cost(item))
        return await self._batcher.submit(item)

    def submit_many_nowait(
        self, items: Sequence[P], *, priority: int = 0
    ) -> list[asyncio.Future[R]]:
        """Queue every item at once or none (``QueueFullError``): a request is all-or-nothing.
        ``priority``: the batcher's (higher first, aged; see ``batchline._queue``)."""
        costs = [self.model.cost(i) for i in items] if self._padded else None
        return self._batcher.submit_many_nowait(
            list(items), estimated_costs=costs, priority=priority
        )


def _niced(run: Callable[[list[P]], R], delta: int) -> Callable[[list[P]], R]:
    """``run``, lowering the priority of each worker thread that calls it, once per thread (a
    batcher's bulk worker thread, lowered further when it started, keeps its own).

    The model's threads then yield the CPU to the event loop, which parses requests and forms
    the next batch, instead of starving it while they compute (``batchline serve``: x1.34 the
    baseline's req/s with p99 x0.83 at +5, against x1.19 with p99 x1.40 at 0)."""

    def niced_run(batch: list[P]) -> R:
        lower_thread_priority(delta)
        return run(batch)

    return niced_run


def _batch_cost(info: ModelInfo, tokens: int) -> int:
    """The cost a batch closes at for a budget of ``tokens`` (``target_batch_tokens``, or the
    bulk lane's ``bulk_batch_tokens``): the tokens, read for an image model as pictures of
    :data:`~batchline.models.image.PICTURE_TOKENS` tokens each."""
    if info.input_kind != "image":
        return tokens
    from batchline.models.image import PICTURE_TOKENS

    return max(1, tokens // PICTURE_TOKENS)
