"""``batchline serve`` classifying images over HTTP against a plain FastAPI app, in one run.

32 clients (closed loop), each request one ~100 KB JPEG as a data URI in infinity's shape
(``{"input": [uri], "modality": "image"}`` to ``POST /v1/classify``), against the image
classifier of the image benchmark (a ViT-S/16-shaped folder with random weights):

(a) batchline    ``batchline serve --model MODEL/``: pictures decoded in two worker processes,
                 batched across requests by the model's one batcher; the model in the
                 precision ``auto`` chooses (bf16 on torch on a host with native bf16 where it
                 passes the gate, measured once and cached; fp32 on ONNX Runtime elsewhere),
                 said in the lines ``batchline serve:`` the run prints (``WORKDIR/serve.log``);
(b) baseline     a plain FastAPI app: the same converted ONNX graph behind one shared ONNX
                 Runtime session (2 threads), each request decoded with Pillow and run alone
                 in FastAPI's thread pool (the same preprocessing, ``ImagePreprocess``).

The load generator is this file's ``--loadgen`` mode in its own process: raw keep-alive
sockets, never httpx (it saturates a core before the server does: docs FACTS). Points of the
two servers alternate, so drift on a shared machine hits both. Goals: rps >= x1.5 the
baseline's, p99 <= the baseline's.

Usage::

    python benchmarks/bench_images_serve.py              # full: 20 s a point, 3 repeats
    python benchmarks/bench_images_serve.py --duration 2 --repeats 1 --clients 4   # smoke

Needs ``batchline[server,jobs]``, torch and transformers (the model's conversion, once).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from starlette.requests import Request  # at the top: FastAPI resolves the route's annotations

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from bench_images_peers import converted_graph, make_model


def make_bodies(count: int, seed: int) -> list[bytes]:
    """``count`` request bodies, each one 640 x 480 JPEG of ~100 KB as a data URI."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    out: list[bytes] = []
    for _ in range(count):
        field = Image.fromarray(rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)).resize(
            (640, 480), Image.Resampling.BICUBIC
        )
        noise = rng.integers(-14, 15, (480, 640, 1), dtype=np.int16)
        pixels = np.clip(np.asarray(field, np.int16) + noise, 0, 255).astype(np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="JPEG", quality=88)
        uri = "data:image/jpeg;base64," + base64.b64encode(buffer.getvalue()).decode()
        out.append(json.dumps({"input": [uri], "modality": "image"}).encode())
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(port: int, process: subprocess.Popen[bytes], limit_s: float = 300.0) -> None:
    import http.client

    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server on port {port} exited with {process.returncode}")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
            conn.request("GET", "/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the server on port {port} was not ready in {limit_s:.0f} s")


# -- the baseline: a plain FastAPI app ------------------------------------------------------


def baseline_app(graph: str, model: Path) -> Any:
    import onnxruntime as ort
    from fastapi import FastAPI
    from PIL import Image

    from batchline.models.image import preprocess_from_config
    from batchline.models.image.processor_config import read_processor_config

    preprocess = preprocess_from_config(read_processor_config(model))
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    labels = json.loads((model / "config.json").read_text())["id2label"]
    app = FastAPI()

    @app.get("/ready")
    def ready() -> dict[str, str]:
        return {"status": "ready"}

    @app.post("/v1/classify")
    async def classify(request: Request) -> dict[str, Any]:
        body = json.loads(await request.body())
        data = base64.b64decode(body["input"][0].partition(",")[2])
        return await asyncio.to_thread(_classify, data)

    def _classify(data: bytes) -> dict[str, Any]:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        pixels = preprocess(image)[None]
        logits = session.run(["logits"], {"pixel_values": pixels})[0][0]
        best = int(np.argmax(logits))
        return {"results": [{"label": labels[str(best)], "score": float(logits[best])}]}

    return app


# -- the load generator -----------------------------------------------------------------------


async def loadgen(port: int, clients: int, seconds: float, bodies: list[bytes]) -> dict[str, Any]:
    requests = [
        b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(b)}\r\n\r\n".encode()
        + b
        for b in bodies
    ]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds

    async def client(k: int) -> None:
        nonlocal errors
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        try:
            while time.perf_counter() < deadline:
                i += clients
                started = time.perf_counter()
                writer.write(requests[i % len(requests)])
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - started)
                errors += int(head[9:12]) != 200
        finally:
            writer.close()

    started = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(clients)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    p99 = latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))] if latencies else 0.0
    return {"rps": len(latencies) / elapsed, "p99_ms": p99 * 1e3, "errors": errors}


