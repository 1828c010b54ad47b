"""The fault-injection harness: fail the n-th write of a site, check what the user is left with.

Every write batchline makes passes ``batchline._fsio.checkpoint(site, step, path)`` before each
of its steps (open, write, fsync, rename, append, one SQLite statement...). :class:`Fault` is
the hook installed there: it counts the steps of the sites it watches and, from the n-th on,
raises what the operating system (or SQLite) raises for ENOSPC, EIO or EROFS, until it is
lifted (space returns). A torn append leaves half its line behind first, as a real full disk
may.

``SITES`` below is the one table: each write site of ``src/`` and the scenario that covers it.
``test_sites.py`` fails when a site in ``src/`` has no line here, so a new write site is
covered by adding one line: ``"<site>": <scenario>``. A scenario runs a whole job, batch or
cache fill under a fault and checks the three things issue 53 asks:

1. it ends in a stated state (a one-line error with rc 2; a batch ``failed`` naming the data
   dir; a 507 naming it; or, for a cache that only saves work, a warning and a finished job);
2. nothing half-written is read back as whole (no ``.tmp`` left where a reader looks; every
   file a manifest or the metadata lists reads whole);
3. once the fault is lifted, ``--resume`` (or the server itself, without a restart) finishes
   every record exactly once.

In the normal pytest run each scenario tries a few n (first, middle, last) with each errno
(those that run a real model: ENOSPC alone, at fewer n); ``BATCHLINE_FAULT_MATRIX=full``
(``scripts/fault_matrix.sh``) tries every n up to the count of steps a clean run makes.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

__all__ = [
    "ERRNOS",
    "SITES",
    "Fault",
    "Step",
    "count_steps",
    "full_matrix",
    "points",
    "slow_codes",
]

ERRNOS = (errno.ENOSPC, errno.EIO, errno.EROFS)

#: What SQLite says for each fault (``sqlite3.OperationalError``).
_SQLITE_TEXT = {
    errno.ENOSPC: "database or disk is full",
    errno.EIO: "disk I/O error",
    errno.EROFS: "attempt to write a readonly database",
}

#: Every write site in ``src/`` (the ``site`` argument of ``batchline._fsio``'s functions and
#: ``checkpoint``) -> the scenario that covers it (a test module in this folder). One line each.
SITES = {
    "run.part": "run",  # a chunk's part file (test_run_faults.py)
    "run.manifest": "run",  # _manifest.json
    "run.skipped": "run",  # _skipped.jsonl: appended, then sorted at the end
    "run.flushed": "flush",  # _flushed-N.jsonl, what a stopped run kept (test_flush_faults.py)
    "batch.file": "batch",  # uploads and a batch's output/error files (test_batch_faults.py)
    "batch.meta": "batch",  # the Batch API's SQLite metadata
    "batch.output": "batch",  # a batch's all.jsonl, from its chunks (run on a batch file too)
    "drive.failures": "drive",  # drive's _failures.jsonl (test_drive_faults.py)
    "cache.result": "result_cache",  # run --cache (test_cache_faults.py)
    "cache.hf": "written_whole",  # an HF folder converted to ONNX
    "cache.kernel": "written_whole",  # the compiled decode kernel
    "cache.model": "written_whole",  # the built-in MiniLM graph
    "cache.corpus": "written_whole",  # the demo corpus
    "cache.demo": "written_whole",  # the demo prompts
    "cache.quantized": "written_whole",  # an int8 graph and its measured quality
    "cache.precision": "written_whole",  # the precision auto measured for a model on a CPU kind
    "cache.smollm2": "written_whole",  # the smollm2 safetensors folder (renamed whole)
    "cache.gguf": "written_whole",  # a GGUF file's config and tokenizer (renamed whole)
    "config.knobs": "written_whole",  # tune's knobs file
    "config.serve": "written_whole",  # serve's settings written as a config file
    "cache.test": "written_whole",  # tests/test_cache.py's own
}


def full_matrix() -> bool:
    """Whether to try every n (``BATCHLINE_FAULT_MATRIX=full``), not a few."""
    return os.environ.get("BATCHLINE_FAULT_MATRIX") == "full"


def points(total: int) -> list[int]:
    """The n to fail at, 1-based: every one up to ``total`` in the full matrix, else the first,
    the middle and the last."""
    if total < 1:
        return []
    if full_matrix():
        return list(range(1, total + 1))
    return sorted({1, (total + 1) // 2, total})


def slow_codes() -> tuple[int, ...]:
    """The errnos for a scenario that runs a real model each time: all three in the full
    matrix, ENOSPC alone in the normal run (its other cases are the same code path)."""
    return ERRNOS if full_matrix() else (errno.ENOSPC,)


@dataclass(frozen=True)
class Step:
    site: str
    step: str
    path: Path


@dataclass
class Fault:
    """The hook for ``batchline._fsio.injecting``: counts the steps of ``sites`` (prefixes;
    empty: all) and fails every one from the ``at``-th on (None: none) with ``code``, until
    :meth:`lift` or until it has failed ``lasting`` steps (None: until lifted)."""

    sites: tuple[str, ...] = ()
    at: int | None = None
    code: int = errno.ENOSPC
    lasting: int | None = None
    steps: list[Step] = field(default_factory=list)
    failed: list[Step] = field(default_factory=list)
    lifted: bool = False

    def __call__(self, site: str, step: str, path: Path) -> None:
        if self.sites and not site.startswith(self.sites):
            return
        here = Step(site, step, path)
        self.steps.append(here)
        if self.at is None or self.lifted or len(self.steps) < self.at:
            return
        if self.lasting is not None and len(self.failed) >= self.lasting:
            return
        self.failed.append(here)
        raise self.error(here)

    def lift(self) -> None:
        """Space returns (or the disk is writable again): no step fails from now on."""
        self.lifted = True

    @property
    def fired(self) -> bool:
        return bool(self.failed)

    def error(self, step: Step) -> Exception:
        if step.step == "sqlite":
            return sqlite3.OperationalError(_SQLITE_TEXT[self.code])
        if step.step == "append" and step.path.exists() and self.code == errno.ENOSPC:
            # a torn append: the disk took half a line before it ran out
            with open(step.path, "ab") as f:
                f.write(b'{"index": 99999, "id": "torn')
        return OSError(self.code, os.strerror(self.code), str(step.path))


def count_steps(fault: Fault) -> int:
    """The steps a clean run made (``fault`` ran with ``at=None``)."""
    return len(fault.steps)
