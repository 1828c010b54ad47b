"""Every example runs, and every Python block of the README (and of the docs pages the README
sends readers to for the rules it leaves out: ``docs/batcher.md``) runs."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load(path: Path) -> object:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_batch_a_function_example() -> None:
    import asyncio

    module = _load(ROOT / "examples" / "batch_a_function.py")
    results = asyncio.run(module.main())  # type: ignore[attr-defined]
    assert results == [len((f"text number {i} " * (i % 5 + 1)).split()) for i in range(100)]


def test_embed_from_threads_example() -> None:
    pytest.importorskip("onnxruntime")
    import numpy as np

    module = _load(ROOT / "examples" / "embed_from_threads.py")
    matrix, stats = module.main()  # type: ignore[attr-defined]
    n = len(module.QUESTIONS)  # type: ignore[attr-defined]
    assert matrix.shape == (n, 384)
    np.testing.assert_allclose(np.linalg.norm(matrix, axis=1), 1.0, atol=1e-5)
    # the threads' texts really shared model calls
    assert stats.total_completed == n
    assert stats.avg_batch_size > 1


#: The pages whose Python blocks are run as they are.
RUN_PAGES = ("README.md", "docs/batcher.md")


def python_blocks() -> list[str]:
    text = "\n".join((ROOT / page).read_text() for page in RUN_PAGES)
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index: int, tmp_path: Path) -> None:
    code = python_blocks()[index]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, timeout=300
    )
    assert result.returncode == 0, result.stderr


def test_readme_is_a_newcomers_path() -> None:
    """Short enough to read top to bottom, with a from-a-clone install, and every docs page it
    links to exists."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 270
    assert "pip install '.[jobs]'" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_readme_gives_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/run.sh" in text
    assert "bash scripts/test.sh" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci
