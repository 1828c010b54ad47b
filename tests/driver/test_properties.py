"""Property: whatever the replicas answer and wherever the driver crashes, after a resume every
record is exactly once either in the output (with its own vector) or in the failures file."""

from __future__ import annotations

import asyncio
import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.datasets.sinks import ChunkWriter, read_output, read_skipped
from batchline.driver.drive import DriveOptions, drive_job, read_failures
from tests.driver.fake import FakeReplica, fake_vectors

ACTIONS = st.one_of(
    st.sampled_from(["count", "index", "dim", "nan"]),
    st.tuples(st.sampled_from([400, 413, 422, 429, 500, 502, 503, 504]), st.just("0")),
)


class Crash(Exception):
    pass


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n=st.integers(1, 120),
    chunk_size=st.integers(1, 25),
    output_chunk_size=st.integers(1, 50),
    concurrency=st.integers(1, 6),
    scripts=st.lists(st.lists(ACTIONS, max_size=12), min_size=1, max_size=3),
    crash_at=st.one_of(st.none(), st.integers(1, 10)),
)
def test_every_record_is_written_or_failed_exactly_once(
    n: int,
    chunk_size: int,
    output_chunk_size: int,
    concurrency: int,
    scripts: list[list[Any]],
    crash_at: int | None,
) -> None:
    items = [f"text {i} " + "x" * (i % 5) for i in range(n)]
    replicas = {f"r{k}": FakeReplica(script=list(s)) for k, s in enumerate(scripts)}

    async def handler(request: httpx.Request) -> httpx.Response:
        return await replicas[request.url.host].handler(request)

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "in.jsonl"
        src.write_text("".join(json.dumps({"text": t}) + "\n" for t in items))
        out = Path(tmp) / "out"

        def opts(resume: bool) -> DriveOptions:
            return DriveOptions(
                input=src,
                output=out,
                endpoints=[f"http://{name}" for name in replicas],
                chunk_size=chunk_size,
                output_chunk_size=output_chunk_size,
                concurrency=concurrency,
                max_attempts=3,
                failures_to_set_aside=1000,
                backoff_base_s=0.0,
                backoff_cap_s=0.0,
                # without it, a short vector in the very first answer would set the length
                dim=8,
                resume=resume,
            )

        def run(resume: bool) -> Any:
            transport = httpx.MockTransport(handler)
            return asyncio.run(drive_job(opts(resume), transport=transport))

        if crash_at is not None:
            real = ChunkWriter.write_batch
            calls = {"n": 0}

            def crashing(self: ChunkWriter, records: Any, results: Any) -> None:
                calls["n"] += 1
                if calls["n"] == crash_at:
                    raise Crash
                real(self, records, results)

            # (the crash may come after the last write: then the first run simply finishes)
            with (
                mock.patch.object(ChunkWriter, "write_batch", crashing),
                contextlib.suppress(Crash),
            ):
                run(resume=False)
        summary = run(resume=crash_at is not None)

        table = read_output(out)
        written = table.column("index").to_pylist()
        failed = [f["index"] for f in read_failures(out)]
        assert len(written) == len(set(written))
        assert len(failed) == len(set(failed))
        assert sorted(written + failed) == list(range(n))
        assert [s["index"] for s in read_skipped(out)] == sorted(failed)
        assert summary.failed_total == len(failed)
        assert summary.exit_code == (1 if failed else 0)
        if written:
            vectors = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding")])
            np.testing.assert_array_equal(vectors, fake_vectors([items[i] for i in written]))
