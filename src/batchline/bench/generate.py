"""``batchline bench --task generate``: one-at-a-time, static and continuous batching of one
text generator, on the same loaded model, in one run.

The weights load once (:func:`load_parts`: ``load_text_generator`` on ``--model smollm2`` or
a Hugging Face folder ``PATH/``); each run builds a fresh generator of one kind over the
loaded engine, drives it, and stops it before the next one starts. Every configuration gets
the same work at each load point: the built-in math prompts (seeded), each with its own
``max_tokens`` drawn between ``min_new`` and ``max_new`` and ``ignore_eos``, so every request
generates exactly what it asked for. Repeats are interleaved, the order rotating each time.

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

One-at-a-time runs fewer requests (``sequential_requests``): it is slow, and only its
throughput enters a ratio.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from batchline._clock import Clock, MonotonicClock
from batchline._errors import InputError, QueueFullError
from batchline.bench.loadgen import Counters, LoadKind, LoadPoint, parse_load, run_closed, run_open
from batchline.bench.runner import Say, environment
from batchline.bench.stats import Sample, poisson_arrivals, summarize
from batchline.models.generation.engine import SamplingParams, StepEngine
from batchline.models.generation.stream import Completion, Detokenizer, TextGenerator

__all__ = [
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
    "fake_parts",
    "load_parts",
    "run_generate_bench",
    "run_generate_bench_async",
]

DEFAULT_GENERATE_LOAD = "closed:16"
GeneratorName = Literal["one-at-a-time", "static", "continuous"]
GENERATORS: tuple[GeneratorName, ...] = ("one-at-a-time", "static", "continuous")

#: The goals the ratios are held to: (name, numerator, denominator, metric, op, goal).
GOALS: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("continuous/static throughput", "continuous", "static", "tokens_per_s", ">=", 1.3),
    ("continuous/static p99 latency", "continuous", "static", "latency_p99_s", "<=", 0.8),
    ("continuous/one-at-a-time throughput", "continuous", "one-at-a-time", "tokens_per_s", ">=",
     2.5),
    ("continuous/static TTFT p99", "continuous", "static", "ttft_p99_s", "<=", 0.5),
)  # fmt: skip

_DESCRIPTIONS: dict[str, str] = {
    "one-at-a-time": "one sequence at a time (the baseline)",
    "static": "static batching: a batch runs until its last sequence ends",
    "continuous": "continuous batching: sequences join and leave between steps",
}


@dataclass(frozen=True)
class ModelParts:
    """What every generator of a run is built on: one engine (the loaded weights), its
    detokenizer and prompt encoding, and ``close`` to free the model afterwards."""

    name: str
    engine: StepEngine
    detokenizer: Detokenizer
    encode: Callable[[str], list[int]]
    close: Callable[[], None] = lambda: None


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
    threads: int = 1
    max_running_sequences: int = 16
    kv_token_budget: int | None = None
    dtype: str = "auto"
    max_step_tokens: int | None = None  # None: Knobs' default
    seed: int = 0
    warmup: bool = True
    command: str = ""

    def check(self) -> None:
        """``InputError`` for values that cannot run."""
        if not self.loads:
            raise InputError("no load points given")
        unknown = [g for g in self.generators if g not in GENERATORS]
        if unknown or not self.generators:
            raise InputError(
                f"--generators takes {', '.join(GENERATORS)}; got {', '.join(self.generators)}"
            )
        for name in ("requests", "sequential_requests", "repeats", "min_new"):
            if getattr(self, name) < 1:
                raise InputError(f"--{name.replace('_', '-')} must be >= 1")
        if self.max_new < self.min_new:
            raise InputError(f"--max-new ({self.max_new}) must be >= --min-new ({self.min_new})")
        if self.max_running_sequences < 1 or self.threads < 1:
            raise InputError("--max-running-sequences and --threads must be >= 1")


@dataclass(frozen=True)
class Work:
    prompt_ids: tuple[int, ...]
    max_tokens: int


@dataclass(frozen=True)
class RunFigures:
    """One generator, one load point, one repeat: the raw figures."""

    generator: str
    kind: LoadKind
    offered: float
    repeat: int
    requests: int
    tokens: int
    wall_s: float
    latencies_s: list[float]
    ttfts_s: list[float]
    itl_p50_s: float
    rejected: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0


@dataclass(frozen=True)
class GenPoint:
    """One generator at one load point: medians over the repeats (seconds; ``nan`` = none)."""

    generator: str
    kind: LoadKind
    offered: float
    requests: int
    repeats: int
    tokens_per_s: float
    latency_p50_s: float
    latency_p99_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    itl_p50_s: float
    rejected: int = 0

    @property
    def point(self) -> LoadPoint:
        return LoadPoint(self.kind, self.offered)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in data.items()}


@dataclass(frozen=True)
class Ratio:
    """One goal's ratio at one load point."""

    name: str
    point: LoadPoint
    value: float
    op: str
    goal: float

    @property
    def ok(self) -> bool:
        if math.isnan(self.value):
            return False
        return self.value >= self.goal if self.op == ">=" else self.value <= self.goal

    def line(self) -> str:
        mark = "ok" if self.ok else "MISSED"
        return (
            f"{self.point.label:<18} {self.name:<38} {self.value:6.2f}   "
            f"goal {self.op} {self.goal:g}   {mark}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "load": str(self.point),
            "value": None if math.isnan(self.value) else self.value,
            "goal": f"{self.op} {self.goal:g}",
            "ok": self.ok,
        }


