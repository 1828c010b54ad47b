"""The Batch API beside live traffic: interactive latency while a batch runs, and the batch's
throughput against ``batchline run`` on the same file, ratios measured in one run.

One ``batchline serve`` (127.0.0.1, the default embedder, and with ``--chat-lines`` smollm2)
answers, in turn:

1. ``idle``: interactive ``/v1/embeddings`` requests (one short text each, closed loop,
   ``--concurrency`` clients on raw keep-alive sockets, never httpx: its client costs more
   CPU than the server) for ``--duration`` seconds;
2. ``batch alone``: an embeddings batch of ``--lines`` lines (uploaded, created, polled until
   ``completed``): its lines per second from creation to completion;
3. ``batch + live``: the same batch again with the interactive load running all along: the
   interactive p99 against ``idle``'s (goal <= 1.5x) and the batch's lines per second;
4. with ``--chat-lines N``: the same two for a chat batch of N lines on smollm2 (report only).

``batchline run`` answers the same files in this process, before the server starts and after
it stops (its pipeline's wall time and the time it takes to write the output file, as a batch
does; not its model load), and the batch's lines per second (from creation to completion) are
compared with the mean of the two (goal >= 0.85x). Points run one after
the other on the same server, so each ratio's two sides share the machine's state; rerun on a
quiet machine before quoting figures.

Usage::

    python benchmarks/bench_batch_api.py                            # 2,000 lines, 10 s idle
    python benchmarks/bench_batch_api.py --chat-lines 64            # and a smollm2 chat batch
    python benchmarks/bench_batch_api.py --lines 100 --duration 2   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from batchline.bench.stats import summarize

WORDS = [
    "the",
    "batch",
    "api",
    "runs",
    "beside",
    "live",
    "traffic",
    "at",
    "batch",
    "priority",
    "and",
    "every",
    "line",
    "once",
]


def texts(n: int, seed: int, lo: int = 8, hi: int = 48) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi))) for _ in range(n)]


def write_file(path: Path, n: int, *, chat: bool, max_tokens: int) -> Path:
    lines = []
    for i, text in enumerate(texts(n, seed=7 if chat else 3)):
        if chat:
            body: dict[str, Any] = {"model": "chat", "max_tokens": max_tokens, "temperature": 0,
                                    "messages": [{"role": "user", "content": text}]}  # fmt: skip
            url = "/v1/chat/completions"
        else:
            body, url = {"model": "emb", "input": text}, "/v1/embeddings"
        lines.append({"custom_id": f"line-{i}", "method": "POST", "url": url, "body": body})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    return path


RUN_MODEL = {"embed": "emb=default", "chat": "chat=smollm2"}


@contextlib.contextmanager
def started_serve(flags: list[str], work: Path, ready_s: float = 600.0) -> Iterator[int]:
    """``batchline serve FLAGS`` on a free 127.0.0.1 port, its data in ``work/data`` and its
    log in ``work/serve.log``, ready (or ``SystemExit`` when it exits or is not ready within
    ``ready_s``); its port, then SIGTERM and a wait for it to end."""
    port = free_port()
    with (work / "serve.log").open("wb") as log:
        server = subprocess.Popen(
            [sys.executable, "-m", "batchline", "serve", "--port", str(port), *flags,
             "--data-dir", str(work / "data")],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ},
        )  # fmt: skip
        try:
            deadline = time.monotonic() + ready_s
            while True:
                if server.poll() is not None:
                    raise SystemExit(f"serve exited: see {work / 'serve.log'}")
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise SystemExit(
                        f"serve not ready in {ready_s:.0f} s: see {work / 'serve.log'}"
                    )
                time.sleep(0.1)
            yield port
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=120)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Live:
    """Interactive load: closed loop on raw sockets, latencies kept while ``recording``."""

    def __init__(self, port: int, concurrency: int) -> None:
        self.port = port
        self.concurrency = concurrency
        self.latencies: list[float] = []
        self.errors = 0
        self._stop = asyncio.Event()
        body = [json.dumps({"model": "emb", "input": t}).encode() for t in texts(256, seed=11)]
        self.requests = [
            b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\n" + f"Content-Length: {len(b)}\r\n\r\n".encode() + b
            for b in body
        ]

    async def run(self) -> None:
        await asyncio.gather(*(self._client(k) for k in range(self.concurrency)))

    def stop(self) -> None:
        self._stop.set()

    async def _client(self, k: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        i = k * 7919
        try:
            while not self._stop.is_set():
                i += 1
                t0 = time.perf_counter()
                writer.write(self.requests[i % len(self.requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                self.latencies.append(time.perf_counter() - t0)
                if head[9:12] != b"200":
                    self.errors += 1
        finally:
            writer.close()


async def run_batch(client: httpx.AsyncClient, path: Path, endpoint: str) -> float:
    """Upload ``path``, run it as a batch; its lines per second from creation to completion."""
    data = await asyncio.to_thread(path.read_bytes)
    made = await client.post(
        "/v1/files", files={"file": (path.name, data)}, data={"purpose": "batch"}
    )
    made.raise_for_status()
    t0 = time.perf_counter()
    r = await client.post("/v1/batches", json={"input_file_id": made.json()["id"],
                                               "endpoint": endpoint})  # fmt: skip
    r.raise_for_status()
    batch = r.json()
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        await asyncio.sleep(0.1)
        batch = (await client.get(f"/v1/batches/{batch['id']}")).json()
    wall = time.perf_counter() - t0
    if batch["status"] != "completed" or batch["request_counts"]["failed"]:
        raise SystemExit(f"batch did not complete cleanly: {json.dumps(batch)}")
    return int(batch["request_counts"]["total"]) / wall


async def measure(port: int, args: argparse.Namespace, files: dict[str, Path]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=600) as client:
        live = Live(port, args.concurrency)
        task = asyncio.create_task(live.run())
        await asyncio.sleep(args.warmup)
        live.latencies.clear()
        await asyncio.sleep(args.duration)
        live.stop()
        await task
        out["idle"] = summarize(live.latencies)
        for kind, endpoint in (("embed", "/v1/embeddings"), ("chat", "/v1/chat/completions")):
            if kind not in files:
                continue
            out[f"{kind} alone"] = await run_batch(client, files[kind], endpoint)
            live = Live(port, args.concurrency)
            task = asyncio.create_task(live.run())
            out[f"{kind} + live"] = await run_batch(client, files[kind], endpoint)
            live.stop()
            await task
            out[f"{kind} live"] = summarize(live.latencies)
            out[f"{kind} live errors"] = live.errors
    return out


def run_job(path: Path, models: list[str], workdir: Path) -> float:
    """``batchline run`` on the batch file, in this process: lines per second over the same
    work a batch does (its pipeline, and writing its output file: the summary's wall time
    leaves that out, so it is timed again after the job), its model load left out."""
    from batchline.jobs.openai_batch import detect_batch, run_batch_job
    from batchline.jobs.options import GenerateOptions

    opts = GenerateOptions(
        input=path, output=workdir / f"{path.stem}.run.jsonl", models=tuple(models), overwrite=True
    )
    batch = detect_batch(opts)
    assert batch is not None
    summary = asyncio.run(run_batch_job(opts, batch))
    started = time.perf_counter()
    batch.write_output()
    return summary.total_records / (summary.wall_s + time.perf_counter() - started)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--lines", type=int, default=2000, help="lines of the embeddings batch")
    p.add_argument("--chat-lines", type=int, default=0, help="lines of a smollm2 chat batch")
    p.add_argument("--max-tokens", type=int, default=32, help="a chat line's max_tokens")
    p.add_argument("--duration", type=float, default=10.0, help="seconds of idle interactive load")
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--concurrency", type=int, default=2, help="interactive clients")
    p.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        help="one more argument for batchline serve (repeat), e.g. --serve-arg=--set=KEY=VALUE",
    )
    args = p.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="bench-batch-api-"))
    files = {"embed": write_file(work / "embed.jsonl", args.lines, chat=False, max_tokens=0)}
    models = ["emb=default"]
    if args.chat_lines:
        files["chat"] = write_file(
            work / "chat.jsonl", args.chat_lines, chat=True, max_tokens=args.max_tokens
        )
        models.append("chat=smollm2")
    # batchline run before the server and after it, the mean taken: the machine drifts
    before = {kind: run_job(path, [RUN_MODEL[kind]], work) for kind, path in files.items()}
    model_flags = [flag for m in models for flag in ("--model", m)]
    with started_serve([*model_flags, *args.serve_arg], work) as port:
        got = asyncio.run(measure(port, args, files))
    run_rate = {
        kind: (before[kind] + run_job(path, [RUN_MODEL[kind]], work)) / 2
        for kind, path in files.items()
    }

    idle = got["idle"]
    print(f"interactive idle: p50 {idle.p50_s * 1e3:.2f} ms  p99 {idle.p99_s * 1e3:.2f} ms  "
          f"({idle.count} requests, {args.concurrency} clients)")  # fmt: skip
    for kind in files:
        live = got[f"{kind} live"]
        ratio = live.p99_s / idle.p99_s
        print(f"{kind}: interactive during the batch p99 {live.p99_s * 1e3:.2f} ms = "
              f"{ratio:.2f}x idle (goal <= 1.5x)  errors {got[f'{kind} live errors']}")  # fmt: skip
        for label in ("alone", "+ live"):
            rate = got[f"{kind} {label}"]
            print(f"{kind}: batch {label} {rate:.1f} lines/s = {rate / run_rate[kind]:.2f}x "
                  f"batchline run's {run_rate[kind]:.1f} (goal >= 0.85x alone)")  # fmt: skip
    return 0


if __name__ == "__main__":
    if os.environ.get("BATCHLINE_CACHE_DIR") is None:
        print(
            "note: BATCHLINE_CACHE_DIR unset: models load from the default cache", file=sys.stderr
        )
    sys.exit(main())
