"""``batchline serve --engine ray`` against the single-process ``batchline serve``, in one run.

Servers (each ``batchline serve`` in a process of its own, one at a time, on 127.0.0.1;
all-MiniLM-L6-v2):

- ``single``: the single-process server, serve's default knobs;
- ``ray x1``: Ray Serve, one replica with the same knobs (what the ingress costs);
- ``ray x1 1c`` and ``ray x2 1c``: one and two replicas of one session of one intra-op thread
  each (a core each on a 2-core machine, as ``run --engine ray``'s replicas): what a second
  replica adds, with the same knobs per replica;
- ``ray 0-1`` (unless ``--no-cold``): min 0, to time the first request, which waits for a
  replica to start and load the model.

The Ray servers run once per ``--ingress`` (``serve --ray-ingress``: ``proxy``, Serve's Python
proxy; ``haproxy``, HAProxy in front of replicas that serve HTTP themselves), named with it
(``ray x1 haproxy``); the default compares both in one run.

For each server: ``batchline drive`` of the first N demo-corpus records (chunks of 32, at
``--concurrency`` = replicas x the autoscaling target of 10, as the README advises; 10 for
``single``), then the proxy's overhead with the lean asyncio load generator of
``bench_serve.py`` (one short text per request, closed loop): p50 at c=1 and req/s at c=32.
Ratios are against ``single``. Goals at one replica: c=1 p50 <= +2 ms, c=32 >= 0.9x.
Servers run one after the other (a Ray server starts in ~20-30 s, so points cannot be
interleaved as ``bench_serve.py`` does): ``--repeats`` cycles through them again and the
median is kept; on a shared machine, compare only figures of the same run.

Usage::

    python benchmarks/bench_ray_serve.py                 # 3,000 records, 8 s per point
    python benchmarks/bench_ray_serve.py --quick         # smoke: 256 records, 2 s per point
    python benchmarks/bench_ray_serve.py --ingress haproxy --no-cold   # one ingress only
    python benchmarks/bench_ray_serve.py --ingress haproxy --no-cold --overhead-only --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_serve import Server, bodies, make_texts, run_asyncio_loadgen

from batchline.datasets.corpus import demo_corpus_path
from batchline.driver.drive import DriveOptions, drive

TARGET_ONGOING = 10
ONE_CORE = ["--sessions", "1", "--set", "intra_op_threads=1", "--set", "solo_intra_op_threads=null"]
GOAL_P50_ADDED_MS = 2.0
GOAL_RPS_RATIO = 0.9


@dataclass(frozen=True)
class Config:
    name: str
    args: list[str]
    replicas: int  # drive concurrency = replicas x TARGET_ONGOING


RAY = ["--engine", "ray", "--target-ongoing", str(TARGET_ONGOING)]
INGRESSES = ("proxy", "haproxy")


def configs(ingresses: list[str], *, overhead_only: bool = False) -> list[Config]:
    """``single``, then the Ray servers once per ingress (one replica of serve's knobs only,
    with ``overhead_only``)."""
    out = [Config("single", [], 1)]
    for ingress in ingresses:
        ray = [*RAY, "--ray-ingress", ingress]
        out.append(Config(f"ray x1 {ingress}", [*ray, "--replicas", "1"], 1))
        if not overhead_only:
            out += [
                Config(f"ray x1 1c {ingress}", [*ray, "--replicas", "1", *ONE_CORE], 1),
                Config(f"ray x2 1c {ingress}", [*ray, "--replicas", "2", *ONE_CORE], 2),
            ]
    return out


@dataclass
class Figures:
    drive_rps: list[float] = field(default_factory=list)
    p50_c1_ms: list[float] = field(default_factory=list)
    rps_c32: list[float] = field(default_factory=list)
    errors: int = 0
    start_s: list[float] = field(default_factory=list)

    def median(self, name: str) -> float:
        values: list[float] = getattr(self, name)
        return statistics.median(values) if values else float("nan")


def measure(
    config: Config, corpus: Path, n: int, seconds: float, bodies_file: Path, tmp: Path
) -> Figures:
    fig = Figures()
    server = Server(config.name.replace(" ", "-"), config.args, None)
    t0 = time.perf_counter()
    server.start(tmp)
    fig.start_s.append(time.perf_counter() - t0)
    url = f"http://127.0.0.1:{server.port}"
    try:
        run_asyncio_loadgen(server.port, 4, min(2.0, seconds), bodies_file, None)  # warm-up
        summary = drive(
            DriveOptions(
                input=corpus,
                endpoints=[url],
                output=tmp / f"out-{config.name.replace(' ', '-')}",
                overwrite=True,
                limit=n,
                chunk_size=32,
                concurrency=config.replicas * TARGET_ONGOING,
            )
        )
        if summary.exit_code != 0:
            raise SystemExit(f"{config.name}: drive failed: {summary}")
        fig.drive_rps.append(summary.records / summary.wall_s)
        for conc in (1, 32):
            point = run_asyncio_loadgen(server.port, conc, seconds, bodies_file, None)
            fig.errors += point.errors
            if conc == 1:
                fig.p50_c1_ms.append(point.p50_ms)
            else:
                fig.rps_c32.append(point.rps)
    finally:
        code = server.stop()
        if code not in (0, None):
            print(f"  {config.name}: exit code {code}; log: {server.log}")
    return fig


def cold_start(tmp: Path, ingress: str) -> tuple[float, float]:
    """(seconds until /ready, seconds of the first request) with --replicas 0-1."""
    import httpx

    argv = ["--engine", "ray", "--replicas", "0-1", "--ray-ingress", ingress]
    server = Server(f"ray-0-1-{ingress}", argv, None)
    t0 = time.perf_counter()
    server.start(tmp)
    ready_s = time.perf_counter() - t0
    try:
        t1 = time.perf_counter()
        r = httpx.post(
            f"http://127.0.0.1:{server.port}/v1/embeddings",
            json={"input": ["the first request wakes a replica"]},
            timeout=120,
        )
        first_s = time.perf_counter() - t1
        if r.status_code != 200:
            raise SystemExit(f"cold start: {r.status_code} {r.text}")
    finally:
        server.stop()
    return ready_s, first_s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="smoke: 256 records, 2 s per point")
    ap.add_argument("-n", type=int, default=None, help="records driven (default 3000)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per load point (8)")
    ap.add_argument("--repeats", type=int, default=1, help="cycles through the servers")
    ap.add_argument("--no-cold", action="store_true", help="skip the first-request-from-zero")
    ap.add_argument(
        "--overhead-only",
        action="store_true",
        help="single and one Ray replica per ingress: the ingress' overhead, no 1-core pair",
    )
    ap.add_argument(
        "--ingress",
        default=",".join(INGRESSES),
        help="serve --ray-ingress of the Ray servers, comma-separated (default: proxy,haproxy)",
    )
    args = ap.parse_args(argv)
    ingresses = [i.strip() for i in args.ingress.split(",") if i.strip()]
    if not ingresses or not set(ingresses) <= set(INGRESSES):
        ap.error(f"--ingress {args.ingress!r}: expected some of {', '.join(INGRESSES)}")
    servers = configs(ingresses, overhead_only=args.overhead_only)
    n = args.n or (256 if args.quick else 3000)
    seconds = args.duration or (2.0 if args.quick else 8.0)
    corpus = demo_corpus_path()
    print(
        f"bench_ray_serve: drive {n:,} records of {corpus.name}; load points of {seconds:g} s; "
        f"{args.repeats} repeat(s); {os.cpu_count()} cores; load avg {os.getloadavg()[0]:.1f}"
    )
    results = {c.name: Figures() for c in servers}
    with tempfile.TemporaryDirectory(prefix="bench-ray-serve-") as tmp_name:
        tmp = Path(tmp_name)
        bodies_file = tmp / "short.jsonl"
        texts = make_texts(500, 8, 24, seed=1)
        bodies_file.write_bytes(b"\n".join(bodies(texts, "all-MiniLM-L6-v2")) + b"\n")
        for _ in range(args.repeats):
            for config in servers:
                fig = measure(config, corpus, n, seconds, bodies_file, tmp)
                into = results[config.name]
                for name in ("drive_rps", "p50_c1_ms", "rps_c32", "start_s"):
                    getattr(into, name).extend(getattr(fig, name))
                into.errors += fig.errors
                print(
                    f"  {config.name:17} started in {fig.start_s[0]:5.1f} s | drive "
                    f"{fig.drive_rps[0]:7.1f} rec/s | c=1 p50 {fig.p50_c1_ms[0]:6.2f} ms | "
                    f"c=32 {fig.rps_c32[0]:7.1f} req/s",
                    flush=True,
                )
        cold = {} if args.no_cold else {i: cold_start(tmp, i) for i in ingresses}

    base = results["single"]
    print()
    print(
        "server            | drive rec/s   x single | c=1 p50 ms  added | c=32 req/s  x single "
        "| non-2xx"
    )
    for config in servers:
        r = results[config.name]
        drive_rps, p50, rps = r.median("drive_rps"), r.median("p50_c1_ms"), r.median("rps_c32")
        print(
            f"{config.name:17} | {drive_rps:11.1f} {drive_rps / base.median('drive_rps'):8.2f}x | "
            f"{p50:10.2f} {p50 - base.median('p50_c1_ms'):+6.2f} | "
            f"{rps:10.1f} {rps / base.median('rps_c32'):8.2f}x | {r.errors}"
        )
    print()
    for ingress in ingresses:
        ray1 = results[f"ray x1 {ingress}"]
        added = ray1.median("p50_c1_ms") - base.median("p50_c1_ms")
        ratio = ray1.median("rps_c32") / base.median("rps_c32")
        met = added <= GOAL_P50_ADDED_MS and ratio >= GOAL_RPS_RATIO
        if not args.overhead_only:
            one, two = results[f"ray x1 1c {ingress}"], results[f"ray x2 1c {ingress}"]
            x2 = two.median("drive_rps") / one.median("drive_rps")
            print(f"{ingress}: drive, 2 replicas against 1 (one core each) x{x2:.2f}")
        print(
            f"{ingress}: overhead at one replica: c=1 p50 {added:+.2f} ms (goal <= "
            f"+{GOAL_P50_ADDED_MS:g}), c=32 x{ratio:.2f} req/s (goal >= {GOAL_RPS_RATIO:g}): "
            + ("met" if met else "NOT met")
        )
    for ingress, (ready_s, first_s) in cold.items():
        print(
            f"{ingress}, --replicas 0-1: ready in {ready_s:.1f} s (no replica), first request "
            f"{first_s:.2f} s (a replica started and loaded the model meanwhile)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
