"""OpenAI batch files in and out: ``batchline run requests.jsonl`` where each line is
``{"custom_id", "method": "POST", "url", "body"}``, ``url`` one of ``/v1/chat/completions``,
``/v1/completions``, ``/v1/embeddings``, ``/v1/rerank``, ``/v1/score`` and ``/v1/classify``,
mixed as they come.

The job has one generator, one embedding model, one reranker and one classifier at most
(``--model NAME=SPEC`` repeated); each line's ``body.model`` picks one by ``NAME`` (a line
naming none takes the job's model of its kind; a name the job lacks is that line's error,
naming the ``--model`` flag to add). One pipeline reads the file: :class:`LinesAdapter` sends
each block's chat and completions lines to the generator (as any generate job), its
embeddings lines to the embedding model's batcher, its classify lines to the classifier's and
its rerank and score lines to the reranker's (every text or picture of a line's ``input``,
every pair of a rerank line, its own record there, so items of many lines share
batches), into one chunked output folder beside the output file (``OUTPUT.parts``), so the job
is resumable like every job. The output file is then written, whole and atomically, from the
committed chunks: one line per input line, in input order, ``{"id", "custom_id", "response":
{"status_code": 200, "request_id", "body"}, "error": null}``, or ``"response": null`` and
``"error": {"code", "message"}`` for a line that failed (malformed JSON, an unknown url, a bad
body, a model the job lacks). Blank lines are skipped (no output line; the summary counts
them). A file whose ``custom_id`` values repeat is refused whole before anything runs, as
OpenAI's validation refuses it (:func:`check_batch_file`): its output lines could not be told
apart. A body is what the OpenAI route returns: a ``chat.completion``, a ``text_completion``,
an embeddings ``list`` (``encoding_format`` float or base64), what ``/v1/classify`` answers
(``batchline.models.openai.classify``), or what ``/v1/rerank`` and ``/v1/score`` answer
(``batchline.models.scoring``). Its
ids derive from the line and the input file's fingerprint (another file's line 0 gets another
id; the Batch API's from the batch's id instead), and ``created`` is when the completion was
made (kept in the chunk), so a job killed and resumed writes the same file as one that never
stopped but for the ``created`` of the completions the killed run had not committed.

Example::

    batchline run requests.jsonl --model text-embedding-3-small=default \\
        --model gpt-4o-mini=smollm2 --output results.jsonl
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._cache import write_whole
from batchline._errors import InputError
from batchline.datasets.flushed import flushed_output
from batchline.datasets.formats.base import file_fingerprint
from batchline.datasets.formats.base import lines as nonblank_lines
from batchline.datasets.manifest import MANIFEST_NAME
from batchline.datasets.outcomes import Failed, Outcome, Result, told
from batchline.datasets.pipeline import PipelineRun, Progress, open_dataset_job, run_pipeline
from batchline.datasets.readers import read_output, read_skipped
from batchline.datasets.sources import Record
from batchline.jobs.batch import DEDUPE_WINDOW, cancel
from batchline.jobs.generate import (
    GeneratorAdapter,
    generate_summary,
    pipeline_limits,
    running_generator,
)
from batchline.jobs.openai_lines import BatchLines, Line, LineEngine
from batchline.jobs.openai_output import output_line
from batchline.jobs.options import GenerateOptions, batch_specs
from batchline.jobs.requests import (
    KIND_OF_URL,
    BatchModels,
    RecordRequests,
    batch_line,
    classify_line,
    custom_id_error,
    embedding_line,
    first_duplicate_custom_id,
    is_openai_batch_file,
)
from batchline.jobs.summary import GenerateSummary, RunSummary, summarize
from batchline.models.batching import ModelBatcher
from batchline.models.openai.requests import (
    BODY_OF_URL,
    ClassifyRequest,
    EmbeddingRequest,
    read_body,
)
from batchline.models.scoring import (
    RERANK_URL,
    read_rerank,
    read_score,
)

if TYPE_CHECKING:
    from batchline.datasets.outcomes import Written
    from batchline.datasets.sinks import ChunkWriter
    from batchline.datasets.sources import Source
    from batchline.jobs.options import RunOptions
    from batchline.models.config import Knobs
    from batchline.models.generation import GenerationModel
    from batchline.models.protocol import BatchModel
    from batchline.models.specs import ModelSpec

__all__ = [
    "BatchFiles",
    "BatchJobModels",
    "LineEngine",
    "LinesAdapter",
    "answer_lines",
    "check_batch_file",
    "detect_batch",
    "load_batch_models",
    "open_batch_parts",
    "run_batch_job",
    "started_batch_models",
]

#: Lines read at a time when the job has no generator (the generator sets its own).
_BLOCK = 64
_MAX_BLOCKS_IN_FLIGHT = 8


def check_batch_file(path: Path) -> int:
    """The number of blank lines of the batch file ``path`` (skipped); ``InputError`` naming
    the first ``custom_id`` that repeats and the two lines that carry it, or the first that is
    not a string
    (:func:`~batchline.jobs.requests.first_duplicate_custom_id`, which ``serve``'s Batch API
    validates with too). One pass; malformed lines are left to the job: each becomes its own
    error line."""
    blank = 0

    def parsed() -> Iterator[tuple[int, object]]:
        nonlocal blank
        with path.open("rb") as f:
            for lineno, raw in enumerate(f, 1):
                line = raw.removeprefix(b"\xef\xbb\xbf") if lineno == 1 else raw
                if not line.strip():
                    blank += 1
                    continue
                try:
                    value = json.loads(line)
                except ValueError:
                    continue
                wrong = custom_id_error(value)
                if wrong is not None:
                    raise InputError(f"{path}: line {lineno}: {wrong} (OpenAI refuses it too)")
                yield lineno, value

    duplicate = first_duplicate_custom_id(parsed())
    if duplicate is not None:
        custom_id, first, second = duplicate
        raise InputError(
            f"{path}: custom_id {json.dumps(custom_id, ensure_ascii=False)} is on lines {first} "
            f"and {second}; give each line of an OpenAI batch file its own custom_id (OpenAI "
            "refuses such a file too)"
        )
    return blank


def detect_batch(options: RunOptions) -> BatchFiles | None:
    """The batch files of a job whose input is an OpenAI batch file (``--format openai-batch``,
    or a JSONL input whose first line is a batch request); None for any other job."""
    path = options.input
    if path is None or not is_openai_batch_file(
        path, options.input_format, forced=getattr(options, "openai_batch", False)
    ):
        return None
    output = options.output or Path(f"{path.stem}.output.jsonl")
    return BatchFiles(path, output, output.with_name(output.name + ".parts"))


@dataclasses.dataclass(frozen=True)
class BatchFiles:
    """An OpenAI batch job's input file, output file, and the chunk folder between them;
    ``job_id``, what the output lines' ids derive from besides the line (the Batch API's batch
    id; ``None``: the input file's fingerprint, the same for a resumed ``run``)."""

    input: Path
    output: Path
    parts: Path
    job_id: str | None = None

    def job_options(self, options: GenerateOptions) -> GenerateOptions:
        """The options of the job that runs the batch: JSONL in, chunks out, a bad line an
        error."""
        return dataclasses.replace(
            options,
            input_format="jsonl",
            openai_batch=True,
            output=self.parts,
            on_bad_record="skip",
            copy_columns=(),
        )

    @property
    def started(self) -> bool:
        """Whether the chunk folder holds a job (its manifest): what a resume continues."""
        return (self.parts / MANIFEST_NAME).is_file()

    def write_output(self, *, not_run: tuple[str, str] | None = None) -> Path:
        """Write the output file from the committed chunks (replacing it whole). A line that
        was not run (``--limit``; a batch cancelled or expired) has no output line, or with
        ``not_run=(code, message)`` an error line saying so."""
        have = self.started
        rows = {int(r["index"]): r for r in read_output(self.parts).to_pylist()} if have else {}
        skipped = (
            {int(s["index"]): s for s in read_skipped(self.parts)}  # type: ignore[call-overload]
            if have
            else {}
        )
        if have:  # a stopped batch's last answers, in no chunk (so none of the above): kept
            more_rows, more_skipped = flushed_output(self.parts)
            rows.update(more_rows)
            skipped.update(more_skipped)
        with self.input.open("rb") as f:  # non-blank lines, as the JSONL reader numbers records
            raws = [line for _, line in nonblank_lines(f)]
        job = self.job_id if self.job_id is not None else file_fingerprint(self.input)
        lines = []
        for index, raw in enumerate(raws):
            if index not in rows and index not in skipped and not_run is None:
                continue  # not run (--limit)
            try:
                request: object = json.loads(raw)
            except ValueError:
                request = None
            if not isinstance(request, dict):
                request = {}
            lines.append(
                output_line(index, request, rows.get(index), skipped.get(index), not_run, job=job)
            )
        write_whole(
            self.output, "".join(line + "\n" for line in lines).encode("utf-8"), "batch.output"
        )
        umask = os.umask(0o022)  # read, then put back: the mode open() gives every other output
        os.umask(umask)
        self.output.chmod(0o666 & ~umask)  # not the temporary file's 0600
        return self.output


