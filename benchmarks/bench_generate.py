"""Generation benchmark: one-at-a-time vs static vs continuous batching, same model, one run.

The three generators drive the same engine (SmolLM2-135M-Instruct through the torch step
engine by default), in interleaved repeats (rotating which goes first), on the same workload:
the built-in demo math prompts with ``max_tokens`` drawn per request (seeded) between
``--min-new`` and ``--max-new`` and ``ignore_eos=True``, so every request generates exactly
what it asked for.

Closed loop (default): ``--clients`` clients (16) each submit a request, await its result,
and submit the next, until the configuration's request count is done. Open loop
(``--mode open``): requests arrive as a Poisson process at ``--rate`` per second; there the
throughput is capped by the arrival rate, so compare latencies and TTFT, not tokens/s.

Printed per configuration: generated tokens/s, request latency p50/p99, TTFT p50/p99 and
ITL p50 (medians over repeats), then the ratios the goals use:

    continuous / static throughput      goal >= 1.3
    continuous / static p99 latency     goal <= 0.8
    continuous / one-at-a-time tok/s    goal >= 2.5
    continuous / static TTFT p99        goal <= 0.5

    python benchmarks/bench_generate.py             # real model, CPU, ~3-4 min on a quiet machine
    python benchmarks/bench_generate.py --fake      # smoke run on the fake engine (seconds)

One-at-a-time runs fewer requests than the batched ones (``--sequential-requests``): it is
slow, and only its throughput enters a ratio. Run it on a quiet machine; the load average is
printed at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from batchline import QueueFullError
from batchline._stats import percentile
from batchline.models.generation.demo import demo_prompts
from batchline.models.generation.engine import SamplingParams, StepEngine
from batchline.models.generation.fake import FakeEngine, FakeTokenizer, StepCost
from batchline.models.generation.scheduler import ContinuousGenerator
from batchline.models.generation.static import SequentialGenerator, StaticGenerator
from batchline.models.generation.stream import Completion, Detokenizer, TextGenerator

CONFIGS = ("sequential", "static", "continuous")


@dataclass(frozen=True)
class Work:
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass
class Result:
    config: str
    repeat: int
    wall_s: float
    tokens: int
    latencies: list[float]
    ttfts: list[float]
    itl_p50: float
    rejected: int

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


# -- the model ----------------------------------------------------------------------------


def load_real(
    threads: int, device: str
) -> tuple[StepEngine, Detokenizer, Callable[[str], list[int]]]:
    """SmolLM2 through the torch step engine, imported by name so this file has no hard
    dependency on it."""
    try:
        torch = importlib.import_module("torch")
        smollm2 = importlib.import_module("batchline.models.generation.smollm2")
        torch_engine = importlib.import_module("batchline.models.generation.torch_engine")
    except ImportError as exc:
        sys.exit(
            f"bench_generate: the real model needs torch, transformers and batchline's torch "
            f"engine ({exc}); install 'batchline[generate]' or run with --fake"
        )
    if not hasattr(smollm2, "load_smollm2") or not hasattr(torch_engine, "TorchStepEngine"):
        sys.exit("bench_generate: load_smollm2/TorchStepEngine not found; run with --fake")
    torch.set_num_threads(threads)  # 2 intra-op threads collapsed on a shared 2-core machine
    model, tokenizer = smollm2.load_smollm2(device=device)
    engine: StepEngine = torch_engine.TorchStepEngine(model)

    def encode(text: str) -> list[int]:
        try:
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            )
        except (ValueError, AttributeError):  # no chat template: the bare question
            chat = text
        return list(tokenizer.encode(chat, add_special_tokens=False))

    return engine, tokenizer, encode


def load_fake() -> tuple[StepEngine, Detokenizer, Callable[[str], list[int]]]:
    # a step costs a fixed part plus a little per sequence: batching pays, as on a real model
    cost = StepCost(fixed_s=0.004, per_sequence_s=0.0004, per_prefill_token_s=0.00001)
    tok = FakeTokenizer()
    return FakeEngine(step_cost=cost, max_context_tokens=4096), tok, tok.encode


def make_generator(
    config: str, engine: StepEngine, detok: Detokenizer, *, max_running: int, kv_budget: int
) -> TextGenerator:
    if config == "sequential":
        return SequentialGenerator(engine, detok)
    if config == "static":
        return StaticGenerator(engine, detok, max_batch_size=max_running, kv_token_budget=kv_budget)
    return ContinuousGenerator(engine, detok, max_running=max_running, kv_token_budget=kv_budget)


# -- load generation ------------------------------------------------------------------------


async def closed_loop(gen: TextGenerator, work: Sequence[Work], clients: int) -> list[Completion]:
    queue = list(reversed(work))
    done: list[Completion] = []

    async def client() -> None:
        while queue:
            item = queue.pop()
            params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
            done.append(await gen.submit(item.prompt_ids, params).result())

    await asyncio.gather(*(client() for _ in range(clients)))
    return done


async def open_loop(
    gen: TextGenerator, work: Sequence[Work], rate: float, rng: random.Random
) -> tuple[list[Completion], int]:
    pending = []
    rejected = 0
    for item in work:
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        try:
            pending.append(gen.submit(item.prompt_ids, params))
        except QueueFullError:
            rejected += 1
        await asyncio.sleep(rng.expovariate(rate))
    return [await s.result() for s in pending], rejected


async def run_one(
    config: str,
    repeat: int,
    engine: StepEngine,
    detok: Detokenizer,
    work: Sequence[Work],
    args: argparse.Namespace,
    kv_budget: int,
) -> Result:
    gen = make_generator(config, engine, detok, max_running=args.clients, kv_budget=kv_budget)
    rejected = 0
    async with gen:
        started = time.perf_counter()
        if args.mode == "closed":
            done = await closed_loop(gen, work, args.clients)
        else:
            rng = random.Random(args.seed * 1000 + repeat)
            done, rejected = await open_loop(gen, work, args.rate, rng)
        wall = time.perf_counter() - started
        stats = gen.stats
    return Result(
        config,
        repeat,
        wall,
        sum(c.completion_tokens for c in done),
        [c.latency_s for c in done],
        [c.ttft_s for c in done if c.ttft_s is not None],
        stats.itl_p50_s,
        rejected,
    )


# -- report ------------------------------------------------------------------------------------


def median(values: Sequence[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def summarize(results: list[Result]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for config in CONFIGS:
        rs = [r for r in results if r.config == config]
        if not rs:
            continue
        table[config] = {
            "tok_s": median([r.tok_s for r in rs]),
            "lat_p50": median([percentile(r.latencies, 50) for r in rs]),
            "lat_p99": median([percentile(r.latencies, 99) for r in rs]),
            "ttft_p50": median([percentile(r.ttfts, 50) for r in rs]),
            "ttft_p99": median([percentile(r.ttfts, 99) for r in rs]),
            "itl_p50": median([r.itl_p50 for r in rs]),
        }
    return table


def ratio_line(name: str, value: float, goal: str, ok: bool) -> str:
    mark = "ok" if ok else "MISSED"
    return f"  {name:<38} {value:6.2f}   goal {goal:<7} {mark}"


def report(results: list[Result]) -> None:
    print("\nper run:")
    for r in results:
        print(
            f"  #{r.repeat} {r.config:<11} {r.tok_s:8.1f} tok/s  {len(r.latencies):3d} requests  "
            f"{r.wall_s:6.1f} s  lat p99 {percentile(r.latencies, 99):7.2f} s  "
            f"ttft p99 {percentile(r.ttfts, 99):7.3f} s"
            + (f"  rejected {r.rejected}" if r.rejected else "")
        )
    table = summarize(results)
    print("\nmedians over repeats:")
    print(
        f"  {'config':<11} {'tok/s':>8} {'lat p50':>9} {'lat p99':>9} {'ttft p50':>9} "
        f"{'ttft p99':>9} {'itl p50':>9}"
    )
    for config, row in table.items():
        print(
            f"  {config:<11} {row['tok_s']:8.1f} {row['lat_p50']:8.2f}s {row['lat_p99']:8.2f}s "
            f"{row['ttft_p50']:8.3f}s {row['ttft_p99']:8.3f}s {row['itl_p50'] * 1e3:7.1f}ms"
        )
    if "continuous" not in table:
        return
    cont = table["continuous"]
    print("\nratios:")
    if "static" in table:
        st = table["static"]
        v = cont["tok_s"] / st["tok_s"]
        print(ratio_line("continuous/static throughput", v, ">= 1.3", v >= 1.3))
        v = cont["lat_p99"] / st["lat_p99"]
        print(ratio_line("continuous/static p99 latency", v, "<= 0.8", v <= 0.8))
        v = cont["ttft_p99"] / st["ttft_p99"]
        print(ratio_line("continuous/static TTFT p99", v, "<= 0.5", v <= 0.5))
    if "sequential" in table:
        v = cont["tok_s"] / table["sequential"]["tok_s"]
        print(ratio_line("continuous/one-at-a-time throughput", v, ">= 2.5", v >= 2.5))


# -- main ----------------------------------------------------------------------------------------


def build_work(
    encode: Callable[[str], list[int]], n: int, lo: int, hi: int, seed: int
) -> list[Work]:
    rng = random.Random(seed)
    prompts = demo_prompts(n, seed=seed)
    return [Work(tuple(encode(p["prompt"])), rng.randint(lo, hi)) for p in prompts]


async def main_async(args: argparse.Namespace) -> None:
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    engine, detok, encode = load_fake() if args.fake else load_real(args.threads, args.device)
    print(
        f"# engine: {'fake' if args.fake else 'smollm2 (torch)'}; loaded in "
        f"{time.perf_counter() - t0:.1f} s; load average at the start: {load0:.2f}"
    )
    work = build_work(encode, args.requests, args.min_new, args.max_new, args.seed)
    longest = max(len(w.prompt_ids) for w in work)
    kv_budget = args.kv_budget or args.clients * (longest + args.max_new)
    print(
        f"# mode {args.mode}, {args.clients} clients, {args.requests} requests per batched run, "
        f"{args.sequential_requests} one-at-a-time, max_tokens {args.min_new}-{args.max_new}, "
        f"prompts {min(len(w.prompt_ids) for w in work)}-{longest} tokens, "
        f"kv budget {kv_budget}, repeats {args.repeats}"
        + (f", rate {args.rate}/s" if args.mode == "open" else "")
    )
    # warm up the model (first calls allocate) outside every measurement
    warm = ContinuousGenerator(engine, detok, max_running=4, kv_token_budget=kv_budget)
    async with warm:
        await asyncio.gather(
            *(warm.submit(w.prompt_ids, SamplingParams(max_tokens=4)).result() for w in work[:4])
        )
    configs = [c for c in CONFIGS if c in args.configs.split(",")]
    results: list[Result] = []
    for repeat in range(args.repeats):
        order = configs[repeat % len(configs) :] + configs[: repeat % len(configs)]
        for config in order:
            n = args.sequential_requests if config == "sequential" else args.requests
            result = await run_one(config, repeat, engine, detok, work[:n], args, kv_budget)
            results.append(result)
            print(
                f"  done #{repeat} {config:<11} {result.tok_s:8.1f} tok/s in {result.wall_s:.1f} s",
                flush=True,
            )
    report(results)
    print(f"\n# load average at the end: {os.getloadavg()[0]:.2f} (at the start: {load0:.2f})")


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--fake", action="store_true", help="the fake engine (a smoke run)")
    p.add_argument("--mode", choices=("closed", "open"), default="closed")
    p.add_argument("--clients", type=int, default=16, help="closed-loop clients; also max_running")
    p.add_argument("--requests", type=int, default=None, help="requests per static/continuous run")
    p.add_argument("--sequential-requests", type=int, default=None)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--min-new", type=int, default=8)
    p.add_argument("--max-new", type=int, default=128)
    p.add_argument("--rate", type=float, default=None, help="open loop: requests per second")
    p.add_argument("--kv-budget", type=int, default=None, help="default: clients x longest request")
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    if args.requests is None:
        args.requests = 32
    if args.sequential_requests is None:
        args.sequential_requests = 8 if args.fake else 6
    if args.rate is None:
        args.rate = 40.0 if args.fake else 1.0
    if not 1 <= args.min_new <= args.max_new:
        p.error("need 1 <= --min-new <= --max-new")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    asyncio.run(main_async(parse(argv)))


if __name__ == "__main__":
    main()
