"""``batchline run --task generate``: text generation over a dataset of prompts, resumable.

The same dataset machinery as every ``run`` (``open_dataset_job``, ``ChunkWriter``,
``write_outcomes``), with a text generator in place of a batch function::

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
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import math
import os
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from batchline._errors import BatchlineError, InputError
from batchline._stats import percentile
from batchline.datasets.outcomes import Failed, Outcome, cancel, describe, write_outcomes
from batchline.datasets.sinks import ChunkWriter
from batchline.datasets.sources import BadRecord, Record, Source, open_source, read_blocks_ahead
from batchline.jobs.openai_batch import detect_batch
from batchline.jobs.requests import RecordRequests, job_constraint, reads_whole_rows
from batchline.jobs.run import (
    Progress,
    RunOptions,
    RunSummary,
    _Silent,
    default_output,
    expected_records,
    finish_output,
    job_spec,
    open_dataset_job,
)
from batchline.models.generation.engine import SamplingParams
from batchline.models.protocol import ModelInfo

if TYPE_CHECKING:
    from batchline.models.generation.load import GenerationModel
    from batchline.models.generation.stats import GenerationStats
    from batchline.models.generation.stream import Completion, TextGenerator

__all__ = [
    "GenerateOptions",
    "GenerateSummary",
    "TokenRate",
    "demo_prompts_path",
    "in_flight_limit",
    "is_generate_job",
    "run_generate_job",
]

#: Records read and encoded at a time.
_BLOCK = 64
#: Seconds between two reads of the generator's stats (peaks and the progress bar's rate).
_SAMPLE_S = 0.25
#: ... and at most this often on a request's completion.
_SAMPLE_ON_DONE_S = 0.02
#: Prompt columns looked for, in order, when none is named.
PROMPT_COLUMNS = ("prompt", "messages", "text")
_DEMO_NAME = "demo-prompts.jsonl"
_DEMO_COUNT = 300


@dataclass
class GenerateOptions(RunOptions):
    """:class:`RunOptions` plus how to sample (see ``SamplingParams``) and read prompts.

    ``seed`` with ``temperature > 0`` makes sampling repeatable: record ``i`` draws from
    ``seed + i``, whatever shares its batch (so a resumed job samples what the killed one
    would have).

    ``response_format`` constrains every completion (structured outputs; a record's own
    fields win): see :mod:`batchline.jobs.requests`.
    """

    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    chat_template: bool = True
    #: the column holding prompts (text or chat messages); None: prompt, messages, else text
    prompt_column: str | None = None
    response_format: str | None = None
    #: the input is an OpenAI batch file (``--format openai-batch``; else detected from it)
    openai_batch: bool = False

    def sampling(self) -> SamplingParams:
        """The job's sampling parameters (``seed`` is per record: see the class docstring)."""
        try:
            return SamplingParams(
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=tuple(self.stop),
                constraint=job_constraint(self.response_format),
            )
        except ValueError as exc:
            raise InputError(f"sampling settings: {exc}") from None


@runtime_checkable
class TokenRate(Protocol):
    """A progress display that also shows generation speed (the CLI's bar)."""

    def tokens(self, generated: int, tokens_per_s: float) -> None:
        """``generated`` tokens so far in this run, at ``tokens_per_s``."""


