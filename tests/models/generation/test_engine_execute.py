"""The torch engine executes hand-written plans (no scheduler): the greedy tokens equal
transformers' own decoding of each prompt alone, as the engine's scheduled steps do."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.plan import Decode, Prefill, StepPlan
from batchline.models.generation.torch_engine import TorchStepEngine

from .gen_helpers import greedy_reference
from .test_engine_torch import MAX_NEW, _prompt


def _decode_all(
    engine: TorchStepEngine, got: dict[str, list[int]], prompts: dict[str, int]
) -> None:
    """Hand-written decode plans, one row per sequence in ``got``'s order, to MAX_NEW tokens."""
    while any(len(tokens) < MAX_NEW for tokens in got.values()):
        plan = StepPlan(
            tuple(
                Decode(rid, slot, tokens[-1], prompts[rid] + len(tokens) - 1)
                for slot, (rid, tokens) in enumerate(got.items())
            ),
            (),
        )
        assert plan.decode_only
        for out in engine.execute(plan):
            got[out.request_id] += out.token_ids


def _add(engine: TorchStepEngine, rid: str, prompt: tuple[int, ...]) -> None:
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True)
    engine.add(GenerationRequest(rid, prompt, params))


def test_a_hand_written_plan_gives_the_greedy_tokens(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    prompts = {"a": _prompt(1, 5), "b": _prompt(2, 9)}
    for rid, prompt in prompts.items():
        _add(engine, rid, prompt)
    join = StepPlan((), (Prefill("a", 0, 5, 5, 0), Prefill("b", 0, 9, 9, 1)))
    got = {out.request_id: list(out.token_ids) for out in engine.execute(join)}
    assert list(got) == ["a", "b"]
    _decode_all(engine, got, {rid: len(p) for rid, p in prompts.items()})
    for rid, prompt in prompts.items():
        assert got[rid] == greedy_reference(tiny_llama, prompt, MAX_NEW)


def test_a_hand_written_chunked_prefill_gives_the_greedy_tokens(tiny_llama: Any) -> None:
    engine = TorchStepEngine(tiny_llama, prefix_cache_tokens=0)
    prompt = _prompt(3, 12)
    _add(engine, "long", prompt)
    # its first chunk goes to a buffer of its own and yields no token
    assert engine.execute(StepPlan((), (Prefill("long", 0, 5, 12, None),))) == []
    last = StepPlan((), (Prefill("long", 5, 12, 12, 0, staged=True),))
    got = {out.request_id: list(out.token_ids) for out in engine.execute(last)}
    _decode_all(engine, got, {"long": len(prompt)})
    assert got["long"] == greedy_reference(tiny_llama, prompt, MAX_NEW)
