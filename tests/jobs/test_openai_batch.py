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

import numpy as np
import pytest

from batchline.models.config import Knobs

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

    options.setdefault("knobs", Knobs(dtype="float32"))
    opts = GenerateOptions(input=src, output=out, model=f"{MODEL}={tiny}/", **options)
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
    assert "body.temperature: Input should be a valid number" in messages[6]
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
    from batchline.__main__ import main

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
    from batchline.__main__ import main

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


EMB = "text-embedding-test"


def embed(i: int | str, text: str | list[str], **body: Any) -> dict[str, Any]:
    return {
        "custom_id": f"emb-{i}",
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": EMB, "input": text, **body},
    }


def unnamed(line: dict[str, Any]) -> dict[str, Any]:
    """``line`` with no ``body.model``."""
    return {**line, "body": {k: v for k, v in line["body"].items() if k != "model"}}


def run_mixed(tiny: Path, src: Path, out: Path) -> Any:
    from batchline.jobs.generate import GenerateOptions
    from batchline.jobs.run import run

    models = (f"{EMB}=default", f"{MODEL}={tiny}/")
    return run(
        GenerateOptions(
            input=src, output=out, model=models[0], models=models, knobs=Knobs(dtype="float32")
        )
    )


def plain_embeddings(texts: list[str], tmp_path: Path) -> Any:
    """What a plain embed job (``batchline run texts.jsonl``) gives for ``texts``."""
    from batchline.datasets.readers import read_arrays
    from batchline.jobs.run import RunOptions, run

    src = write_lines(tmp_path / "texts.jsonl", [{"text": t} for t in texts])
    run(RunOptions(input=src, output=tmp_path / "texts.embeddings"))
    return read_arrays(tmp_path / "texts.embeddings")