@dataclass(frozen=True)
class GenerateSummary(RunSummary):
    """What a generation job did (this run's records only); latencies are per request, from
    ``submit`` (time in the waiting queue included)."""

    generation_batching: str = "continuous"
    dtype: str = ""
    generated_tokens: int = 0
    prompt_tokens: int = 0
    ttft_p50_s: float = math.nan
    ttft_p99_s: float = math.nan
    itl_p50_s: float = math.nan
    itl_p99_s: float = math.nan
    max_running: int = 0
    running_peak: int = 0
    waiting_peak: int = 0
    in_flight_limit: int = 0
    avg_running_per_step: float = 0.0
    kv_token_budget: int = 0
    kv_reserved_peak: int = 0
    aborted: int = 0
    preempted: int = 0
    failed: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s > 0 else 0.0

    def rows(self) -> list[tuple[str, str]]:
        budget = (
            f"{self.kv_reserved_peak:,} / {self.kv_token_budget:,} "
            f"({self.kv_reserved_peak / self.kv_token_budget:.0%})"
            if self.kv_token_budget
            else "n/a"
        )
        return [
            ("output", str(self.output)),
            ("mode", _MODES.get(self.generation_batching, self.generation_batching)),
            *([("dtype", self.dtype)] if self.dtype else []),
            ("records (this run)", f"{self.records:,}"),
            ("skipped", f"{self.skipped:,}"),
            ("resumed (already done)", f"{self.already_done:,}"),
            ("wall time", f"{self.wall_s:.1f} s"),
            ("tokens generated", f"{self.generated_tokens:,}"),
            ("tokens/s", f"{self.tokens_per_s:,.1f}"),
            ("records/s", f"{self.records_per_s:,.2f}"),
            ("TTFT p50 / p99", f"{_ms(self.ttft_p50_s)} / {_ms(self.ttft_p99_s)}"),
            ("inter-token p50 / p99", f"{_ms(self.itl_p50_s)} / {_ms(self.itl_p99_s)}"),
            ("end-to-end p50 / p99", f"{_ms(self.latency_p50_s)} / {_ms(self.latency_p99_s)}"),
            ("running peak (sampled) / cap", f"{self.running_peak} / {self.max_running}"),
            ("avg running per step", f"{self.avg_running_per_step:.1f}"),
            ("waiting peak (in-flight cap)", f"{self.waiting_peak} ({self.in_flight_limit})"),
            ("KV reserved peak / budget", budget),
            (
                "aborted / preempted / failed",
                f"{self.aborted} / {self.preempted} / {self.failed}",
            ),
        ]


_MODES = {
    "continuous": "continuous batching",
    "static": "static batching",
    "sequential": "no batching (one sequence at a time)",
    "vllm": "vLLM",
}


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{seconds * 1e3:,.1f} ms"


def is_generate_job(options: RunOptions) -> bool:
    """Whether ``options`` name a generation job: task ``generate``, or a model that
    generates (``smollm2``, a Hugging Face causal-LM folder)."""
    if isinstance(options, GenerateOptions) or options.task == "generate":
        return True
    if options.input is not None and detect_batch(as_generate_options(options)) is not None:
        return True
    return bool(job_spec(options).generates)


def as_generate_options(options: RunOptions) -> GenerateOptions:
    """``options`` as :class:`GenerateOptions` (default sampling for plain ``RunOptions``)."""
    if isinstance(options, GenerateOptions):
        return options
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(RunOptions)}
    return GenerateOptions(**values)


def in_flight_limit(model: GenerationModel) -> int:
    """Requests the job keeps submitted and unfinished: enough to keep every running slot busy
    and the next ones queued (4 × the running cap), never more than the waiting queue holds
    (every request in flight may be waiting at once, before the engine admits any)."""
    return max(1, min(model.max_waiting, 4 * model.max_running))


def demo_prompts_path() -> Path:
    """The built-in math prompts as JSONL in batchline's cache folder (rewritten if the
    prompts changed, so a resume sees the same file only when the prompts are the same)."""
    from batchline._cache import cache_dir
    from batchline.models.generation.demo import demo_prompts

    lines = "".join(
        json.dumps(r, ensure_ascii=False, separators=(", ", ": ")) + "\n"
        for r in demo_prompts(_DEMO_COUNT)
    ).encode("utf-8")
    path = cache_dir() / _DEMO_NAME
    with contextlib.suppress(OSError):
        if path.read_bytes() == lines:
            return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(lines)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    return path


def _prompt_column(options: GenerateOptions, input_path: Path) -> str:
    """The column to read prompts from; ``InputError`` naming the columns when it is absent."""
    probe = open_source(
        input_path,
        fmt=options.input_format,
        input_kind="record",
        extra_columns=(),
        on_bad_record="skip",
    )
    if probe.format == "text":
        return options.prompt_column or options.text_column
    columns = probe.columns
    named = options.prompt_column or (
        options.text_column if options.text_column != "text" else None
    )
    if named is None:
        named = next((c for c in PROMPT_COLUMNS if c in columns), "text")
    if columns and named not in columns:
        where = "the first record has" if probe.format == "jsonl" else "its columns are"
        names = ", ".join(repr(c) for c in columns)
        raise InputError(
            f"{input_path}: no prompt column {named!r}; {where}: {names} "
            "(choose one with --prompt-column)"
        )
    return named


