"""The running cap measured against fixed ones, on an offline generation job, in one run.

Issue 32, part 3: larger running batches where they pay, with an admission rule that measures
a row's marginal cost. Three configurations of the continuous scheduler over the same loaded
engine (SmolLM2-135M-Instruct, the torch backend, ``--dtype``):

- ``fixed 16``: the cap before this rule (``start_running = max_running = 16``);
- ``measured``: the defaults, the cap starting at 16 and moved by the measured cost of a row
  between 16 and 64 (``generation/admission.py``);
- ``fixed 64``: every row the ceiling allows, measured or not.

The workload is what ``batchline run --task generate`` submits: the built-in demo math
prompts, all queued at once (the job keeps 4 x the cap in flight, far more than run), with
``max_tokens`` drawn per request (seeded) between ``--min-new`` and ``--max-new`` and
``ignore_eos``, so each configuration generates exactly the same tokens. A first pass at 2
tokens a request warms the engine and its prefix cache for all three alike; then the
configurations take turns in ``--repeats`` interleaved rounds.

Printed per configuration (medians over repeats): tokens/s, inter-token p50 / p99, the mean
running rows per step and the cap at the end; then tokens/s and inter-token p50 as ratios of
``fixed 16``.

    python benchmarks/bench_running_cap.py                 # ~4 min on a quiet 2-core machine
    python benchmarks/bench_running_cap.py --requests 64 --repeats 1 --max-new 32  # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from batchline.bench.generate import (
    GenerateBenchOptions,
    ModelParts,
    Work,
    build_work,
    load_parts,
)
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.engine import SamplingParams

#: name -> (start_running, max_running)
CONFIGS = {"fixed 16": (16, 16), "measured": (16, 64), "fixed 64": (64, 64)}


async def one_run(
    parts: ModelParts, work: list[Work], start: int, cap: int, budget: int
) -> dict[str, float]:
    gen = ContinuousGenerator(
        parts.engine,
        parts.detokenizer,
        max_running=cap,
        start_running=start,
        kv_token_budget=budget,
        max_waiting=len(work),
    )
    async with gen:
        t0 = time.perf_counter()
        streams = [
            gen.submit(w.prompt_ids, SamplingParams(max_tokens=w.max_tokens, ignore_eos=True))
            for w in work
        ]
        done = await asyncio.gather(*(s.result() for s in streams))
        wall = time.perf_counter() - t0
        stats = gen.stats
    tokens = sum(d.completion_tokens for d in done)
    assert tokens == sum(w.max_tokens for w in work), "a request did not finish"
    return {
        "tokens_per_s": tokens / wall,
        "itl_p50_ms": stats.itl_p50_s * 1000,
        "itl_p99_ms": stats.itl_p99_s * 1000,
        "avg_running": stats.avg_running_per_step,
        "cap": stats.running_cap,
    }


async def main_async(args: argparse.Namespace) -> None:
    options = GenerateBenchOptions(
        requests=args.requests,
        sequential_requests=1,
        min_new=args.min_new,
        max_new=args.max_new,
        dtype=args.dtype,
        seed=args.seed,
    )
    print(f"loading smollm2 ({args.dtype}) ...", flush=True)
    parts = await asyncio.to_thread(load_parts, options)
    work = build_work(parts, options)[: args.requests]
    longest = max(len(w.prompt_ids) for w in work)
    widest = max(cap for _, cap in CONFIGS.values())
    budget = widest * (longest + args.max_new)  # room for every row of the widest cap
    print(
        f"workload: {len(work)} demo math prompts queued at once, "
        f"{min(len(w.prompt_ids) for w in work)}-{longest} prompt tokens, max_tokens "
        f"{args.min_new}-{args.max_new} (seeded, ignore_eos), dtype {parts.dtype}, "
        f"kv_token_budget {budget}, {args.repeats} interleaved repeats",
        flush=True,
    )
    await one_run(parts, [Work(w.prompt_ids, 2) for w in work], widest, widest, budget)  # warm
    results: dict[str, list[dict[str, float]]] = {name: [] for name in CONFIGS}
    names = list(CONFIGS)
    for repeat in range(args.repeats):
        order = names[repeat % len(names) :] + names[: repeat % len(names)]
        for name in order:
            start, cap = CONFIGS[name]
            found = await one_run(parts, work, start, cap, budget)
            results[name].append(found)
            print(
                f"  repeat {repeat + 1} {name:>9}: {found['tokens_per_s']:7.1f} tokens/s, "
                f"ITL p50 {found['itl_p50_ms']:5.1f} ms, avg running {found['avg_running']:5.1f}, "
                f"cap at the end {found['cap']}",
                flush=True,
            )
    parts.close()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    base_tps, base_itl = median("fixed 16", "tokens_per_s"), median("fixed 16", "itl_p50_ms")
    print()
    print(
        f"{'config':>9} | tokens/s | x fixed 16 | ITL p50 ms | x fixed 16 | ITL p99 ms | "
        "avg running | cap at end"
    )
    for name in names:
        tps, itl = median(name, "tokens_per_s"), median(name, "itl_p50_ms")
        caps = sorted(r["cap"] for r in results[name])
        print(
            f"{name:>9} | {tps:8.1f} | {tps / base_tps:10.2f} | {itl:10.1f} | "
            f"{itl / base_itl:10.2f} | {median(name, 'itl_p99_ms'):10.1f} | "
            f"{median(name, 'avg_running'):11.1f} | {caps}"
        )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
