"""The generation routes (``/generate``, ``/v1/completions``, ``/v1/chat/completions``) on the
fake engine, through ``httpx.ASGITransport`` and raw ASGI calls (for disconnects).

Steps are driven by the test (``GatedEngine``) where timing matters, and the generator's
clock is a ``ManualClock`` moved one second per step: nothing asserts on real time.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("prometheus_client")

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from batchline import ManualClock
from batchline._batcher import State
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import StepOutput
from batchline.models.generation.fake import FakeEngine, FakeTokenizer, default_next_token
from batchline.models.protocol import ModelInfo
from batchline.server.errors import install_error_handlers
from batchline.server.gate import Gate
from batchline.server.metrics import ServerMetrics
from batchline.server.routes import generation
from batchline.server.served import ServedGenerator
from batchline.server.settings import ServerSettings
from batchline.server.state import ServerState

from .conftest import wait_for

pytestmark = pytest.mark.anyio

TOK = FakeTokenizer()


class GatedEngine(FakeEngine):
    """A FakeEngine whose steps wait for the test's permission (until ``open()``); each
    step moves ``clock`` one second."""

    def __init__(self, clock: ManualClock, **options: Any) -> None:
        super().__init__(**options)
        self.clock = clock
        self._permits = threading.Semaphore(0)
        self._open = threading.Event()
        self.blocked = threading.Event()

    def allow(self, steps: int = 1) -> None:
        for _ in range(steps):
            self._permits.release()

    def open(self) -> None:
        self._open.set()
        self._permits.release()

    def step(self) -> Sequence[StepOutput]:
        if not self._open.is_set():
            self.blocked.set()
            if not self._permits.acquire(timeout=30):
                raise RuntimeError("the test never allowed this step")
            self.blocked.clear()
        self.clock.advance(1.0)
        return super().step()


class TemplateError(Exception):
    """What jinja2 raises when a chat template refuses a conversation."""


def chat_text(messages: Sequence[Mapping[str, str]]) -> str:
    """The test's chat template."""
    return "".join(f"<{m['role']}>{m['content']}\n" for m in messages) + "<assistant>"


