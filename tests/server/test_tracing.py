"""OpenTelemetry traces from the server (``batchline.server.tracing``), on the fake models:
the span tree of a request, ``traceparent`` adopted, batch numbers shared by the requests of a
batch, generation's spans; and the decision from the ``OTEL_*`` variables
(``batchline._tracing``): off by default with nothing of OpenTelemetry imported, a one-line
error when the extra is missing."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

import httpx
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from batchline._commands import install_command
from batchline._errors import InputError
from batchline._tracing import tracing_for, tracing_from_env, tracing_requested
from batchline.server import create_app
from batchline.server.tracing import DECODE_EVERY

from .conftest import FakeEmbedder, client_on, fake_generator_loader, loader, settings, wait_for

pytestmark = pytest.mark.anyio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


@asynccontextmanager
async def traced(
    fake: FakeEmbedder | None = None, **overrides: Any
) -> AsyncIterator[tuple[Any, InMemorySpanExporter, Any]]:
    """The app on the fake embedder (and, with ``model=[...]``, the fake generator), its spans
    kept in memory."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    model = fake if fake is not None else FakeEmbedder()
    app = create_app(
        settings(**overrides),
        load_model=loader(model),
        load_generator=fake_generator_loader(),
        tracer_provider=provider,
    )
    try:
        async with client_on(app, release=model.gate.set) as client:
            yield client, exporter, app
    finally:
        provider.shutdown()


def by_name(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


def children(spans: tuple[ReadableSpan, ...], parent: ReadableSpan) -> list[ReadableSpan]:
    return [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]


async def test_an_embedding_request_has_a_batch_span_under_its_server_span() -> None:
    async with traced() as (client, exporter, _app):
        r = await client.post("/v1/embeddings", json={"input": "one two three", "model": "fake"})
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/embeddings")
    assert server.attributes is not None
    assert server.attributes["http.route"] == "/v1/embeddings"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["batchline.model"] == "fake"
    assert server.parent is None  # no traceparent: a new trace
    (batch,) = children(spans, server)
    assert batch.name == "batch"
    assert batch.attributes is not None
    assert batch.attributes["batchline.batch.size"] == 1
    assert batch.attributes["batchline.batch.cost"] == 5  # [CLS] one two three [SEP]
    assert batch.attributes["batchline.batch.padding"] == 0
    wait = batch.attributes["batchline.queue_wait_s"]
    assert isinstance(wait, float)
    assert wait >= 0
    # the model call lies within the request, its queue wait before it
    assert server.start_time is not None
    assert server.end_time is not None
    assert batch.start_time is not None
    assert batch.end_time is not None
    assert server.start_time <= batch.start_time - int(wait * 1e9) <= batch.start_time
    assert batch.start_time <= batch.end_time <= server.end_time


async def test_the_trace_of_an_incoming_traceparent_is_continued() -> None:
    header = f"00-{TRACE_ID}-{PARENT_ID}-01"
    async with traced() as (client, exporter, _app):
        r = await client.post(
            "/v1/embeddings", json={"input": "hi"}, headers={"traceparent": header}
        )
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/embeddings")
    assert f"{server.context.trace_id:032x}" == TRACE_ID
    assert server.parent is not None
    assert f"{server.parent.span_id:016x}" == PARENT_ID
    assert {f"{s.context.trace_id:032x}" for s in spans} == {TRACE_ID}


async def test_requests_that_share_a_batch_carry_its_id_and_size() -> None:
    fake = FakeEmbedder(gated=True)
    async with traced(fake) as (client, exporter, app):
        batcher = app.state.server.registry.get("fake").batcher
        first = asyncio.create_task(client.post("/v1/embeddings", json={"input": "a"}))
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)  # held on the gate
        others = [
            asyncio.create_task(client.post("/v1/embeddings", json={"input": t}))
            for t in ("b c", "d e f")
        ]
        await wait_for(lambda: batcher.queue_depth == 2)
        fake.gate.set()
        for r in await asyncio.gather(first, *others):
            assert r.status_code == 200
    batches = by_name(exporter.get_finished_spans(), "batch")
    assert len(batches) == 3  # one per request
    attrs = [dict(b.attributes or {}) for b in batches]
    ids = [a["batchline.batch.id"] for a in attrs]
    (pair,) = [a for a in attrs if ids.count(a["batchline.batch.id"]) == 2][:1]
    assert pair["batchline.batch.size"] == 2
    # padded cost: 2 rows x the longer (5 tokens), of which 1 is padding
    assert pair["batchline.batch.cost"] == 10
    assert pair["batchline.batch.padding"] == 1
    (alone,) = [a for a in attrs if ids.count(a["batchline.batch.id"]) == 1]
    assert alone["batchline.batch.size"] == 1


