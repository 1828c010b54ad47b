"""The server processes the benchmarks start: a free port on 127.0.0.1, waiting until one
answers, stopping it by its PID, and finding llama.cpp's ``llama-server``.

Not a benchmark: ``bench_vs_vllm.py``, ``bench_sizes.py`` and ``bench_quant_quality.py`` import it
(run from ``benchmarks/``, where a script's own folder is on ``sys.path``).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.request
from pathlib import Path

#: Where ../shared/FACTS.md's recipe builds llama.cpp (``BATCHLINE_LLAMA_DIR`` overrides it).
LLAMA_DIR = Path(os.environ.get("BATCHLINE_LLAMA_DIR", "/work/llama/llama.cpp"))
#: On an AMX host llama-server's weight repacking crashed at load (2026-12): without it, it runs.
LLAMA_FALLBACK = ("--no-repack",)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def wait_ready(proc: subprocess.Popen[bytes], port: int, log: Path, timeout_s: float) -> None:
    """Return once ``GET /v1/models`` answers 200 (vLLM, batchline and llama-server all have
    it); ``SystemExit`` with the log's tail if the process exits or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited early:\n{log.read_text(errors='replace')[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(
        f"server not ready in {timeout_s} s:\n{log.read_text(errors='replace')[-4000:]}"
    )


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to this process alone, then SIGKILL if it has not exited in two minutes."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def start(
    command: list[str], port: int, log: Path, timeout_s: float, *, fallback: tuple[str, ...] = ()
) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``command`` (its output to ``log``) and wait until it answers on ``port``.

    Where it exits at load and ``fallback`` is given, it is started once more with those flags
    added. Returns the process and a note: "" or the flags added and why. ``SystemExit`` (with
    the log's tail) if it does not start; the process is stopped then.
    """
    note = ""
    while True:
        with log.open("wb") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_ready(proc, port, log, timeout_s)
        except SystemExit as exc:
            exited = proc.poll() is not None
            stop(proc)
            if note or not fallback or not exited:  # the fallback is tried once, at a crash
                raise
            said = (str(exc).strip().splitlines() or [""])[-1][:100]
            note = (
                f"{' '.join(fallback)} (with its defaults it exited at load, "
                f"code {proc.returncode}: {said})"
            )
            command = [*command, *fallback]
            continue
        return proc, note


def find_llama_server(llama_dir: Path = LLAMA_DIR) -> Path | None:
    """``llama_dir``'s build (``build/bin/llama-server``), else the one on ``PATH``, else None."""
    built = llama_dir / "build" / "bin" / "llama-server"
    if built.is_file() and os.access(built, os.X_OK):
        return built
    found = shutil.which("llama-server")
    return Path(found) if found else None
