"""Every ``--help`` works with any extra missing, and a command whose extra is missing says
which ``pip install`` fixes it, in one line, with exit code 2.

Each extra's third-party modules are blocked in a fresh interpreter (``sys.modules[name] =
None`` makes their import fail as if they were not installed), one block set per extra.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batchline._commands import install_command

# extra -> the third-party modules it brings (pyproject.toml's optional-dependencies)
EXTRA_MODULES = {
    "onnx": ["numpy", "onnxruntime", "onnx", "tokenizers", "safetensors", "platformdirs"],
    "jobs": ["pyarrow", "rich", "pydantic", "PIL"],
    "server": ["fastapi", "starlette", "uvicorn", "prometheus_client", "httptools"],
    "driver": ["httpx"],
    "bench": ["matplotlib"],
    "ray": ["ray"],
    "generate": ["torch", "transformers", "gguf", "sklearn", "skimage"],
    "trace": ["opentelemetry.sdk", "opentelemetry.exporter"],
}

HELP_ARGVS = [
    ["--help"],
    ["run", "--help"],
    ["serve", "--help"],
    ["drive", "--help"],
    ["bench", "--help"],
    ["tune", "--help"],
    ["models", "--help"],
    ["models", "pull", "--help"],
    ["models", "list"],
]

_RUNNER = """
import json, sys
for name in json.loads(sys.argv[1]):
    sys.modules[name] = None
from batchline.__main__ import main
codes = []
for argv in json.loads(sys.argv[2]):
    try:
        codes.append(main(argv))
    except SystemExit as exc:  # argparse's --help
        codes.append(exc.code)
print(json.dumps(codes))
"""


def _blocked(blocked: list[str], argvs: list[list[str]]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, json.dumps(blocked), json.dumps(argvs)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize("extra", sorted(EXTRA_MODULES))
def test_every_help_works_without_the_extra(extra: str) -> None:
    done = _blocked(EXTRA_MODULES[extra], HELP_ARGVS)
    assert done.returncode == 0, done.stderr
    codes = json.loads(done.stdout.strip().splitlines()[-1])
    assert codes == [0] * len(HELP_ARGVS), done.stderr


@pytest.fixture(scope="module")
def texts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("in") / "in.txt"
    path.write_text("one\ntwo\n")
    return path


# extra blocked -> (the command that needs it, the extra its message must name)
CASES = {
    "onnx": (["run", "{texts}", "-o", "{out}"], "jobs"),
    "jobs": (["run", "{texts}", "-o", "{out}"], "jobs"),
    "server": (["serve", "--port", "0"], "server"),
    "driver": (["drive", "{texts}", "--endpoint", "http://127.0.0.1:9", "-o", "{out}"], "driver"),
    "bench": (["bench", "--duration", "0.1", "-o", "{out}"], "bench"),
    "ray": (["run", "{texts}", "--engine", "ray", "-o", "{out}"], "ray"),
}


@pytest.mark.parametrize("extra", sorted(CASES))
def test_a_missing_extra_is_one_line_naming_the_install(
    extra: str, texts: Path, tmp_path: Path
) -> None:
    argv, named = CASES[extra]
    argv = [a.format(texts=texts, out=tmp_path / "out") for a in argv]
    done = _blocked(EXTRA_MODULES[extra], [argv])
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert install_command(named) in lines[0]
    assert not (tmp_path / "out").exists()  # failed before touching the output
