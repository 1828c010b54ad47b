"""Every error batchline raises on purpose.

The tree::

    BatchlineError
    ├── QueueFullError            submit_nowait()/submit_many_nowait() found no room: nothing queued
    ├── BatcherClosedError        the batcher is stopping or stopped
    ├── RecordTooLargeError       one record costs more than a whole batch may (oversize="reject")
    ├── DeadlineExceededError     a queued record's deadline passed before dispatch
    ├── BatchProcessingError      process_fn failed in a way that is not the record's own exception
    │   ├── BatchSizeMismatchError   process_fn returned the wrong number of results
    │   │                            (also a ValueError, as Flyte raises there)
    │   └── BatchTimeoutError        process_fn did not finish within process_timeout_s
    ├── DiskError                 a write failed for the disk's reason: full, read-only, I/O
    ├── ModelError                a model could not be loaded or run
    │   └── FixedBatchAxisError      an ONNX model cannot take a batch of another size
    └── InputError                the user's data or settings cannot be used (CLI exit code 2)
        └── ConstraintError          the grammar engine gave up on a request's constraint
                                     mid-generation: the sequence ends with this, never "stop"

Each error's message says what to do about it.
"""

from __future__ import annotations

__all__ = [
    "BatchProcessingError",
    "BatchSizeMismatchError",
    "BatchTimeoutError",
    "BatcherClosedError",
    "BatchlineError",
    "ConstraintError",
    "DeadlineExceededError",
    "DiskError",
    "EngineGoneError",
    "FixedBatchAxisError",
    "InputError",
    "ModelError",
    "QueueFullError",
    "RecordTooLargeError",
]


class BatchlineError(Exception):
    """Base of every error batchline raises on purpose."""


class QueueFullError(BatchlineError):
    """Raised by ``submit_nowait`` when the queue already holds ``queue_capacity`` records
    (``max_queue_size`` plus the Flyte-compatible prefetch room), and by
    ``submit_many_nowait`` when it has no room for all of the records; nothing is queued."""


class BatcherClosedError(BatchlineError):
    """Raised by ``submit`` once ``stop()`` has begun; set on records a stop did not run."""


class RecordTooLargeError(BatchlineError):
    """Raised by ``submit`` when one record's cost exceeds ``target_batch_cost`` and
    the batcher was built with ``oversize="reject"``."""


class DeadlineExceededError(BatchlineError):
    """Set on a queued record whose deadline passed before dispatch; it is never processed."""


class DiskError(BatchlineError):
    """Raised when a write failed for a reason of the disk's, not the program's: it is full or
    over quota (ENOSPC, EDQUOT), read-only (EROFS), not writable (EACCES) or failed (EIO). The
    message names the folder and what to do; ``errno`` is the cause's. Nothing half-written
    is left to be read back as whole (``batchline._fsio``)."""

    def __init__(self, message: str, errno: int) -> None:
        super().__init__(message)
        self.errno = errno


class BatchProcessingError(BatchlineError):
    """Set on a record when ``process_fn`` failed for a reason that is not an exception of the
    record's own (for example ``process_fn`` raised ``CancelledError``)."""


class BatchSizeMismatchError(BatchProcessingError, ValueError):
    """Set on every record of a batch for which ``process_fn`` returned the wrong number
    of results. Also a ``ValueError``: Flyte's batcher raises one there, and code written
    for it catches that."""


class BatchTimeoutError(BatchProcessingError):
    """Set on every record of a batch that ran longer than ``process_timeout_s``."""


class ModelError(BatchlineError):
    """Raised when a model cannot be loaded or run."""


class EngineGoneError(ModelError):
    """Raised by a generator whose engine has exited (an engine process killed, vLLM's engine
    core dead): it takes no more requests until the server, or the model, is started again.
    The message says what exited and how; the server answers it with a 503 and its ``/ready``
    and ``/health`` say so, so that a load balancer or an orchestrator acts on it."""


class FixedBatchAxisError(ModelError):
    """Raised at load when an ONNX model's batch dimension is fixed, so it cannot batch."""


class InputError(BatchlineError):
    """Raised when input data or settings cannot be used; the CLI prints it as one line, exit 2."""


class ConstraintError(InputError):
    """Set on a generation request whose structured-output constraint the grammar engine gave
    up on mid-generation (a parser or lexer limit reached at some token): the sequence ends
    with this error, never as ``finish_reason="stop"``. The server answers it with a 400 (an
    SSE error event once streaming), a ``run`` job fails that record. Simplify the constraint
    (fewer choices, smaller repetition counts, no cyclic ``$ref``)."""
