"""Text classifiers and cross-encoders in bf16 on torch (``precision = "bf16"``): the torch
graph gives transformers' logits (token types of pairs included), and the task models over it
give fp32's labels and scores within bf16's rounding."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_spec
from tests.models.hf.conftest import save_bert, tiny_bert, tiny_roberta

pytestmark = pytest.mark.usefixtures("torch_ready")

TEXTS = ["hello world", "the cat sat on the mat", "paris", "query document hello cat sat"]
PAIRS = [["hello world", "the cat sat on the mat"], ["paris", "query document cat"], ["a", "b"]]


def feeds(types: bool) -> dict[str, np.ndarray[Any, Any]]:
    ids = np.array([[2, 7, 9, 11, 3, 0], [2, 5, 3, 8, 8, 3]], dtype=np.int64)
    mask = (ids != 0).astype(np.int64)
    out = {"input_ids": ids, "attention_mask": mask}
    if types:
        out["token_type_ids"] = np.array([[0, 0, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]], np.int64)
    return out


def test_a_bert_classifier_runs_lean_with_transformers_logits_and_token_types() -> None:
    import torch

    from batchline.models.hf.torch_logits import TorchLogits

    model = tiny_bert(labels=3, seed=1)
    with torch.inference_mode():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds(True).items()}).logits.numpy()
    graph = TorchLogits(model, path=Path("clf"), sessions=1)  # fp32 weights: a tight check
    assert graph._encoder is not None
    assert graph.input_names == ("input_ids", "attention_mask", "token_type_ids")
    got = graph.run(feeds(True))["logits"]
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # the second pair's types matter: all-zero types give other logits
    zeros = {**feeds(True), "token_type_ids": np.zeros((2, 6), np.int64)}
    assert np.abs(graph.run(zeros)["logits"][1] - want[1]).max() > 1e-3


def test_another_architecture_runs_transformers_forward() -> None:
    import torch

    from batchline.models.hf.torch_logits import TorchLogits

    model = tiny_roberta(labels=2, seed=3)
    data = feeds(False)
    with torch.inference_mode():
        want = model(**{k: torch.from_numpy(v) for k, v in data.items()}).logits.numpy()
    graph = TorchLogits(model, path=Path("rob"), sessions=1)
    assert graph._encoder is None
    assert graph.input_names == ("input_ids", "attention_mask")  # one token type
    np.testing.assert_allclose(graph.run(data)["logits"], want, atol=1e-4, rtol=0)


def test_a_classifier_folder_in_bf16_gives_fp32_s_labels(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = save_bert(tmp_path / "clf", labels=3, seed=1)
    spec = parse_spec(f"{folder}/")
    fp32 = load_model(spec, Knobs(sessions=1))
    with caplog.at_level(logging.INFO, logger="batchline.models"):
        bf16 = load_model(spec, Knobs(sessions=1, precision="bf16"))
    assert "-> torch (bf16)" in caplog.text
    assert bf16.info.details["labels"] == ["L0", "L1", "L2"]
    want = fp32.run_batch(fp32.prepare(TEXTS))
    got = bf16.run_batch(bf16.prepare(TEXTS))
    probs = np.array([[r["scores"][f"L{i}"] for i in range(3)] for r in got])
    expected = np.array([[r["scores"][f"L{i}"] for i in range(3)] for r in want])
    assert 0 < np.abs(probs - expected).max() <= 0.05  # it ran in bf16, close to fp32


def test_a_cross_encoder_folder_in_bf16_scores_pairs_as_fp32(tmp_path: Path) -> None:
    folder = save_bert(tmp_path / "rerank", labels=1, seed=2)
    spec = parse_spec(f"{folder}/").with_options(task="score")
    fp32 = load_model(spec, Knobs(sessions=1))
    bf16 = load_model(spec, Knobs(sessions=1, precision="bf16"))
    want = np.array(fp32.run_batch(fp32.prepare(PAIRS)))
    got = np.array(bf16.run_batch(bf16.prepare(PAIRS)))
    assert got.shape == (3,)
    assert 0 < np.abs(got - want).max() <= 0.02


def test_bf16_for_a_classifier_that_is_no_folder_is_refused(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from tests.jobs.test_quantize import _tiny_predictor

    path = tmp_path / "tiny.onnx"
    _tiny_predictor(path)
    spec = parse_spec(str(path)).with_options(task="classify")
    with pytest.raises(InputError, match="is no such folder: use precision auto or fp32"):
        load_model(spec, Knobs(precision="bf16"))