async def test_a_refused_request_is_traced_with_its_status() -> None:
    async with traced() as (client, exporter, _app):
        r = await client.post("/v1/embeddings", json={"input": "x", "model": "nope"})
        assert r.status_code == 404
    (server,) = by_name(exporter.get_finished_spans(), "POST /v1/embeddings")
    assert server.attributes is not None
    assert server.attributes["http.response.status_code"] == 404
    assert not children(exporter.get_finished_spans(), server)


async def test_a_generate_request_has_admission_prefill_and_decode_spans() -> None:
    both = {"model": ["fake=default", "gen=smollm2"], "model_name": None}
    async with traced(**both) as (client, exporter, _app):
        r = await client.post("/generate", json={"prompts": ["hello"], "max_tokens": 40})
        assert r.status_code == 200
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /generate")
    assert server.attributes is not None
    assert server.attributes["batchline.model"] == "gen"
    kids = {s.name: s for s in children(spans, server)}
    assert {"admission", "prefill", "decode"} <= set(kids)
    assert kids["decode"].attributes is not None
    assert kids["decode"].attributes["gen_ai.usage.output_tokens"] == 40
    assert kids["prefill"].attributes is not None
    assert kids["prefill"].attributes["gen_ai.usage.input_tokens"] == len(b"hello")
    assert kids["admission"].end_time == kids["prefill"].start_time
    assert kids["prefill"].end_time == kids["decode"].start_time
    # the engine's steps: its prefill, and one decode step in DECODE_EVERY (40 tokens: 2)
    steps = [s for s in children(spans, server) if s.name.endswith(("chunk", "step"))]
    assert [s.name for s in steps].count("prefill chunk") >= 1
    assert [s.name for s in steps].count("decode step") == 40 // DECODE_EVERY
    assert all(s.attributes and s.attributes["batchline.step.sequences"] == 1 for s in steps)


async def test_drive_and_the_server_share_one_trace_per_request(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """drive's client span is the parent of the server's span, through ``traceparent``."""
    from batchline.driver import drive as drive_module
    from batchline.driver.drive import DriveOptions, drive_job

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(drive_module, "tracing_from_env", lambda: tracing_for(provider))
    fake = FakeEmbedder()
    app = create_app(settings(), load_model=loader(fake), tracer_provider=provider)
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"text": f"text {i}"}) + "\n" for i in range(6)))
    options = DriveOptions(
        input=src, output=tmp_path / "out", endpoints=["http://127.0.0.1:8000"], chunk_size=3
    )
    try:
        async with app.router.lifespan_context(app):
            summary = await drive_job(options, transport=httpx.ASGITransport(app=app))
    finally:
        provider.shutdown()
    assert summary.records == 6
    spans = exporter.get_finished_spans()
    clients = {s.context.span_id: s for s in spans if s.kind is SpanKind.CLIENT}
    servers = by_name(spans, "POST /v1/embeddings")
    servers = [s for s in servers if s.kind is SpanKind.SERVER]
    assert len(clients) == len(servers) == 2
    for server in servers:
        assert server.parent is not None
        client = clients[server.parent.span_id]
        assert client.context.trace_id == server.context.trace_id
        assert [c.name for c in children(spans, server)] == ["batch"]


async def test_a_streamed_completion_is_traced_to_its_last_event() -> None:
    both = {"model": ["fake=default", "gen=smollm2"], "model_name": None}
    async with traced(**both) as (client, exporter, _app):
        body = {"model": "gen", "prompt": "hi", "max_tokens": 3, "stream": True}
        r = await client.post("/v1/completions", json=body)
        assert r.status_code == 200
        assert r.text.rstrip().endswith("data: [DONE]")
    spans = exporter.get_finished_spans()
    (server,) = by_name(spans, "POST /v1/completions")
    kids = {s.name: s for s in children(spans, server)}
    assert {"admission", "prefill", "decode"} <= set(kids)
    assert server.end_time is not None
    assert kids["decode"].end_time is not None
    assert kids["decode"].end_time <= server.end_time


