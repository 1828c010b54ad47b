"""``batchline run``: an offline job over a dataset file, resumable, nothing lost.

The pipeline (``batchline.datasets.pipeline``), all of it overlapping so the model never
waits on I/O::

    reader thread ──blocks──> prepare (worker thread) ──items──> the model's engine
                                                                   │ (bounded queue:
                                                                   │  backpressure)
                                    ChunkWriter thread <───────────┘ results, in chunks

A job that generates text runs :mod:`batchline.jobs.generate` instead (decided once, by
:func:`batchline.jobs.options.resolve`), and an OpenAI batch file
:mod:`batchline.jobs.openai_batch`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable

from batchline._errors import InputError
from batchline.datasets.pipeline import Progress, open_dataset_job, run_pipeline
from batchline.datasets.sinks import ChunkWriter, default_output
from batchline.datasets.sources import Record, Source
from batchline.jobs.batch import DEDUPE_WINDOW, BatchAdapter
from batchline.jobs.images import ImageAdapter
from batchline.jobs.options import GenerateOptions, RunOptions, resolve
from batchline.jobs.precision import Choice, announce, resolve_knobs
from batchline.jobs.result_cache import open_cache
from batchline.jobs.summary import RunSummary, summarize
from batchline.knobs import Knobs
from batchline.models.batching import ModelBatcher
from batchline.models.image import DecodePool, ImagePreprocess
from batchline.models.protocol import BatchModel, ModelInfo

__all__ = [
    "RunOptions",
    "RunSummary",
    "dedupe_window",
    "load_job_model",
    "open_job",
    "record_input",
    "run",
    "run_job",
]

# Records read and submitted at a time, and blocks in flight beyond the engine's own queue.
_BLOCK = 256
_MAX_BLOCKS_IN_FLIGHT = 8


def load_job_model(options: RunOptions, knobs: Knobs) -> tuple[BatchModel[object, object], str]:
    """The job's model, from its spec and options, laid out as ``knobs`` say, in the precision
    they ask for or ``auto`` chooses (int8 asked for: past its quality gate), and that
    precision and why in a line (the summary's ``precision`` row; "" where it does not
    apply)."""
    spec = resolve(options).spec
    assert spec is not None
    knobs, choice = resolve_knobs(spec, knobs)
    return _load_gated(options, knobs, choice)[0], "" if choice is None else choice.describe()


def _load_gated(
    options: RunOptions, knobs: Knobs, choice: Choice | None
) -> tuple[BatchModel[object, object], str]:
    """The job's model in the precision ``knobs`` say (already chosen: ``choice``), and an
    int8 model's figures against its float32 graph in a line ("" for any other): int8 asked
    for passes :mod:`batchline.jobs.quantized`'s gate; int8 chosen passed the stricter one."""
    from batchline.models.loader import load_model

    spec = resolve(options).spec
    assert spec is not None
    model = load_model(spec, knobs)
    announce(spec, choice)
    if knobs.precision != "int8" or (choice is not None and choice.measured):
        return model, ""
    from batchline.jobs.quantized import check_quantized, describe

    try:
        return model, describe(check_quantized(model, spec, knobs), "int8")
    except BaseException:
        model.close()
        raise


