"""Rotating heavy traffic across models under a memory budget that holds one: does the
residency thrash?

The hostile round of issue 53: three default embedders behind one ``batchline serve
--memory-budget 600MiB`` (``a=default``, ``b=default``, ``c=default``: each load is a real
one, ~90 MB of weights and an ONNX Runtime session, and only one fits), ``--clients`` closed
loops (16), each request ``--texts`` long texts (32 of ~``--words`` 400 words: every text is
cut at the model's 256 tokens, so each request is heavy). Two phases on the same server, one
after the other, ``--seconds`` each:

* ``one``: every request to ``a``: the same load on one model (no swap after the first load);
* ``rotating``: the requests go round the three models: ``--rotation shifted`` (client i's
  k-th request to model (i + k) % 3) or ``random`` (each request picks one, seeded), or
  ``both`` (two rotating phases).

Printed per phase: requests answered (200), 504s and other errors, the loads the server made
(``batchline_model_loads_total``), answered per load, p50/p99 latency; then each rotating
phase's ratio of answered requests against ``one`` (same duration, same server, same run).
Goal (issue 53): 0 x 504, ratio >= 0.5. The hostile round saw 117 of 323 requests end in 504
with a reload on most turns: a loaded model took every new request for itself while the
others waited past ``request_timeout_s``, and which waiting model loaded next was left to
chance. The residency now loads in the order the models were asked for, and once a model
has waited a third of ``request_timeout_s`` for room, holds back new requests for the loaded
one, which serves its queued work and is swapped (``batchline._residency``; the simulated
workload in ``tests/test_residency_rotation.py``).

Usage::

    python benchmarks/bench_rotation.py                 # the full run (~4 minutes)
    python benchmarks/bench_rotation.py --smoke         # a short run: the script works

Measured: only ``--smoke`` so far (2026-12-01, a shared, loaded 2-core machine: its numbers
say the script runs, nothing about speed). At that size a load (~0.6-2 s here) costs far more
than a request's work, so every rotation thrashes: 2 clients answered ~1-2 requests per load,
6 clients ~3-5, x0.1-0.4 of one model's, before and after the change alike; the full run is
for a quiet machine.

Its clients are loops of its own (raw HTTP/1.1 on keep-alive connections, like
``bench_multimodel``'s): a client that switches model on every request is not what
``batchline.bench``'s load generator expresses.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_multimodel import _WORDS_TEXT, Server, _get, _http_post, _read_response

MODELS = ("a", "b", "c")


def long_texts(rng: random.Random, n: int, words: int) -> list[str]:
    vocabulary = _WORDS_TEXT.split()
    return [" ".join(rng.choice(vocabulary) for _ in range(words)) for _ in range(n)]


def loads_so_far(port: int) -> int:
    """The server's successful loads so far, all models (``/metrics``)."""
    status, body = _get(port, "/metrics")
    if status != 200:
        return 0
    pattern = r'batchline_model_loads_total\{model="[^"]+",outcome="ok"\} ([0-9.e+]+)'
    return int(sum(float(x) for x in re.findall(pattern, body.decode())))


async def phase(
    port: int, plan: str, *, clients: int, texts: int, words: int, seconds: float, seed: int
) -> dict[str, Any]:
    """``clients`` closed loops for ``seconds``; ``plan``: ``one``, ``shifted`` or ``random``."""
    statuses: dict[int, int] = {}
    latencies: list[float] = []
    first_error: list[str] = []
    deadline = time.perf_counter() + seconds

    async def client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        k = 0
        try:
            while time.perf_counter() < deadline:
                if plan == "one":
                    model = MODELS[0]
                elif plan == "shifted":
                    model = MODELS[(i + k) % len(MODELS)]
                else:
                    model = rng.choice(MODELS)
                k += 1
                body = json.dumps({"model": model, "input": long_texts(rng, texts, words)})
                raw = _http_post(
                    "/v1/embeddings", body.encode(), {"Content-Type": "application/json"}
                )
                started = time.perf_counter()
                try:
                    writer.write(raw)
                    status, answer = await asyncio.wait_for(_read_response(reader), 300)
                except (ConnectionError, asyncio.IncompleteReadError) as exc:
                    status, answer = 0, repr(exc).encode()  # the server closed: reconnect
                    writer.close()
                    reader, writer = await asyncio.open_connection("127.0.0.1", port)
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    latencies.append(time.perf_counter() - started)
                elif not first_error:
                    first_error.append(f"{status}: {answer[:300].decode('utf-8', 'replace')}")
        finally:
            writer.close()

    loads_before = loads_so_far(port)
    started = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - started
    latencies.sort()

    def pct(q: float) -> float:
        return latencies[min(len(latencies) - 1, int(q * len(latencies)))] if latencies else 0.0

    return {
        "plan": plan,
        "seconds": elapsed,
        "answered": statuses.get(200, 0),
        "timeouts": statuses.get(504, 0),
        "errors": sum(n for s, n in statuses.items() if s not in (200, 504)),
        "statuses": statuses,
        "loads": loads_so_far(port) - loads_before,
        "p50_s": pct(0.5),
        "p99_s": pct(0.99),
        "first_error": first_error[0] if first_error else None,
    }