def test_work_outside_a_traced_request_makes_no_spans() -> None:
    """The Batch API's lines run through the same served model, under no request span."""
    from batchline.server.batcher import Job
    from batchline.server.tracing import mark_batch, trace_jobs

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    jobs = [Job("item", 3, 0.0)]
    mark_batch(jobs, 0.5, [3], padded=True)
    trace_jobs(tracing_for(provider), jobs)
    provider.shutdown()
    assert exporter.get_finished_spans() == ()


# -- on or off --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("env", "on"),
    [
        ({}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "console,otlp"}, True),
        ({"OTEL_TRACES_EXPORTER": "none"}, False),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, False),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318"}, True),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, True),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "true"}, False),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_SDK_DISABLED": "false"}, True),
        ({"OTEL_SERVICE_NAME": "x"}, False),
    ],
)
def test_the_otel_variables_decide(env: dict[str, str], on: bool) -> None:
    assert tracing_requested(env) is on


def test_off_builds_nothing_and_on_builds_a_named_service() -> None:
    assert tracing_from_env({}) is None
    tracing = tracing_from_env({"OTEL_TRACES_EXPORTER": "console"})
    assert tracing is not None
    try:
        resource = tracing.provider.resource
        assert resource.attributes["service.name"] == "batchline"
    finally:
        tracing.shutdown()


def test_an_unknown_exporter_is_one_line_naming_the_known_ones() -> None:
    with pytest.raises(InputError, match=r"OTEL_TRACES_EXPORTER='nosuch'.*console, otlp"):
        tracing_from_env({"OTEL_TRACES_EXPORTER": "nosuch"})


def test_otlp_over_grpc_without_its_exporter_says_what_to_install() -> None:
    pytest.importorskip("opentelemetry.exporter.otlp.proto.http")
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        pass
    else:
        pytest.skip("the gRPC exporter is installed here")
    env = {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}
    with pytest.raises(InputError, match="opentelemetry-exporter-otlp-proto-grpc"):
        tracing_from_env(env)


_OFF = """
import json, os, sys
for k in [k for k in os.environ if k.startswith("OTEL_")]:
    del os.environ[k]
from batchline._tracing import tracing_from_env
assert tracing_from_env() is None
from batchline.driver.client import ReplicaClient, EMBEDDINGS
ReplicaClient(EMBEDDINGS)
from batchline.__main__ import main
try:
    main(["serve", "--help"])
except SystemExit:
    pass
before = sorted(m for m in sys.modules if m.startswith("opentelemetry"))
from batchline.server import create_app
from batchline.server.tracing import DECODE_EVERY
from batchline.server.settings import ServerSettings
app = create_app(ServerSettings.model_validate({"model_name": "f"}), load_model=lambda s, k: None)
after = sorted(m for m in sys.modules if m.startswith("opentelemetry.sdk"))
print(json.dumps([before, after]))
"""


def test_off_by_default_imports_nothing_of_opentelemetry() -> None:
    """Off: drive and every ``--help`` import nothing of OpenTelemetry, and the server nothing
    of its SDK (FastAPI >= 0.165 itself imports OpenTelemetry's API, which costs nothing)."""
    done = subprocess.run(
        [sys.executable, "-c", _OFF], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [[], []]


_MISSING = """
import json, sys
for name in ("opentelemetry.sdk", "opentelemetry.exporter"):  # the API comes with FastAPI
    sys.modules[name] = None
from batchline.__main__ import main
sys.exit(main(json.loads(sys.argv[1])))
"""


@pytest.mark.parametrize("command", ["serve", "drive"])
def test_tracing_asked_without_the_extra_is_one_line_naming_it(
    command: str, tmp_path: Path
) -> None:
    src = tmp_path / "in.txt"
    src.write_text("one\n")
    argv = {
        "serve": ["serve", "--model", "default", "--port", "0"],
        "drive": ["drive", str(src), "--endpoint", "http://127.0.0.1:9", "-o", str(tmp_path / "o")],
    }[command]
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = "http://127.0.0.1:4318"
    done = subprocess.run(
        [sys.executable, "-c", _MISSING, json.dumps(argv)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert install_command("trace") in lines[0]
    assert not (tmp_path / "o").exists()
