"""``batchline run`` over a ``score`` model (a reranker): (query, document) pairs in, one
score per record out, read from ``query`` and ``document`` columns or the two named ones."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

from batchline.__main__ import main
from batchline.datasets.sinks import read_output, read_skipped

SCORER = textwrap.dedent(
    """
    from batchline.models.protocol import ModelInfo

    class Overlap:
        info = ModelInfo(name="overlap", task="score", input_kind="record",
                         cost_kind="padded", result_kind="value", result_column="score")

        def prepare(self, inputs):
            out = []
            for x in inputs:
                q, d = x.get("query"), x.get("document")
                if not isinstance(q, str) or not isinstance(d, str):
                    out.append(TypeError("a pair needs a query and a document text"))
                else:
                    out.append((q.split(), d.split()))
            return out

        def cost(self, item):
            return len(item[0]) + len(item[1])

        def run_batch(self, batch):
            return [len(set(q) & set(d)) / len(q) for q, d in batch]

        def encode(self, result):
            return result

        def close(self):
            pass

    def factory():
        return Overlap()
    """
)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "reranker.py").write_text(SCORER)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _pairs(path: Path, rows: list[dict[str, object]]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_a_score_job_writes_one_score_per_pair_in_order(workdir: Path) -> None:
    rows = [{"query": "the cat", "document": d} for d in ("the cat sat", "a dog", "cat food")]
    _pairs(workdir / "pairs.jsonl", rows)
    argv = ["run", "pairs.jsonl", "--model", "reranker:factory", "--quiet"]
    assert main(argv) == 0
    table = read_output(workdir / "pairs.results").to_pylist()
    assert [(r["index"], r["score"]) for r in table] == [(0, 1.0), (1, 0.0), (2, 0.5)]


def test_a_score_job_reads_two_named_columns_and_reports_a_bad_pair(workdir: Path) -> None:
    rows: list[dict[str, object]] = [
        {"q": "red apple", "passage": "an apple that is red"},
        {"q": "red apple", "passage": None},
        {"q": "green", "passage": "green tea"},
    ]
    _pairs(workdir / "pairs.jsonl", rows)
    argv = ["run", "pairs.jsonl", "--model", "reranker:factory", "-o", "out", "--quiet"]
    argv += ["--input-column", "q", "--input-column", "passage", "--on-bad-record", "skip"]
    assert main(argv) == 0
    table = read_output(workdir / "out").to_pylist()
    assert [(r["index"], r["score"]) for r in table] == [(0, 1.0), (2, 1.0)]
    (skipped,) = read_skipped(workdir / "out")
    assert skipped["index"] == 1
    assert "a pair needs a query and a document text" in skipped["reason"]


def test_a_score_job_takes_two_columns_only(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _pairs(workdir / "pairs.jsonl", [{"query": "a", "document": "a"}])
    argv = ["run", "pairs.jsonl", "--model", "reranker:factory", "--input-column", "query"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "a score job reads two columns, a query and a document" in err
    assert "Traceback" not in err


def test_an_openai_batch_file_answers_rerank_and_score_lines(workdir: Path) -> None:
    def line(i: int, url: str, **body: object) -> dict[str, object]:
        return {"custom_id": f"c{i}", "method": "POST", "url": url, "body": body}

    docs = ["the cat sat", "a dog", "cat food"]
    lines = [
        line(0, "/v1/rerank", model="rr", query="the cat", documents=docs, top_n=2),
        line(1, "/v1/score", text_1="the cat", text_2=docs),
        line(2, "/v1/rerank", query="the cat", documents=[]),
        line(3, "/v1/chat/completions", messages=[{"role": "user", "content": "hi"}]),
        line(4, "/v1/rerank", model="other", query="a", documents=["a"]),
        line(5, "/v1/rerank", query="cat", documents=[{"text": "cat"}], return_documents=False),
    ]
    _pairs(workdir / "requests.jsonl", lines)  # type: ignore[arg-type]
    argv = ["run", "requests.jsonl", "--model", "rr=reranker:factory", "-o", "out.jsonl"]
    assert main([*argv, "--quiet"]) == 0
    got = [json.loads(x) for x in (workdir / "out.jsonl").read_text().splitlines()]
    assert [g["custom_id"] for g in got] == [f"c{i}" for i in range(6)]
    assert [g["error"] is None for g in got] == [True, True, False, False, False, True]
    rerank = got[0]["response"]["body"]
    assert rerank["model"] == "rr"
    assert [
        (r["index"], r["relevance_score"], r["document"]["text"]) for r in rerank["results"]
    ] == [
        (0, 1.0, "the cat sat"),
        (2, 0.5, "cat food"),
    ]
    assert rerank["usage"]["total_tokens"] == sum(2 + len(d.split()) for d in docs)
    score = got[1]["response"]["body"]
    assert score["object"] == "list"
    assert [(d["index"], d["score"]) for d in score["data"]] == [(0, 1.0), (1, 0.0), (2, 0.5)]
    assert '"documents" must be a non-empty list' in got[2]["error"]["message"]
    assert "this job has no generator for /v1/chat/completions lines" in got[3]["error"]["message"]
    assert "add --model other=SPEC (a reranker" in got[4]["error"]["message"]
    assert got[5]["response"]["body"]["results"] == [{"index": 0, "relevance_score": 1.0}]
