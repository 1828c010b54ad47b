"""One OpenAI request layer: a generation body that the server's routes refuse is refused by a
batch file's line with the same words (both read it through
``batchline.models.openai.requests``), and a body both take becomes the same sampling
parameters."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

from batchline.datasets.sources import Record
from batchline.jobs.requests import RecordRequests
from batchline.models.generation.engine import SamplingParams

from .test_generation_routes import client_for, make_app
from .test_generation_sampling import CHAT, recording

pytestmark = pytest.mark.anyio

COMPLETION = {"prompt": "hi", "max_tokens": 2}

BAD: list[tuple[str, dict[str, Any]]] = [
    ("/v1/chat/completions", {**CHAT, "temperature": "hot"}),
    ("/v1/chat/completions", {**CHAT, "temperature": 3}),
    ("/v1/chat/completions", {**CHAT, "n": 0}),
    ("/v1/chat/completions", {**CHAT, "n": 129}),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 21}),
    ("/v1/chat/completions", {**CHAT, "tools": [{"type": "function"}]}),
    ("/v1/chat/completions", {**CHAT, "messages": []}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "robot", "content": "hi"}]}),
    ("/v1/chat/completions", {**CHAT, "top_k": 4}),
    ("/v1/chat/completions", {**CHAT, "presence_penalty": 5}),
    ("/v1/chat/completions", {**CHAT, "logit_bias": {"x": 1}}),
    ("/v1/chat/completions", {**CHAT, "stop": ["s"] * 17}),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 0}),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": -1}),
    ("/v1/completions", {**COMPLETION, "logprobs": 21}),
    ("/v1/completions", {**COMPLETION, "best_of": 3}),
    ("/v1/completions", {**COMPLETION, "suffix": "!"}),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 2, 3]}),
    ("/v1/completions", {**COMPLETION, "seed": 2**64}),
]


def job_error(url: str, body: dict[str, Any]) -> str:
    """What a batch file's line with this body fails with."""
    requests = RecordRequests("body", True, SamplingParams(), openai_batch=True)
    record = Record(0, "a", "", value={"custom_id": "a", "url": url, "body": body})
    try:
        requests.prompt(record)
        requests.params(record)
    except ValueError as exc:
        return str(exc)
    raise AssertionError(f"a {url} line with {body} did not fail")


@pytest.mark.parametrize(("url", "body"), BAD)
async def test_a_body_the_routes_refuse_fails_a_batch_line_with_the_same_words(
    url: str, body: dict[str, Any]
) -> None:
    model, _ = recording()
    app, _ = make_app(model)
    async with client_for(app) as client:
        r = await client.post(url, json=body)
    assert r.status_code in (400, 422), r.text
    assert r.json()["error"]["message"] == job_error(url, body)


async def test_a_body_both_take_becomes_the_same_sampling_parameters() -> None:
    asked = {
        "max_completion_tokens": 3,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 7,
        "stop": "x",
        "ignore_eos": True,
        "presence_penalty": 1,
        "logit_bias": {"5": -2},
    }
    model, engine = recording()
    app, _ = make_app(model)
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json={**CHAT, **asked})
    assert r.status_code == 200, r.text
    requests = RecordRequests("body", True, SamplingParams(max_tokens=99), openai_batch=True)
    line = {"custom_id": "a", "url": "/v1/chat/completions", "body": {**CHAT, **asked}}
    from_line = requests.params(Record(0, "a", "", value=line))
    (from_route,) = engine.params
    # the route's request is interactive; a job sets its own priority when it submits
    assert from_line == SamplingParams(
        max_tokens=3,
        temperature=0.5,
        top_p=0.9,
        seed=7,
        stop=("x",),
        ignore_eos=True,
        presence_penalty=1,
        logit_bias=((5, -2),),
    )
    assert from_route == from_line
