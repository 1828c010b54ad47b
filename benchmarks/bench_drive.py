"""``batchline drive`` throughput: two local replicas against one, measured in the same run.

Each replica is ``batchline serve`` with one ONNX session of one intra-op thread, so two of
them fit on a 2-core machine; the driver runs in this process. The input is a spread of the
demo corpus (real docstring paragraphs, median ~66 tokens). Runs of 1 and 2 replicas are
interleaved, after a warm-up of each replica; the ratio of the medians and the median of the
per-repeat ratios (robust to drifts in the load of a shared machine) are printed.

    python benchmarks/bench_drive.py            # 3,000 records, 3 repeats (~3-4 min)
    python benchmarks/bench_drive.py --quick    # 600 records, 1 repeat (smoke run)

Replicas are started on free ports on 127.0.0.1 and stopped by PID at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO

import httpx

from batchline.datasets.corpus import demo_corpus_path
from batchline.driver.drive import DriveOptions, DriveSummary, drive_job


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class Replica:
    """One ``batchline serve`` subprocess (``extra``: more of its flags, e.g. ``--model``)."""

    def __init__(self, folder: Path, config: Path, *extra: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log: IO[bytes] = open(folder / f"serve-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "batchline",
                "serve",
                "--port",
                str(self.port),
                "--config",
                str(config),
                "--log-level",
                "warning",
                *extra,
            ],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"replica on port {self.port} exited; see its log")
                try:
                    if client.get(self.url + "/ready").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"replica on port {self.port} not ready after {timeout_s} s")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(30)
        self._log.close()


def make_input(folder: Path, n: int) -> Path:
    """``n`` records spread evenly over the demo corpus (its order groups similar modules)."""
    lines = demo_corpus_path().read_text(encoding="utf-8").splitlines()
    step = max(1, len(lines) // n)
    picked = lines[::step][:n]
    path = folder / f"corpus-{n}.jsonl"
    path.write_text("\n".join(picked) + "\n", encoding="utf-8")
    return path


async def drive_once(
    src: Path, out: Path, urls: list[str], *, concurrency: int, chunk_size: int
) -> DriveSummary:
    return await drive_job(
        DriveOptions(
            input=src,
            output=out,
            endpoints=urls,
            overwrite=True,
            concurrency=concurrency,
            chunk_size=chunk_size,
        )
    )


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-drive-") as tmp:
        folder = Path(tmp)
        config = folder / "serve.json"
        config.write_text(json.dumps({"sessions": 1, "intra_op_threads": 1}))
        src = make_input(folder, args.records)
        warm = make_input(folder, args.warmup_records)
        replicas = [Replica(folder, config), Replica(folder, config)]
        try:
            for r in replicas:
                r.wait_ready()
            for r in replicas:  # first calls allocate and fill caches: keep them out of the runs
                await drive_once(
                    warm, folder / "warm", [r.url], concurrency=2, chunk_size=args.chunk_size
                )
            layouts = {1: [replicas[0].url], 2: [r.url for r in replicas]}
            rates: dict[int, list[float]] = {1: [], 2: []}
            print(
                f"{args.records} records, chunks of {args.chunk_size}, "
                f"concurrency {args.concurrency}; replicas: 1 session x 1 thread each"
            )
            for repeat in range(args.repeats):
                order = (1, 2) if repeat % 2 == 0 else (2, 1)
                for n in order:
                    summary = await drive_once(
                        src,
                        folder / f"out-{n}",
                        layouts[n],
                        concurrency=args.concurrency,
                        chunk_size=args.chunk_size,
                    )
                    if summary.records != args.records or summary.failed_total:
                        raise RuntimeError(f"incomplete run: {summary}")
                    rates[n].append(summary.records_per_s)
                    per = ", ".join(f"{e.requests} req" for e in summary.endpoints)
                    print(
                        f"  repeat {repeat + 1}: {n} replica(s): "
                        f"{summary.records_per_s:7.1f} records/s "
                        f"({summary.wall_s:.1f} s; {per}; {summary.retries} retries)"
                    )
        finally:
            for r in replicas:
                r.stop()
    one, two = statistics.median(rates[1]), statistics.median(rates[2])
    # each repeat ran both layouts back to back: its own ratio cancels slow drifts in the
    # machine's load (it is shared), which the ratio of medians does not
    pairs = [b / a for a, b in zip(rates[1], rates[2], strict=True)]
    print()
    print(f"1 replica : {one:7.1f} records/s (median of {len(rates[1])})")
    print(f"2 replicas: {two:7.1f} records/s (median of {len(rates[2])})")
    print(
        f"ratio 2 vs 1: x{two / one:.2f} (medians); per repeat: "
        + ", ".join(f"x{r:.2f}" for r in pairs)
    )
    print(f"median of per-repeat ratios: x{statistics.median(pairs):.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="600 records, 1 repeat")
    parser.add_argument("--records", type=int, default=3000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-size", type=int, default=50)
    parser.add_argument(
        "--concurrency", type=int, default=8, help="chunks in flight (both layouts)"
    )
    parser.add_argument("--warmup-records", type=int, default=200)
    args = parser.parse_args()
    if args.quick:
        args.records, args.repeats, args.warmup_records = 600, 1, 100
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
