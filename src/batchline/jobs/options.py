"""What a ``batchline run`` job is: its options, its one model spec, and whether it generates.

:func:`resolve` is the one place that decides batch against generation: it parses the model
spec once, keeps it on the options, and turns the options of a generation job into
:class:`GenerateOptions`. The CLI and :func:`batchline.jobs.run.run_job` both go through it;
resolving resolved options does nothing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._errors import InputError
from batchline.datasets.selection import DatasetSelection
from batchline.jobs.requests import job_constraint
from batchline.models.config import Knobs
from batchline.models.generation import MAX_LOGPROBS, SamplingParams
from batchline.models.image import DecodeOptions, ImageOptions
from batchline.models.openai.requests import MAX_N
from batchline.models.selection import ModelSelection

if TYPE_CHECKING:
    from batchline.models.specs import ModelSpec

__all__ = [
    "IMAGE_COLUMN",
    "GenerateOptions",
    "RunOptions",
    "SeveralModelsError",
    "batch_specs",
    "resolve",
]

#: The column of a CSV, JSONL or Parquet file an image model reads pictures from when
#: ``--image-column`` names none.
IMAGE_COLUMN = "image"
JSONL_SUFFIXES = (".jsonl", ".ndjson")


class SeveralModelsError(InputError):
    """Raised by :func:`resolve` when a job is given several models and its input is not an
    OpenAI batch file (the one job that picks a model per line)."""


@dataclass
class RunOptions(DatasetSelection, ModelSelection):
    """What to run: a model (:class:`ModelSelection`) over a dataset (:class:`DatasetSelection`).
    ``input=None`` runs on the built-in demo corpus."""

    #: columns (or the ``.npy`` input's name) holding a ``predict`` model's tensors
    input_columns: Sequence[str] = ()
    chunk_size: int = 10_000
    knobs: Knobs = field(default_factory=Knobs)
    #: compute a record whose input repeats a recent one's only once (not for a user's Python
    #: model, which may not be a function of its input): ``batchline.jobs.batch.Seen``
    dedupe: bool = True
    #: keep results across runs in this folder (``batchline.jobs.result_cache``), and take
    #: those an earlier run computed; at most ``cache_bytes`` of them
    cache: Path | None = None
    cache_bytes: int = 1 << 30
    #: the parsed model spec, set by :func:`resolve` (parsed once per job)
    spec: ModelSpec | None = field(default=None, repr=False, compare=False)
    #: the column of a CSV, JSONL or Parquet file holding pictures (paths or bytes)
    image_column: str | None = None
    #: a plain ONNX image model's preprocessing (``--image-size``, ``--mean``, ``--std``)
    image_size: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    #: how pictures are decoded (worker processes, draft, pixel limit, bytes in flight)
    decode: DecodeOptions = field(default_factory=DecodeOptions)

    def reads_pictures(self) -> bool:
        """Whether the job's records are pictures: a folder or shards, or ``--image-column``."""
        from batchline.datasets.sources import holds_pictures

        if self.image_column is not None:
            return True
        return self.input is not None and holds_pictures(self.input, self.input_format)

    def spec_options(self) -> dict[str, Any]:
        """:meth:`ModelSelection.spec_options`, plus how a plain ONNX model reads pictures
        when the job reads pictures or the image flags are given."""
        options = super().spec_options()
        flags = (self.image_size, self.mean, self.std)
        if any(x is not None for x in flags) or self.reads_pictures():
            options["image"] = ImageOptions(*flags)
        return options


@dataclass
class GenerateOptions(RunOptions):
    """:class:`RunOptions` plus how to sample (see ``SamplingParams``) and read prompts.

    ``seed`` with ``temperature > 0`` makes sampling repeatable: record ``i`` draws from
    ``seed + i``, whatever shares its batch (so a resumed job samples what the killed one
    would have).

    ``response_format`` constrains every completion (structured outputs; a record's own
    fields win): see :mod:`batchline.jobs.requests`. ``openai_batch``: the input is an OpenAI
    batch file (``--format openai-batch``; else detected from it, see
    :mod:`batchline.jobs.openai_batch`); ``models``: such a job's several model specs
    (``NAME=SPEC``, ``--model`` repeated; ``model`` is then the first), each line's
    ``body.model`` picking one.
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
    openai_batch: bool = False
    models: tuple[str, ...] = ()
    #: submit the prompts of each window of ``jobs.generate.PREFIX_ORDER_WINDOW`` records
    #: grouped by shared prefix (outputs stay in input order)
    prefix_ordering: bool = True
    #: completions per prompt: with more than one, a row lists them all in ``texts`` (and
    #: ``finish_reasons``), its ``text`` the first; sample ``j`` of record ``i`` draws from
    #: ``seed + i * n + j``
    n: int = 1
    #: log-probabilities of each completion's tokens, with this many top alternatives each
    #: (0-20), in a ``logprobs`` column as OpenAI's completions give them; None: none
    logprobs: int | None = None

    def sampling(self) -> SamplingParams:
        """The job's sampling parameters (``seed`` is per record: see the class docstring)."""
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise InputError(f"--n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InputError(
                f"--logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs}"
            )
        try:
            return SamplingParams(
                logprobs=self.logprobs,
                max_tokens=self.max_tokens,
                temperature=self.temperature,
                top_p=self.top_p,
                seed=self.seed,
                stop=tuple(self.stop),
                constraint=job_constraint(self.response_format),
            )
        except ValueError as exc:
            raise InputError(f"sampling settings: {exc}") from None


