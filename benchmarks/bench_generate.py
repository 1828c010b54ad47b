"""Generation benchmark: sequential vs static vs continuous batching, same model, one run.

A thin wrapper over ``batchline bench --task generate`` (``batchline.bench.generate``) that
keeps this script's flags. The three generators are built in turn over the same loaded
engine (SmolLM2-135M-Instruct through the torch step engine by default), in interleaved
repeats (rotating which goes first), on the same workload: the built-in demo math prompts
with ``max_tokens`` drawn per request (seeded) between ``--min-new`` and ``--max-new`` and
``ignore_eos=True``, so every request generates exactly what it asked for.

Closed loop (default): ``--clients`` clients (16) each submit a request, await its result,
and submit the next, until the configuration's request count is done. Open loop
(``--mode open``): requests arrive as a Poisson process at ``--rate`` per second, latency and
TTFT from each request's intended send time; there the throughput is capped by the arrival
rate, so only latencies and TTFT are compared.

Printed per configuration: generated tokens/s, request latency p50/p99, TTFT p50/p99 and
ITL p50 (medians over repeats), then the ratios the goals use:

    continuous / static throughput      goal >= 1.3
    continuous / static p99 latency     goal <= 0.8
    continuous / sequential tok/s    goal >= 2.5
    continuous / static TTFT p99        goal <= 0.5

    python benchmarks/bench_generate.py             # real model, CPU, ~3-4 min on a quiet machine
    python benchmarks/bench_generate.py --fake      # smoke run on the fake engine (seconds)
    python benchmarks/bench_generate.py -o report   # also report.md, results.json and plots

The same through the CLI (several load points, one report):

    batchline bench --model smollm2 --load closed:16 --load open:1 -o report

Sequential runs fewer requests than the batched ones (``--sequential-requests``): it is
slow, and only its throughput enters a ratio. Run it on a quiet machine; the load average is
printed at the start and the end.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from batchline._errors import BatchlineError
from batchline.bench.generate import GenerateBenchOptions, fake_parts, run_generate_bench
from batchline.bench.loadgen import LoadPoint
from batchline.bench.report import print_generate_table, write_generate_report

CONFIGS = ("sequential", "static", "continuous")
# this script's names for the bench's configurations
_NAMES = {"sequential": "sequential", "static": "static", "continuous": "continuous"}


def _print(text: str) -> None:
    print(text, flush=True)


def options_from(args: argparse.Namespace) -> GenerateBenchOptions:
    """This script's flags as the bench's options."""
    load = (
        LoadPoint("closed", args.clients) if args.mode == "closed" else LoadPoint("open", args.rate)
    )
    return GenerateBenchOptions(
        model=args.model,
        loads=[load],
        requests=args.requests,
        sequential_requests=args.sequential_requests,
        repeats=args.repeats,
        min_new=args.min_new,
        max_new=args.max_new,
        generators=[_NAMES[c] for c in CONFIGS if c in args.configs.split(",")],
        device=args.device,
        threads=args.threads,
        max_running_sequences=args.clients,  # as before: every client's request may run
        kv_token_budget=args.kv_budget,
        seed=args.seed,
    )


def main(argv: Sequence[str] | None = None) -> None:
    args = parse(argv)
    load0 = os.getloadavg()[0]
    print(
        f"# engine: {'fake' if args.fake else args.model}; load average at the start: {load0:.2f}"
    )
    try:
        result = run_generate_bench(
            options_from(args), _print, parts=fake_parts() if args.fake else None
        )
    except (BatchlineError, ImportError) as exc:
        sys.exit(f"bench_generate: {exc}")
    print_generate_table(result)
    if args.output is not None:
        files = write_generate_report(result, args.output)
        print(f"report: {files['report']}")
    print(f"\n# load average at the end: {os.getloadavg()[0]:.2f} (at the start: {load0:.2f})")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fake", action="store_true", help="the fake engine (a smoke run)")
    p.add_argument("--model", default="smollm2", help="smollm2 (default) or a folder PATH/")
    p.add_argument("--mode", choices=("closed", "open"), default="closed")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients; also max_running")
    p.add_argument("--requests", type=int, default=32, help="requests per static/continuous run")
    p.add_argument("--sequential-requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    p.add_argument("--kv-budget", type=int, default=None, help="default: clients x longest request")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, help="torch intra-op threads (default: the engine's own choice)"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument("-o", "--output", type=Path, help="also write report.md, results.json, plots")
    args = p.parse_args(argv)
    if args.sequential_requests is None:
        args.sequential_requests = 8 if args.fake else 6
    if args.rate is None:
        args.rate = 40.0 if args.fake else 1.0
    if not 1 <= args.min_new <= args.max_new:
        p.error("need 1 <= --min-new <= --max-new")
    return args


if __name__ == "__main__":
    main()