def report(rows: list[dict[str, Any]]) -> None:
    print()
    print(f"{'phase':<10} {'answered':>8} {'504':>5} {'other':>5} {'loads':>5} "
          f"{'per load':>8} {'p50 s':>6} {'p99 s':>6} {'seconds':>7}")  # fmt: skip
    for r in rows:
        per_load = r["answered"] / r["loads"] if r["loads"] else float("inf")
        print(
            f"{r['plan']:<10} {r['answered']:>8} {r['timeouts']:>5} {r['errors']:>5} "
            f"{r['loads']:>5} {per_load:>8.1f} {r['p50_s']:>6.2f} {r['p99_s']:>6.2f} "
            f"{r['seconds']:>7.1f}"
        )
        if r["first_error"]:
            print(f"  first error: {r['first_error']}")
    one = rows[0]["answered"]
    for r in rows[1:]:
        ratio = r["answered"] / one if one else float("nan")
        verdict = "ok" if r["timeouts"] == 0 and ratio >= 0.5 else "MISSED"
        print(
            f"{r['plan']}: {r['timeouts']} x 504, answered x{ratio:.2f} of one model's "
            f"(goal: 0 x 504, >= 0.5) {verdict}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, help="closed loops (16; --smoke: 2)")
    p.add_argument("--texts", type=int, help="texts per request (32; --smoke: 4)")
    p.add_argument("--words", type=int, help="words per text (400; --smoke: 40)")
    p.add_argument("--seconds", type=float, help="each phase's length (75; --smoke: 8)")
    p.add_argument("--budget", default="600MiB", help="--memory-budget of the server")
    p.add_argument("--rotation", choices=["shifted", "random", "both"], default="both")
    p.add_argument("--cpus", help="taskset the server to these CPUs (e.g. 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep-log", metavar="DIR", help="write the server's log to DIR/server.log")
    p.add_argument("--smoke", action="store_true", help="a short run: the script works")
    p.add_argument("--serve-arg", action="append", default=[], help="one more serve argument")
    args = p.parse_args(argv)
    sizes = (2, 4, 40, 8.0) if args.smoke else (16, 32, 400, 75.0)
    for name, size in zip(("clients", "texts", "words", "seconds"), sizes, strict=True):
        if getattr(args, name) is None:
            setattr(args, name, size)
    plans = ["one", *(["shifted", "random"] if args.rotation == "both" else [args.rotation])]
    serve = ["--memory-budget", args.budget, *args.serve_arg]
    for name in MODELS:
        serve += ["--model", f"{name}=default"]
    print(
        f"{args.clients} clients x {args.texts} texts of {args.words} words, phases of "
        f"{args.seconds:.0f} s: {', '.join(plans)}; budget {args.budget}",
        flush=True,
    )
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(serve, args.cpus, Path(args.keep_log) if args.keep_log else Path(tmp))
        server.start(timeout_s=180)
        try:
            rows = []
            for plan in plans:
                row = asyncio.run(
                    phase(
                        server.port,
                        plan,
                        clients=args.clients,
                        texts=args.texts,
                        words=args.words,
                        seconds=args.seconds,
                        seed=args.seed,
                    )
                )
                print(json.dumps(row), flush=True)
                rows.append(row)
        finally:
            server.stop()
    report(rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