@dataclass(frozen=True)
class FakeServed:
    """A generate model (shaped like ``GenerationModel``) on the fake engine and tokenizer."""

    name: str
    generator: ContinuousGenerator
    engine: FakeEngine = field(repr=False)

    @property
    def max_context_tokens(self) -> int:
        return self.generator.max_context_tokens

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            task="generate",
            input_kind="text",
            result_kind="value",
            result_column="text",
            max_tokens=self.max_context_tokens,
        )

    @property
    def detokenizer(self) -> FakeTokenizer:
        return TOK

    def token_bytes(self, token_id: int) -> bytes:
        return TOK.token_bytes(token_id)

    def close(self) -> None:
        pass

    def encode_prompt(self, text: str) -> list[int]:
        return TOK.encode(text)

    def encode_chat(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        if any(m["role"] == "tool" for m in messages):
            raise ValueError("this model's chat template has no tool role")
        roles = [m["role"] for m in messages]
        if any(a == b == "user" for a, b in itertools.pairwise(roles)):
            raise TemplateError("Conversation roles must alternate user/assistant/user/...")
        return TOK.encode(chat_text(messages))


def served(
    name: str = "fake",
    *,
    gated: bool = False,
    max_running: int = 8,
    max_waiting: int = 64,
    kv_token_budget: int = 16_384,
    **engine_options: Any,
) -> FakeServed:
    clock = ManualClock()
    engine: FakeEngine = (
        GatedEngine(clock, **engine_options) if gated else FakeEngine(**engine_options)
    )
    generator = ContinuousGenerator(
        engine,
        TOK,
        max_running=max_running,
        max_waiting=max_waiting,
        kv_token_budget=kv_token_budget,
        clock=clock,
        name=name,
    )
    return FakeServed(name, generator, engine)


def make_app(
    *models: FakeServed,
    limits: Mapping[str, Any] | None = None,
    others: Mapping[str, Any] | None = None,
    gate: bool = False,
) -> tuple[FastAPI, CollectorRegistry]:
    """A FastAPI app with only the generation router, the server's error handlers, a
    ``ServerState`` serving ``models`` (and ``others``: batch models, by name) with the
    settings ``limits``, and a lifespan that starts and stops the generators; ``gate``: behind
    the server's gate (which watches for disconnects)."""
    metrics = ServerMetrics()
    state = ServerState(settings=ServerSettings(**(limits or {})), metrics=metrics)
    for m in models:
        state.registry.add(ServedGenerator(m.name, m, metrics.generation))
    for other in (others or {}).values():
        state.registry.add(other)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for served_model in state.registry.generators():
            await served_model.start()
        state.ready = True
        try:
            yield
        finally:
            for m in models:
                if isinstance(m.engine, GatedEngine):
                    m.engine.open()
                await m.generator.stop(drain=False)

    app = FastAPI(lifespan=lifespan)
    app.include_router(generation.router)
    install_error_handlers(app)
    app.state.server = state
    if gate:
        app.add_middleware(Gate, state=state)
    return app, metrics.registry


@asynccontextmanager
async def client_for(app: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            yield client


def expected(prompt: str, max_tokens: int) -> str:
    """What the fake engine generates for a prompt (it never emits EOS by default)."""
    ids = TOK.encode(prompt)
    generated: list[int] = []
    for _ in range(max_tokens):
        generated.append(default_next_token(ids, generated))
    return TOK.decode(generated)


def sse(text: str) -> list[Any]:
    """The ``data:`` payloads of a server-sent event stream (``"[DONE]"`` kept as is)."""
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: "), block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


class RawCall:
    """One request through the raw ASGI interface, whose client disconnects on demand."""

    def __init__(self, app: FastAPI, path: str, body: Mapping[str, Any]) -> None:
        self.sent: list[dict[str, Any]] = []
        self._gone = asyncio.Event()
        self._delivered = False
        self._body = json.dumps(body).encode("utf-8")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode("ascii"),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json"), (b"host", b"127.0.0.1")],
            "client": ("127.0.0.1", 40000),
            "server": ("test", 80),
            "state": {},
        }
        self.task = asyncio.ensure_future(app(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if not self._delivered:
            self._delivered = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: Mapping[str, Any]) -> None:
        self.sent.append(dict(message))

    def disconnect(self) -> None:
        self._gone.set()

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")


# -- /generate ------------------------------------------------------------------------------------


async def test_generate_answers_every_prompt_in_order() -> None:
    app, _ = make_app(served())
    prompts = ["2 + 2 =", "the capital of France is", "x"]
    async with client_for(app) as client:
        r = await client.post(
            "/generate", json={"prompts": prompts, "task_id": "t-1", "max_tokens": 6}
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body == {
        "results": [expected(p, 6) for p in prompts],
        "details": [
            {"finish_reason": "length", "prompt_tokens": len(TOK.encode(p)), "completion_tokens": 6}
            for p in prompts
        ],
        "task_id": "t-1",
        "model": "fake",
    }


async def test_generate_with_chat_sends_each_prompt_through_the_chat_template() -> None:
    """``"chat": true`` (what ``drive`` sends): a prompt is one user message, as ``run`` takes a
    text prompt; without it (the seed's body) the prompt is raw."""
    app, _ = make_app(served())
    prompts = ["2 + 2 =", "x"]
    async with client_for(app) as client:
        chat = await client.post(
            "/generate", json={"prompts": prompts, "max_tokens": 5, "chat": True}
        )
        raw = await client.post("/generate", json={"prompts": prompts, "max_tokens": 5})
    assert chat.status_code == raw.status_code == 200, chat.text
    templated = [chat_text([{"role": "user", "content": p}]) for p in prompts]
    assert chat.json()["results"] == [expected(t, 5) for t in templated]
    assert [d["prompt_tokens"] for d in chat.json()["details"]] == [
        len(TOK.encode(t)) for t in templated
    ]
    assert raw.json()["results"] == [expected(p, 5) for p in prompts]
    assert chat.json()["results"] != raw.json()["results"]


async def test_generate_without_max_tokens_uses_what_the_context_leaves() -> None:
    app, _ = make_app(served(max_context_tokens=40))
    async with client_for(app) as client:
        r = await client.post("/generate", json={"prompts": ["a" * 30]})
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [expected("a" * 30, 10)]


async def test_generate_stop_string_cuts_the_text() -> None:
    app, _ = make_app(served())
    full = expected("stop me", 12)
    stop = full[5:7]
    async with client_for(app) as client:
        r = await client.post(
            "/generate", json={"prompts": ["stop me"], "max_tokens": 12, "stop": stop}
        )
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [full[: full.index(stop)]]


async def test_prompts_of_concurrent_clients_share_the_engines_steps() -> None:
    model = served(gated=True, max_running=8)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model)
    async with client_for(app) as client:
        first = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["a", "b"], "max_tokens": 4})
        )
        second = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["c", "d"], "max_tokens": 4})
        )
        await wait_for(lambda: model.generator.stats.requests_submitted == 4)
        engine.open()
        r1, r2 = await first, await second
    assert r1.status_code == r2.status_code == 200
    assert r1.json()["results"] == [expected("a", 4), expected("b", 4)]
    assert r2.json()["results"] == [expected("c", 4), expected("d", 4)]
    # one engine step ran sequences of both requests
    assert max(len(step.running) for step in engine.steps) == 4
    prefixes = {rid.rsplit("-", 1)[0] for step in engine.steps for rid in step.running}
    assert len(prefixes) == 2


