"""An OpenAI batch file's own rules, checked before anything runs: repeated ``custom_id`` values
make the file invalid (as at OpenAI), blank lines are skipped and counted in the summary."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batchline.__main__ import main
from batchline._errors import InputError
from batchline.jobs.openai_batch import check_batch_file

EMB = "text-embedding-test"


def embed(custom_id: object, text: str) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/embeddings",
        "body": {"model": EMB, "input": text},
    }


def write(path: Path, lines: list[Any]) -> Path:
    text = "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_repeated_custom_id_is_refused_with_its_lines_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = write(
        tmp_path / "requests.jsonl",
        [
            embed("a", "x"),
            embed("req-1", "y"),
            "",
            embed("b", "z"),
            embed("req-1", "w"),
            embed("b", "again"),
        ],
    )
    out = tmp_path / "results.jsonl"
    code = main(["run", str(src), "--model", f"{EMB}=default", "-o", str(out), "--quiet"])
    assert code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert 'custom_id "req-1" is on lines 2 and 5' in err  # the first repeat, its line numbers
    assert "its own custom_id" in err
    assert "Traceback" not in err
    assert not out.exists()
    assert not (tmp_path / "results.jsonl.parts").exists()  # refused before any output


def test_the_check_counts_blank_lines_and_leaves_bad_lines_to_the_job(tmp_path: Path) -> None:
    src = tmp_path / "requests.jsonl"
    src.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps(embed("1", "x")).encode()
        + b"\n\n   \r\n"
        + json.dumps(embed("2", "x")).encode()
        + b"\nnot json\n"
        + json.dumps({"url": "/v1/embeddings"}).encode()  # no custom_id: the job's error
        + b"\n\t\n"
    )
    assert check_batch_file(src) == 3
    write(src, [embed("é", "x"), embed("é", "y")])
    with pytest.raises(InputError, match='custom_id "é" is on lines 1 and 2'):
        check_batch_file(src)
    write(src, [embed("1", "x"), embed(1, "y")])  # the number 1 is not the string "1"
    with pytest.raises(InputError, match="line 2: custom_id must be a string, got 1; quote it"):
        check_batch_file(src)


def test_blank_lines_are_skipped_and_counted_and_a_resumed_job_counts_them_too(
    tmp_path: Path,
) -> None:
    pytest.importorskip("onnxruntime")
    from batchline.jobs.options import GenerateOptions
    from batchline.jobs.run import run

    src = write(
        tmp_path / "requests.jsonl",
        ["", embed("a", "one"), "  ", embed("b", "two"), "", embed("c", "three")],
    )
    out = tmp_path / "results.jsonl"
    options = GenerateOptions(input=src, output=out, models=(f"{EMB}=default",))
    summary = run(options)
    assert summary.blank_lines == 3
    assert ("blank lines (skipped)", "3") in summary.rows()
    got = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert [g["custom_id"] for g in got] == ["a", "b", "c"]
    assert all(g["error"] is None for g in got)
    again = run(GenerateOptions(input=src, output=out, models=(f"{EMB}=default",), resume=True))
    assert again.blank_lines == 3
    assert again.already_done == 3
    assert [json.loads(line)["custom_id"] for line in out.read_text().splitlines()] == [
        "a",
        "b",
        "c",
    ]


def test_a_line_key_is_the_line_but_its_custom_id_and_only_for_a_fixed_answer() -> None:
    from batchline.jobs.requests import line_key
    from batchline.models.generation import SamplingParams

    base = SamplingParams(max_tokens=16)

    def chat(custom_id: str, **sampling: object) -> dict[str, object]:
        body = {"messages": [{"role": "user", "content": "hi"}], **sampling}
        return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                "body": body}  # fmt: skip

    embed = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings", "body": {"input": "x"}}
    assert line_key(embed, base) == line_key({**embed, "custom_id": "b"}, base) is not None
    other = {**embed, "body": {"input": "y"}}
    assert line_key(other, base) != line_key(embed, base)
    assert line_key(chat("a", temperature=0), base) == line_key(chat("b", temperature=0), base)
    assert line_key(chat("a", temperature=0.7, seed=3), base) is not None
    assert line_key(chat("a", temperature=0.7), base) is None  # a draw of its own
    assert line_key(chat("a"), base) is None  # OpenAI's default temperature is 1
    assert line_key({**embed, "url": "/v1/nope"}, base) is None  # its own error, when sent