def test_a_mixed_file_answers_embeddings_and_chat_lines(tiny: Path, tmp_path: Path) -> None:
    import base64

    import numpy as np

    texts = ["the cat sat on the mat", "batching shares one model call", "hello", "é ü ß"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}

    def strict(value: object) -> dict[str, Any]:
        return {"name": "a", "schema": schema, "strict": value}

    lines: list[Any] = [
        embed(0, texts[0]),
        chat(1),
        embed(2, texts[1:], encoding_format="base64", dimensions=384),
        unnamed(embed(3, texts[3])),  # no model: the job's embedding model
        unnamed(chat(4)),  # the job's generator
        embed(5, "x", dimensions=1000),
        embed(6, "x", encoding_format="int8"),
        embed(7, []),
        embed(8, [101, 2023]),
        embed(9, "x", model="text-embedding-other"),
        chat(10, model=EMB),
        embed(11, "x", model=MODEL),
        chat(12, response_format={"type": "json_schema", "json_schema": strict("yes")}),
        chat(
            13, max_tokens=24, response_format={"type": "json_schema", "json_schema": strict(False)}
        ),
        embed(14, ["ok", ""]),
    ]
    src = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    run_mixed(tiny, src, out)
    got = read_lines(out)
    assert [g["custom_id"] for g in got] == [line["custom_id"] for line in lines]
    assert len({g["id"] for g in got}) == len(lines)
    ok = {0, 1, 2, 3, 4, 13}
    for i, g in enumerate(got):
        assert (g["error"] is None) == (i in ok), (i, g["error"])
        if i not in ok:
            assert g["response"] is None
            assert openai.types.BatchError.model_validate(g["error"]).message
    errors = {i: got[i]["error"]["message"] for i in range(len(got)) if i not in ok}
    assert "'dimensions' must be between 1 and 384" in errors[5]
    assert "body.encoding_format: Input should be 'float' or 'base64'" in errors[6]
    assert "'input' is empty; send at least one of its texts" in errors[7]
    assert "token arrays are not taken" in errors[8]
    assert "add --model text-embedding-other=SPEC" in errors[9]
    assert f"model {EMB!r} embeds; a /v1/chat/completions line needs a generator" in errors[10]
    assert f"model {MODEL!r} generates text" in errors[11]
    assert '"strict" must be true or false' in errors[12]
    assert "'input' text 1 is empty" in errors[14]

    def embeddings(i: int) -> Any:
        raw = got[i]["response"]["body"]
        decoded = [
            {**d, "embedding": np.frombuffer(base64.b64decode(d["embedding"]), "<f4").tolist()}
            if isinstance(d["embedding"], str)  # base64: little-endian float32, as OpenAI's
            else d
            for d in raw["data"]
        ]
        body = openai.types.CreateEmbeddingResponse.model_validate({**raw, "data": decoded})
        assert body.object == "list"
        assert body.model == EMB
        assert [d.index for d in body.data] == list(range(len(body.data)))
        assert body.usage.total_tokens == body.usage.prompt_tokens > 0
        return body

    expected = plain_embeddings(texts, tmp_path)
    first, listed, anonymous = embeddings(0), embeddings(2), embeddings(3)
    np.testing.assert_allclose(first.data[0].embedding, expected[0], rtol=0, atol=1e-6)
    # base64 was asked for: one item per text of the list, in order
    assert all(isinstance(d["embedding"], str) for d in got[2]["response"]["body"]["data"])
    assert len(listed.data) == 3
    for item, want in zip(listed.data, expected[1:4], strict=True):
        np.testing.assert_allclose(item.embedding, want, rtol=0, atol=1e-6)
    np.testing.assert_allclose(anonymous.data[0].embedding, expected[3], rtol=0, atol=1e-6)
    assert listed.usage.prompt_tokens > first.usage.prompt_tokens  # three texts, summed
    for i in (1, 4, 13):
        body = openai.types.chat.ChatCompletion.model_validate(got[i]["response"]["body"])
        assert body.model == MODEL  # a line naming no model is answered by the generator
        assert body.choices[0].message.role == "assistant"
    # strict: false still constrains (the schema is always enforced)
    content = got[13]["response"]["body"]["choices"][0]["message"]["content"]
    if got[13]["response"]["body"]["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content)["a"], int)
    else:
        assert content.startswith("{")


def test_an_embeddings_only_file_needs_no_generator(tiny: Path, tmp_path: Path) -> None:
    from batchline.__main__ import main

    lines = [embed(0, "one"), unnamed(chat(1)), unnamed(embed(2, "two")), embed(3, "one")]
    lines[3]["body"]["dimensions"] = 16
    src = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    assert main(["run", str(src), "--model", f"{EMB}=default", "-o", str(out), "--quiet"]) == 0
    # the output file has the mode of every other output (a part file's), not 0600
    (part,) = (tmp_path / "results.jsonl.parts").glob("part-*")
    assert out.stat().st_mode & 0o777 == part.stat().st_mode & 0o777 != 0o600
    got = read_lines(out)
    assert [g["error"] is None for g in got] == [True, False, True, True]
    assert "this job has no generator for /v1/chat/completions lines" in got[1]["error"]["message"]
    assert "--model NAME=smollm2" in got[1]["error"]["message"]
    for g in (got[0], got[2]):
        body = openai.types.CreateEmbeddingResponse.model_validate(g["response"]["body"])
        assert len(body.data[0].embedding) == 384
    # dimensions: the first 16 of the same text's vector, renormalized
    full = np.asarray(got[0]["response"]["body"]["data"][0]["embedding"], dtype=np.float32)
    cut = np.asarray(got[3]["response"]["body"]["data"][0]["embedding"], dtype=np.float32)
    np.testing.assert_allclose(cut, full[:16] / np.linalg.norm(full[:16]), rtol=1e-5, atol=1e-7)
    # and one with no embedding model: its embeddings lines say which flag to add
    assert main(["run", str(src), "--model", f"{MODEL}={tiny}/", "-o", str(out), "--quiet",
                 "--overwrite", "--limit", "1"]) == 0  # fmt: skip
    (only,) = read_lines(out)
    assert "add --model text-embedding-test=SPEC (an embedding model" in only["error"]["message"]


def test_several_models_go_with_a_batch_file_only(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    plain = write_lines(tmp_path / "plain.jsonl", [{"text": "hello"}])
    assert main(["run", str(plain), "--model", "a=default", "--model", "b=default"]) == 2
    assert "--model repeats only for an OpenAI batch file" in capsys.readouterr().err
    # a file that is not there is said first: what the flags allow depends on what it holds
    missing = tmp_path / "requests.jsonl"
    assert main(["run", str(missing), "--model", "a=default", "--model", "b=default"]) == 2
    assert f"{missing}: no such file or folder" in capsys.readouterr().err
    from batchline._errors import InputError
    from batchline.jobs.generate import GenerateOptions
    from batchline.jobs.run import run

    with pytest.raises(InputError, match="several models go with an OpenAI batch file only"):
        run(GenerateOptions(input=plain, models=("a=default", "b=smollm2")))
    src = write_lines(tmp_path / "requests.jsonl", [embed(0, "one")])
    args = ["run", str(src), "-o", str(tmp_path / "r.jsonl"), "--quiet"]
    assert main([*args, "--model", "a=default", "--model", "b=default"]) == 2
    assert "takes one embedding model at most, got 'a' and 'b'" in capsys.readouterr().err
    assert main([*args, "--model", f"a={tiny}/", "--model", f"b={tiny}/"]) == 2
    assert "takes one generator at most" in capsys.readouterr().err
    assert not (tmp_path / "r.jsonl.parts").exists()  # refused before any output was made


def test_strict_must_be_a_bool() -> None:
    from batchline.models.generation.structured import constraint_from_openai

    schema = {"type": "object"}
    for strict in (True, False, None):
        spec: dict[str, Any] = {"schema": schema, "strict": strict}
        fmt = {"type": "json_schema", "json_schema": spec}
        constraint = constraint_from_openai({"response_format": fmt})
        assert constraint is not None
        assert constraint.kind == "json_schema"
    fmt = {"type": "json_schema", "json_schema": {"schema": schema, "strict": 1}}
    with pytest.raises(ValueError, match='"strict" must be true or false'):
        constraint_from_openai({"response_format": fmt})


@pytest.mark.slow
def test_kill_9_then_resume_a_mixed_file_gives_the_same_file(tiny: Path, tmp_path: Path) -> None:
    lines = [embed(i, [f"text {i}", f"more {i}"]) if i % 2 else chat(i) for i in range(12)]
    src = write_lines(tmp_path / "requests.jsonl", lines)
    out = tmp_path / "results.jsonl"
    args = ["run", str(src), "--model", f"{EMB}=default", "--model", f"{MODEL}={tiny}/",
            "-o", str(out), "--chunk-size", "3", "--max-running-sequences", "2", "--quiet",
            "--dtype", "float32"]  # fmt: skip
    env = {**os.environ, "BATCHLINE_CACHE_DIR": str(tmp_path / "cache")}
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_CHUNK, *args], env=env, capture_output=True, timeout=300
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert not out.exists()
    from batchline.__main__ import main

    assert main([*args, "--resume"]) == 0
    resumed = out.read_text(encoding="utf-8").splitlines()
    whole = tmp_path / "whole.jsonl"
    run_mixed(tiny, src, whole)
    uninterrupted = whole.read_text(encoding="utf-8").splitlines()
    assert len(resumed) == len(uninterrupted) == len(lines)
    for i, (a, b) in enumerate(zip(resumed, uninterrupted, strict=True)):
        if i % 2:  # an embeddings line: byte for byte
            assert a == b
            openai.types.CreateEmbeddingResponse.model_validate(json.loads(a)["response"]["body"])
        else:  # a completion: the same but for the time it was made
            x, y = json.loads(a), json.loads(b)
            del x["response"]["body"]["created"], y["response"]["body"]["created"]
            assert x == y


def test_a_lines_penalties_and_bias_are_applied_and_unapplied_fields_fail_it() -> None:
    from batchline.datasets.sources import Record
    from batchline.jobs.requests import RecordRequests
    from batchline.models.generation.engine import SamplingParams

    requests = RecordRequests("prompt", True, SamplingParams(), openai_batch=True)

    def line(**body: object) -> Record:
        value = {"custom_id": "a", "method": "POST", "url": "/v1/completions"}
        return Record(0, "a", "", value={**value, "body": {"prompt": "hi", **body}})

    params = requests.params(
        line(presence_penalty=1, frequency_penalty=-0.5, logit_bias={"12": 5, "3": -1})
    )
    assert (params.presence_penalty, params.frequency_penalty) == (1, -0.5)
    assert params.logit_bias == ((3, -1), (12, 5))
    for body, message in (
        ({"frequency_penalty": 2.5}, r"frequency_penalty must be a number in \[-2, 2\]"),
        ({"presence_penalty": "high"}, "body.presence_penalty: Input should be a valid number"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"top_k": 40}, "'top_k' is not applied by batchline's engines"),
    ):
        with pytest.raises(ValueError, match=message):
            requests.params(line(**body))
