"""A toy job kind, all of it in this module: count the words of each record's text.

It is what "one module, one registration line" means for a job kind: a test registers
:data:`KIND` (``undo = register(KIND)``) and ``batchline run`` runs any ``*.words.jsonl`` file
with it, locally (it has no Ray plan), through the same dataset pipeline as every job:
resumable, its output in chunks, its bad records listed.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from batchline.datasets.outcomes import Outcome
from batchline.datasets.pipeline import Progress, open_dataset_job, run_pipeline
from batchline.datasets.sinks import default_output
from batchline.datasets.sources import Record
from batchline.jobs.job import Job, JobKind
from batchline.jobs.options import RunOptions
from batchline.jobs.summary import RunSummary, summarize


class WordCounter:
    """The pipeline's adapter: a record's outcome is its text's number of words."""

    async def submit(self, records: Sequence[Record]) -> asyncio.Future[list[Outcome]]:
        done: asyncio.Future[list[Outcome]] = asyncio.get_running_loop().create_future()
        done.set_result([len(str(record.input).split()) for record in records])
        return done

    def utilization(self) -> float:
        return 1.0


def claims(options: RunOptions) -> bool:
    return options.input is not None and options.input.name.endswith(".words.jsonl")


async def run_local(job: Job, progress: Progress | None) -> RunSummary:
    options = job.options
    source, writer = await asyncio.to_thread(
        open_dataset_job,
        options,
        model="words",
        output=options.output or default_output(options.input, "words"),
        chunk_size=options.chunk_size,
        result_column="words",
        result_kind="value",
    )
    with writer:
        done = await run_pipeline(
            WordCounter(),
            source,
            writer,
            block_records=64,
            max_blocks_in_flight=2,
            limit=options.limit,
            on_bad_record=options.on_bad_record,
            progress=progress,
        )
    return summarize(writer.out_dir, options.knobs.batching, done, None, padded=False)


KIND = JobKind("words", claims=claims, run_local=run_local)
