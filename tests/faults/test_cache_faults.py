"""Caches under a failing disk (the harness: ``harness.py``): the files built once (the model
graph, an HF conversion, the decode kernel, the demo corpus and prompts) and ``run --cache``'s
results, each step failed with ENOSPC, EIO and EROFS.

A file built once is whole or absent (never half of it under its name, no temporary file
left); ``batchline run`` says the failure in one line, rc 2, and runs once the fault is
lifted. The result cache only saves work: a job whose cache cannot be written says so once
and finishes every record; nothing half-written is read back from it later."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from batchline import _fsio
from batchline._cache import write_whole

from .harness import ERRNOS, SITES, Fault, count_steps, full_matrix, points, slow_codes

CACHE_SITES = sorted(site for site, scenario in SITES.items() if scenario == "written_whole")


@pytest.mark.parametrize("site", CACHE_SITES)
@pytest.mark.parametrize("code", ERRNOS, ids=errno.errorcode.get)
def test_a_file_built_once_is_whole_or_absent(tmp_path: Path, site: str, code: int) -> None:
    target = tmp_path / "cache" / "built.bin"
    data = os.urandom(4096)
    counter = Fault((site,))
    with _fsio.injecting(counter):
        write_whole(target, data, site)
    target.unlink()
    for n in points(count_steps(counter)):
        fault = Fault((site,), at=n, code=code)
        with _fsio.injecting(fault), pytest.raises(OSError, match=os.strerror(code)) as raised:
            write_whole(target, data, site)
        assert _fsio.disk_errno(raised.value) == code
        assert not target.exists() or target.read_bytes() == data  # whole or absent
        assert [p.name for p in target.parent.iterdir()] in ([], ["built.bin"])
        write_whole(target, data, site)  # lifted
        assert target.read_bytes() == data
        target.unlink()


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    texts = [f"a sentence about the number {i}" for i in range(40)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return tmp_path


@pytest.mark.parametrize("code", slow_codes(), ids=errno.errorcode.get)
def test_run_says_a_model_cache_it_cannot_write_in_one_line(
    here: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], code: int
) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("pyarrow")
    from batchline.__main__ import main

    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(here / "cache"))
    argv = ["run", "in.jsonl", "-o", "out", "--quiet"]
    fault = Fault(("cache.model",), at=2, code=code)  # its bytes written, not yet whole
    with _fsio.injecting(fault):
        assert main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("batchline run: error: cannot write ")
    assert f"({os.strerror(code)})" in lines[0]
    assert not list((here / "cache").glob("*.onnx"))  # absent, not half
    assert not list((here / "cache").glob(".*.tmp"))
    assert not (here / "out").exists()
    assert main(argv) == 0  # lifted: the rerun builds it and runs
    from batchline.datasets.sinks import read_output

    assert read_output(here / "out").num_rows == 40


@pytest.mark.parametrize("code", slow_codes(), ids=errno.errorcode.get)
def test_a_result_cache_that_cannot_be_written_is_said_once_and_the_job_finishes(
    here: Path, caplog: pytest.LogCaptureFixture, code: int
) -> None:
    pytest.importorskip("onnxruntime")
    from batchline.datasets.sinks import read_output
    from batchline.jobs.run import RunOptions, run

    def options(out: str) -> RunOptions:
        return RunOptions(input=here / "in.jsonl", output=here / out, cache=here / "rc")

    counter = Fault(("cache.result",))
    with _fsio.injecting(counter):
        run(options("clean"))
    total = count_steps(counter)
    assert total >= 2
    for n in points(total) if full_matrix() else [total // 2]:
        (here / "rc" / "results.sqlite").unlink()
        for extra in ("-wal", "-shm"):
            (here / "rc" / f"results.sqlite{extra}").unlink(missing_ok=True)
        caplog.clear()
        fault = Fault(("cache.result",), at=n, code=code)
        with _fsio.injecting(fault):
            summary = run(options(f"faulted-{n}"))
        assert fault.fired
        assert summary.records == 40
        said = [r for r in caplog.records if "result cache" in r.getMessage()]
        assert len(said) == 1  # once (a fresh cache: every step is a put, none a mark of use)
        assert read_output(here / f"faulted-{n}").num_rows == 40
        again = run(options(f"again-{n}"))  # lifted: what was kept is read whole
        assert again.records == 40
        got = read_output(here / f"again-{n}")["embedding"].to_pylist()
        assert got == read_output(here / "clean")["embedding"].to_pylist()
