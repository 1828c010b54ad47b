"""``batchline drive``: fan a dataset out to serving replicas, every record exactly once.

The pipeline::

    open_source ──blocks of --records-per-request──> chunk tasks (at most --concurrency alive)
                                              │ pool.acquire(): the up endpoint with the
                                              │ fewest chunks in flight
                                              ▼
                                   POST /v1/embeddings | /generate
                        ok ─────────────> ChunkWriter (the same one `batchline run` uses)
                        retry ──backoff──> another attempt (Retry-After honoured)
                        fail / gave up ──> _failures.jsonl + ChunkWriter.skip

Two "chunks", two sizes: ``chunk_size`` records go in one request; ``output_chunk_size``
records go in one output file (the writer's chunk, the unit of resuming).

``--route generate`` keeps prefix affinity (``driver/affinity.py``; ``prefix_affinity=False``:
the plain loop above): records are read in windows of 2,048 (or ``chunk_size`` x
``concurrency``, if more), two windows at a time; a window's requests hold the prompts of one
shared prefix each (small groups packed together) and go to their prefix's replica while it is
not overloaded, at most ``concurrency`` in flight, a window's before the next one's. Outputs
are written in input order, exactly once, as ever.

What happens to a record, always exactly one of:

- its result is written (a row of ``part-NNNNNN.parquet``);
- it was bad input and ``on_bad_record="skip"``: it is in ``_skipped.jsonl``;
- its chunk was refused with a 4xx other than 401/403/404/405, or its chunk used up
  ``max_attempts`` on retryable errors: it is in ``_failures.jsonl`` (index, id, status, the
  server's message) and in ``_skipped.jsonl``; the job goes on and ends with exit code 1.
  (Records are not silently dropped, and one poisonous chunk does not cost the whole job;
  rerun those records from ``_failures.jsonl`` once the cause is fixed.)

A job stops instead (exit code 2; ``--resume`` continues it) on bad input, on 401/403/404/405
(a wrong key or URL would fail every chunk), or when no endpoint has been ready for
``give_up_after_s``. Attempts are spent only on requests actually sent: while every endpoint
is set aside, chunks wait.

A killed driver resumed with ``resume=True`` skips the committed output chunks and redoes the
rest; ``_failures.jsonl`` keeps only the entries of committed chunks, so nothing is listed twice.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias, cast

import httpx

from batchline._clock import Clock, LoopClock
from batchline._errors import BatchlineError, InputError
from batchline._tracing import tracing_from_env
from batchline.datasets.manifest import append_synced, json_line, replacing
from batchline.datasets.outcomes import Failed, Outcome
from batchline.datasets.output_dir import FAILURES_NAME
from batchline.datasets.pipeline import Progress, open_dataset_job, run_pipeline
from batchline.datasets.sinks import ChunkWriter, default_output
from batchline.datasets.sources import Record, holds_pictures, prompt_column
from batchline.driver.affinity import plan_requests, prefix_keys
from batchline.driver.client import (
    ClassifyRoute,
    EmbeddingsRoute,
    GenerateRoute,
    ReplicaClient,
    Reply,
    Route,
)
from batchline.driver.endpoints import Endpoint, EndpointPool, EndpointReport
from batchline.driver.options import DriveOptions, normalize_endpoint
from batchline.driver.pictures import PictureAdapter
from batchline.driver.retry import Backoff, sleep
from batchline.jobs.batch import DEDUPE_WINDOW, Seen, cancel, input_key

__all__ = [
    "FAILURES_NAME",
    "DriveOptions",
    "DriveSummary",
    "HttpAdapter",
    "drive",
    "drive_job",
    "normalize_endpoint",
    "read_failures",
]


_API_KEY_ENV = "BATCHLINE_API_KEY"


@dataclass(frozen=True)
class DriveSummary:
    """What a drive did. ``records``, ``failed`` and ``skipped`` count this run only;
    ``failed_total`` counts every failure in the output (resumed runs included)."""

    output: Path
    route: str
    records: int
    failed: int
    skipped: int
    already_done: int
    total_records: int
    failed_total: int
    wall_s: float
    requests: int
    retries: int
    endpoints: tuple[EndpointReport, ...] = ()
    #: records of empty or blank text (sent, or skipped with on_bad_record="skip")
    empty_texts: int = 0
    #: records answered from an identical text's answer, not sent
    duplicates: int = 0
    #: prefix affinity was on (``--route generate``): requests (attempts) sent to their
    #: prefix's replica, and those that fell back to the least-loaded one (it was over the
    #: imbalance bound)
    prefix_affinity: bool = False
    affine_requests: int = 0
    fallback_requests: int = 0

    @property
    def records_per_s(self) -> float:
        return self.records / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def exit_code(self) -> int:
        """0 when every record has a result (or was skipped as bad input), 1 when some failed."""
        return 1 if self.failed_total else 0

    def rows(self) -> list[tuple[str, str]]:
        """The summary as (label, value) rows, for a table."""
        rows = [
            ("output", str(self.output)),
            ("route", self.route),
            ("records (this run)", f"{self.records:,}"),
            ("failed (this run)", f"{self.failed:,}"),
            ("skipped bad input", f"{self.skipped:,}"),
            *([("empty texts", f"{self.empty_texts:,}")] if self.empty_texts else []),
            *([("duplicates (sent once)", f"{self.duplicates:,}")] if self.duplicates else []),
            ("resumed (already done)", f"{self.already_done:,}"),
            ("wall time", f"{self.wall_s:.1f} s"),
            ("records/s", f"{self.records_per_s:,.1f}"),
            ("requests", f"{self.requests:,}"),
            ("retries", f"{self.retries:,}"),
        ]
        if self.prefix_affinity:
            rows.append(
                (
                    "prefix affinity",
                    f"{self.affine_requests:,} requests to their prefix's replica, "
                    f"{self.fallback_requests:,} fell back to the least busy",
                )
            )
        for ep in self.endpoints:
            errors = ", ".join(f"{k} {v}" for k, v in ep.errors.items()) or "no errors"
            aside = (
                f"; set aside {ep.times_set_aside}x, back {ep.times_rejoined}x"
                if ep.times_set_aside
                else ""
            )
            rows.append((ep.url, f"{ep.requests:,} requests; {errors}{aside}"))
        if self.failed_total:
            rows.append(
                ("FAILED records (all runs)", f"{self.failed_total:,}: see {FAILURES_NAME}")
            )
        return rows


# -- the failures file ---------------------------------------------------------------------------


class _FailureLog:
    """``_failures.jsonl``: one line per failed record, kept in step with the writer.

    Lines are fsync'd before the writer hears of the skip, so a committed chunk's failures are
    always on disk. On opening, lines of chunks the manifest does not list are dropped: those
    chunks are redone, and their records fail (or not) again.
    """

    def __init__(self, path: Path, committed: Callable[[int], bool]) -> None:
        self.path = path
        self._lock = threading.Lock()
        self.added = 0
        kept: list[bytes] = []
        if path.exists():
            for line in path.read_bytes().splitlines(keepends=True):
                try:
                    index = json.loads(line)["index"]
                except (ValueError, KeyError, TypeError):
                    continue  # a line torn by a crash: its chunk was never committed
                if isinstance(index, int) and committed(index):
                    kept.append(line if line.endswith(b"\n") else line + b"\n")
        self.previous = len(kept)
        if kept or path.exists():
            with replacing(path, "drive.failures") as f:
                f.write(b"".join(kept))

    @property
    def total(self) -> int:
        return self.previous + self.added

    def add(self, entries: Sequence[dict[str, object]]) -> None:
        with self._lock:
            append_synced(self.path, b"".join(map(json_line, entries)), "drive.failures")
            self.added += len(entries)


def read_failures(out_dir: str | os.PathLike[str]) -> list[dict[str, object]]:
    """The entries of ``OUTPUT/_failures.jsonl`` (index, id, status, message, ...), by index."""
    path = Path(out_dir) / FAILURES_NAME
    if not path.exists():
        return []
    entries = [
        cast(dict[str, object], json.loads(line))
        for line in path.read_bytes().splitlines()
        if line.strip()
    ]
    return sorted(entries, key=lambda e: cast(int, e["index"]))


# -- the job -------------------------------------------------------------------------------------


#: the task of each route's answers: what an output folder left unnamed is called after
_TASKS = {"embeddings": "embed", "classify": "classify", "generate": "generate"}


def drive_output(options: DriveOptions) -> Path:
    """The folder the drive writes: ``options.output``, or one named after the input and the
    route's task (``STEM.embeddings``)."""
    return options.output or default_output(options.input, _TASKS[options.route])


