"""The Batch API's documented flow (docs/batch-api.md, linked from the README): its ``py``
block runs against a real ``batchline serve`` with the default embedder, started as the text
says."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from .test_uvicorn import run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

pytest.importorskip("openai")
pytest.importorskip("multipart")

DOC = Path(__file__).resolve().parents[2] / "docs" / "batch-api.md"


def test_the_documented_client_flow_runs(tmp_path: Path) -> None:
    text = DOC.read_text(encoding="utf-8")
    (code,) = re.findall(r"```py\n(.*?)```", text, flags=re.S)
    assert "--model text-embedding-3-small=default" in text  # the server the block talks to
    args = ["--model", "text-embedding-3-small=default", "--data-dir", str(tmp_path / "data")]
    with run_server(*args, env={"BATCHLINE_API_KEY": "sk-local"}) as server:
        code = code.replace("http://127.0.0.1:8000", f"http://127.0.0.1:{server.port}")
        done = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "completed 3 ['doc-0', 'doc-1', 'doc-2']"
