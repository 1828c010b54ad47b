"""``drive`` sends a repeated text once: a record whose text repeats one of the last distinct
texts takes that text's answer (the same vector bit for bit), and the summary counts it; a
record whose first failed is sent itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchline.datasets.sinks import read_skipped
from batchline.driver.drive import drive_job, read_failures
from tests.driver.fake import FakeReplica, fake_vectors
from tests.driver.test_drive import Replicas, options, output_vectors, write_jsonl

pytestmark = pytest.mark.anyio


def repeated(n: int) -> list[str]:
    """``n`` texts, every third a copy of an earlier one (near and far, inside a block too)."""
    return [f"copy of {i // 9}" if i % 3 == 0 else f"text number {i}" for i in range(n)]


async def test_a_repeated_text_is_sent_once_and_written_for_every_record(tmp_path: Path) -> None:
    items = repeated(120)
    distinct = len(set(items))
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(delay_s=0.002), b=FakeReplica(delay_s=0.002))
    summary = await drive_job(options(src, tmp_path / "out"), transport=replicas.transport)
    sent = sum(h.n for r in replicas.by_host.values() for h in r.hits)
    assert sent == distinct
    assert summary.duplicates == len(items) - distinct
    assert summary.records == len(items)
    assert ("duplicates (sent once)", f"{len(items) - distinct:,}") in summary.rows()
    _, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(len(items)))
    np.testing.assert_array_equal(vectors, fake_vectors(items))


async def test_no_dedupe_sends_every_record(tmp_path: Path) -> None:
    items = repeated(60)
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(), b=FakeReplica())
    opts = options(src, tmp_path / "out", dedupe=False)
    summary = await drive_job(opts, transport=replicas.transport)
    assert sum(h.n for r in replicas.by_host.values() for h in r.hits) == len(items)
    assert summary.duplicates == 0
    _, _, vectors = output_vectors(tmp_path / "out")
    np.testing.assert_array_equal(vectors, fake_vectors(items))


async def test_a_duplicate_of_a_failed_record_is_sent_itself(tmp_path: Path) -> None:
    """The first block holds a text the replica refuses (a 400 for its whole request): its
    records fail, and a later copy of one of them is sent on its own, not failed with it."""
    items = [f"text {i}" for i in range(20)]
    items[3] = "BAD first"
    items[15] = "text 4"  # a copy of a record of the failed block, in a later block
    src = write_jsonl(tmp_path / "in.jsonl", items)
    replicas = Replicas(a=FakeReplica(poison="BAD"))
    opts = options(src, tmp_path / "out", endpoints=["http://a:8000"], chunk_size=10)
    summary = await drive_job(opts, transport=replicas.transport)
    failed = {int(str(f["index"])) for f in read_failures(tmp_path / "out")}
    assert failed == set(range(10))  # the whole first request
    assert summary.duplicates == 0  # record 15 was sent after all
    _, indices, vectors = output_vectors(tmp_path / "out")
    assert indices == list(range(10, 20))
    np.testing.assert_array_equal(vectors, fake_vectors(items[10:]))
    assert len(read_skipped(tmp_path / "out")) == 10