async def test_a_request_the_queue_cannot_take_whole_is_refused_whole() -> None:
    model = served(gated=True, max_running=1, max_waiting=2)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model, limits={"retry_after_s": 3})
    async with client_for(app) as client:
        holder = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["hold"], "max_tokens": 2})
        )
        await wait_for(lambda: engine.blocked.is_set() and model.generator.stats.running == 1)
        r = await client.post("/generate", json={"prompts": ["a", "b", "c"], "max_tokens": 2})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "3"
        assert "queue full" in r.json()["error"]["message"]
        stats = model.generator.stats
        # the three are asked for together (submit_many): none was queued, none withdrawn
        assert (stats.waiting, stats.requests_submitted) == (0, 1)
        assert stats.requests_aborted == 0
        assert stats.requests_rejected == 1
        # a request that fits is still served
        fits = asyncio.ensure_future(
            client.post("/generate", json={"prompts": ["d", "e"], "max_tokens": 2})
        )
        await wait_for(lambda: model.generator.stats.waiting == 2)
        engine.open()
        assert (await holder).status_code == 200
        r = await fits
    assert r.status_code == 200, r.text
    assert r.json()["results"] == [expected("d", 2), expected("e", 2)]


# -- errors ---------------------------------------------------------------------------------------


async def test_prompt_over_the_context_is_400_with_the_counts() -> None:
    app, _ = make_app(served(max_context_tokens=32))
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json={"prompt": "x" * 30, "max_tokens": 8})
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "prompt of 30 tokens + max_tokens 8 = 38 tokens" in message
        assert "the model's context of 32 tokens" in message
        r = await client.post("/generate", json={"prompts": ["ok", "y" * 31], "max_tokens": 4})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("prompt 1: ")
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "z" * 40}], "max_tokens": 1},
        )
        assert r.status_code == 400
        assert "exceeds the model's context of 32 tokens" in r.json()["error"]["message"]


async def test_kv_budget_refusal_is_400_and_admits_nothing() -> None:
    model = served(kv_token_budget=20)
    app, _ = make_app(model)
    async with client_for(app) as client:
        r = await client.post("/generate", json={"prompts": ["ok", "k" * 18], "max_tokens": 4})
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert message.startswith("prompt 1: prompt of 18 tokens + max_tokens 4 = 22 tokens")
    assert "KV-cache budget of 20 tokens" in message
    assert model.generator.stats.requests_submitted == 0


async def test_a_missing_max_tokens_fits_in_what_the_kv_budget_leaves() -> None:
    """The default ``max_tokens`` is capped by the KV budget where it is smaller than the
    context, as by the context: a request that named none was refused, its 400 blaming a
    max_tokens the client never sent."""
    model = served(kv_token_budget=20)
    assert model.generator.max_request_tokens == 20  # the context is larger
    app, _ = make_app(model)
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json={"prompt": "k" * 15, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"] == {
            "prompt_tokens": 15, "completion_tokens": 5, "total_tokens": 20
        }  # fmt: skip
        assert r.json()["choices"][0]["finish_reason"] == "length"