def resolve(options: RunOptions) -> RunOptions:
    """``options`` with their model spec parsed (once), as :class:`GenerateOptions` when the
    job generates text: task ``generate``, a model that generates (``smollm2``, a Hugging
    Face causal-LM folder), or an OpenAI batch file. The default model embeds; a generation
    job's default is smollm2. An OpenAI batch job's spec is its generator's (else its first
    model's): :func:`batch_specs` parses them all."""
    if options.spec is not None:
        return options
    from batchline.datasets.sources import check_exists
    from batchline.jobs.requests import is_openai_batch_file

    if options.input is not None:
        check_exists(options.input)  # first: a missing input holds neither texts nor pictures

    given = options if isinstance(options, GenerateOptions) else None
    models = given.models if given is not None else ()
    forced = given is not None and given.openai_batch
    batch = is_openai_batch_file(options.input, options.input_format, forced=forced)
    generating = given is not None or options.task == "generate" or batch
    if generating and options.model == "default" and not models:
        options = dataclasses.replace(options, model="smollm2")
    if models and not batch:
        raise SeveralModelsError(
            "several models go with an OpenAI batch file only (each line's body.model picks "
            f"one); {options.input or 'the demo input'} is not one: run one model at a time"
        )
    if batch:
        specs = batch_specs(options)
        spec = next((s for s in specs if s.generates), specs[0])
    else:
        task = "generate" if generating and options.task is None else options.task
        spec = options.parse_spec(task)
        if (pictures := _picture_column(spec, options)) is not options:
            options, spec = pictures, pictures.parse_spec(task)
        spec = _tower(spec, options)
    if isinstance(options, GenerateOptions) or not (generating or spec.generates):
        return dataclasses.replace(options, spec=spec)
    values = {f.name: getattr(options, f.name) for f in dataclasses.fields(RunOptions)}
    return GenerateOptions(**{**values, "spec": spec})


def _picture_column(spec: ModelSpec, options: RunOptions) -> RunOptions:
    """``options`` reading pictures from the :data:`IMAGE_COLUMN` of a CSV, JSONL or Parquet
    file when an image model reads it and ``--image-column`` names no column: an image folder
    or a plain ``.onnx`` given ``--image-size``, ``--mean`` or ``--std``; a two-tower folder
    embedding (CLIP, SigLIP: texts too) only when the file has that column. ``InputError``,
    naming the flag and the file's columns, when a model that reads pictures only finds none."""
    if options.image_column is not None or options.input is None or spec.generates:
        return options
    kind = spec.folder.image if spec.folder is not None else None
    if kind is None and not (spec.kind == "onnx" and spec.image is not None):
        return options
    if options.reads_pictures():  # a folder or shards
        return options
    from batchline.datasets.sources import table_columns

    columns = table_columns(options.input, options.input_format)
    if columns is None:
        return options
    if IMAGE_COLUMN not in columns:
        if kind == "two-tower" and spec.task != "classify":
            return options  # its text tower embeds the texts
        jsonl = options.input_format == "jsonl" or options.input.suffix.lower() in JSONL_SUFFIXES
        where = "the first record has" if jsonl else "its columns are"
        names = ", ".join(repr(c) for c in columns) or "none"
        raise InputError(
            f"{options.input}: no picture column {IMAGE_COLUMN!r} (an image model's default); "
            f"{where}: {names} (choose it with --image-column)"
        )
    return dataclasses.replace(options, image_column=IMAGE_COLUMN)


def _tower(spec: ModelSpec, options: RunOptions) -> ModelSpec:
    """An image folder's spec loaded for what the dataset holds: a two-tower folder (CLIP,
    SigLIP) takes pictures through its image tower and texts through its text tower; an
    image-only model given texts is refused here, once, before anything loads."""
    image = spec.folder.image if spec.folder is not None else None
    if image is None or spec.generates:
        return spec
    if options.reads_pictures():
        return spec.with_options(input_kind="image")
    where = options.input if options.input is not None else "the demo input"
    if image != "two-tower":
        raise InputError(
            f"{where} holds texts, but model {spec.name!r} reads pictures: give a folder of "
            "pictures, .tar shards, or a file with --image-column"
        )
    if spec.task == "classify":
        raise InputError(
            f"{where} holds texts, but zero-shot classification with {spec.name!r} reads "
            "pictures; embed texts with its text tower by leaving out --labels"
        )
    return spec.with_options(input_kind="text")


def batch_specs(options: RunOptions) -> list[ModelSpec]:
    """An OpenAI batch job's model specs (``models``, else ``model``), each with its own task
    (``--task NAME=TASK`` with several)."""
    from batchline.models.specs import parse_specs

    return parse_specs(
        list((isinstance(options, GenerateOptions) and options.models) or (options.model,)),
        tasks=[options.task] if options.task else [],
        **options.spec_options(),
    )
