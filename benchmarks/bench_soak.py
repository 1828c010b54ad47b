"""A soak: one ``batchline serve`` under minutes of mixed traffic with faults.

One server on 127.0.0.1 serves three models under ``--memory-budget``: the default embedder
(``emb``, pinned), the built-in SmolLM2 (``chat``, pinned; CPU torch) and ``broken``, an ONNX
file cut short, so its load fails each time it is asked (on first use, as the budget makes
models load). For ``--duration`` seconds, all at once and every loop bounded:

* embeddings: ``--emb-clients`` closed-loop clients, 1-4 short texts a request; every 8th
  request is abandoned (the client gives up after 5-100 ms, before its answer);
* chat: ``--chat-clients`` clients, taking turns at four behaviours: read the whole stream (it
  must end with ``[DONE]`` and a ``finish_reason``), disconnect after a few chunks, read slowly
  (a pause between chunks), abandon a non-streamed answer after 0.1-1.5 s;
* ``batchline drive`` jobs (subprocesses, one after the other while time is left): a JSONL
  dataset of ``--drive-records`` short texts to ``/v1/embeddings``; each job's output must hold
  every input id exactly once;
* the failing model, every ``--broken-every`` seconds: each answer must be a 503 whose JSON
  error says the load failed and names the cause.

Then the clients pause and the server's in-flight gauges must all read 0 (requests, queued
records, batches, sequences, KV reservations: a count leaked by a disconnect would cost
capacity for good); they resume, and 2 s later comes SIGTERM, with requests and streams in
flight: each must complete or get a clean answer (a 503 with a JSON error once the drain has
begun; a refused connection, or a kept-alive one closed with the request unread, once the
server is going), and the server must exit 0 within its drain timeout.

Every ``--sample-every`` seconds the server's resident memory (``VmRSS``), open file descriptors
(``/proc/PID/fd``) and threads are sampled. Warm-up is the first 20 % of the run; the *early*
window is the first 3 samples after it, the *late* window the last 3 before SIGTERM. Goals
(printed pass/fail with the numbers): RSS growth, median late against median early, <= 5 %;
fds flat, max late - max early <= ``FD_SLACK`` (the fds of connections in flight move it by a
few; a leak of one per request grows it by hundreds). Invariants (exit 1 when one fails): no
unexplained 5xx (the server's access log is read: a 503 from ``broken`` or after the drain
began is explained, any other 5xx is not), no other unexpected answer or transport error, no
traceback in the server log, the gauges at 0 at rest, each drive exactly once, every full stream
complete, a clean drain.

The client is lean on purpose: ``batchline.bench.loadgen`` times a load point and reduces an
answer to ok/failed, while a soak classifies each answer (status, error body, how a stream ended)
and keeps its clients in flight across SIGTERM until the server is gone.

Usage::

    python benchmarks/bench_soak.py                              # 10 minutes
    python benchmarks/bench_soak.py --duration 40 --drive-records 300 --json soak.json
    python benchmarks/bench_soak.py --plot soak.png              # RSS and fds over time

Needs the ``server`` and ``generate`` extras and SmolLM2 pulled (``batchline models pull
smollm2``).

Measured (2026-11-28, the 2-core CPU shared with other work, the defaults; verbatim in
``benchmarks/soak.md``): RSS +0.55 % after warm-up (1912.5 -> 1923.0 MiB); fds 20 at start, 29
at most, 25 at the end; 160 of 4,586 answers 5xx, all explained (121 failed loads, 35 drain
refusals, 4 drive requests past ``request_timeout_s``, retried); 2,000 drive records exactly
once; in-flight gauges 0 at rest; SIGTERM with 5 requests in flight: all completed, exit 0
after 7.4 s. It found that a request sent on a kept-alive connection just as the drain ended
was cut unread by the shutdown (fixed: responses that end during the drain close their
connection).

Its clients are its own, not ``batchline.bench``'s load generator: each misbehaves on purpose
(gives up, disconnects, reads slowly), which a generator that measures throughput must not do.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

RSS_GOAL = 0.05  # growth after warm-up
FD_SLACK = 8  # fds: max late - max early
WARMUP_FRACTION = 0.2
WINDOW = 3  # samples in the early and late windows
PROMPTS = [
    "Tell me a short story about a lighthouse.",
    "What is the capital of France?",
    "List three uses for a paperclip.",
    "Explain what a queue is in one paragraph.",
    "Write a haiku about autumn.",
    "Why is the sky blue?",
]
# uvicorn's access log: 127.0.0.1:50012 - "POST /v1/embeddings HTTP/1.1" 503 Service Unavailable
ACCESS = re.compile(r'"(?P<method>[A-Z]+) (?P<path>\S+) HTTP/[\d.]+" (?P<status>\d{3})')
DRAINING = "draining before shutdown"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def corpus_texts(n: int, seed: int) -> list[str]:
    """``n`` short texts from the demo corpus (real docstring paragraphs)."""
    from batchline.datasets.corpus import demo_corpus_path

    texts = []
    for line in demo_corpus_path().read_text(encoding="utf-8").splitlines():
        text = json.loads(line)["text"]
        if 10 <= len(text) <= 400:
            texts.append(text)
    random.Random(seed).shuffle(texts)
    return [texts[i % len(texts)] for i in range(n)]


# -- the server and what is sampled from it ---------------------------------------------------


@dataclass
class Sample:
    t_s: float
    rss_bytes: int
    fds: int
    threads: int
    emb_ok: int
    chat_ok: int
    drive_records: int


def proc_sample(pid: int) -> tuple[int, int, int]:
    """RSS bytes, open fds and threads of process ``pid`` (from /proc)."""
    rss = threads = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            rss = int(line.split()[1]) * 1024
        elif line.startswith("Threads:"):
            threads = int(line.split()[1])
    return rss, len(os.listdir(f"/proc/{pid}/fd")), threads


class Server:
    """``batchline serve`` as a subprocess of this one (stopped by its PID)."""

    def __init__(self, folder: Path, drain_timeout_s: float) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = folder / "serve.log"
        broken = folder / "broken.onnx"
        broken.write_bytes(b"\x08\x07\x12\x04soak" + b"\x00" * 64)  # an ONNX file cut short
        self._log: IO[str] = open(self.log_path, "w", encoding="utf-8")  # noqa: SIM115
        self._started = time.monotonic()
        cmd = [
            sys.executable,
            "-m",
            "batchline",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--model",
            "emb=default",
            "--model",
            "chat=smollm2",
            "--model",
            f"broken={broken}",
            "--task",
            "broken=predict",
            "--memory-budget",
            "0.8",
            "--pin",
            "emb",
            "--pin",
            "chat",
            "--data-dir",
            str(folder / "batch-api"),
            "--log-level",
            "info",
            "--set",
            "access_log=true",
            "--set",
            f"drain_timeout_s={drain_timeout_s}",
        ]
        self.proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace"
        )
        # each line stamped with the seconds since the start (uvicorn's log has no clock)
        self._pump = threading.Thread(target=self._stamp, daemon=True)
        self._pump.start()

    def _stamp(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # ends when the server exits
            self._log.write(f"[{time.monotonic() - self._started:7.1f}] {line}")

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise SystemExit(f"the server exited at start:\n{self.tail()}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(self.url + "/ready").status_code == 200:
                        return
                time.sleep(0.5)
        self.kill()
        raise SystemExit(f"the server was not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, lines: int = 20) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)

    def close(self) -> None:
        self.kill()
        self._pump.join(10)
        self._log.close()


def read_access_log(text: str) -> dict[str, Any]:
    """5xx answers in the server's log, split explained (``broken``'s failed loads; 503 once the
    drain began) and unexplained; and its tracebacks."""
    draining = False
    explained: Counter[str] = Counter()
    unexplained: list[str] = []
    statuses: Counter[int] = Counter()
    for line in text.splitlines():
        if DRAINING in line:
            draining = True
        m = ACCESS.search(line)
        if m is None:
            continue
        status = int(m["status"])
        statuses[status] += 1
        if status < 500:
            continue
        if status == 503 and m["path"] == "/v2/models/broken/infer":
            explained["broken model load"] += 1
        elif status == 503 and draining:
            explained["draining"] += 1
        else:
            unexplained.append(line.strip())
    return {
        "requests": sum(statuses.values()),
        "by_status": {str(k): v for k, v in sorted(statuses.items())},
        "5xx_explained": dict(explained),
        "5xx_unexplained": unexplained,
        "tracebacks": text.count("Traceback (most recent call last)"),
    }


# -- the traffic --------------------------------------------------------------------------------


@dataclass
class Tally:
    """What one kind of traffic got. ``unexpected`` holds one line per answer that breaks an
    invariant (a status, a body, a stream's end)."""

    ok: int = 0
    disconnected: int = 0  # streams this side closed on purpose
    explained_5xx: int = 0
    refused_after_stop: int = 0  # connections refused once the server had closed
    # requests sent after SIGTERM on a kept-alive connection that the server closed unread as
    # it exited: HTTP/1.1 lets a server close an idle connection at any time (RFC 9112, 9.3.1);
    # the request was never read, so never run, and a client retries it on a new connection
    unread_after_stop: int = 0
    timeouts: int = 0  # 504s this side got (each one also unexpected)
    unexpected: list[str] = field(default_factory=list)

    def bad(self, what: str) -> None:
        if len(self.unexpected) < 50:
            self.unexpected.append(what)
        else:
            self.unexpected[-1] = f"... and more (last: {what})"


class Soak:
    def __init__(self, args: argparse.Namespace, server: Server, folder: Path) -> None:
        self.args = args
        self.server = server
        self.folder = folder
        self.started = time.monotonic()
        self.term_at: float | None = None  # when SIGTERM was sent
        self.stopped = asyncio.Event()  # the server has exited: clients stop
        self.going = asyncio.Event()  # cleared: clients pause (the quiet check before SIGTERM)
        self.going.set()
        self.busy = 0  # requests this side has in flight
        self.at_rest: dict[
            str, float | None
        ] = {}  # the server's in-flight gauges once traffic paused
        self.emb = Tally()
        self.chat = Tally()
        self.broken = Tally()
        self.drives: list[dict[str, Any]] = []
        self.drive_records = 0
        self.across_drain: Counter[str] = Counter()  # requests sent before SIGTERM, ended after
        self.samples: list[Sample] = []
        self.texts = corpus_texts(512, seed=1)

    def now(self) -> float:
        return time.monotonic() - self.started

    def note(self, sent: float, outcome: str) -> None:
        """How a request sent before SIGTERM and ended after it fared."""
        if self.term_at is not None and sent < self.term_at:
            self.across_drain[outcome] += 1

    def _answer_ok_or_drain(self, tally: Tally, what: str, status: int, body: bytes) -> bool:
        """Whether a non-200 answer is a clean drain refusal (503 with a JSON error, once
        SIGTERM was sent); otherwise it is recorded as unexpected."""
        if status == 503 and self.term_at is not None and _json_error(body):
            tally.explained_5xx += 1
            return True
        tally.timeouts += status == 504
        tally.bad(f"{what}: {status} {body[:200]!r}")
        return False

    def _transport_error(self, tally: Tally, what: str, exc: Exception, sent_at: float) -> None:
        self.note(sent_at, "transport error")
        if isinstance(exc, httpx.ConnectError) and self.term_at is not None:
            tally.refused_after_stop += 1  # the server closed its socket: expected after SIGTERM
            return
        unread = (httpx.ReadError, httpx.RemoteProtocolError)
        if isinstance(exc, unread) and self.term_at is not None and sent_at >= self.term_at:
            tally.unread_after_stop += 1
            return
        cut = " (sent before SIGTERM: cut by the drain)" if self.term_at is not None else ""
        if self.term_at is not None and sent_at >= self.term_at:
            cut = " (sent after SIGTERM)"
        tally.bad(f"{what}: {type(exc).__name__}: {exc}{cut}")

    async def _pause_if_gone(self) -> None:
        """After SIGTERM, a client whose request was refused waits a little, not in a hot loop."""
        if self.term_at is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), 0.2)

    async def emb_client(self, client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        turn = 0
        while not self.stopped.is_set():
            await self.going.wait()
            turn += 1
            # every 8th request is abandoned: the client gives up before its answer
            abandon = turn % 8 == 0 and self.term_at is None
            texts = rng.sample(self.texts, rng.randint(1, 4))
            sent = time.monotonic()
            self.busy += 1
            try:
                r = await client.post(
                    "/v1/embeddings",
                    json={"model": "emb", "input": texts},
                    timeout=rng.uniform(0.005, 0.1) if abandon else httpx.USE_CLIENT_DEFAULT,
                )
            except httpx.TimeoutException as exc:
                if abandon:
                    self.emb.disconnected += 1
                else:
                    self._transport_error(self.emb, "embeddings", exc, sent)
                continue
            except httpx.HTTPError as exc:
                self._transport_error(self.emb, "embeddings", exc, sent)
                await self._pause_if_gone()
                continue
            finally:
                self.busy -= 1
            if r.status_code == 200:
                data = r.json()["data"]
                if len(data) == len(texts) and all(d["embedding"] for d in data):
                    self.emb.ok += 1
                    self.note(sent, "completed")
                else:
                    self.emb.bad(f"embeddings: {len(data)} vectors for {len(texts)} texts")
            elif self._answer_ok_or_drain(self.emb, "embeddings", r.status_code, r.content):
                self.note(sent, "503 with a JSON error")
            else:
                await asyncio.sleep(0.1)
            await self._pause_if_gone()

    async def chat_client(self, client: httpx.AsyncClient, seed: int) -> None:
        rng = random.Random(seed)
        turn = seed
        while not self.stopped.is_set():
            await self.going.wait()
            behaviour = ("full", "disconnect", "slow", "abandon")[turn % 4]
            turn += 1
            if behaviour == "abandon" and self.term_at is not None:
                behaviour = "full"
            body = {
                "model": "chat",
                "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": 48 if behaviour == "disconnect" else self.args.max_tokens,
                "temperature": 0,
                "stream": True,
            }
            sent = time.monotonic()
            self.busy += 1
            try:
                if behaviour == "abandon":  # a non-streamed answer the client stops waiting for
                    body["stream"] = False
                    try:
                        r = await asyncio.wait_for(
                            client.post("/v1/chat/completions", json=body), rng.uniform(0.1, 1.5)
                        )
                    except TimeoutError:
                        self.chat.disconnected += 1
                        continue
                    if r.status_code == 200:
                        self.chat.ok += 1
                    else:
                        self._answer_ok_or_drain(
                            self.chat, "chat (abandon)", r.status_code, r.content
                        )
                    continue
                self.note(sent, await self._one_stream(client, body, behaviour, rng))
            except httpx.HTTPError as exc:
                self._transport_error(self.chat, f"chat ({behaviour})", exc, sent)
                await self._pause_if_gone()
            finally:
                self.busy -= 1

    async def _one_stream(
        self, client: httpx.AsyncClient, body: dict[str, Any], behaviour: str, rng: random.Random
    ) -> str:
        """One stream, read as ``behaviour`` says; returns how it ended."""
        what = f"chat ({behaviour})"
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                content = await r.aread()
                clean = self._answer_ok_or_drain(self.chat, what, r.status_code, content)
                await self._pause_if_gone()
                return "503 with a JSON error" if clean else f"answered {r.status_code}"
            chunks = 0
            finish = None
            done = False
            errored = False
            leave_after = rng.randint(1, 4)
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[6:]
                if payload == "[DONE]":
                    done = True
                    break
                event = json.loads(payload)
                if "error" in event:
                    errored = True
                    error = event["error"]
                    if self.term_at is not None and error.get("code") == 503:
                        self.chat.explained_5xx += 1  # cut at the drain timeout, with a reason
                    else:
                        self.chat.bad(f"{what}: error event {str(error)[:200]}")
                    continue
                chunks += 1
                finish = event["choices"][0].get("finish_reason") or finish
                if behaviour == "disconnect" and chunks >= leave_after:
                    self.chat.disconnected += 1
                    return "disconnected by the client"  # leaving the block closes it
                if behaviour == "slow":
                    await asyncio.sleep(self.args.slow_read_s)
            if done and finish in ("stop", "length"):
                self.chat.ok += 1
                return "completed"
            if done and errored:  # the event was counted, explained or not
                return "stream ended with an error event"
            self.chat.bad(f"{what}: stream ended without [DONE] and a finish_reason")
            return "stream cut"

    async def broken_client(self, client: httpx.AsyncClient) -> None:
        body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1, 2]}]}
        while not self.stopped.is_set():
            await self.going.wait()
            sent = time.monotonic()
            self.busy += 1
            try:
                r = await client.post("/v2/models/broken/infer", json=body)
            except httpx.HTTPError as exc:
                self._transport_error(self.broken, "broken", exc, sent)
            else:
                message = _json_error(r.content)
                if (
                    r.status_code == 503
                    and message
                    and "failed to load" in message
                    and "broken.onnx" in message
                ):
                    self.broken.explained_5xx += 1
                    self.broken.ok += 1
                    self.note(sent, "503 with a JSON error")
                elif self._answer_ok_or_drain(self.broken, "broken", r.status_code, r.content):
                    self.note(sent, "503 with a JSON error")
            finally:
                self.busy -= 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), self.args.broken_every)

    async def drive_loop(self) -> None:
        """``batchline drive`` jobs one after the other while one more fits in the run."""
        job = 0
        last_wall = 0.0
        while job == 0 or self.now() + 1.2 * last_wall < self.args.duration:
            result = await self.drive_job(job)
            self.drives.append(result)
            last_wall = result["wall_s"]
            job += 1

    async def drive_job(self, job: int) -> dict[str, Any]:
        n = self.args.drive_records
        src = self.folder / f"drive-{job}.jsonl"
        ids = [f"j{job}-r{i:05d}" for i in range(n)]
        texts = corpus_texts(n, seed=100 + job)
        src.write_text(
            "".join(
                json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts, strict=True)
            ),
            encoding="utf-8",
        )
        out = self.folder / f"drive-{job}.out"
        started = time.monotonic()
        log = os.open(self.folder / f"drive-{job}.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "batchline",
                "drive",
                str(src),
                "--endpoint",
                self.server.url,
                "--request-model",
                "emb",
                "--output-format",
                "jsonl",
                "--records-per-request",
                "16",
                "--concurrency",
                "4",
                "-o",
                str(out),
                "--overwrite",
                "--quiet",
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            try:
                code = await asyncio.wait_for(proc.wait(), self.args.drive_timeout_s)
            except TimeoutError:
                proc.kill()  # our own child, by its handle
                code = await proc.wait()
        finally:
            os.close(log)
        seen: Counter[str] = Counter()
        for part in sorted(out.glob("part-*.jsonl")):
            for line in part.read_text(encoding="utf-8").splitlines():
                row = json.loads(line)
                if row.get("embedding"):
                    seen[row["id"]] += 1
        want = set(ids)
        lost = sorted(want - set(seen))
        duplicated = sorted(i for i, c in seen.items() if c > 1)
        strangers = sorted(set(seen) - want)
        self.drive_records += sum(seen.values())
        return {
            "job": job,
            "records": n,
            "exit_code": code,
            "wall_s": round(time.monotonic() - started, 1),
            "written": sum(seen.values()),
            "lost": len(lost),
            "duplicated": len(duplicated),
            "unknown_ids": len(strangers),
            "examples": (lost + duplicated + strangers)[:5],
        }

    async def quiet_check(self, client: httpx.AsyncClient) -> None:
        """Pause the clients, let the server settle, and read its in-flight gauges: every one
        must be back to 0 (a request, batch, sequence or KV reservation still counted after all
        traffic ended is leaked accounting, which costs capacity for good). Then resume."""
        self.going.clear()
        for _ in range(int(10 * self.args.request_timeout_s)):  # the answers in flight
            if not self.busy:
                break
            await asyncio.sleep(0.1)
        for _ in range(20):  # the server sees the last disconnects a moment later
            await asyncio.sleep(0.5)
            r = await client.get("/metrics")
            self.at_rest = at_rest_gauges(r.text)
            if all(v == 0 for v in self.at_rest.values()):
                break
        self.going.set()
        await asyncio.sleep(2.0)  # requests in flight again when SIGTERM comes

    async def sampler(self) -> None:
        pid = self.server.proc.pid
        every = max(1, round(self.args.print_every / self.args.sample_every))
        while self.term_at is None:
            try:
                s = self.sample(pid)
            except (OSError, ValueError):
                return
            self.samples.append(s)
            if len(self.samples) % every == 1:
                print_row(s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopped.wait(), self.args.sample_every)

    def sample(self, pid: int) -> Sample:
        """The server's memory, fds and threads now, beside what the clients have had."""
        rss, fds, threads = proc_sample(pid)
        return Sample(
            round(self.now(), 1), rss, fds, threads, self.emb.ok, self.chat.ok, self.drive_records
        )

    async def run(self) -> dict[str, Any]:
        args = self.args
        limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
        timeout = httpx.Timeout(args.request_timeout_s, connect=5.0)
        async with httpx.AsyncClient(base_url=self.server.url, timeout=timeout, limits=limits) as c:
            clients = [
                *(asyncio.create_task(self.emb_client(c, i)) for i in range(args.emb_clients)),
                *(asyncio.create_task(self.chat_client(c, i)) for i in range(args.chat_clients)),
                asyncio.create_task(self.broken_client(c)),
            ]
            sampler = asyncio.create_task(self.sampler())
            drives = asyncio.create_task(self.drive_loop())
            await asyncio.sleep(args.duration)
            # the last drive finishes before the drain (its output is checked exactly once)
            await asyncio.wait_for(asyncio.shield(drives), args.drive_timeout_s + 10)
            await self.quiet_check(c)
            with contextlib.suppress(OSError, ValueError):
                self.samples.append(self.sample(self.server.proc.pid))
            self.term_at = time.monotonic()
            os.kill(self.server.proc.pid, signal.SIGTERM)
            await sampler
            code: int | None
            try:
                code = await asyncio.wait_for(
                    asyncio.to_thread(self.server.proc.wait), args.drain_timeout_s + 30
                )
            except TimeoutError:
                code = None
            drain_s = time.monotonic() - self.term_at
            self.stopped.set()
            _, pending = await asyncio.wait(clients, timeout=args.request_timeout_s + 5)
            for task in pending:
                task.cancel()
                self.chat.bad("a client still waiting after the server exited")
        return {
            "at_rest": self.at_rest,
            "in_flight_at_sigterm": dict(self.across_drain),
            "exit_code": code,
            "drain_s": round(drain_s, 1),
            "drain_timeout_s": args.drain_timeout_s,
        }


AT_REST = (
    "batchline_requests_in_flight",
    "batchline_http_requests_in_flight",
    "batchline_queue_depth",
    "batchline_batches_in_flight",
    "batchline_generation_running_sequences",
    "batchline_generation_waiting_sequences",
    'batchline_generation_kv_tokens{kind="reserved"',
)


def at_rest_gauges(metrics: str) -> dict[str, float | None]:
    """The series of :data:`AT_REST` in a ``/metrics`` text, summed over models (``None``: not
    exported): each must read 0 once traffic has ended."""
    out: dict[str, float | None] = dict.fromkeys(AT_REST)
    for line in metrics.splitlines():
        if line.startswith("#"):
            continue
        series, _, value = line.rpartition(" ")
        for name in AT_REST:
            base, _, label = name.partition("{")
            if series.split("{")[0] == base and label in series:
                out[name] = (out[name] or 0.0) + float(value)
    return out


def _json_error(body: bytes) -> str | None:
    """The message of a JSON error body (OpenAI's ``{"error": {"message"}}`` or the OIP's
    ``{"error": "..."}``), ``None`` for anything else."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if isinstance(error, dict):
        error = error.get("message")
    return error if isinstance(error, str) and error else None


# -- the report ---------------------------------------------------------------------------------


def print_row(s: Sample | None) -> None:
    if s is None:
        print(
            f"{'t (s)':>7} {'RSS MiB':>8} {'fds':>5} {'threads':>7} "
            f"{'emb ok':>7} {'chat ok':>7} {'drive rec':>9}"
        )
        return
    print(
        f"{s.t_s:7.1f} {s.rss_bytes / 2**20:8.1f} {s.fds:5d} {s.threads:7d} "
        f"{s.emb_ok:7d} {s.chat_ok:7d} {s.drive_records:9d}",
        flush=True,
    )


def memory_goals(samples: list[Sample], duration: float) -> dict[str, Any]:
    warm = [s for s in samples if s.t_s >= WARMUP_FRACTION * duration]
    if len(warm) < 2 * WINDOW:
        warm = samples[len(samples) // 5 :]
    early, late = warm[:WINDOW], warm[-WINDOW:]
    rss_early = statistics.median(s.rss_bytes for s in early)
    rss_late = statistics.median(s.rss_bytes for s in late)
    growth = (rss_late - rss_early) / rss_early
    fd_early, fd_late = max(s.fds for s in early), max(s.fds for s in late)
    return {
        "warmup_s": round(WARMUP_FRACTION * duration, 1),
        "rss_early_mib": round(rss_early / 2**20, 1),
        "rss_late_mib": round(rss_late / 2**20, 1),
        "rss_max_mib": round(max(s.rss_bytes for s in samples) / 2**20, 1),
        "rss_growth_pct": round(100 * growth, 2),
        "rss_pass": growth <= RSS_GOAL,
        "fds_start": samples[0].fds,
        "fds_early_max": fd_early,
        "fds_late_max": fd_late,
        "fds_end": samples[-1].fds,
        "fds_max": max(s.fds for s in samples),
        "fds_pass": fd_late - fd_early <= FD_SLACK,
    }


def plot(samples: list[Sample], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    t = [s.t_s for s in samples]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s.rss_bytes / 2**20 for s in samples], color="tab:blue")
    ax.set_xlabel("seconds")
    ax.set_ylabel("server RSS (MiB)", color="tab:blue")
    fds = ax.twinx()
    fds.plot(t, [s.fds for s in samples], color="tab:orange")
    fds.set_ylabel("open fds", color="tab:orange")
    ax.set_title("batchline serve under the soak")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of traffic")
    parser.add_argument("--emb-clients", type=int, default=2)
    parser.add_argument("--chat-clients", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=24, help="a chat stream's max_tokens")
    parser.add_argument("--slow-read-s", type=float, default=0.2, help="a slow reader's pause")
    parser.add_argument("--broken-every", type=float, default=5.0, help="seconds between asks")
    parser.add_argument("--drive-records", type=int, default=1000, help="records per drive job")
    parser.add_argument("--drive-timeout-s", type=float, default=600.0)
    parser.add_argument("--drain-timeout-s", type=float, default=30.0)
    parser.add_argument("--request-timeout-s", type=float, default=120.0)
    parser.add_argument("--start-timeout-s", type=float, default=300.0)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds")
    parser.add_argument("--print-every", type=float, default=30.0, help="seconds between rows")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--plot", type=Path, help="RSS and fds over time (needs matplotlib)")
    parser.add_argument("--keep", type=Path, help="keep the server's and drives' logs here")
    args = parser.parse_args(argv)
    if args.duration < 10:
        parser.error(f"--duration must be >= 10 s, got {args.duration}")

    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp:
        folder = args.keep or Path(tmp)
        folder.mkdir(parents=True, exist_ok=True)
        server = Server(folder, args.drain_timeout_s)
        try:
            server.wait_ready(args.start_timeout_s)
            print(
                f"soak: {args.duration:.0f} s against pid {server.proc.pid} ({server.url}): "
                f"{args.emb_clients} embedding clients, {args.chat_clients} chat clients "
                f"(full/disconnect/slow/abandon), drive jobs of {args.drive_records} records, the "
                f"failing model every {args.broken_every:g} s; SIGTERM at the end"
            )
            print_row(None)
            soak = Soak(args, server, folder)
            drain = asyncio.run(soak.run())
        finally:
            server.close()
        log = read_access_log(server.log_path.read_text(errors="replace"))
    return report(args, soak, drain, log)


DRIVE_TIMEOUT = "request timeout of a drive request (retried)"


def explain_drive_timeouts(log: dict[str, Any], own_timeouts: int, drive_ok: bool) -> None:
    """Move the 504s to ``/v1/embeddings`` in ``log`` from unexplained to explained when they
    were the drive's: this side's embedding clients got none (``own_timeouts``), and every
    drive job still wrote each record exactly once (it retried them). Under the soak's load a
    ``batch``-priority drive request waits the aging offset (10 s) behind the interactive
    clients plus its own backlog, and on a slowed, shared machine that can pass
    ``request_timeout_s`` (30 s)."""
    if own_timeouts or not drive_ok:
        return
    timeouts = [
        line
        for line in log["5xx_unexplained"]
        if '"POST /v1/embeddings ' in line and '" 504 ' in line
    ]
    if timeouts:
        log["5xx_unexplained"] = [x for x in log["5xx_unexplained"] if x not in timeouts]
        log["5xx_explained"][DRIVE_TIMEOUT] = len(timeouts)


def report(args: argparse.Namespace, soak: Soak, drain: dict[str, Any], log: dict[str, Any]) -> int:
    mem = memory_goals(soak.samples, args.duration)
    tallies = {"embeddings": soak.emb, "chat": soak.chat, "broken": soak.broken}
    drive_ok = bool(soak.drives) and all(
        d["exit_code"] == 0 and d["lost"] == d["duplicated"] == d["unknown_ids"] == 0
        for d in soak.drives
    )
    explain_drive_timeouts(log, soak.emb.timeouts, drive_ok)
    unexpected = [line for t in tallies.values() for line in t.unexpected]
    across = drain["in_flight_at_sigterm"]
    drain_clean = (
        drain["exit_code"] == 0
        and not across.get("transport error")
        and not across.get("stream cut")
        and drain["drain_s"] <= args.drain_timeout_s + 10
        and not any("SIGTERM" in line for line in unexpected)
    )
    invariants = {
        "no unexplained 5xx": not log["5xx_unexplained"],
        "no unexpected answer or transport error": not unexpected,
        "no traceback in the server log": log["tracebacks"] == 0,
        "in-flight gauges back to 0 at rest": bool(drain["at_rest"])
        and all(v == 0 for v in drain["at_rest"].values()),
        "failing model's errors explained": soak.broken.ok >= 1 and not soak.broken.unexpected,
        "drive exactly once": drive_ok,
        "drain clean": drain_clean,
    }
    lost = sum(d["lost"] for d in soak.drives)
    dup = sum(d["duplicated"] for d in soak.drives)
    five = sum(v for k, v in log["by_status"].items() if k.startswith("5"))
    print()
    print(f"summary ({args.duration:.0f} s, {len(soak.samples)} samples):")
    print(
        f"  RSS: {mem['rss_early_mib']} MiB after warm-up ({mem['warmup_s']} s) -> "
        f"{mem['rss_late_mib']} MiB at the end: growth {mem['rss_growth_pct']:+.2f} % "
        f"(goal <= {100 * RSS_GOAL:.0f} %): {'pass' if mem['rss_pass'] else 'FAIL'}; "
        f"max {mem['rss_max_mib']} MiB"
    )
    print(
        f"  fds: start {mem['fds_start']}, end {mem['fds_end']}, max {mem['fds_max']}; "
        f"max after warm-up {mem['fds_early_max']} -> max at the end {mem['fds_late_max']} "
        f"(goal: +{FD_SLACK} at most): {'pass' if mem['fds_pass'] else 'FAIL'}"
    )
    print(
        f"  server answers: {log['requests']} ({log['by_status']}); 5xx {five}: explained "
        f"{sum(log['5xx_explained'].values())} {log['5xx_explained']}, unexplained "
        f"{len(log['5xx_unexplained'])}; tracebacks in the log {log['tracebacks']}"
    )
    for name, t in tallies.items():
        print(
            f"  {name}: {t.ok} ok, {t.disconnected} disconnected on purpose, "
            f"{t.explained_5xx} explained 5xx, {t.refused_after_stop} refused after the stop, "
            f"{t.unread_after_stop} closed unread at the exit, "
            f"{len(t.unexpected)} unexpected"
        )
    print(
        f"  drive: {len(soak.drives)} job(s), {sum(d['written'] for d in soak.drives)} records "
        f"written of {sum(d['records'] for d in soak.drives)}; lost {lost}, duplicated {dup}"
        + "".join(
            f"\n    job {d['job']}: exit {d['exit_code']}, {d['written']}/{d['records']} in "
            f"{d['wall_s']} s, lost {d['lost']}, duplicated {d['duplicated']}"
            for d in soak.drives
        )
    )
    rest = {k: v for k, v in drain["at_rest"].items() if v != 0}
    print(
        "  at rest (traffic paused before SIGTERM): "
        + (f"not 0 (None: not exported) {rest}" if rest else "every in-flight gauge 0")
    )
    print(
        f"  drain: SIGTERM -> exit code {drain['exit_code']} after {drain['drain_s']} s "
        f"(drain timeout {args.drain_timeout_s:g} s): {'clean' if drain_clean else 'NOT CLEAN'}; "
        f"requests in flight at SIGTERM: {drain['in_flight_at_sigterm'] or 'none'}"
    )
    for line in [*log["5xx_unexplained"][:10], *unexpected[:20]]:
        print(f"    ! {line}")
    for name, ok in invariants.items():
        print(f"  {'pass' if ok else 'FAIL'}: {name}")
    passed = all(invariants.values())
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {
                    "duration_s": args.duration,
                    "samples": [asdict(s) for s in soak.samples],
                    "memory": mem,
                    "server_log": log,
                    "clients": {k: asdict(t) for k, t in tallies.items()},
                    "drives": soak.drives,
                    "drain": {**drain, "clean": drain_clean},
                    "invariants": invariants,
                    "passed": passed,
                },
                indent=2,
            )
        )
    if args.plot is not None:
        print(f"  plot: {args.plot}" if plot(soak.samples, args.plot) else "  (no matplotlib)")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
