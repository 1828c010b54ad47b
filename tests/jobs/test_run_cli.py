"""``batchline run`` as a newcomer meets it: errors that end the circle (a failed run leaves
nothing behind, so the hinted rerun works; empty input is an error), empty texts counted and
listed, ``--quiet`` silent, ``--id-column`` kept by name, and Ctrl-C / SIGTERM saying what is
committed and the command that goes on."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("pyarrow")

import batchline
from batchline.__main__ import main
from batchline.datasets.sinks import Manifest, read_output, read_skipped


def _one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_a_run_stopped_by_a_bad_line_leaves_nothing_so_the_hinted_rerun_works(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (here / "mal.jsonl").write_text('{"text": "fine"}\n{broken\n{"text": "also fine"}\n')
    assert main(["run", "mal.jsonl", "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert "line 2" in line
    assert "--on-bad-record skip" in line
    assert not (here / "mal.embeddings").exists()
    # the rerun the message suggests, as written
    assert main(["run", "mal.jsonl", "--quiet", "--on-bad-record", "skip"]) == 0
    assert read_output(here / "mal.embeddings").column("index").to_pylist() == [0, 2]


def test_an_output_path_through_a_file_is_one_line(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``-o FILE/out``: the folder cannot be made; said in one line, exit 2 (it had been 40
    lines of traceback and exit 1), as ``-o FILE`` is."""
    (here / "data.jsonl").write_text('{"text": "fine"}\n')
    (here / "afile").write_text("hi")
    assert main(["run", "data.jsonl", "-o", "afile/out", "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert "cannot make the output folder afile/out: Not a directory" in line
    assert main(["run", "data.jsonl", "-o", "afile", "--quiet"]) == 2
    assert "exists and is not a directory" in _one_error_line(capsys)


def test_a_resume_with_other_model_options_is_refused(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--no-normalize`` (or ``--pooling``...) on a resume of an output written without it
    had been taken silently: one output, two kinds of vectors. A run without such options
    writes none, so a resume without them goes on as before."""
    (here / "data.jsonl").write_text('{"text": "a b"}\n{"text": "c d"}\n')
    assert main(["run", "data.jsonl", "-o", "out", "--quiet", "--limit", "1"]) == 0
    capsys.readouterr()
    again = ["run", "data.jsonl", "-o", "out", "--quiet", "--resume"]
    assert main([*again, "--no-normalize"]) == 2
    assert "normalize was 'unset', now False" in _one_error_line(capsys)
    assert main([*again, "--pooling", "none"]) == 2
    assert "pooling was 'unset', now 'none'" in _one_error_line(capsys)
    assert main(again) == 2  # the limit, asked the same: refused for it alone
    assert "limit" in _one_error_line(capsys)
    assert main([*again, "--limit", "1"]) == 0
    assert read_output(here / "out").num_rows == 1


def test_empty_input_is_an_error_unless_allow_empty(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (here / "empty.jsonl").write_text("\n")
    assert main(["run", "empty.jsonl", "--quiet"]) == 2
    line = _one_error_line(capsys)
    assert "no records to run" in line
    assert "--allow-empty" in line
    assert not (here / "empty.embeddings").exists()
    assert main(["run", "empty.jsonl", "--quiet", "--allow-empty"]) == 0
    manifest = Manifest.load(here / "empty.embeddings")
    assert manifest.complete
    assert manifest.total_records == 0


def test_empty_texts_are_counted_and_with_skip_listed(
    here: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (here / "cells.csv").write_text("id,text\na,hello\nb,\nc,   \nd,world\n")
    assert main(["run", "cells.csv", "-o", "ran"]) == 0
    captured = capsys.readouterr()
    assert "warning: 2 record(s) had empty text" in captured.err
    row = next(line for line in captured.out.splitlines() if "empty texts" in line)
    assert row.split("│")[2].strip() == "2"
    assert read_output(here / "ran").column("id").to_pylist() == ["a", "b", "c", "d"]

    assert main(["run", "cells.csv", "-o", "skipped", "--on-bad-record", "skip"]) == 0
    out = capsys.readouterr().out
    assert any(
        "empty texts" in line and line.split("│")[2].strip() == "2" for line in out.split("\n")
    )
    assert read_output(here / "skipped").column("id").to_pylist() == ["a", "d"]
    listed = read_skipped(here / "skipped")
    assert [(s["index"], s["id"]) for s in listed] == [(1, "b"), (2, "c")]
    assert all("empty text" in str(s["reason"]) for s in listed)


def test_quiet_prints_nothing_on_success(here: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (here / "in.txt").write_text("one\ntwo\n")
    assert main(["run", "in.txt", "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert read_output(here / "in.embeddings").num_rows == 2


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_the_id_column_keeps_its_name(here: Path, fmt: str) -> None:
    rows = [{"sku": f"S{i}", "text": f"item {i}", "title": f"t{i}"} for i in range(5)]
    (here / "items.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["run", "items.jsonl", "--id-column", "sku", "--copy-column", "title", "--quiet"]
    argv += ["--output-format", fmt, "-o", "out", "--chunk-size", "2"]
    assert main(argv) == 0
    table = read_output(here / "out")
    assert table.column_names == ["sku", "index", "embedding", "title"]
    assert table.column("sku").to_pylist() == [f"S{i}" for i in range(5)]
    assert main([*argv, "--resume"]) == 0  # a finished job resumes as it is
    assert read_output(here / "out").column_names == table.column_names


#: this checkout's batchline, for the subprocess
SRC = str(Path(batchline.__file__).resolve().parents[1])

STOPPER = textwrap.dedent(
    """
    import json
    import os
    import signal
    import time

    def factory():
        def score(records):
            with open("computed.txt", "a") as f:  # how many records each run computes
                f.write(f"{len(records)}\\n")
            if any(r["id"] == "r600" for r in records) and os.environ.get("STOP_WITH"):
                manifest = os.path.join("out", "_manifest.json")
                deadline = time.monotonic() + 60
                while os.environ.get("STOP_AFTER_A_CHUNK") and time.monotonic() < deadline:
                    try:
                        with open(manifest) as f:
                            if json.load(f)["chunks"]:
                                break
                    except (OSError, ValueError):
                        pass
                    time.sleep(0.01)
                os.kill(os.getpid(), getattr(signal, os.environ["STOP_WITH"]))
                if os.environ.get("STOP_TWICE"):  # a double Ctrl-C; GNU timeout's two sends
                    os.kill(os.getpid(), getattr(signal, os.environ["STOP_WITH"]))
                # the earlier batches' results reach the writer while this one sleeps: on a
                # busy machine 0.2 s was not always enough, and nothing was there to keep
                time.sleep(1.0)
            return [len(r["text"]) for r in records]
        return score
    """
)


def _ignore_sigint() -> None:
    """What a script's ``batchline run ... &`` gets: SIGINT ignored from the start."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _default_sigint() -> None:
    """What a terminal's ``batchline run`` gets: SIGINT at its default, whatever the test
    process's own disposition (a child inherits an ignored SIGINT, and Python then installs
    no KeyboardInterrupt handler)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _program_here(path: str) -> list[str]:
    """The program a hint names in an environment whose ``PATH`` is ``path``."""
    own = Path(sys.executable).parent / "batchline"
    if not own.is_file():
        return [sys.executable, "-m", "batchline"]
    return (
        ["batchline"] if str(Path(sys.executable).parent) in path.split(os.pathsep) else [str(own)]
    )


@pytest.mark.parametrize(
    ("signame", "code", "sigint_ignored", "twice"),
    [
        ("SIGINT", 130, False, False),
        ("SIGTERM", 143, False, False),
        ("SIGTERM", 143, True, False),
        ("SIGINT", 130, False, True),
        ("SIGTERM", 143, False, True),
        ("SIGTERM", 143, True, True),
    ],
)
def test_a_stopped_run_says_what_is_committed_and_how_to_go_on(
    here: Path,
    monkeypatch: pytest.MonkeyPatch,
    signame: str,
    code: int,
    sigint_ignored: bool,
    twice: bool,
) -> None:
    """Also started in the background by a script (SIGINT ignored): SIGTERM still stops it,
    keeps the committed chunks and prints the resume command, naming a program that runs.
    The signal sent twice at once (a double Ctrl-C; GNU timeout signals the command, then
    its group) stops it the same way: the second had raised in the stop's own cleanup, and
    half such runs hung, asleep, for good."""
    (here / "stopper.py").write_text(STOPPER)
    monkeypatch.syspath_prepend(str(here))
    rows = [{"id": f"r{i}", "text": f"text {i}"} for i in range(1000)]
    (here / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["run", "data.jsonl", "--model", "stopper:factory", "-o", "out", "--quiet"]
    argv += ["--chunk-size", "32", "--target-batch-tokens", "16"]
    path = os.environ.get("PATH", "")
    stopped = subprocess.run(
        [sys.executable, "-m", "batchline", *argv],
        env={
            **os.environ,
            "STOP_WITH": signame,
            "STOP_AFTER_A_CHUNK": "1",
            "STOP_TWICE": "1" if twice else "",
            "PYTHONPATH": f"{here}{os.pathsep}{SRC}",
        },
        cwd=here,
        preexec_fn=_ignore_sigint if sigint_ignored else _default_sigint,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert stopped.returncode == code, stopped.stderr
    assert "Traceback" not in stopped.stderr
    lines = [line for line in stopped.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stopped.stderr
    manifest = Manifest.load(here / "out")
    assert manifest.chunks
    kept = manifest.records_kept
    assert 0 < kept < 1000
    message, _, command = lines[0].partition("; to go on, run: ")
    assert message == f"batchline run: interrupted ({signame}): {kept:,} record(s) kept in out"
    resume = shlex.split(command)
    program = _program_here(path)
    assert resume == [*program, *argv, "--resume"]
    assert main(resume[len(program) :]) == 0
    assert read_output(here / "out").column("index").to_pylist() == list(range(1000))


def test_ctrl_c_before_the_first_chunk_keeps_what_is_done(here: Path) -> None:
    """Stopped before its first chunk of 10,000 records is complete, a run keeps the results
    it has (flushed), names --resume, and the resume computes only the others."""
    (here / "stopper.py").write_text(STOPPER)
    rows = [{"id": f"r{i}", "text": f"text {i}"} for i in range(1000)]
    (here / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["run", "data.jsonl", "--model", "stopper:factory", "-o", "out", "--quiet"]
    argv += ["--target-batch-tokens", "16"]
    env = {**os.environ, "PYTHONPATH": f"{here}{os.pathsep}{SRC}"}
    stopped = subprocess.run(
        [sys.executable, "-m", "batchline", *argv],
        env={**env, "STOP_WITH": "SIGINT"},
        cwd=here,
        preexec_fn=_default_sigint,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert stopped.returncode == 130, stopped.stderr
    manifest = Manifest.load(here / "out")
    assert not manifest.chunks  # no chunk was complete
    kept = manifest.records_kept
    assert 0 < kept < 1000
    line = stopped.stderr.strip()
    assert f"interrupted (SIGINT): {kept:,} record(s) kept in out; to go on, run: " in line
    assert line.endswith(" --resume")
    (here / "computed.txt").unlink()
    resumed = subprocess.run(
        [sys.executable, "-m", "batchline", *argv, "--resume"],
        env=env,
        cwd=here,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert resumed.returncode == 0, resumed.stderr
    computed = sum(int(n) for n in (here / "computed.txt").read_text().split())
    assert computed == 1000 - kept
    table = read_output(here / "out")
    assert table.column("index").to_pylist() == list(range(1000))
    assert table.column("result").to_pylist() == [json.dumps(len(r["text"])) for r in rows]
    assert not list(here.glob("out/_flushed-*"))  # a finished output holds its chunks only
