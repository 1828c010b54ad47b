"""Many models under a memory budget, and interactive traffic beside bulk traffic.

**Part 1, residency.** Three models behind one ``batchline serve --memory-budget``: the default
embedder (``emb``) and two dense MLPs built here (``mlp``, 192 MiB of weights, and
``mlp2``, 128 MiB; ``bench_multimodel``'s image classifier, ~16 MiB, is too small to need
evicting). A probe server (no budget that binds) loads each
once and reads the footprints it measured from ``/v1/models``; the measured server then gets a
budget of the two largest footprints plus 5 %: it holds two of the models, never three. The
traffic comes in phases, one model at a time (emb, mlp, mlp2, emb, ...), ``--requests``
sequential requests per phase. Printed: every request answered (or not); the server's peak
resident memory above what it held before any load (sampled every 10 ms), against the
budget (goal: <= budget + 10 %); and each phase's first-request latency (the switch cost:
it includes a load when the model had been evicted) against the model's mean load time from
``/metrics``.

**Part 2, priority.** One ``emb`` server; bulk closed loops (``--bulk-concurrency``
connections, 16 texts a request) saturate it while an interactive client sends one short text
at ``--interactive-rate`` requests/s. Two modes, interleaved over ``--repeats``: ``without``
(the interactive client also sends ``X-Batchline-Priority: batch``: one class) and ``with``
(it sends ``interactive``; bulk sends ``batch``, as ``batchline drive`` does). Printed: the
interactive p99 with/without (goal: <= 0.3) and bulk throughput with/without (goal: >= 0.9).

Usage::

    python benchmarks/bench_residency.py                         # the full run
    python benchmarks/bench_residency.py --smoke                 # a short run: the script works

Measured (2026-11-25, this 2-core machine, nothing else running; ``python
benchmarks/bench_residency.py``): 180/180 requests answered; peak RSS above the pre-load
process 507 MiB = 1.06x the budget (480 MiB); switch cost ~ the load (emb 420 vs 385 ms, mlp
676 vs 593 ms, mlp2 376 vs 365 ms). The peak had been 1.4x: the unload's gc and
``malloc_trim`` ran while the residency still held the model; they run after it lets go now
(``Residency(reclaim=...)``). Priority (2026-11-25, quiet, ``--part priority``): interactive
p99 49 ms with, 298 ms without = 0.16 (goal <= 0.3), p50 21 against 197 ms; bulk throughput
0.94x (goal >= 0.9). Before the core's batch rule (a batch takes no lower priority than its
first; a lower-priority batch takes half the budget while higher ones arrive) the ratio was
0.34-0.44: the interactive text rode a whole bulk batch, behind a whole one in flight.

Its clients are loops of its own, not ``batchline.bench``'s load generator: a phase sends to
one model at a time and times its first request, which a loop over one target does not express.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_multimodel import (
    _WORDS_TEXT,
    Server,
    _get,
    _http_post,
    _read_response,
    _request,
    emb_requests,
)

MLP_FEATURES, MLP_OUT = 1024, 8
HIDDEN = {"mlp": 49_152, "mlp2": 32_768}  # 1024 x 49152 float32 = 192 MiB; x 32768 = 128 MiB


def build_mlp(path: Path, hidden: int) -> None:
    """``input`` float32 ``[batch, 1024]`` → ``scores`` ``[batch, 8]`` via a ``1024 x hidden``
    layer."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((MLP_FEATURES, hidden), dtype=np.float32) * 0.01).astype(np.float32)
    w2 = rng.standard_normal((hidden, MLP_OUT), dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w1"], ["hidden"]),
            helper.make_node("Relu", ["hidden"], ["act"]),
            helper.make_node("MatMul", ["act", "w2"], ["scores"]),
        ],
        "mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", MLP_FEATURES])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", MLP_OUT])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


def mlp_requests(model: str, n: int = 4, seed: int = 0) -> list[bytes]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        data = [round(rng.uniform(-1, 1), 3) for _ in range(MLP_FEATURES)]
        body = json.dumps(
            {
                "inputs": [
                    {"name": "input", "datatype": "FP32", "shape": [1, MLP_FEATURES], "data": data}
                ]
            }
        ).encode()
        out.append(
            _http_post(f"/v2/models/{model}/infer", body, {"Content-Type": "application/json"})
        )
    return out


