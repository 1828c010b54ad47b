from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import ModelError
from batchline.models.onnx import minilm
from batchline.models.onnx.runtime import OnnxModel, pad_sequences

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "minilm_reference.json"


@pytest.fixture(scope="module")
def reference() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(FIXTURE.read_text(encoding="utf-8"))
    return data


@pytest.fixture(scope="module")
def model(minilm_path: Path) -> OnnxModel:
    return OnnxModel.load(minilm_path, sessions=2, intra_op_threads=1)


def _tokenize(texts: list[str]) -> list[list[int]]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(minilm.weights_dir() / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=minilm.MAX_LENGTH)
    return [e.ids for e in tok.encode_batch(texts)]


def _cosines(a: np.ndarray[Any, Any], b: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.asarray((a * b).sum(axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1)))


def test_built_model_is_cached_under_the_cache_dir(minilm_path: Path, model_cache: Path) -> None:
    assert minilm_path.parent == model_cache
    assert f"-v{minilm.BUILDER_VERSION}.onnx" in minilm_path.name
    mtime = minilm_path.stat().st_mtime_ns
    # A second call reuses the file instead of rebuilding it.
    assert minilm.default_model_path() == minilm_path
    assert minilm_path.stat().st_mtime_ns == mtime
    # The atomic write left no temp file behind (the session's cache holds other tests' folders
    # too, in whatever order the files ran: the model's own files are the ones checked).
    mine = [p.name for p in model_cache.iterdir() if minilm_path.name in p.name]
    assert mine == [minilm_path.name]
    assert not [p.name for p in model_cache.iterdir() if p.name.endswith(".tmp")]


def test_cache_dir_follows_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path))
    assert minilm.cache_dir() == tmp_path
    monkeypatch.delenv("BATCHLINE_CACHE_DIR")
    assert "batchline" in str(minilm.cache_dir())


def test_model_has_dynamic_batch_and_sequence_axes(model: OnnxModel) -> None:
    assert model.input_names == ("input_ids", "attention_mask")
    for spec in model.inputs:
        assert all(isinstance(d, str) for d in spec.shape)
    assert model.outputs[0].name == "sentence_embedding"
    assert model.outputs[0].shape[1] == 384


def test_matches_sentence_transformers_reference(
    model: OnnxModel, reference: dict[str, Any]
) -> None:
    texts = [item["text"] for item in reference["items"]]
    expected = np.array([item["vector"] for item in reference["items"]], dtype=np.float64)
    ids = _tokenize(texts)
    assert max(len(i) for i in ids) == minilm.MAX_LENGTH  # the fixture covers truncation
    assert any(item["untruncated_tokens"] > minilm.MAX_LENGTH for item in reference["items"])

    # One record at a time (no padding) and all in one padded batch must both match.
    single = np.stack(
        [
            model.run({"input_ids": [seq], "attention_mask": [[1] * len(seq)]})[
                "sentence_embedding"
            ][0]
            for seq in ids
        ]
    )
    # Padded batches: the short texts together, and the long ones with a very short one.
    short = [i for i, seq in enumerate(ids) if len(seq) <= 64]
    long = [i for i in range(len(ids)) if i not in short] + [0]
    batched = np.empty_like(single)
    for group in (short, long):
        padded, mask = pad_sequences([ids[i] for i in group])
        batched[group] = model.run({"input_ids": padded, "attention_mask": mask})[
            "sentence_embedding"
        ]
    for got in (single, batched):
        assert got.shape == expected.shape
        assert got.dtype == np.float32
        cos = _cosines(got.astype(np.float64), expected)
        worst = int(np.argmin(cos))
        assert cos.min() >= 0.9999, f"{texts[worst]!r}: cosine {cos[worst]:.6f}"
        np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)


def test_no_torch_needed(model: OnnxModel) -> None:
    """Loading and running the default model imports no torch (checked in a fresh interpreter:
    other tests in this process may have imported it)."""
    code = (
        "import sys\n"
        "from batchline.models.onnx.runtime import OnnxModel\n"
        f"m = OnnxModel.load({str(model.path)!r}, sessions=1)\n"
        "m.run({'input_ids': [[101, 102]], 'attention_mask': [[1, 1]]})\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_missing_weights_is_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="weights not found"):
        minilm.default_model_path(cache=tmp_path, source=tmp_path)


def test_unwritable_cache_is_model_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(ModelError, match="BATCHLINE_CACHE_DIR"):
        minilm.default_model_path(cache=blocker / "sub")


def test_cache_key_changes_with_builder_version(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, minilm_path: Path
) -> None:
    # Pre-seed the cache under the next version's name so nothing is rebuilt.
    monkeypatch.setattr(minilm, "BUILDER_VERSION", minilm.BUILDER_VERSION + 1)
    name = minilm_path.name.replace(
        f"-v{minilm.BUILDER_VERSION - 1}.onnx", f"-v{minilm.BUILDER_VERSION}.onnx"
    )
    (tmp_path / name).write_bytes(b"")
    assert minilm.default_model_path(cache=tmp_path) == tmp_path / name
    assert os.path.getsize(tmp_path / name) == 0
