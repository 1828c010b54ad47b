"""OpenAI batch files in and out: ``batchline run requests.jsonl`` where each line is
``{"custom_id", "method": "POST", "url", "body"}``, ``url`` one of ``/v1/chat/completions``,
``/v1/completions`` and ``/v1/embeddings``, mixed as they come.

The job has one generator and one embedding model at most (``--model NAME=SPEC`` repeated);
each line's ``body.model`` picks one by ``NAME`` (a line naming none takes the job's model of
its kind; a name the job lacks is that line's error, naming the ``--model`` flag to add). One
pipeline reads the file: :class:`LinesAdapter` sends each block's chat and completions lines to
the generator (as any generate job) and its embeddings lines to the embedding model's batcher
(every text of a line's ``input`` its own record there, so texts of many lines share
batches), into one chunked output folder beside the output file (``OUTPUT.parts``), so the job
is resumable like every job. The output file is then written, whole and atomically, from the
committed chunks: one line per input line, in input order, ``{"id", "custom_id", "response":
{"status_code": 200, "request_id", "body"}, "error": null}``, or ``"response": null`` and
``"error": {"code", "message"}`` for a line that failed (malformed JSON, an unknown url, a bad
body, a model the job lacks). A body is what the OpenAI route returns: a ``chat.completion``,
a ``text_completion``, or an embeddings ``list`` (``encoding_format`` float or base64). Its
ids derive from the line, and ``created`` is when the completion was made (kept in the chunk),
so a job killed and resumed writes the same file as one that never stopped but for the
``created`` of the completions the killed run had not committed.

Example::

    batchline run requests.jsonl --model text-embedding-3-small=default \\
        --model gpt-4o-mini=smollm2 --output results.jsonl
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from batchline._cache import write_whole
from batchline._errors import InputError
from batchline.datasets.formats.base import lines as nonblank_lines
from batchline.datasets.outcomes import Failed, Outcome, Result, describe
from batchline.datasets.pipeline import Progress, open_dataset_job, run_pipeline
from batchline.datasets.readers import read_output, read_skipped
from batchline.datasets.sources import Record
from batchline.jobs.batch import collect, prepare_block, queue_block
from batchline.jobs.generate import (
    GeneratorAdapter,
    generate_summary,
    pipeline_limits,
    running_generator,
)
from batchline.jobs.options import GenerateOptions, batch_specs
from batchline.jobs.requests import (
    EMBEDDINGS_URL,
    BatchModels,
    EmbeddingLine,
    RecordRequests,
    batch_line,
    embedding_line,
    is_openai_batch_file,
)
from batchline.jobs.summary import GenerateSummary, RunSummary, summarize
from batchline.models.batching import ModelBatcher

if TYPE_CHECKING:
    from batchline.datasets.sinks import ChunkWriter
    from batchline.datasets.sources import Source
    from batchline.jobs.options import RunOptions
    from batchline.knobs import Knobs
    from batchline.models.generation.load import GenerationModel
    from batchline.models.protocol import BatchModel
    from batchline.models.specs import ModelSpec

__all__ = ["BatchFiles", "LinesAdapter", "detect_batch", "run_batch_job"]

#: Lines read at a time when the job has no generator (the generator sets its own).
_BLOCK = 64
_MAX_BLOCKS_IN_FLIGHT = 8


def _lines(path: Path) -> list[bytes]:
    """The input's non-blank lines, as the JSONL reader numbers records."""
    with path.open("rb") as f:
        return [line for _, line in nonblank_lines(f)]


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
    """An OpenAI batch job's input file, output file, and the chunk folder between them."""

    input: Path
    output: Path
    parts: Path

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

    def write_output(self) -> Path:
        """Write the output file from the committed chunks (replacing it whole)."""
        rows = {int(r["index"]): r for r in read_output(self.parts).to_pylist()}
        skipped = {int(s["index"]): s for s in read_skipped(self.parts)}  # type: ignore[call-overload]
        lines = []
        for index, raw in enumerate(_lines(self.input)):
            if index not in rows and index not in skipped:
                continue  # not run (--limit)
            try:
                request: Any = json.loads(raw)
            except ValueError:
                request = None
            if not isinstance(request, dict):
                request = {}
            out = _output_line(index, request, rows.get(index), skipped.get(index))
            lines.append(json.dumps(out, ensure_ascii=False, separators=(",", ":")))
        write_whole(self.output, "".join(line + "\n" for line in lines).encode("utf-8"))
        umask = os.umask(0o022)  # read, then put back: the mode open() gives every other output
        os.umask(umask)
        self.output.chmod(0o666 & ~umask)  # not the temporary file's 0600
        return self.output


