"""``batchline run requests.jsonl`` on an OpenAI batch file: one output line per input line, in
the OpenAI batch output format (read back with the ``openai`` package's own types), a bad line
an error object, and a SIGKILLed job resumed to the same file.

The model is the tiny random Llama of test_generate (served as ``gpt-test``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline.knobs import Knobs

from .test_generate import _KILL_AFTER_CHUNK

pytest.importorskip("transformers")
pytest.importorskip("llguidance")
openai = pytest.importorskip("openai")

MODEL = "gpt-test"


@pytest.fixture(autouse=True)
def _cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.models.generation.test_load import save_tiny_generator

    torch.set_num_threads(1)
    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny")


def chat(i: int, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"req-{i}",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": MODEL,
            "messages": [{"role": "user", "content": f"question {i}"}],
            "max_tokens": 5,
            "temperature": 0,
            **body,
        },
    }


def write_lines(path: Path, lines: list[Any]) -> Path:
    with path.open("w", encoding="utf-8") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def run_batch(tiny: Path, src: Path, out: Path, **options: Any) -> Any:
    from batchline.jobs.generate import GenerateOptions
    from batchline.jobs.run import run

    opts = GenerateOptions(
        input=src, output=out, model=f"{MODEL}={tiny}/", knobs=Knobs(dtype="float32"), **options
    )
    return run(opts)


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def test_every_line_answered_once_in_the_openai_format(tiny: Path, tmp_path: Path) -> None:
    completion = {
        "custom_id": "plain",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "2 + 2 =", "max_tokens": 4, "seed": 7},
    }
    lines: list[Any] = [
        chat(0),
        completion,
        "{not json",
        {**chat(3), "url": "/v1/images"},
        {**chat(4), "url": "/v1/embeddings"},
        chat(5, model="gpt-other"),
        chat(6, temperature="hot"),
        chat(7, guided_choice=["yes", "no"], max_tokens=8),
        chat(8, response_format={"type": "json_schema", "json_schema": {"schema": {"type": 1}}}),
        chat(9, stop=["x"], top_p=0.5),
    ]
    src = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    summary = run_batch(tiny, src, out)
    assert summary.output == out
    got = read_lines(out)
    assert len(got) == len(lines)
    assert [g["custom_id"] for g in got] == [
        "req-0", "plain", None, "req-3", "req-4", "req-5", "req-6", "req-7", "req-8", "req-9"
    ]  # fmt: skip
    assert len({g["id"] for g in got}) == len(lines)
    ok = {0, 1, 7, 9}
    for i, g in enumerate(got):
        assert set(g) == {"id", "custom_id", "response", "error"}
        if i not in ok:
            assert g["response"] is None
            error = openai.types.BatchError.model_validate(g["error"])
            assert error.code == "invalid_request"
            assert error.message
            continue
        assert g["error"] is None
        response = g["response"]
        assert response["status_code"] == 200
        assert response["request_id"]
        if i == 1:
            body = openai.types.Completion.model_validate(response["body"])
            assert body.choices[0].text is not None
        else:
            body = openai.types.chat.ChatCompletion.model_validate(response["body"])
            assert body.choices[0].message.role == "assistant"
        assert body.model == MODEL
        assert body.usage is not None
        assert body.usage.total_tokens == body.usage.prompt_tokens + body.usage.completion_tokens
    messages = {i: got[i]["error"]["message"] for i in range(len(got)) if i not in ok}
    assert "malformed JSON" in messages[2]
    assert "'/v1/images' is not one of" in messages[3]
    assert "generates text; a /v1/embeddings line needs an embedding model" in messages[4]
    assert "--model gpt-other=SPEC" in messages[5]
    assert "temperature must be a number" in messages[6]
    assert "invalid json schema constraint" in messages[8]
    choice = openai.types.chat.ChatCompletion.model_validate(got[7]["response"]["body"])
    assert choice.choices[0].message.content in ("yes", "no")
    assert choice.choices[0].finish_reason == "stop"
    # greedy chat lines answer as a plain job answers the same messages
    plain = write_lines(
        tmp_path / "plain.jsonl",
        [{"messages": [{"role": "user", "content": "question 0"}]}],
    )
    from batchline.datasets.readers import read_output
    from batchline.jobs.generate import GenerateOptions
    from batchline.jobs.run import run

    run(
        GenerateOptions(
            input=plain,
            output=tmp_path / "plain",
            model=f"{tiny}/",
            max_tokens=5,
            knobs=Knobs(dtype="float32"),
        )
    )
    (row,) = read_output(tmp_path / "plain").to_pylist()
    first = openai.types.chat.ChatCompletion.model_validate(got[0]["response"]["body"])
    assert first.choices[0].message.content == row["text"]


def test_the_format_flag_and_a_finished_job_rewrites_the_same_file(
    tiny: Path, tmp_path: Path
) -> None:
    # a .txt name is not detected: --format openai-batch says what it is
    src = write_lines(tmp_path / "requests.txt", [chat(i) for i in range(3)])
    from batchline.cli import main

    out = tmp_path / "answers.jsonl"
    args = ["run", str(src), "--model", f"{MODEL}={tiny}/", "-o", str(out), "--quiet",
            "--dtype", "float32", "--format", "openai-batch"]  # fmt: skip
    assert main(args) == 0
    first = out.read_bytes()
    assert len(read_lines(out)) == 3
    assert main([*args, "--resume"]) == 0  # complete: only the file is written again
    assert out.read_bytes() == first


@pytest.mark.slow
def test_kill_9_then_resume_gives_the_same_file(tiny: Path, tmp_path: Path) -> None:
    src = write_lines(tmp_path / "requests.jsonl", [chat(i) for i in range(10)])
    out = tmp_path / "results.jsonl"
    args = ["run", str(src), "--model", f"{MODEL}={tiny}/", "-o", str(out), "--chunk-size", "3",
            "--max-running-sequences", "2", "--quiet", "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "BATCHLINE_CACHE_DIR": str(tmp_path / "cache")}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_CHUNK, *args], env=env, capture_output=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert not out.exists()  # the file is written once the job is done
    from batchline.cli import main

    assert main([*args, "--resume"]) == 0
    resumed = read_lines(out)
    assert [g["custom_id"] for g in resumed] == [f"req-{i}" for i in range(10)]
    whole = tmp_path / "whole.jsonl"
    run_batch(tiny, src, whole)

    def without_time(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for g in lines:
            del g["response"]["body"]["created"]
        return lines

    # the same lines as an uninterrupted job, but for the time each completion was made
    assert without_time(resumed) == without_time(read_lines(whole))
