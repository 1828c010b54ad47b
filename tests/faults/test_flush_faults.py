"""A stopped run's flush under a failing disk (the harness: ``harness.py``): each step of the
flushed file and of the manifest that names it, failed with ENOSPC, EIO and EROFS.

The stop still ends the job as a stop (the flush only saves work); the output holds the
committed chunks and either the whole flushed file named by its manifest or none of it, no
temporary file; and ``resume`` then finishes every record exactly once."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest

from batchline import _fsio
from batchline.datasets.sinks import ChunkWriter, Manifest, read_output
from batchline.datasets.sources import Record

from .harness import ERRNOS, Fault, count_steps, points


def _records(indices: range) -> list[Record]:
    return [Record(index=i, id=f"r{i}", text=f"t{i}") for i in indices]


def _vectors(indices: range) -> np.ndarray:
    return np.array([[i, -i] for i in indices], dtype=np.float32)


def _stop_under(out: Path, fault: Fault) -> None:
    """Write 13 records (chunk 0 commits, 3 wait), then stop with ``fault`` at the disk."""
    writer = ChunkWriter(out, chunk_size=10, flush_on_stop=True)
    writer.write_batch(_records(range(13)), _vectors(range(13)))
    with _fsio.injecting(fault), pytest.raises(KeyboardInterrupt), writer:
        raise KeyboardInterrupt


def test_the_clean_stop_writes_the_flushed_file_and_its_manifest(tmp_path: Path) -> None:
    counter = Fault(("run.",))
    _stop_under(tmp_path / "out", counter)
    assert {s.site for s in counter.steps} == {"run.flushed", "run.manifest"}
    assert Manifest.load(tmp_path / "out").records_kept == 13


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_a_failed_flush_keeps_the_stop_and_the_committed_chunks(tmp_path: Path, code: int) -> None:
    counter = Fault(("run.",))
    _stop_under(tmp_path / "clean", counter)
    for n in points(count_steps(counter)):
        out = tmp_path / f"out-{n}"
        fault = Fault(("run.",), at=n, code=code)
        _stop_under(out, fault)
        assert fault.fired
        kept = Manifest.load(out).records_kept
        assert kept in (10, 13)  # the flush is whole or absent
        assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
        with ChunkWriter(out, chunk_size=10, resume=True) as again:
            start = again.committed_ranges()[-1][1]
            again.write_batch(_records(range(start, 25)), _vectors(range(start, 25)))
            again.finish(25)
        assert read_output(out).column("index").to_pylist() == list(range(25))
