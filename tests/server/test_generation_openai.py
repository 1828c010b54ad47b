"""The ``openai`` client against the generation routes, served for real by uvicorn on
127.0.0.1 (in a thread): completions and chat, streaming and not, and its error types."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("openai")
pytest.importorskip("uvicorn")

import openai

from .conftest import uvicorn_in_thread
from .test_generation_routes import TOK, chat_text, expected, make_app, served


@pytest.fixture(scope="module")
def client() -> Iterator[openai.OpenAI]:
    """One uvicorn server on a free port of 127.0.0.1, with a fake generate model whose
    sequences stop (EOS) after 5 tokens for the prompt ``"ends early"``."""
    model = served(eos_after=lambda ids: 5 if TOK.decode(ids) == "ends early" else None)
    app, _ = make_app(model)
    with (
        uvicorn_in_thread(app) as url,
        openai.OpenAI(
            base_url=f"http://{url}/v1", api_key="unused", max_retries=0, timeout=30
        ) as c,
    ):
        yield c


def test_completion(client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake", prompt="hello", max_tokens=8)
    assert out.object == "text_completion"
    assert out.model == "fake"
    (choice,) = out.choices
    assert choice.text == expected("hello", 8)
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert (out.usage.prompt_tokens, out.usage.completion_tokens) == (5, 8)
    assert out.usage.total_tokens == 13


def test_completion_ends_on_eos_and_on_a_stop_string(client: openai.OpenAI) -> None:
    out = client.completions.create(model="fake", prompt="ends early", max_tokens=20)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == expected("ends early", 4)
    full = expected("cut", 10)
    out = client.completions.create(model="fake", prompt="cut", max_tokens=10, stop=[full[3:5]])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == full[: full.index(full[3:5])]


def test_streamed_completion(client: openai.OpenAI) -> None:
    stream = client.completions.create(
        model="fake",
        prompt=["a b", "c d e"],
        max_tokens=6,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts = ["", ""]
    finishes: dict[int, str | None] = {}
    usage = None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason is not None:
                finishes[choice.index] = choice.finish_reason
    assert texts == [expected("a b", 6), expected("c d e", 6)]
    assert finishes == {0: "length", 1: "length"}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (8, 12, 20)


def test_chat_completion(client: openai.OpenAI) -> None:
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Colour of the sky?"},
    ]
    out = client.chat.completions.create(model="fake", messages=messages, max_tokens=9)
    assert out.object == "chat.completion"
    (choice,) = out.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == expected(chat_text(messages), 9)
    assert choice.finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(TOK.encode(chat_text(messages)))
    assert out.usage.completion_tokens == 9


def test_streamed_chat_completion(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say something."}]
    stream = client.chat.completions.create(
        model="fake",
        messages=messages,
        max_completion_tokens=7,
        stream=True,
        stream_options={"include_usage": True},
    )
    content = ""
    roles = []
    finish = None
    usage = None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.role is not None:
                roles.append(choice.delta.role)
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert roles == ["assistant"]
    assert content == expected(chat_text(messages), 7)
    assert finish == "length"
    assert usage is not None
    assert usage.completion_tokens == 7


def test_errors_are_the_clients_error_types(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError, match="'nope' is not served here; models: fake"):
        client.completions.create(model="nope", prompt="hi")
    with pytest.raises(openai.BadRequestError, match="exceeds the model's context of 2048"):
        client.completions.create(model="fake", prompt="x" * 2000, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match="'top_logprobs' needs 'logprobs': true"):
        client.chat.completions.create(
            model="fake", messages=[{"role": "user", "content": "hi"}], top_logprobs=2
        )
    with pytest.raises(openai.UnprocessableEntityError):
        client.completions.create(model="fake", prompt="hi", temperature=5)
