"""The step scheduler plans against a plan-recording executor: no torch, no model.

What is checked is the plan itself (which rows decode, which prompt ranges prefill into which
slot, which cached prefixes are reused, what the cache keeps), the KV manager's rows as
sequences finish and leave, and that a failed step changes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from batchline import ManualClock
from batchline.models.generation import admission
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest, SamplingParams, StepOutput
from batchline.models.generation.fake import FakeTokenizer
from batchline.models.generation.plan import Compaction, Decode, Prefill, PrefixOp, StepPlan
from batchline.models.generation.step_scheduler import Planned, StepScheduler, run_step

TOKEN = 7  # what the fake executor generates, every time


@dataclass
class Recording:
    """An executor that runs nothing: it records each plan and yields one token for every
    decoding row and every prompt that joins, finishing a sequence at its ``max_tokens``."""

    plans: list[StepPlan] = field(default_factory=list)
    released: list[Compaction] = field(default_factory=list)
    requests: dict[str, GenerationRequest] = field(default_factory=dict)
    generated: dict[str, int] = field(default_factory=dict)
    fail_next: bool = False

    def add(self, request: GenerationRequest) -> None:
        self.requests[request.request_id] = request
        self.generated[request.request_id] = 0

    def forget(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def execute(self, plan: StepPlan) -> Sequence[StepOutput]:
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device lost")
        self.plans.append(plan)
        outputs = []
        for rid in [d.request_id for d in plan.decodes] + [p.request_id for p in plan.joining]:
            self.generated[rid] += 1
            done = self.generated[rid] >= self.requests[rid].params.max_tokens
            outputs.append(StepOutput(rid, (TOKEN,), done, "length" if done else None))
            if done:
                del self.requests[rid]
        return outputs

    def release(self, compaction: Compaction) -> None:
        self.released.append(compaction)


def _request(rid: str, prompt: Sequence[int], max_tokens: int = 4) -> GenerationRequest:
    return GenerationRequest(rid, tuple(prompt), SamplingParams(max_tokens=max_tokens))


def _add(scheduler: StepScheduler, executor: Recording, request: GenerationRequest) -> None:
    executor.add(request)
    scheduler.add(request)


def _prompt(base: int, length: int) -> tuple[int, ...]:
    return tuple(3 + (base + i) % 200 for i in range(length))


def test_a_prompt_joins_then_decodes_in_its_slot() -> None:
    scheduler, executor = StepScheduler(), Recording()
    _add(scheduler, executor, _request("a", [5, 6, 7], max_tokens=3))
    plan, outputs = run_step(scheduler, executor)
    assert plan.decodes == ()
    assert plan.prefills == (Prefill("a", 0, 3, 3, 0),)
    assert not plan.decode_only
    assert [o.request_id for o in outputs] == ["a"]
    plan, _ = run_step(scheduler, executor)
    # the latest token is fed at the position after the prompt
    assert plan.decodes == (Decode("a", 0, TOKEN, 3),)
    assert plan.decode_only
    plan, _ = run_step(scheduler, executor)
    assert plan.decodes == (Decode("a", 0, TOKEN, 4),)
    assert scheduler.num_running() == 0
    assert scheduler.kv.rows == []
    assert executor.released == [Compaction((), 0, 0)]  # the last row left: the store is freed


def test_chunked_prefill_plans_decodes_first_and_a_chunk_at_a_time() -> None:
    scheduler, executor = StepScheduler(max_step_tokens=8), Recording()
    _add(scheduler, executor, _request("short", [4, 5], max_tokens=8))
    run_step(scheduler, executor)
    _add(scheduler, executor, _request("long", _prompt(0, 20)))
    chunks = []
    while "long" not in {p.request_id for p in executor.plans[-1].joining}:
        plan, _ = run_step(scheduler, executor)
        assert [d.request_id for d in plan.decodes] == ["short"]  # decodes every step
        assert sum(p.computed for p in plan.prefills) + len(plan.decodes) <= 8
        chunks += [(p.begin, p.end, p.slot, p.staged) for p in plan.prefills]
    # 7 prompt tokens a step beside the one decode; the buffer of its own until the last
    assert chunks == [(0, 7, None, False), (7, 14, None, True), (14, 20, 1, True)]
    assert scheduler.prompt_tokens_computed == 2 + 20
    # each row: its prompt, its generated tokens (short 4, long 1)
    assert scheduler.kv_tokens_in_use() == (2 + 4) + (20 + 1)


def test_a_prompt_between_its_chunks_holds_what_it_has_prefilled() -> None:
    scheduler, executor = StepScheduler(max_step_tokens=8), Recording()
    _add(scheduler, executor, _request("long", _prompt(0, 20)))
    plan, outputs = run_step(scheduler, executor)
    assert (plan.prefills, outputs) == ((Prefill("long", 0, 8, 20, None),), [])
    assert scheduler.kv_tokens_in_use() == 8
    assert scheduler.kv.rows == []


def test_identical_prompts_joining_together_compute_once() -> None:
    scheduler, executor = StepScheduler(), Recording()
    for rid in ("a", "b"):
        _add(scheduler, executor, _request(rid, [9, 9, 9, 9]))
    plan, outputs = run_step(scheduler, executor)
    assert plan.prefills == (Prefill("a", 0, 4, 4, 0), Prefill("b", 0, 4, 4, 1, twin=0))
    assert plan.prompt_tokens == 4
    assert {o.request_id for o in outputs} == {"a", "b"}
    assert (scheduler.prompt_tokens_computed, scheduler.prompts_shared) == (4, 1)


def test_a_burst_over_a_shared_prefix_prefills_it_once_and_reuses_it() -> None:
    scheduler, executor = StepScheduler(prefix_cache_tokens=64), Recording()
    shared = _prompt(50, 20)
    prompts = {f"r{i}": (*shared, *_prompt(100 + 10 * i, 3)) for i in range(3)}
    for rid, prompt in prompts.items():
        _add(scheduler, executor, _request(rid, prompt))
    first, _ = run_step(scheduler, executor)
    # the first goes alone; the cache keeps the prefix the others share with it
    assert [p.request_id for p in first.prefills] == ["r0"]
    assert first.held_back == (prompts["r1"], prompts["r2"])
    assert first.prefix_ops == (PrefixOp("keep", shared, 0),)
    second, _ = run_step(scheduler, executor)
    assert [(p.request_id, p.begin, p.prefix) for p in second.prefills] == [
        ("r1", 20, shared),
        ("r2", 20, shared),
    ]
    assert second.reused == (shared, shared)
    prefixes = scheduler.kv.prefixes
    assert prefixes is not None
    assert (prefixes.hits, prefixes.tokens_reused) == (2, 40)
    assert scheduler.prompt_tokens_computed == 23 + 3 + 3


def test_finished_and_aborted_sequences_free_their_rows() -> None:
    scheduler, executor = StepScheduler(), Recording()
    for rid, n in (("a", 2), ("b", 9), ("c", 9), ("d", 9)):
        _add(scheduler, executor, _request(rid, [5] * (3 + len(rid)), max_tokens=n))
    run_step(scheduler, executor)  # a, b, c, d join slots 0-3
    assert [s.request.request_id for s in scheduler.kv.rows] == ["a", "b", "c", "d"]
    in_use = scheduler.kv_tokens_in_use()
    run_step(scheduler, executor)  # a finishes: d moves into its slot
    assert executor.released[-1] == Compaction(((3, 0),), 3, 5)
    assert [s.request.request_id for s in scheduler.kv.rows] == ["d", "b", "c"]
    assert scheduler.kv_tokens_in_use() == in_use - 5 + 3  # a's 5 freed, 3 rows grew by one
    scheduler.abort("b")
    executor.forget("b")
    plan, _ = run_step(scheduler, executor)  # b's slot is freed before the step is planned
    assert executor.released[-1] == Compaction(((2, 1),), 2, 5)
    assert [(d.request_id, d.slot) for d in plan.decodes] == [("d", 0), ("c", 1)]
    assert scheduler.num_running() == 2


def test_a_failed_step_changes_nothing() -> None:
    scheduler, executor = StepScheduler(prefix_cache_tokens=64), Recording()
    shared = _prompt(0, 20)
    for rid, tail in (("a", 1), ("b", 2)):  # b shares 20 tokens with a: the cache keeps them
        _add(scheduler, executor, _request(rid, (*shared, tail)))
        run_step(scheduler, executor)
    _add(scheduler, executor, _request("c", (*shared, 3)))
    before = (
        scheduler.kv_tokens_in_use(),
        scheduler.prompt_tokens_computed,
        len(scheduler.kv.rows),
    )
    executor.fail_next = True
    with pytest.raises(RuntimeError, match="device lost"):
        run_step(scheduler, executor)
    after = (scheduler.kv_tokens_in_use(), scheduler.prompt_tokens_computed, len(scheduler.kv.rows))
    assert after == before
    prefixes = scheduler.kv.prefixes
    assert prefixes is not None
    assert prefixes.hits == 0
    plan, _ = run_step(scheduler, executor)  # the same plan again, and it counts now
    assert [(p.request_id, p.begin, p.prefix) for p in plan.prefills] == [("c", 20, shared)]
    prefixes = scheduler.kv.prefixes
    assert prefixes is not None
    assert prefixes.hits == 1


# -- the continuous generator over a planned engine ---------------------------------------------


class PlannedFake(Recording):
    """The recording executor with its scheduler, as a step engine (what the torch engine is)."""

    def __init__(self, max_step_tokens: int | None = None) -> None:
        super().__init__()
        self.scheduler = StepScheduler(max_step_tokens=max_step_tokens)
        self.eos_token_ids = frozenset({2})
        self.max_context_tokens = 4096

    def add_request(self, request: GenerationRequest) -> None:
        self.add(request)
        self.scheduler.add(request)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id):
            self.forget(request_id)

    def step(self) -> Sequence[StepOutput]:
        raise AssertionError("a planned engine is stepped through run_step")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_running() > 0

    def num_running(self) -> int:
        return self.scheduler.num_running()

    def kv_tokens_in_use(self) -> int:
        return self.scheduler.kv_tokens_in_use()


TOK = FakeTokenizer()


@pytest.mark.anyio
async def test_admission_keeps_the_plans_within_the_kv_budget() -> None:
    engine = PlannedFake()
    assert isinstance(engine, Planned)
    # each request reserves 10 + 6 = 16 positions: two at a time fit in 40
    async with ContinuousGenerator(engine, TOK, max_running=8, kv_token_budget=40) as gen:
        streams = [gen.submit(_prompt(i, 10), SamplingParams(max_tokens=6)) for i in range(5)]
        for stream in streams:
            assert (await stream.result()).finish_reason == "length"
    rows = [len(p.decodes) + len(p.joining) for p in engine.plans]
    assert max(rows) == 2
    joined = [p.request_id for plan in engine.plans for p in plan.joining]
    assert len(joined) == 5


@pytest.mark.anyio
async def test_the_row_cost_counts_only_the_steps_its_plan_says_only_decoded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = PlannedFake(max_step_tokens=4)
    observed: list[StepPlan] = []
    real_observe = admission.RowCost.observe

    def spy(self: admission.RowCost, rows: int, seconds: float) -> None:
        observed.append(engine.plans[-1])  # the plan of the step just run
        real_observe(self, rows, seconds)

    monkeypatch.setattr(admission.RowCost, "observe", spy)
    clock = ManualClock()
    async with ContinuousGenerator(engine, TOK, max_running=4, start_running=1, clock=clock) as gen:
        short = gen.submit(_prompt(0, 2), SamplingParams(max_tokens=12))
        await short.result()
        # a long prompt arrives alone: it joins in one step and is chunked over the next ones
        long = gen.submit(_prompt(1, 13), SamplingParams(max_tokens=3))
        await long.result()
    chunk_steps = [p for p in engine.plans if p.prefills and not p.joining]
    assert chunk_steps  # steps that computed prompt chunks, with no request admitted
    assert observed
    assert all(p.decode_only for p in observed)
    assert not any(p is q for p in observed for q in chunk_steps)
