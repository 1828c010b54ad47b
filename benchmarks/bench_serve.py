"""``batchline serve`` against its own no-batching baseline, over HTTP, in the same run.

Two servers run side by side on 127.0.0.1 (the idle one costs nothing): batchline's shared
batcher, and ``--no-batching`` (one ONNX Runtime session with 2 threads, each request's texts
run directly, concurrent calls on that one session). A separate load-generator process --
``wrk`` with a Lua script, or a lean asyncio raw-socket client when ``wrk`` is missing, never
httpx (it saturates a core before the server does) -- sends OpenAI-style ``/v1/embeddings``
requests of one text each, closed loop, at each concurrency. Baseline and batchline points are
interleaved, so drift on a shared machine hits both.

Workloads: ``short`` texts of 8-24 tokens at concurrency 1, 8, 32, 64, and one ``mixed`` run of
8-128 tokens. Goals (short texts): at c=1 p50 <= baseline + 1 ms; at c=32 >= 1.3x the baseline's
req/s with p99 <= the baseline's; never below the baseline.

Measured (2026-11-23, the 2-core machine with nothing else running, server defaults, median
of 3 interleaved repeats of 6 s; httptools and uvloop installed, as the server extra brings)::

    python benchmarks/bench_serve.py --duration 6 --warmup 1.5 --repeats 3 --retries 2 \
        --quiet-patience-s 20

    workload   c | base req/s   p50    p99 | bl req/s   p50    p99 batch | x req/s p50 +ms p99 x
    short      1 |        149   6.55  10.71 |      150   6.50  11.77   1.0 |    1.00  -0.05  1.10
    short      8 |        307  25.03  49.58 |      318  24.41  43.12   2.1 |    1.03  -0.62  0.87
    short     32 |        331  94.15 150.77 |      436  71.76 128.21   6.6 |    1.32 -22.39  0.85
    short     64 |        318 192.25 581.76 |      476 129.19 240.63  11.4 |    1.50 -63.06  0.41
    mixed     32 |        118 267.19 335.24 |      125 276.76 416.51   2.3 |    1.06  +9.57  1.24

Per repeat at c=32, batchline gave 430-439 req/s and the baseline 309-335 (x1.30-1.42); at
c=8 the two overlap (278-313 against 307-329). Where batchline's margin comes from on this
CPU: a one-thread session runs a 16-token sentence in ~4 ms alone and ~2.6 ms in a batch of
16, and a padded token costs about what a real one does, so tight length groups
(``padding_slack`` 4) beat bigger batches. Mixed lengths gain little, and their p99 is above
the baseline's; that is not explained yet.

Usage::

    python benchmarks/bench_serve.py                       # defaults: 10 s per point
    python benchmarks/bench_serve.py --duration 5 --concurrency 1 32
    python benchmarks/bench_serve.py --config tuned.toml   # batchline knobs from a file
    python benchmarks/bench_serve.py --pin split           # server on CPU 1, loadgen on CPU 0
    # the server's CPU per request over exactly 20,000 requests at c=32, old code against new
    python benchmarks/bench_serve.py --concurrency 32 --mixed-concurrency --requests 20000 \
        --duration 300 --variant old= --variant new= \
        --variant-src old=OLD/src --variant-src new=NEW/src

Before each point the bench waits (up to ``--quiet-patience-s``) until the rest of the machine
uses under ``--quiet-cores`` cores; during the point it measures what other processes used
(``background``) and re-runs a disturbed point up to ``--retries`` times, keeping the quietest:
on a shared machine, points taken while others run are not comparable to quiet ones.

``--pin`` (default ``none``): on a 2-core machine, pinning the server to one core halves the
model's cores, so by default nothing is pinned and the load generator's CPU is reported
(``wrk`` uses a few percent of a core at these rates).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_WORDS = (
    "time person year way day thing man world life hand part child eye woman place work week "
    "case point government company number group problem fact be have do say get make go know "
    "take see come think look want give use find tell ask seem feel try leave call good new "
    "first last long great little own other old right big high different small large next "
    "early young important few public bad same able to of in for on with at by from up about "
    "into over after batch queue model server token request latency device core memory"
)
WORDS = _WORDS.split()


# -- texts ----------------------------------------------------------------------------------


def make_texts(n: int, lo: int, hi: int, seed: int) -> list[str]:
    """``n`` texts of ``lo``-``hi`` MiniLM tokens (specials included), checked with the
    model's tokenizer."""
    from batchline.models import load_tokenizer
    from batchline.models.onnx import minilm

    tok, _ = load_tokenizer(minilm.weights_dir() / "tokenizer.json", max_length=minilm.MAX_LENGTH)
    rng = random.Random(seed)
    texts: list[str] = []
    while len(texts) < n:
        want = rng.randint(lo, hi)
        words = [rng.choice(WORDS) for _ in range(max(1, want - 2))]
        text = " ".join(words)
        ids = tok.encode(text).ids
        while len(ids) > want and len(words) > 1:
            words.pop()
            text = " ".join(words)
            ids = tok.encode(text).ids
        if lo <= len(ids) <= hi:
            texts.append(text)
    return texts