#: Where a line goes: the model's name, its kind (``KIND_OF_URL``), and what a batch model's
#: line asks (None for a generator's line); or the line's failure.
_Route = tuple[str, str, Line | None] | Failed


class LinesAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for the lines of an OpenAI batch file:
    each line goes to the model its ``body.model`` picks (``names``), chat and completions
    lines to ``generator``, embeddings lines and rerank or score lines to the batch model of
    that task (``engines``); a line that cannot go anywhere is its :class:`Failed`. Every
    written row carries the name of the model that answered it (a ``model`` column)."""

    def __init__(
        self,
        names: BatchModels,
        generator: GeneratorAdapter | None,
        engines: Mapping[str, LineEngine],
    ) -> None:
        self.names = names
        self.generator = generator
        self.batch = {task: BatchLines(engine) for task, engine in engines.items()}

    def utilization(self) -> float:
        if self.generator is not None:
            return self.generator.utilization()
        return max((b.engine.stats.utilization for b in self.batch.values()), default=0.0)

    def _route(self, record: Record) -> _Route:
        """The model that answers ``record`` and, for a batch model's line, what it asks."""
        try:
            url, fields = batch_line(record.value)
            name = self.names.pick(url, fields.get("model"))
            body = read_body(BODY_OF_URL[url], fields)
            kind = KIND_OF_URL[url]
            if kind == "generate":
                return name, kind, None
            if isinstance(body, EmbeddingRequest):
                return name, kind, embedding_line(body, self.batch[kind].dim, name)
            if isinstance(body, ClassifyRequest):
                return name, kind, classify_line(body)
            return name, kind, read_rerank(fields) if url == RERANK_URL else read_score(fields)
        except ValueError as exc:
            return Failed(f"bad input: {told(exc)}")

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        routes = [self._route(r) for r in records]
        chats: list[Record] = []
        lines: dict[str, list[Line]] = {}
        for record, route in zip(records, routes, strict=True):
            if not isinstance(route, Failed):
                _, kind, line = route
                if line is None:
                    chats.append(record)
                else:
                    lines.setdefault(kind, []).append(line)
        parts: dict[str, asyncio.Future[list[Outcome]]] = {}
        try:
            if chats:
                assert self.generator is not None  # pick() named the job's generator
                parts["generate"] = asyncio.ensure_future(await self.generator.submit(chats))
            for kind, mine in lines.items():
                parts[kind] = await self.batch[kind].submit(mine)
        except BaseException:
            cancel(list(parts.values()))
            raise
        return asyncio.ensure_future(self._merge(routes, parts))

    async def _merge(
        self, routes: Sequence[_Route], parts: Mapping[str, asyncio.Future[list[Outcome]]]
    ) -> list[Outcome]:
        try:
            await asyncio.gather(*parts.values())
        except BaseException:
            cancel(list(parts.values()))
            raise
        done = {kind: iter(part.result()) for kind, part in parts.items()}
        outcomes: list[Outcome] = []
        for route in routes:
            if isinstance(route, Failed):
                outcomes.append(route)
                continue
            name, kind, _ = route
            got = next(done[kind])
            if isinstance(got, Result):
                got = Result(got.value, {**got.columns, "model": name})
            outcomes.append(got)
        return outcomes


