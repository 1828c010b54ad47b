"""OnnxClassifier: texts to a label and its probabilities, labels from every source."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from batchline._errors import InputError, ModelError
from batchline.models.batching import ModelBatcher
from batchline.models.config import Knobs
from batchline.models.onnx.classify import (
    OnnxClassifier,
    labels_from_config,
    load_classifier,
    softmax,
)
from batchline.models.onnx.embedder import TokenizedText
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec, parse_spec

from .onnx_builders import TextClassifier, text_classifier

Array = np.ndarray[Any, Any]
KNOBS = Knobs(sessions=2, intra_op_threads=1, max_concurrent_batches=2)
TEXTS = [
    "the movie was great",
    "a very bad film",
    "plot",
    "the actors were not really good and the ending was awful",
    "zebra unknown words",
    "",
]


def spec_for(files: TextClassifier, **options: Any) -> ModelSpec:
    return parse_spec(str(files.model)).with_options(task="classify", **options)


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> TextClassifier:
    return text_classifier(tmp_path_factory.mktemp("classifier"))


@pytest.fixture(scope="module")
def classifier(files: TextClassifier) -> OnnxClassifier:
    return load_classifier(spec_for(files), KNOBS)


def ok(prepared: list[TokenizedText | BaseException]) -> list[TokenizedText]:
    assert all(isinstance(p, TokenizedText) for p in prepared), prepared
    return [p for p in prepared if isinstance(p, TokenizedText)]


def direct_logits(files: TextClassifier, ids: Array) -> Array:
    """ONNX Runtime on one unpadded text, no batchline in between."""
    sess = ort.InferenceSession(str(files.model), providers=["CPUExecutionProvider"])
    feeds = {"input_ids": ids[None], "attention_mask": np.ones((1, len(ids)), np.int64)}
    (logits,) = sess.run(["logits"], feeds)
    return np.asarray(logits[0])


def test_info(classifier: OnnxClassifier) -> None:
    info = classifier.info
    assert isinstance(classifier, BatchModel)
    assert (info.name, info.task, info.input_kind) == ("model", "classify", "text")
    assert (info.cost_kind, info.result_kind, info.result_column) == (
        "padded",
        "value",
        "classification",
    )
    assert info.details == {"labels": ["negative", "neutral", "positive"]}
    assert info.max_tokens == 16
    assert classifier.sessions == 2


def test_labels_and_scores_are_the_softmax_of_the_logits(
    classifier: OnnxClassifier, files: TextClassifier
) -> None:
    items = ok(classifier.prepare(TEXTS))
    assert [classifier.cost(t) for t in items] == [max(1, len(t)) for t in items]
    assert max(len(t) for t in items) > min(len(t) for t in items)  # padding happens
    batched = classifier.run_batch(items)
    for item, got in zip(items, batched, strict=True):
        logits = direct_logits(files, item.ids)
        probs = np.exp(logits - logits.max())
        probs /= probs.sum()
        best = int(np.argmax(logits))
        assert got["label"] == files.labels[best]
        assert got["score"] == pytest.approx(float(probs[best]), rel=1e-5)
        assert list(got["scores"]) == list(files.labels)
        np.testing.assert_allclose(list(got["scores"].values()), probs, rtol=1e-5)
        (alone,) = classifier.run_batch([item])
        assert alone["label"] == got["label"]
        assert alone["score"] == pytest.approx(got["score"], rel=1e-5)
    # the texts do not all get one label: the test can tell labels apart
    assert len({r["label"] for r in batched}) > 1


def test_results_are_json_values(classifier: OnnxClassifier) -> None:
    (result,) = classifier.run_batch(ok(classifier.prepare(["good movie"])))
    encoded = classifier.encode(result)
    assert json.loads(json.dumps(encoded)) == encoded
    assert isinstance(encoded["score"], float)
    assert sum(encoded["scores"].values()) == pytest.approx(1.0)


def test_a_non_text_input_fails_alone(classifier: OnnxClassifier) -> None:
    prepared = classifier.prepare(["good", 3, None, "bad \ud800 text"])
    assert isinstance(prepared[0], TokenizedText)
    assert isinstance(prepared[1], InputError)
    assert "must be a string, got int" in str(prepared[1])
    assert isinstance(prepared[2], InputError)
    assert isinstance(prepared[3], TokenizedText)


def test_labels_from_the_spec_win_over_config(files: TextClassifier) -> None:
    model = load_classifier(spec_for(files, labels=("bad", "meh", "good")), KNOBS)
    assert model.labels == ("bad", "meh", "good")
    assert model.info.details == {"labels": ["bad", "meh", "good"]}


def test_without_config_labels_are_numbered(tmp_path: Path) -> None:
    files = text_classifier(tmp_path, config=False)
    model = load_classifier(spec_for(files), KNOBS)
    assert model.labels == ("LABEL_0", "LABEL_1", "LABEL_2")


def test_label_count_mismatch_is_a_clear_model_error(files: TextClassifier, tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"returns 3 logits per text but 2 labels were given"):
        load_classifier(spec_for(files, labels=("a", "b")), KNOBS)
    four = text_classifier(tmp_path, labels=("a", "b", "c", "d"), num_logits=3)
    with pytest.raises(ModelError, match="returns 3 logits per text but 4 labels"):
        load_classifier(spec_for(four), KNOBS)


def test_repeated_labels_are_refused(files: TextClassifier) -> None:
    with pytest.raises(ModelError, match="repeat 'a'"):
        load_classifier(spec_for(files, labels=("a", "b", "a")), KNOBS)


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"id2label": {"0": "x", "2": "z"}}, r"ids must be 0\.\.1"),
        ({"id2label": {"zero": "x"}}, "keys must be integer ids"),
        ({"id2label": []}, "must be an object"),
    ],
)
def test_bad_id2label_is_a_model_error(tmp_path: Path, config: object, match: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(ModelError, match=match):
        labels_from_config(path)


def test_id2label_is_ordered_by_id(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps(
            {"id2label": {"1": "b", "0": "a", "10": "k", **{str(i): f"l{i}" for i in range(2, 10)}}}
        )
    )
    labels = labels_from_config(path)
    assert labels is not None
    assert labels[:3] == ("a", "b", "l2")
    assert labels[-1] == "k"
    assert labels_from_config(tmp_path / "none.json") is None


def test_missing_tokenizer_says_where_it_looked(files: TextClassifier, tmp_path: Path) -> None:
    lonely = tmp_path / "lonely" / "model.onnx"
    lonely.parent.mkdir()
    lonely.write_bytes(files.model.read_bytes())
    with pytest.raises(InputError, match="no tokenizer for"):
        load_classifier(parse_spec(str(lonely)).with_options(task="classify"), KNOBS)


def test_baseline_layout_is_one_shared_session(files: TextClassifier) -> None:
    model = load_classifier(spec_for(files), Knobs(batching=False, sessions=1, intra_op_threads=2))
    assert model.sessions == 1
    assert model.model.shared


def test_softmax_is_stable_for_large_logits() -> None:
    probs = softmax(np.array([[1000.0, 1000.0], [0.0, -1000.0]]))
    np.testing.assert_allclose(probs, [[0.5, 0.5], [1.0, 0.0]])


@pytest.mark.anyio
async def test_engine_groups_texts_by_length(classifier: OnnxClassifier) -> None:
    items = ok(classifier.prepare(TEXTS * 4))
    knobs = KNOBS.replace(batch_timeout_s=0.0, target_batch_tokens=64)
    async with ModelBatcher(classifier, knobs) as engine:
        futures = [await engine.submit(t) for t in items]
        results = [await f for f in futures]
    want = classifier.run_batch(items)
    assert [r["label"] for r in results] == [w["label"] for w in want]
    for got, exp in zip(results, want, strict=True):
        assert got["score"] == pytest.approx(exp["score"], rel=1e-5)


def test_top_k_keeps_the_likeliest_labels_in_one_shape(
    files: TextClassifier, classifier: OnnxClassifier
) -> None:
    top = load_classifier(spec_for(files, top_k=2), KNOBS)
    assert top.info.details == {"labels": ["negative", "neutral", "positive"], "top_k": 2}
    items = ok(classifier.prepare(TEXTS))
    for short, whole in zip(top.run_batch(items), classifier.run_batch(items), strict=True):
        ranked = sorted(whole["scores"].items(), key=lambda kv: -kv[1])[:2]
        assert set(short) == {"label", "score", "top_k"}
        assert [(e["label"], e["score"]) for e in short["top_k"]] == ranked
        assert (short["label"], short["score"]) == ranked[0]
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        OnnxClassifier(classifier.model, classifier.tokenizer, name="m", top_k=0)