async def test_models_are_picked_by_name_and_task() -> None:
    embedder = SimpleNamespace(name="emb", task="embed")
    app, _ = make_app(served("gen-a"), served("gen-b"), others={"emb": embedder})
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json={"model": "nope", "prompt": "hi"})
        assert r.status_code == 404
        message = r.json()["error"]["message"]
        assert "'nope'" in message
        assert "gen-a (generate), gen-b (generate), emb (embed)" in message
        r = await client.post("/v1/completions", json={"model": "emb", "prompt": "hi"})
        assert r.status_code == 400
        assert "does embed" in r.json()["error"]["message"]
        assert "/v1/embeddings" in r.json()["error"]["message"]
        r = await client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 400
        assert "name one in 'model'" in r.json()["error"]["message"]
        r = await client.post(
            "/v1/completions", json={"model": "gen-b", "prompt": "hi", "max_tokens": 3}
        )
        assert r.status_code == 200
        assert r.json()["model"] == "gen-b"


async def test_no_generate_model_is_400() -> None:
    app, _ = make_app(others={"emb": SimpleNamespace(name="emb", task="embed")})
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            r = await client.post("/generate", json={"prompts": ["hi"]})
    assert r.status_code == 400
    assert "no model served here does generate" in r.json()["error"]["message"]


SECRET = "sEcReT-\u00e9-input"


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", {"prompt": "hi", "temperature": SECRET}, 422),
        ("/v1/completions", {"prompt": "hi", "temperature": 3}, 422),
        ("/v1/completions", {"prompt": "hi", "top_p": 0}, 422),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 422),
        ("/v1/completions", {"prompt": "hi", "max_tokens": SECRET}, 422),
        ("/v1/completions", {"prompt": "hi", "n": 0}, 422),
        ("/v1/completions", {"prompt": "hi", "n": SECRET}, 422),
        ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": SECRET}, 422),
        ("/v1/completions", {"prompt": "hi", "logprobs": 21}, 422),
        ("/v1/completions", {"prompt": ["a"] * 40, "n": 100}, 413),
        ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400),
        ("/v1/completions", {"prompt": [1, 2, 3]}, 422),
        ("/v1/completions", {"prompt": []}, 400),
        ("/v1/completions", {"prompt": ""}, 400),
        ("/v1/completions", {"prompt": "hi", "stream": SECRET}, 422),
        ("/v1/chat/completions", {"messages": []}, 400),
        ("/v1/chat/completions", {"messages": [{"role": SECRET, "content": "x"}]}, 422),
        ("/v1/chat/completions", {"messages": [{"role": "tool", "content": SECRET}]}, 400),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
            400,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            400,
        ),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "url": SECRET}]}]},
            422,
        ),
        ("/generate", {"prompts": "hi"}, 422),
        ("/generate", {"prompts": []}, 400),
        ("/generate", {"prompts": ["hi"], "seed": 1.5}, 422),
        ("/generate", {"prompts": ["hi"], "seed": 2**64}, 422),
    ],
)
async def test_bad_parameters_are_4xx_and_never_echo_the_input(
    path: str, body: dict[str, Any], status: int
) -> None:
    app, _ = make_app(served())
    async with client_for(app) as client:
        r = await client.post(path, json=body)
    assert r.status_code == status, r.text
    assert SECRET not in r.text
    assert r.json()["error"]["code"] == status


@pytest.mark.parametrize(
    "raw",
    [
        b'{"prompt": "hi", "temperature": NaN}',
        b'{"prompt": "hi", "temperature": Infinity}',
        b'{"prompt": "\\ud800", "max_tokens": 2}',
        b'{"model": "\\ud800", "prompt": "hi"}',
        b"not json",
    ],
)
async def test_odd_bytes_are_never_a_5xx(raw: bytes) -> None:
    app, _ = make_app(served())
    async with client_for(app) as client:
        r = await client.post(
            "/v1/completions", content=raw, headers={"content-type": "application/json"}
        )
    assert 400 <= r.status_code < 500, r.text


async def test_a_conversation_the_chat_template_refuses_is_400() -> None:
    app, _ = make_app(served())
    twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    async with client_for(app) as client:
        r = await client.post("/v1/chat/completions", json={"messages": twice})
    assert r.status_code == 400
    assert (
        "refused by the model's chat template: Conversation roles must alternate"
        in (r.json()["error"]["message"])
    )


