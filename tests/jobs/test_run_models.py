"""``batchline run`` over any model behind the seam: the user's own Python (``module:factory``),
an ONNX tensor model (``.npy`` rows, list columns) and an ONNX classifier, through the CLI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("pyarrow")

import onnxruntime as ort

from batchline.__main__ import main
from batchline.datasets.sinks import read_arrays, read_output, read_skipped
from tests.models.onnx_builders import IMAGE_SHAPE, image_classifier, text_classifier

FACTORY = textwrap.dedent(
    """
    import json
    import os
    import signal
    import time

    def _kill_once_a_chunk_is_committed():
        manifest = os.path.join("out", "_manifest.json")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with open(manifest) as f:
                    if json.load(f)["chunks"]:
                        break
            except (OSError, ValueError):
                pass
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9, mid-job

    def factory():
        def score(records):
            out = []
            for r in records:
                if os.environ.get("CRASH_AT") == r["id"]:
                    _kill_once_a_chunk_is_committed()
                if r["text"] == "boom":
                    raise ValueError("boom is not allowed")
                out.append({"length": len(r["text"]), "upper": r["text"].upper()})
            return out
        score.cost = lambda record: 1 + len(record["text"]) // 8
        return score
    """
)


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The current directory holds ``scorer.py`` (importable as ``scorer:factory``)."""
    (tmp_path / "scorer.py").write_text(FACTORY)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def _records(path: Path, n: int, boom: int | None = None) -> list[dict[str, str]]:
    rows = [{"id": f"r{i}", "text": "boom" if i == boom else f"text number {i}"} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_a_python_batch_function_writes_every_result_once_in_order(workdir: Path) -> None:
    rows = _records(workdir / "data.jsonl", 300, boom=123)
    argv = ["run", "data.jsonl", "--model", "scorer:factory", "-o", "out", "--quiet"]
    assert main([*argv, "--on-bad-record", "skip", "--chunk-size", "64"]) == 0
    table = read_output(workdir / "out").to_pylist()
    assert [r["index"] for r in table] == [i for i in range(300) if i != 123]
    for row in table:
        text = rows[row["index"]]["text"]
        assert json.loads(row["result"]) == {"length": len(text), "upper": text.upper()}
    # the record that raised is listed with its id, and only it
    assert read_skipped(workdir / "out") == [
        {"index": 123, "id": "r123", "reason": "model error: ValueError: boom is not allowed"}
    ]


def test_by_default_a_failing_record_stops_the_job_naming_it(
    workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _records(workdir / "data.jsonl", 20, boom=7)
    assert main(["run", "data.jsonl", "--model", "scorer:factory", "-o", "out", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "record 7 (id 'r7') failed: model error: ValueError: boom is not allowed" in err


def test_a_python_model_job_killed_then_resumed_writes_each_record_once(workdir: Path) -> None:
    _records(workdir / "data.jsonl", 1000)
    argv = ["run", "data.jsonl", "--model", "scorer:factory", "-o", "out", "--quiet"]
    argv += ["--target-batch-tokens", "64"]  # small batches: chunks commit before the kill
    crashed = subprocess.run(
        [sys.executable, "-m", "batchline", *argv, "--chunk-size", "32"],
        env={**os.environ, "CRASH_AT": "r900", "PYTHONPATH": str(workdir)},
        cwd=workdir,
        capture_output=True,
        timeout=120,
        check=False,
    )
    assert crashed.returncode == -signal.SIGKILL, crashed.stderr
    manifest = json.loads((workdir / "out" / "_manifest.json").read_text())
    assert 0 < len(manifest["chunks"]) < 32  # some chunks committed before the kill
    assert main([*argv, "--chunk-size", "32", "--resume"]) == 0
    assert [r["index"] for r in read_output(workdir / "out").to_pylist()] == list(range(1000))


def test_npy_rows_through_an_onnx_tensor_model_equal_onnxruntime(tmp_path: Path) -> None:
    model = image_classifier(tmp_path)
    images = np.random.default_rng(3).normal(size=(70, *IMAGE_SHAPE)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    out = tmp_path / "out"
    argv = ["run", str(tmp_path / "images.npy"), "--model", str(model), "--task", "predict"]
    assert main([*argv, "-o", str(out), "--quiet"]) == 0
    rows = read_output(out).to_pylist()
    assert [r["index"] for r in rows] == list(range(70))
    got = np.array([r["outputs"]["logits"] for r in rows], dtype=np.float32)
    (want,) = ort.InferenceSession(str(model)).run(None, {"input": images})
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # numbers, not JSON text: what pyarrow, pandas and numpy users read
    part = pq.read_table(next(out.glob("part-*.parquet")))
    outputs = part.schema.field("outputs").type
    assert pa.types.is_struct(outputs)
    logits = outputs.field("logits").type
    assert pa.types.is_fixed_size_list(logits)  # the model declares 5 logits per row
    assert logits.list_size == 5
    assert pa.types.is_floating(logits.value_type)
    assert isinstance(part.column("outputs").to_pylist()[0]["logits"][0], float)
    arrays = read_arrays(out)
    assert arrays["logits"].shape == (70, 5)
    np.testing.assert_allclose(arrays["logits"], want, rtol=1e-5, atol=1e-5)


def test_predict_outputs_keep_the_models_dtype_end_to_end(tmp_path: Path) -> None:
    """float32 logits stay float32 and int64 labels int64 in Parquet, and come back exactly
    from read_output and read_arrays; a JSONL output holds the same values as numbers."""
    model = image_classifier(tmp_path, label=True)
    images = np.random.default_rng(5).normal(size=(40, *IMAGE_SHAPE)).astype(np.float32)
    np.save(tmp_path / "images.npy", images)
    want = dict(
        zip(
            ["logits", "label"],
            ort.InferenceSession(str(model)).run(None, {"input": images}),
            strict=True,
        )
    )
    assert (want["logits"].dtype, want["label"].dtype) == (np.float32, np.int64)
    argv = ["run", str(tmp_path / "images.npy"), "--model", str(model), "--task", "predict"]
    assert main([*argv, "-o", str(tmp_path / "out"), "--quiet"]) == 0
    outputs = read_output(tmp_path / "out").schema.field("outputs").type
    assert outputs.field("logits").type == pa.list_(pa.float32(), 5)
    assert outputs.field("label").type == pa.int64()
    part = pq.read_table(next((tmp_path / "out").glob("part-*.parquet")))
    assert part.schema.field("outputs").type == outputs  # as written, not cast on reading
    arrays = read_arrays(tmp_path / "out")
    assert arrays["logits"].dtype == np.float32
    assert arrays["label"].dtype == np.int64
    np.testing.assert_array_equal(arrays["logits"], want["logits"])
    np.testing.assert_array_equal(arrays["label"], want["label"])

    jsonl = tmp_path / "out.jsonl.d"
    assert main([*argv, "-o", str(jsonl), "--output-format", "jsonl", "--quiet"]) == 0
    rows = [
        json.loads(line)
        for f in sorted(jsonl.glob("part-*"))
        for line in f.read_text().splitlines()
    ]
    rows.sort(key=lambda r: r["index"])
    assert all(isinstance(v, float) for r in rows for v in r["outputs"]["logits"])
    assert all(isinstance(r["outputs"]["label"], int) for r in rows)
    got = np.array([r["outputs"]["logits"] for r in rows], dtype=np.float32)
    np.testing.assert_array_equal(got, want["logits"])
    assert [r["outputs"]["label"] for r in rows] == want["label"].tolist()


def test_list_columns_feed_a_tensor_model(tmp_path: Path) -> None:
    model = image_classifier(tmp_path)
    images = np.random.default_rng(4).normal(size=(5, *IMAGE_SHAPE)).astype(np.float32)
    data = tmp_path / "images.jsonl"
    data.write_text("".join(json.dumps({"pixels": im.tolist()}) + "\n" for im in images))
    out = tmp_path / "out"
    argv = ["run", str(data), "--model", str(model), "--input-column", "pixels", "-o", str(out)]
    assert main([*argv, "--quiet"]) == 2  # the model's input is 'input', not 'pixels'
    argv[argv.index("pixels")] = "input"
    data.write_text("".join(json.dumps({"input": im.tolist()}) + "\n" for im in images))
    assert main([*argv, "--quiet", "--overwrite"]) == 0
    got = [r["outputs"]["logits"] for r in read_output(out).to_pylist()]
    (want,) = ort.InferenceSession(str(model)).run(None, {"input": images})
    np.testing.assert_allclose(np.array(got, dtype=np.float32), want, rtol=1e-5, atol=1e-5)


def test_an_onnx_classifier_labels_each_text(tmp_path: Path) -> None:
    clf = text_classifier(tmp_path)
    texts = ["the movie was great", "awful plot", "the cat sat on the mat", "not good"]
    data = tmp_path / "reviews.txt"
    data.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    assert main(["run", str(data), "--model", str(clf.model), "-o", str(out), "--quiet"]) == 0
    rows = read_output(out).to_pylist()
    results = [r["classification"] for r in rows]
    # a struct column: the label a string, the scores numbers
    kind = pq.read_table(next(out.glob("part-*.parquet"))).schema.field("classification").type
    assert pa.types.is_struct(kind)
    assert pa.types.is_string(kind.field("label").type)
    assert pa.types.is_floating(kind.field("score").type)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(clf.tokenizer))
    session = ort.InferenceSession(str(clf.model))
    for text, result in zip(texts, results, strict=True):
        ids = np.array([tok.encode(text).ids], dtype=np.int64)
        (logits,) = session.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})
        probs = np.exp(logits[0] - logits[0].max())
        probs /= probs.sum()
        assert result["label"] == clf.labels[int(np.argmax(probs))]
        assert result["score"] == pytest.approx(float(probs.max()), rel=1e-5)
        assert sorted(result["scores"]) == sorted(clf.labels)


def test_top_k_from_the_command_line_keeps_the_likeliest_labels(tmp_path: Path) -> None:
    clf = text_classifier(tmp_path)
    data = tmp_path / "reviews.txt"
    data.write_text("the movie was great\nawful plot\n")
    out = tmp_path / "out"
    argv = ["run", str(data), "--model", str(clf.model), "--top-k", "2", "-o", str(out), "--quiet"]
    assert main(argv) == 0
    for row in read_output(out).to_pylist():
        result = row["classification"]
        assert len(result["top_k"]) == 2
        assert result["top_k"][0] == {"label": result["label"], "score": result["score"]}
        assert result["top_k"][0]["score"] >= result["top_k"][1]["score"]
