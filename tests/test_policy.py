"""``BatchPolicy``: the batcher's settings in one frozen object, passed whole or built from
Flyte's keywords, validated once, and what ``models/`` hands the batcher from the knobs."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import pytest

from batchline import BatchPolicy, DynamicBatcher, InputError, TokenBatcher
from batchline._policy import POLICY_FIELDS, UNSET
from batchline.knobs import Knobs


async def echo(batch: list[Any]) -> list[Any]:
    return list(batch)


def test_a_policy_is_frozen_and_replace_validates_again() -> None:
    policy = BatchPolicy(max_batch_size=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.max_batch_size = 9  # type: ignore[misc]
    assert policy.replace(max_batch_size=4).max_batch_size == 4
    with pytest.raises(ValueError, match="max_batch_size must be >= 1, got 0"):
        policy.replace(max_batch_size=0)
    assert policy.queue_capacity == 5_000 + 3 * 8


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"max_batch_size": 0}, "max_batch_size must be >= 1, got 0"),
        ({"target_batch_cost": True}, "target_batch_cost must be a number, got True"),
        ({"max_queue_size": "many"}, "max_queue_size must be a number, got 'many'"),
        ({"min_batch_size": 9, "max_batch_size": 8}, r"min_batch_size \(9\) must be <= max"),
        ({"batch_timeout_s": -1}, "batch_timeout_s must be >= 0, got -1"),
        ({"prefetch_batches": -1}, "prefetch_batches must be >= 0"),
        ({"default_cost": -1}, "default_cost must be >= 0"),
        ({"max_concurrent_batches": 0}, "max_concurrent_batches must be >= 1"),
        ({"oversize": "split"}, "oversize must be 'alone' or 'reject', got 'split'"),
        ({"on_error": "ignore"}, "on_error must be 'bisect' or 'fail_batch'"),
        ({"process_timeout_s": -0.5}, "process_timeout_s must be >= 0"),
        ({"priority_aging_s": 0}, "priority_aging_s must be > 0 or None, got 0"),
        ({"priority_yield": 1.5}, r"priority_yield must be in \(0, 1\], got 1.5"),
        ({"bulk_slots": 1.5}, "bulk_slots must be an integer >= 1 or None, got 1.5"),
        ({"bulk_batch_cost": 0}, "bulk_batch_cost must be >= 1"),
        ({"bulk_thread_nice": 20}, r"bulk_thread_nice must be an integer in \[0, 19\], got 20"),
        ({"mix_priorities": "yes"}, "mix_priorities must be true or false, got 'yes'"),
        ({"padding_aware": 1}, "padding_aware must be true or false, got 1"),
    ],
)
def test_each_bad_setting_is_one_clear_error_from_the_policy_and_the_batchers(
    changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        BatchPolicy(**changes)
    # the batchers' keywords build a policy, so they say the same
    with pytest.raises(ValueError, match=message):
        DynamicBatcher(echo, **changes)
    with pytest.raises(ValueError, match=message):
        TokenBatcher(echo, **changes)


def test_a_policy_is_passed_whole_and_keywords_given_win_over_it() -> None:
    policy = BatchPolicy(max_batch_size=8, max_concurrent_batches=3, target_batch_cost=100)
    b = DynamicBatcher(echo, policy=policy)
    assert b.policy == policy.replace(padding_aware=False)
    assert (b.max_batch_size, b.max_concurrent_batches, b.target_batch_cost) == (8, 3, 100)
    b = DynamicBatcher(echo, policy=policy, max_batch_size=2)
    assert (b.max_batch_size, b.max_concurrent_batches) == (2, 3)
    with pytest.raises(TypeError, match=r"policy must be a batchline\.BatchPolicy, got dict"):
        DynamicBatcher(echo, policy={"max_batch_size": 2})  # type: ignore[arg-type]


def test_padding_aware_none_is_each_batcher_s_own_default() -> None:
    assert DynamicBatcher(echo).policy.padding_aware is False
    assert TokenBatcher(echo).policy.padding_aware is True
    off = BatchPolicy(padding_aware=False)
    assert TokenBatcher(echo, policy=off).policy.padding_aware is False
    assert DynamicBatcher(echo, padding_aware=True).policy.padding_aware is True


def test_the_token_spellings_are_the_policy_s_cost_fields() -> None:
    policy = BatchPolicy(target_batch_cost=100, default_cost=2)
    tb = TokenBatcher(echo, policy=policy, target_batch_tokens=512, default_token_estimate=5)
    assert (tb.target_batch_tokens, tb.policy.default_cost) == (512, 5)
    tb = TokenBatcher(echo, policy=policy)
    assert (tb.target_batch_tokens, tb.policy.default_cost) == (100, 2)


def test_flyte_s_keywords_all_remain_and_every_policy_field_is_a_keyword() -> None:
    """Flyte's drop-in signature (docs/CONTRACTS.md) keeps every keyword; each policy field is
    one too, its default the policy's (written once: the signature says UNSET)."""
    flyte_dynamic = {
        "process_fn", "cost_estimator", "target_batch_cost", "max_batch_size",
        "min_batch_size", "batch_timeout_s", "max_queue_size", "prefetch_batches",
        "default_cost",
    }  # fmt: skip
    flyte_token = {
        "inference_fn", "process_fn", "token_estimator", "target_batch_tokens",
        "default_token_estimate", "max_batch_size", "min_batch_size", "batch_timeout_s",
        "max_queue_size", "prefetch_batches",
    }  # fmt: skip
    dynamic = inspect.signature(DynamicBatcher).parameters
    token = inspect.signature(TokenBatcher).parameters
    assert flyte_dynamic <= set(dynamic)
    assert flyte_token <= set(token)
    for params in (dynamic, token):
        assert set(POLICY_FIELDS) <= set(params)
        for name in POLICY_FIELDS:
            assert params[name].default is UNSET, name
    b = TokenBatcher(
        inference_fn=echo,
        token_estimator=len,
        target_batch_tokens=64,
        default_token_estimate=3,
        max_batch_size=4,
        min_batch_size=2,
        batch_timeout_s=0.2,
        max_queue_size=10,
        prefetch_batches=1,
    )
    assert b.policy == BatchPolicy(
        target_batch_cost=64,
        default_cost=3,
        max_batch_size=4,
        min_batch_size=2,
        batch_timeout_s=0.2,
        max_queue_size=10,
        prefetch_batches=1,
        padding_aware=True,
    )
    assert b.queue_capacity == 10 + 2 * 4