@dataclasses.dataclass
class BatchJobModels:
    """An OpenAI batch job's loaded models: a generator, and batch models by task (an embedding
    model, a reranker), at most one of each."""

    names: BatchModels
    generator: GenerationModel | None = None
    batch: dict[str, BatchModel[object, object]] = dataclasses.field(default_factory=dict)

    def close(self) -> None:
        for model in (self.generator, *self.batch.values()):
            if model is not None:
                model.close()


#: What each batch model's task answers in a batch file, for the messages.
_LINES_OF_TASK = {
    "embed": "embeddings lines",
    "score": "rerank and score lines",
    "classify": "classify lines",
}
_WHAT_OF_TASK = {"embed": "embedding model", "score": "reranker", "classify": "classifier"}


def load_batch_models(specs: Sequence[ModelSpec], knobs: Knobs) -> BatchJobModels:
    """Load the job's models (sync: slow). ``InputError`` for two of a kind, or a model that
    neither generates, embeds nor scores."""
    generators = [s for s in specs if s.generates]
    others = [s for s in specs if not s.generates]
    if len(generators) > 1:
        names = " and ".join(repr(s.name) for s in generators)
        raise InputError(
            f"an OpenAI batch job takes one generator at most, got {names}; give one --model "
            "for chat and completions lines, one for embeddings lines and one for rerank lines"
        )
    from batchline.models.loader import load_model

    models = BatchJobModels(BatchModels())
    try:
        for spec in others:
            model = load_model(spec, knobs.for_loading())
            task = model.info.task
            if task not in _LINES_OF_TASK or task in models.batch:
                model.close()
            if task not in _LINES_OF_TASK:
                raise InputError(
                    f"model {spec.name!r} does {task}: an OpenAI batch file's models embed "
                    "(/v1/embeddings lines), score (/v1/rerank and /v1/score lines), classify "
                    "(/v1/classify lines) or generate (chat and completions lines)"
                )
            if task in models.batch:
                first = getattr(models.names, task)
                raise InputError(
                    f"an OpenAI batch job takes one {_WHAT_OF_TASK[task]} at most, got "
                    f"{first!r} and {spec.name!r}; give one --model for its {_LINES_OF_TASK[task]}"
                )
            models.batch[task] = model
            models.names = dataclasses.replace(models.names, **{task: spec.name})
        if generators:
            from batchline.models.generation import load_text_generator

            (spec,) = generators
            models.generator = load_text_generator(spec, knobs)
            models.names = dataclasses.replace(models.names, generate=spec.name)
    except BaseException:
        models.close()
        raise
    return models


