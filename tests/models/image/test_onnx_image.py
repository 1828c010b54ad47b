"""A plain ONNX image classifier (one NCHW input, ``models/image/onnx_image.py``): its scores
are the softmax of its logits, or its output as it is when that is probabilities already (a
graph that ends in a softmax); its result has the other classifiers' shape, ``scores`` for
every label or ``--top-k``'s likeliest."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from batchline.models.common.image_options import ImageOptions
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.onnx import softmax
from batchline.models.protocol import BatchModel
from batchline.models.specs import parse_spec
from tests.image_helpers import CLASSES, image_model

KNOBS = Knobs(sessions=1, intra_op_threads=1)
LABELS = ("cat", "dog", "car", "tree", "boat")


def _classifier(path: Path, **options: object) -> BatchModel:
    spec = parse_spec(str(path)).with_options(
        task="classify",
        labels=LABELS,
        image=ImageOptions(),
        **options,  # type: ignore[arg-type]
    )
    return load_model(spec, KNOBS)


def _pixels(count: int) -> list[np.ndarray]:
    rng = np.random.default_rng(7)
    return [rng.normal(size=(3, 32, 32)).astype(np.float32) for _ in range(count)]


def _graph(path: Path, pixels: list[np.ndarray]) -> np.ndarray:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"pixels": np.stack(pixels)})
    return np.asarray(out, dtype=np.float64)


def _scores(results: list[object]) -> np.ndarray:
    rows = [r["scores"] for r in results]  # type: ignore[index]
    return np.array([[row[label] for label in LABELS] for row in rows])


def test_a_graph_ending_in_a_softmax_gives_its_probabilities_as_they_are(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = image_model(tmp_path, softmax=True)
    pixels = _pixels(4)
    with caplog.at_level(logging.INFO, logger="batchline.models"):
        model = _classifier(path)
    got = _scores(model.run_batch(pixels))
    want = _graph(path, pixels)
    assert want.shape == (4, CLASSES)
    np.testing.assert_allclose(got, want, atol=1e-6)  # not softmax(want): flatter
    assert "outputs probabilities already" in caplog.text  # the load line says so


def test_a_graph_of_logits_gets_their_softmax(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = image_model(tmp_path)
    pixels = _pixels(4)
    with caplog.at_level(logging.INFO, logger="batchline.models"):
        model = _classifier(path)
    assert "probabilities already" not in caplog.text
    got = _scores(model.run_batch(pixels))
    np.testing.assert_allclose(got, softmax(_graph(path, pixels)), atol=1e-6)


def test_without_top_k_scores_holds_every_label_as_for_a_folder_classifier(
    tmp_path: Path,
) -> None:
    model = _classifier(image_model(tmp_path))
    for result in model.run_batch(_pixels(3)):
        assert set(result) == {"label", "score", "scores"}  # type: ignore[arg-type]
        assert list(result["scores"]) == list(LABELS)  # type: ignore[index]
        assert result["score"] == max(result["scores"].values())  # type: ignore[index]


@pytest.mark.parametrize(("top_k", "kept"), [(1, 1), (2, 2), (5, 5), (9, 5)])
def test_top_k_keeps_the_likeliest_labels_best_first(tmp_path: Path, top_k: int, kept: int) -> None:
    path = image_model(tmp_path)
    pixels = _pixels(3)
    every = _classifier(path).run_batch(pixels)
    short = _classifier(path, top_k=top_k)
    assert short.info.details["top_k"] == top_k
    for full, result in zip(every, short.run_batch(pixels), strict=True):
        ranked = sorted(full["scores"].items(), key=lambda e: -e[1])[:kept]  # type: ignore[index]
        assert set(result) == {"label", "score", "top_k"}  # type: ignore[arg-type]
        assert [(e["label"], e["score"]) for e in result["top_k"]] == ranked  # type: ignore[index]
        assert result["label"] == ranked[0][0]  # type: ignore[index]