@dataclass
class GenerateBenchResult:
    """Everything the report needs."""

    model: str
    generators: list[str]
    points: list[GenPoint]
    runs: list[RunFigures]
    loads: list[LoadPoint]
    workload: str
    environment: dict[str, str]
    command: str = ""
    elapsed_s: float = 0.0

    def ratios(self) -> list[Ratio]:
        """Every goal's ratio at every load point where both its configurations ran
        (throughput ratios at closed-loop points only: open-loop throughput is the rate)."""
        out: list[Ratio] = []
        for load in self.loads:
            here = {p.generator: p for p in self.points if p.point == load}
            for name, num, den, metric, op, goal in GOALS:
                if metric == "tokens_per_s" and load.kind == "open":
                    continue  # capped by the arrival rate: not what the goal measures
                if num in here and den in here:
                    a, b = getattr(here[num], metric), getattr(here[den], metric)
                    value = a / b if b > 0 else math.nan
                    out.append(Ratio(name, load, value, op, goal))
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "generators": {g: _DESCRIPTIONS[g] for g in self.generators},
            "loads": [str(p) for p in self.loads],
            "workload": self.workload,
            "points": [p.to_dict() for p in self.points],
            "ratios": [r.to_dict() for r in self.ratios()],
            "runs": [
                {
                    "generator": r.generator,
                    "load": str(LoadPoint(r.kind, r.offered)),
                    "repeat": r.repeat,
                    "requests": r.requests,
                    "tokens": r.tokens,
                    "wall_s": r.wall_s,
                    "tokens_per_s": r.tokens_per_s,
                    "rejected": r.rejected,
                }
                for r in self.runs
            ],
            "environment": self.environment,
            "command": self.command,
            "elapsed_s": self.elapsed_s,
        }


# -- the model ------------------------------------------------------------------------------


def load_parts(options: GenerateBenchOptions) -> ModelParts:
    """Load ``options.model`` once through ``load_text_generator`` (slow: call it in a thread).

    The generator it builds is never started: each run builds its own over the same engine.
    """
    from batchline.knobs import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_specs

    (spec,) = parse_specs([options.model], tasks=["generate"])
    knobs = Knobs(
        device=options.device,
        intra_op_threads=options.threads,
        max_running_sequences=options.max_running_sequences,
        dtype=options.dtype,
    )
    if options.max_step_tokens is not None:
        knobs = knobs.replace(max_step_tokens=options.max_step_tokens)
    model = load_text_generator(spec, knobs)
    engine = model.engine  # the loaded weights, shared by every generator of the bench
    if engine is None:
        model.close()
        raise InputError(f"model {spec.name!r}: bench --task generate needs the torch backend")
    return ModelParts(spec.name, engine, model.detokenizer, model.encode, model.close)


def fake_parts(*, fixed_s: float = 0.004, per_sequence_s: float = 0.0004) -> ModelParts:
    """The fake engine: a step costs a fixed part plus a little per sequence, so batching pays
    as on a real model (a smoke run; ``fixed_s=0`` for tests)."""
    from batchline.models.generation.fake import FakeEngine, FakeTokenizer, StepCost

    cost = StepCost(fixed_s=fixed_s, per_sequence_s=per_sequence_s, per_prefill_token_s=1e-5)
    tok = FakeTokenizer()
    return ModelParts("fake", FakeEngine(step_cost=cost, max_context_tokens=4096), tok, tok.encode)


def make_generator(
    name: str, parts: ModelParts, *, max_running: int, kv_budget: int, clock: Clock | None
) -> TextGenerator:
    from batchline.models.generation.scheduler import ContinuousGenerator
    from batchline.models.generation.static import SequentialGenerator, StaticGenerator

    if name == "one-at-a-time":
        return SequentialGenerator(parts.engine, parts.detokenizer, clock=clock)
    if name == "static":
        return StaticGenerator(
            parts.engine,
            parts.detokenizer,
            max_batch_size=max_running,
            kv_token_budget=kv_budget,
            clock=clock,
        )
    return ContinuousGenerator(
        parts.engine,
        parts.detokenizer,
        max_running=max_running,
        kv_token_budget=kv_budget,
        clock=clock,
    )


