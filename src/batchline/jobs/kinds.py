"""The job kinds ``batchline run`` knows, and the one place a job's kind is decided.

:func:`resolve_job` asks each registered :class:`~batchline.jobs.job.JobKind` in turn, the
newest registration first, whether a job's resolved options are its own; the built-in kinds
are asked last, in this order: an OpenAI batch file, text generation, pictures, then any other
dataset (which claims every job the others leave). A kind is added with one line::

    undo = register(JobKind("words", claims=..., run_local=...))

and :func:`register`'s return value takes it out again (a test's, so it never leaks).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from batchline._errors import InputError
from batchline.jobs.job import Job, JobKind
from batchline.jobs.options import RunOptions, resolve

__all__ = ["kind_of", "register", "registered", "resolve_job"]

_added: list[JobKind] = []
_lock = threading.Lock()


def _built_in() -> list[JobKind]:
    """The built-in kinds, asked after every registered one (last of all, the dataset kind,
    which claims whatever the others leave); one line each."""
    from batchline.jobs import dataset, generate_job, images, openai_batch_job

    return [openai_batch_job.KIND, generate_job.KIND, images.KIND, dataset.KIND]


def register(kind: JobKind) -> Callable[[], None]:
    """Add ``kind``, asked before every kind registered earlier and the built-in ones; the
    function that takes it out again. A name already taken is refused."""
    with _lock:
        if any(k.name == kind.name for k in registered()):
            raise ValueError(f"a job kind named {kind.name!r} is already registered")
        _added.append(kind)

    def undo() -> None:
        with _lock:
            if kind in _added:
                _added.remove(kind)

    return undo


def registered() -> list[JobKind]:
    """Every kind, in the order :func:`resolve_job` asks them."""
    return [*reversed(_added), *_built_in()]


def kind_of(job: Job) -> JobKind:
    """The kind ``job`` was resolved to."""
    for kind in registered():
        if kind.name == job.kind:
            return kind
    raise InputError(f"no job kind named {job.kind!r} is registered")


def resolve_job(options: RunOptions | Job) -> Job:
    """The job ``options`` describe: resolved once, its kind the first that claims it (sync:
    a kind may read the input's first line); a job as it is."""
    if isinstance(options, Job):
        return options
    options = resolve(options)
    for kind in registered():
        claim = kind.claims(options)
        if claim:
            return Job(kind.name, options, claim)
    raise InputError(f"no job kind runs {options.input or 'the demo input'}")  # pragma: no cover