async def test_too_many_prompts_is_413() -> None:
    app, _ = make_app(served(), limits={"max_inputs_per_request": 2})
    async with client_for(app) as client:
        r = await client.post("/generate", json={"prompts": ["a", "b", "c"]})
    assert r.status_code == 413
    assert "at most 2" in r.json()["error"]["message"]


# -- OpenAI shapes --------------------------------------------------------------------------------


async def test_completions_have_choices_usage_and_finish_reasons() -> None:
    app, _ = make_app(served(eos_after=lambda ids: 3 if TOK.decode(ids) == "short" else None))
    async with client_for(app) as client:
        r = await client.post(
            "/v1/completions", json={"prompt": ["long one", "short"], "max_tokens": 5}
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == "fake"
    first, second = body["choices"]
    assert first == {
        "index": 0,
        "text": expected("long one", 5),
        "logprobs": None,
        "finish_reason": "length",
    }
    # EOS as the third token: two tokens of text, three generated
    assert second["finish_reason"] == "stop"
    assert second["text"] == expected("short", 2)
    assert body["usage"] == {"prompt_tokens": 8 + 5, "completion_tokens": 8, "total_tokens": 21}


async def test_completions_default_to_16_tokens() -> None:
    app, _ = make_app(served())
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json={"prompt": "go"})
    assert r.json()["choices"][0]["text"] == expected("go", 16)
    assert r.json()["usage"]["completion_tokens"] == 16


async def test_chat_goes_through_the_chat_template() -> None:
    app, _ = make_app(served())
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
    ]
    templated = chat_text(
        [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
    )
    async with client_for(app) as client:
        r = await client.post(
            "/v1/chat/completions", json={"messages": messages, "max_completion_tokens": 7}
        )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": expected(templated, 7)},
            "logprobs": None,
            "finish_reason": "length",
        }
    ]
    assert body["usage"] == {
        "prompt_tokens": len(TOK.encode(templated)),
        "completion_tokens": 7,
        "total_tokens": len(TOK.encode(templated)) + 7,
    }


async def test_completions_stream_as_server_sent_events() -> None:
    app, _ = make_app(served())
    async with client_for(app) as client:
        r = await client.post(
            "/v1/completions",
            json={
                "prompt": ["one", "two"],
                "max_tokens": 6,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    usage = events[-2]
    assert usage["choices"] == []
    assert usage["usage"] == {"prompt_tokens": 6, "completion_tokens": 12, "total_tokens": 18}
    chunks = events[:-2]
    texts = {0: "", 1: ""}
    finishes: dict[int, str] = {}
    for chunk in chunks:
        assert chunk["object"] == "text_completion"
        assert chunk["usage"] is None
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["text"]
        if choice["finish_reason"] is not None:
            finishes[choice["index"]] = choice["finish_reason"]
    assert texts == {0: expected("one", 6), 1: expected("two", 6)}
    assert finishes == {0: "length", 1: "length"}
    assert len({c["id"] for c in chunks}) == 1


async def test_chat_streams_a_role_then_content_then_the_finish() -> None:
    app, _ = make_app(served())
    messages = [{"role": "user", "content": "hello"}]
    async with client_for(app) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 5, "stream": True, "stop": ["\n"]},
        )
    events = sse(r.text)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "usage" not in chunks[0]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:])
    assert content == expected(chat_text(messages), 5).split("\n")[0]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])


# -- disconnects and timeouts ---------------------------------------------------------------------


@pytest.mark.parametrize("stream", [False, True])
async def test_a_client_that_disconnects_aborts_its_sequence_and_frees_its_slot(
    stream: bool,
) -> None:
    model = served(gated=True, max_running=1)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model, gate=True)
    async with client_for(app) as client:
        call = RawCall(
            app, "/v1/completions", {"prompt": "leave", "max_tokens": 50, "stream": stream}
        )
        await wait_for(lambda: engine.blocked.is_set() and model.generator.stats.running == 1)
        # a second request waits for the only slot
        waiter = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "stay", "max_tokens": 3})
        )
        await wait_for(lambda: model.generator.stats.waiting == 1)
        engine.allow(1)  # the first sequence gets a token
        if stream:
            await wait_for(lambda: b'"text"' in call.body)
        await wait_for(lambda: len(engine.steps) == 1 and engine.blocked.is_set())
        call.disconnect()
        await asyncio.wait_for(call.task, 20)
        if not stream:
            assert call.sent == []  # the gate cancelled it: nobody is listening, no response
        # the abort takes effect before the next step: the waiting request gets the slot
        engine.allow(1)
        await wait_for(lambda: model.generator.stats.requests_aborted == 1)
        await wait_for(lambda: len(engine.added) == 2)
        assert engine.aborted == [engine.added[0]]
        engine.open()
        r = await waiter
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == expected("stay", 3)
    stats = model.generator.stats
    assert stats.requests_completed == 1
    assert stats.running == 0
    assert stats.kv_tokens_reserved == 0


