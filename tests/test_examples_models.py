"""The "your own model" examples run as a user runs them, and do what they say."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    ("script", "says"),
    [
        ("own_function_model.py", "skipped: {'index': 1, 'id': '1', 'reason': 'model error"),
        ("own_onnx_model.py", "32 images, outputs equal to onnxruntime's"),
    ],
)
def test_own_model_example(script: str, says: str) -> None:
    pytest.importorskip("onnxruntime")
    pytest.importorskip("pyarrow")
    done = subprocess.run(
        [sys.executable, script],
        cwd=ROOT / "examples",
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert says in done.stdout