def _open(
    options: GenerateOptions, column: str, params: SamplingParams
) -> tuple[Source, ChunkWriter]:
    assert options.input is not None
    whole_rows = reads_whole_rows(options.input, options.input_format)
    info = ModelInfo(name="", task="generate")
    output = options.output or default_output(options.input, options.output_format, info)
    settings: dict[str, object] = {
        "task": "generate",
        "sampling": {
            "max_tokens": params.max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "seed": params.seed,
            "stop": list(params.stop),
            "constraint": None
            if params.constraint is None
            else {"kind": params.constraint.kind, "spec": params.constraint.spec},
        },
        "chat_template": options.chat_template,
    }
    return open_dataset_job(
        dataclasses.replace(options, text_column=column, input_columns=()),
        output=output,
        chunk_size=options.chunk_size,
        extra_settings=settings,
        result_column="text",
        result_kind="value",
        input_kind="record",
        # a record's constraint fields are read with its prompt (whole rows)
        default_input=None if whole_rows else column,
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
            out.append(Failed(f"bad input: {describe(exc)}"))
            continue
        out.append(ids if ids else Failed("bad input: the prompt has no tokens"))
    return out


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


async def run_generate_job(
    options: RunOptions, progress: Progress | None = None
) -> GenerateSummary:
    """Generate a completion for every prompt of ``options.input`` into ``options.output``.

    >>> summary = asyncio.run(run_generate_job(GenerateOptions(
    ...     input=Path("prompts.jsonl"), model="smollm2", max_tokens=64)))
    >>> summary.tokens_per_s
    """
    opts = as_generate_options(options)
    if opts.model == "default":  # the default model embeds: generation's default is smollm2
        opts = dataclasses.replace(opts, model="smollm2")
    params = opts.sampling()
    if opts.input is None:
        demo = await asyncio.to_thread(demo_prompts_path)
        opts = dataclasses.replace(opts, input=demo, copy_columns=opts.copy_columns or ("answer",))
    assert opts.input is not None
    shown: Progress = progress if progress is not None else _Silent()
    spec = job_spec(dataclasses.replace(opts, task=opts.task or "generate"))
    batch = await asyncio.to_thread(detect_batch, opts)
    if batch is not None:
        opts = batch.job_options(opts)
    input_path: Path = opts.input if opts.input is not None else Path()
    column = "body" if batch else await asyncio.to_thread(_prompt_column, opts, input_path)
    requests = RecordRequests(
        column, opts.chat_template, params, openai_batch=batch is not None, model_name=spec.name
    )
    from batchline.models.generation.load import load_text_generator

    # The model loads before the output opens (as in run): a model that fails to load leaves
    # no half-made output behind that would need --resume or --overwrite.
    model = await asyncio.to_thread(load_text_generator, spec, opts.knobs)
    try:
        source, writer = await asyncio.to_thread(_open, opts, column, params)
        with writer:
            if writer.manifest.complete:
                total = writer.manifest.total_records or 0
                shown.start(total, total)
                summary = _summary(writer.out_dir, opts, 0, 0, total, total, 0.0, None, None, [])
            else:
                committed = writer.committed_ranges()
                already = sum(hi - lo for lo, hi in committed)
                shown.start(expected_records(source, opts.limit), already)
                summary = await _pipeline(source, writer, model, opts, requests, committed, shown)
    finally:
        model.close()
    if batch is not None:
        output = await asyncio.to_thread(batch.write_output)
        summary = dataclasses.replace(summary, output=output)
    return summary


async def _pipeline(
    source: Source,
    writer: ChunkWriter,
    model: GenerationModel,
    options: GenerateOptions,
    requests: RecordRequests,
    committed: list[tuple[int, int]],
    progress: Progress,
) -> GenerateSummary:
    gen: TextGenerator = model.generator
    limit = in_flight_limit(model)
    slots = asyncio.Semaphore(limit)
    counts = {"records": 0, "skipped": 0, "tokens": 0, "prompt_tokens": 0}
    latencies: list[float] = []
    peaks = _Peaks()
    failure: list[BaseException] = []
    blocks_done: set[asyncio.Task[None]] = set()
    started = time.perf_counter()

    def occupancy() -> float:
        """Running sequences over the running cap, at the last sample (the bar's field)."""
        return peaks.last_running / model.max_running if model.max_running else 0.0

    def sample(*, every_s: float = 0.0) -> None:
        now = time.perf_counter()
        # a stats snapshot sorts its latency windows: at most one per every_s
        if now - peaks.sampled_at >= every_s:
            peaks.see(gen.stats)
            peaks.sampled_at = now
        if isinstance(progress, TokenRate):
            elapsed = now - started
            rate = counts["tokens"] / elapsed if elapsed > 0 else 0.0
            progress.tokens(counts["tokens"], rate)

    async def sampler() -> None:
        while True:
            sample()
            await asyncio.sleep(_SAMPLE_S)

    def on_done(future: asyncio.Future[Completion]) -> None:
        slots.release()
        if not future.cancelled() and future.exception() is None:
            done = future.result()
            counts["tokens"] += done.completion_tokens
            counts["prompt_tokens"] += done.prompt_tokens
            latencies.append(done.latency_s)
        sample(every_s=_SAMPLE_ON_DONE_S)  # completions are moments of high occupancy
        progress.advance(1, occupancy())

    async def finish_block(records: list[Record], pending: list[Any]) -> None:
        try:
            futures = [p for p in pending if not isinstance(p, Failed)]
            await asyncio.gather(*futures, return_exceptions=True)
            rows, outcomes = _outcomes(records, pending, stamp=requests.openai_batch)
            written, skipped = await asyncio.to_thread(
                write_outcomes, writer, rows, outcomes, on_bad_record=options.on_bad_record
            )
            counts["records"] += written
            counts["skipped"] += skipped
            failed_here = sum(isinstance(p, Failed) for p in pending)
            if failed_here:
                progress.advance(failed_here, occupancy())
        except BaseException as exc:
            failure.append(exc)

    def submit(record: Record, ids: list[int]) -> asyncio.Future[Completion] | Failed:
        try:
            own = requests.params(record)
            stream = gen.submit(ids, own, request_id=f"record-{record.index}")
        except (BatchlineError, ValueError) as exc:
            # RecordTooLargeError (over the context or the KV budget) is this record's fault
            return Failed(f"bad input: {describe(exc)}")
        return asyncio.ensure_future(stream.result())

    await gen.start()
    sampling = asyncio.create_task(sampler())
    drain = True
    try:
        blocks = read_blocks_ahead(source, _BLOCK, skip=committed, limit=options.limit)
        async with contextlib.aclosing(blocks):
            async for block in blocks:
                if failure:
                    break
                bad = [item for item in block if isinstance(item, BadRecord)]
                for item in bad:
                    await asyncio.to_thread(writer.skip_bad, item)
                if bad:
                    counts["skipped"] += len(bad)
                    progress.advance(len(bad), occupancy())
                records = [item for item in block if isinstance(item, Record)]
                if not records:
                    continue
                encoded = await asyncio.to_thread(_encode, model, records, requests)
                pending: list[asyncio.Future[Completion] | Failed] = []
                for record, ids in zip(records, encoded, strict=True):
                    if isinstance(ids, Failed):
                        pending.append(ids)
                        continue
                    await slots.acquire()
                    outcome = submit(record, ids)
                    if isinstance(outcome, Failed):
                        slots.release()
                    else:
                        outcome.add_done_callback(on_done)
                    pending.append(outcome)
                    if failure:
                        break
                if failure:
                    cancel(pending)
                    break
                task = asyncio.create_task(finish_block(records, list(pending)))
                blocks_done.add(task)
                task.add_done_callback(blocks_done.discard)
        await asyncio.gather(*blocks_done)
        if failure:
            raise failure[0]
    except BaseException:
        drain = False
        for task in blocks_done:
            task.cancel()
        await asyncio.gather(*blocks_done, return_exceptions=True)
        raise
    finally:
        sampling.cancel()
        await asyncio.gather(sampling, return_exceptions=True)
        await gen.stop(drain=drain)
    stats = gen.stats
    peaks.see(stats)
    total = await finish_output(writer, source, options.limit)
    wall = time.perf_counter() - started
    already = sum(hi - lo for lo, hi in committed)
    return _summary(
        writer.out_dir,
        options,
        counts["records"],
        counts["skipped"],
        already,
        total,
        wall,
        model,
        (stats, peaks, limit, counts),
        latencies,
    )


def _outcomes(
    records: Sequence[Record],
    pending: Sequence[asyncio.Future[Completion] | Failed],
    *,
    stamp: bool = False,
) -> tuple[list[Record], list[Outcome]]:
    """Each record (its completion's figures added as columns, and with ``stamp`` the Unix
    time it was written, ``created``) and its outcome, in order."""
    rows: list[Record] = []
    outcomes: list[Outcome] = []
    for record, p in zip(records, pending, strict=True):
        if isinstance(p, Failed):
            rows.append(record)
            outcomes.append(p)
            continue
        if p.cancelled():
            raise asyncio.CancelledError
        exc = p.exception()
        if exc is not None:
            if not isinstance(exc, Exception):
                raise exc
            rows.append(record)
            outcomes.append(Failed(f"model error: {describe(exc)}"))
            continue
        done = p.result()
        if done.finish_reason == "abort":
            rows.append(record)
            outcomes.append(Failed("aborted before it finished"))
            continue
        figures: dict[str, object] = {
            "finish_reason": done.finish_reason,
            "prompt_tokens": done.prompt_tokens,
            "completion_tokens": done.completion_tokens,
        }
        if stamp:
            figures["created"] = int(time.time())
        rows.append(dataclasses.replace(record, extra={**record.extra, **figures}))
        outcomes.append(done.text)
    return rows, outcomes


def _summary(
    output: Path,
    options: GenerateOptions,
    records: int,
    skipped: int,
    already: int,
    total: int,
    wall: float,
    model: GenerationModel | None,
    run: tuple[GenerationStats, _Peaks, int, dict[str, int]] | None,
    latencies: list[float],
) -> GenerateSummary:
    knobs = options.knobs
    mode = (
        model.batching
        if model is not None
        else ("sequential" if not knobs.batching else knobs.generation_batching)
    )
    common: dict[str, Any] = {
        "output": output,
        "batching": knobs.batching,
        "records": records,
        "skipped": skipped,
        "already_done": already,
        "total_records": total,
        "wall_s": wall,
        "padding_waste": 0.0,
        "avg_batch_cost": 0.0,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "generation_batching": mode,
        "dtype": model.dtype if model is not None else "",
    }
    if run is None or model is None:
        return GenerateSummary(utilization=0.0, avg_batch_size=0.0, **common)
    stats, peaks, limit, counts = run
    cap = model.max_running
    return GenerateSummary(
        utilization=stats.avg_running_per_step / cap if cap else 0.0,
        avg_batch_size=stats.avg_running_per_step,
        generated_tokens=counts["tokens"],
        prompt_tokens=counts["prompt_tokens"],
        ttft_p50_s=stats.ttft_p50_s,
        ttft_p99_s=stats.ttft_p99_s,
        itl_p50_s=stats.itl_p50_s,
        itl_p99_s=stats.itl_p99_s,
        max_running=cap,
        running_peak=peaks.running,
        waiting_peak=peaks.waiting,
        in_flight_limit=limit,
        avg_running_per_step=stats.avg_running_per_step,
        kv_token_budget=stats.kv_token_budget,
        kv_reserved_peak=peaks.kv_reserved,
        aborted=stats.requests_aborted,
        preempted=stats.preempted,
        failed=stats.requests_failed,
        **common,
    )
