"""A ``batchline run`` job, resolved once: its options and its kind.

:func:`resolve_job` is the one place that says what a job is. It resolves the options
(:func:`batchline.jobs.options.resolve`: the model spec parsed once, generation options for a
job that generates) and names the job's kind, which everything after it dispatches on: the
local run (:func:`batchline.jobs.run.run_job`), the CLI, and the Ray driver and its replicas.

- ``openai-batch``: an OpenAI batch file, each line to the model its ``body.model`` picks;
- ``generate``: text generation over a dataset of prompts;
- ``images``: a batch model over pictures (a folder, ``.tar`` shards, ``--image-column``);
- ``dataset``: a batch model over any other dataset (embed, classify, predict, score).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchline.jobs.options import GenerateOptions, RunOptions, resolve

if TYPE_CHECKING:
    from batchline.jobs.openai_batch import BatchFiles

__all__ = ["Job", "resolve_job"]


@dataclass(frozen=True)
class Job:
    """A resolved job: its kind's name, its resolved options, and an OpenAI batch job's
    files (``batch``)."""

    kind: str
    options: RunOptions
    batch: BatchFiles | None = None

    @property
    def generates(self) -> bool:
        """Whether the job's options are a generation job's (:class:`GenerateOptions`): its
        progress counts prompts and tokens."""
        return isinstance(self.options, GenerateOptions)


def resolve_job(options: RunOptions | Job) -> Job:
    """The job ``options`` describe (sync: it may read the input's first line); a job as it
    is."""
    if isinstance(options, Job):
        return options
    options = resolve(options)
    if isinstance(options, GenerateOptions):
        from batchline.jobs.openai_batch import detect_batch

        batch = detect_batch(options)
        if batch is not None:
            return Job("openai-batch", options, batch)
        return Job("generate", options)
    if options.reads_pictures():
        return Job("images", options)
    return Job("dataset", options)
