"""One owner per Batch API data directory: a second ``serve`` on a held ``--data-dir`` is one
line naming the holder's pid, a killed holder frees it, and the default directory, shared
by every server of the machine, sends a second server to ``batch-api-PORT``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")

import batchline
from batchline.server.data_lock import LOCK_NAME, DataDirBusyError, hold_data_dir, lock_dir
from tests.helpers import free_port

SRC = str(Path(batchline.__file__).resolve().parents[1])


def _serve(data: Path, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    argv = [sys.executable, "-m", "batchline", "serve", "--port", str(free_port())]
    argv += ["--data-dir", str(data), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": SRC}
    with (tmp_path / f"{name}.log").open("wb") as log:
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)


def _wait_holder(data: Path, proc: subprocess.Popen[bytes]) -> None:
    """Until ``proc`` has written its pid into the lock file (it holds the lock by then)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the server exited before taking the data dir"
        try:
            if (data / LOCK_NAME).read_text().strip() == str(proc.pid):
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise AssertionError("the server never took the data dir")


def test_a_second_server_on_a_held_data_dir_names_the_holder(tmp_path: Path) -> None:
    data = tmp_path / "data"
    first = _serve(data, tmp_path, "first")
    try:
        _wait_holder(data, first)
        argv = ["serve", "--port", str(free_port()), "--data-dir", str(data)]
        second = subprocess.run(
            [sys.executable, "-m", "batchline", *argv],
            env={**os.environ, "PYTHONPATH": SRC},
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode == 2, second.stderr
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        assert len(lines) == 1, second.stderr
        assert f"in use by another batchline serve (pid {first.pid})" in lines[0]
        assert f"--data-dir {data}" in lines[0]
        # kill -9: the kernel frees the lock, and the next server takes the directory
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        third = _serve(data, tmp_path, "third")
        try:
            _wait_holder(data, third)
        finally:
            third.kill()
            third.wait(timeout=30)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait(timeout=30)


def test_the_default_dir_held_sends_a_second_server_beside_it(tmp_path: Path) -> None:
    root = tmp_path / "batch-api"
    with lock_dir(root):
        with pytest.raises(DataDirBusyError, match=f"pid {os.getpid()}"):
            hold_data_dir(root, explicit=True, port=8001)
        with hold_data_dir(root, explicit=False, port=8001) as own:
            assert own.root == tmp_path / "batch-api-8001"
            # a third server on the same port finds the port's folder held: refused, naming it
            with pytest.raises(DataDirBusyError, match=f"--data-dir {own.root} "):
                hold_data_dir(root, explicit=False, port=8001)
    with hold_data_dir(root, explicit=True, port=8001) as again:  # released: free again
        assert again.root == root


def test_a_server_started_again_on_its_port_goes_on_in_the_port_folder(tmp_path: Path) -> None:
    """The second server's batches live in ``batch-api-PORT``: started again on that port
    once the first server is gone (the default free), it goes back there, where its unfinished
    batches are; it had taken the default, and its batches were 404 for good. A server on
    another port still takes the default."""
    root = tmp_path / "batch-api"
    with lock_dir(root), hold_data_dir(root, explicit=False, port=8001) as own:
        assert own.root == tmp_path / "batch-api-8001"
    with hold_data_dir(root, explicit=False, port=8001) as again:
        assert again.root == tmp_path / "batch-api-8001"
        with hold_data_dir(root, explicit=False, port=8000) as other:
            assert other.root == root


def test_a_data_dir_that_cannot_be_made_says_which_setting_moves_it(tmp_path: Path) -> None:
    """A data dir the server cannot make (here through a file; read-only or full alike) is
    refused in one line that says what the folder is for and the flag that moves it."""
    from batchline._errors import InputError

    (tmp_path / "afile").write_text("x")
    with pytest.raises(InputError) as refused:
        lock_dir(tmp_path / "afile" / "batch-api")
    message = str(refused.value)
    assert "cannot use it: Not a directory" in message
    assert "give --data-dir a writable folder" in message
