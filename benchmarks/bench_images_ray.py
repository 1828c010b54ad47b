"""An image job on Ray: ``batchline run IMAGES/ --engine ray`` with 2 replicas x 1 CPU against
1 replica x 1 CPU, in one run.

Pictures: the image benchmark's (``bench_images.make_images``: 2,000 JPEGs of 0.3 to 12
megapixels from a fixed seed, written once to ``--workdir``). Model: its classifier
(``bench_images.build_model``: ViT-S/16 as ONNX, random weights, 1,000 classes; ``--model
tiny`` for smoke runs). Each replica decodes its own units' pictures (docs/ray.md) and runs the
model; the driver reads, hashes (its duplicate check) and writes.

**One CPU per replica, really.** A replica has one ONNX session of one intra-op thread
(``cpus_per_replica=1``) and one decode worker process (``DecodeOptions(workers=1)``); and,
since decode and the model would otherwise run side by side on two cores (making the 1 x 1
baseline a 2-core run and the ratio meaningless), every thread of each replica's process is
pinned to one core of its own (``os.sched_setaffinity``, replica ``i`` on the ``i``-th core this
process may use) as soon as the replicas have loaded the model, before any unit is sent; the
decode worker it starts later inherits that core. The driver is not pinned (the same in both
runs). The pinning wraps ``batchline.integrations.ray._start_replicas`` (Linux only).

Throughput is the summary's ``records / wall_s`` (from the replicas ready to the last chunk
committed; Ray's start and the model loads are reported apart). Runs alternate (1, 2, 1, 2)
so drift hits both; the best of each is kept. Goal: 2 x 1 >= 1.6 x (1 x 1).

Usage::

    python benchmarks/bench_images_ray.py                          # 2,000 pictures, ViT-S/16
    python benchmarks/bench_images_ray.py --images 48 --model tiny --repeats 1   # smoke
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
sys.path.insert(0, str(Path(__file__).parent))

import ray
from bench_images import build_model, picture_folder

import batchline.integrations.ray as ray_engine
from batchline.integrations.ray import RaySummary, run_on_ray
from batchline.jobs.run import RunOptions
from batchline.models.config import Knobs
from batchline.models.image import DecodeOptions

GOAL = 1.6


def pin(pid: int, core: int) -> int:
    """Every thread of process ``pid`` on ``core``; the threads pinned (0: it is gone)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return 0
    pinned = 0
    for tid in tids:
        try:
            os.sched_setaffinity(int(tid), {core})
            pinned += 1
        except (ProcessLookupError, FileNotFoundError):
            pass  # the thread ended meanwhile
    return pinned


def pin_replicas_when_ready(cores: Sequence[int]) -> None:
    """Wrap the engine's replica start so that replica ``i`` is pinned to ``cores[i]`` once
    it has loaded its model, before the driver sends it anything."""
    start = ray_engine._start_replicas

    def started(*args: Any, **kwargs: Any) -> Any:
        actors = start(*args, **kwargs)
        for i, (_, ready) in enumerate(actors):
            core = cores[i % len(cores)]
            if pin(ready.pid, core) == 0 or os.sched_getaffinity(ready.pid) != {core}:
                raise SystemExit(f"replica {i} (pid {ready.pid}) could not be pinned")
        return actors

    ray_engine._start_replicas = started


def ray_run(images: Path, model: Path, out: Path, replicas: int, unit: int) -> RaySummary:
    options = RunOptions(
        input=images,
        output=out,
        model=str(model),
        overwrite=True,
        knobs=Knobs(),
        decode=DecodeOptions(workers=1),  # one decode process per replica
    )
    return run_on_ray(options, replicas=replicas, cpus_per_replica=1.0, unit_records=unit)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--images", type=int, default=2000)
    ap.add_argument("--model", choices=("vit-s16", "resnet50", "tiny"), default="vit-s16")
    ap.add_argument("--repeats", type=int, default=2, help="runs per side (the best is kept)")
    ap.add_argument("--workdir", type=Path, default=None, help="keeps pictures and the model")
    ap.add_argument(
        "--unit-records",
        type=int,
        default=64,
        help="pictures per unit: small enough that the replicas end together",
    )
    args = ap.parse_args(argv)

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit(f"needs 2 cores to pin 2 replicas to, has {len(cores)}")
    work = args.workdir or Path(tempfile.gettempdir()) / "bench-images-ray"
    work.mkdir(parents=True, exist_ok=True)
    pictures, images = picture_folder(work, args.images)
    model = build_model(args.model, work)
    pin_replicas_when_ready(cores[:2])

    print(f"bench_images_ray: {len(pictures):,} pictures, {args.model}, {args.repeats} run(s) "
          f"per side, replicas pinned to cores {cores[:2]}")  # fmt: skip
    t0 = time.perf_counter()
    ray.init(
        address="local", num_cpus=len(cores), include_dashboard=False, logging_level=logging.WARNING
    )
    print(f"ray.init: {time.perf_counter() - t0:.1f} s")
    rates: dict[int, list[float]] = {1: [], 2: []}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-images-ray-") as tmp:
            for i in range(args.repeats):
                for replicas in (1, 2):
                    s = ray_run(images, model, Path(tmp) / "out", replicas, args.unit_records)
                    rates[replicas].append(s.records_per_s)
                    print(
                        f"  run {i + 1}, {replicas} x 1 CPU: {s.records_per_s:7.1f} pictures/s "
                        f"({s.records:,} in {s.wall_s:.1f} s; start-up {s.startup_s:.1f} s; "
                        f"replica cores used {s.cores_used:.2f}; failed {s.skipped})"
                    )
    finally:
        ray.shutdown()
    one, two = max(rates[1]), max(rates[2])
    ratio = two / one
    print(f"\n1 replica x 1 CPU:  {one:.1f} pictures/s (best)")
    print(f"2 replicas x 1 CPU: {two:.1f} pictures/s (best)")
    verdict = "meets" if ratio >= GOAL else "below"
    print(f"ratio: {ratio:.2f}x ({verdict} the goal of {GOAL}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
