"""drive_job in process, against fake replicas behind httpx.MockTransport (no sockets)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from batchline._errors import BatchlineError, InputError
from batchline.datasets.sinks import ChunkWriter, Manifest, read_output, read_skipped
from batchline.driver.drive import (
    FAILURES_NAME,
    DriveOptions,
    _FailureLog,
    drive_job,
    normalize_endpoint,
    read_failures,
)
from tests.driver.fake import FakeReplica, fake_vectors

pytestmark = pytest.mark.anyio

A, B = "http://a:8000", "http://b:8000"


def texts(n: int) -> list[str]:
    return [f"record number {i} says {'hello ' * (i % 7)}" for i in range(n)]


def write_jsonl(path: Path, items: list[str], *, bad_lines: tuple[int, ...] = ()) -> Path:
    lines = []
    for i, t in enumerate(items):
        lines.append("{not json" if i in bad_lines else json.dumps({"id": f"r{i}", "text": t}))
    path.write_text("\n".join(lines) + "\n")
    return path


class Replicas:
    """Fake replicas by URL, behind one MockTransport; counts requests in flight."""

    def __init__(self, **replicas: FakeReplica) -> None:
        self.by_host = {f"{name}": r for name, r in replicas.items()}
        self.in_flight = 0
        self.max_in_flight = 0
        self.down: set[str] = set()

    async def handler(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.down:
            raise httpx.ConnectError("connection refused")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self.by_host[host].handler(request)
        finally:
            self.in_flight -= 1

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)


def options(src: Path, out: Path, **kwargs: Any) -> DriveOptions:
    base: dict[str, Any] = {
        "input": src,
        "output": out,
        "endpoints": [A, B],
        "chunk_size": 10,
        "output_chunk_size": 40,
        "concurrency": 4,
        "backoff_base_s": 0.001,
        "backoff_cap_s": 0.01,
    }
    base.update(kwargs)
    return DriveOptions(**base)


def output_vectors(out: Path) -> tuple[list[str], list[int], np.ndarray]:
    table = read_output(out)
    ids = table.column("id").to_pylist()
    indices = table.column("index").to_pylist()
    vectors = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding")])
    return ids, indices, vectors


async def test_every_record_once_in_order_from_two_replicas(tmp_path: Path) -> None:
    items = texts(237)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    # 20 ms per request: long enough that the 4th request starts before the 1st ends even on
    # a loaded machine (at 2 ms the cap was sometimes never reached: a race, not the driver)
    replicas = Replicas(a=FakeReplica(delay_s=0.02), b=FakeReplica(delay_s=0.02))
    summary = await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    assert summary.records == 237
    assert summary.total_records == 237
    assert (summary.failed, summary.failed_total, summary.exit_code) == (0, 0, 0)
    assert summary.requests == 24  # ceil(237 / 10), no retries
    ids, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(237))
    assert ids == [f"r{i}" for i in range(237)]
    np.testing.assert_array_equal(vectors, fake_vectors(items))
    per_endpoint = {r.url: r.requests for r in summary.endpoints}
    assert per_endpoint[A] > 0
    assert per_endpoint[B] > 0
    assert sum(per_endpoint.values()) == 24
    assert replicas.max_in_flight == 4  # the cap was reached and never passed
    manifest = Manifest.load(tmp_path / "out")
    assert manifest.complete
    assert manifest.settings["route"] == "embeddings"
    assert manifest.settings["chunk_size"] == 40
    assert str(manifest.settings["input_fingerprint"]).startswith(f"{src.stat().st_size}:")


async def test_the_concurrency_cap_spans_all_endpoints(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(200))
    replicas = Replicas(a=FakeReplica(delay_s=0.005), b=FakeReplica(delay_s=0.005))
    opts = options(src, tmp_path / "out", chunk_size=5, concurrency=3)
    await drive_job(opts, transport=replicas.transport)
    assert replicas.max_in_flight == 3


async def test_a_slow_replica_gets_fewer_chunks(tmp_path: Path) -> None:
    """A answers nothing until B has answered 24 of the 30 chunks: meanwhile the least-loaded
    pick sends every freed slot to B, so A gets the 2 chunks it was given at the start and at
    most the last 4. (Replicas slow by a delay let a loaded machine decide: with A at 50 ms and
    B at 2 ms, a run beside the rest of the suite split 10 / 20.)"""
    src = write_jsonl(tmp_path / "in.jsonl", texts(300))
    fast = FakeReplica()

    async def until_fast_answered_24() -> None:
        for _ in range(20_000):  # bounded: at worst the split below says what happened
            if sum(hit.status == 200 for hit in fast.hits) >= 24:
                return
            await asyncio.sleep(0.001)

    replicas = Replicas(a=FakeReplica(gate=until_fast_answered_24), b=fast)
    summary = await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    per = {r.url: r.requests for r in summary.endpoints}
    assert per[A] + per[B] == 30
    assert per[A] <= 6 < 24 <= per[B], per


async def test_retryable_errors_are_retried_and_nothing_is_lost(tmp_path: Path) -> None:
    items = texts(120)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    flaky = FakeReplica(
        script=[(500, None), (503, "0"), (429, "0"), (502, None), (504, None), (408, None)]
    )
    replicas = Replicas(a=flaky, b=FakeReplica())
    summary = await drive_job(
        options(src, tmp_path / "out", endpoints=[A]), transport=replicas.transport
    )
    assert summary.records == 120
    assert summary.retries == 6
    assert summary.requests == 12 + 6
    (report,) = summary.endpoints
    assert report.errors == {"http_429": 1, "http_4xx": 1, "http_503": 1, "http_5xx": 3}
    _, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(120))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


@pytest.mark.parametrize("corruption", ["count", "index", "dim", "nan"])
async def test_a_wrong_answer_is_retried_and_never_written(tmp_path: Path, corruption: str) -> None:
    items = texts(60)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(script=[corruption, corruption]), b=FakeReplica())
    summary = await drive_job(
        options(src, tmp_path / "out", endpoints=[A]), transport=replicas.transport
    )
    assert summary.retries == 2
    assert summary.endpoints[0].errors == {"invalid_response": 2}
    _, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(60))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


async def test_dim_catches_a_wrong_length_even_in_the_first_answer(tmp_path: Path) -> None:
    items = texts(3)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(script=["dim"]), b=FakeReplica())
    summary = await drive_job(
        options(src, tmp_path / "out", endpoints=[A], chunk_size=1, dim=8),
        transport=replicas.transport,
    )
    assert summary.endpoints[0].errors == {"invalid_response": 1}
    np.testing.assert_array_equal(output_vectors(tmp_path / "out")[2], fake_vectors(items))
    with pytest.raises(InputError, match=r"--dim 16, but .* holds vectors of 8 values"):
        await drive_job(
            options(src, tmp_path / "out", endpoints=[A], resume=True, dim=16),
            transport=replicas.transport,
        )


async def test_a_4xx_chunk_goes_to_the_failures_file_unretried_with_exit_code_1(
    tmp_path: Path,
) -> None:
    items = texts(100)
    items[23] = "this one is POISON for the server"
    src = write_jsonl(tmp_path / "in.jsonl", items)
    a = FakeReplica(poison="POISON")
    b = FakeReplica(poison="POISON")
    replicas = Replicas(a=a, b=b)
    summary = await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    assert (summary.records, summary.failed, summary.failed_total) == (90, 10, 10)
    assert summary.exit_code == 1
    assert summary.retries == 0
    poisoned = [h for h in a.hits + b.hits if h.status == 400]
    assert len(poisoned) == 1  # sent once, not retried
    failures = read_failures(tmp_path / "out")
    assert [f["index"] for f in failures] == list(range(20, 30))
    assert failures[0]["id"] == "r20"
    assert failures[0]["status"] == 400
    assert failures[0]["message"] == "input contains 'POISON'"
    skipped = read_skipped(tmp_path / "out")
    assert [s["index"] for s in skipped] == list(range(20, 30))
    assert "HTTP 400" in str(skipped[0]["reason"])
    _, indices, _ = output_vectors(tmp_path / "out")
    assert indices == [i for i in range(100) if not 20 <= i < 30]
    assert Manifest.load(tmp_path / "out").complete


async def test_a_chunk_that_uses_up_its_attempts_fails_and_the_job_finishes(
    tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(30))
    broken = FakeReplica(script=[(500, None)] * 3)
    replicas = Replicas(a=broken, b=FakeReplica())
    opts = options(
        src, tmp_path / "out", endpoints=[A], concurrency=1, max_attempts=3, failures_to_set_aside=9
    )
    summary = await drive_job(opts, transport=replicas.transport)
    assert (summary.records, summary.failed, summary.exit_code) == (20, 10, 1)
    failures = read_failures(tmp_path / "out")
    assert [f["index"] for f in failures] == list(range(10))
    assert failures[0]["attempts"] == 3
    assert failures[0]["status"] == 500
    assert failures[0]["error"] == "http_5xx"
    assert "gave up after 3 attempts" in str(read_skipped(tmp_path / "out")[0]["reason"])


async def test_a_dead_replica_is_set_aside_and_the_other_does_the_work(tmp_path: Path) -> None:
    items = texts(200)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    replicas.down.add("a")
    summary = await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    assert summary.records == 200
    a, _ = summary.endpoints
    assert a.times_set_aside == 1
    assert a.successes == 0
    assert a.errors == {"connect": a.requests}
    assert a.requests <= 3 + 4  # set aside after 3 in a row (plus what was already in flight)
    _, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(200))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


async def test_with_every_replica_down_the_job_waits_then_gives_up_resumably(
    tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(50))
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    replicas.down.update({"a", "b"})
    opts = options(src, tmp_path / "out", give_up_after_s=0.3, failures_to_set_aside=1)
    with pytest.raises(BatchlineError, match=r"no endpoint has been ready for 0\.3 s"):
        await drive_job(opts, transport=replicas.transport)
    assert not (tmp_path / "out").exists()  # nothing committed: nothing left behind
    replicas.down.clear()
    opts.resume = True
    summary = await drive_job(opts, transport=replicas.transport)
    assert summary.records == 50


async def test_a_wrong_key_or_url_stops_the_job_instead_of_failing_every_record(
    tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(100))
    replicas = Replicas(a=FakeReplica(script=[(401, None)]), b=FakeReplica())
    opts = options(src, tmp_path / "out", endpoints=[A], concurrency=1)
    with pytest.raises(BatchlineError, match=r"answered HTTP 401.*--api-key"):
        await drive_job(opts, transport=replicas.transport)
    assert read_failures(tmp_path / "out") == []
    opts.resume = True
    summary = await drive_job(opts, transport=replicas.transport)
    assert summary.records == 100
    assert summary.exit_code == 0


async def test_a_model_that_never_fits_the_servers_budget_stops_the_job_at_once(
    tmp_path: Path,
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(100))
    replicas = Replicas(a=FakeReplica(script=[(507, None)] * 100))
    opts = options(src, tmp_path / "out", endpoints=[A], concurrency=1)
    with pytest.raises(BatchlineError, match=r"answered HTTP 507.*server's configuration"):
        await drive_job(opts, transport=replicas.transport)
    assert (
        len(replicas.by_host["a"].script) == 99
    )  # asked once, never retried: no retry makes it fit
    assert read_failures(tmp_path / "out") == []


async def test_resume_after_a_crash_gives_every_record_exactly_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    items = texts(230)
    items[57] = "POISON"
    items[201] = "POISON again"
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    real_write = ChunkWriter.write_batch
    writes = {"n": 0}

    def crashing(self: ChunkWriter, records: Any, results: Any) -> None:
        writes["n"] += 1
        if writes["n"] == 12:
            raise OSError("disk on fire")
        real_write(self, records, results)

    monkeypatch.setattr(ChunkWriter, "write_batch", crashing)
    replicas = Replicas(a=FakeReplica(poison="POISON"), b=FakeReplica(poison="POISON"))
    with pytest.raises(OSError, match="disk on fire"):
        await drive_job(options(src, out), transport=replicas.transport)
    monkeypatch.setattr(ChunkWriter, "write_batch", real_write)
    first = Manifest.load(out)
    assert 0 < len(first.chunks) < 6

    summary = await drive_job(options(src, out, resume=True), transport=replicas.transport)
    assert summary.already_done == 40 * len(first.chunks)
    assert summary.records + summary.failed == 230 - summary.already_done
    assert summary.failed_total == 20
    _, indices, vectors = output_vectors(out)
    failed = set(range(50, 60)) | set(range(200, 210))
    assert indices == [i for i in range(230) if i not in failed]
    np.testing.assert_array_equal(vectors, fake_vectors([items[i] for i in indices]))
    assert [f["index"] for f in read_failures(out)] == sorted(failed)  # each once
    assert [s["index"] for s in read_skipped(out)] == sorted(failed)

    again = await drive_job(options(src, out, resume=True), transport=replicas.transport)
    assert (again.records, again.already_done, again.exit_code) == (0, 230, 1)


def test_the_failures_file_keeps_only_committed_chunks(tmp_path: Path) -> None:
    path = tmp_path / FAILURES_NAME
    lines = [json.dumps({"index": i, "id": str(i)}) for i in (3, 12, 25, 31)]
    path.write_text("\n".join(lines) + "\n" + '{"index": 40, "id"')  # torn by a crash
    log = _FailureLog(path, committed=lambda i: i // 10 in {0, 2})
    assert [json.loads(x)["index"] for x in path.read_text().splitlines()] == [3, 25]
    assert log.total == 2
    log.add([{"index": 45, "id": "45"}])
    assert log.total == 3
    assert path.read_text().endswith('{"index": 45, "id": "45"}\n')


async def test_bad_input_can_be_skipped_and_is_not_a_failure(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(50), bad_lines=(4, 33))
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    with pytest.raises(InputError, match="line 5: malformed JSON"):
        await drive_job(options(src, tmp_path / "out1"), transport=replicas.transport)
    summary = await drive_job(
        options(src, tmp_path / "out2", on_bad_record="skip"), transport=replicas.transport
    )
    assert (summary.records, summary.skipped, summary.exit_code) == (48, 2, 0)
    assert [s["index"] for s in read_skipped(tmp_path / "out2")] == [4, 33]
    assert read_failures(tmp_path / "out2") == []


async def test_the_generate_route_and_a_limit(tmp_path: Path) -> None:
    items = texts(45)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    summary = await drive_job(
        options(src, tmp_path / "out", route="generate", limit=33), transport=replicas.transport
    )
    assert (summary.records, summary.total_records) == (33, 33)
    table = read_output(tmp_path / "out")
    assert table.column("index").to_pylist() == list(range(33))
    np.testing.assert_allclose(
        np.array(table.column("text").to_pylist()), fake_vectors(items[:33]), rtol=1e-6
    )
    assert Manifest.load(tmp_path / "out").settings["route"] == "generate"


async def test_the_generate_route_reads_the_prompt_column_as_run_does(tmp_path: Path) -> None:
    items = texts(6)
    src = tmp_path / "prompts.jsonl"
    src.write_text(
        "".join(json.dumps({"id": f"r{i}", "prompt": t}) + "\n" for i, t in enumerate(items))
    )
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    summary = await drive_job(
        options(src, tmp_path / "out", route="generate"), transport=replicas.transport
    )
    assert summary.records == 6
    table = read_output(tmp_path / "out")
    np.testing.assert_allclose(
        np.array(table.column("text").to_pylist()), fake_vectors(items), rtol=1e-6
    )
    assert Manifest.load(tmp_path / "out").settings["text_column"] == "prompt"
    # neither a prompt nor a text column: the error names the columns and the flag
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(InputError, match=r"no prompt column 'text'.*'question'.*--text-column"):
        await drive_job(
            options(other, tmp_path / "out2", route="generate"), transport=replicas.transport
        )


async def test_resuming_with_another_route_is_refused(tmp_path: Path) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(5))
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    with pytest.raises(InputError, match="route was 'embeddings', now 'generate'"):
        await drive_job(
            options(src, tmp_path / "out", route="generate", resume=True),
            transport=replicas.transport,
        )


async def test_overwrite_starts_a_fresh_failures_file(tmp_path: Path) -> None:
    items = texts(20)
    items[3] = "POISON"
    src = write_jsonl(tmp_path / "in.jsonl", items)
    poisoned = Replicas(a=FakeReplica(poison="POISON"), b=FakeReplica(poison="POISON"))
    first = await drive_job(options(src, tmp_path / "out"), transport=poisoned.transport)
    assert first.exit_code == 1
    healthy = Replicas(a=FakeReplica(), b=FakeReplica())
    again = await drive_job(
        options(src, tmp_path / "out", overwrite=True), transport=healthy.transport
    )
    assert (again.records, again.exit_code) == (20, 0)
    assert read_failures(tmp_path / "out") == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"endpoints": []}, "at least one --endpoint"),
        ({"endpoints": ["ftp://x"]}, "not an http"),
        ({"endpoints": ["http://x?a=1"]}, "without"),
        ({"endpoints": [A, A + "/"]}, "repeats"),
        ({"chunk_size": 0}, "--records-per-request must be >= 1"),
        ({"concurrency": 0}, "--concurrency must be >= 1"),
        ({"max_attempts": 0}, "--max-attempts must be >= 1"),
        ({"read_timeout_s": 0.0}, "--read-timeout-s must be"),
        ({"connect_timeout_s": float("nan")}, "--connect-timeout-s must be"),
        ({"give_up_after_s": -1.0}, "--give-up-after-s must be"),
        ({"limit": -1}, "--limit must be"),
        ({"dim": 0}, "--dim must be >= 1"),
        ({"probe_cap_s": 0.1}, "probe_cap_s must be >= 0.25"),
        ({"route": "chat"}, "--route must be"),
    ],
)
async def test_bad_settings_are_input_errors(
    tmp_path: Path, kwargs: dict[str, Any], message: str
) -> None:
    src = write_jsonl(tmp_path / "in.jsonl", texts(3))
    with pytest.raises(InputError, match=message):
        await drive_job(options(src, tmp_path / "out", **kwargs))
    assert not (tmp_path / "out").exists()


def test_endpoint_urls_are_normalised() -> None:
    assert normalize_endpoint(" http://h:1/ ") == "http://h:1"
    assert normalize_endpoint("http://h:1/v1/embeddings") == "http://h:1"
    assert normalize_endpoint("https://h/prefix/generate") == "https://h/prefix"


async def test_cancelling_the_job_leaves_a_resumable_output(tmp_path: Path) -> None:
    items = texts(400)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(delay_s=0.01), b=FakeReplica(delay_s=0.01))
    out = tmp_path / "out"
    task = asyncio.ensure_future(drive_job(options(src, out), transport=replicas.transport))
    for _ in range(500):
        await asyncio.sleep(0.01)
        if (out / "_manifest.json").exists() and Manifest.load(out).chunks:
            break
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    summary = await drive_job(options(src, out, resume=True), transport=replicas.transport)
    assert summary.already_done > 0
    _, indices, vectors = output_vectors(out)
    assert indices == list(range(400))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


async def test_empty_texts_are_counted_and_with_skip_listed_not_sent(tmp_path: Path) -> None:
    items = texts(30)
    items[3] = ""
    items[17] = "  "
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    opts = options(src, tmp_path / "out", on_bad_record="skip")
    summary = await drive_job(opts, transport=replicas.transport)
    assert (summary.records, summary.skipped, summary.empty_texts) == (28, 2, 2)
    assert ("empty texts", "2") in summary.rows()
    assert [s["index"] for s in read_skipped(tmp_path / "out")] == [3, 17]
    assert "empty text" in str(read_skipped(tmp_path / "out")[0]["reason"])


async def test_an_empty_input_is_an_error_unless_allowed(tmp_path: Path) -> None:
    src = tmp_path / "in.jsonl"
    src.write_text("")
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    with pytest.raises(InputError, match="--allow-empty"):
        await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    assert not (tmp_path / "out").exists()
    opts = options(src, tmp_path / "out", allow_empty=True)
    summary = await drive_job(opts, transport=replicas.transport)
    assert summary.total_records == 0
    assert Manifest.load(tmp_path / "out").complete
