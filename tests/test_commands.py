"""The commands a hint names work where this batchline runs: in an environment whose scripts
are not on PATH (``bash scripts/run.sh`` puts them in the clone's ``.venv/bin``) they are
spelled with absolute paths, and batchline's extras install from the folder it came from,
torch pinned to its CPU wheel."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import batchline

SRC = Path(batchline.__file__).resolve().parents[1]
ROOT = SRC.parent

_PRINT = f"""
import json, sys
sys.path.insert(0, {str(SRC)!r})
from batchline._commands import install_command, pip_command, program
print(json.dumps([program(), pip_command(), install_command("generate"), install_command("jobs")]))
"""


@pytest.fixture(scope="module")
def venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An environment with its own ``batchline`` and ``pip`` scripts (empty stand-ins)."""
    where = tmp_path_factory.mktemp("env") / ".venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(where)], check=True)
    for name in ("batchline", "pip"):
        (where / "bin" / name).write_text("#!/bin/sh\n")
        (where / "bin" / name).chmod(0o755)
    return where


def _commands(venv: Path, path: str) -> list[str]:
    env = {**os.environ, "PATH": path}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-c", _PRINT],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return list(json.loads(done.stdout))


def test_off_path_the_commands_are_absolute(venv: Path) -> None:
    program, pip, generate, jobs = _commands(venv, "/usr/bin:/bin")
    python = str(venv / "bin" / "python")
    assert program == str(venv / "bin" / "batchline")
    assert shlex.split(pip) == [python, "-m", "pip", "install"]
    # this checkout runs from its source folder: the install is editable, from there
    assert shlex.split(generate) == [
        python, "-m", "pip", "install", "torch==2.13.0", "-e", f"{ROOT}[generate]"
    ]  # fmt: skip
    assert shlex.split(jobs) == [python, "-m", "pip", "install", "-e", f"{ROOT}[jobs]"]


def test_on_path_the_commands_are_the_bare_names(venv: Path) -> None:
    program, pip, generate, _ = _commands(venv, f"{venv / 'bin'}:/usr/bin:/bin")
    assert program == "batchline"
    assert pip == "pip install"
    assert generate == f"pip install torch==2.13.0 -e {shlex.quote(f'{ROOT}[generate]')}"