def open_batch_parts(options: GenerateOptions, models: Sequence[str]) -> tuple[Source, ChunkWriter]:
    """The batch file's source and the chunk writer of ``OUTPUT.parts``: one row per answered
    line (a completion's ``text``, or an embeddings line's ``embeddings``); ``models`` name the
    job's models in its resume settings."""
    assert options.output is not None
    settings: dict[str, object] = {
        "task": "openai-batch",
        "models": list(models),
        "max_tokens": options.max_tokens,  # a line's max_tokens when its body gives none
    }
    return open_dataset_job(
        dataclasses.replace(options, text_column="body", input_columns=()),
        model=options.model,
        output=options.output,
        chunk_size=options.chunk_size,
        extra_settings=settings,
        result_column="text",
        result_kind="value",
        input_kind="record",
        input_columns=(),
    )


@contextlib.asynccontextmanager
async def started_batch_models(
    models: BatchJobModels, options: GenerateOptions, progress: Progress | None
) -> AsyncIterator[tuple[GeneratorAdapter | None, dict[str, ModelBatcher[object, object]]]]:
    """The job's generator started (its adapter) and a started batcher per batch model, as
    :func:`answer_lines` takes them; stopped on the way out."""
    async with contextlib.AsyncExitStack() as stack:
        generator: GeneratorAdapter | None = None
        if models.generator is not None:
            requests = RecordRequests("body", True, options.sampling(), openai_batch=True)
            generator = await stack.enter_async_context(
                running_generator(
                    models.generator,
                    requests,
                    progress,
                    dedupe_window=DEDUPE_WINDOW if options.dedupe else 0,
                )
            )
        knobs = options.knobs.for_loading()
        engines = {
            task: await stack.enter_async_context(ModelBatcher(model, knobs))
            for task, model in models.batch.items()
        }
        yield generator, engines