def bodies(texts: list[str], model: str) -> list[bytes]:
    return [json.dumps({"input": t, "model": model}).encode() for t in texts]


# -- servers --------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def http_get(port: int, path: str) -> tuple[int, bytes]:
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


@dataclass
class Server:
    name: str
    args: list[str]
    cpus: str | None
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    src: str | None = None  # run batchline from this source tree (--variant-src)

    def command(self, workdir: Path) -> list[str]:
        """What runs the server on ``self.port``."""
        cmd = [sys.executable, "-m", "batchline", "serve", "--port", str(self.port)]
        cmd += ["--log-level", "warning", *self.args]
        if self.cpus is not None and shutil.which("taskset"):
            cmd = ["taskset", "-c", self.cpus, *cmd]
        return cmd

    def environment(self) -> dict[str, str] | None:
        """The server's environment (None: this process's; ``src``: its code from there)."""
        if self.src is None:
            return None
        return {**os.environ, "PYTHONPATH": self.src}

    def start(self, workdir: Path) -> None:
        self.port = free_port()
        cmd = self.command(workdir)
        self.log = workdir / f"{self.name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=self.environment()
            )
        for _ in range(1800):
            if self.proc.poll() is not None:
                raise SystemExit(f"{self.name} server exited:\n{self.log.read_text()}")
            try:
                if http_get(self.port, "/ready")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise SystemExit(f"{self.name} server never became ready")

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)

    def cpu_seconds(self) -> float:
        assert self.proc is not None
        pid = self.proc.pid
        if self.cpus is not None and shutil.which("taskset"):
            # taskset execs the command: same pid
            pass
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = os.sysconf("SC_CLK_TCK")
        return (int(fields[11]) + int(fields[12])) / ticks

    def metric(self, name: str) -> float:
        _, text = http_get(self.port, "/metrics")
        total = 0.0
        for line in text.decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


# -- load generators ------------------------------------------------------------------------

WRK_LUA = r"""
local bodies = {}
for line in io.lines(os.getenv("BENCH_BODIES")) do bodies[#bodies + 1] = line end
local headers = {["Content-Type"] = "application/json"}
local i = 0
local statuses = {}
init = function(args)
  math.randomseed(os.time() + tonumber(tostring({}):sub(8), 16) % 100000)
  i = math.random(#bodies)
end
request = function()
  i = i % #bodies + 1
  return wrk.format("POST", "/v1/embeddings", headers, bodies[i])
end
done = function(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    "BENCH_JSON {\"requests\":%d,\"duration_us\":%d,\"p50_us\":%d,\"p90_us\":%d," ..
    "\"p99_us\":%d,\"mean_us\":%.1f,\"non2xx\":%d,\"socket_errors\":%d}\n",
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(90),
    latency:percentile(99), latency.mean, e.status, e.connect + e.read + e.write + e.timeout))
end
"""


