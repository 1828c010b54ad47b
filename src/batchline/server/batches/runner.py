"""Running the Batch API's batches on the server's own models, beside live traffic.

Each batch is one worker task; at most ``max_running_batches`` run at once, and the others
wait for a slot in creation order (``asyncio.Semaphore`` wakes its waiters first come, first
served), so a long batch delays later ones but never starves them.

A batch runs through the same pipeline and chunk writer as ``batchline run`` on a batch file
(:func:`batchline.jobs.openai_batch.answer_lines`, whose :class:`LinesAdapter` reads and
answers the lines): into ``batches/<id>/all.jsonl.parts``, resumable. What differs is what
answers the lines: the server's models, not loaded ones:

- chat and completions lines go to the served generator's shared ``TextGenerator``, at
  ``batch`` priority (every job request is, see ``jobs/generate.py``), with fewer requests in
  flight than its waiting queue holds, so live requests still find room;
- embeddings, classify, rerank and score lines go to the served model's own queue
  (:class:`~batchline.server.served.ServedLane`) at ``batch`` priority, at most a share of
  the queue at a time; a queue that live traffic filled makes the batch wait, never a line
  fail;
- with ``memory_budget`` the on-demand models a batch needs are acquired for its whole run
  (loaded as needed, never evicted meanwhile).

Status runs validating → in_progress → finalizing → completed, or failed (a file that is not
JSONL, duplicate ``custom_id``s), expired (``completion_window`` passed: the lines not run are
``batch_expired`` errors) or cancelling → cancelled (``batch_cancelled``). Finalizing writes the
output file (the lines answered) and the error file (the lines that failed), each whole.

A full or failing disk: a worker whose write fails for the disk's reason (full, read-only,
an I/O error) waits and tries again, resuming from its committed chunks, after 1, 2, 4 ... 60
seconds (``_DISK_RETRY_S``, about seven minutes in all), so a batch whose disk got space back
meanwhile finishes by itself, every line once; then it turns ``failed``, its error naming the
data dir. The status write itself cannot fail for lack of space (``store.py``: the reserve,
then memory). A watchdog (every ``_WATCH_S``) writes statuses kept in memory once the disk
takes them, takes the reserve back, and relaunches an unfinished batch that has no worker, so
a poller never waits on a dead one.

Crash safety: a batch's status and counts are in SQLite, its results in committed chunks. A
server killed mid-batch and started again on the same ``data_dir`` resumes every unfinished
batch where its chunks end (:meth:`BatchService.start`); the output is byte-identical to an
uninterrupted run's but for ``created``. Shutting down (SIGTERM) stops the workers without
finalizing: their batches resume on the next start.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._cache import write_whole
from batchline._fsio import disk_errno, disk_phrase
from batchline._priority import BATCH, batcher_priority
from batchline.datasets.formats.base import lines as nonblank_lines
from batchline.datasets.manifest import Manifest
from batchline.jobs.openai_batch import BatchFiles, LineEngine, answer_lines
from batchline.jobs.openai_output import answered
from batchline.jobs.options import GenerateOptions
from batchline.jobs.requests import (
    KIND_OF_URL,
    BatchModels,
    RecordRequests,
    custom_id_error,
    first_duplicate_custom_id,
)
from batchline.server.batches.store import FileRecord, Store, derived_file_id, now
from batchline.server.served import ServedGenerator, ServedLane

if TYPE_CHECKING:
    from batchline.datasets.outcomes import Written
    from batchline.datasets.sources import Record
    from batchline.models.config import Knobs
    from batchline.server.settings import ServerSettings
    from batchline.server.state import ServerState

__all__ = ["BatchService"]

logger = logging.getLogger("batchline.server")

_PRIORITY = batcher_priority(BATCH)
#: How long a batch item waits before trying again a queue that live traffic filled.
_FULL_RETRY_S = 0.05
#: The most validation errors a failed batch lists.
_MAX_ERRORS = 10
#: Waits before each new try of a batch whose worker hit a disk error; then it fails.
_DISK_RETRY_S: tuple[float, ...] = (1, 2, 4, 8, 16, 32, 60, 60, 60, 60, 60, 60, 60)
#: How often the watchdog writes kept statuses and looks for unfinished batches without a worker.
_WATCH_S = 5.0
#: Relaunches of one batch whose worker died (not a disk error) before it is failed.
_MAX_RELAUNCHES = 3


class _Expired(Exception):
    """The batch's completion window passed."""


