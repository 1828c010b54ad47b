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
    assert len(text.splitlines()) <= 240  # room left for an Images section
    assert "pip install '.[jobs]'" in text
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link


def test_readme_gives_the_two_setup_commands() -> None:
    text = (ROOT / "README.md").read_text()
    assert "bash scripts/run.sh" in text
    assert "bash scripts/test.sh" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in ci


def _options(command: str) -> dict[str, str]:
    """``command``'s visible options and their help, as ``batchline COMMAND --help`` shows."""
    import argparse

    from batchline.__main__ import build_parser

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    parser = sub.choices[command]
    found = {"--help": "show this help message and exit"}
    for action in parser._actions:
        if action.help != argparse.SUPPRESS:
            for option in action.option_strings:
                found[option] = str(action.help or "")
    return found


def _readme_commands(text: str) -> list[tuple[str, list[str]]]:
    """Each ``batchline COMMAND ...`` line of the README's bash blocks (continuations joined):
    the command and its ``--flags``."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split("#", 1)[0]
            match = re.search(r"(?:^|\s)batchline\s+([a-z]+)\b(.*)", line)
            if match:
                found.append((match.group(1), re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", line)))
    return found


def test_every_flag_the_readme_names_is_one_help_knows() -> None:
    """The README's commands use only flags their command's ``--help`` lists, every flag its
    prose names is one a command lists, and where the README describes a flag it says what
    the one help text says."""
    text = (ROOT / "README.md").read_text()
    commands = ("run", "serve", "drive", "bench", "tune", "models")
    helps = {c: _options(c) for c in commands}
    lines = _readme_commands(text)
    assert {c for c, _ in lines} >= {"run", "serve", "drive", "bench", "tune", "models"}
    for command, flags in lines:
        unknown = [f for f in flags if f not in helps[command]]
        assert not unknown, f"batchline {command} has no {unknown} (README)"
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    known = {f for h in helps.values() for f in h}
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", prose))
    assert named - known == set(), "README names flags no command has"
    # the one description of --task, as run and serve give it
    from batchline.models.selection import TASK_HELP

    assert "`--task` overrides what was detected" in text
    assert "overrides what was detected" in TASK_HELP
    assert helps["run"]["--task"].startswith(TASK_HELP)
    assert helps["serve"]["--task"].startswith(TASK_HELP)
    assert "score" in TASK_HELP


def test_a_readme_curl_runs_against_the_server_started_above_it() -> None:
    """``scripts/run_readme_blocks.py`` runs a line marked ``# needs the server above`` while
    the ``batchline serve`` line above it in its block is up; every such README line has one
    (a curl is checked by the fresh-install check, never skipped silently)."""
    runner = _load(ROOT / "scripts" / "run_readme_blocks.py")
    blocks = runner.blocks  # type: ignore[attr-defined]
    sample = (
        "```bash\nbatchline serve --port 8000\ncurl -sf x  # needs the server above: why\n```\n"
    )
    assert blocks(sample) == [[("batchline serve --port 8000", False), ("curl -sf x", True)]]
    marked = 0
    for block in blocks((ROOT / "README.md").read_text()):
        for at, (line, needs_server) in enumerate(block):
            if needs_server:
                marked += 1
                assert any(runner._is_serve(above) for above, _ in block[:at]), line  # type: ignore[attr-defined]
    assert marked >= 3  # the Images section's curls: /v1/classify, /classify, /v1/embeddings
