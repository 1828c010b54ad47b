"""``batchline run --task generate``: text generation over a dataset of prompts, resumable.

The dataset pipeline of every job (``batchline.datasets.pipeline``), with a text generator as
its adapter in place of a batch model::

    reader thread ──blocks──> encode (worker thread) ──ids──> generator.submit ──> engine thread
                                   at most N requests in flight ┘  (continuous / static / one
                                                                      at a time)
    ChunkWriter thread <── completions of a block, in input order ──┘

- Prompts come from one column: ``--prompt-column``, else ``prompt`` if the input has one,
  else ``messages``, else ``text``. A string is a prompt (sent through the model's chat
  template as one user message unless ``--no-chat-template``); a list of ``{role, content}``
  objects is a chat. Without an input file, the built-in math prompts (``demo.py``) are used.
- The output's ``text`` column holds each completion (kind ``value``: a native string column,
  readable by any Parquet tool, not JSON text inside a string), beside ``finish_reason``,
  ``prompt_tokens`` and ``completion_tokens``.
- A record whose prompt cannot be used (not text or messages, longer than the context with
  ``max_tokens``) is that record's failure: with ``--on-bad-record skip`` it is listed in
  ``_skipped.jsonl`` and the job goes on; with ``fail`` (the default) it stops the job.
- Backpressure: at most :func:`in_flight_limit` requests are submitted and unfinished; that
  never exceeds the generator's waiting queue, so ``QueueFullError`` cannot happen.
- Resuming (``--resume``) needs the same input, prompt column and sampling settings; the
  batching mode may change (greedy outputs do not depend on it).
- ``--cache DIR`` keeps each greedy or seeded completion across runs and answers a request an
  earlier run computed from there (:mod:`batchline.jobs.generate_cache`).
- An OpenAI batch file is a job of its own (:mod:`batchline.jobs.openai_batch`, which runs
  its generate lines through :func:`running_generator` too); ``run_job`` picks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, runtime_checkable

from batchline._errors import BatchlineError, InputError
from batchline._priority import batcher_priority
from batchline._stats import percentile
from batchline.datasets.outcomes import Failed, Outcome, Result, describe, told
from batchline.datasets.pipeline import PipelineRun, Progress, open_dataset_job, run_pipeline
from batchline.datasets.sinks import ChunkWriter, default_output
from batchline.datasets.sources import PROMPT_COLUMNS, Record, Source, prompt_column
from batchline.jobs.batch import DEDUPE_WINDOW, Cached, cancel, settle
from batchline.jobs.generate_cache import Answers, CompletionCache, request_key
from batchline.jobs.generate_choices import CHOICES_COLUMN, Samples, gather_samples, samples_outcome
from batchline.jobs.options import GenerateOptions, RunOptions, resolve
from batchline.jobs.prefix_order import submission_order
from batchline.jobs.requests import (
    Choices,
    RecordRequests,
    is_openai_batch_file,
    reads_whole_rows,
)
from batchline.jobs.result_cache import open_cache
from batchline.jobs.summary import GenerateSummary
from batchline.models.generation import GenerationRequest, SamplingParams

if TYPE_CHECKING:
    from batchline.models.generation import (
        Completion,
        GenerationModel,
        GenerationStats,
        GenerationStream,
        TextGenerator,
    )

__all__ = [
    "GenerateOptions",
    "GenerateSummary",
    "GeneratorAdapter",
    "TokenRate",
    "demo_prompts_path",
    "generate_summary",
    "in_flight_limit",
    "open_generate_job",
    "pipeline_limits",
    "plan_generate",
    "run_generate_job",
    "running_generator",
]

#: Records read and encoded at a time (the progress bar moves by a block).
_BLOCK = 16
#: Prompts read at a time and submitted grouped by shared prefix (``--no-prefix-ordering``:
#: in input order, ``_BLOCK`` at a time).
PREFIX_ORDER_WINDOW = 2_048
#: Seconds between two reads of the generator's stats (peaks and the progress bar's rate).
_SAMPLE_S = 0.25
#: ... and at most this often on a request's completion.
_SAMPLE_ON_DONE_S = 0.02
_DEMO_NAME = "demo-prompts.jsonl"
_DEMO_COUNT = 300
#: Every request a job submits is ``batch`` work (as ``drive`` sends it to a server).
_JOB_PRIORITY = batcher_priority("batch")


@runtime_checkable
class TokenRate(Protocol):
    """A progress display that also shows generation speed (the CLI's bar)."""

    def tokens(self, generated: int, tokens_per_s: float) -> None:
        """``generated`` tokens so far in this run, at ``tokens_per_s``."""


def in_flight_limit(model: GenerationModel) -> int:
    """Requests the job keeps submitted and unfinished: enough to keep every running slot busy
    and the next ones queued (4 × the running cap), never more than the waiting queue holds
    (every request in flight may be waiting at once, before the engine admits any)."""
    return max(1, min(model.max_waiting, 4 * model.max_running))


def demo_prompts_path() -> Path:
    """The built-in math prompts as JSONL in batchline's cache folder (rewritten if the
    prompts changed, so a resume sees the same file only when the prompts are the same)."""
    from batchline._cache import cache_dir
    from batchline.models.generation import write_demo_prompts

    return write_demo_prompts(cache_dir() / _DEMO_NAME, _DEMO_COUNT)


def open_generate_job(
    options: GenerateOptions, requests: RecordRequests
) -> tuple[Source, ChunkWriter]:
    """The job's source and chunk writer (:func:`plan_generate`'s options and requests)."""
    column, params = requests.column, requests.base
    output = options.output or default_output(options.input, "generate")
    assert options.input is not None
    # a record's constraint fields are read with its prompt: whole rows (all but plain text)
    whole_rows = reads_whole_rows(options.input, options.input_format)
    settings: dict[str, object] = {
        "task": "generate",
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": list(params.stop),
            # only when asked: the settings of outputs written before the flag stay as they were
            **({} if params.logprobs is None else {"logprobs": params.logprobs}),
            "constraint": None
            if params.constraint is None
            else {"kind": params.constraint.kind, "spec": params.constraint.spec},
        },
        "chat_template": options.chat_template,
    }
    return open_dataset_job(
        dataclasses.replace(options, text_column=column, input_columns=()),
        model=options.model,
        output=output,
        chunk_size=options.chunk_size,
        extra_settings=settings,
        result_column="text",
        result_kind="value",
        input_kind="record",
        input_columns=() if whole_rows else (column,),
    )


def _encode(
    model: GenerationModel, records: Sequence[Record], requests: RecordRequests
) -> list[list[int] | Failed]:
    out: list[list[int] | Failed] = []
    for record in records:
        try:
            prompt, chat_template = requests.prompt(record)
            ids = model.encode(prompt, chat_template=chat_template)
        except (BatchlineError, ValueError, TypeError) as exc:
            out.append(Failed(f"bad input: {told(exc)}"))
            continue
        out.append(ids if ids else Failed("bad input: the prompt has no tokens"))
    return out


async def _prefilled(stream: GenerationStream) -> None:
    """Wait until ``stream``'s prompt is prefilled (its first token, or its end)."""
    with contextlib.suppress(Exception):  # its end, or its error: result() gives that
        await anext(stream)


class _Peaks:
    """The highest running/waiting/KV figures seen in the generator's stats."""

    def __init__(self) -> None:
        self.running = 0
        self.waiting = 0
        self.kv_reserved = 0
        self.last_running = 0
        self.sampled_at = -math.inf

    def see(self, stats: GenerationStats) -> None:
        self.last_running = stats.running
        self.running = max(self.running, stats.running)
        self.waiting = max(self.waiting, stats.waiting)
        self.kv_reserved = max(self.kv_reserved, stats.kv_tokens_reserved)


#: A record's prompt ids, settings, request key (None: always generated) and what it asks
#: beyond one plain completion; or why it fails
_Planned = tuple[list[int], SamplingParams, bytes | None, Choices | None] | Failed
#: What a record's outcome waits on: its completion, or its failure or kept completion.
_Pending: TypeAlias = "asyncio.Future[Completion] | asyncio.Future[Samples] | Failed | Cached"


class GeneratorAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for a started text generator: each
    record's prompt is encoded (off the loop) and submitted as its own request, at most
    :func:`in_flight_limit` unfinished; a completion is written as its ``text`` with
    ``finish_reason``, ``prompt_tokens`` and ``completion_tokens`` columns. A request that
    repeats one of this job's (``dedupe_window``) or that an earlier run computed (``cache``)
    takes that completion instead (:func:`request_key`)."""

    def __init__(
        self,
        model: GenerationModel,
        requests: RecordRequests,
        progress: Progress | None,
        *,
        limit: int | None = None,
        order_window: int = 0,
        dedupe_window: int = 0,
        cache: CompletionCache | None = None,
    ) -> None:
        self.model = model
        self.gen: TextGenerator = model.generator
        self.requests = requests
        #: records read at a time and submitted grouped by shared prefix (0: in input order)
        self.order_window = order_window
        #: where a request whose answer does not depend on chance (:func:`request_key`) is
        #: answered from: a duplicate's first request, or a completion an earlier run kept
        self.answers = Answers(dedupe_window, cache)
        # a shared generator (serve's) keeps room in its waiting queue for live requests
        self.limit = in_flight_limit(model) if limit is None else max(1, limit)
        self._slots = asyncio.Semaphore(self.limit)
        self.tokens = 0
        self.prompt_tokens = 0
        self.latencies: list[float] = []
        self.peaks = _Peaks()
        shown: object = progress  # a Progress may also be a TokenRate (the CLI's bar)
        self._rate = shown if isinstance(shown, TokenRate) else None
        self._started = time.perf_counter()

    @property
    def duplicates(self) -> int:
        """Records answered from an identical earlier request's completion."""
        return self.answers.duplicates

    @property
    def cached(self) -> int:
        """Records answered from a completion an earlier run kept (``--cache``)."""
        return self.answers.cached

    def utilization(self) -> float:
        """Running sequences over the running cap, at the last sample (the bar's field)."""
        cap = self.model.max_running
        return self.peaks.last_running / cap if cap else 0.0

    def sample(self, *, every_s: float = 0.0) -> None:
        now = time.perf_counter()
        # a stats snapshot sorts its latency windows: at most one per every_s
        if now - self.peaks.sampled_at >= every_s:
            self.peaks.see(self.gen.stats)
            self.peaks.sampled_at = now
        if self._rate is not None:
            elapsed = now - self._started
            self._rate.tokens(self.tokens, self.tokens / elapsed if elapsed > 0 else 0.0)

    async def sampler(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(_SAMPLE_S)

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        encoded = await asyncio.to_thread(_encode, self.model, records, self.requests)
        planned = self._plan(records, encoded)
        kept = await self.answers.kept(p[2] for p in planned if not isinstance(p, Failed))
        placed: dict[int, _Pending] = {}
        store: dict[int, bytes] = {}  # a computed record's place -> its request key
        grouped = self.order_window > 1
        leading: GenerationStream | None = None
        try:
            for i, member in submission_order(encoded, grouped=grouped):
                plan = planned[i]
                if isinstance(plan, Failed):
                    placed[i] = plan
                    continue
                ids, params, key, asked = plan
                answer = None if key is None else self.answers.answer(key, kept)
                if answer is not None:  # same prompt and settings: same completion
                    placed[i] = answer
                    continue
                if asked is not None:  # n completions, log-probabilities, echo
                    placed[i] = await self._submit_choices(records[i], ids, params, asked)
                    leading = None
                    continue
                if leading is not None and member in (1, 2):
                    await _prefilled(leading)
                await self._slots.acquire()
                stream = self._submit_one(records[i], ids, params)
                if isinstance(stream, Failed):
                    self._slots.release()
                    placed[i] = stream
                    leading = None
                    continue
                # the first two prompts of a group go one at a time: the engine's prefix cache
                # keeps a prefix once a second prompt has shared it, and prompts prefilled in
                # one step share nothing; from the third on, they find it kept
                leading = stream if grouped and member < 2 else None
                outcome = asyncio.ensure_future(stream.result())
                outcome.add_done_callback(self._on_done)
                placed[i] = outcome
                if key is not None:
                    self.answers.generating(key, outcome)
                    store[i] = key
        except BaseException:
            cancel(list(placed.values()))
            raise
        pending = [placed[i] for i in range(len(records))]  # the outcomes in input order
        return asyncio.ensure_future(self._finish(pending, store))

    def _plan(
        self, records: Sequence[Record], encoded: Sequence[list[int] | Failed]
    ) -> list[_Planned]:
        """Each record's :data:`_Planned`. A record that asks for more than one plain
        completion (``n``, log-probabilities, ``echo``) has no request key: it is always
        generated, never kept (its row is not a plain completion's)."""
        planned: list[_Planned] = []
        for record, ids in zip(records, encoded, strict=True):
            params = ids if isinstance(ids, Failed) else self._params(record)
            if isinstance(params, Failed):
                planned.append(params)
                continue
            assert not isinstance(ids, Failed)
            asked = self.requests.choices(record)
            keyed = self.answers.keyed and asked is None
            planned.append((ids, params, request_key(ids, params) if keyed else None, asked))
        return planned

    async def _finish(self, pending: Sequence[_Pending], store: dict[int, bytes]) -> list[Outcome]:
        outcomes = await _outcomes(pending, stamp=self.requests.openai_batch, model=self.model)
        await self.answers.keep(outcomes, store)
        return outcomes

    def _params(self, record: Record) -> SamplingParams | Failed:
        try:
            # a job's requests are batch work: a generator it shares ranks them so (_priority)
            return dataclasses.replace(self.requests.params(record), priority=_JOB_PRIORITY)
        except (BatchlineError, ValueError) as exc:
            return Failed(f"bad input: {told(exc)}")

    async def _submit_choices(
        self, record: Record, ids: list[int], params: SamplingParams, asked: Choices
    ) -> asyncio.Future[Samples] | Failed:
        """The record's ``n`` requests, submitted together (one prefill in the engine)."""
        if asked.n > self.limit:
            return Failed(
                f"bad input: n={asked.n} is more than this job keeps in flight ({self.limit}); "
                "lower n or split the line"
            )
        prompt = tuple(ids)
        requests = [
            GenerationRequest(f"record-{record.index}-{j}", prompt, sample)
            for j, sample in enumerate(params.samples(asked.n))
        ]
        taken = 0
        try:
            # every slot first, then the n requests in one go: the engine admits them in one
            # step, where they share one prefill of the prompt
            for _ in requests:
                await self._slots.acquire()
                taken += 1
            streams = self.gen.submit_many(requests)
        except BaseException as exc:
            for _ in range(taken):
                self._slots.release()
            if isinstance(exc, BatchlineError | ValueError):  # as _submit_one's
                return Failed(f"bad input: {told(exc)}")
            raise
        results: list[asyncio.Future[Completion]] = []
        for stream in streams:
            result = asyncio.ensure_future(stream.result())
            result.add_done_callback(self._on_done)
            results.append(result)
        return asyncio.ensure_future(gather_samples(results, asked, ids[0]))

    def _submit_one(
        self, record: Record, ids: list[int], params: SamplingParams, rid: str | None = None
    ) -> GenerationStream | Failed:
        try:
            return self.gen.submit(ids, params, request_id=rid or f"record-{record.index}")
        except (BatchlineError, ValueError) as exc:
            # RecordTooLargeError (over the context or the KV budget) is this record's fault
            return Failed(f"bad input: {told(exc)}")

    def _on_done(self, future: asyncio.Future[Completion]) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is None:
            done = future.result()
            self.tokens += done.completion_tokens
            self.prompt_tokens += done.prompt_tokens
            self.latencies.append(done.latency_s)
        self.sample(every_s=_SAMPLE_ON_DONE_S)  # completions are moments of high occupancy


def pipeline_limits(adapter: GeneratorAdapter) -> tuple[int, int]:
    """``run_pipeline``'s block size and blocks in flight for a generator: enough blocks to
    keep its in-flight cap full."""
    if adapter.order_window > 1:
        # one window read at a time, the next read while it runs
        return adapter.order_window, 2
    return _BLOCK, -(-adapter.limit // _BLOCK) + 1


@contextlib.asynccontextmanager
async def running_generator(
    model: GenerationModel,
    requests: RecordRequests,
    progress: Progress | None,
    *,
    order_window: int = 0,
    dedupe_window: int = 0,
    cache: CompletionCache | None = None,
) -> AsyncIterator[GeneratorAdapter]:
    """The model's generator started, and its adapter; on the way out the generator stops,
    drained when the block ended normally, else at once."""
    adapter = GeneratorAdapter(
        model,
        requests,
        progress,
        order_window=order_window,
        dedupe_window=dedupe_window,
        cache=cache,
    )
    gen = adapter.gen
    await gen.start()
    sampling = asyncio.create_task(adapter.sampler())
    drain = False
    try:
        yield adapter
        drain = True
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await gen.stop(drain=drain)
    adapter.peaks.see(gen.stats)


def plan_generate(options: RunOptions) -> tuple[GenerateOptions, RecordRequests]:
    """A generate job's resolved options (the built-in prompts as its input when it has none)
    and how its records are read (sync: it reads the input's first rows). ``--engine ray``
    plans here too, and its replicas read records with the same requests."""
    if not isinstance(options, GenerateOptions):  # plain RunOptions: default sampling
        options = dataclasses.replace(options, task=options.task or "generate", spec=None)
    opts = resolve(options)
    assert isinstance(opts, GenerateOptions)
    assert opts.spec is not None
    params = opts.sampling()
    if opts.input is None:
        opts = dataclasses.replace(
            opts, input=demo_prompts_path(), copy_columns=opts.copy_columns or ("answer",)
        )
    assert opts.input is not None
    if is_openai_batch_file(opts.input, opts.input_format, forced=opts.openai_batch):
        raise InputError(
            f"{opts.input} is an OpenAI batch file: run it with batchline.jobs.run.run_job "
            "(batchline run), which answers it line by line"
        )
    # the column named by --prompt-column (or --text-column), else the first the input has
    named = opts.prompt_column or (opts.text_column if opts.text_column != "text" else None)
    column = prompt_column(opts.input, fmt=opts.input_format, named=named)
    fallbacks = () if named else tuple(c for c in PROMPT_COLUMNS if c != column)
    requests = RecordRequests(column, opts.chat_template, params, n=opts.n, fallbacks=fallbacks)
    return opts, requests


async def run_generate_job(
    options: RunOptions, progress: Progress | None = None
) -> GenerateSummary:
    """Generate a completion for every prompt of ``options.input`` into ``options.output``.

    >>> summary = asyncio.run(run_generate_job(GenerateOptions(
    ...     input=Path("prompts.jsonl"), model="smollm2", max_tokens=64)))
    >>> summary.tokens_per_s

    An OpenAI batch file runs through :func:`batchline.jobs.run.run_job` (its own job).
    """
    opts, requests = await asyncio.to_thread(plan_generate, options)
    assert opts.spec is not None
    from batchline.models.generation import load_text_generator

    # The cache opens and the model loads before the output opens (as in run): either failing
    # leaves no half-made output behind that would need --resume or --overwrite.
    store = await asyncio.to_thread(open_cache, opts)
    cache = None if store is None else CompletionCache(store)
    with contextlib.ExitStack() as closing:  # the model, then the cache, whatever happens
        if cache is not None:
            closing.callback(cache.close)
        model = await asyncio.to_thread(load_text_generator, opts.spec, opts.knobs)
        closing.callback(model.close)
        source, writer = await asyncio.to_thread(open_generate_job, opts, requests)
        with writer:
            window = PREFIX_ORDER_WINDOW if opts.prefix_ordering else 0
            async with running_generator(
                model,
                requests,
                progress,
                order_window=window,
                dedupe_window=DEDUPE_WINDOW if opts.dedupe else 0,
                cache=cache,
            ) as adapter:
                block, blocks = pipeline_limits(adapter)
                done = await run_pipeline(
                    adapter,
                    source,
                    writer,
                    block_records=block,
                    max_blocks_in_flight=blocks,
                    limit=opts.limit,
                    on_bad_record=opts.on_bad_record,
                    progress=progress,
                )
            return generate_summary(writer.out_dir, opts, done, adapter)


async def _outcomes(
    pending: Sequence[_Pending], *, stamp: bool = False, model: GenerationModel | None = None
) -> list[Outcome]:
    """Each record's outcome, in order: its completion's text and figures (and with ``stamp``,
    an OpenAI batch file's row: the Unix time it was written, ``created``, and its
    ``choices``), or its failure, or its kept completion."""
    await settle(pending)
    outcomes: list[Outcome] = []
    for p in pending:
        if isinstance(p, Failed | Cached):
            outcomes.append(p if isinstance(p, Failed) else p.outcome)
            continue
        if p.cancelled():
            raise asyncio.CancelledError
        exc = p.exception()
        if exc is not None:
            if not isinstance(exc, Exception):
                raise exc
            # InputError: the record's own (a constraint the grammar engine gave up on)
            told_as = f"bad input: {told(exc)}" if isinstance(exc, InputError) else None
            outcomes.append(Failed(told_as or f"model error: {describe(exc)}"))
            continue
        done = p.result()
        stamped: dict[str, object] = {"created": int(time.time())} if stamp else {}
        if isinstance(done, Samples):
            assert model is not None  # its detokenizer writes the tokens' texts
            outcomes.append(samples_outcome(done, model.detokenizer, stamped, model.token_bytes))
            continue
        if done.finish_reason == "abort":
            outcomes.append(Failed("aborted before it finished"))
            continue
        figures: dict[str, object] = {
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
            **stamped,
        }
        if stamp:
            figures[CHOICES_COLUMN] = ""  # one plain completion (every row has the column)
        outcomes.append(Result(done.text, figures))
    return outcomes


def generate_summary(
    output: Path, options: RunOptions, done: PipelineRun, adapter: GeneratorAdapter
) -> GenerateSummary:
    """What a job of ``adapter``'s generator did, for the CLI's table."""
    model = adapter.model
    stats = adapter.gen.stats
    cap = model.max_running
    return GenerateSummary(
        output=output,
        batching=options.knobs.batching,
        **done.counts(),
        padding_waste=0.0,
        avg_batch_cost=0.0,
        latency_p50_s=percentile(adapter.latencies, 50),
        latency_p99_s=percentile(adapter.latencies, 99),
        generation_batching=model.batching,
        dtype=model.dtype,
        weights=model.weights,
        utilization=stats.avg_running_per_step / cap if cap else 0.0,
        avg_batch_size=stats.avg_running_per_step,
        generated_tokens=adapter.tokens,
        prompt_tokens=adapter.prompt_tokens,
        ttft_p50_s=stats.ttft_p50_s,
        ttft_p99_s=stats.ttft_p99_s,
        itl_p50_s=stats.itl_p50_s,
        itl_p99_s=stats.itl_p99_s,
        max_running=cap,
        running_cap=stats.running_cap,
        running_peak=adapter.peaks.running,
        waiting_peak=adapter.peaks.waiting,
        in_flight_limit=adapter.limit,
        avg_running_per_step=stats.avg_running_per_step,
        kv_token_budget=stats.kv_token_budget,
        kv_reserved_peak=adapter.peaks.kv_reserved,
        aborted=stats.requests_aborted,
        preempted=stats.preempted,
        failed=stats.requests_failed,
        prefix_ordering=adapter.order_window > 1,
        prefix_cache_tokens=stats.prefix_cache_tokens,
        prefix_cache_hits=stats.prefix_cache_hits,
        prefix_tokens_reused=stats.prefix_tokens_reused,
        prompt_tokens_computed=stats.prompt_tokens_computed,
        prompts_shared=stats.prompts_shared,
        duplicates=adapter.duplicates,
        cached=adapter.cached,
    )
