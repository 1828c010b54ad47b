"""What OpenTelemetry tracing costs ``batchline serve``: the same server with tracing off and on,
interleaved, in one run; prints the throughput ratio (goal: on >= 0.97x off at c=32).

Two servers run side by side on 127.0.0.1 (the idle one costs nothing), each this file's
``--server-worker`` mode: the default embedder behind ``batchline.server.serve``, one with no
tracing (as ``batchline serve`` is without ``OTEL_*`` variables) and one tracing every request
(the SDK's ``TracerProvider``, its default always-on sampler, and a ``BatchSpanProcessor``, as
``OTEL_TRACES_EXPORTER=otlp`` builds, in front of an exporter that only counts the spans: what
the OTLP exporter would add, protobuf and HTTP on the processor's thread, is not measured). The
load is bench_serve's: OpenAI-style ``/v1/embeddings`` requests of one short text (8-24
tokens), closed loop at ``--concurrency``, from ``wrk`` or bench_serve's raw-socket client in a
separate process. Off and on alternate, the order flipped each repeat, so drift on a shared
machine hits both; the ratio is of the medians. It also prints the server's CPU per request
off and on: on a machine shared with other work, req/s follows the neighbours, CPU per
request much less.

Usage::

    python benchmarks/bench_tracing.py                                  # c=32, 5 x 10 s each
    python benchmarks/bench_tracing.py --duration 5 --repeats 3 --concurrency 32
    python benchmarks/bench_tracing.py --micro      # tracing's own CPU per request, in-process

Measured: see docs/serving.md ("Traces").
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import (
    WRK_LUA,
    Point,
    Server,
    bodies,
    make_texts,
    measure,
)

GOAL = 0.97
MODES = ("off", "on")


class WorkerServer(Server):
    """A server started as this file's ``--server-worker MODE`` (tracing configured in it)."""

    def command(self, workdir: Path) -> list[str]:
        stats = workdir / f"{self.name}.json"
        return [sys.executable, __file__, "--server-worker", self.name, str(self.port), str(stats)]

    def environment(self) -> dict[str, str] | None:
        # tracing is configured in the worker itself, never by the caller's OTEL_* variables
        return {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}


def serve_worker(mode: str, port: int, stats_file: Path) -> int:
    """``serve`` the default embedder on ``port``; ``on``: tracing every request. On the way
    out, ``stats_file`` gets the spans exported and the garbage collector's passes and time
    (each span allocates a few dozen objects: the collector runs more often over the heap)."""
    import gc
    import json

    from batchline.server import ServerSettings
    from batchline.server.runner import serve

    collector = {"seconds": 0.0, "passes": 0, "full": 0, "started": 0.0}

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collector["started"] = time.perf_counter()
            return
        collector["seconds"] += time.perf_counter() - collector["started"]
        collector["passes"] += 1
        collector["full"] += info["generation"] == 2

    gc.callbacks.append(on_gc)

    provider: Any = None
    counter: Any = None
    if mode == "on":
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import (
            BatchSpanProcessor,
            SpanExporter,
            SpanExportResult,
        )

        class Counting(SpanExporter):
            """Takes every span, keeps only the count (memory stays flat over a long run)."""

            def __init__(self) -> None:
                self.spans = 0

            def export(self, spans: Any) -> SpanExportResult:
                self.spans += len(spans)
                return SpanExportResult.SUCCESS

        counter = Counting()
        provider = TracerProvider()
        provider.add_span_processor(BatchSpanProcessor(counter))
    settings = ServerSettings.build(port=port, log_level="warning")
    code = serve(settings, tracer_provider=provider)
    if provider is not None:
        provider.shutdown()
    collector.pop("started")
    stats_file.write_text(json.dumps({"spans": counter.spans if counter else 0, **collector}))
    return code


def micro(rounds: int, requests: int) -> int:
    """``--micro``: what tracing adds to one request's CPU, in-process and without a model: the
    server's ASGI middleware and a batch model's ``batch`` span around a stub app, against the
    stub alone, interleaved (``time.process_time``, so the exporter thread's work counts)."""
    import asyncio

    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

    from batchline._tracing import tracing_for
    from batchline.server.batcher import Job
    from batchline.server.tracing import TraceRequests, mark_batch, trace_jobs

    class Drop(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Drop()))
    tracing = tracing_for(provider)

    def stub(traced: bool) -> Any:
        async def app(scope: Any, receive: Any, send: Any) -> None:
            await send({"type": "http.response.start", "status": 200, "headers": []})
            jobs = [Job("text", 16, time.perf_counter())]
            mark_batch(jobs, time.perf_counter(), [16], padded=True)  # what the Metering hook does
            if traced:
                trace_jobs(tracing, jobs)
            await send({"type": "http.response.body", "body": b"{}"})

        return app

    apps = {
        "off": stub(False),
        "server span": TraceRequests(stub(False), tracing),
        "on": TraceRequests(stub(True), tracing),
    }
    headers = [(b"host", b"127.0.0.1:8000"), (b"content-type", b"application/json")]

    async def send(message: Any) -> None:
        pass

    async def receive() -> Any:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def run(app: Any) -> None:
        for _ in range(requests):
            scope = {"type": "http", "method": "POST", "path": "/v1/embeddings"}
            await app({**scope, "headers": headers}, receive, send)

    cpu: dict[str, list[float]] = {mode: [] for mode in apps}
    for _ in range(rounds):
        for mode, app in apps.items():
            started = time.process_time()
            asyncio.run(run(app))
            cpu[mode].append((time.process_time() - started) / requests * 1e6)
    provider.shutdown()
    off, server, on = (statistics.median(cpu[m]) for m in apps)
    print(
        f"# tracing's CPU per request (median of {rounds} x {requests}): off {off:.0f} us, "
        f"the server span alone {server:.0f} us, on (with the batch span) {on:.0f} us: "
        f"+{on - off:.0f} us, {100 * (on - off) / 4600:.1f}% of the ~4.6 ms a short embedding "
        "request costs the 2-core machine at c=32"
    )
    return 0


