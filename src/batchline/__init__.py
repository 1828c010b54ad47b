"""batchline: dynamic batching for ML inference.

Keep the device busy, never make a request wait when the device is free, lose nothing.

>>> import asyncio
>>> from batchline import DynamicBatcher
>>> async def double(batch: list[int]) -> list[int]:
...     return [2 * x for x in batch]
>>> async def main() -> list[int]:
...     async with DynamicBatcher(double, max_batch_size=64) as batcher:
...         return list(await asyncio.gather(*(batcher.run(i) for i in range(5))))
>>> asyncio.run(main())
[0, 2, 4, 6, 8]

``import batchline`` loads only the standard library; models, the job runner, the server,
the driver, benchmarks and Ray live in subpackages behind extras.
"""

from __future__ import annotations

from batchline._batcher import DynamicBatcher, ProcessFn, State
from batchline._clock import Clock, LoopClock, ManualClock
from batchline._cost import CostEstimator, TokenEstimator
from batchline._device import Device
from batchline._errors import (
    BatcherClosedError,
    BatchlineError,
    BatchProcessingError,
    BatchSizeMismatchError,
    BatchTimeoutError,
    DeadlineExceededError,
    DiskError,
    EngineGoneError,
    FixedBatchAxisError,
    InputError,
    ModelError,
    QueueFullError,
    RecordTooLargeError,
)
from batchline._policy import BatchPolicy
from batchline._stats import BatchStats
from batchline._tokens import Prompt, TokenBatcher
from batchline.sync import SyncBatcher

__version__ = "0.1.0"

__all__ = [
    "BatchPolicy",
    "BatchProcessingError",
    "BatchSizeMismatchError",
    "BatchStats",
    "BatchTimeoutError",
    "BatcherClosedError",
    "BatchlineError",
    "Clock",
    "CostEstimator",
    "DeadlineExceededError",
    "Device",
    "DiskError",
    "DynamicBatcher",
    "EngineGoneError",
    "FixedBatchAxisError",
    "InputError",
    "LoopClock",
    "ManualClock",
    "ModelError",
    "ProcessFn",
    "Prompt",
    "QueueFullError",
    "RecordTooLargeError",
    "State",
    "SyncBatcher",
    "TokenBatcher",
    "TokenEstimator",
    "__version__",
]