def drive(options: DriveOptions, progress: Progress | None = None) -> DriveSummary:
    """Run the drive to the end (sync). See :func:`drive_job`."""
    from batchline.jobs.stopping import run_stoppable

    return run_stoppable(drive_job(options, progress))


async def drive_job(
    options: DriveOptions,
    progress: Progress | None = None,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> DriveSummary:
    """Send every record of ``options.input`` to ``options.endpoints``; write the results.

    ``transport`` (an ``httpx`` transport such as ``httpx.MockTransport``) is for tests.
    Raises ``InputError`` for bad input or settings and ``BatchlineError`` when the job cannot
    go on; the output is then resumable.

        >>> summary = drive(DriveOptions(
        ...     input=Path("docs.jsonl"), output=Path("docs.embeddings"),
        ...     endpoints=["http://10.0.0.1:8000", "http://10.0.0.2:8000"]))
        >>> summary.records_per_s, summary.exit_code
    """
    options.check()
    urls = [normalize_endpoint(u) for u in options.endpoints]
    tracing = tracing_from_env()  # None (nothing imported) unless OTEL_* asks for traces
    route: Route
    extra: dict[str, object] = {"route": options.route}
    pictures = options.input is not None and holds_pictures(options.input, options.input_format)
    if options.route == "embeddings":
        route = EmbeddingsRoute(encoding=options.encoding, images=pictures)
    elif options.route == "classify":
        route = ClassifyRoute(images=pictures)
    else:
        route = GenerateRoute(max_tokens=options.max_tokens, chat_template=options.chat_template)
        if options.input is not None and options.text_column == "text":
            # the prompt column run would read (drive sends text prompts: not 'messages')
            column = await asyncio.to_thread(
                prompt_column,
                options.input,
                fmt=options.input_format,
                named=None,
                looked_for=("prompt", "text"),
                flag="--text-column",
            )
            options = dataclasses.replace(options, text_column=column)
        extra["chat_template"] = options.chat_template
        if options.max_tokens is not None:  # other lengths give other texts: a resume must match
            extra["max_tokens"] = options.max_tokens
    source, writer = await asyncio.to_thread(
        open_dataset_job,
        options,
        model=options.model,
        output=drive_output(options),
        chunk_size=options.output_chunk_size,
        extra_settings=extra,
        result_column=route.result_column,
        result_kind=route.result_kind,
        input_kind="image" if pictures else "text",
        input_columns=("image",) if pictures else (),
    )
    with writer:
        dim = _expected_dim(options, writer, route)
        failures = await asyncio.to_thread(
            _FailureLog, writer.out_dir / FAILURES_NAME, writer.is_committed
        )
        client = ReplicaClient(
            route,
            api_key=options.api_key or os.environ.get(_API_KEY_ENV) or None,
            model=options.model,
            connect_timeout_s=options.connect_timeout_s,
            read_timeout_s=options.read_timeout_s,
            max_connections=options.concurrency + 2 * len(urls),
            dim=dim,
            transport=transport,
            tracing=tracing,
        )
        clock, rng = LoopClock(), random.random
        pool = EndpointPool(
            urls,
            probe=client.ready,
            failures_to_set_aside=options.failures_to_set_aside,
            probe_backoff=Backoff(base_s=0.25, cap_s=options.probe_cap_s, floor_s=0.1),
            give_up_after_s=options.give_up_after_s,
            affinity_slack=options.affinity_slack,
            clock=clock,
            rng=rng,
        )
        grouped = options.prefix_affinity and route.name == "generate"
        http = HttpAdapter(options, client, pool, failures, clock, rng, grouped=grouped)
        # pictures: each read and sent as a data URI
        adapter = PictureAdapter(http) if pictures else http
        if grouped:  # a window read at a time, the next one read while it runs
            block, blocks = _window(options), 2
        else:
            block, blocks = options.chunk_size, options.concurrency
        try:
            async with pool:
                done = await run_pipeline(
                    adapter,
                    source,
                    writer,
                    block_records=block,
                    max_blocks_in_flight=blocks,
                    limit=options.limit,
                    on_bad_record=options.on_bad_record,
                    progress=progress,
                )
                reports = tuple(pool.reports())
        finally:
            await client.aclose()
            if tracing is not None:
                await asyncio.to_thread(tracing.shutdown)  # the last spans go out
        return DriveSummary(
            output=writer.out_dir,
            route=route.name,
            records=done.records,
            failed=done.failed,
            skipped=done.skipped - done.failed,
            already_done=done.already_done,
            total_records=done.total_records,
            failed_total=failures.total,
            wall_s=done.wall_s,
            requests=sum(r.requests for r in reports),
            retries=adapter.retries,
            endpoints=reports,
            empty_texts=done.empty_texts,
            duplicates=adapter.duplicates,
            prefix_affinity=grouped,
            affine_requests=pool.affine,
            fallback_requests=pool.fallbacks,
        )


def _window(options: DriveOptions) -> int:
    """Records read at a time and sent grouped by prefix: the local job's window, or enough
    to fill every request slot."""
    from batchline.jobs.generate import PREFIX_ORDER_WINDOW

    return max(PREFIX_ORDER_WINDOW, options.chunk_size * options.concurrency)


def _expected_dim(options: DriveOptions, writer: ChunkWriter, route: Route) -> int | None:
    """The vector length every answer must have: ``--dim``, or the output's when resuming;
    None lets the first valid answer decide."""
    if route.result_kind != "vector":
        return None
    written = writer.manifest.result_dim
    if options.dim is not None and written is not None and options.dim != written:
        raise InputError(
            f"--dim {options.dim}, but {writer.out_dir} holds vectors of {written} values"
        )
    return options.dim if options.dim is not None else written


@dataclass
class _Deduped:
    """A block's records: the ones to send (``fresh``; ``answers`` their futures, for later
    duplicates) and the ones that wait on an earlier record's answer (``waits``)."""

    fresh: list[int] = dataclasses.field(default_factory=list)
    answers: dict[int, asyncio.Future[Outcome]] = dataclasses.field(default_factory=dict)
    waits: dict[int, asyncio.Future[Outcome]] = dataclasses.field(default_factory=dict)


#: one request of a block: the indices of its records among those sent, and its task
_Request: TypeAlias = tuple[list[int], "asyncio.Task[list[Outcome]]"]


async def _gathered(n: int, sends: Sequence[_Request]) -> list[Outcome]:
    """The ``n`` outcomes of ``sends``' records, in order; one request's error withdraws the
    others."""
    tasks = [task for _, task in sends]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        cancel(tasks)
        raise
    outcomes: list[Outcome] = [None] * n
    for (indices, _), got in zip(sends, results, strict=True):
        for i, outcome in zip(indices, got, strict=True):
            outcomes[i] = outcome
    return outcomes


class HttpAdapter:
    """:class:`~batchline.datasets.pipeline.Adapter` for serving replicas: each block of
    records is one request (``--chunk-size``), sent to the ready endpoint with the fewest in
    flight and retried elsewhere with backoff; a block that fails for good is listed in
    ``_failures.jsonl`` (before the writer hears of it) and its records are skipped.

    ``grouped`` (prefix affinity): a block is a window, sent as requests of one shared prefix
    each (:func:`~batchline.driver.affinity.plan_requests`), each routed by its prefix key."""

    def __init__(
        self,
        options: DriveOptions,
        client: ReplicaClient,
        pool: EndpointPool,
        failures: _FailureLog,
        clock: Clock,
        rng: Callable[[], float],
        *,
        grouped: bool = False,
    ) -> None:
        self.options = options
        self.client = client
        self.pool = pool
        self.failures = failures
        self.clock = clock
        self.rng = rng
        self.grouped = grouped
        self.backoff = Backoff(base_s=options.backoff_base_s, cap_s=options.backoff_cap_s)
        self.retries = 0
        self._in_flight = 0
        # every request holds one of --concurrency slots, whatever a block holds; waiters get
        # them in turn, so a window's requests go out before the next window's
        self._slots = asyncio.Semaphore(options.concurrency)
        # The server's answer is a function of the text (embeddings; greedy generation, the
        # route's default, with the job's settings): a repeated text need not be sent again.
        self.seen = Seen[asyncio.Future[Outcome]](DEDUPE_WINDOW) if options.dedupe else None

    @property
    def duplicates(self) -> int:
        """Records answered from an earlier identical text's answer, not sent."""
        return 0 if self.seen is None else self.seen.duplicates

    async def submit(self, records: Sequence[Record]) -> asyncio.Task[list[Outcome]]:
        # what the block asks first is registered now, in submit order: a later block waits on
        # an earlier one, never the other way round; its requests are queued now, in order
        plan = self._dedupe(records)
        try:
            sends = await self._start([records[i] for i in plan.fresh])
        except BaseException:
            for answer in plan.answers.values():
                answer.cancel()  # never sent: later duplicates send their own
            raise
        task = asyncio.create_task(self._answer(records, plan, sends))
        # withdrawn, even before it ran: so are its requests
        task.add_done_callback(lambda _: cancel([t for _, t in sends]))
        return task

    def _dedupe(self, records: Sequence[Record]) -> _Deduped:
        if self.seen is None:  # --no-dedupe: every record is sent
            return _Deduped(fresh=list(range(len(records))))
        loop = asyncio.get_running_loop()
        plan = _Deduped()
        for i, record in enumerate(records):
            key = input_key(record.text)
            if key is None:
                plan.fresh.append(i)
                continue
            first = self.seen.get(key)
            if isinstance(first, asyncio.Future):
                plan.waits[i] = first
                continue
            answer: asyncio.Future[Outcome] = loop.create_future()
            self.seen.put(key, answer)
            plan.fresh.append(i)
            plan.answers[i] = answer
        return plan

    async def _start(self, records: Sequence[Record]) -> list[_Request]:
        """Queue the requests for ``records``, in order: one, or (grouped) one per prefix
        group of the window, each with the indices of its records in ``records``."""
        if not records:
            return []
        if not self.grouped:
            return [(list(range(len(records))), asyncio.create_task(self._send(records)))]
        keys = await asyncio.to_thread(prefix_keys, [r.text for r in records])
        return [
            (p.indices, asyncio.create_task(self._send([records[i] for i in p.indices], p.key)))
            for p in plan_requests(keys, self.pool.home, self.options.chunk_size)
        ]

    async def _answer(
        self, records: Sequence[Record], plan: _Deduped, sends: list[_Request]
    ) -> list[Outcome]:
        """The block's outcomes: its new texts' answers, the others from their first's answer;
        a record whose first failed (or was withdrawn) is sent itself."""
        outcomes: list[Outcome] = [None] * len(records)
        try:
            results = await _gathered(len(plan.fresh), sends)
            for i, outcome in zip(plan.fresh, results, strict=True):
                outcomes[i] = outcome
                answer = plan.answers.get(i)
                if answer is not None and not answer.done():
                    answer.set_result(outcome)
            again: list[int] = []
            for i, first in plan.waits.items():
                await asyncio.wait([first])  # its own cancellation still raises here
                got = None if first.cancelled() else first.result()
                if got is None or isinstance(got, Failed):
                    again.append(i)
                else:
                    outcomes[i] = got
            if again:
                assert self.seen is not None
                self.seen.duplicates -= len(again)  # sent after all
                resends = await self._start([records[i] for i in again])
                resent = await _gathered(len(again), resends)
                for i, outcome in zip(again, resent, strict=True):
                    outcomes[i] = outcome
        finally:
            for answer in plan.answers.values():
                answer.cancel()  # unanswered (this block failed or was withdrawn): theirs to send
        return outcomes

    def utilization(self) -> float:
        """Requests in flight over ``--concurrency``."""
        return self._in_flight / self.options.concurrency

    async def _send(self, records: Sequence[Record], key: bytes | None = None) -> list[Outcome]:
        async with self._slots:
            self._in_flight += 1
            try:
                return await self._attempts(records, key)
            finally:
                self._in_flight -= 1

    async def _attempts(self, records: Sequence[Record], key: bytes | None) -> list[Outcome]:
        opts, pool = self.options, self.pool
        texts = [r.text for r in records]
        task_id = f"{records[0].index}-{records[-1].index}"
        last: Endpoint | None = None
        attempt = 0
        while True:
            ep = await pool.acquire(avoid=last, key=key)
            attempt += 1
            try:
                reply = await self.client.post(ep.url, texts, task_id=task_id)
            except BaseException:
                pool.released(ep)
                raise
            if reply.verdict == "ok":
                pool.succeeded(ep)
                assert reply.results is not None  # an ok reply carries its results
                return list(reply.results)
            if reply.verdict == "abort":
                pool.failed(ep, reply.kind, endpoint_fault=False)
                check = (
                    "the server's configuration"
                    if reply.status is not None and reply.status >= 500
                    else "--endpoint, --route and --api-key"
                )
                raise BatchlineError(
                    f"{ep.url}{self.client.route.path} answered HTTP {reply.status}: "
                    f"{reply.message}; check {check} (the output is resumable with --resume)"
                )
            if reply.verdict == "fail":
                pool.failed(ep, reply.kind, endpoint_fault=False)
                return await self._fail(records, reply, ep, attempt)
            retry_after = reply.retry_after_s
            if retry_after is not None:
                retry_after = min(retry_after, opts.max_retry_after_s)
            pool.failed(
                ep, reply.kind, retry_after_s=retry_after, endpoint_fault=reply.endpoint_fault
            )
            if attempt >= opts.max_attempts:
                return await self._fail(records, reply, ep, attempt)
            self.retries += 1
            last = ep
            await sleep(self.clock, self.backoff.delay(attempt, self.rng))

    async def _fail(
        self, records: Sequence[Record], reply: Reply, ep: Endpoint, attempts: int
    ) -> list[Outcome]:
        if reply.verdict == "fail":
            reason = f"HTTP {reply.status}: {reply.message}"
        else:
            what = f"HTTP {reply.status}" if reply.status is not None else reply.kind
            reason = f"gave up after {attempts} attempts; last: {what}: {reply.message}"
        entries: list[dict[str, object]] = [
            {
                "index": r.index,
                "id": r.id,
                "status": reply.status,
                "error": reply.kind,
                "message": reply.message,
                "attempts": attempts,
                "endpoint": ep.url,
            }
            for r in records
        ]
        await asyncio.to_thread(self.failures.add, entries)
        failed = Failed(f"request failed: {reason}", record_fault=False)
        return [failed] * len(records)