def run(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Run the job to the end (sync). See :func:`run_job`."""
    return asyncio.run(run_job(options, progress))


async def run_job(options: RunOptions, progress: Progress | None = None) -> RunSummary:
    """Run the model over every record of ``options.input`` into ``options.output``.

    >>> summary = run(RunOptions(input=Path("docs.jsonl"), output=Path("docs.embeddings")))
    >>> summary.records_per_s

    A generation job (task ``generate``, or a model that generates) runs
    :func:`batchline.jobs.generate.run_generate_job`; an OpenAI batch file
    :func:`batchline.jobs.openai_batch.run_batch_job`.
    """
    options = await asyncio.to_thread(resolve, options)
    if isinstance(options, GenerateOptions):
        from batchline.jobs.openai_batch import detect_batch, run_batch_job

        batch = await asyncio.to_thread(detect_batch, options)
        if batch is not None:
            if options.cache is not None:
                raise InputError(
                    "--cache keeps the results of dataset jobs (embed, classify, score, "
                    "generate); an OpenAI batch file runs without it"
                )
            return await run_batch_job(options, batch, progress)
        from batchline.jobs.generate import run_generate_job

        return await run_generate_job(options, progress)
    assert options.spec is not None  # resolved
    knobs, choice = await asyncio.to_thread(
        resolve_knobs, options.spec, options.knobs.for_loading()
    )
    chosen = dataclasses.replace(options, knobs=options.knobs.replace(precision=knobs.precision))
    cache = await asyncio.to_thread(open_cache, chosen)  # keyed by the precision chosen
    model, quantized = await asyncio.to_thread(_load_gated, options, knobs, choice)
    try:
        source, writer = await asyncio.to_thread(open_job, options, model.info)
        split = ""
        with writer:
            async with ModelBatcher(model, knobs) as engine, _pictures(model, options) as pool:
                adapter: BatchAdapter | ImageAdapter
                if pool is not None:
                    adapter = ImageAdapter(
                        engine,
                        pool,
                        base=options.input.parent if options.input is not None else None,
                        dedupe_window=dedupe_window(options),
                        cache=cache,
                        tune_workers=options.decode.workers is None,
                    )
                else:
                    adapter = BatchAdapter(
                        engine,
                        record_input(options, model.info),
                        dedupe_window=dedupe_window(options),
                        cache=cache,
                    )
                done = await run_pipeline(
                    adapter,
                    source,
                    writer,
                    block_records=_BLOCK,
                    max_blocks_in_flight=_MAX_BLOCKS_IN_FLIGHT,
                    limit=options.limit,
                    on_bad_record=options.on_bad_record,
                    progress=progress,
                )
                stats = engine.stats
                if isinstance(adapter, ImageAdapter):
                    split = adapter.time_split().text()
        padded = knobs.batching and model.info.cost_kind == "padded"
        summary = summarize(writer.out_dir, options.knobs.batching, done, stats, padded=padded)
        cached = 0 if cache is None else cache.hits
        return dataclasses.replace(
            summary,
            duplicates=adapter.duplicates,
            cached=cached,
            quantized=quantized,
            precision="" if choice is None else choice.describe(),
            time_split=split,
        )
    finally:
        model.close()
        if cache is not None:
            cache.close()


@contextlib.asynccontextmanager
async def _pictures(
    model: BatchModel[object, object], options: RunOptions
) -> AsyncIterator[DecodePool | None]:
    """The decode workers of an image model (``info.input_kind == "image"``), else None."""
    if model.info.input_kind != "image":
        yield None
        return
    preprocess = getattr(model, "preprocess", None)
    if not isinstance(preprocess, ImagePreprocess):
        raise InputError(
            f"model {model.info.name!r} reads pictures but has no preprocess (an "
            "ImagePreprocess attribute): the decode workers need it"
        )
    async with DecodePool(preprocess, options.decode) as pool:
        yield pool


def dedupe_window(options: RunOptions) -> int:
    """Distinct inputs the job keeps to answer duplicates from (0: ``--no-dedupe``, or a
    model whose backend says its results may not be a function of their input: a
    ``module:factory`` model's, ``Backend.deterministic``)."""
    from batchline.models.loader import deterministic

    spec = options.spec
    if not options.dedupe or (spec is not None and not deterministic(spec, options.knobs)):
        return 0
    return DEDUPE_WINDOW


def open_job(options: RunOptions, info: ModelInfo) -> tuple[Source, ChunkWriter]:
    """``open_dataset_job`` for ``batchline run`` (local or Ray: either resumes the other).

    The output's result column and kind are the model's; a task other than ``embed`` is part
    of the settings a resume must match (embedding outputs keep their settings unchanged).
    """
    output = options.output or default_output(options.input, info.task)
    extra: dict[str, object] = {} if info.task == "embed" else {"task": info.task}
    columns = tuple(options.input_columns)
    if info.input_kind == "image":
        columns = (options.image_column or "image",)
    elif options.image_column is not None:
        raise InputError(
            f"--image-column goes with an image model; {options.model!r} reads {info.input_kind}"
        )
    elif info.task == "score":
        columns = pair_columns(options)
    elif not columns and (only := _only_input(info)) is not None:
        columns = (only,)
    return open_dataset_job(
        options,
        model=options.model,
        output=output,
        chunk_size=options.chunk_size,
        extra_settings=extra,
        result_column=info.result_column,
        result_kind=info.result_kind,
        result_shapes=_output_shapes(info) if info.result_kind == "tensors" else None,
        input_kind=info.input_kind,
        input_columns=columns,
    )


#: The columns a ``score`` job reads by default: a query and a document per record.
PAIR_COLUMNS = ("query", "document")


def pair_columns(options: RunOptions) -> tuple[str, str]:
    """A ``score`` job's query and document columns: ``--input-column Q --input-column D``,
    else ``query`` and ``document``."""
    columns = tuple(options.input_columns)
    if not columns:
        return PAIR_COLUMNS
    if len(columns) != 2:
        raise InputError(
            f"a score job reads two columns, a query and a document; got --input-column "
            f"{' --input-column '.join(columns)} (default: {' and '.join(PAIR_COLUMNS)})"
        )
    return columns[0], columns[1]


def record_input(options: RunOptions, info: ModelInfo) -> Callable[[Record], object] | None:
    """What the job's model is given of a record: a ``score`` model its pair, others the
    record's input as read (``None``)."""
    if info.task != "score":
        return None
    query, document = pair_columns(options)

    def take(record: Record) -> object:
        row = record.input
        assert isinstance(row, dict)  # a record read whole (input_kind "record")
        return {"query": row.get(query), "document": row.get(document)}

    return take


def _only_input(info: ModelInfo) -> str | None:
    """The name of a tensor model's one input (what a ``.npy`` file's rows feed)."""
    inputs = info.details.get("inputs")
    if isinstance(inputs, list) and len(inputs) == 1 and isinstance(inputs[0], dict):
        name = inputs[0].get("name")
        return name if isinstance(name, str) else None
    return None


def _output_shapes(info: ModelInfo) -> dict[str, list[int] | None]:
    """Each declared output's shape per row (without the batch axis), ``None`` where a
    dimension is dynamic (``-1``): what the writer stores as fixed-size lists."""
    shapes: dict[str, list[int] | None] = {}
    outputs = info.details.get("outputs")
    for output in outputs if isinstance(outputs, list) else []:
        if isinstance(output, dict) and isinstance(output.get("name"), str):
            shape = output.get("shape")
            dims = shape[1:] if isinstance(shape, list) else None
            fixed = dims is not None and all(isinstance(d, int) and d >= 0 for d in dims)
            shapes[output["name"]] = list(dims) if fixed and dims is not None else None
    return shapes