@dataclass
class Point:
    requests: int
    seconds: float
    p50_ms: float
    p90_ms: float
    p99_ms: float
    errors: int
    server_cpu: float = 0.0  # cores used by the server process
    loadgen_cpu: float = 0.0  # cores used by the load generator
    avg_batch: float = 0.0
    background: float = 0.0  # cores other processes used during the point
    server_cpu_s: float = 0.0  # CPU seconds the server process used over the point

    @property
    def cpu_ms_per_request(self) -> float:
        """The server's CPU per answered request (``/proc/PID/stat``), in milliseconds."""
        return 1e3 * self.server_cpu_s / self.requests if self.requests else float("nan")

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def run_wrk(
    port: int, conc: int, seconds: float, bodies_file: Path, lua: Path, cpus: str | None
) -> Point:
    cmd = [
        "wrk",
        "-t1",
        f"-c{conc}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "30s",
        "-s",
        str(lua),
        f"http://127.0.0.1:{port}/v1/embeddings",
    ]
    if cpus is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus, *cmd]
    before = os.times()
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, "BENCH_BODIES": str(bodies_file)},
        check=True,
    ).stdout
    after = os.times()
    line = next((x for x in out.splitlines() if x.startswith("BENCH_JSON ")), None)
    if line is None:
        raise SystemExit(f"wrk gave no summary:\n{out}")
    d = json.loads(line.split(" ", 1)[1])
    dur = d["duration_us"] / 1e6
    child_cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return Point(
        requests=d["requests"],
        seconds=dur,
        p50_ms=d["p50_us"] / 1e3,
        p90_ms=d["p90_us"] / 1e3,
        p99_ms=d["p99_us"] / 1e3,
        errors=d["non2xx"] + d["socket_errors"],
        loadgen_cpu=child_cpu / dur if dur else 0.0,
    )


def run_asyncio_loadgen(
    port: int, conc: int, seconds: float, bodies_file: Path, cpus: str | None, count: int = 0
) -> Point:
    """The fallback: this file's ``--loadgen-worker`` mode in a separate (pinned) process;
    ``count`` > 0: exactly that many requests (``seconds`` is then only a cap)."""
    cmd = [
        sys.executable,
        __file__,
        "--loadgen-worker",
        str(port),
        str(conc),
        str(seconds),
        str(bodies_file),
        str(count),
    ]
    if cpus is not None and shutil.which("taskset"):
        cmd = ["taskset", "-c", cpus, *cmd]
    before = os.times()
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    after = os.times()
    d = json.loads(out.strip().splitlines()[-1])
    child_cpu = (after.children_user - before.children_user) + (
        after.children_system - before.children_system
    )
    return Point(
        requests=d["requests"],
        seconds=d["seconds"],
        p50_ms=d["p50_ms"],
        p90_ms=d["p90_ms"],
        p99_ms=d["p99_ms"],
        errors=d["errors"],
        loadgen_cpu=child_cpu / d["seconds"],
    )


async def _loadgen(
    port: int, conc: int, seconds: float, bodies_list: list[bytes], count: int = 0
) -> dict[str, Any]:
    """Closed loop on raw keep-alive sockets: pre-built requests, Content-Length parsing.
    ``count`` > 0: the clients stop once that many requests were sent (all of them answered),
    or at ``seconds``, whichever comes first."""
    reqs = [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(b)}\r\n\r\n".encode()
        + b
        for b in bodies_list
    ]
    latencies: list[float] = []
    errors = 0
    deadline = time.perf_counter() + seconds
    left = count if count > 0 else -1  # requests still to send (-1: no count)

    async def worker(k: int) -> None:
        nonlocal errors, left
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        i = k * 7919
        try:
            while time.perf_counter() < deadline and left != 0:
                left -= 1 if left > 0 else 0
                i += 1
                t0 = time.perf_counter()
                writer.write(reqs[i % len(reqs)])
                head = await reader.readuntil(b"\r\n\r\n")
                status = int(head[9:12])
                length = 0
                for line in head.split(b"\r\n"):
                    if line[:15].lower() == b"content-length:":
                        length = int(line[15:])
                await reader.readexactly(length)
                latencies.append(time.perf_counter() - t0)
                if status != 200:
                    errors += 1
        finally:
            writer.close()

    start = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(conc)))
    elapsed = time.perf_counter() - start
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q / 100 * len(latencies)))] * 1e3

    return {
        "requests": len(latencies),
        "seconds": elapsed,
        "p50_ms": pct(50),
        "p90_ms": pct(90),
        "p99_ms": pct(99),
        "errors": errors,
    }


