"""End to end with real processes on 127.0.0.1: fake servers that answer 429, real
``batchline serve`` replicas killed with ``kill -9`` and restarted, a ``batchline drive``
process killed with ``kill -9`` and resumed.

Assertions are on counts, order and contents, never on how long something took, except for
the floor a ``Retry-After`` sets.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from batchline.__main__ import main
from batchline.datasets.sinks import Manifest, read_output, read_skipped
from batchline.driver.drive import DriveOptions, drive_job, read_failures
from tests.driver.fake import fake_vectors
from tests.driver.procs import Proc, Procs, child_env, fake_log, processes

pytestmark = [pytest.mark.slow, pytest.mark.serial, pytest.mark.timeout(300)]

API_KEY = "driver-test-key"


def corpus(n: int) -> list[str]:
    topics = ["batching", "the sea", "Ünïcödé", "queues", "a lazy dog", "résumé", "🙂 emoji"]
    return [f"Sentence {i} is about {topics[i % len(topics)]}." for i in range(n)]


def write_jsonl(path: Path, texts: list[str]) -> Path:
    path.write_text(
        "".join(json.dumps({"id": f"d{i}", "text": t}) + "\n" for i, t in enumerate(texts))
    )
    return path


def vectors_of(out: Path, column: str = "embedding") -> tuple[list[int], np.ndarray]:
    table = read_output(out)
    indices = table.column("index").to_pylist()
    vectors = np.stack([np.asarray(v, dtype=np.float32) for v in table.column(column)])
    return indices, vectors


@pytest.fixture
def procs(tmp_path: Path) -> Iterator[Procs]:
    with processes(tmp_path) as p:
        yield p


class Counter:
    """A progress hook that counts records done."""

    def __init__(self) -> None:
        self.done = 0

    def start(self, total: int | None, already_done: int) -> None:
        pass

    def advance(self, records: int, *, failed: int = 0, utilization: float = 0.0) -> None:
        self.done += records


# -- Retry-After, against fake servers -------------------------------------------------------


@pytest.mark.anyio
async def test_retry_after_is_a_floor_for_the_next_attempt(tmp_path: Path, procs: Procs) -> None:
    server = procs.fake("--script", "429:1,429:1,429:1")
    server.wait_ready()
    items = corpus(30)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    summary = await drive_job(
        DriveOptions(
            input=src,
            output=tmp_path / "out",
            endpoints=[server.url],
            chunk_size=10,
            concurrency=1,
            backoff_base_s=0.01,
        )
    )
    hits = fake_log(server)
    assert [h["status"] for h in hits] == [429, 429, 429, 200, 200, 200]
    for before, after in itertools.pairwise(hits):
        if before["status"] == 429:
            # the next attempt left the driver no sooner than Retry-After: 1 allowed
            assert after["t"] - before["done"] >= 0.99
    assert (summary.records, summary.retries, summary.exit_code) == (30, 3, 0)
    np.testing.assert_array_equal(vectors_of(tmp_path / "out")[1], fake_vectors(items))


@pytest.mark.anyio
async def test_a_throttling_replica_is_left_alone_while_the_other_works(
    tmp_path: Path, procs: Procs
) -> None:
    throttled = procs.fake("--script", "429:1,429:1,429:1", "--delay-s", "0.1")
    healthy = procs.fake("--delay-s", "0.1")
    throttled.wait_ready()
    healthy.wait_ready()
    items = corpus(600)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    summary = await drive_job(
        DriveOptions(
            input=src,
            output=tmp_path / "out",
            endpoints=[throttled.url, healthy.url],
            chunk_size=5,
            concurrency=4,
        )
    )
    assert (summary.records, summary.exit_code) == (600, 0)
    hits = fake_log(throttled)
    statuses = [h["status"] for h in hits]
    refusals = [h["done"] for h in hits if h["status"] == 429]
    assert len(refusals) == 3
    assert statuses[-1] == 200  # it was used again once it stopped refusing
    for h in hits:
        for refused_at in refusals:
            # requests already on their way when the 429 left may arrive just after it;
            # anything sent after the driver read it waits out the second
            assert not refused_at + 0.2 < h["t"] < refused_at + 0.99, (h, refused_at)
    assert summary.endpoints[0].times_set_aside == 0  # busy is not broken
    indices, vectors = vectors_of(tmp_path / "out")
    assert indices == list(range(600))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


@pytest.mark.anyio
async def test_a_hung_request_times_out_and_is_retried(tmp_path: Path, procs: Procs) -> None:
    server = procs.fake("--script", "hang")
    server.wait_ready()
    items = corpus(20)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    summary = await drive_job(
        DriveOptions(
            input=src,
            output=tmp_path / "out",
            endpoints=[server.url],
            chunk_size=10,
            concurrency=1,
            read_timeout_s=0.5,
            backoff_base_s=0.01,
        )
    )
    assert (summary.records, summary.retries) == (20, 1)
    assert summary.endpoints[0].errors == {"timeout": 1}
    np.testing.assert_array_equal(vectors_of(tmp_path / "out")[1], fake_vectors(items))


# -- real replicas ---------------------------------------------------------------------------

N_RECORDS = 1500


@pytest.fixture(scope="module")
def shared_input(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("driver-input") / "in.jsonl", corpus(N_RECORDS))


@pytest.fixture(scope="module")
def reference(shared_input: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """The same input embedded in process by ``batchline run``."""
    pytest.importorskip("onnxruntime")
    from batchline.jobs.run import RunOptions, run

    out = tmp_path_factory.mktemp("driver-reference") / "out"
    run(RunOptions(input=shared_input, output=out))
    indices, vectors = vectors_of(out)
    assert indices == list(range(N_RECORDS))
    return vectors


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    """One real replica that wants an API key, shared by the tests below."""
    pytest.importorskip("onnxruntime")
    with processes(tmp_path_factory.mktemp("keyed-server")) as p:
        server = p.serve("--api-key", API_KEY, name="keyed")
        server.wait_ready()
        yield server


@pytest.mark.anyio
async def test_a_replica_killed_and_restarted_mid_run_loses_and_duplicates_nothing(
    tmp_path: Path, procs: Procs, shared_input: Path, reference: np.ndarray
) -> None:
    a, b = procs.serve(name="a"), procs.serve(name="b")
    a.wait_ready()
    b.wait_ready()
    counter = Counter()
    job = asyncio.ensure_future(
        drive_job(
            DriveOptions(
                input=shared_input,
                output=tmp_path / "out",
                endpoints=[a.url, b.url],
                chunk_size=10,
                concurrency=2,
                output_chunk_size=200,
                probe_cap_s=0.5,
            ),
            counter,
        )
    )
    for _ in range(3000):  # bounded: 300 s at most
        if counter.done >= 200 or job.done():
            break
        await asyncio.sleep(0.1)
    assert not job.done(), "the job finished before the replica could be killed"
    a.kill()  # kill -9, chunks in flight to it included
    procs.serve(port=a.port, name="a-again")  # restarted on the same port
    summary = await asyncio.wait_for(job, timeout=240)
    print(*summary.endpoints, sep="\n")
    assert (summary.records, summary.failed, summary.exit_code) == (N_RECORDS, 0, 0)
    ra, rb = summary.endpoints
    assert ra.times_set_aside >= 1
    assert set(ra.errors) <= {"connect", "network", "timeout", "http_503"}
    assert rb.successes > 0
    # (rejoining after a re-probe is tested on an injected clock in test_endpoints.py)
    indices, vectors = vectors_of(tmp_path / "out")
    assert indices == list(range(N_RECORDS))  # every record, once, in order
    np.testing.assert_allclose(vectors, reference, atol=1e-5)
    ids = read_output(tmp_path / "out").column("id").to_pylist()
    assert ids == [f"d{i}" for i in range(N_RECORDS)]


def test_a_killed_driver_resumes_without_duplicates_or_gaps(
    tmp_path: Path, procs: Procs, keyed_server: Proc, shared_input: Path, reference: np.ndarray
) -> None:
    out = tmp_path / "out"
    common = [
        str(shared_input),
        "--endpoint",
        keyed_server.url,
        "-o",
        str(out),
        "--api-key",
        API_KEY,
        "--records-per-request",
        "20",
        "--concurrency",
        "4",
        "--output-chunk-size",
        "100",
        "--quiet",
    ]
    first = procs.drive(*common, name="drive-1")
    for _ in range(3000):  # bounded: 300 s at most
        if not first.alive():
            break
        try:
            if len(Manifest.load(out).chunks) >= 2:
                break
        except Exception:
            pass  # not written yet, or being replaced
        time.sleep(0.1)
    assert first.alive(), first.output()
    first.kill()
    before = Manifest.load(out)
    assert not before.complete
    assert 2 <= len(before.chunks) < N_RECORDS // 100

    second = procs.drive(*common, "--resume", name="drive-2")
    assert second.wait(240) == 0, second.output()
    after = Manifest.load(out)
    assert after.complete
    assert all(after.chunks[k] == before.chunks[k] for k in before.chunks)  # kept as they were
    indices, vectors = vectors_of(out)
    assert indices == list(range(N_RECORDS))
    np.testing.assert_allclose(vectors, reference, atol=1e-5)
    assert read_failures(out) == []
    assert not list(out.glob("*.tmp"))


@pytest.mark.anyio
async def test_a_4xx_chunk_is_a_failure_not_a_retry(tmp_path: Path, keyed_server: Proc) -> None:
    items = corpus(60)
    items[17] = ""  # the server refuses empty texts: 400
    src = write_jsonl(tmp_path / "in.jsonl", items)
    summary = await drive_job(
        DriveOptions(
            input=src,
            output=tmp_path / "out",
            endpoints=[keyed_server.url],
            api_key=API_KEY,
            chunk_size=10,
        )
    )
    assert (summary.records, summary.failed, summary.retries) == (50, 10, 0)
    assert summary.exit_code == 1
    (report,) = summary.endpoints
    assert report.requests == 6
    assert report.errors == {"client_error": 1}
    failures = read_failures(tmp_path / "out")
    assert [f["index"] for f in failures] == list(range(10, 20))
    assert {f["status"] for f in failures} == {400}
    assert "empty" in str(failures[0]["message"])
    assert [s["index"] for s in read_skipped(tmp_path / "out")] == list(range(10, 20))


def test_the_cli_exit_codes(
    tmp_path: Path, keyed_server: Proc, capsys: pytest.CaptureFixture[str]
) -> None:
    items = corpus(30)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    base = [
        "drive",
        str(src),
        "--endpoint",
        keyed_server.url,
        "--records-per-request",
        "10",
        "--quiet",
    ]
    assert main([*base, "-o", str(tmp_path / "ok"), "--api-key", API_KEY]) == 0
    assert capsys.readouterr().out == ""  # --quiet: nothing on success

    items[5] = ""
    bad = write_jsonl(tmp_path / "bad.jsonl", items)
    code = main(
        [*base[:1], str(bad), *base[2:], "-o", str(tmp_path / "failed"), "--api-key", API_KEY]
    )
    assert code == 1
    assert "10 record(s) failed" in capsys.readouterr().err

    assert main([*base, "-o", str(tmp_path / "nokey"), "--api-key", "wrong"]) == 2
    err = capsys.readouterr().err
    assert "HTTP 401" in err
    assert "--api-key" in err

    assert main([*base, "-o", str(tmp_path / "x"), "--records-per-request", "0"]) == 2
    assert "--records-per-request must be >= 1" in capsys.readouterr().err
    assert main([*base[:2], "--endpoint", "localhost:8000", "--quiet"]) == 2
    assert "not an http(s) URL" in capsys.readouterr().err


@pytest.mark.anyio
async def test_the_generate_route_of_an_embedding_only_replica_is_a_clear_4xx(
    tmp_path: Path, keyed_server: Proc, shared_input: Path
) -> None:
    """``/generate`` generates text: a replica serving only an embedder answers 400 naming its
    models' tasks, and the driver lists each record in the failures file instead of retrying.
    (Generation through real replicas: ``tests/driver/test_generate_flow.py``.)"""
    summary = await drive_job(
        DriveOptions(
            input=shared_input,
            output=tmp_path / "out",
            endpoints=[keyed_server.url + "/generate"],  # a route path in the URL is dropped
            api_key=API_KEY,
            route="generate",
            limit=40,
            chunk_size=16,
        )
    )
    assert (summary.records, summary.exit_code) == (0, 1)
    failures = read_failures(tmp_path / "out")
    assert [f["index"] for f in failures] == list(range(40))
    assert {f["status"] for f in failures} == {400}
    assert all("embed" in str(f["message"]) for f in failures)


@pytest.mark.parametrize("sigint_ignored", [False, True])
def test_kill_stops_a_drive_as_ctrl_c_does_and_says_how_to_go_on(
    tmp_path: Path, procs: Procs, sigint_ignored: bool
) -> None:
    """SIGTERM, also to a drive a script started with ``&`` (SIGINT ignored): what is done is
    kept, one line says how much and the command that goes on, and that command finishes the
    output with every record once."""
    server = procs.fake("--delay-s", "0.05")
    server.wait_ready()
    items = corpus(3000)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    out = tmp_path / "out"
    argv = ["drive", str(src), "--endpoint", server.url, "-o", str(out), "--quiet"]
    argv += ["--records-per-request", "10", "--concurrency", "2", "--output-chunk-size", "100"]
    sigint = signal.SIG_IGN if sigint_ignored else signal.SIG_DFL
    driver = subprocess.Popen(
        [sys.executable, "-m", "batchline", *argv],
        cwd=tmp_path,
        env=child_env(),
        preexec_fn=lambda: signal.signal(signal.SIGINT, sigint),
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for _ in range(3000):  # bounded: 300 s at most
            if driver.poll() is not None:
                break
            try:
                if Manifest.load(out).chunks:
                    break
            except Exception:
                pass  # not written yet, or being replaced
            time.sleep(0.1)
        assert driver.poll() is None, driver.stderr.read() if driver.stderr else ""
        driver.send_signal(signal.SIGTERM)
        _, err = driver.communicate(timeout=60)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(30)
    assert driver.returncode == 143, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    kept = Manifest.load(out).records_kept
    assert 100 <= kept < 3000
    message, _, command = lines[0].partition("; to go on, run: ")
    assert message == f"batchline drive: interrupted (SIGTERM): {kept:,} record(s) kept in {out}"
    resume = shlex.split(command)
    assert resume[-len(argv) - 1 :] == [*argv, "--resume"]
    assert main(resume[-len(argv) - 1 :]) == 0
    indices, vectors = vectors_of(out)
    assert indices == list(range(3000))
    np.testing.assert_array_equal(vectors, fake_vectors(items))
