"""The ``openai-batch`` job kind: an OpenAI batch file, each line to the model its
``body.model`` picks (:mod:`batchline.jobs.openai_batch` runs it), locally and on Ray replicas.

Asked before every other built-in kind: a file is one when ``--format openai-batch`` says so
or its first line is a batch request (:func:`~batchline.jobs.openai_batch.detect_batch`, whose
:class:`~batchline.jobs.openai_batch.BatchFiles` the job keeps as its claim).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import InputError
from batchline.jobs.dataset import dedupe_window
from batchline.jobs.generate import GeneratorAdapter, in_flight_limit
from batchline.jobs.generate_job import generator_figures
from batchline.jobs.job import Job, JobKind, RayPlan, WorkFigures
from batchline.jobs.openai_batch import (
    BatchFiles,
    BatchJobModels,
    LinesAdapter,
    check_batch_file,
    detect_batch,
    load_batch_models,
    open_batch_parts,
    run_batch_job,
    started_batch_models,
)
from batchline.jobs.options import GenerateOptions, batch_specs
from batchline.models.protocol import ModelInfo

if TYPE_CHECKING:
    from batchline.datasets.pipeline import Adapter, Progress
    from batchline.jobs.summary import RunSummary
    from batchline.knobs import Knobs
    from batchline.models.batching import ModelBatcher
    from batchline.models.specs import ModelSpec

__all__ = ["KIND", "LinesWork"]


def _parts(job: Job) -> tuple[GenerateOptions, BatchFiles]:
    """The job's options and its batch files (its kind's claim)."""
    assert isinstance(job.options, GenerateOptions)
    assert isinstance(job.claim, BatchFiles)
    return job.options, job.claim


class LinesWork:
    """An OpenAI batch job on a Ray replica (:class:`~batchline.jobs.job.ReplicaWork`): the
    file's models, each line to the one its ``body.model`` picks (:class:`LinesAdapter`)."""

    precision = ""

    def __init__(
        self, options: GenerateOptions, specs: tuple[ModelSpec, ...], knobs: Knobs
    ) -> None:
        self._options = options
        self.models: BatchJobModels = load_batch_models(specs, knobs)
        self.info = ModelInfo(name=options.model, task="generate")
        generator = self.models.generator
        self.max_running = 0 if generator is None else generator.max_running
        self.in_flight = 0 if generator is None else in_flight_limit(generator)
        self._gen: GeneratorAdapter | None = None
        self._engines: dict[str, ModelBatcher[object, object]] = {}

    async def start(self, stack: contextlib.AsyncExitStack) -> Adapter:
        self._gen, engines = await stack.enter_async_context(
            started_batch_models(self.models, self._options, None)
        )
        self._engines = dict(engines)
        return LinesAdapter(self.models.names, self._gen, engines)

    def figures(self) -> WorkFigures:
        engine = self._engines.get("embed", self._engines.get("score"))
        stats = engine.stats if engine is not None else None
        if self._gen is None:
            return WorkFigures(stats=stats)
        return generator_figures(self._gen, stats)

    def close(self) -> None:
        self.models.close()


async def _run_local(job: Job, progress: Progress | None) -> RunSummary:
    options, batch = _parts(job)
    if options.cache is not None:
        raise InputError(
            "--cache keeps the results of dataset jobs (embed, classify, score, "
            "generate); an OpenAI batch file runs without it"
        )
    return await run_batch_job(options, batch, progress)


def _plan_ray(job: Job) -> RayPlan:
    """Each replica holds the file's models; the driver compares lines by the whole line but
    its ``custom_id``, a chat or completions line only when its completion does not depend on
    chance (greedy, or a fixed seed: the rule a local run's generator dedupes by); the output
    file is written from the chunks at the end."""
    from batchline.jobs.requests import line_key

    options, batch = _parts(job)
    blank_lines = check_batch_file(batch.input)  # before any work
    opts = batch.job_options(options)
    specs = tuple(batch_specs(opts))
    labels = [f"{s.name}={s.source}" for s in specs]
    base = opts.sampling()

    def finish(summary: RunSummary) -> RunSummary:
        output = batch.write_output()
        return dataclasses.replace(summary, output=output, blank_lines=blank_lines)

    return RayPlan(
        work=functools.partial(LinesWork, opts, specs),
        open=lambda _: open_batch_parts(opts, labels),
        on_bad_record="skip",
        generates=any(s.generates for s in specs),
        dedupe_window=dedupe_window(opts),  # resolved: a module:factory model has none
        key_of=lambda record: line_key(record.value, base),
        finish=finish,
    )


def _out_dir(job: Job) -> Path:
    return Path(_parts(job)[1].parts)


#: An OpenAI batch file.
KIND = JobKind(
    "openai-batch", claims=detect_batch, run_local=_run_local, plan_ray=_plan_ray, out_dir=_out_dir
)
