"""Structured outputs on the OpenAI routes: the constraint a body asks for reaches the engine
with the request, and a bad one is a 400 that says what is wrong."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("llguidance")

from batchline.models.generation.engine import GenerationRequest
from batchline.models.generation.fake import FakeEngine
from batchline.models.generation.scheduler import ContinuousGenerator
from batchline.models.generation.structured import Constraint

from .test_generation_routes import TOK, FakeServed, client_for, make_app, served

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