async def test_a_request_past_its_timeout_is_504_and_its_sequences_are_aborted() -> None:
    model = served(gated=True, max_running=1)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model, limits={"request_timeout_s": 0.2})
    async with client_for(app) as client:
        # no step is ever allowed: one sequence holds the slot, the other waits
        r = await client.post("/generate", json={"prompts": ["a", "b"], "max_tokens": 4})
        assert r.status_code == 504, r.text
        assert "request_timeout_s=0.2" in r.json()["error"]["message"]
        assert model.generator.stats.waiting == 0
        engine.allow(1)
        await wait_for(lambda: model.generator.stats.requests_aborted == 2)
        stats = model.generator.stats
        assert stats.running == 0
        assert stats.kv_tokens_reserved == 0
        assert len(engine.aborted) == 1


async def test_a_stream_past_its_timeout_ends_with_an_error_event() -> None:
    model = served(gated=True, max_running=1)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model, limits={"request_timeout_s": 0.2})
    async with client_for(app) as client:
        r = await client.post(
            "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "stream": True},
        )
        events = sse(r.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 504
        engine.allow(1)
        await wait_for(lambda: model.generator.stats.requests_aborted == 1)
        assert model.generator.stats.running == 0


async def test_the_timeout_is_a_wait_without_progress_not_the_whole_answer() -> None:
    """``request_timeout_s`` bounds the wait for a request's next token (its first included),
    not its whole answer: a stream 30 s long at the default was cut mid-answer with a 504
    while it made tokens every few ms. On a manual clock: a token every 0.6 of the timeout
    goes on past the timeout in all; a wait of a whole timeout ends it."""
    from batchline import ManualClock
    from batchline.models.generation import GenerationDelta, GenerationStream
    from batchline.server.routes._sse import merged_deltas

    clock = ManualClock()
    stream = GenerationStream("r", 3, on_abort=lambda _: None)
    got: list[str] = []
    merged = merged_deltas([stream], 10.0, now=clock.now)
    for k in range(5):  # 5 tokens over 30 units: 3 timeouts in all, none without progress
        stream._push(GenerationDelta(f"t{k}", (k,)))
        got.append((await anext(merged))[1].text)
        clock.advance(6.0)
    assert got == ["t0", "t1", "t2", "t3", "t4"]
    clock.advance(4.0)  # 10 units since the last token: that is the timeout
    with pytest.raises(TimeoutError):
        await anext(merged)
    await merged.aclose()


async def test_requests_cut_short_by_a_stop_without_drain_are_503() -> None:
    model = served(gated=True, max_running=1)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app, _ = make_app(model, limits={"retry_after_s": 2})
    async with client_for(app) as client:
        running = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "run", "max_tokens": 9})
        )
        waiting = asyncio.ensure_future(
            client.post("/v1/completions", json={"prompt": "wait", "max_tokens": 9, "stream": True})
        )
        await wait_for(lambda: model.generator.stats.waiting == 1 and engine.blocked.is_set())
        stopping = asyncio.ensure_future(model.generator.stop(drain=False))
        await wait_for(lambda: model.generator.state is State.STOPPING)
        engine.open()  # the step in progress ends; then the stop ends everything
        await stopping
        r, s = await running, await waiting
        assert r.status_code == 503
        assert r.headers["retry-after"] == "2"
        # the stream had begun: it ends with an error event, then [DONE]
        events = sse(s.text)
        assert events[-1] == "[DONE]"
        assert events[-2]["error"]["code"] == 503
        r = await client.post("/v1/completions", json={"prompt": "late"})
        assert r.status_code == 503
        assert "shutting down" in r.json()["error"]["message"]