class BatchService:
    """The batches of one server: started and stopped with the app (its lifespan)."""

    def __init__(self, state: ServerState, store: Store) -> None:
        self.state = state
        self.store = store
        self.settings = state.settings
        self._slots = asyncio.Semaphore(self.settings.max_running_batches)
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._stopping = False
        self._retry_s = _DISK_RETRY_S
        self._watch_s = _WATCH_S
        self._watcher: asyncio.Task[None] | None = None
        self._relaunched: dict[str, int] = {}
        #: the kinds of model each validated batch's lines ask for, until it runs
        self._kinds: dict[str, set[str]] = {}

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        """Resume every batch a previous run of the server left unfinished; start the
        watchdog."""
        for owner, batch in self.store.unfinished():
            logger.info("batch %s resumes (%s)", batch["id"], batch["status"])
            self.launch(owner, batch["id"])
        self._watcher = asyncio.create_task(self._watch(), name="batch-watchdog")

    async def stop(self) -> None:
        """Stop the workers; their batches keep their status and resume on the next start."""
        self._stopping = True
        tasks = list(self._tasks.values())
        if self._watcher is not None:
            tasks.append(self._watcher)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.store.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self._watch_s)
            try:
                await self.watch_once()
            except Exception:  # the watchdog never dies of one bad round
                logger.exception("the batch watchdog's round failed")

    async def watch_once(self) -> None:
        """One round of the watchdog: statuses kept in memory written if the disk takes them
        now, the reserve taken back, and each unfinished batch without a worker relaunched
        (failed after ``_MAX_RELAUNCHES``)."""
        if self.store.flush() == 0 and self.store.disk_problem is None:
            await asyncio.to_thread(self.store.keep_reserve)
        for owner, batch in list(self.store.unfinished()):
            batch_id = batch["id"]
            if batch_id in self._tasks or self._stopping:
                continue
            n = self._relaunched[batch_id] = self._relaunched.get(batch_id, 0) + 1
            if n > _MAX_RELAUNCHES:
                message = f"the batch's worker stopped {n - 1} times without finishing it"
                self._fail(owner, batch_id, [_error("batch_failed", message)])
                continue
            logger.warning("batch %s has no worker (%s): relaunched", batch_id, batch["status"])
            self.launch(owner, batch_id)

    def launch(self, owner: str, batch_id: str) -> None:
        task = asyncio.create_task(self._run(owner, batch_id), name=f"batch-{batch_id}")
        self._tasks[batch_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(batch_id, None))

    def cancel(self, owner: str, batch_id: str) -> dict[str, Any] | None:
        """Cancel ``owner``'s batch (``None``: no such batch): a batch at work turns
        ``cancelling``, then ``cancelled`` once its worker has stopped and written what it
        answered; a finished one is returned as it is."""
        batch = self.store.batch(owner, batch_id)
        if batch is None or batch["status"] not in ("validating", "in_progress"):
            return batch
        batch.update(status="cancelling", cancelling_at=now())
        self.store.put_batch(owner, batch)
        task = self._tasks.get(batch_id)
        if task is not None:
            task.cancel()
        return batch

    # -- one batch --------------------------------------------------------------------------

    async def _run(self, owner: str, batch_id: str) -> None:
        try:
            for attempt in range(len(self._retry_s) + 1):
                try:
                    async with self._slots:
                        await self._work(owner, batch_id)
                    return
                except Exception as exc:
                    code = self.store.note_disk_error(exc)
                    if code is None or attempt == len(self._retry_s):
                        raise
                    wait_s = self._retry_s[attempt]
                    logger.warning(
                        "batch %s: the data dir %s %s; trying again in %g s (%d of %d)",
                        batch_id,
                        self.store.root,
                        disk_phrase(code),
                        wait_s,
                        attempt + 1,
                        len(self._retry_s),
                    )
                await asyncio.sleep(wait_s)  # the slot is free meanwhile
        except asyncio.CancelledError:
            if self._stopping:
                raise
            await self._end(owner, batch_id, "cancelled")  # a user's cancel
        except _Expired:
            await self._end(owner, batch_id, "expired")
        except Exception as exc:
            self._crashed(owner, batch_id, exc)

    async def _work(self, owner: str, batch_id: str) -> None:
        """Take the batch from its status to the end (each step resumes the one before)."""
        batch = self._get(owner, batch_id)
        try:
            if batch["status"] == "validating":
                batch = await self._validate(owner, batch)
            if batch["status"] == "in_progress":
                await self._execute(owner, batch)
                await self._finalize(owner, batch_id, "completed")
            elif batch["status"] in ("finalizing", "cancelling"):
                final = "completed" if batch["status"] == "finalizing" else "cancelled"
                await self._finalize(owner, batch_id, final)
        finally:
            self._kinds.pop(batch_id, None)

    async def _end(self, owner: str, batch_id: str, final: str) -> None:
        try:
            await self._finalize(owner, batch_id, final)
        except Exception as exc:
            self._crashed(owner, batch_id, exc)

    def _crashed(self, owner: str, batch_id: str, exc: Exception) -> None:
        logger.error("batch %s failed", batch_id, exc_info=exc)
        code = disk_errno(exc)
        if code is None:
            error = _error("batch_failed", f"the batch failed: {exc}")
        else:
            tries = len(self._retry_s) + 1
            message = (
                f"the batch failed after {tries} tries: the server's data dir "
                f"{self.store.root} {disk_phrase(code)}; once it has room, create the batch again"
            )
            error = _error("disk_error", message)
        self._fail(owner, batch_id, [error])

    def _get(self, owner: str, batch_id: str) -> dict[str, Any]:
        batch = self.store.batch(owner, batch_id)
        assert batch is not None, batch_id
        return batch

    def _files(self, batch: dict[str, Any]) -> BatchFiles:
        work = self.store.batch_dir(batch["id"])
        output = work / "all.jsonl"
        return BatchFiles(
            self.store.file_path(batch["input_file_id"]),
            output,
            Path(f"{output}.parts"),
            job_id=batch["id"],  # its lines' ids: this batch's, the same when it resumes
        )

    async def _validate(self, owner: str, batch: dict[str, Any]) -> dict[str, Any]:
        path = self.store.file_path(batch["input_file_id"])
        kinds: set[str] = set()
        total, errors = await asyncio.to_thread(_check_file, path, self.settings, kinds)
        if errors:
            self._fail(owner, batch["id"], errors)
            return self._get(owner, batch["id"])
        self._kinds[batch["id"]] = kinds  # for _execute: the file is not parsed twice
        batch = self._get(owner, batch["id"])
        if batch["status"] == "validating":  # not cancelled meanwhile
            batch["request_counts"]["total"] = total
            batch.update(status="in_progress", in_progress_at=now())
            self.store.put_batch(owner, batch)
        return batch

    def _fail(self, owner: str, batch_id: str, errors: list[dict[str, object]]) -> None:
        batch = self._get(owner, batch_id)
        batch.update(status="failed", failed_at=now(), errors={"object": "list", "data": errors})
        self.store.put_batch(owner, batch)

    async def _execute(self, owner: str, batch: dict[str, Any]) -> None:
        files = self._files(batch)
        kinds = self._kinds.pop(batch["id"], None)
        if kinds is None:  # validated before a restart
            kinds = await asyncio.to_thread(_kinds_asked, files.input)
        names = _served_names(self.state)
        options = files.job_options(
            GenerateOptions(
                input=files.input,
                output=files.output,
                model="serve",
                chunk_size=self.settings.batch_chunk_size,
                # a folder without a manifest committed nothing: start it again
                resume=files.started,
                overwrite=not files.started,
            )
        )
        counts = batch["request_counts"]
        # from what is committed: lines handed on but not committed before a crash or a disk
        # error are answered again, and would be counted twice
        committed = Manifest.load(files.parts).chunks.values() if files.started else ()
        counts["completed"] = sum(c.rows for c in committed)
        counts["failed"] = sum(c.skipped for c in committed)
        current = self._get(owner, batch["id"])
        if current["status"] == "in_progress":  # not cancelled meanwhile
            current["request_counts"] = counts
            self.store.put_batch(owner, current)
        lines = self.state.metrics.batch_lines

        def written(records: Sequence[Record], done: Written) -> None:
            counts["completed"] = min(counts["total"], counts["completed"] + done.written)
            counts["failed"] = min(counts["total"], counts["failed"] + done.skipped)
            lines.labels(outcome="completed").inc(done.written)
            lines.labels(outcome="failed").inc(done.skipped)
            current = self._get(owner, batch["id"])
            if current["status"] == "in_progress":
                current["request_counts"] = counts
                self.store.put_batch(owner, current)

        left_s = batch["expires_at"] - time.time()
        try:
            async with asyncio.timeout(max(0.0, left_s)), self._hold(names, kinds) as held:
                generator, engines = held
                adapter = None
                if generator is not None:
                    requests = RecordRequests("body", True, options.sampling(), openai_batch=True)
                    adapter = generator.job_adapter(requests, limit=self._generator_room(generator))
                await answer_lines(
                    options,
                    [
                        f"{n}"
                        for n in (names.generate, names.embed, names.score, names.classify)
                        if n
                    ],
                    names,
                    adapter,
                    engines,
                    on_written=written,
                    line_blocks=True,  # a cancel or the window's end keeps every answer
                )
        except TimeoutError:
            raise _Expired from None

    def _generator_room(self, generator: ServedGenerator) -> int:
        """Requests a batch keeps in the generator's waiting queue: a share of it, so that
        the running batches together take half of it at most (and never more than a job keeps
        in flight: :meth:`ServedGenerator.job_adapter`)."""
        return max(1, generator.max_waiting // (2 * self.settings.max_running_batches))

    @contextlib.asynccontextmanager
    async def _hold(
        self, names: BatchModels, kinds: set[str]
    ) -> AsyncIterator[tuple[ServedGenerator | None, dict[str, LineEngine]]]:
        """The served models the batch's lines need, acquired (on-demand ones) while it runs."""
        registry = self.state.registry
        acquired: list[str] = []
        generator: ServedGenerator | None = None
        engines: dict[str, LineEngine] = {}
        knobs = self.settings.knobs
        room = _lane_room(knobs, self.settings.max_running_batches)
        try:
            for kind in sorted(kinds):
                name = getattr(names, kind)
                if name is None:
                    continue  # every such line is an error naming what to serve
                served = await registry.claim(name)
                if served is None:
                    continue
                acquired.append(name)
                if isinstance(served, ServedGenerator):
                    generator = served
                else:
                    engines[kind] = ServedLane(
                        served, room, priority=_PRIORITY, retry_s=_FULL_RETRY_S
                    )
            yield generator, engines
        finally:
            for name in acquired:
                registry.unclaim(name)

    async def _finalize(self, owner: str, batch_id: str, final: str) -> None:
        """Write the output and error files (whole), then mark the batch ``final``."""
        batch = self._get(owner, batch_id)
        if final == "completed":
            batch.update(status="finalizing", finalizing_at=batch.get("finalizing_at") or now())
            self.store.put_batch(owner, batch)
        not_run = {
            "expired": ("batch_expired", "the batch expired before this request was answered"),
            "cancelled": (
                "batch_cancelled",
                "the batch was cancelled before this request was answered",
            ),
        }.get(final)
        ok, failed = await asyncio.to_thread(self._write_files, owner, batch, not_run)
        batch = self._get(owner, batch_id)
        counts = batch["request_counts"]
        counts.update(completed=ok, failed=failed, total=max(counts["total"], ok + failed))
        stamp = {"completed": "completed_at", "expired": "expired_at", "cancelled": "cancelled_at"}
        batch.update(status=final, **{stamp[final]: now()})
        for kind, n in (("output", ok), ("error", failed)):
            file_id = derived_file_id(batch_id, kind)
            batch[f"{kind}_file_id"] = file_id if n else None
        self.store.put_batch(owner, batch)
        logger.info("batch %s %s: %d completed, %d failed", batch_id, final, ok, failed)

    def _write_files(
        self, owner: str, batch: dict[str, Any], not_run: tuple[str, str] | None
    ) -> tuple[int, int]:
        """The output file (answered lines) and the error file (failed ones) of ``batch``,
        from its chunks, each written whole and recorded; the count of each (sync)."""
        files = self._files(batch)
        if not files.input.is_file():
            return 0, 0
        files.write_output(not_run=not_run)
        ok: list[bytes] = []
        failed: list[bytes] = []
        with files.output.open("rb") as f:
            for line in f:
                (ok if answered(line) else failed).append(line)
        for kind, lines in (("output", ok), ("error", failed)):
            if not lines:
                continue
            file_id = derived_file_id(batch["id"], kind)
            data = b"".join(lines)
            write_whole(self.store.file_path(file_id), data, "batch.file")
            self.store.add_file(
                FileRecord(
                    file_id,
                    owner,
                    f"{batch['id']}_{kind}.jsonl",
                    "batch_output",
                    len(data),
                    len(lines),
                    now(),
                )
            )
        return len(ok), len(failed)


def _lane_room(knobs: Knobs, running_batches: int) -> int:
    """Items a batch keeps queued at a served batch model: enough to fill its bulk slots
    twice over (``max_batch_size`` each), shared by the batches running, and never more than
    a share of its queue. More takes room in the queue that live requests may need and, where
    bulk shares the slots (``bulk_slots`` unset), waits long enough to age past live requests
    (10 s of ``priority_aging_s``) and go before them: there, with 1,024 queued, live p99 was
    x2.1 its idle p99 (``benchmarks/bench_batch_api.py``)."""
    slots = knobs.bulk_slots or knobs.max_concurrent_batches
    fill = 2 * slots * knobs.max_batch_size // running_batches
    return max(1, min(fill, knobs.max_queue_size // (2 * running_batches)))


def _served_names(state: ServerState) -> BatchModels:
    """The models a batch's lines go to: the first served model of each kind (a line's
    ``body.model`` must name it, or name none)."""
    first: dict[str, str] = {}
    registry = state.registry
    for name in registry.names():
        task = registry.task_of(name)
        if task in ("generate", "embed", "score", "classify"):
            first.setdefault(task, name)
    return BatchModels(**first)


def _kinds_asked(path: Path) -> set[str]:
    """The kinds of model the lines of a batch file ask for (sync: reads the file)."""
    kinds: set[str] = set()
    with path.open("rb") as f:
        for _, raw in nonblank_lines(f):
            try:
                value = json.loads(raw)
            except ValueError:
                continue
            _add_kind(kinds, value)
    return kinds


def _add_kind(kinds: set[str], value: object) -> None:
    url = value.get("url") if isinstance(value, dict) else None
    if isinstance(url, str) and url in KIND_OF_URL:
        kinds.add(KIND_OF_URL[url])


def _check_file(
    path: Path, settings: ServerSettings, kinds: set[str] | None = None
) -> tuple[int, list[dict[str, object]]]:
    """Validate a batch's input file (sync): its count of requests, and the errors that fail
    the batch: a missing file, no line that is a JSON object (not JSONL), too many lines, a
    ``custom_id`` that is not a string, two lines with one ``custom_id``. A bad line among
    good ones is not one: its error goes to the error file when the batch runs. ``kinds``
    gains the kinds of model the lines ask for (:func:`_kinds_asked`, in the same pass).

    Of each line only its ``custom_id`` is kept while the file is read: a file of pictures
    as data URIs is hundreds of MB, which the batch's job reads again line by line."""
    if not path.is_file():
        return 0, [_error("invalid_file", "the input file was deleted before the batch ran")]
    parsed: list[tuple[int, object]] = []
    bad: list[dict[str, object]] = []
    with path.open("rb") as f:
        for number, raw in nonblank_lines(f):
            try:
                value = json.loads(raw)
            except ValueError as exc:
                bad.append(_error("invalid_json_line", f"line {number} is not JSON: {exc}", number))
                value = None
            if isinstance(value, dict):
                if kinds is not None:
                    _add_kind(kinds, value)
                value = {"custom_id": value["custom_id"]} if "custom_id" in value else {}
            parsed.append((number, value))
    if not parsed:
        return 0, [_error("empty_file", "the input file has no requests")]
    if len(parsed) > settings.max_batch_file_lines:
        message = (
            f"the input file has {len(parsed)} requests; the limit is "
            f"max_batch_file_lines={settings.max_batch_file_lines}: split it"
        )
        return 0, [_error("too_many_requests", message)]
    if not any(isinstance(v, dict) for _, v in parsed):
        note = _error("invalid_file", "the input file is not JSONL: no line is a JSON object")
        return 0, [note, *bad[: _MAX_ERRORS - 1]]
    for number, value in parsed:
        wrong = custom_id_error(value)
        if wrong is not None:
            return 0, [_error("invalid_custom_id", f"line {number}: {wrong}", number)]
    duplicate = first_duplicate_custom_id(parsed)
    if duplicate is not None:
        custom_id, first, second = duplicate
        message = (
            f"custom_id {custom_id!r} is on lines {first} and {second}; every request of a "
            "batch needs its own custom_id"
        )
        return 0, [_error("duplicate_custom_id", message, second)]
    return len(parsed), []


def _error(code: str, message: str, line: int | None = None) -> dict[str, object]:
    """One of a failed batch's ``errors``, as OpenAI shows it."""
    return {"code": code, "message": message, "param": None, "line": line}
