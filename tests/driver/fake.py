"""A fake serving replica for the driver's tests: deterministic vectors, scripted misbehaviour.

In-process, ``FakeReplica.handler`` plugs into ``httpx.MockTransport``. As a real server on
127.0.0.1 (a subprocess the tests start and kill by PID)::

    python tests/driver/fake.py --port 8123 --script 429:1,429:1 --delay-s 0.01

``--script`` lists the statuses the first requests get, in order (``STATUS[:RETRY_AFTER]``;
``hang`` never answers); afterwards every request is served. ``GET /_log`` returns every
request seen: ``{"t": arrival (time.time()), "done": answer time, "n": texts, "status"}``.

It imports nothing from batchline, so it stands for any OpenAI-compatible server.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import threading
import time
import zlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

DIM = 8


def fake_vector(text: str, dim: int = DIM) -> np.ndarray:
    """The fake model: a pseudo-random unit vector seeded by the text."""
    rng = np.random.default_rng(zlib.crc32(text.encode("utf-8", "surrogatepass")))
    v = rng.standard_normal(dim).astype(np.float32)
    return v / np.float32(np.linalg.norm(v))


def fake_vectors(texts: Sequence[str], dim: int = DIM) -> np.ndarray:
    return np.stack([fake_vector(t, dim) for t in texts])


@dataclass
class Hit:
    t: float
    path: str
    n: int
    status: int = 0
    done: float = 0.0


@dataclass
class FakeReplica:
    """The replica's logic, shared by the in-process handler and the real server.

    ``script``: statuses for the first requests (``(status, retry_after)`` or ``"hang"``).
    ``poison``: a text containing it gets the whole request a 400.
    ``corrupt``: a scripted 200 whose body is wrong (``count``, ``index``, ``dim``, ``nan``).
    ``gate``: awaited before each request is answered (in-process only: a test's own condition
    in place of a delay, so that an order of events holds however loaded the machine is).
    """

    dim: int = DIM
    script: list[Any] = field(default_factory=list)
    poison: str | None = None
    delay_s: float = 0.0
    gate: Callable[[], Awaitable[None]] | None = None
    ready: bool = True
    model: str = "fake-model"
    hits: list[Hit] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def next_action(self) -> Any:
        with self._lock:
            return self.script.pop(0) if self.script else None

    def answer(self, path: str, body: Any) -> tuple[int, dict[str, str], Any]:
        if path == "/v1/embeddings":
            texts = body["input"] if isinstance(body["input"], list) else [body["input"]]
        else:
            texts = body["prompts"]
        action = self.next_action()
        if isinstance(action, tuple):
            status, retry_after = action
            headers = {"Retry-After": str(retry_after)} if retry_after is not None else {}
            message = f"scripted {status}"
            return status, headers, {"detail": message, "error": {"message": message}}
        if self.poison is not None and any(self.poison in t for t in texts):
            message = f"input contains {self.poison!r}"
            return 400, {}, {"detail": message, "error": {"message": message, "code": 400}}
        vectors = fake_vectors(texts, self.dim)
        if path == "/generate":
            out: Any = {"results": vectors.tolist(), "task_id": body.get("task_id")}
            if action == "count":
                out["results"] = out["results"][:-1]
            return 200, {}, out
        b64 = body.get("encoding_format") == "base64"
        data = [
            {
                "object": "embedding",
                "index": i,
                "embedding": base64.b64encode(v.astype("<f4").tobytes()).decode()
                if b64
                else v.tolist(),
            }
            for i, v in enumerate(vectors)
        ]
        data.reverse()  # order by "index", not by position: clients must sort
        if action == "count":
            data = data[1:]
        elif action == "index":
            data[0]["index"] = data[1]["index"] if len(data) > 1 else 7
        elif action == "dim":
            short = vectors[0][: self.dim - 1]
            data[-1]["embedding"] = (
                base64.b64encode(short.astype("<f4").tobytes()).decode() if b64 else short.tolist()
            )
        elif action == "nan":
            data[0]["embedding"] = [float("nan")] * self.dim
        return 200, {}, {"object": "list", "data": data, "model": self.model, "usage": {}}

    async def handle(self, method: str, path: str, raw: bytes) -> tuple[int, dict[str, str], Any]:
        if method == "GET" and path == "/ready":
            return (200 if self.ready else 503), {}, {"ready": self.ready}
        if method == "GET" and path == "/_log":
            return 200, {}, [h.__dict__ for h in self.hits]
        if method != "POST" or path not in ("/v1/embeddings", "/generate"):
            return 404, {}, {"detail": "Not Found"}
        hit = Hit(time.time(), path, 0)
        self.hits.append(hit)
        try:
            body = json.loads(raw)
            hit.n = len(body.get("input") or body.get("prompts") or [])
        except ValueError:
            return 422, {}, {"detail": "not JSON"}
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if self.gate is not None:
            await self.gate()
        if self.script and self.script[0] == "hang":
            self.next_action()
            await asyncio.sleep(3600)
        status, headers, out = self.answer(path, body)
        hit.status = status
        hit.done = time.time()
        return status, headers, out

    async def handler(self, request: Any) -> Any:
        """For ``httpx.MockTransport``."""
        import httpx

        status, headers, out = await self.handle(
            request.method, request.url.path, await request.aread()
        )
        content = json.dumps(out).encode()  # allows NaN, as a careless server would send it
        return httpx.Response(
            status, headers={"Content-Type": "application/json", **headers}, content=content
        )


def parse_script(text: str) -> list[Any]:
    actions: list[Any] = []
    for part in filter(None, text.split(",")):
        if part in ("hang", "count", "index", "dim", "nan"):
            actions.append(part)
            continue
        status, _, retry_after = part.partition(":")
        actions.append((int(status), retry_after or None))
    return actions


def build_app(replica: FakeReplica) -> Any:
    """A raw ASGI app around ``replica`` (no framework: it starts fast and stays out of the way)."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        status, headers, out = await replica.handle(scope["method"], scope["path"], raw)
        payload = json.dumps(out).encode()
        header_list = [(b"content-type", b"application/json")]
        header_list += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        await send({"type": "http.response.start", "status": status, "headers": header_list})
        await send({"type": "http.response.body", "body": payload})

    return app


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--dim", type=int, default=DIM)
    parser.add_argument("--script", default="")
    parser.add_argument("--poison")
    parser.add_argument("--delay-s", type=float, default=0.0)
    args = parser.parse_args()
    import uvicorn

    replica = FakeReplica(
        dim=args.dim, script=parse_script(args.script), poison=args.poison, delay_s=args.delay_s
    )
    uvicorn.run(build_app(replica), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