# -- the run --------------------------------------------------------------------------------


@dataclass
class Result:
    workload: str
    conc: int
    points: dict[str, list[Point]] = field(default_factory=dict)

    def best(self, name: str) -> Point:
        """The median point by req/s over repeats."""
        pts = sorted(self.points[name], key=lambda p: p.rps)
        return pts[len(pts) // 2]


def _cpu_sample() -> tuple[int, int]:
    """(all ticks, idle ticks) of the whole machine, from /proc/stat."""
    values = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    return sum(values[:8]), values[3] + values[4]


def _busy_between(a: tuple[int, int], b: tuple[int, int]) -> float:
    total = b[0] - a[0]
    return (os.cpu_count() or 1) * (1 - (b[1] - a[1]) / total) if total else 0.0


def busy_cores(seconds: float = 1.0) -> float:
    """Cores busy on the whole machine over ``seconds``."""
    before = _cpu_sample()
    time.sleep(seconds)
    return _busy_between(before, _cpu_sample())


def wait_for_quiet(limit: float, patience_s: float) -> float:
    """Wait (at most ``patience_s``) until other processes use under ``limit`` cores; return
    the background load seen last."""
    deadline = time.monotonic() + patience_s
    while True:
        load = busy_cores()
        if load <= limit or time.monotonic() >= deadline:
            return load
        time.sleep(2.0)


def measure(
    server: Server,
    conc: int,
    seconds: float,
    warmup: float,
    bodies_file: Path,
    lua: Path | None,
    loadgen_cpus: str | None,
    count: int = 0,
) -> Point:
    def once(duration: float, n: int = 0) -> Point:
        if lua is not None:
            return run_wrk(server.port, conc, duration, bodies_file, lua, loadgen_cpus)
        return run_asyncio_loadgen(server.port, conc, duration, bodies_file, loadgen_cpus, n)

    if warmup > 0:
        once(warmup)
    cpu0 = server.cpu_seconds()
    batches0 = server.metric("batchline_batch_size_count")
    records0 = server.metric("batchline_batch_size_sum")
    machine0 = _cpu_sample()
    t0 = time.perf_counter()
    point = once(seconds, count)
    wall = time.perf_counter() - t0
    machine = _busy_between(machine0, _cpu_sample())
    point.server_cpu_s = server.cpu_seconds() - cpu0
    if count and point.requests < count:
        print(
            f"  warning: {server.name} answered {point.requests} of {count} requests within "
            f"--duration {seconds:g}s; raise --duration (with --requests it is only a cap)",
            flush=True,
        )
    point.server_cpu = point.server_cpu_s / wall
    # what the rest of the machine used meanwhile: busy cores less the server and loadgen
    point.background = max(0.0, machine - point.server_cpu - point.loadgen_cpu)
    batches = server.metric("batchline_batch_size_count") - batches0
    records = server.metric("batchline_batch_size_sum") - records0
    point.avg_batch = records / batches if batches else 0.0
    return point


def print_table(results: list[Result], base: str, ours: str) -> None:
    head = (
        f"{'workload':<8} {'c':>3} | {'base req/s':>10} {'p50':>7} {'p99':>7} | "
        f"{'bl req/s':>9} {'p50':>7} {'p99':>7} {'batch':>5} | {'x req/s':>7} "
        f"{'p50 +ms':>7} {'p99 x':>6} | {'srv CPU b/bl':>12} {'err':>5} {'bg b/bl':>9}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        b, o = r.best(base), r.best(ours)
        ratio = o.rps / b.rps if b.rps else float("nan")
        print(
            f"{r.workload:<8} {r.conc:>3} | {b.rps:>10.0f} {b.p50_ms:>7.2f} {b.p99_ms:>7.2f} | "
            f"{o.rps:>9.0f} {o.p50_ms:>7.2f} {o.p99_ms:>7.2f} {o.avg_batch:>5.1f} | "
            f"{ratio:>7.2f} {o.p50_ms - b.p50_ms:>+7.2f} {o.p99_ms / b.p99_ms:>6.2f} | "
            f"{b.server_cpu:>5.2f}/{o.server_cpu:<5.2f}  {b.errors + o.errors:>5} "
            f"{b.background:>4.2f}/{o.background:<4.2f}"
        )


def check_goals(results: list[Result], base: str, ours: str) -> list[str]:
    lines = []
    for r in results:
        if r.workload != "short":
            continue
        b, o = r.best(base), r.best(ours)
        ok = o.rps >= 0.97 * b.rps  # "never below": within run-to-run noise
        verdict = "OK" if ok else "MISS"
        lines.append(f"c={r.conc}: req/s x{o.rps / b.rps:.2f} (never below) {verdict}")
        if r.conc == 1:
            ok = o.p50_ms <= b.p50_ms + 1.0
            lines.append(
                f"c=1: p50 {o.p50_ms:.2f} vs baseline {b.p50_ms:.2f} + 1 ms "
                f"{'OK' if ok else 'MISS'}"
            )
        if r.conc == 32:
            ok = o.rps >= 1.3 * b.rps and o.p99_ms <= b.p99_ms
            lines.append(
                f"c=32: x{o.rps / b.rps:.2f} >= 1.3 and p99 {o.p99_ms:.1f} <= {b.p99_ms:.1f} ms "
                f"{'OK' if ok else 'MISS'}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=10.0, help="seconds per point")
    p.add_argument("--warmup", type=float, default=2.0, help="seconds of warm-up per point")
    p.add_argument("--repeats", type=int, default=1, help="points per setting (median kept)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--mixed-concurrency", type=int, nargs="*", default=[32])
    p.add_argument("--config", help="batchline server config file (TOML/JSON)")
    p.add_argument("--server-args", default="", help="extra flags for the batchline server")
    p.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="compare several batchline servers, e.g. --variant slack4='--set padding_slack=4'",
    )
    p.add_argument("--pin", choices=["none", "split"], default="none")
    p.add_argument("--loadgen", choices=["auto", "wrk", "asyncio"], default="auto")
    p.add_argument(
        "--quiet-cores",
        type=float,
        default=0.3,
        help="before each point, wait until other processes use at most this many cores",
    )
    p.add_argument(
        "--quiet-patience-s", type=float, default=60.0, help="...but no longer than this"
    )
    p.add_argument(
        "--retries", type=int, default=3, help="re-runs of a point disturbed by other processes"
    )
    p.add_argument(
        "--requests",
        type=int,
        default=0,
        metavar="N",
        help="each point sends exactly N requests (--duration is then a cap; the asyncio "
        "load generator), and the server's CPU per request is read from /proc over them",
    )
    p.add_argument(
        "--variant-src",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="run the server NAME (a --variant, or batchline/baseline) with PYTHONPATH=PATH: "
        "old code against new in one run, e.g. --variant-src old=/tmp/old/src",
    )
    p.add_argument("--loadgen-worker", nargs=5, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.loadgen_worker:
        port, conc, seconds, path, count = args.loadgen_worker
        bl = Path(path).read_bytes().splitlines()
        run = _loadgen(int(port), int(conc), float(seconds), bl, int(count))
        print(json.dumps(asyncio.run(run)))
        return 0

    if args.requests < 0:
        raise SystemExit(f"--requests must be >= 0, got {args.requests}")
    if args.requests and args.loadgen == "wrk":
        raise SystemExit("--requests needs the asyncio load generator (wrk runs for a time)")
    use_wrk = not args.requests and (
        args.loadgen == "wrk" or (args.loadgen == "auto" and shutil.which("wrk"))
    )
    if args.loadgen == "wrk" and not shutil.which("wrk"):
        raise SystemExit("wrk not found: apt-get install -y wrk, or --loadgen asyncio")
    server_cpus, loadgen_cpus = ("1", "0") if args.pin == "split" else (None, None)
    model = "all-MiniLM-L6-v2"

    workdir = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    short_file = workdir / "short.jsonl"
    mixed_file = workdir / "mixed.jsonl"
    short_file.write_bytes(b"\n".join(bodies(make_texts(1000, 8, 24, seed=1), model)) + b"\n")
    mixed_file.write_bytes(b"\n".join(bodies(make_texts(1000, 8, 128, seed=2), model)) + b"\n")
    lua = None
    if use_wrk:
        lua = workdir / "bench.lua"
        lua.write_text(WRK_LUA)

    ours_args = (["--config", args.config] if args.config else []) + args.server_args.split()
    servers = {"baseline": Server("baseline", ["--no-batching"], server_cpus)}
    if args.variant:
        for spec in args.variant:
            name, _, extra = spec.partition("=")
            servers[name] = Server(name, ours_args + extra.split(), server_cpus)
    else:
        servers["batchline"] = Server("batchline", ours_args, server_cpus)
    for spec in args.variant_src:
        name, _, src = spec.partition("=")
        if name not in servers or not src:
            known = ", ".join(servers)
            raise SystemExit(f"--variant-src {spec!r}: NAME=PATH with NAME one of {known}")
        servers[name].src = str(Path(src).resolve())
    variants = [n for n in servers if n != "baseline"]
    print(
        f"# bench_serve: {os.cpu_count()} CPUs, loadgen={'wrk' if use_wrk else 'asyncio'}, "
        f"pin={args.pin}, {args.duration:.0f}s/point, repeats={args.repeats}, "
        f"load average before: {os.getloadavg()[0]:.2f}"
    )
    print(f"# batchline server args: {' '.join(ours_args) or '(defaults)'}")
    results: list[Result] = []
    try:
        for s in servers.values():
            s.start(workdir)
        plan = [("short", c, short_file) for c in args.concurrency]
        plan += [("mixed", c, mixed_file) for c in args.mixed_concurrency]
        for workload, conc, file in plan:
            res = Result(workload, conc)
            for rep in range(args.repeats):
                order = list(servers) if rep % 2 == 0 else list(reversed(servers))
                for name in order:
                    # retry a point that other processes disturbed; keep the quietest try
                    tries: list[Point] = []
                    for _ in range(1 + args.retries):
                        wait_for_quiet(args.quiet_cores, args.quiet_patience_s)
                        pt = measure(
                            servers[name],
                            conc,
                            args.duration,
                            args.warmup,
                            file,
                            lua,
                            loadgen_cpus,
                            args.requests,
                        )
                        tries.append(pt)
                        flag = "" if pt.background <= args.quiet_cores else "  (disturbed)"
                        print(
                            f"  {workload:<5} c={conc:<3} {name:<9} {pt.rps:8.0f} req/s  "
                            f"p50 {pt.p50_ms:7.2f}  p99 {pt.p99_ms:7.2f} ms  "
                            f"batch {pt.avg_batch:5.1f}  srv {pt.server_cpu:.2f} cores "
                            f"{pt.cpu_ms_per_request:.3f} ms/req  "
                            f"loadgen {pt.loadgen_cpu:.2f}  err {pt.errors}  "
                            f"background {pt.background:.2f} cores{flag}",
                            flush=True,
                        )
                        if pt.background <= args.quiet_cores:
                            break
                    res.points.setdefault(name, []).append(min(tries, key=lambda p: p.background))
            results.append(res)
    finally:
        codes = {name: s.stop() for name, s in servers.items()}
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"# load average after: {os.getloadavg()[0]:.2f}; server exit codes: {codes}")
    print()
    print("## server CPU per request (ms, from /proc; median point by req/s)")
    for r in results:
        cells = "  ".join(f"{n} {r.best(n).cpu_ms_per_request:.3f}" for n in servers)
        print(f"{r.workload:<8} c={r.conc:<3} {cells}")
    print()
    for name in variants:
        print(f"## {name} vs baseline")
        print_table(results, "baseline", name)
        print()
        for line in check_goals(results, "baseline", name):
            print("goal", line)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
