"""The ``dataset`` job kind: a batch model over a dataset (embed, classify, predict, score),
resumable, nothing lost; and what every batch model's job shares (the ``images`` kind's too).

The pipeline (``batchline.datasets.pipeline``), all of it overlapping so the model never
waits on I/O::

    reader thread ──blocks──> prepare (worker thread) ──items──> the model's engine
                                                                   │ (bounded queue:
                                                                   │  backpressure)
                                    ChunkWriter thread <───────────┘ results, in chunks

:func:`run_model_job` runs a batch model's job with the adapter its kind gives
(:class:`~batchline.jobs.batch.BatchAdapter` here, the image kind's decode workers in
:mod:`batchline.jobs.images`); :class:`ModelWork` is the same job on a Ray replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Protocol

from batchline._errors import InputError
from batchline.datasets.columns import prime_conversion
from batchline.datasets.pipeline import Adapter, Progress, open_dataset_job, run_pipeline
from batchline.datasets.sinks import ChunkWriter, default_output
from batchline.datasets.sources import Record, Source
from batchline.jobs.batch import DEDUPE_WINDOW, BatchAdapter
from batchline.jobs.job import Job, JobKind, RayPlan, WorkFigures
from batchline.jobs.options import IMAGE_COLUMN, RunOptions, resolve
from batchline.jobs.precision import Choice, announce, resolve_knobs
from batchline.jobs.result_cache import ResultCache, open_cache
from batchline.jobs.summary import RunSummary, summarize
from batchline.models.batching import ModelBatcher
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel, ModelInfo

__all__ = [
    "KIND",
    "AdapterFactory",
    "ModelAdapter",
    "ModelWork",
    "OpenJob",
    "dedupe_window",
    "load_job_model",
    "model_out_dir",
    "open_job",
    "plan_model_job",
    "record_input",
    "run_model_job",
]

# Records read and submitted at a time, and records in flight beyond the engine's own queue
# (in blocks). A block's outcomes are written when all of them are in, and a stop keeps what
# is written: a job whose records take long (pictures) reads smaller blocks, so that a stop
# loses little of what its model did.
_BLOCK = 256
_RECORDS_IN_FLIGHT = 8 * _BLOCK

_Engine = ModelBatcher[object, object]


class ModelAdapter(Adapter, Protocol):
    """A batch model's adapter: its engine, the duplicates it answered, and where the job's
    time went ("" where it does not say)."""

    engine: _Engine

    @property
    def duplicates(self) -> int: ...

    def split_text(self) -> str: ...


#: What a batch model's kind feeds the started engine through: (job, model, engine, cache)
#: to the adapter, entered around the pipeline (it may start workers of its own).
AdapterFactory = Callable[
    [Job, BatchModel[object, object], _Engine, ResultCache | None],
    AbstractAsyncContextManager[ModelAdapter],
]
#: How a batch model's kind opens the job's input and output, given the loaded model's info.
OpenJob = Callable[[Job, ModelInfo], tuple[Source, ChunkWriter]]


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


async def run_model_job(
    job: Job,
    progress: Progress | None,
    *,
    opener: OpenJob,
    adapter: AdapterFactory,
    block_records: int | None = None,
) -> RunSummary:
    """A batch model's job: the model loaded in the precision its knobs choose, the output
    opened by the kind (``opener``), the model's engine fed through the kind's ``adapter``,
    ``block_records`` records at a time (the most a stop can leave undone per block in
    flight; ``_BLOCK`` unless the kind says)."""
    block = block_records if block_records is not None else _BLOCK
    options = job.options
    assert options.spec is not None  # resolved
    # pyarrow's first conversion imports pandas (~0.4 s, holding the GIL): paid while the
    # model loads, not while its first batches run
    prime_conversion()
    knobs, choice = await asyncio.to_thread(
        resolve_knobs, options.spec, options.knobs.for_loading()
    )
    chosen = dataclasses.replace(options, knobs=options.knobs.replace(precision=knobs.precision))
    cache = await asyncio.to_thread(open_cache, chosen)  # keyed by the precision chosen
    model, quantized = await asyncio.to_thread(_load_gated, options, knobs, choice)
    try:
        source, writer = await asyncio.to_thread(opener, job, model.info)
        with writer:
            async with (
                ModelBatcher(model, knobs) as engine,
                adapter(job, model, engine, cache) as fed,
            ):
                done = await run_pipeline(
                    fed,
                    source,
                    writer,
                    block_records=block,
                    max_blocks_in_flight=max(1, _RECORDS_IN_FLIGHT // block),
                    limit=options.limit,
                    on_bad_record=options.on_bad_record,
                    progress=progress,
                )
                stats = engine.stats
                split = fed.split_text()
        padded = knobs.batching and model.info.cost_kind == "padded"
        summary = summarize(writer.out_dir, options.knobs.batching, done, stats, padded=padded)
        cached = 0 if cache is None else cache.hits
        return dataclasses.replace(
            summary,
            duplicates=fed.duplicates,
            cached=cached,
            quantized=quantized,
            precision="" if choice is None else choice.describe(),
            time_split=split,
        )
    finally:
        model.close()
        if cache is not None:
            cache.close()


class ModelWork:
    """A batch model's job on a Ray replica (:class:`~batchline.jobs.job.ReplicaWork`): the
    model loaded when made, its engine and the kind's adapter started on the first unit
    (duplicates inside the replica's window computed once)."""

    def __init__(self, job: Job, adapter: AdapterFactory, knobs: Knobs) -> None:
        self._job, self._adapter, self._knobs = job, adapter, knobs
        self.model, self.precision = load_job_model(job.options, knobs.for_loading())
        self.info = self.model.info
        self.max_running = self.in_flight = 0
        self._fed: ModelAdapter | None = None

    async def start(self, stack: contextlib.AsyncExitStack) -> Adapter:
        engine = await stack.enter_async_context(
            ModelBatcher(self.model, self._knobs.for_loading())
        )
        self._fed = await stack.enter_async_context(
            self._adapter(self._job, self.model, engine, None)
        )
        return self._fed

    def figures(self) -> WorkFigures:
        fed = self._fed
        if fed is None:
            return WorkFigures()
        return WorkFigures(stats=fed.engine.stats, duplicates=fed.duplicates)

    def close(self) -> None:
        self.model.close()


def plan_model_job(
    job: Job,
    *,
    opener: OpenJob,
    adapter: AdapterFactory,
    key_of: Callable[[Record], bytes | None] | None = None,
) -> RayPlan:
    """How a batch model's job runs on Ray: each replica a :class:`ModelWork`; the driver
    finds duplicates once per job (by ``key_of``, else the record's input)."""
    return RayPlan(
        work=functools.partial(ModelWork, job, adapter),
        open=functools.partial(opener, job),
        on_bad_record=job.options.on_bad_record,
        dedupe_window=dedupe_window(job.options),  # resolved: a module:factory model has none
        key_of=key_of,
    )


def model_out_dir(job: Job) -> Path | None:
    """The folder a batch model's job commits its chunks to."""
    from batchline.models.loader import resolve_task

    options = job.options
    if options.output is not None:
        return Path(options.output)
    assert options.spec is not None  # resolved
    return default_output(options.input, resolve_task(options.spec))


# -- the dataset kind ------------------------------------------------------------------------


def _open(job: Job, info: ModelInfo) -> tuple[Source, ChunkWriter]:
    """:func:`open_job`, after refusing a model that reads pictures: a ``module:factory``
    model, which its spec cannot tell, given a dataset that does not hold them."""
    if info.input_kind == "image":
        raise InputError(
            f"model {info.name!r} reads pictures: give a folder of pictures, .tar shards, or a "
            "file with --image-column COLUMN"
        )
    return open_job(job.options, info)


@contextlib.asynccontextmanager
async def _batch_adapter(
    job: Job,
    model: BatchModel[object, object],
    engine: _Engine,
    cache: ResultCache | None,
) -> AsyncIterator[ModelAdapter]:
    """The model given each record's input (a ``score`` model its pair)."""
    yield BatchAdapter(
        engine,
        record_input(job.options, model.info),
        dedupe_window=dedupe_window(job.options),
        cache=cache,
    )


async def _run_local(job: Job, progress: Progress | None) -> RunSummary:
    return await run_model_job(job, progress, opener=_open, adapter=_batch_adapter)


def _plan_ray(job: Job) -> RayPlan:
    return plan_model_job(job, opener=_open, adapter=_batch_adapter)


#: Any dataset a batch model reads (claims every job the other kinds leave).
KIND = JobKind(
    "dataset",
    claims=lambda options: True,
    run_local=_run_local,
    plan_ray=_plan_ray,
    out_dir=model_out_dir,
)


def dedupe_window(options: RunOptions) -> int:
    """Distinct inputs the job keeps to answer duplicates from (0: ``--no-dedupe``, or a
    model whose backend says its results may not be a function of their input: a
    ``module:factory`` model's, ``Backend.deterministic``)."""
    from batchline.models.loader import deterministic

    spec = options.spec
    if not options.dedupe or (spec is not None and not deterministic(spec, options.knobs)):
        return 0
    return DEDUPE_WINDOW


#: The model options a resume must give as the run it resumes did (they change the results).
_RESULT_OPTIONS = (
    "tokenizer", "labels", "pooling", "normalize", "top_k", "image_size", "mean", "std"
)  # fmt: skip


def _decode_settings(options: RunOptions) -> dict[str, object]:
    """The decode flags a resume must give as the run it resumes did, where not the default:
    ``--no-draft`` changes the pixels (a resume had mixed two decodes in one output), and
    ``--max-image-pixels`` which pictures are refused."""
    from batchline.models.image import DEFAULT_MAX_PIXELS

    settings: dict[str, object] = {}
    if not options.decode.draft:
        settings["draft"] = False
    if options.decode.max_pixels != DEFAULT_MAX_PIXELS:
        settings["max_image_pixels"] = options.decode.max_pixels
    return settings


def open_job(options: RunOptions, info: ModelInfo) -> tuple[Source, ChunkWriter]:
    """``open_dataset_job`` for ``batchline run`` (local or Ray: either resumes the other).

    The output's result column and kind are the model's; a task other than ``embed`` is part
    of the settings a resume must match (embedding outputs keep their settings unchanged), and
    so is each model option given (``_RESULT_OPTIONS``: ``--pooling``, ``--no-normalize``,
    ``--top-k``, ``--image-size``...: a resume had mixed vectors of two kinds in one output);
    one left at the model's default is not written, so outputs begun before stay resumable.
    """
    output = options.output or default_output(options.input, info.task)
    extra: dict[str, object] = {} if info.task == "embed" else {"task": info.task}
    for name in _RESULT_OPTIONS:
        value = getattr(options, name)
        if value is not None:
            extra[name] = list(value) if isinstance(value, tuple) else value
            if isinstance(value, Path):
                extra[name] = str(value)
    if info.input_kind == "image":
        extra.update(_decode_settings(options))
    columns = tuple(options.input_columns)
    if info.input_kind == "image":
        columns = (options.image_column or IMAGE_COLUMN,)
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
