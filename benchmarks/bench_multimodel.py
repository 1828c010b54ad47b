"""Two models behind one ``batchline serve``: does each keep its share of the machine?

The server runs the default embedder and a second model at once (``--second``)::

    batchline serve --model emb=default --model mlp=MLP.onnx --task mlp=predict
    batchline serve --model emb=default --model clf=CLF.onnx --task clf=predict

- ``mlp`` (the default): a 64-input MLP (64 -> 256 -> 256 -> 10), microseconds per row, asked
  over JSON (``POST /v2/models/mlp/infer``, 64 numbers in, 10 out). Its cost is almost all
  request path (parse, encode, write): the model the embedder's threads starve most.
- ``clf``: an image-classifier-shaped model (input float32 ``[batch, 3, 32, 32]``, convolutions
  and a dense layer: a few ms per row on one CPU thread; the bench prints what it measured),
  one image per request, binary tensor data in and out.

Both are built here with ``onnx.helper``. A separate, lean load-generator process (asyncio on
raw keep-alive sockets, pre-built requests: never httpx, which saturates a core before the
server does) drives closed loops: ``emb`` alone (``POST /v1/embeddings``, one short text per
request), the second model alone, then both at once, each at the same concurrency as alone.
The three configurations are interleaved over the repeats, so drift on a shared machine hits
all three.

Printed: each model's req/s alone and together (median over repeats), the quotients
together/alone (goal: each >= 0.4, neither model starved) and their sum (goal: >= 0.9, sharing
costs little), and the load average and busy cores seen during the points.

Pinning (``--pin split``, the default when ``taskset`` exists and there are >= 2 CPUs): the
load generator on CPU 0, the server on the others, so that the client's CPU never competes
with the models. ``--pin none`` leaves both unpinned.

Usage::

    python benchmarks/bench_multimodel.py                # emb + mlp, 10 s points, 3 repeats
    python benchmarks/bench_multimodel.py --second clf   # emb + the classifier
    python benchmarks/bench_multimodel.py --duration 2 --repeats 1 --warmup 0.5   # smoke
    python benchmarks/bench_multimodel.py --concurrency 8 --pin none

If ``batchline serve`` cannot yet serve several models (repeated ``--model NAME=SPEC``,
``--task NAME=TASK``) or lacks a route this bench uses, it stops with a message saying which.

Measured (2026-11-28, this 2-core machine, nothing else running, 10 s points, 3 repeats, 8
clients per model; the server keeps the last of its two slots for a model active in the last
0.1 s, ``Device(reserve_s=0.1)``):

- ``--pin none``: emb 0.57 and mlp 0.51 of their alone req/s, sum 1.08 (a second run: 0.55,
  0.53, 1.08); before the reserve, issue 34 measured 0.76 and 0.25. emb + clf: 0.64 and 0.55,
  sum 1.18 (0.68, 0.58, 1.26 in a second run; 0.60 and 0.59 at 16 clients).
- ``--pin split`` (the server on one core, so one slot: nothing to keep): emb 0.84 and mlp
  0.22, sum 1.06, below the goal (0.76 and 0.22 in a second run); emb + clf 0.55 and 0.43,
  sum 0.98 (0.54, 0.41, 0.95). On one core the MLP's requests lose the event loop to the
  embedder's own requests and its session thread; a hold of the slot after each embedder
  batch (as long as that batch) was tried and moved nothing (0.76 / 0.22), so it was left out.

Measured (2026-11-25, before the reserve, 16 clients): ``--pin split``: emb 0.49 and clf 0.49,
sum 0.97; ``--pin none``: emb 0.68, clf 0.42, sum 1.10.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SECONDS = ("mlp", "clf")
IMAGE_SHAPE = (3, 32, 32)
MLP_INPUTS = 64
_WORDS_TEXT = (
    "time person year way day thing world life hand part child eye place work week case point "
    "company number group problem fact batch queue model server token request latency device "
    "core memory image label class vector search index cache budget share fair"
)


# -- the classifier -------------------------------------------------------------------------


def build_classifier(path: Path, *, seed: int = 0) -> None:
    """An image-classifier-shaped ONNX model: ``input`` [batch, 3, 32, 32] -> ``logits``
    [batch, 10]: convs 3->32->64 at 32x32, 64->64 with stride 2, 64->128->128 at 16x16, dense
    32768->128->10 (about 90 M multiply-adds per row)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)

    def weight(name: str, *shape: int) -> onnx.TensorProto:
        fan_in = int(np.prod(shape[1:])) if len(shape) > 1 else shape[0]
        values = (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)
        return numpy_helper.from_array(values, name)

    inits = [
        weight("w1", 32, 3, 3, 3),
        weight("b1", 32),
        weight("w1b", 64, 32, 3, 3),
        weight("b1b", 64),
        weight("w2", 64, 64, 3, 3),
        weight("b2", 64),
        weight("w3", 128, 64, 3, 3),
        weight("b3", 128),
        weight("w4", 128, 128, 3, 3),
        weight("b4", 128),
        weight("d1", 128 * 16 * 16, 128),
        weight("e1", 128),
        weight("d2", 128, 10),
        weight("e2", 10),
    ]
    nodes = [
        helper.make_node("Conv", ["input", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1"], ["r1a"]),
        helper.make_node("Conv", ["r1a", "w1b", "b1b"], ["c1b"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c1b"], ["r1"]),
        helper.make_node("Conv", ["r1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], strides=[2, 2]),
        helper.make_node("Relu", ["c2"], ["r2"]),
        helper.make_node("Conv", ["r2", "w3", "b3"], ["c3"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c3"], ["r3a"]),
        helper.make_node("Conv", ["r3a", "w4", "b4"], ["c4"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c4"], ["r3"]),
        helper.make_node("Flatten", ["r3"], ["f"], axis=1),
        helper.make_node("MatMul", ["f", "d1"], ["m1"]),
        helper.make_node("Add", ["m1", "e1"], ["a1"]),
        helper.make_node("Relu", ["a1"], ["h"]),
        helper.make_node("MatMul", ["h", "d2"], ["m2"]),
        helper.make_node("Add", ["m2", "e2"], ["logits"]),
    ]
    graph = helper.make_graph(
        nodes,
        "bench_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", *IMAGE_SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def build_mlp(path: Path, *, seed: int = 0) -> None:
    """A small MLP: ``input`` [batch, 64] -> 256 -> 256 -> ``output`` [batch, 10], ReLU
    between."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    sizes = [MLP_INPUTS, 256, 256, 10]
    inits, nodes, x = [], [], "input"
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits += [
            numpy_helper.from_array(w, f"w{i}"),
            numpy_helper.from_array(np.zeros(b, np.float32), f"b{i}"),
        ]
        nodes += [
            helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]),
            helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
        ]
        x = f"a{i}"
        if b != sizes[-1]:
            nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    nodes.append(helper.make_node("Identity", [x], ["output"]))
    graph = helper.make_graph(
        nodes,
        "bench_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", MLP_INPUTS])],
        [helper.make_tensor_value_info("output", TensorProto.FLOAT, ["batch", 10])],
        initializer=inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))


def classifier_ms_per_row(path: Path, batch: int = 8, calls: int = 5) -> float:
    """Milliseconds per row on one ONNX Runtime thread (informative: the model's weight)."""
    import numpy as np
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.inter_op_num_threads = 1
    sess = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(0).standard_normal((batch, *IMAGE_SHAPE)).astype(np.float32)
    sess.run(None, {"input": x})
    t0 = time.perf_counter()
    for _ in range(calls):
        sess.run(None, {"input": x})
    return (time.perf_counter() - t0) / (calls * batch) * 1e3


# -- requests -------------------------------------------------------------------------------


def _http_post(path: str, body: bytes, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def emb_requests(model: str, n: int = 64, seed: int = 0) -> list[bytes]:
    """``n`` OpenAI-style embedding requests, one text of 6-14 words each."""
    rng = random.Random(seed)
    words = _WORDS_TEXT.split()
    out = []
    for _ in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(6, 14)))
        body = json.dumps({"input": text, "model": model}).encode()
        out.append(_http_post("/v1/embeddings", body, {"Content-Type": "application/json"}))
    return out


def clf_requests(model: str, n: int = 16, seed: int = 0) -> list[bytes]:
    """``n`` OIP inference requests of one random image each, binary data in and out."""
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        raw = rng.standard_normal((1, *IMAGE_SHAPE)).astype("<f4").tobytes()
        header = json.dumps(
            {
                "inputs": [
                    {
                        "name": "input",
                        "shape": [1, *IMAGE_SHAPE],
                        "datatype": "FP32",
                        "parameters": {"binary_data_size": len(raw)},
                    }
                ],
                "outputs": [{"name": "logits", "parameters": {"binary_data": True}}],
            }
        ).encode()
        out.append(
            _http_post(
                f"/v2/models/{model}/infer",
                header + raw,
                {
                    "Content-Type": "application/octet-stream",
                    "Inference-Header-Content-Length": str(len(header)),
                },
            )
        )
    return out


def mlp_requests(model: str, n: int = 64, seed: int = 0) -> list[bytes]:
    """``n`` OIP inference requests of one row of 64 numbers each, JSON in and out."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        row = [round(rng.uniform(-1, 1), 4) for _ in range(MLP_INPUTS)]
        body = json.dumps(
            {
                "inputs": [
                    {"name": "input", "shape": [1, MLP_INPUTS], "datatype": "FP32", "data": row}
                ]
            }
        ).encode()
        out.append(
            _http_post(f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
        )
    return out


def requests_for(kind: str) -> list[bytes]:
    makers = {"emb": emb_requests, "mlp": mlp_requests, "clf": clf_requests}
    return makers[kind](kind)


# -- the load generator (a separate process) ------------------------------------------------


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = None
    for line in head.split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            length = int(value)
    if length is None:
        raise RuntimeError("a response without Content-Length; this client reads only those")
    return status, await reader.readexactly(length)


async def _loadgen(port: int, seconds: float, targets: list[dict[str, Any]]) -> dict[str, Any]:
    """Closed loops, ``concurrency`` connections per target, all for the same ``seconds``."""
    stats: dict[str, dict[str, Any]] = {
        t["kind"]: {"latencies": [], "errors": 0, "first_error": None} for t in targets
    }
    deadline = time.perf_counter() + seconds

    async def worker(kind: str, reqs: list[bytes], k: int) -> None:
        s = stats[kind]
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k * 7919
        try:
            while time.perf_counter() < deadline:
                i += 1
                t0 = time.perf_counter()
                writer.write(reqs[i % len(reqs)])
                status, body = await _read_response(reader)
                if status == 200:
                    s["latencies"].append(time.perf_counter() - t0)
                else:
                    s["errors"] += 1
                    if s["first_error"] is None:
                        s["first_error"] = f"{status}: {body[:300].decode('utf-8', 'replace')}"
        finally:
            writer.close()

    jobs = []
    for t in targets:
        reqs = requests_for(t["kind"])
        jobs += [worker(t["kind"], reqs, k) for k in range(t["concurrency"])]
    start = time.perf_counter()
    await asyncio.gather(*jobs)
    elapsed = time.perf_counter() - start
    out: dict[str, Any] = {"seconds": elapsed, "targets": {}}
    for kind, s in stats.items():
        lat = sorted(s["latencies"])

        def pct(q: float, lat: list[float] = lat) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] * 1e3 if lat else float("nan")

        out["targets"][kind] = {
            "requests": len(lat),
            "errors": s["errors"],
            "first_error": s["first_error"],
            "p50_ms": pct(0.5),
            "p99_ms": pct(0.99),
        }
    return out


def loadgen_worker(spec_json: str) -> None:
    spec = json.loads(spec_json)
    result = asyncio.run(_loadgen(spec["port"], spec["seconds"], spec["targets"]))
    print(json.dumps(result))


# -- the server -----------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _request(port: int, raw: bytes, timeout_s: float = 30.0) -> tuple[int, bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(raw)
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        head, _, body = data.partition(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n")[1:]:
            key, _, value = line.partition(b":")
            if key.strip().lower() == b"content-length":
                length = int(value)
        while len(body) < length:
            chunk = s.recv(65536)
            if not chunk:
                break
            body += chunk
        return (int(head[9:12]) if head[:5] == b"HTTP/" else 0), body


def _get(port: int, path: str) -> tuple[int, bytes]:
    return _request(port, f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())


def _tail(path: Path, lines: int = 15) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return "\n".join(text.splitlines()[-lines:])


@dataclass
class Server:
    args: list[str]
    cpus: str | None
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.workdir / "server.log"

    def start(self, timeout_s: float) -> None:
        self.port = _free_port()
        cmd = [sys.executable, "-m", "batchline", "serve", "--port", str(self.port)]
        cmd += ["--log-level", "warning", *self.args]
        if self.cpus is not None:
            cmd = ["taskset", "-c", self.cpus, *cmd]
        print("server:", " ".join(cmd[cmd.index("-m") + 1 :]), flush=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = _tail(self.log)
                if "unrecognized arguments" in log or "--task" in log or "--model" in log:
                    raise SystemExit(
                        "batchline serve does not accept several models yet (this bench needs "
                        "`--model emb=default --model mlp=MLP.onnx --task mlp=predict`); "
                        f"it said:\n{log}"
                    )
                raise SystemExit(f"batchline serve exited with {self.proc.returncode}:\n{log}")
            try:
                if _get(self.port, "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(
            f"batchline serve was not ready within {timeout_s:.0f} s:\n{_tail(self.log)}"
        )

    def check_routes(self, second: str) -> None:
        """One request per model, before measuring: a missing route stops the bench here."""
        routes = (("emb", "POST /v1/embeddings"), (second, f"POST /v2/models/{second}/infer"))
        for kind, what in routes:
            status, body = _request(self.port, requests_for(kind)[0])
            if status != 200:
                raise SystemExit(
                    f"batchline serve is up, but {what} for model {kind!r} answered {status}: "
                    f"{body[:300].decode('utf-8', 'replace')}\n(this bench needs both models "
                    "served at once, the second through the Open Inference Protocol route)"
                )

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


# -- measuring ------------------------------------------------------------------------------


def _cpu_sample() -> tuple[int, int]:
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values[:8]), values[3] + values[4]


@dataclass
class Point:
    config: str
    rps: dict[str, float]
    p50_ms: dict[str, float]
    p99_ms: dict[str, float]
    errors: int
    loadavg_1m: float
    busy_cores: float


@dataclass
class Results:
    points: list[Point] = field(default_factory=list)

    def median_rps(self, config: str, model: str) -> float:
        values = [p.rps[model] for p in self.points if p.config == config]
        return statistics.median(values) if values else float("nan")


def run_point(
    port: int, config: str, second: str, seconds: float, concurrency: int, cpus: str | None
) -> Point:
    kinds = ["emb", second] if config == "both" else [config]
    spec = {
        "port": port,
        "seconds": seconds,
        "targets": [{"kind": k, "concurrency": concurrency} for k in kinds],
    }
    cmd = [sys.executable, __file__, "--loadgen-worker", json.dumps(spec)]
    if cpus is not None:
        cmd = ["taskset", "-c", cpus, *cmd]
    before = _cpu_sample()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120)
    after = _cpu_sample()
    if proc.returncode != 0:
        raise SystemExit(f"the load generator failed:\n{proc.stderr[-2000:]}")
    d = json.loads(proc.stdout.strip().splitlines()[-1])
    total = after[0] - before[0]
    busy = (os.cpu_count() or 1) * (1 - (after[1] - before[1]) / total) if total else 0.0
    targets = d["targets"]
    errors = sum(t["errors"] for t in targets.values())
    if errors:
        first = next(t["first_error"] for t in targets.values() if t["first_error"])
        print(f"  {config}: {errors} failed requests; the first: {first}", flush=True)
    return Point(
        config=config,
        rps={k: t["requests"] / d["seconds"] for k, t in targets.items()},
        p50_ms={k: t["p50_ms"] for k, t in targets.items()},
        p99_ms={k: t["p99_ms"] for k, t in targets.items()},
        errors=errors,
        loadavg_1m=os.getloadavg()[0],
        busy_cores=busy,
    )


def report(results: Results, second: str) -> None:
    print()
    print(f"{'model':<6} | {'alone req/s':>11} | {'together req/s':>14} | together/alone")
    print("-" * 56)
    quotients = {}
    for m in ("emb", second):
        alone, both = results.median_rps(m, m), results.median_rps("both", m)
        quotients[m] = both / alone if alone else float("nan")
        verdict = "ok" if quotients[m] >= 0.4 else "BELOW GOAL"
        print(
            f"{m:<6} | {alone:>11.1f} | {both:>14.1f} | {quotients[m]:>6.2f} "
            f"(goal >= 0.4: {verdict})"
        )
    total = sum(quotients.values())
    verdict = "ok" if total >= 0.9 else "BELOW GOAL"
    print(f"sum of quotients: {total:.2f} (goal >= 0.9: {verdict})")
    loads = [p.loadavg_1m for p in results.points]
    busy = [p.busy_cores for p in results.points]
    print(
        f"load average (1 min) after the points: {min(loads):.2f}-{max(loads):.2f}; busy cores "
        f"during them: {min(busy):.2f}-{max(busy):.2f} of {os.cpu_count()}"
    )
    print("\nper point (in run order):")
    for p in results.points:
        detail = ", ".join(
            f"{m} {p.rps[m]:.1f} req/s p50 {p.p50_ms[m]:.1f} p99 {p.p99_ms[m]:.1f} ms"
            for m in p.rps
        )
        print(
            f"  {p.config:<4}  {detail}  errors {p.errors}  load {p.loadavg_1m:.2f}  "
            f"busy {p.busy_cores:.2f}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--duration", type=float, default=10.0, help="seconds per point")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of both models first")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=8, help="connections per model")
    ap.add_argument(
        "--second", choices=SECONDS, default="mlp", help="the model served beside the embedder"
    )
    ap.add_argument("--pin", choices=["split", "none"], default="split")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="passed to batchline serve as --set KEY=VALUE",
    )
    ap.add_argument("--loadgen-worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.loadgen_worker is not None:
        loadgen_worker(args.loadgen_worker)
        return 0

    n_cpus = os.cpu_count() or 1
    pin = args.pin == "split" and n_cpus >= 2 and shutil.which("taskset") is not None
    loadgen_cpus = "0" if pin else None
    server_cpus = f"1-{n_cpus - 1}" if pin else None
    if args.pin == "split" and not pin:
        print("note: not pinning (needs taskset and >= 2 CPUs)")

    with tempfile.TemporaryDirectory(prefix="bench-multimodel-") as tmp:
        workdir = Path(tmp)
        path = workdir / f"{args.second}.onnx"
        if args.second == "clf":
            build_classifier(path)
            print(
                f"classifier: {classifier_ms_per_row(path):.2f} ms per row "
                "(batch 8, one ONNX Runtime thread)"
            )
        else:
            build_mlp(path)
        second = args.second
        server = Server(
            ["--model", "emb=default", "--model", f"{second}={path}", "--task", f"{second}=predict"]
            + [x for kv in args.set for x in ("--set", kv)],
            server_cpus,
            workdir,
        )
        try:
            server.start(args.start_timeout_s)
            server.check_routes(second)
            print(
                f"pinned: server on CPUs {server_cpus}, load generator on CPU {loadgen_cpus}"
                if pin
                else "pinned: nothing"
            )
            if args.warmup > 0:
                run_point(server.port, "both", second, args.warmup, args.concurrency, loadgen_cpus)
            results = Results()
            for r in range(args.repeats):
                configs = ("emb", second, "both")
                order = configs if r % 2 == 0 else configs[::-1]
                for config in order:
                    point = run_point(
                        server.port, config, second, args.duration, args.concurrency, loadgen_cpus
                    )
                    results.points.append(point)
                    print(
                        f"repeat {r + 1} {config:<4}: "
                        + ", ".join(f"{m} {v:.1f} req/s" for m, v in point.rps.items()),
                        flush=True,
                    )
            report(results, second)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
