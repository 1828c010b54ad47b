"""``batchline run`` under a failing disk: every step of its output (part files, the manifest,
``_skipped.jsonl``) failed in turn with ENOSPC, EIO and EROFS (the harness: ``harness.py``).

Each time: one error line, rc 2, no traceback; what is on disk reads whole; then ``--resume``
on a healthy disk finishes every record exactly once, the bad ones skipped once."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

from batchline import _fsio
from batchline.__main__ import main
from batchline.datasets.manifest import MANIFEST_NAME, SKIPPED_NAME, Manifest
from batchline.datasets.sinks import read_output, read_skipped

from .harness import ERRNOS, Fault, count_steps, points

MODEL = "def factory():\n    return lambda records: [len(r['text']) for r in records]\n"
GOOD = [f"r{i}" for i in range(14)]
BAD = (3, 9)  # lines that are not JSON: skipped under --on-bad-record skip
SITES = ("run.",)


@pytest.fixture
def job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "faultmodel.py").write_text(MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    lines = [json.dumps({"id": rid, "text": "x" * (i + 1)}) for i, rid in enumerate(GOOD)]
    for at in BAD:
        lines.insert(at, '{"id": "broken", "text": ')
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["run", "in.jsonl", "--model", "faultmodel:factory", "-o", "out", "--quiet"]
    return [*argv, "--chunk-size", "4", "--on-bad-record", "skip"]


def _steps(argv: list[str]) -> int:
    counter = Fault(SITES)
    with _fsio.injecting(counter):
        assert main(argv) == 0
    return count_steps(counter)


def _check_readable(out: Path) -> None:
    """Nothing half-written is taken for whole: no temporary file is left where a reader
    looks, and every file the manifest lists reads whole with the rows it says."""
    if not out.exists():
        return
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]
    if not (out / MANIFEST_NAME).exists():
        return
    manifest = Manifest.load(out)  # parses: it was replaced whole or not at all
    import pyarrow.parquet as pq

    for chunk in manifest.chunks.values():
        if chunk.file is not None:
            assert pq.read_table(out / chunk.file).num_rows == chunk.rows
    skipped = out / SKIPPED_NAME
    if manifest.skipped_bytes:
        data = skipped.read_bytes()[: manifest.skipped_bytes]
        assert all(json.loads(line)["id"] for line in data.splitlines())


def _check_done_once(out: Path) -> None:
    table = read_output(out)
    ids = table.column("id").to_pylist()
    assert sorted(ids) == sorted(GOOD)  # each once
    results = dict(zip(ids, table.column(table.column_names[2]).to_pylist(), strict=True))
    assert results == {rid: str(i + 1) for i, rid in enumerate(GOOD)}  # JSON text
    skipped = read_skipped(out)
    assert [row["index"] for row in skipped] == [3, 9]


def test_the_count_of_steps_is_every_write(job: list[str]) -> None:
    counter = Fault(SITES)
    with _fsio.injecting(counter):
        assert main(job) == 0
    sites = {s.site for s in counter.steps}
    assert sites == {"run.part", "run.manifest", "run.skipped"}
    renames = [s for s in counter.steps if s.step == "rename"]
    # the opening manifest, 4 parts and a manifest for each, the finished manifest
    assert len(renames) == 1 + 4 + 4 + 1
    _check_done_once(Path("out"))


@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_each_write_failed_is_one_line_then_resume_finishes_once(
    job: list[str], code: int, capsys: pytest.CaptureFixture[str]
) -> None:
    total = _steps(job)
    capsys.readouterr()
    out = Path("out")
    for n in points(total):
        _remove(out)
        fault = Fault(SITES, at=n, code=code)
        with _fsio.injecting(fault):
            rc = main(job)
        assert fault.fired, n
        assert rc == 2, (n, fault.failed)
        err = capsys.readouterr().err
        lines = [line for line in err.splitlines() if line.strip()]
        assert len(lines) == 1, (n, err)
        assert "Traceback" not in err
        assert f"({os.strerror(code)})" in lines[0], lines[0]
        assert "out" in lines[0]
        _check_readable(out)
        resume = [*job, "--resume"] if out.exists() else job
        assert main(resume) == 0, (n, capsys.readouterr().err)
        _check_done_once(out)


def test_a_read_only_output_is_one_line_rc_2(
    job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    fault = Fault(SITES, at=1, code=errno.EROFS)
    with _fsio.injecting(fault):
        assert main(job) == 2
    line = capsys.readouterr().err.strip()
    assert line.startswith("batchline run: error: cannot write to out: the file system is ")
    assert "read-only" in line
    assert "--output" in line


def test_a_full_disk_mid_run_says_resume(
    job: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    fault = Fault(SITES, at=12, code=errno.ENOSPC)  # past the first commit
    with _fsio.injecting(fault):
        assert main(job) == 2
    line = capsys.readouterr().err.strip()
    assert "is full (No space left on device)" in line
    assert "free some space, then rerun with --resume" in line


def _remove(out: Path) -> None:
    if out.exists():
        for path in out.iterdir():
            path.unlink()
        out.rmdir()