def _read_stats(path: Path) -> dict[str, Any]:
    import json

    return dict(json.loads(path.read_text())) if path.exists() else {}


def cpu_ms(point: Point) -> float:
    """The server's CPU per request, in ms."""
    return point.server_cpu / point.rps * 1e3 if point.rps else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per point")
    p.add_argument("--repeats", type=int, default=5, help="points per mode (median kept)")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--loadgen", choices=["auto", "wrk", "asyncio"], default="auto")
    p.add_argument(
        "--micro",
        action="store_true",
        help="only tracing's own CPU per request, in-process, without a model or HTTP",
    )
    p.add_argument("--server-worker", nargs=3, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.micro:
        return micro(rounds=max(5, args.repeats), requests=2000)
    if args.server_worker:
        mode, port, spans = args.server_worker
        return serve_worker(mode, int(port), Path(spans))

    use_wrk = args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk"))
    workdir = Path(tempfile.mkdtemp(prefix="bench-tracing-"))
    body_file = workdir / "short.jsonl"
    texts = make_texts(1000, 8, 24, seed=1)
    body_file.write_bytes(b"\n".join(bodies(texts, "all-MiniLM-L6-v2")) + b"\n")
    lua = None
    if use_wrk:
        lua = workdir / "bench.lua"
        lua.write_text(WRK_LUA)
    print(
        f"# bench_tracing: {os.cpu_count()} CPUs, loadgen={'wrk' if use_wrk else 'asyncio'}, "
        f"c={args.concurrency}, {args.duration:g}s/point, repeats={args.repeats}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    servers = {mode: WorkerServer(mode, [], None) for mode in MODES}
    points: dict[str, list[Point]] = {mode: [] for mode in MODES}
    served: dict[str, float] = {}  # requests each server answered, warm-ups included
    try:
        for s in servers.values():
            s.start(workdir)
        for r in range(args.repeats):
            for mode in MODES if r % 2 == 0 else MODES[::-1]:
                point = measure(
                    servers[mode],
                    args.concurrency,
                    args.duration,
                    args.warmup,
                    body_file,
                    lua,
                    None,
                )
                points[mode].append(point)
                print(
                    f"repeat {r + 1} tracing {mode:3}: {point.rps:7.1f} req/s  "
                    f"p50 {point.p50_ms:6.2f} ms  p99 {point.p99_ms:6.2f} ms  "
                    f"server {point.server_cpu:.2f} cores = {cpu_ms(point):.2f} ms/req  "
                    f"background {point.background:.2f}  errors {point.errors}",
                    flush=True,
                )
        served = {
            m: s.metric("batchline_request_duration_seconds_count") for m, s in servers.items()
        }
    finally:
        for s in servers.values():
            s.stop()
    stats = {m: _read_stats(workdir / f"{m}.json") for m in MODES}
    spans = stats["on"].get("spans", 0)
    for mode in MODES:
        st, n = stats[mode], served.get(mode, 0.0)
        if st and n:
            print(
                f"# tracing {mode:3}: {n:.0f} requests served; the collector: "
                f"{st['passes'] / n:.2f} passes and {st['seconds'] / n * 1e6:.0f} us per request, "
                f"{st['full']} full passes in all"
            )
    off = statistics.median(p.rps for p in points["off"])
    on = statistics.median(p.rps for p in points["on"])
    ratio = on / off if off else 0.0
    per_repeat = [a.rps / b.rps for a, b in zip(points["on"], points["off"], strict=True) if b.rps]
    print(f"# spans exported by the traced server: {spans}")
    # On a busy machine req/s follows the neighbours; the server's CPU per request much less:
    # its ratio says what the same CPU-bound server would lose (1 = nothing).
    cpu_off = statistics.median(cpu_ms(p) for p in points["off"])
    cpu_on = statistics.median(cpu_ms(p) for p in points["on"])
    print(
        f"# median server CPU per request: off {cpu_off:.2f} ms, on {cpu_on:.2f} ms "
        f"(+{(cpu_on - cpu_off) * 1e3:.0f} us); CPU-bound estimate of on/off = "
        f"{cpu_off / cpu_on if cpu_on else 0.0:.3f}"
    )
    print(
        f"# median req/s: off {off:.1f}, on {on:.1f}; on/off = {ratio:.3f} "
        f"(per repeat {', '.join(f'{x:.3f}' for x in per_repeat)}); goal >= {GOAL}: "
        f"{'met' if ratio >= GOAL else 'NOT met'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
