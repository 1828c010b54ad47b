"""``benchmarks/_servers.py``: finding llama-server, and starting a server with a fallback when
it exits at load (a stand-in server in Python, not llama-server)."""

from __future__ import annotations

import os
import stat
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ..benchmark_scripts import load_benchmark

# Exits with 3 unless given --no-repack; then answers GET with 200 for at most 30 s.
STAND_IN = """
import http.server, sys, time
if "--no-repack" not in sys.argv:
    sys.exit(3)

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

server = http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
server.timeout = 0.2
deadline = time.monotonic() + 30
while time.monotonic() < deadline:
    server.handle_request()
"""


@pytest.fixture
def servers(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("_servers.py", monkeypatch)


def _executable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_find_llama_server_prefers_the_build_then_path(
    servers: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_path = _executable(tmp_path / "bin" / "llama-server")
    monkeypatch.setenv("PATH", str(on_path.parent))
    assert servers.find_llama_server(tmp_path / "llama.cpp") == on_path
    built = _executable(tmp_path / "llama.cpp" / "build" / "bin" / "llama-server")
    assert servers.find_llama_server(tmp_path / "llama.cpp") == built
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert servers.find_llama_server(tmp_path / "elsewhere") is None


def test_start_retries_with_the_fallback_when_the_server_exits_at_load(
    servers: ModuleType, tmp_path: Path
) -> None:
    port = servers.free_port()
    command = [sys.executable, "-c", STAND_IN, str(port)]
    proc, note = servers.start(
        command, port, tmp_path / "log", 30.0, fallback=servers.LLAMA_FALLBACK
    )
    try:
        assert proc.poll() is None
        assert "--no-repack" in proc.args
        assert note.startswith("--no-repack (with its defaults it exited at load, code 3")
    finally:
        servers.stop(proc)
    assert proc.returncode is not None


def test_start_without_a_fallback_says_the_server_exited(
    servers: ModuleType, tmp_path: Path
) -> None:
    port = servers.free_port()
    command = [sys.executable, "-c", STAND_IN, str(port)]
    with pytest.raises(SystemExit, match="server exited early"):
        servers.start(command, port, tmp_path / "log", 30.0)
    assert os.path.exists(tmp_path / "log")  # kept for reading