def measure(port: int, clients: int, seconds: float, bodies_file: Path) -> dict[str, Any]:
    command = [sys.executable, __file__, "--loadgen", str(port), str(clients), str(seconds)]
    out = subprocess.run([*command, str(bodies_file)], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds a point")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", choices=["vit-s16", "resnet50"], default="vit-s16")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/batchline-bench-images"))
    parser.add_argument("--loadgen", nargs=4, metavar=("PORT", "CLIENTS", "SECONDS", "BODIES"))
    parser.add_argument("--baseline", nargs=3, metavar=("PORT", "GRAPH", "MODEL"))
    args = parser.parse_args()
    if args.loadgen:
        port, clients, seconds, path = args.loadgen
        bodies = [bytes.fromhex(h) for h in json.loads(Path(path).read_text())]
        print(json.dumps(asyncio.run(loadgen(int(port), int(clients), float(seconds), bodies))))
        return
    if args.baseline:
        import uvicorn

        port, graph, folder = args.baseline
        app = baseline_app(graph, Path(folder))
        uvicorn.run(app, host="127.0.0.1", port=int(port), log_level="warning")
        return

    args.workdir.mkdir(parents=True, exist_ok=True)
    model = make_model(args.workdir / f"model-{args.shape}", args.shape)
    graph = converted_graph(model)  # converts the folder once, off the clock
    bodies = make_bodies(64, seed=0)
    mean_kb = np.mean([len(b) for b in bodies]) * 3 / 4 / 1024  # the JPEG, not its base64
    bodies_file = args.workdir / "serve-bodies.json"
    bodies_file.write_text(json.dumps([b.hex() for b in bodies]))
    ours, theirs = free_port(), free_port()
    serve = [sys.executable, "-m", "batchline", "serve", "--model", f"{model}/"]
    # the server's load lines say what the model runs on (precision auto: bf16 on torch where
    # the CPU computes bf16 natively and it passes the gate, else fp32 on ONNX Runtime)
    serve_log = (args.workdir / "serve.log").open("wb")
    processes = {
        "batchline": subprocess.Popen(
            [*serve, "--port", str(ours), "--log-level", "info"],
            stdout=serve_log,
            stderr=subprocess.STDOUT,
        ),
        "baseline": subprocess.Popen(
            [sys.executable, __file__, "--baseline", str(theirs), graph, str(model)]
        ),
    }
    ports = {"batchline": ours, "baseline": theirs}
    try:
        for name, process in processes.items():
            wait_ready(ports[name], process)
        said = (args.workdir / "serve.log").read_text(errors="replace").splitlines()
        for line in said:
            if "precision" in line or " -> " in line:
                print(f"  batchline serve: {line.strip()}")
        print(f"{args.clients} clients, one ~{mean_kb:.0f} KB JPEG each (a data URI); {args.shape}")
        points: dict[str, list[dict[str, Any]]] = {"batchline": [], "baseline": []}
        for _ in range(args.repeats):
            for name in ("baseline", "batchline"):
                point = measure(ports[name], args.clients, args.duration, bodies_file)
                points[name].append(point)
                print(
                    f"  {name:10} {point['rps']:8.1f} req/s  p99 {point['p99_ms']:8.1f} ms  "
                    f"errors {point['errors']}"
                )
    finally:
        for process in processes.values():
            process.terminate()
        for process in processes.values():
            process.wait(timeout=30)
        serve_log.close()
    best = {n: sorted(p, key=lambda x: x["rps"])[len(p) // 2] for n, p in points.items()}
    if any(p["errors"] for p in best.values()):
        print("WARNING: some requests were not answered 200; the figures are not comparable")
    ratio = best["batchline"]["rps"] / best["baseline"]["rps"]
    print(f"SERVE rps batchline / baseline x{ratio:.2f} (goal x1.5)")
    print(
        f"SERVE p99 batchline {best['batchline']['p99_ms']:.1f} ms vs baseline "
        f"{best['baseline']['p99_ms']:.1f} ms (goal: <=)"
    )
    print(json.dumps({"rps_ratio": ratio, "best": best}))


if __name__ == "__main__":
    main()
