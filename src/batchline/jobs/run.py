"""``batchline run``: an offline job over a dataset file, resumable, nothing lost.

:func:`run_job` resolves the job once (:func:`batchline.jobs.kinds.resolve_job`: its options
and its kind) and runs it as its kind says: a batch model over a dataset
(:mod:`batchline.jobs.dataset`) or over pictures (:mod:`batchline.jobs.images`), text
generation (:mod:`batchline.jobs.generate_job`), an OpenAI batch file
(:mod:`batchline.jobs.openai_batch_job`), or a kind registered with
:func:`batchline.jobs.kinds.register`.
"""

from __future__ import annotations

import asyncio

from batchline.datasets.output_dir import refuse_if_busy
from batchline.datasets.pipeline import Progress
from batchline.jobs.dataset import dedupe_window, load_job_model, open_job, record_input
from batchline.jobs.job import Job
from batchline.jobs.kinds import kind_of, resolve_job
from batchline.jobs.options import RunOptions
from batchline.jobs.stopping import run_stoppable
from batchline.jobs.summary import RunSummary

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


def run(options: RunOptions | Job, progress: Progress | None = None) -> RunSummary:
    """Run the job to the end (sync). See :func:`run_job`."""
    return run_stoppable(run_job(options, progress))


async def run_job(options: RunOptions | Job, progress: Progress | None = None) -> RunSummary:
    """Run the job ``options`` describe: its records of ``options.input`` into
    ``options.output``, by its kind's ``run_local``.

    >>> summary = run(RunOptions(input=Path("docs.jsonl"), output=Path("docs.embeddings")))
    >>> summary.records_per_s
    """
    job = await asyncio.to_thread(resolve_job, options)
    kind = kind_of(job)
    out = None if kind.out_dir is None else kind.out_dir(job)
    if out is not None:  # a folder another job writes: refused before the model loads
        refuse_if_busy(out)
    return await kind.run_local(job, progress)
