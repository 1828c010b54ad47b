"""The real thing: ``batchline serve`` in a subprocess on 127.0.0.1, the default model, the
``openai`` client, and SIGTERM with requests in flight."""

from __future__ import annotations

import base64
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Dynamic batching keeps the device busy.",
    "short",
    "A somewhat longer sentence about embeddings, servers, queues and the joy of "
    "measuring before deciding anything at all.",
]
MODEL = "all-MiniLM-L6-v2"


def _request(
    port: int, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        data = None if body is None else json.dumps(body).encode()
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=data, headers=hdrs)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


class Server:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc = proc
        self.port = port
        self.log = log

    def get(self, path: str, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return _request(self.port, "GET", path, **kw)

    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, dict[str, str], bytes]:
        return _request(self.port, "POST", path, body, **kw)

    def metric(self, name: str) -> float:
        _, _, text = self.get("/metrics")
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


@contextmanager
def run_server(*args: str, env: dict[str, str] | None = None) -> Iterator[Server]:
    """Start ``batchline serve`` on a free port; kill it by PID on the way out."""
    port = free_port()
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"batchline-serve-{port}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", "serve", "--port", str(port), *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
    server = Server(proc, port, log)
    try:
        for _ in range(1200):  # up to ~2 minutes: the first run builds the ONNX graph
            if proc.poll() is not None:
                raise AssertionError(f"server exited early:\n{log.read_text()}")
            try:
                status, _, _ = server.get("/ready")
            except OSError:
                status = 0
            if status == 200:
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"server never became ready:\n{log.read_text()}")
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        log.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def reference() -> np.ndarray[Any, Any]:
    from batchline.models import Embedder

    return Embedder.default(sessions=1).embed_sync(TEXTS)


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server() as s:
        yield s


def test_openai_client_gets_the_in_process_vectors(
    server: Server, reference: np.ndarray[Any, Any]
) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="any")
    try:
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]
        for fmt in ("float", "base64", None):
            kwargs: dict[str, Any] = {} if fmt is None else {"encoding_format": fmt}
            resp = client.embeddings.create(model=MODEL, input=TEXTS, **kwargs)
            if fmt == "base64":  # asked for explicitly, the client hands back the string
                rows = [np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in resp.data]
            else:  # "float", or left to the client (it asks for base64 and decodes it)
                rows = [np.asarray(d.embedding, dtype=np.float32) for d in resp.data]
            got = np.stack(rows)
            assert [d.index for d in resp.data] == list(range(len(TEXTS)))
            assert got.shape == (len(TEXTS), 384)
            assert np.allclose(got, reference, atol=1e-5)
            assert resp.usage.prompt_tokens > len(TEXTS)
        one = client.embeddings.create(model=MODEL, input=TEXTS[0])
        assert np.allclose(one.data[0].embedding, reference[0], atol=1e-5)
    finally:
        client.close()


def test_errors_over_real_http(server: Server) -> None:
    status, _, body = server.post("/generate", {"prompts": TEXTS, "task_id": "x"})
    assert status == 400
    assert json.loads(body)["error"]["message"] == (
        f"no model served here does generate; models: {MODEL} (embed)"
    )
    status, _, body = server.post("/v1/embeddings", {"input": []})
    assert status == 400
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    try:
        raw = b'{"input": [NaN, "\\ud800"]}'
        conn.request(
            "POST", "/v1/embeddings", body=raw, headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        assert resp.status == 422
        resp.read()
    finally:
        conn.close()
    assert server.get("/health")[0] == 200
    assert server.metric("batchline_records_total") >= len(TEXTS)


def _open_partial(port: int, path: str, body: bytes, headers: str = "") -> socket.socket:
    """A request whose body is half sent: in flight until the rest follows."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=60)
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{headers}\r\n"
    ).encode()
    sock.sendall(head + body[: len(body) // 2])
    return sock


def _finish(sock: socket.socket, body: bytes) -> tuple[int, bytes]:
    sock.sendall(body[len(body) // 2 :])
    chunks = []
    while True:
        chunk = sock.recv(65536)
        if not chunk:
            break
        chunks.append(chunk)
        data = b"".join(chunks)
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep:
            length = next(
                int(line.split(b":", 1)[1])
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
            if len(rest) >= length:
                sock.close()
                return int(head.split(b" ", 2)[1]), rest[:length]
    sock.close()
    raise AssertionError(f"connection closed early: {b''.join(chunks)!r}")


def _until(done: Callable[[], object], what: str) -> None:
    """Poll ``done`` for 30 s at most; ``what`` is the failure's message."""
    for _ in range(600):
        if done():
            return
        time.sleep(0.05)
    raise AssertionError(what)


def test_a_response_ending_during_the_drain_closes_its_connection() -> None:
    """A client whose request ends during the drain must not send the next one on that
    connection: when that one came last, the shutdown closed the connection with it unread, a
    reset instead of an answer (found by benchmarks/bench_soak.py)."""
    with run_server() as server:
        body = json.dumps({"input": TEXTS}).encode()
        sock = _open_partial(server.port, "/v1/embeddings", body)
        in_flight = "batchline_http_requests_in_flight"
        _until(lambda: server.metric(in_flight) == 1, "the request never arrived")
        server.proc.send_signal(signal.SIGTERM)
        _until(lambda: server.get("/ready")[0] == 503, "/ready never turned false")
        sock.sendall(body[len(body) // 2 :])
        chunks = []
        for _ in range(10_000):  # to the end of the stream: the server closes it
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
        sock.close()
        head = b"".join(chunks).partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 200"), head
        assert b"connection: close" in head.split(b"\r\n")
        assert server.proc.wait(timeout=60) == 0


def test_sigterm_drains_in_flight_requests_and_exits_0(reference: np.ndarray[Any, Any]) -> None:
    key = "k-" + os.urandom(8).hex()
    auth = {"Authorization": f"Bearer {key}"}
    with run_server(env={"BATCHLINE_API_KEY": key}) as server:
        assert server.post("/v1/embeddings", {"input": "x"})[0] == 401
        assert server.post("/v1/embeddings", {"input": "x"}, headers=auth)[0] == 200

        embed_body = json.dumps({"input": TEXTS}).encode()
        pair_body = json.dumps({"input": TEXTS[:2]}).encode()
        auth_line = f"Authorization: Bearer {key}\r\n"
        a = _open_partial(server.port, "/v1/embeddings", embed_body, auth_line)
        b = _open_partial(server.port, "/v1/embeddings", pair_body, auth_line)
        in_flight = "batchline_http_requests_in_flight"
        _until(lambda: server.metric(in_flight) == 2, "the two requests never arrived")

        server.proc.send_signal(signal.SIGTERM)
        _until(lambda: server.get("/ready")[0] == 503, "/ready never turned false")
        status, headers, _ = server.post("/v1/embeddings", {"input": "late"}, headers=auth)
        assert status == 503
        assert "retry-after" in headers

        status, body = _finish(a, embed_body)
        assert status == 200
        got = np.array([d["embedding"] for d in json.loads(body)["data"]], dtype=np.float32)
        assert np.allclose(got, reference, atol=1e-5)
        status, body = _finish(b, pair_body)
        assert status == 200
        assert len(json.loads(body)["data"]) == 2

        assert server.proc.wait(timeout=60) == 0
        log = server.log.read_text()
        assert key not in log
        assert "draining" in log