def test_the_openapi_document_inlines_nested_request_models() -> None:
    app, _ = make_app(served())
    paths = app.openapi()["paths"]
    schema = paths["/v1/chat/completions"]["post"]["requestBody"]["content"]
    assert "$defs" not in json.dumps(schema)
    assert set(paths) == {"/generate", "/v1/completions", "/v1/chat/completions"}


# -- metrics --------------------------------------------------------------------------------------


async def test_metrics_appear_on_the_registry_after_requests() -> None:
    model = served(gated=True)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    engine.open()
    app, registry = make_app(model)
    async with client_for(app) as client:
        r = await client.post("/v1/completions", json={"prompt": ["p", "q"], "max_tokens": 4})
        assert r.status_code == 200
        r = await client.post(
            "/v1/completions", json={"prompt": "s", "max_tokens": 3, "stream": True}
        )
        assert r.status_code == 200

        def value(name: str, **labels: str) -> float | None:
            return registry.get_sample_value(name, {"model": "fake", **labels})

        assert value("batchline_generation_requests_total", outcome="submitted") == 3
        assert value("batchline_generation_requests_total", outcome="completed") == 3
        assert value("batchline_generation_requests_total", outcome="aborted") == 0
        assert value("batchline_generation_generated_tokens_total") == 11
        assert value("batchline_generation_running_sequences") == 0
        assert value("batchline_generation_waiting_sequences") == 0
        assert value("batchline_generation_running_cap") == 8  # served(): max_running 8, fixed
        assert value("batchline_generation_kv_tokens", kind="budget") == 16_384
        assert value("batchline_generation_kv_budget_used_ratio") == 0
        assert value("batchline_generation_preempted_total") == 0
        assert value("batchline_generation_finished_total", finish_reason="length") == 3
        # the manual clock moves 1 s per step: every first token came one step after admission
        assert value("batchline_generation_time_to_first_token_seconds_count") == 3
        assert value("batchline_generation_time_to_first_token_seconds_sum") == 3.0
        assert value("batchline_generation_time_per_output_token_seconds_sum") == 3.0
        assert value("batchline_generation_e2e_request_latency_seconds_sum") == 4 + 4 + 3
        assert (
            value("batchline_generation_recent_time_to_first_token_seconds", quantile="0.5") == 1.0
        )
        assert value("batchline_generation_tokens_per_second") is not None


# -- behind the server's own app and gate ---------------------------------------------------------


async def test_behind_create_app_and_its_gate() -> None:
    """The router mounted on ``create_app``'s app (an embed model served beside): the gate
    hands the body over, a disconnect seen by the gate aborts the sequence, the embed model
    is named by task."""
    from batchline.server import create_app

    from .conftest import FakeEmbedder, loader, settings

    model = served("gen", gated=True, max_running=1)
    engine = model.engine
    assert isinstance(engine, GatedEngine)
    app = create_app(settings(), load_model=loader(FakeEmbedder()))
    app.include_router(generation.router)
    async with app.router.lifespan_context(app):
        server = app.state.server
        server.registry.add(ServedGenerator("gen", model, server.metrics.generation))
        await model.generator.start()
        try:
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(
                transport=transport, base_url="http://127.0.0.1"
            ) as client:
                r = await client.post("/v1/completions", json={"model": "fake", "prompt": "x"})
                assert r.status_code == 400
                assert "does embed" in r.json()["error"]["message"]
                call = RawCall(app, "/v1/completions", {"prompt": "gone", "max_tokens": 40})
                await wait_for(
                    lambda: engine.blocked.is_set() and model.generator.stats.running == 1
                )
                call.disconnect()
                await asyncio.wait_for(call.task, 20)
                engine.allow(1)
                await wait_for(lambda: model.generator.stats.requests_aborted == 1)
                assert model.generator.stats.running == 0
                engine.open()
                r = await client.post(
                    "/v1/chat/completions",
                    json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
                )
                assert r.status_code == 200, r.text
                text = expected(chat_text([{"role": "user", "content": "hi"}]), 3)
                assert r.json()["choices"][0]["message"]["content"] == text
        finally:
            engine.open()
            await model.generator.stop(drain=False)