def test_knobs_defaults_for_the_batcher_are_the_policy_s() -> None:
    """The knobs a batcher reads by the policy's names take the policy's defaults (the
    dataset-measured budget and the slots per core are the knobs' own)."""
    knobs, policy = Knobs(), BatchPolicy()
    for name in ("max_batch_size", "min_batch_size", "batch_timeout_s", "max_queue_size"):
        assert getattr(knobs, name) == getattr(policy, name), name
    for name in ("mix_priorities", "priority_yield", "bulk_slots", "bulk_thread_nice"):
        assert getattr(knobs, name) == getattr(policy, name), name


def test_knobs_give_the_batcher_their_policy() -> None:
    knobs = Knobs(
        target_batch_tokens=300,
        max_batch_size=16,
        min_batch_size=64,
        max_concurrent_batches=3,
        max_queue_size=99,
        mix_priorities=True,
        priority_yield=1.0,
        bulk_slots=2,
        bulk_thread_nice=19,
        bulk_batch_tokens=900,
    )
    policy = knobs.policy(padding_slack=4)
    assert policy == BatchPolicy(
        target_batch_cost=300,
        max_batch_size=16,
        min_batch_size=16,  # capped at max_batch_size
        max_concurrent_batches=3,
        max_queue_size=99,
        mix_priorities=True,
        priority_yield=1.0,
        bulk_slots=2,
        bulk_thread_nice=19,
        bulk_batch_cost=900,
        padding_slack=4,
    )


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"priority_yield": 0}, r"priority_yield must be in \(0, 1\], got 0"),
        ({"max_batch_size": "lots"}, "max_batch_size must be a number, got 'lots'"),
        ({"batch_timeout_s": -1}, "batch_timeout_s must be >= 0, got -1"),
        ({"bulk_thread_nice": 20}, r"bulk_thread_nice must be an integer in \[0, 19\]"),
        ({"mix_priorities": 1}, "mix_priorities must be true or false, got 1"),
    ],
)
def test_knobs_refuse_a_bad_batcher_knob_with_the_policy_s_error_in_one_line(
    changes: dict[str, Any], message: str
) -> None:
    """The knobs a batcher reads under the same names are checked where their rules live,
    the policy, and said as the CLI's one-line InputError."""
    with pytest.raises(InputError, match=message):
        Knobs(**changes)


def test_knobs_may_hold_more_than_a_batch_s_size_for_company_the_policy_caps_it() -> None:
    knobs = Knobs(min_batch_size=64, max_batch_size=16)
    assert knobs.policy().min_batch_size == 16
