"""``TokenBatcher``: the batcher in token units, padding-aware by default.

A model that pads a batch to its longest member computes ``len(batch) * max(tokens)``
tokens, whatever the real lengths. So by default a ``TokenBatcher`` counts that padded
cost against ``target_batch_tokens`` and groups records of similar length (see
``batchline._queue``). Pass ``padding_aware=False`` for Flyte's plain sum of tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from batchline._batcher import DynamicBatcher, ProcessFn
from batchline._clock import Clock
from batchline._device import Device
from batchline._policy import UNSET, BatchPolicy, Unset

__all__ = ["Prompt", "TokenBatcher"]

T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True)
class Prompt:
    """A text record with a rough token estimate (about four characters per token)."""

    text: str

    def estimate_tokens(self) -> int:
        return len(self.text) // 4 + 1


class TokenBatcher(DynamicBatcher[T, R]):
    """A ``DynamicBatcher`` whose budget is in tokens; drop-in for Flyte's ``TokenBatcher``.

    The batch function is ``inference_fn``, or ``process_fn`` (Flyte's other name for it;
    as in Flyte, ``inference_fn`` wins when both are given). Settings come as for
    ``DynamicBatcher`` (``policy=BatchPolicy(...)`` and/or keywords); ``target_batch_tokens``
    and ``default_token_estimate`` are the token spellings of the policy's
    ``target_batch_cost`` and ``default_cost``, and ``padding_aware`` is on unless the policy
    or a keyword says otherwise.

    Token count precedence: ``estimated_tokens`` > ``token_estimator(record)`` >
    ``record.estimate_tokens()`` > ``record.estimate_cost()`` > ``default_token_estimate``.

    >>> async def infer(batch: list[Prompt]) -> list[int]:
    ...     return [len(p.text) for p in batch]
    >>> batcher = TokenBatcher(infer, target_batch_tokens=512, max_concurrent_batches=2)
    """

    _use_tokens = True
    _padding_aware_default = True

    def __init__(
        self,
        inference_fn: ProcessFn[T, R] | None = None,
        *,
        process_fn: ProcessFn[T, R] | None = None,
        policy: BatchPolicy | None = None,
        token_estimator: Callable[[T], int] | None = None,
        cost_estimator: Callable[[T], int] | None = None,
        target_batch_tokens: int | None = None,
        target_batch_cost: int | Unset = UNSET,
        default_token_estimate: int | None = None,
        default_cost: int | Unset = UNSET,
        max_batch_size: int | Unset = UNSET,
        min_batch_size: int | Unset = UNSET,
        batch_timeout_s: float | Unset = UNSET,
        max_queue_size: int | Unset = UNSET,
        prefetch_batches: int | Unset = UNSET,
        max_concurrent_batches: int | Unset = UNSET,
        oversize: Literal["alone", "reject"] | Unset = UNSET,
        on_error: Literal["bisect", "fail_batch"] | Unset = UNSET,
        process_timeout_s: float | Unset | None = UNSET,
        padding_aware: bool | Unset | None = UNSET,
        bucket_width: int | Unset = UNSET,
        padding_slack: int | Unset = UNSET,
        device: Device | None = None,
        weight: float = 1.0,
        priority_aging_s: float | Unset | None = UNSET,
        mix_priorities: bool | Unset = UNSET,
        priority_yield: float | Unset = UNSET,
        bulk_slots: int | Unset | None = UNSET,
        bulk_thread_nice: int | Unset = UNSET,
        bulk_batch_cost: int | Unset | None = UNSET,
        clock: Clock | None = None,
        name: str = "token-batcher",
    ) -> None:
        # as Flyte's TokenBatcher: inference_fn when given, else process_fn
        fn = inference_fn if inference_fn is not None else process_fn
        if fn is None:
            raise TypeError(
                "TokenBatcher requires either inference_fn or process_fn: the function that "
                "takes a batch of records and returns one result per record"
            )
        super().__init__(
            fn,
            policy=policy,
            cost_estimator=token_estimator if token_estimator is not None else cost_estimator,
            # the token names are Flyte's spelling of the policy's cost fields, and win
            target_batch_cost=(
                target_batch_tokens if target_batch_tokens is not None else target_batch_cost
            ),
            default_cost=(
                default_token_estimate if default_token_estimate is not None else default_cost
            ),
            max_batch_size=max_batch_size,
            min_batch_size=min_batch_size,
            batch_timeout_s=batch_timeout_s,
            max_queue_size=max_queue_size,
            prefetch_batches=prefetch_batches,
            max_concurrent_batches=max_concurrent_batches,
            oversize=oversize,
            on_error=on_error,
            process_timeout_s=process_timeout_s,
            padding_aware=padding_aware,
            bucket_width=bucket_width,
            padding_slack=padding_slack,
            device=device,
            weight=weight,
            priority_aging_s=priority_aging_s,
            mix_priorities=mix_priorities,
            priority_yield=priority_yield,
            bulk_slots=bulk_slots,
            bulk_thread_nice=bulk_thread_nice,
            bulk_batch_cost=bulk_batch_cost,
            clock=clock,
            name=name,
        )

    @property
    def target_batch_tokens(self) -> int:
        return self.target_batch_cost

    async def submit(
        self,
        record: T,
        *,
        estimated_tokens: int | None = None,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> asyncio.Future[R]:
        """Queue ``record``; return a future of its result (see ``DynamicBatcher.submit``)."""
        cost = estimated_tokens if estimated_tokens is not None else estimated_cost
        return await super().submit(
            record, estimated_cost=cost, priority=priority, timeout_s=timeout_s
        )

    def submit_nowait(
        self,
        record: T,
        *,
        estimated_tokens: int | None = None,
        estimated_cost: int | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> asyncio.Future[R]:
        """Like ``submit`` but raises ``QueueFullError`` instead of waiting."""
        cost = estimated_tokens if estimated_tokens is not None else estimated_cost
        return super().submit_nowait(
            record, estimated_cost=cost, priority=priority, timeout_s=timeout_s
        )

    def submit_many_nowait(
        self,
        records: Sequence[T],
        *,
        estimated_tokens: Sequence[int | None] | None = None,
        estimated_costs: Sequence[int | None] | None = None,
        priority: int = 0,
        timeout_s: float | None = None,
    ) -> list[asyncio.Future[R]]:
        """Queue every record or none (see ``DynamicBatcher.submit_many_nowait``)."""
        costs = estimated_tokens if estimated_tokens is not None else estimated_costs
        return super().submit_many_nowait(
            records, estimated_costs=costs, priority=priority, timeout_s=timeout_s
        )
