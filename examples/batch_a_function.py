"""Batch calls to any function: many producers, one batched process_fn, results per caller."""

from __future__ import annotations

import asyncio

from batchline import DynamicBatcher


def score(batch: list[str]) -> list[int]:
    # a sync function runs in a worker thread: the event loop never blocks
    return [len(text.split()) for text in batch]


async def main() -> list[int]:
    async with DynamicBatcher(score, target_batch_cost=64, max_batch_size=16) as batcher:
        texts = [f"text number {i} " * (i % 5 + 1) for i in range(100)]
        results = await asyncio.gather(*(batcher.run(t) for t in texts))
        stats = batcher.stats
        print(f"{stats.total_completed} records in {stats.total_batches} batches")
        return list(results)


if __name__ == "__main__":
    asyncio.run(main())
