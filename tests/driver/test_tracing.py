"""``drive`` with tracing on: each attempt is a client span whose context goes to the server in
``traceparent`` (W3C); with tracing off nothing is added to the request."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from batchline._tracing import Tracing, tracing_for
from batchline.driver import drive as drive_module
from batchline.driver.client import EMBEDDINGS, ReplicaClient
from batchline.driver.drive import DriveOptions, drive_job
from tests.driver.fake import FakeReplica

pytestmark = pytest.mark.anyio

URL = "http://replica:8000"


@pytest.fixture
def spans() -> Iterator[tuple[Tracing, InMemorySpanExporter]]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield tracing_for(provider), exporter
    provider.shutdown()


class Capture:
    """A fake replica that keeps every request's headers."""

    def __init__(self, status: int = 200) -> None:
        self.replica = FakeReplica()
        self.headers: list[httpx.Headers] = []
        self.status = status

    async def handler(self, request: httpx.Request) -> httpx.Response:
        self.headers.append(request.headers)
        if self.status != 200:
            return httpx.Response(self.status, json={"error": {"message": "busy"}})
        return await self.replica.handler(request)


def ids_of(traceparent: str) -> tuple[str, str]:
    version, trace_id, span_id, flags = traceparent.split("-")
    assert version == "00"
    assert int(flags, 16) & 1  # sampled
    return trace_id, span_id


async def test_an_attempt_is_a_client_span_sent_as_traceparent(
    spans: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = spans
    capture = Capture()
    client = ReplicaClient(
        EMBEDDINGS, transport=httpx.MockTransport(capture.handler), tracing=tracing
    )
    try:
        reply = await client.post(URL, ["a", "b", "c"], task_id="0-3")
    finally:
        await client.aclose()
    assert reply.verdict == "ok"
    (span,) = exporter.get_finished_spans()
    assert span.name == "POST /v1/embeddings"
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 200
    assert span.attributes["batchline.records"] == 3
    assert span.attributes["batchline.task_id"] == "0-3"
    trace_id, span_id = ids_of(capture.headers[0]["traceparent"])
    assert trace_id == f"{span.context.trace_id:032x}"
    assert span_id == f"{span.context.span_id:016x}"


async def test_a_failed_attempt_is_an_error_span(
    spans: tuple[Tracing, InMemorySpanExporter],
) -> None:
    tracing, exporter = spans
    capture = Capture(status=503)
    client = ReplicaClient(
        EMBEDDINGS, transport=httpx.MockTransport(capture.handler), tracing=tracing
    )
    try:
        reply = await client.post(URL, ["a"], task_id="0-1")
    finally:
        await client.aclose()
    assert reply.verdict == "retry"
    (span,) = exporter.get_finished_spans()
    assert span.attributes is not None
    assert span.attributes["http.response.status_code"] == 503
    assert span.attributes["error.type"] == "http_503"
    assert not span.status.is_ok


async def test_without_tracing_no_traceparent_is_sent() -> None:
    capture = Capture()
    client = ReplicaClient(EMBEDDINGS, transport=httpx.MockTransport(capture.handler))
    try:
        assert (await client.post(URL, ["a"], task_id="0-1")).verdict == "ok"
    finally:
        await client.aclose()
    assert "traceparent" not in capture.headers[0]


async def test_drive_sends_each_request_in_its_own_trace(
    spans: tuple[Tracing, InMemorySpanExporter],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tracing, exporter = spans
    monkeypatch.setattr(drive_module, "tracing_from_env", lambda: tracing)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"record {i}"}) + "\n" for i in range(25)))
    capture = Capture()
    options = DriveOptions(
        input=src, output=tmp_path / "out", endpoints=[URL], chunk_size=10, concurrency=2
    )
    summary = await drive_job(options, transport=httpx.MockTransport(capture.handler))
    assert summary.records == 25
    posts = [h for h in capture.headers if "traceparent" in h]
    assert len(posts) == 3  # 10 + 10 + 5 records
    sent = {ids_of(h["traceparent"]) for h in posts}
    finished = exporter.get_finished_spans()
    assert {(f"{s.context.trace_id:032x}", f"{s.context.span_id:016x}") for s in finished} == sent
    assert len({trace_id for trace_id, _ in sent}) == 3
