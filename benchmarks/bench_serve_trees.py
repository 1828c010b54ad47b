"""``batchline serve`` from two (or more) source trees, old against new, in one run: the
server's CPU per embedding request over a fixed request count, with its req/s and latency.

A refactor of the request path is judged by what a request costs the server, not only by
req/s, which a 2-core machine caps at "both cores busy". Each tree's server runs the same
defaults (plus ``--server-args``) on 127.0.0.1; ``wrk`` sends exactly ``--requests`` OpenAI
``/v1/embeddings`` requests of one short text (8-24 MiniLM tokens) each at ``--concurrency``
clients, closed loop, from a separate raw-socket asyncio process (``wrk`` cannot stop at a
request count), and the server's CPU seconds (user + system, every thread, from
``/proc/PID/stat``) are read before and after. Trees are interleaved within each repeat
(the order flips every repeat), so drift on the machine hits each alike; the median repeat
is kept.

Usage (the tree before the change checked out as a worktree)::

    git worktree add --detach /tmp/old <old-commit>
    python benchmarks/bench_serve_trees.py --tree old=/tmp/old/src --tree new=src \\
        --requests 20000 --repeats 5

Prints one line per point and a table: req/s, p50/p99, server CPU ms per request, and each
tree's ratios to the first tree's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import Server, bodies, make_texts, wait_for_quiet


@dataclass
class TreeServer(Server):
    """A server whose ``batchline`` is imported from ``src`` (a tree's ``src`` folder)."""

    src: str = ""

    def environment(self) -> dict[str, str] | None:
        return {**os.environ, "PYTHONPATH": self.src}


@dataclass
class Sample:
    requests: int
    seconds: float
    cpu_s: float
    p50_ms: float
    p99_ms: float
    errors: int

    @property
    def rps(self) -> float:
        return self.requests / self.seconds

    @property
    def cpu_ms_per_request(self) -> float:
        return 1e3 * self.cpu_s / self.requests


async def _fixed_load(port: int, conc: int, requests: int, lines: list[bytes]) -> dict[str, float]:
    """Exactly ``requests`` requests from ``conc`` keep-alive raw-socket clients."""
    reqs = [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(b)}\r\n\r\n".encode()
        + b
        for b in lines
    ]
    latencies: list[float] = []
    errors = 0
    left = requests

    async def client(k: int) -> None:
        nonlocal errors, left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k * 7919
        try:
            while left > 0:
                left -= 1
                i += 1
                t0 = time.perf_counter()
                writer.write(reqs[i % len(reqs)])
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                if head[9:12] != b"200":
                    errors += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(client(k) for k in range(conc)))
    elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))] * 1e3

    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "p50_ms": pct(50),
        "p99_ms": pct(99),
        "errors": errors,
    }


def run_fixed(server: Server, conc: int, requests: int, bodies_file: Path) -> Sample:
    """``requests`` requests at ``conc`` clients (a separate process); the server's CPU over
    exactly them."""
    cmd = [sys.executable, __file__, "--load-worker", str(server.port), str(conc)]
    cmd += [str(requests), str(bodies_file)]
    cpu0 = server.cpu_seconds()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    cpu = server.cpu_seconds() - cpu0
    d = json.loads(out.strip().splitlines()[-1])
    return Sample(
        requests=int(d["requests"]),
        seconds=d["seconds"],
        cpu_s=cpu,
        p50_ms=d["p50_ms"],
        p99_ms=d["p99_ms"],
        errors=int(d["errors"]),
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="NAME=SRC",
        help="a source tree's src folder to serve from; the first is the reference (>= 2)",
    )
    p.add_argument("--requests", type=int, default=20000, help="requests per point")
    p.add_argument("--warmup-requests", type=int, default=2000, help="before each point")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="points per tree (median kept)")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--quiet-cores", type=float, default=0.3)
    p.add_argument("--quiet-patience-s", type=float, default=60.0)
    p.add_argument("--load-worker", nargs=4, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.load_worker:
        port, conc, count, path = args.load_worker
        lines = Path(path).read_bytes().splitlines()
        result = asyncio.run(_fixed_load(int(port), int(conc), int(count), lines))
        print(json.dumps(result))
        return 0
    if len(args.tree) < 2:
        p.error("give at least two --tree NAME=SRC")
    trees: dict[str, str] = {}
    for spec in args.tree:
        name, sep, src = spec.partition("=")
        if not sep or not (Path(src) / "batchline" / "__init__.py").is_file():
            p.error(f"--tree {spec!r}: expected NAME=SRC, SRC holding batchline/")
        trees[name] = str(Path(src).resolve())

    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-trees-"))
    body_file = workdir / "short.jsonl"
    texts = make_texts(1000, 8, 24, seed=1)
    body_file.write_bytes(b"\n".join(bodies(texts, "all-MiniLM-L6-v2")) + b"\n")
    servers = {
        name: TreeServer(name, args.server_args.split(), None, src=src)
        for name, src in trees.items()
    }
    print(
        f"# bench_serve_trees: {os.cpu_count()} CPUs, c={args.concurrency}, "
        f"{args.requests} requests a point, repeats={args.repeats}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    samples: dict[str, list[Sample]] = {name: [] for name in servers}
    try:
        for s in servers.values():
            s.start(workdir)
        for rep in range(args.repeats):
            order = list(servers) if rep % 2 == 0 else list(reversed(servers))
            for name in order:
                wait_for_quiet(args.quiet_cores, args.quiet_patience_s)
                run_fixed(servers[name], args.concurrency, args.warmup_requests, body_file)
                pt = run_fixed(servers[name], args.concurrency, args.requests, body_file)
                samples[name].append(pt)
                print(
                    f"  rep {rep} {name:<8} {pt.rps:7.0f} req/s  p50 {pt.p50_ms:7.2f}  "
                    f"p99 {pt.p99_ms:7.2f} ms  cpu {pt.cpu_ms_per_request:.3f} ms/request  "
                    f"err {pt.errors}",
                    flush=True,
                )
    finally:
        codes = {name: s.stop() for name, s in servers.items()}
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}; server exit codes: {codes}\n")

    def median(name: str, key: str) -> float:
        return statistics.median(getattr(s, key) for s in samples[name])

    ref = next(iter(servers))
    head = (
        f"{'tree':<8} | {'req/s':>7} {'p50 ms':>7} {'p99 ms':>7} {'CPU ms/req':>10} | "
        f"{'x req/s':>7} {'x CPU/req':>9} {'x p99':>6}"
    )
    print(head)
    print("-" * len(head))
    for name in servers:
        rps, cpu, p50, p99 = (
            median(name, k) for k in ("rps", "cpu_ms_per_request", "p50_ms", "p99_ms")
        )
        print(
            f"{name:<8} | {rps:>7.0f} {p50:>7.2f} {p99:>7.2f} {cpu:>10.3f} | "
            f"{rps / median(ref, 'rps'):>7.2f} {cpu / median(ref, 'cpu_ms_per_request'):>9.2f} "
            f"{p99 / median(ref, 'p99_ms'):>6.2f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
