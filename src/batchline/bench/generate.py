"""``batchline bench --task generate``: sequential, static and continuous batching of one
text generator, on the same loaded model, in one run; and vLLM's engine beside them (``vllm``).

The weights load once (:func:`load_parts`: ``load_text_generator`` on ``--model smollm2`` or
a Hugging Face folder ``PATH/``); each run builds a fresh generator of one kind over the
loaded engine, drives it, and stops it before the next one starts. ``vllm`` loads the same
model on vLLM's engine with the same dtype knob and knobs, for each of its turns (``auto``
chooses alike for both, but for the own engine's int weights on an AVX512-BF16 CPU without
AMX, computed in float32 there: the summary says each engine's dtype)
(:mod:`batchline.bench.generate_vllm`); the torch weights load even for ``vllm`` alone, whose
tokenizer encodes the work once for every configuration. Every configuration gets the same
work at each load point: the built-in math prompts (seeded, encoded once), each with its own
``max_tokens`` drawn between ``min_new`` and ``max_new`` and ``ignore_eos``, so every request
generates exactly what it asked for. Repeats are interleaved: in each, every configuration takes its
turn at every load point, the order of the turns rotating from one repeat to the next.

The load comes from :mod:`batchline.bench.loadgen`, as for every other bench: each run is a
:class:`GenerationTarget` (request ``i`` is the work's prompt ``i``) driven by its loops with a
fixed amount of work instead of a duration, and the figures are read off its samples.

- closed loop (``closed:N``): N clients, each submitting its next request when the previous
  one completes, until the run's requests are done; tokens/s = tokens / wall time.
- open loop (``open:R``): the run's requests arrive as a Poisson process at R per second;
  latency and TTFT run from each request's *intended* send time. Throughput is capped by the
  arrival rate there: compare latencies and TTFT, not tokens/s.

Example::

    from batchline.bench.generate import GenerateBenchOptions, run_generate_bench
    from batchline.bench.loadgen import parse_load

    options = GenerateBenchOptions(model="smollm2", loads=parse_load("closed:16"))
    result = run_generate_bench(options)
    for ratio in result.ratios():
        print(ratio.line())

Sequential runs fewer requests (``sequential_requests``): it is slow, and only its
throughput enters a ratio.
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from batchline._clock import Clock, MonotonicClock
from batchline._errors import InputError, QueueFullError
from batchline.bench.generate_results import (
    ALL_GENERATORS,
    BASELINE_GENERATOR,
    GENERATORS,
    GOALS,
    GenerateBenchResult,
    GenPoint,
    Ratio,
    RunFigures,
    medians,
)
from batchline.bench.loadgen import Counters, LoadPoint, parse_load, run_closed, run_open
from batchline.bench.runner import Say, environment
from batchline.bench.stats import Sample, poisson_arrivals
from batchline.models.generation import (
    Completion,
    Detokenizer,
    GenerationDtype,
    SamplingParams,
    StepEngine,
    TextGenerator,
)

if TYPE_CHECKING:
    from batchline.bench.generate_vllm import StartTurn
    from batchline.models.config import Knobs
    from batchline.models.generation import GeneratorKind

__all__ = [
    "ALL_GENERATORS",
    "DEFAULT_GENERATE_LOAD",
    "GENERATORS",
    "GOALS",
    "GenPoint",
    "GenerateBenchOptions",
    "GenerateBenchResult",
    "GenerationTarget",
    "ModelParts",
    "Ratio",
    "RunFigures",
    "bench_knobs",
    "fake_parts",
    "load_parts",
    "run_generate_bench",
    "run_generate_bench_async",
]

DEFAULT_GENERATE_LOAD = "closed:16"


@dataclass(frozen=True)
class ModelParts:
    """What every generator of a run is built on: one engine (the loaded weights), its
    detokenizer and prompt encoding, ``close`` to free the model afterwards, and the dtype it
    computes in (and why)."""

    name: str
    engine: StepEngine
    detokenizer: Detokenizer
    encode: Callable[[str], list[int]]
    close: Callable[[], None] = lambda: None
    dtype: str = "n/a"


@dataclass
class GenerateBenchOptions:
    """What ``batchline bench --task generate`` measures (see the module docstring).

    ``kv_token_budget`` defaults to ``max_running_sequences`` x (longest prompt + ``max_new``):
    KV room for every running sequence, so only the batching differs between configurations.
    """

    model: str = "smollm2"
    loads: list[LoadPoint] = field(default_factory=lambda: parse_load(DEFAULT_GENERATE_LOAD))
    requests: int = 32
    sequential_requests: int = 6
    repeats: int = 2
    min_new: int = 8
    max_new: int = 128
    generators: Sequence[str] = GENERATORS
    device: str = "cpu"
    threads: int | None = None  # None: the engine's default (load.engine_threads)
    max_running_sequences: int = 16
    kv_token_budget: int | None = None
    dtype: GenerationDtype = "auto"
    max_step_tokens: int | None = None  # None: Knobs' default
    seed: int = 0
    warmup: bool = True
    command: str = ""

    def check(self) -> None:
        """``InputError`` for values that cannot run."""
        if not self.loads:
            raise InputError("no load points given")
        unknown = [g for g in self.generators if g not in ALL_GENERATORS]
        if unknown or not self.generators:
            raise InputError(
                f"--generators takes {', '.join(ALL_GENERATORS)}; got {', '.join(self.generators)}"
            )
        for name in ("requests", "sequential_requests", "repeats", "min_new"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_new < self.min_new:
            raise InputError(f"--max-new ({self.max_new}) must be >= --min-new ({self.min_new})")
        if self.max_running_sequences < 1 or (self.threads is not None and self.threads < 1):
            raise InputError("--max-running-sequences and --threads must be >= 1")


@dataclass(frozen=True)
class Work:
    prompt_ids: tuple[int, ...]
    max_tokens: int


# -- the model ------------------------------------------------------------------------------


def bench_knobs(options: GenerateBenchOptions) -> Knobs:
    """The knobs every configuration of the bench loads with (the torch backend's)."""
    from batchline.models.config import Knobs

    knobs = Knobs(
        device=options.device,
        generation_threads=options.threads,
        max_running_sequences=options.max_running_sequences,
        dtype=options.dtype,
    )
    if options.max_step_tokens is not None:
        knobs = knobs.replace(max_step_tokens=options.max_step_tokens)
    return knobs


def load_parts(options: GenerateBenchOptions) -> ModelParts:
    """Load ``options.model`` once through ``load_text_generator`` (slow: call it in a thread).

    The generator it builds is never started: each run builds its own over the same engine.
    """
    from batchline.models.generation import load_text_generator
    from batchline.models.specs import parse_specs

    (spec,) = parse_specs([options.model], tasks=["generate"])
    model = load_text_generator(spec, bench_knobs(options))
    engine = model.engine  # the loaded weights, shared by every generator of the bench
    if engine is None:
        model.close()
        raise InputError(f"model {spec.name!r}: bench --task generate needs the torch backend")
    return ModelParts(
        spec.name, engine, model.detokenizer, model.encode, model.close, model.dtype or "n/a"
    )


def fake_parts(*, fixed_s: float = 0.004, per_sequence_s: float = 0.0004) -> ModelParts:
    """The fake engine: a step costs a fixed part plus a little per sequence, so batching pays
    as on a real model (a smoke run; ``fixed_s=0`` for tests)."""
    from batchline.models.generation import FakeEngine, FakeTokenizer, StepCost

    cost = StepCost(fixed_s=fixed_s, per_sequence_s=per_sequence_s, per_prefill_token_s=1e-5)
    tok = FakeTokenizer()
    engine = FakeEngine(step_cost=cost, max_context_tokens=4096)
    return ModelParts("fake", engine, tok, tok.encode, dtype="fake (no arithmetic)")


def build_work(parts: ModelParts, options: GenerateBenchOptions) -> list[Work]:
    """The demo math prompts, encoded, each with its own seeded ``max_tokens``."""
    from batchline.models.generation import demo_prompts

    n = max(options.requests, options.sequential_requests)
    rng = random.Random(options.seed)
    prompts = demo_prompts(n, seed=options.seed)
    work = [
        Work(tuple(parts.encode(str(p["prompt"]))), rng.randint(options.min_new, options.max_new))
        for p in prompts
    ]
    context = parts.engine.max_context_tokens
    longest = max(len(w.prompt_ids) for w in work)
    if longest + options.max_new > context:
        raise InputError(
            f"the longest prompt ({longest} tokens) + --max-new {options.max_new} is over the "
            f"model's context of {context} tokens; lower --max-new"
        )
    return work


# -- the target the load generator drives -------------------------------------------------------


class GenerationTarget:
    """One generator as a load-generator target: request ``i`` submits ``work[i]`` and waits
    for its completion, which is kept (by index) for the run's figures.

    A request the generator refuses (``QueueFullError``) fails as a request, as a full server
    does; any other error is kept and raised by :meth:`check`, so a broken model ends the
    bench instead of turning into a column of failures.
    """

    def __init__(self, gen: TextGenerator, work: Sequence[Work]) -> None:
        self.gen = gen
        self.work = work
        self.completions: dict[int, Completion] = {}
        self.rejected = 0
        self._error: BaseException | None = None

    async def call(self, index: int) -> None:
        item = self.work[index]
        params = SamplingParams(max_tokens=item.max_tokens, ignore_eos=True)
        try:
            stream = self.gen.submit(item.prompt_ids, params)
        except QueueFullError:
            self.rejected += 1
            raise
        try:
            self.completions[index] = await stream.result()
        except Exception as exc:
            self._error = self._error or exc
            raise

    def counters(self) -> Counters | None:
        return None  # the generator's own stats say how it batched (ITL)

    def check(self) -> None:
        """Raise the first error a request met, other than a refusal."""
        if self._error is not None:
            raise self._error


async def run_one(
    name: str,
    gen: TextGenerator,
    work: Sequence[Work],
    load: LoadPoint,
    repeat: int,
    *,
    seed: int,
    clock: Clock,
) -> RunFigures:
    """Start ``gen`` (a fresh generator of configuration ``name``), drive it at ``load`` until
    ``work`` is done, stop it."""
    target = GenerationTarget(gen, work)
    async with gen:
        if load.kind == "closed":
            samples, start = await run_closed(
                target, int(load.value), None, requests=len(work), clock=clock
            )
        else:
            # the same arrival times for every generator at this rate and repeat
            arrivals = seed * 1_000_003 + int(load.value * 1000) * 101 + repeat
            schedule = poisson_arrivals(load.value, len(work), seed=arrivals)
            samples, start = await run_open(target, schedule, clock=clock, drain_s=None)
        end = clock.now()
        itl = gen.stats.itl_p50_s
    target.check()
    return figures(name, load, repeat, samples, target, wall_s=end - start, itl_p50_s=itl)


def figures(
    name: str,
    load: LoadPoint,
    repeat: int,
    samples: Sequence[Sample],
    target: GenerationTarget,
    *,
    wall_s: float,
    itl_p50_s: float,
) -> RunFigures:
    """A run's figures from the load generator's samples and the target's completions: latency
    from each request's intended send time (the samples'), TTFT the generator's plus the time
    the request waited to be sent (open loop)."""
    done = sorted(
        (s for s in samples if s.ok and s.index in target.completions), key=lambda s: s.index
    )
    completions = [target.completions[s.index] for s in done]
    return RunFigures(
        generator=name,
        kind=load.kind,
        offered=load.value,
        repeat=repeat,
        requests=len(done),
        tokens=sum(c.completion_tokens for c in completions),
        wall_s=wall_s,
        latencies_s=[s.latency_s for s in done if s.latency_s is not None],
        ttfts_s=[
            c.ttft_s + (s.sent_s - s.intended_s)
            for s, c in zip(done, completions, strict=True)
            if c.ttft_s is not None
        ],
        itl_p50_s=itl_p50_s,
        rejected=target.rejected,
    )


# -- the whole bench ----------------------------------------------------------------------------


def run_generate_bench(
    options: GenerateBenchOptions,
    progress: Say | None = None,
    *,
    parts: ModelParts | None = None,
    start_vllm: StartTurn | None = None,
) -> GenerateBenchResult:
    """Run the bench (sync). ``parts``: an already loaded model (else :func:`load_parts`);
    ``start_vllm``: what starts the ``vllm`` configuration's engine for each of its turns (else
    :func:`~batchline.bench.generate_vllm.start_vllm_turn`, which needs vLLM installed)."""
    return asyncio.run(
        run_generate_bench_async(options, progress, parts=parts, start_vllm=start_vllm)
    )


async def run_generate_bench_async(
    options: GenerateBenchOptions,
    progress: Say | None = None,
    *,
    parts: ModelParts | None = None,
    start_vllm: StartTurn | None = None,
) -> GenerateBenchResult:
    """Async :func:`run_generate_bench`; ``progress`` is told how it goes, one line at a
    time."""
    from batchline.bench.generate_vllm import EngineTurn, check_vllm_installed, start_vllm_turn
    from batchline.models.generation import build_generator

    options.check()
    if "vllm" in options.generators and start_vllm is None:
        check_vllm_installed()  # before anything loads
        start_vllm = start_vllm_turn
    say = progress or (lambda _text: None)
    clock = MonotonicClock()
    started = time.perf_counter()
    env = environment()
    own = parts is None
    if parts is None:
        say(f"loading {options.model} ...")
        t0 = time.perf_counter()
        parts = await asyncio.to_thread(load_parts, options)
        say(f"loaded in {time.perf_counter() - t0:.1f} s")
    names: list[str] = [g for g in ALL_GENERATORS if g in options.generators]
    dtypes = {name: parts.dtype for name in names if name != "vllm"}
    try:
        work = build_work(parts, options)
        longest = max(len(w.prompt_ids) for w in work)
        need = longest + options.max_new
        kv_budget = options.kv_token_budget or options.max_running_sequences * need
        if kv_budget < need:
            raise InputError(
                f"--kv-token-budget {kv_budget} cannot hold the longest request ({need} tokens)"
            )
        running = options.max_running_sequences
        workload = (
            f"{options.requests} demo math prompts per run ({options.sequential_requests} "
            f"one at a time), {min(len(w.prompt_ids) for w in work)}-{longest} prompt tokens, "
            f"max_tokens {options.min_new}-{options.max_new} (seeded, ignore_eos), "
            f"max_running_sequences {running}, kv_token_budget {kv_budget}, "
            f"{options.repeats} interleaved repeat{'s' if options.repeats > 1 else ''}"
        )
        say(f"workload: {workload}")
        # the first calls allocate: warm each engine outside every measurement
        warm = [Work(w.prompt_ids, 2) for w in work[:4]]

        def on_torch(name: str) -> EngineTurn:
            def new_generator(clock: Clock) -> TextGenerator:
                return build_generator(
                    cast("GeneratorKind", name),  # a name of GENERATORS, checked with the options
                    parts.engine,
                    parts.detokenizer,
                    max_running=running,
                    kv_token_budget=kv_budget,
                    clock=clock,
                )

            return EngineTurn(new_generator, parts.engine.max_context_tokens, parts.dtype, _idle)

        async def start_turn(name: str) -> EngineTurn:
            if name != "vllm":
                return on_torch(name)
            assert start_vllm is not None
            say("starting vLLM's engine ...")
            t0 = time.perf_counter()
            turn = await start_vllm(options.model, bench_knobs(options))
            say(f"vLLM started in {time.perf_counter() - t0:.1f} s")
            dtypes[name] = turn.dtype
            try:
                if need > turn.max_context_tokens:
                    raise InputError(
                        f"the longest prompt ({longest} tokens) + --max-new {options.max_new} "
                        f"is over vLLM's context of {turn.max_context_tokens} tokens; lower "
                        "--max-new"
                    )
                if options.warmup:
                    gen = turn.new_generator(clock)
                    await run_one(name, gen, warm, LoadPoint("closed", 4), -1, seed=0, clock=clock)
            except BaseException:
                await turn.close()
                raise
            return turn

        if options.warmup and any(name != "vllm" for name in names):
            gen = on_torch("continuous").new_generator(clock)
            await run_one("continuous", gen, warm, LoadPoint("closed", 4), -1, seed=0, clock=clock)
        runs: list[RunFigures] = []

        async def take_turn(name: str, repeat: int) -> None:
            n = options.sequential_requests if name == BASELINE_GENERATOR else options.requests
            turn = await start_turn(name)
            try:
                for load in options.loads:
                    gen = turn.new_generator(clock)
                    figures = await run_one(
                        name, gen, work[:n], load, repeat, seed=options.seed, clock=clock
                    )
                    runs.append(figures)
                    say(
                        f"  #{repeat} {load.label}: {name} {figures.tokens_per_s:,.1f} "
                        f"tok/s in {figures.wall_s:.1f} s"
                    )
            finally:
                await turn.close()

        for repeat in range(options.repeats):
            # rotate the order: a neighbour's burst on the shared machine hits each alike
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for name in order:
                await take_turn(name, repeat)
                if name == "vllm":
                    # vLLM's engine objects sit in reference cycles: collect them now, while
                    # the interpreter is whole, not at exit (where their __del__ fails)
                    gc.collect()
    finally:
        if own:
            await asyncio.to_thread(parts.close)
    if hasattr(os, "getloadavg"):
        env["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    return GenerateBenchResult(
        model=parts.name,
        generators=names,
        points=medians(runs),
        runs=runs,
        loads=list(options.loads),
        workload=workload,
        environment=env,
        command=options.command,
        elapsed_s=time.perf_counter() - started,
        dtypes=dtypes,
    )


async def _idle() -> None:
    """A torch configuration's turn ends with nothing to close: the weights stay loaded."""
