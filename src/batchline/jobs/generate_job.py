"""The ``generate`` job kind: text generation over a dataset of prompts
(:mod:`batchline.jobs.generate` runs it), locally and on Ray replicas.

A job generates when its resolved options are :class:`~batchline.jobs.options.GenerateOptions`
(task ``generate``, or a model that generates: decided once, by
:func:`batchline.jobs.options.resolve`), and its input is not an OpenAI batch file (that kind
is asked first).
"""

from __future__ import annotations

import contextlib
import functools
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.datasets.sinks import default_output
from batchline.jobs.batch import DEDUPE_WINDOW
from batchline.jobs.generate import (
    GeneratorAdapter,
    in_flight_limit,
    open_generate_job,
    plan_generate,
    run_generate_job,
    running_generator,
)
from batchline.jobs.job import Job, JobKind, RayPlan, WorkFigures
from batchline.jobs.options import GenerateOptions, RunOptions
from batchline.models.protocol import ModelInfo

if TYPE_CHECKING:
    from batchline._stats import BatchStats
    from batchline.datasets.pipeline import Adapter, Progress
    from batchline.jobs.requests import RecordRequests
    from batchline.jobs.summary import RunSummary
    from batchline.models.config import Knobs

__all__ = ["KIND", "GenerateWork", "generator_figures"]


def generator_figures(
    gen: GeneratorAdapter, stats: BatchStats | None = None, duplicates: int = 0
) -> WorkFigures:
    """A started generator's figures for the Ray driver (sampled now), beside a batch model's
    batcher ``stats`` and ``duplicates`` where the job has one too."""
    gen.sample()
    return WorkFigures(
        stats=stats,
        duplicates=duplicates + gen.duplicates,
        generation=gen.gen.stats,
        max_running=gen.model.max_running,
        in_flight=gen.limit,
        batching=gen.model.batching,
        dtype=gen.model.dtype,
        weights=gen.model.weights,
        running_peak=gen.peaks.running,
        waiting_peak=gen.peaks.waiting,
        kv_reserved_peak=gen.peaks.kv_reserved,
        tokens=gen.tokens,
    )


class GenerateWork:
    """A generation job on a Ray replica (:class:`~batchline.jobs.job.ReplicaWork`): the model's
    text generator, continuous batching (or vLLM), each record its own request."""

    precision = ""

    def __init__(self, options: GenerateOptions, requests: RecordRequests, knobs: Knobs) -> None:
        from batchline.models.generation import load_text_generator

        assert options.spec is not None
        self._options, self._requests = options, requests
        self.model = load_text_generator(options.spec, knobs)
        self.info = ModelInfo(name=options.model, task="generate")
        self.max_running = self.model.max_running
        self.in_flight = in_flight_limit(self.model)
        self._gen: GeneratorAdapter | None = None

    async def start(self, stack: contextlib.AsyncExitStack) -> Adapter:
        self._gen = await stack.enter_async_context(
            running_generator(
                self.model,
                self._requests,
                None,
                dedupe_window=DEDUPE_WINDOW if self._options.dedupe else 0,
            )
        )
        return self._gen

    def figures(self) -> WorkFigures:
        return WorkFigures() if self._gen is None else generator_figures(self._gen)

    def close(self) -> None:
        self.model.close()


def _generates(options: RunOptions) -> bool:
    return isinstance(options, GenerateOptions)


async def _run_local(job: Job, progress: Progress | None) -> RunSummary:
    return await run_generate_job(job.options, progress)


def _plan_ray(job: Job) -> RayPlan:
    """Each replica a generator; the driver does not compare records (a prompt's key is its
    token ids, which only a replica's tokenizer gives: each replica dedupes its own units)."""
    opts, requests = plan_generate(job.options)
    return RayPlan(
        work=functools.partial(GenerateWork, opts, requests),
        open=lambda _: open_generate_job(opts, requests),
        on_bad_record=opts.on_bad_record,
        generates=True,
    )


def _out_dir(job: Job) -> Path:
    options = job.options
    return (
        Path(options.output)
        if options.output is not None
        else default_output(options.input, "generate")
    )


#: Text generation over a dataset of prompts.
KIND = JobKind(
    "generate", claims=_generates, run_local=_run_local, plan_ray=_plan_ray, out_dir=_out_dir
)
