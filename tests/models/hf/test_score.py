"""The score task: a cross-encoder folder converted to ONNX scores (query, document) pairs as
sentence-transformers' CrossEncoder does (fp32, max abs difference <= 1e-4)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_spec, parse_specs
from tests.models.hf.conftest import save_bert, write_json

PAIRS = [
    ("hello world", "the cat sat on the mat"),
    ("paris", "query document hello cat sat on the mat mat mat"),
    ("the cat", "hello"),
]


@pytest.fixture(scope="module")
def reranker(torch_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-label BertForSequenceClassification saved by CrossEncoder (its layout)."""
    from sentence_transformers import CrossEncoder

    plain = save_bert(tmp_path_factory.mktemp("ce") / "plain", labels=1, seed=3)
    folder = plain.parent / "reranker"
    CrossEncoder(str(plain), device="cpu").save(str(folder))
    return folder


@pytest.fixture(scope="module")
def scorer(reranker: Path) -> Any:
    return load_model(parse_spec(f"{reranker}/"), Knobs(sessions=1))


def test_a_cross_encoder_scores_as_sentence_transformers_does(reranker: Path, scorer: Any) -> None:
    from sentence_transformers import CrossEncoder

    info = scorer.info
    assert (info.task, info.input_kind, info.cost_kind, info.result_kind, info.result_column) == (
        "score",
        "record",
        "padded",
        "value",
        "score",
    )
    assert info.max_tokens == 64
    items = scorer.prepare([{"query": q, "document": d} for q, d in PAIRS])
    ours = np.array([scorer.encode(s) for s in scorer.run_batch(items)])
    expected = CrossEncoder(str(reranker), device="cpu").predict(PAIRS)
    assert np.abs(ours - expected).max() <= 1e-4
    # a pair alone scores the same as in a padded batch
    alone = scorer.run_batch(scorer.prepare([list(PAIRS[2])]))
    assert abs(alone[0] - ours[2]) <= 1e-5
    assert all(isinstance(scorer.encode(s), float) for s in ours)


def test_a_pair_is_tokenized_with_the_pair_template(scorer: Any) -> None:
    (item,) = scorer.prepare([("hello", "cat")])
    # [CLS] hello [SEP] cat [SEP], the document's tokens in segment 1
    assert item.type_ids.tolist() == [0, 0, 0, 1, 1]
    assert scorer.cost(item) == len(item) == 5


def test_a_bad_input_fails_alone(scorer: Any) -> None:
    prepared = scorer.prepare(
        [
            {"query": "hello", "document": "cat"},
            {"query": "hello"},
            ["one", "two", "three"],
            ["hello", 3],
            "just text",
        ]
    )
    good, *bad = prepared
    assert len(scorer.run_batch([good])) == 1
    messages = [str(e) for e in bad]
    assert all(isinstance(e, InputError) for e in bad)
    assert messages == [
        "a score input needs string 'query' and 'document' fields, got query=str, "
        "document=NoneType",
        "a score input as a list must be [query, document], got 3 items",
        "a score input as a list must be [query, document] (two strings), got int",
        "a score input is {'query': ..., 'document': ...} or [query, document], got str",
    ]


def test_a_one_label_classifier_scores_and_identity_keeps_the_logit(
    torch_ready: None, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = save_bert(tmp_path / "one", labels=1, seed=4)
    assert parse_spec(f"{folder}/").task == "score"
    write_json(
        folder / "config_sentence_transformers.json",
        {"model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.linear.Identity"},
    )
    model = load_model(parse_spec(f"{folder}/"), Knobs(sessions=1))
    ours = np.array(model.run_batch(model.prepare(PAIRS)))
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    queries, documents = zip(*PAIRS, strict=True)
    with torch.no_grad():
        batch = tok(list(queries), list(documents), padding=True, return_tensors="pt")
        logits = hf(**batch).logits[:, 0].numpy()
    assert np.abs(ours - logits).max() <= 1e-4


def test_a_classifier_with_several_labels_does_not_score(torch_ready: None, tmp_path: Path) -> None:
    folder = save_bert(tmp_path / "three", labels=3)
    with pytest.raises(InputError, match="this one has 3 labels; use --task classify") as info:
        parse_specs([f"{folder}/"], tasks=["score"])
    assert "\n" not in str(info.value)


def test_an_onnx_file_or_folder_scores_with_task_score(
    reranker: Path, scorer: Any, tmp_path: Path
) -> None:
    """The converted file as PATH.onnx --task score, and as a folder's model.onnx."""
    folder = tmp_path / "onnx-reranker"
    folder.mkdir()
    shutil.copy(scorer.model.path, folder / "model.onnx")
    for name in ("tokenizer.json", "config.json"):
        shutil.copy(reranker / name, folder / name)
    expected = scorer.run_batch(scorer.prepare(PAIRS))
    from_folder = load_model(parse_spec(f"{folder}/"), Knobs(sessions=1))
    assert from_folder.info.task == "score"
    assert np.allclose(from_folder.run_batch(from_folder.prepare(PAIRS)), expected, atol=1e-6)
    (spec,) = parse_specs([str(folder / "model.onnx")], tasks=["score"])
    from_file = load_model(spec, Knobs(sessions=1))
    assert np.allclose(from_file.run_batch(from_file.prepare(PAIRS)), expected, atol=1e-6)
    # the config says a one-label classifier; with no config the graph decides
    (folder / "config.json").write_text(json.dumps({}), encoding="utf-8")
    assert parse_spec(f"{folder}/").task is None