def build_work(parts: ModelParts, options: GenerateBenchOptions) -> list[Work]:
    """The demo math prompts, encoded, each with its own seeded ``max_tokens``."""
    from batchline.models.generation.demo import demo_prompts

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
    parts: ModelParts,
    work: Sequence[Work],
    load: LoadPoint,
    repeat: int,
    *,
    max_running: int,
    kv_budget: int,
    seed: int,
    clock: Clock,
) -> RunFigures:
    """Build ``name``'s generator over ``parts``, drive it at ``load`` until ``work`` is done,
    stop it."""
    gen = make_generator(name, parts, max_running=max_running, kv_budget=kv_budget, clock=clock)
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


def _median(values: Sequence[float]) -> float:
    clean = [v for v in values if not math.isnan(v)]
    return statistics.median(clean) if clean else math.nan


def medians(runs: Sequence[RunFigures]) -> list[GenPoint]:
    """Medians over repeats, per load point and generator (in run order)."""
    keys = list(dict.fromkeys((r.kind, r.offered, r.generator) for r in runs))
    points: list[GenPoint] = []
    for kind, offered, generator in keys:
        rs = [r for r in runs if (r.kind, r.offered, r.generator) == (kind, offered, generator)]
        latency = [summarize(r.latencies_s) for r in rs]
        ttft = [summarize(r.ttfts_s) for r in rs]
        points.append(
            GenPoint(
                generator=generator,
                kind=kind,
                offered=offered,
                requests=rs[0].requests,
                repeats=len(rs),
                tokens_per_s=_median([r.tokens_per_s for r in rs]),
                latency_p50_s=_median([x.p50_s for x in latency]),
                latency_p99_s=_median([x.p99_s for x in latency]),
                ttft_p50_s=_median([x.p50_s for x in ttft]),
                ttft_p99_s=_median([x.p99_s for x in ttft]),
                itl_p50_s=_median([r.itl_p50_s for r in rs]),
                rejected=sum(r.rejected for r in rs),
            )
        )
    return points


def run_generate_bench(
    options: GenerateBenchOptions,
    progress: Say | None = None,
    *,
    parts: ModelParts | None = None,
) -> GenerateBenchResult:
    """Run the bench (sync). ``parts``: an already loaded model (else :func:`load_parts`)."""
    return asyncio.run(run_generate_bench_async(options, progress, parts=parts))


async def run_generate_bench_async(
    options: GenerateBenchOptions,
    progress: Say | None = None,
    *,
    parts: ModelParts | None = None,
    clock: Clock | None = None,
) -> GenerateBenchResult:
    """Async :func:`run_generate_bench`; ``clock`` for tests (a ``ManualClock`` and a fake
    engine that advances it). ``progress`` is told how it goes, one line at a time."""
    options.check()
    say = progress or (lambda _text: None)
    clock = clock or MonotonicClock()
    started = time.perf_counter()
    env = environment()
    own = parts is None
    if parts is None:
        say(f"loading {options.model} ...")
        t0 = time.perf_counter()
        parts = await asyncio.to_thread(load_parts, options)
        say(f"loaded in {time.perf_counter() - t0:.1f} s")
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
        if options.warmup:
            # the first calls allocate: warm the model outside every measurement
            warm = [Work(w.prompt_ids, 2) for w in work[:4]]
            await run_one(
                "continuous",
                parts,
                warm,
                LoadPoint("closed", 4),
                -1,
                max_running=running,
                kv_budget=kv_budget,
                seed=options.seed,
                clock=clock,
            )
        names = [g for g in GENERATORS if g in options.generators]
        runs: list[RunFigures] = []
        for repeat in range(options.repeats):
            # rotate the order: a neighbour's burst on the shared machine hits each alike
            order = names[repeat % len(names) :] + names[: repeat % len(names)]
            for load in options.loads:
                for name in order:
                    n = options.sequential_requests if name == "one-at-a-time" else options.requests
                    figures = await run_one(
                        name,
                        parts,
                        work[:n],
                        load,
                        repeat,
                        max_running=running,
                        kv_budget=kv_budget,
                        seed=options.seed,
                        clock=clock,
                    )
                    runs.append(figures)
                    say(
                        f"  #{repeat} {load.label}: {name} {figures.tokens_per_s:,.1f} tok/s "
                        f"in {figures.wall_s:.1f} s"
                    )
    finally:
        if own:
            await asyncio.to_thread(parts.close)
    if hasattr(os, "getloadavg"):
        env["load average (1 min) at end"] = f"{os.getloadavg()[0]:.2f}"
    return GenerateBenchResult(
        model=parts.name,
        generators=list(names),
        points=medians(runs),
        runs=runs,
        loads=list(options.loads),
        workload=workload,
        environment=env,
        command=options.command,
        elapsed_s=time.perf_counter() - started,
    )
