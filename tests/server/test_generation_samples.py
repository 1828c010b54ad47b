"""``n`` completions per prompt, log-probabilities and ``echo`` on the OpenAI generation
routes (the fake engine: its log-probabilities are ``fake_logprob``'s)."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("fastapi")

from batchline.models.generation.fake import fake_logprob

from .test_generation_routes import TOK, client_for, expected, make_app, served, sse
from .test_generation_sampling import recording

pytestmark = pytest.mark.anyio

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HALF = -math.log(2)


async def post(path: str, body: dict[str, Any]) -> Any:
    model = served()
    app, _ = make_app(model)
    async with client_for(app) as client:
        r = await client.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json() if not body.get("stream") else sse(r.text)


async def test_n_choices_per_prompt_in_order_with_the_prompt_counted_once() -> None:
    body = await post("/v1/completions", {"prompt": ["ab", "cde"], "n": 3, "max_tokens": 5})
    choices = body["choices"]
    assert [c["index"] for c in choices] == list(range(6))
    # greedy: every choice of a prompt is the same text
    assert [c["text"] for c in choices] == [expected("ab", 5)] * 3 + [expected("cde", 5)] * 3
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 30, "total_tokens": 35}


async def test_seeded_samples_get_seed_plus_their_index() -> None:
    model, engine = recording()
    app, _ = make_app(model)
    async with client_for(app) as client:
        for extra in (
            {"temperature": 0.7, "seed": 10},
            {"temperature": 0.7},
            {"seed": 10, "temperature": 0},
        ):
            r = await client.post("/v1/chat/completions", json={**CHAT, "n": 4, **extra})
            assert r.status_code == 200, r.text
            assert len(r.json()["choices"]) == 4
    assert [p.seed for p in engine.params[:4]] == [10, 11, 12, 13]
    assert [p.seed for p in engine.params[4:8]] == [None] * 4  # unseeded: fresh entropy each
    assert [p.seed for p in engine.params[8:]] == [10] * 4  # greedy: the seed changes nothing


async def test_chat_logprobs_with_top_logprobs() -> None:
    body = await post("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2})
    (choice,) = body["choices"]
    content = choice["logprobs"]["content"]
    text = choice["message"]["content"]
    assert "".join(t["token"] for t in content) == text
    for token in content:
        assert token["logprob"] == pytest.approx(HALF)
        assert bytes(token["bytes"]).decode() == token["token"]
        assert token["top_logprobs"][0]["token"] == token["token"]
        assert len(token["top_logprobs"]) == 2


async def test_chat_without_logprobs_says_null() -> None:
    body = await post("/v1/chat/completions", CHAT)
    assert body["choices"][0]["logprobs"] is None


async def test_completion_logprobs_in_the_legacy_shape() -> None:
    body = await post("/v1/completions", {"prompt": "ab", "max_tokens": 3, "logprobs": 1})
    logprobs = body["choices"][0]["logprobs"]
    text = expected("ab", 3)
    assert "".join(logprobs["tokens"]) == text
    assert logprobs["text_offset"] == [0, 1, 2]
    assert logprobs["token_logprobs"] == pytest.approx([HALF] * 3)
    assert [list(top) for top in logprobs["top_logprobs"]] == [[t] for t in text]


async def test_echo_puts_the_prompt_before_each_choice() -> None:
    body = await post("/v1/completions", {"prompt": "ab", "max_tokens": 3, "echo": True, "n": 2})
    assert [c["text"] for c in body["choices"]] == ["ab" + expected("ab", 3)] * 2


async def test_a_stream_of_n_choices_with_logprobs_and_echo() -> None:
    events = await post(
        "/v1/completions",
        {
            "prompt": "ab",
            "max_tokens": 3,
            "n": 2,
            "echo": True,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    texts = {0: "", 1: ""}
    for event in events[:-2]:
        for c in event["choices"]:
            texts[c["index"]] += c["text"]
    assert texts == {i: "ab" + expected("ab", 3) for i in (0, 1)}
    assert events[-2]["usage"]["prompt_tokens"] == 2

    events = await post("/v1/chat/completions", {**CHAT, "stream": True, "logprobs": True})
    tokens = [
        t
        for e in events[:-1]
        for c in e["choices"]
        if c["logprobs"] is not None
        for t in c["logprobs"]["content"]
    ]
    text = "".join(c["delta"].get("content", "") for e in events[:-1] for c in e["choices"])
    assert "".join(t["token"] for t in tokens) == text
    assert len(tokens) == 4
    want = fake_logprob(TOK.encode(text[0])[0], 0)
    assert tokens[0]["logprob"] == pytest.approx(want.logprob)


async def test_echo_with_logprobs_scores_the_prompt_then_the_completion() -> None:
    body = await post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 1, "n": 2},
    )
    for choice in body["choices"]:
        logprobs = choice["logprobs"]
        assert "".join(logprobs["tokens"]) == choice["text"] == "abc" + expected("abc", 2)
        assert logprobs["text_offset"] == [0, 1, 2, 3, 4]
        # the prompt's first token has no log-probability; the others the model's
        assert logprobs["token_logprobs"][0] is None
        assert logprobs["top_logprobs"][0] is None
        assert logprobs["token_logprobs"][1:] == pytest.approx([HALF] * 4)
        assert list(logprobs["top_logprobs"][1]) == ["b"]


async def test_a_stream_echoes_the_prompt_with_its_logprobs() -> None:
    events = await post(
        "/v1/completions",
        {"prompt": "abc", "max_tokens": 2, "echo": True, "logprobs": 0, "stream": True},
    )
    chunks = [c for e in events[:-1] for c in e["choices"]]
    assert "".join(c["text"] for c in chunks) == "abc" + expected("abc", 2)
    echoed = chunks[0]
    assert echoed["text"] == "abc"
    assert echoed["logprobs"]["tokens"] == ["a", "b", "c"]
    assert echoed["logprobs"]["token_logprobs"][0] is None
    tokens = [t for c in chunks[1:] if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks[1:] if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert "".join(tokens) == expected("abc", 2)
    assert offsets == [3, 4]
