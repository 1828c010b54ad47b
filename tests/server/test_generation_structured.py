"""Structured outputs on the OpenAI routes: the constraint a body asks for reaches the engine
with the request, and a bad one is a 400 that says what is wrong."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")
pytest.importorskip("prometheus_client")

from prometheus_client import CollectorRegistry

from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import GenerationRequest, StepOutput
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.structured import Constraint

from .test_generation_routes import TOK, FakeServed, client_for, make_app, served, sse

pytestmark = pytest.mark.anyio

SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}}}


class RecordingEngine(FakeEngine):
    """Keeps each request's constraint, then runs it unconstrained (the fake engine has no
    grammar; the torch engine's masking is tested in tests/models/generation)."""

    def __init__(self) -> None:
        super().__init__()
        self.constraints: list[Constraint | None] = []

    def add_request(self, request: GenerationRequest) -> None:
        self.constraints.append(request.params.constraint)
        params = dataclasses.replace(request.params, constraint=None)
        super().add_request(dataclasses.replace(request, params=params))


async def test_the_constraint_reaches_the_engine_on_both_routes() -> None:
    engine = RecordingEngine()
    model = FakeServed("fake", ContinuousGenerator(engine, TOK, name="fake"), engine)
    app, _ = make_app(model)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    async with client_for(app) as client:
        for body in (
            {**chat, "response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}},
            {**chat, "response_format": {"type": "json_object"}},
            {**chat, "guided_choice": ["a", "b"]},
            {**chat, "response_format": {"type": "text"}},
        ):
            r = await client.post("/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
        r = await client.post(
            "/v1/completions",
            json={"prompt": ["x", "y"], "max_tokens": 2, "guided_regex": "[0-9]+"},
        )
        assert r.status_code == 200, r.text
    assert engine.constraints == [
        Constraint.json_schema(SCHEMA),
        Constraint.json_object(),
        Constraint.choice(["a", "b"]),
        None,
        Constraint.regex("[0-9]+"),
        Constraint.regex("[0-9]+"),
    ]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 1}}}},
            "invalid json schema constraint",
        ),
        ({"guided_regex": "(a"}, "invalid regex constraint"),
        ({"guided_choice": []}, "non-empty list"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "not several"),
    ],
)
async def test_a_bad_constraint_is_400_with_the_reason(
    extra: dict[str, object], message: str
) -> None:
    model = served()
    app, _ = make_app(model)
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert model.engine.added == []


# -- what the grammar engine cannot enforce: refused at submit, or an error, never "stop" ----

CYCLIC = {"$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"guided_choice": [f"choice{i}" for i in range(10_000)]}, "at most 1,000 options"),
        ({"guided_regex": "a{1000000}"}, "cannot enforce this regex constraint"),
        ({"guided_json": CYCLIC}, "can produce no output at all"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": CYCLIC}}},
            "can produce no output at all",
        ),
    ],
)
@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions", "/generate"])
async def test_a_constraint_the_engine_cannot_enforce_is_400_at_submit(
    route: str, extra: dict[str, object], message: str, caplog: pytest.LogCaptureFixture
) -> None:
    model = served()
    app, _ = make_app(model)
    prompt: dict[str, object] = {
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}]},
        "/v1/completions": {"prompt": "hi"},
        "/generate": {"prompts": ["hi"]},
    }[route]
    caplog.set_level(logging.WARNING, logger="batchline.server")
    async with client_for(app) as client:
        r = await client.post(
            route, json={**prompt, "max_tokens": 4, **extra}, headers={"X-Request-Id": "req-7"}
        )
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert model.engine.added == []
    # one line: the request and the reason, not the grammar
    (line,) = [r.getMessage() for r in caplog.records if "constraint refused" in r.getMessage()]
    assert line.startswith(f"POST {route} (request req-7): constraint refused: ")
    assert message in line
    assert len(line) < 500


NESTED_CYCLE = {
    "type": "object",
    "properties": {"x": {"$ref": "#/$defs/node"}},
    "required": ["x"],
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"next": {"$ref": "#/$defs/node"}},
            "required": ["next"],
        }
    },
}


@pytest.mark.parametrize(
    "extra",
    [{"guided_json": NESTED_CYCLE}, {"guided_regex": "(a|b)*c{99999}"}],
)
async def test_the_issues_grammars_are_refused_before_a_stream_starts(
    extra: dict[str, object],
) -> None:
    model = served()
    app, _ = make_app(model)
    body = {"prompt": "hi", "max_tokens": 4, "stream": True, **extra}
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text  # not 200, partial text, then an error event
    message = r.json()["error"]["message"]
    assert message.startswith("the grammar engine cannot enforce this")
    assert "request '" not in message
    assert model.engine.added == []


GAVE_UP = "the grammar engine gave up on this request's regex constraint: Parser Error: ..."


class GivingUpEngine(RecordingEngine):
    """Runs a constrained request unconstrained for one token, then ends it as the torch engine
    does when its grammar engine gives up (a StepOutput with ``error``)."""

    def __init__(self) -> None:
        super().__init__()
        self.giving_up: dict[str, int] = {}

    def add_request(self, request: GenerationRequest) -> None:
        if request.params.constraint is not None:
            self.giving_up[request.request_id] = 0
        super().add_request(request)

    def step(self) -> Sequence[StepOutput]:
        outputs = list(super().step())
        for i, out in enumerate(outputs):
            if out.request_id in self.giving_up and not out.finished:
                self.giving_up[out.request_id] += 1
                if self.giving_up[out.request_id] == 2:
                    self._seqs.pop(out.request_id)
                    outputs[i] = StepOutput(out.request_id, (), True, None, error=GAVE_UP)
        return outputs


async def test_a_grammar_given_up_mid_generation_is_an_error_and_counted_failed() -> None:
    engine = GivingUpEngine()
    model = FakeServed("fake", ContinuousGenerator(engine, TOK, name="fake"), engine)
    app, registry = make_app(model)
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json={**chat, "guided_regex": "[a-z]+"})
        assert r.status_code == 400, r.text
        # the reason alone: no generator name, no internal request id (issue 53)
        assert r.json()["error"]["message"] == GAVE_UP
        r = await client.post(
            "/v1/completions",
            json={"prompt": "hi", "max_tokens": 8, "guided_regex": "[a-z]+", "stream": True},
        )
        assert r.status_code == 200
        events = sse(r.text)
        free = await client.post("/v1/chat/completions", json=chat)
        assert free.status_code == 200
        assert free.json()["choices"][0]["finish_reason"] == "length"
    assert events[-1] == "[DONE]"
    *chunks, error = [e for e in events[:-1]]
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks)
    assert chunks
    assert error["error"]["message"] == GAVE_UP
    assert error["error"]["code"] == 400
    assert sample(registry, "batchline_generation_requests_total", outcome="failed") == 2
    assert sample(registry, "batchline_generation_requests_total", outcome="completed") == 1
    assert sample(registry, "batchline_generation_finished_total", finish_reason="stop") is None


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float | None:
    value = registry.get_sample_value(name, {"model": "fake", **labels})
    return None if value is None else float(value)
