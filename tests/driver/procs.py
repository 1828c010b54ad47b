"""Real processes for the driver's end-to-end tests: servers and drivers on 127.0.0.1.

Every process is started on a free port, waited for with a bounded loop, and stopped by its
PID (``kill -9`` when a test asks for it); nothing is left running or unwaited.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import httpx

from tests.helpers import free_port

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).with_name("fake.py")


class Proc:
    """A subprocess whose output goes to a log file; ``kill()`` sends SIGKILL by PID."""

    def __init__(self, args: list[str], log: Path, *, port: int | None = None) -> None:
        self.args = args
        self.log = log
        self.port = port
        self._log_file: IO[bytes] = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            args, stdout=self._log_file, stderr=subprocess.STDOUT, cwd=REPO, env=child_env()
        )

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        """``kill -9`` by PID, then reap it."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
        self.wait(30)

    def wait(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout_s)
        finally:
            if self.proc.returncode is not None and not self._log_file.closed:
                self._log_file.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Poll ``GET /ready`` until 200 (bounded); fail with the log if the process died."""
        deadline = time.monotonic() + timeout_s
        with httpx.Client(timeout=2.0) as client:
            while time.monotonic() < deadline:
                if not self.alive():
                    raise RuntimeError(f"{self.args} exited early:\n{self.output()[-3000:]}")
                try:
                    if client.get(self.url + "/ready").status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                time.sleep(0.1)
        raise TimeoutError(f"{self.url} not ready after {timeout_s} s:\n{self.output()[-3000:]}")


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def serve_args(port: int, config: Path, *extra: str) -> list[str]:
    """``batchline serve`` with one session of one thread (two replicas fit on two cores)."""
    return [
        sys.executable,
        "-m",
        "batchline",
        "serve",
        "--port",
        str(port),
        "--config",
        str(config),
        "--log-level",
        "warning",
        *extra,
    ]


def one_thread_config(folder: Path) -> Path:
    path = folder / "serve-one-thread.json"
    path.write_text(json.dumps({"sessions": 1, "intra_op_threads": 1}))
    return path


class Procs:
    """Starts processes and stops every one that is still running on the way out."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.all: list[Proc] = []

    def start(self, args: list[str], name: str, *, port: int | None = None) -> Proc:
        proc = Proc(args, self.folder / f"{name}.log", port=port)
        self.all.append(proc)
        return proc

    def serve(self, *extra: str, port: int | None = None, name: str = "serve") -> Proc:
        port = port or free_port()
        config = one_thread_config(self.folder)
        return self.start(serve_args(port, config, *extra), f"{name}-{port}", port=port)

    def fake(self, *extra: str, port: int | None = None, name: str = "fake") -> Proc:
        port = port or free_port()
        args = [sys.executable, str(FAKE), "--port", str(port), *extra]
        return self.start(args, f"{name}-{port}", port=port)

    def drive(self, *args: str, name: str = "drive") -> Proc:
        return self.start([sys.executable, "-m", "batchline", "drive", *args], name)

    def stop_all(self) -> None:
        for proc in self.all:
            proc.kill()


@contextmanager
def processes(folder: Path) -> Iterator[Procs]:
    procs = Procs(folder)
    try:
        yield procs
    finally:
        procs.stop_all()


def fake_log(proc: Proc) -> list[dict[str, Any]]:
    """Every request the fake server saw (``GET /_log``)."""
    with httpx.Client(timeout=10.0) as client:
        hits: list[dict[str, Any]] = client.get(proc.url + "/_log").json()
        return hits
