"""OpenAI's sampling parameters on the generation routes: presence and frequency penalties and
logit bias reach the engine (the torch engine's arithmetic is tested against a reference in
tests/models/generation/test_sampling.py), out of OpenAI's ranges they are a 400, and a
sampling field no engine applies is a 400 rather than silently dropped."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest, SamplingParams
from batchline.models.generation.fake import FakeEngine

from .test_generation_routes import TOK, FakeServed, client_for, make_app

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


class ParamsEngine(FakeEngine):
    """Keeps each request's sampling parameters, then runs it as the fake engine does."""

    def __init__(self) -> None:
        super().__init__()
        self.params: list[SamplingParams] = []

    def add_request(self, request: GenerationRequest) -> None:
        self.params.append(request.params)
        super().add_request(request)


def recording() -> tuple[FakeServed, ParamsEngine]:
    engine = ParamsEngine()
    return FakeServed("fake", ContinuousGenerator(engine, TOK, name="fake"), engine), engine


async def test_penalties_and_bias_reach_the_engine_on_every_route() -> None:
    model, engine = recording()
    app, _ = make_app(model)
    asked = {"presence_penalty": 0.5, "frequency_penalty": -1, "logit_bias": {"9": 3, "4": -100}}
    async with client_for(app) as client:
        for route, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
            ("/generate", {"prompts": ["hi"], "max_tokens": 2}),
        ):
            r = await client.post(route, json={**body, **asked})
            assert r.status_code == 200, r.text
        r = await client.post("/v1/chat/completions", json=CHAT)
        assert r.status_code == 200, r.text
    for params in engine.params[:3]:
        assert (params.presence_penalty, params.frequency_penalty) == (0.5, -1)
        assert params.logit_bias == ((4, -100), (9, 3))
    plain = engine.params[3]
    assert (plain.presence_penalty, plain.frequency_penalty, plain.logit_bias) == (0, 0, ())


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be a number in [-2, 2], got 2.5"),
        ({"frequency_penalty": -3}, "frequency_penalty must be a number in [-2, 2], got -3"),
        ({"logit_bias": {"5": 150}}, "logit_bias values must be numbers in [-100, 100]"),
        ({"logit_bias": {"word": 1}}, "logit_bias keys must be token ids"),
        ({"top_k": 5}, "'top_k' is not applied by batchline's engines; omit it"),
        ({"repetition_penalty": 1.2}, "'repetition_penalty' is not applied"),
        ({"min_p": 0.1}, "'min_p' is not applied"),
        ({"prompt_logprobs": 3}, "'prompt_logprobs' is not applied"),
        ({"use_beam_search": True}, "'use_beam_search' is not applied"),
    ],
)
async def test_out_of_range_or_unapplied_parameters_are_400(
    extra: dict[str, Any], message: str
) -> None:
    model, engine = recording()
    app, _ = make_app(model)
    async with client_for(app) as client:
        for route, body in (
            ("/v1/chat/completions", CHAT),
            ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ):
            r = await client.post(route, json={**body, **extra})
            assert r.status_code == 400, r.text
            assert message in r.json()["error"]["message"]
    assert engine.added == []


async def test_neutral_values_of_unapplied_fields_and_unknown_fields_are_accepted() -> None:
    model, engine = recording()
    app, _ = make_app(model)
    neutral = {"top_k": -1, "repetition_penalty": 1.0, "min_p": 0, "tool_choice": "none"}
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, **neutral, "store": False})
    assert r.status_code == 200, r.text
    assert len(engine.added) == 1


class VocabEngine(ParamsEngine):
    """Says its vocabulary, as the torch engine does."""

    vocab_size = 1_000


async def test_a_token_outside_the_vocabulary_is_400_before_any_byte_is_streamed() -> None:
    """A ``logit_bias`` key beyond the engine's vocabulary is the client's fault, told before
    admission: a streamed answer had begun with a 200 and ended in an error
    event, as the engine refused it only when its step took it in."""
    engine = VocabEngine()
    model = FakeServed("fake", ContinuousGenerator(engine, TOK, name="fake"), engine)
    app, _ = make_app(model)
    bias = {"logit_bias": {"99999": 1}}
    async with client_for(app) as client:
        for stream in (False, True):
            r = await client.post("/v1/chat/completions", json={**CHAT, **bias, "stream": stream})
            assert r.status_code == 400, r.text
            message = r.json()["error"]["message"]
            assert "logit_bias names token 99999, outside the model's vocabulary of 1000" in message
        r = await client.post("/v1/completions", json={"prompt": "hi", "stream": True, **bias})
        assert r.status_code == 400, r.text
        assert engine.params == []  # nothing reached the engine
        ok = await client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {"999": 1}})
    assert ok.status_code == 200
    assert engine.params[0].logit_bias == ((999, 1.0),)


def test_the_vllm_backend_gets_them_in_its_sampling_params(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked where the parameters are built, with a stand-in for vLLM's modules (the
    vllm-marked tests run the real one)."""
    import sys
    from types import ModuleType, SimpleNamespace

    from batchline.models.generation.vllm_generator import to_vllm_sampling_params

    vllm = ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: SimpleNamespace(**kw)  # type: ignore[attr-defined]
    options = ModuleType("vllm.sampling_params")
    options.RequestOutputKind = SimpleNamespace(DELTA="delta", CUMULATIVE="cumulative")  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", options)
    params = SamplingParams(presence_penalty=1.5, frequency_penalty=-0.5, logit_bias=((7, 2.0),))
    built: Any = to_vllm_sampling_params(params)
    assert (built.presence_penalty, built.frequency_penalty) == (1.5, -0.5)
    assert built.logit_bias == {7: 2.0}
    plain: Any = to_vllm_sampling_params(dataclasses.replace(params, logit_bias=()))
    assert plain.logit_bias is None