def rss_bytes(pid: int) -> int:
    """A process's resident memory (VmRSS), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class PeakRss:
    """The most resident memory a process held, sampled every 10 ms on a thread (its VmHWM
    will not do: the server resets it before each load to measure that load's peak)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = rss_bytes(pid)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.01):
            try:
                self.peak = max(self.peak, rss_bytes(self.pid))
            except (OSError, RuntimeError):
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def models_list(port: int) -> dict[str, dict[str, Any]]:
    status, body = _get(port, "/v1/models")
    if status != 200:
        raise SystemExit(f"GET /v1/models answered {status}")
    return {c["id"]: c for c in json.loads(body)["data"]}


def metric_values(port: int, name: str) -> dict[str, float]:
    """``{model: value}`` of one metric series family (the ``model`` label)."""
    _, body = _get(port, "/metrics")
    out: dict[str, float] = {}
    for line in body.decode().splitlines():
        if line.startswith(name + "{"):
            labels, _, value = line.partition("} ")
            model = labels.split('model="', 1)[1].split('"', 1)[0]
            out[model] = float(value)
    return out


# -- part 1 -----------------------------------------------------------------------------------


def residency(args: argparse.Namespace, workdir: Path) -> None:
    models = ["--model", "emb=default", "--sessions", "1"]
    reqs = {"emb": emb_requests("emb")}
    for name, hidden in HIDDEN.items():
        path = workdir / f"{name}.onnx"
        build_mlp(path, hidden)
        models += ["--model", f"{name}={path}", "--task", f"{name}=predict"]
        reqs[name] = mlp_requests(name)

    probe = Server([*models, "--memory-budget", "64GiB"], None, workdir)
    probe.start(args.start_timeout_s)
    try:
        for name in ("emb", "mlp", "mlp2"):
            status, body = _request(probe.port, reqs[name][0])
            if status != 200:
                raise SystemExit(f"probe: {name} answered {status}: {body[:300]!r}")
        sizes = {n: c["footprint_bytes"] for n, c in models_list(probe.port).items()}
    finally:
        probe.stop()
    two = sorted(sizes.values())[1:]
    budget = int(sum(two) * 1.05)
    print(
        "footprints measured (MiB): "
        + ", ".join(f"{n} {b / 2**20:.0f}" for n, b in sizes.items())
        + f"; budget {budget / 2**20:.0f} MiB (the two largest + 5 %)"
    )
    if budget >= sum(sizes.values()):
        print("  (the smallest model is under 5 % of the others: the budget holds all three)")

    server = Server([*models, "--memory-budget", str(budget)], None, workdir)
    server.start(args.start_timeout_s)
    assert server.proc is not None
    pid = server.proc.pid
    try:
        base_rss = rss_bytes(pid)
        sampler = PeakRss(pid)
        answered = failed = 0
        switches: list[tuple[str, float]] = []
        steady: list[float] = []
        order = ["emb", "mlp", "mlp2"] * args.rounds
        for phase, name in enumerate(order):
            for i in range(args.requests):
                t0 = time.perf_counter()
                status, _ = _request(server.port, reqs[name][i % len(reqs[name])])
                latency = time.perf_counter() - t0
                if status == 200:
                    answered += 1
                else:
                    failed += 1
                if i == 0 and phase > 0:
                    switches.append((name, latency))
                elif i > 0:
                    steady.append(latency)
        peak = sampler.stop()
        load_sum = metric_values(server.port, "batchline_model_load_seconds_sum")
        load_count = metric_values(server.port, "batchline_model_load_seconds_count")
        evictions = metric_values(server.port, "batchline_model_evictions_total")
    finally:
        server.stop()
    total = answered + failed
    print(f"requests answered: {answered}/{total}" + (f" ({failed} failed)" if failed else ""))
    grown = peak - base_rss
    print(
        f"peak RSS above the pre-load process: {grown / 2**20:.0f} MiB = "
        f"{grown / budget:.2f} x the budget (goal <= 1.10); evictions: "
        + ", ".join(f"{n} {v:.0f}" for n, v in sorted(evictions.items()))
    )
    for name in ("emb", "mlp", "mlp2"):
        firsts = [s for n, s in switches if n == name]
        mean_load = load_sum.get(name, 0.0) / max(1.0, load_count.get(name, 0.0))
        if firsts:
            print(
                f"  {name}: switch cost (first request of a phase) median "
                f"{statistics.median(firsts) * 1e3:.0f} ms vs mean load "
                f"{mean_load * 1e3:.0f} ms ({load_count.get(name, 0):.0f} loads)"
            )
    if steady:
        print(f"  steady requests: median {statistics.median(steady) * 1e3:.1f} ms")


# -- part 2 -----------------------------------------------------------------------------------


def _bulk_requests(n: int = 32, seed: int = 1) -> list[bytes]:
    rng = random.Random(seed)
    words = _WORDS_TEXT.split()
    out = []
    for _ in range(n):
        texts = [" ".join(rng.choice(words) for _ in range(12)) for _ in range(16)]
        body = json.dumps({"input": texts, "model": "emb"}).encode()
        headers = {"Content-Type": "application/json", "X-Batchline-Priority": "batch"}
        out.append(_http_post("/v1/embeddings", body, headers))
    return out


def _interactive_requests(priority: str) -> list[bytes]:
    out = []
    for raw in emb_requests("emb", n=32, seed=2):
        head, _, body = raw.partition(b"\r\n\r\n")
        out.append(head + f"\r\nX-Batchline-Priority: {priority}".encode() + b"\r\n\r\n" + body)
    return out


async def _mixed(
    port: int, seconds: float, bulk_conns: int, rate: float, priority: str
) -> tuple[list[float], int]:
    """Bulk closed loops plus interactive requests at ``rate``/s (open loop): the interactive
    latencies and the bulk requests done."""
    deadline = time.perf_counter() + seconds
    bulk = _bulk_requests()
    inter = _interactive_requests(priority)
    done = 0
    latencies: list[float] = []

    async def bulk_loop(k: int) -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k
        try:
            while time.perf_counter() < deadline:
                i += 1
                writer.write(bulk[i % len(bulk)])
                status, _ = await _read_response(reader)
                done += status == 200
        finally:
            writer.close()

    async def one(i: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            t0 = time.perf_counter()
            writer.write(inter[i % len(inter)])
            status, _ = await _read_response(reader)
            if status == 200:
                latencies.append(time.perf_counter() - t0)
        finally:
            writer.close()

    async def interactive() -> None:
        sent: list[asyncio.Task[None]] = []
        i = 0
        while time.perf_counter() < deadline:
            sent.append(asyncio.ensure_future(one(i)))
            i += 1
            await asyncio.sleep(1 / rate)
        await asyncio.gather(*sent)

    await asyncio.gather(interactive(), *(bulk_loop(k) for k in range(bulk_conns)))
    return latencies, done


def priority(args: argparse.Namespace, workdir: Path) -> None:
    server = Server(["--model", "emb=default"], None, workdir)
    server.start(args.start_timeout_s)
    try:
        _request(server.port, emb_requests("emb")[0])
        p99: dict[str, list[float]] = {"without": [], "with": []}
        p50: dict[str, list[float]] = {"without": [], "with": []}
        rps: dict[str, list[float]] = {"without": [], "with": []}
        for _ in range(args.repeats):
            for mode in ("without", "with"):
                lat, done = asyncio.run(
                    _mixed(
                        server.port,
                        args.duration,
                        args.bulk_concurrency,
                        args.interactive_rate,
                        "batch" if mode == "without" else "interactive",
                    )
                )
                lat.sort()
                p50[mode].append(lat[len(lat) // 2] if lat else float("nan"))
                p99[mode].append(
                    lat[min(len(lat) - 1, int(0.99 * len(lat)))] if lat else float("nan")
                )
                rps[mode].append(done / args.duration)
    finally:
        server.stop()
    p_with, p_without = statistics.median(p99["with"]), statistics.median(p99["without"])
    r_with, r_without = statistics.median(rps["with"]), statistics.median(rps["without"])
    print(
        f"interactive p50: {statistics.median(p50['with']) * 1e3:.0f} ms with priority, "
        f"{statistics.median(p50['without']) * 1e3:.0f} ms without"
    )
    print(
        f"interactive p99: {p_with * 1e3:.0f} ms with priority, {p_without * 1e3:.0f} ms without "
        f"= {p_with / p_without:.2f} (goal <= 0.3)"
    )
    print(
        f"bulk throughput: {r_with:.1f} req/s with, {r_without:.1f} without = "
        f"{r_with / r_without:.2f} (goal >= 0.9)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    ap.add_argument("--requests", type=int, default=20, help="requests per phase")
    ap.add_argument("--rounds", type=int, default=3, help="times through the three models")
    ap.add_argument("--duration", type=float, default=15.0, help="seconds per priority point")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--bulk-concurrency", type=int, default=8)
    ap.add_argument("--interactive-rate", type=float, default=5.0, help="requests/s")
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--part", choices=["residency", "priority", "both"], default="both")
    ap.add_argument("--smoke", action="store_true", help="a short run: the script works")
    args = ap.parse_args(argv)
    if args.smoke:
        args.requests, args.rounds, args.duration, args.repeats = 3, 1, 2.0, 1
    with tempfile.TemporaryDirectory(prefix="bench-residency-") as tmp:
        if args.part in ("residency", "both"):
            residency(args, Path(tmp))
        if args.part in ("priority", "both"):
            priority(args, Path(tmp))
    return 0


if __name__ == "__main__":
    sys.exit(main())