class _Embeddings:
    """An embedding model's started batcher, for embeddings lines: every text of a line's
    ``input`` is queued as its own record, and the line's outcome is all of their vectors
    (or the first failure among them)."""

    def __init__(self, engine: ModelBatcher[Any, Any]) -> None:
        self.engine = engine
        dim = engine.model.info.details.get("dim")
        self.dim = dim if isinstance(dim, int) else None

    async def submit(self, lines: Sequence[EmbeddingLine]) -> asyncio.Future[list[Outcome]]:
        texts = [text for line in lines for text in line.texts]
        prepared = await asyncio.to_thread(prepare_block, self.engine, texts)
        cost = self.engine.model.cost
        tokens = [0 if isinstance(p, BaseException) else cost(p) for p in prepared]
        pending = await queue_block(self.engine, prepared)
        return asyncio.ensure_future(self._outcomes(lines, tokens, pending))

    async def _outcomes(
        self,
        lines: Sequence[EmbeddingLine],
        tokens: Sequence[int],
        pending: Sequence[asyncio.Future[Any] | Failed],
    ) -> list[Outcome]:
        got = await collect(self.engine, pending)
        outcomes: list[Outcome] = []
        at = 0
        for line in lines:
            n = len(line.texts)
            mine, used = got[at : at + n], sum(tokens[at : at + n])
            at += n
            failed = next(((i, g) for i, g in enumerate(mine) if isinstance(g, Failed)), None)
            if failed is not None:
                i, first = failed
                where = f"input text {i}: " if n > 1 else ""
                outcomes.append(Failed(f"{where}{first.message}"))
                continue
            vectors = [np.asarray(v, dtype=np.float32) for v in mine]
            if not all(v.ndim == 1 and np.isfinite(v).all() for v in vectors):
                outcomes.append(
                    Failed("model error: an embedding is not a vector of finite values")
                )
                continue
            # float32 values held exactly as doubles; formatted when the file is written
            columns = {"embeddings": [v.tolist() for v in vectors], "prompt_tokens": used}
            outcomes.append(Result(None, columns))
        return outcomes


_Route = tuple[str, EmbeddingLine | None] | Failed


class LinesAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for the lines of an OpenAI batch file:
    each line goes to the model its ``body.model`` picks (``names``), chat and completions
    lines to ``generator``, embeddings lines to ``embeddings``; a line that cannot go anywhere
    is its :class:`Failed`. Every written row carries the name of the model that answered it
    (a ``model`` column)."""

    def __init__(
        self,
        names: BatchModels,
        generator: GeneratorAdapter | None,
        embeddings: ModelBatcher[Any, Any] | None,
    ) -> None:
        self.names = names
        self.generator = generator
        self.embeddings = _Embeddings(embeddings) if embeddings is not None else None

    def utilization(self) -> float:
        if self.generator is not None:
            return self.generator.utilization()
        return self.embeddings.engine.stats.utilization if self.embeddings is not None else 0.0

    def _route(self, record: Record) -> _Route:
        """The model that answers ``record`` and, for an embeddings line, what it asks."""
        try:
            url, body = batch_line(record.value)
            name = self.names.pick(url, body)
            if url != EMBEDDINGS_URL:
                return name, None
            assert self.embeddings is not None  # pick() named the job's embedding model
            return name, embedding_line(body, self.embeddings.dim)
        except ValueError as exc:
            return Failed(f"bad input: {describe(exc)}")

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        routes = [self._route(r) for r in records]
        chats: list[Record] = []
        lines: list[EmbeddingLine] = []
        for record, route in zip(records, routes, strict=True):
            if not isinstance(route, Failed):
                if route[1] is None:
                    chats.append(record)
                else:
                    lines.append(route[1])
        parts: list[asyncio.Future[Any]] = []
        try:
            if chats:
                assert self.generator is not None  # pick() named the job's generator
                parts.append(asyncio.ensure_future(await self.generator.submit(chats)))
            if lines:
                assert self.embeddings is not None
                parts.append(await self.embeddings.submit(lines))
        except BaseException:
            for part in parts:
                part.cancel()
            raise
        return asyncio.ensure_future(self._merge(routes, parts, bool(chats)))

    async def _merge(
        self, routes: Sequence[_Route], parts: Sequence[asyncio.Future[Any]], chats: bool
    ) -> list[Outcome]:
        try:
            await asyncio.gather(*parts)
        except BaseException:
            for part in parts:
                part.cancel()
            raise
        done = [iter(part.result()) for part in parts]
        generated = done.pop(0) if chats else iter(())
        embedded = done.pop(0) if done else iter(())
        outcomes: list[Outcome] = []
        for route in routes:
            if isinstance(route, Failed):
                outcomes.append(route)
                continue
            name, line = route
            got = next(embedded) if line is not None else next(generated)
            if isinstance(got, Result):
                got = Result(got.value, {**got.columns, "model": name})
            outcomes.append(got)
        return outcomes


@dataclasses.dataclass
class _Models:
    """An OpenAI batch job's loaded models: a generator and an embedding model, at most one
    of each."""

    names: BatchModels
    generator: GenerationModel | None = None
    embedder: BatchModel[Any, Any] | None = None

    def close(self) -> None:
        for model in (self.generator, self.embedder):
            if model is not None:
                model.close()


def _load(specs: Sequence[ModelSpec], knobs: Knobs) -> _Models:
    """Load the job's models (sync: slow). ``InputError`` for two of a kind, or a model that
    neither generates nor embeds."""
    generators = [s for s in specs if s.generates]
    others = [s for s in specs if not s.generates]
    for kind, found in (("generator", generators), ("embedding model", others)):
        if len(found) > 1:
            names = " and ".join(repr(s.name) for s in found)
            raise InputError(
                f"an OpenAI batch job takes one {kind} at most, got {names}; give one "
                "--model for chat and completions lines and one for embeddings lines"
            )
    from batchline.models.loader import load_model

    models = _Models(BatchModels())
    try:
        if others:
            (spec,) = others
            embed_knobs = knobs if knobs.batching else knobs.baseline()
            models.embedder = load_model(spec, embed_knobs)
            task = models.embedder.info.task
            if task != "embed":
                raise InputError(
                    f"model {spec.name!r} does {task}: an OpenAI batch file's models embed "
                    "(/v1/embeddings lines) or generate (chat and completions lines)"
                )
            models.names = dataclasses.replace(models.names, embed=spec.name)
        if generators:
            from batchline.models.generation.load import load_text_generator

            (spec,) = generators
            models.generator = load_text_generator(spec, knobs)
            models.names = dataclasses.replace(models.names, generate=spec.name)
    except BaseException:
        models.close()
        raise
    return models


def _open(options: GenerateOptions, specs: Sequence[ModelSpec]) -> tuple[Source, ChunkWriter]:
    """The batch file's source and the chunk writer of ``OUTPUT.parts``: one row per answered
    line (a completion's ``text``, or an embeddings line's ``embeddings``)."""
    assert options.output is not None
    settings: dict[str, object] = {
        "task": "openai-batch",
        "models": [f"{s.name}={s.source}" for s in specs],
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


async def run_batch_job(
    options: GenerateOptions, batch: BatchFiles, progress: Progress | None = None
) -> GenerateSummary | RunSummary:
    """Answer every line of the batch file ``batch.input`` into ``batch.output``.

    >>> opts = GenerateOptions(input=Path("requests.jsonl"), output=Path("results.jsonl"),
    ...     models=("text-embedding-3-small=default", "gpt-4o-mini=smollm2"))
    >>> summary = asyncio.run(run_batch_job(opts, detect_batch(opts)))

    The summary is the generator's when the job has one, else the embedding model's.
    """
    opts = batch.job_options(options)
    specs = await asyncio.to_thread(batch_specs, opts)
    # The models load before the output opens (as in run): a model that fails to load leaves
    # no half-made output behind that would need --resume or --overwrite.
    models = await asyncio.to_thread(_load, specs, opts.knobs)
    try:
        source, writer = await asyncio.to_thread(_open, opts, specs)
        with writer:
            generator: GeneratorAdapter | None = None
            async with contextlib.AsyncExitStack() as stack:
                if models.generator is not None:
                    requests = RecordRequests("body", True, opts.sampling(), openai_batch=True)
                    generator = await stack.enter_async_context(
                        running_generator(models.generator, requests, progress)
                    )
                engine: ModelBatcher[Any, Any] | None = None
                if models.embedder is not None:
                    knobs = opts.knobs if opts.knobs.batching else opts.knobs.baseline()
                    engine = await stack.enter_async_context(ModelBatcher(models.embedder, knobs))
                block, blocks = (
                    pipeline_limits(generator)
                    if generator is not None
                    else (_BLOCK, _MAX_BLOCKS_IN_FLIGHT)
                )
                done = await run_pipeline(
                    LinesAdapter(models.names, generator, engine),
                    source,
                    writer,
                    block_records=block,
                    max_blocks_in_flight=blocks,
                    limit=opts.limit,
                    on_bad_record="skip",
                    progress=progress,
                )
                stats = engine.stats if engine is not None else None
        summary: GenerateSummary | RunSummary
        if generator is not None:
            summary = generate_summary(writer.out_dir, opts, done, generator)
        else:
            padded = (
                opts.knobs.batching
                and models.embedder is not None
                and (models.embedder.info.cost_kind == "padded")
            )
            summary = summarize(writer.out_dir, opts.knobs.batching, done, stats, padded=padded)
    finally:
        models.close()
    output = await asyncio.to_thread(batch.write_output)
    return dataclasses.replace(summary, output=output)


def _output_line(
    index: int,
    request: dict[str, Any],
    row: dict[str, Any] | None,
    skipped: dict[str, object] | None,
) -> dict[str, Any]:
    custom_id = request.get("custom_id")
    digest = hashlib.sha256(f"{index}\0{custom_id}".encode()).hexdigest()[:24]
    line: dict[str, Any] = {"id": f"batch_req_{digest}", "custom_id": custom_id}
    if row is None:
        reason = str(skipped["reason"]) if skipped is not None else "not run"
        line["response"] = None
        line["error"] = {"code": "invalid_request", "message": reason}
        return line
    body = request.get("body") or {}
    url = request.get("url")
    if url == EMBEDDINGS_URL:
        response = _embeddings_body(row, as_base64=body.get("encoding_format") == "base64")
    else:
        response = _completion_body(row, digest, chat=url == "/v1/chat/completions")
    line["response"] = {"status_code": 200, "request_id": f"req_{digest}", "body": response}
    line["error"] = None
    return line


def _completion_body(row: dict[str, Any], digest: str, *, chat: bool) -> dict[str, Any]:
    """OpenAI's ChatCompletion (``chat``) or Completion of a generated row."""
    usage = {
        "prompt_tokens": row["prompt_tokens"],
        "completion_tokens": row["completion_tokens"],
        "total_tokens": row["prompt_tokens"] + row["completion_tokens"],
    }
    common = {"created": row["created"], "model": row["model"], "usage": usage}
    choice: dict[str, Any] = {"index": 0, "finish_reason": row["finish_reason"], "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": row["text"]}
        response = {"id": f"chatcmpl-{digest}", "object": "chat.completion", **common}
    else:
        choice["text"] = row["text"]
        response = {"id": f"cmpl-{digest}", "object": "text_completion", **common}
    response["choices"] = [choice]
    return response


def _embeddings_body(row: dict[str, Any], *, as_base64: bool) -> dict[str, Any]:
    """OpenAI's CreateEmbeddingResponse of an embedded row: float32 values as the shortest
    decimals that read back to them, or base64 of their little-endian bytes."""
    data = []
    for i, values in enumerate(row["embeddings"]):
        vector = np.asarray(values, dtype=np.float32)
        encoded: object = (
            _base64(vector) if as_base64 else [float(f"{x:.9g}") for x in vector.tolist()]
        )
        data.append({"object": "embedding", "index": i, "embedding": encoded})
    tokens = row["prompt_tokens"]
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    return {"object": "list", "data": data, "model": row["model"], "usage": usage}


def _base64(vector: np.ndarray[Any, Any]) -> str:
    return base64.b64encode(vector.astype("<f4", copy=False).tobytes()).decode("ascii")
