"""ReplicaClient: request bodies, and the verdict on every kind of answer (httpx.MockTransport)."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import numpy as np
import pytest

from batchline.driver.client import EMBEDDINGS, GENERATE, EmbeddingsRoute, ReplicaClient, Route
from tests.driver.fake import FakeReplica, fake_vectors

pytestmark = pytest.mark.anyio

URL = "http://replica:8000"
TEXTS = ["alpha", "beta", "gamma"]


@pytest.fixture
async def make_client() -> AsyncIterator[Callable[..., ReplicaClient]]:
    clients: list[ReplicaClient] = []

    def make(handler: Any, route: Route = EMBEDDINGS, **kwargs: Any) -> ReplicaClient:
        client = ReplicaClient(route, transport=httpx.MockTransport(handler), **kwargs)
        clients.append(client)
        return client

    yield make
    for c in clients:
        await c.aclose()


def reply_with(status: int, body: Any = None, headers: dict[str, str] | None = None) -> Any:
    def handler(request: httpx.Request) -> httpx.Response:
        # json.dumps writes NaN as Python does (httpx's json= refuses it): servers may too
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, headers=headers, content=content)

    return handler


def embeddings_body(vectors: list[Any], model: str = "m") -> dict[str, Any]:
    return {"data": [{"index": i, "embedding": v} for i, v in enumerate(vectors)], "model": model}


@pytest.mark.parametrize("encoding", ["base64", "float"])
async def test_vectors_come_back_in_request_order(
    make_client: Callable[..., ReplicaClient], encoding: str
) -> None:
    replica = FakeReplica()
    client = make_client(replica.handler, EmbeddingsRoute(encoding=encoding))  # type: ignore[arg-type]
    reply = await client.post(URL, TEXTS, task_id="0-2")
    assert reply.verdict == "ok"
    assert reply.results.dtype == np.float32
    np.testing.assert_array_equal(reply.results, fake_vectors(TEXTS))  # the fake reverses them
    assert client.dim == 8


async def test_the_request_body_and_headers(make_client: Callable[..., ReplicaClient]) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=embeddings_body([[1.0, 2.0]] * 2))

    client = make_client(handler, api_key="s3cret", model="mini")
    await client.post(URL, ["é", "\ud800 lone surrogate"], task_id="x")
    request = seen[0]
    assert request.url == URL + "/v1/embeddings"
    assert request.headers["authorization"] == "Bearer s3cret"
    assert request.headers["content-type"] == "application/json"
    assert request.headers["x-batchline-priority"] == "batch"  # drive is bulk traffic
    body = json.loads(request.content)
    assert body == {
        "input": ["é", "\ud800 lone surrogate"],
        "encoding_format": "base64",
        "model": "mini",
    }


async def test_generate_sends_prompts_and_a_task_id(
    make_client: Callable[..., ReplicaClient],
) -> None:
    replica = FakeReplica()
    seen: list[Any] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(json.loads(request.content))
        return await replica.handler(request)

    client = make_client(handler, GENERATE)
    reply = await client.post(URL, TEXTS, task_id="10-12")
    assert seen == [{"prompts": TEXTS, "task_id": "10-12", "chat": True}]
    assert reply.verdict == "ok"
    assert reply.results == fake_vectors(TEXTS).tolist()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (embeddings_body([[1.0]] * 2), "sent 3 texts, got 2 embeddings"),
        (
            {"data": [{"index": i % 2, "embedding": [1.0]} for i in range(3)]},
            "index 0 appears twice",
        ),
        ({"data": [{"index": i + 1, "embedding": [1.0]} for i in range(3)]}, "index 3 is not"),
        ({"data": [{"index": True, "embedding": [1.0]}] * 3}, "index True is not"),
        (embeddings_body([[1.0, 2.0], [1.0], [1.0, 2.0]]), "embedding 1 has 1 values"),
        (embeddings_body([[1.0, float("nan")]] * 3), "NaN"),
        (embeddings_body([["1.0", "2.0"]] * 3), "not a flat list of numbers"),
        (embeddings_body([[True, False]] * 3), "not a flat list of numbers"),
        (embeddings_body([[[1.0], [2.0]]] * 3), "not a flat list of numbers"),
        (embeddings_body([[]] * 3), "not a non-empty list"),
        (embeddings_body(["not base64!"] * 3), "not valid base64"),
        (embeddings_body([base64.b64encode(b"abc").decode()] * 3), "not float32"),
        ({"object": "list"}, "no 'data' list"),
        ([1, 2, 3], "not a JSON object"),
        (b"<html>oops</html>", "not JSON"),
    ],
)
async def test_a_wrong_answer_is_a_retryable_endpoint_fault_never_a_result(
    make_client: Callable[..., ReplicaClient], body: Any, message: str
) -> None:
    client = make_client(reply_with(200, body))
    reply = await client.post(URL, TEXTS, task_id="t")
    assert reply.verdict == "retry"
    assert reply.kind == "invalid_response"
    assert reply.endpoint_fault
    assert message in reply.message
    assert reply.results is None


async def test_the_dimension_and_model_are_pinned_by_the_first_answer(
    make_client: Callable[..., ReplicaClient],
) -> None:
    answers = [
        embeddings_body([[1.0, 2.0]] * 3, model="a"),
        embeddings_body([[1.0, 2.0, 3.0]] * 3, model="a"),
        embeddings_body([[1.0, 2.0]] * 3, model="b"),
        embeddings_body([[3.0, 4.0]] * 3, model="a"),
    ]

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answers.pop(0))

    client = make_client(handler)
    verdicts = [await client.post(URL, TEXTS, task_id="t") for _ in range(4)]
    assert [r.verdict for r in verdicts] == ["ok", "retry", "retry", "ok"]
    assert "earlier ones 2" in verdicts[1].message
    assert "different models" in verdicts[2].message


async def test_a_resumed_job_checks_against_the_dimension_already_written(
    make_client: Callable[..., ReplicaClient],
) -> None:
    client = make_client(reply_with(200, embeddings_body([[1.0, 2.0]] * 3)), dim=384)
    reply = await client.post(URL, TEXTS, task_id="t")
    assert reply.verdict == "retry"
    assert "earlier ones 384" in reply.message


async def test_generate_checks_the_count_and_nulls(
    make_client: Callable[..., ReplicaClient],
) -> None:
    short = make_client(reply_with(200, {"results": ["a", "b"]}), GENERATE)
    assert "got 2 results" in (await short.post(URL, TEXTS, task_id="t")).message
    null = make_client(reply_with(200, {"results": ["a", None, "c"]}), GENERATE)
    assert (await null.post(URL, TEXTS, task_id="t")).message == "a result is null"


@pytest.mark.parametrize(
    ("status", "verdict", "kind", "fault"),
    [
        (429, "retry", "http_429", False),
        (503, "retry", "http_503", True),
        (500, "retry", "http_5xx", True),
        (502, "retry", "http_5xx", True),
        (504, "retry", "http_5xx", True),
        (408, "retry", "http_4xx", True),
        (400, "fail", "client_error", False),
        (413, "fail", "client_error", False),
        (422, "fail", "client_error", False),
        (401, "abort", "misconfigured", False),
        (403, "abort", "misconfigured", False),
        (404, "abort", "misconfigured", False),
        (405, "abort", "misconfigured", False),
        (507, "abort", "misconfigured", False),  # a model that never fits the memory budget
        (302, "abort", "misconfigured", False),
    ],
)
async def test_each_status_gets_its_verdict(
    make_client: Callable[..., ReplicaClient], status: int, verdict: str, kind: str, fault: bool
) -> None:
    body = {"detail": "d", "error": {"message": f"server says {status}"}}
    client = make_client(reply_with(status, body, {"Retry-After": "2"}))
    reply = await client.post(URL, TEXTS, task_id="t")
    assert (reply.verdict, reply.kind, reply.endpoint_fault) == (verdict, kind, fault)
    assert reply.status == status
    assert reply.message == f"server says {status}"
    if verdict == "retry":
        assert reply.retry_after_s == 2.0


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"detail": "too many inputs"}, "too many inputs"),
        ({"detail": [{"loc": ["body", "input"], "msg": "bad"}]}, '[{"loc": ["body", "input"]'),
        (b"plain text error", "plain text error"),
        (b"", "Bad Request"),
    ],
)
async def test_the_server_s_message_is_kept(
    make_client: Callable[..., ReplicaClient], body: Any, message: str
) -> None:
    client = make_client(reply_with(400, body))
    reply = await client.post(URL, TEXTS, task_id="t")
    assert reply.message.startswith(message)


async def test_retry_after_as_a_date_uses_the_injected_wall_clock(
    make_client: Callable[..., ReplicaClient],
) -> None:
    client = make_client(
        reply_with(503, {}, {"Retry-After": "Thu, 01 Jan 1970 00:01:40 GMT"}), wall=lambda: 90.0
    )
    assert (await client.post(URL, TEXTS, task_id="t")).retry_after_s == 10.0


@pytest.mark.parametrize(
    ("exc", "kind"),
    [
        (httpx.ConnectError("refused"), "connect"),
        (httpx.ConnectTimeout("slow"), "connect"),
        (httpx.ReadTimeout("slow"), "timeout"),
        (httpx.WriteTimeout("slow"), "timeout"),
        (httpx.RemoteProtocolError("peer closed connection"), "network"),
        (httpx.ReadError("reset"), "network"),
    ],
)
async def test_network_trouble_is_a_retryable_endpoint_fault(
    make_client: Callable[..., ReplicaClient], exc: Exception, kind: str
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc

    client = make_client(handler)
    reply = await client.post(URL, TEXTS, task_id="t")
    assert (reply.verdict, reply.kind, reply.endpoint_fault) == ("retry", kind, True)
    assert reply.status is None


async def test_ready_is_true_only_for_200(make_client: Callable[..., ReplicaClient]) -> None:
    assert await make_client(reply_with(200, {})).ready(URL)
    assert not await make_client(reply_with(503, {})).ready(URL)

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused")

    assert not await make_client(refuse).ready(URL)
