"""``drive``'s ``_failures.jsonl`` under a failing disk (the harness: ``harness.py``): an append
failed at each step (a full disk tears its line) raises the disk's error, and the log opened
again (a resume) keeps exactly the lines of committed chunks, each whole. ``drive``'s chunks
go through ``run``'s writer, which ``test_run_faults.py`` covers."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from batchline import _fsio
from batchline.driver.drive import _FailureLog

from .harness import ERRNOS, Fault, count_steps, points


def _entry(index: int) -> dict[str, object]:
    return {"index": index, "id": f"r{index}", "status": 503, "message": "busy"}


def _write_two(path: Path) -> None:
    log = _FailureLog(path, lambda i: True)
    log.add([_entry(0)])
    log.add([_entry(1)])


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_a_failed_append_is_dropped_on_resume_and_nothing_torn_is_read(
    tmp_path: Path, code: int
) -> None:
    path = tmp_path / "_failures.jsonl"
    counter = Fault(("drive.",))
    with _fsio.injecting(counter):
        _write_two(path)
    path.unlink()
    for n in points(count_steps(counter)):
        path.unlink(missing_ok=True)
        fault = Fault(("drive.",), at=n, code=code)
        with _fsio.injecting(fault), pytest.raises(OSError, match=os.strerror(code)) as raised:
            _write_two(path)
        assert _fsio.disk_errno(raised.value) == code
        # resumed: chunk 0 committed, the rest redone; a torn line never survives
        again = _FailureLog(path, lambda i: i == 0)
        lines = path.read_bytes().splitlines() if path.exists() else []
        assert [json.loads(line)["index"] for line in lines] in ([], [0])
        assert again.previous == len(lines)