async def run_batch_job(
    options: GenerateOptions, batch: BatchFiles, progress: Progress | None = None
) -> GenerateSummary | RunSummary:
    """Answer every line of the batch file ``batch.input`` into ``batch.output``.

    >>> opts = GenerateOptions(input=Path("requests.jsonl"), output=Path("results.jsonl"),
    ...     models=("text-embedding-3-small=default", "gpt-4o-mini=smollm2"))
    >>> summary = asyncio.run(run_batch_job(opts, detect_batch(opts)))

    The summary is the generator's when the job has one, else the embedding model's.
    """
    blank_lines = await asyncio.to_thread(check_batch_file, batch.input)  # before any work
    opts = batch.job_options(options)
    specs = await asyncio.to_thread(batch_specs, opts)
    # The models load before the output opens (as in run): a model that fails to load leaves
    # no half-made output behind that would need --resume or --overwrite.
    models = await asyncio.to_thread(load_batch_models, specs, opts.knobs)
    try:
        async with started_batch_models(models, opts, progress) as (generator, engines):
            labels = [f"{s.name}={s.source}" for s in specs]
            done, out_dir = await answer_lines(
                opts, labels, models.names, generator, engines, progress=progress
            )
            # the summary's batches: the embedding model's, else the reranker's, the classifier's
            engine = next((engines[k] for k in _LINES_OF_TASK if k in engines), None)
            stats = engine.stats if engine is not None else None
        summary: GenerateSummary | RunSummary
        if generator is not None:
            summary = generate_summary(out_dir, opts, done, generator)
        else:
            padded = (
                opts.knobs.batching
                and engine is not None
                and engine.model.info.cost_kind == "padded"
            )
            summary = summarize(out_dir, opts.knobs.batching, done, stats, padded=padded)
    finally:
        models.close()
    output = await asyncio.to_thread(batch.write_output)
    return dataclasses.replace(summary, output=output, blank_lines=blank_lines)


async def answer_lines(
    options: GenerateOptions,
    models: Sequence[str],
    names: BatchModels,
    generator: GeneratorAdapter | None,
    engines: Mapping[str, LineEngine],
    *,
    progress: Progress | None = None,
    on_written: Callable[[Sequence[Record], Written], None] | None = None,
    line_blocks: bool = False,
) -> tuple[PipelineRun, Path]:
    """Answer the lines of a batch file (``options``: a :meth:`BatchFiles.job_options`) into
    its chunk folder with started models: ``generator`` for chat and completions lines,
    ``engines`` by task for the others, ``names`` the names lines pick them by, ``models`` how
    the resume settings record them. Resumable: committed chunks are skipped. The pipeline's
    run and the chunk folder; :meth:`BatchFiles.write_output` then writes the output file.

    ``run`` calls it with the models it loaded, ``serve`` (``batchline.server.batches``) with
    the ones it serves, at ``batch`` priority beside live traffic. ``line_blocks``: a
    generator's lines go one a block, each written as it is answered, so that a stop (a batch
    cancelled or expired, which no resume follows) keeps every answer given, where a block of
    16 waits for its slowest line and a stop drops the others' answers with it."""
    source, writer = await asyncio.to_thread(open_batch_parts, options, models)
    with writer:
        block, blocks = (
            pipeline_limits(generator) if generator is not None else (_BLOCK, _MAX_BLOCKS_IN_FLIGHT)
        )
        if generator is not None and line_blocks:
            block, blocks = 1, generator.limit + 1
        done = await run_pipeline(
            LinesAdapter(names, generator, engines),
            source,
            writer,
            block_records=block,
            max_blocks_in_flight=blocks,
            limit=options.limit,
            on_bad_record="skip",
            progress=progress,
            on_written=on_written,
        )
    return done, writer.out_dir
