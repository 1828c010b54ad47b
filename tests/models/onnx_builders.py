"""Small ONNX models built with ``onnx.helper`` for tests, and a word-level tokenizer.

Every builder writes into a folder the test owns and returns the path(s); the weights are
fixed by a seed, so a test can recompute what the model does. Import them from any test::

    from tests.models.onnx_builders import image_classifier, text_classifier

- :func:`image_classifier`: ``input`` float32 ``[batch, 3, 8, 8]`` → ``logits`` ``[batch, 5]``
  (flatten, MatMul, Add); ``batch=2`` writes the same with a FIXED batch dimension; ``label``
  adds an int64 ``label`` output (ArgMax).
- :func:`sequence_scorer`: two inputs with a dynamic non-batch dimension, two outputs.
- :func:`text_classifier`: ``input_ids``/``attention_mask`` → embedding Gather → masked mean →
  MatMul → ``logits`` ``[batch, num_labels]``, with ``config.json`` (``id2label``) and a
  ``tokenizer.json`` beside it.
- :func:`token_encoder`: ``input_ids``/``attention_mask`` → ``(batch, seq, hidden)`` token
  vectors (rows of a table) or their masked mean ``(batch, hidden)``.
- :func:`word_tokenizer`: a WordLevel ``tokenizer.json`` over :data:`WORDS`.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = [
    "IMAGE_SHAPE",
    "SPECIAL_TOKENS",
    "WORDS",
    "TextClassifier",
    "image_classifier",
    "save_model",
    "sequence_scorer",
    "text_classifier",
    "token_encoder",
    "token_table",
    "vocab_size",
    "word_tokenizer",
]

Array = np.ndarray[Any, Any]

#: One image row of :func:`image_classifier` (the batch axis left out).
IMAGE_SHAPE = (3, 8, 8)
IMAGE_CLASSES = 5

#: Token ids 0..3 of :func:`word_tokenizer`; words follow from id 4.
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]")
WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "dog",
    "ran",
    "fast",
    "slow",
    "good",
    "bad",
    "great",
    "awful",
    "movie",
    "film",
    "book",
    "was",
    "is",
    "very",
    "not",
    "really",
    "plot",
    "actors",
    "ending",
]


def save_model(graph: onnx.GraphProto, path: Path) -> Path:
    """Save ``graph`` as an opset-17 model at ``path`` (checked by ``onnx.checker``)."""
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(path))
    return path


def image_classifier(
    folder: Path, *, batch: int | str = "batch", seed: int = 0, label: bool = False
) -> Path:
    """``input`` float32 ``[batch, 3, 8, 8]`` → ``logits`` float32 ``[batch, 5]``.

    ``logits = flatten(input) @ W + b`` with fixed random ``W`` (192 x 5) and ``b``. An int
    ``batch`` declares a fixed batch dimension (a model batchline must refuse). ``label`` adds
    a second output, ``label`` int64 ``[batch]`` = ``argmax(logits)``.
    """
    rng = np.random.default_rng(seed)
    features = int(np.prod(IMAGE_SHAPE))
    weight = rng.normal(size=(features, IMAGE_CLASSES)).astype(np.float32)
    bias = rng.normal(size=(IMAGE_CLASSES,)).astype(np.float32)
    nodes = [
        helper.make_node("Flatten", ["input"], ["flat"], axis=1),
        helper.make_node("MatMul", ["flat", "weight"], ["scores"]),
        helper.make_node("Add", ["scores", "bias"], ["logits"]),
    ]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, IMAGE_CLASSES])]
    if label:
        nodes.append(helper.make_node("ArgMax", ["logits"], ["label"], axis=1, keepdims=0))
        outputs.append(helper.make_tensor_value_info("label", TensorProto.INT64, [batch]))
    graph = helper.make_graph(
        nodes,
        "image_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, [batch, *IMAGE_SHAPE])],
        outputs,
        initializer=[
            numpy_helper.from_array(weight, "weight"),
            numpy_helper.from_array(bias, "bias"),
        ],
    )
    name = "image_classifier.onnx" if isinstance(batch, str) else f"image_fixed_{batch}.onnx"
    name = "image_labeller.onnx" if label else name
    return save_model(graph, folder / name)


def sequence_scorer(folder: Path) -> Path:
    """Two inputs, one with a dynamic non-batch dimension, and two outputs.

    Inputs: ``values`` float32 ``[batch, n]`` and ``weight`` int64 ``[batch]``.
    Outputs: ``total`` float32 ``[batch]`` = ``sum(values) * weight`` and ``doubled`` float32
    ``[batch, n]`` = ``values * 2``.
    """
    graph = helper.make_graph(
        [
            helper.make_node("ReduceSum", ["values", "axis1"], ["sums"], keepdims=0),
            helper.make_node("Cast", ["weight"], ["weight_f"], to=TensorProto.FLOAT),
            helper.make_node("Mul", ["sums", "weight_f"], ["total"]),
            helper.make_node("Mul", ["values", "two"], ["doubled"]),
        ],
        "sequence_scorer",
        [
            helper.make_tensor_value_info("values", TensorProto.FLOAT, ["batch", "n"]),
            helper.make_tensor_value_info("weight", TensorProto.INT64, ["batch"]),
        ],
        [
            helper.make_tensor_value_info("total", TensorProto.FLOAT, ["batch"]),
            helper.make_tensor_value_info("doubled", TensorProto.FLOAT, ["batch", "n"]),
        ],
        initializer=[
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
            numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two"),
        ],
    )
    return save_model(graph, folder / "sequence_scorer.onnx")


def word_tokenizer(path: Path, *, special: bool = True, max_length: int | None = None) -> Path:
    """A WordLevel ``tokenizer.json`` over :data:`WORDS` (ids from 4 on), whitespace split.

    ``special`` wraps each text as ``[CLS] ... [SEP]``; ``max_length`` turns truncation on.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {t: i for i, t in enumerate(SPECIAL_TOKENS)}
    vocab.update({w: len(SPECIAL_TOKENS) + i for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    if special:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
        )
    if max_length is not None:
        tok.enable_truncation(max_length=max_length)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def vocab_size() -> int:
    return len(SPECIAL_TOKENS) + len(WORDS)


def _masked_mean_nodes(table_out: str) -> list[onnx.NodeProto]:
    """Nodes from ``table_out`` ``[b, s, h]`` and ``attention_mask`` to ``mean`` ``[b, h]``."""
    return [
        helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask_3d"]),
        helper.make_node("Mul", [table_out, "mask_3d"], ["masked"]),
        helper.make_node("ReduceSum", ["masked", "axis1"], ["summed"], keepdims=0),
        helper.make_node("ReduceSum", ["mask_3d", "axis1"], ["count"], keepdims=0),
        helper.make_node("Max", ["count", "tiny"], ["count_safe"]),
        helper.make_node("Div", ["summed", "count_safe"], ["mean"]),
    ]


def _text_inputs() -> list[onnx.ValueInfoProto]:
    return [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
        helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
    ]


def _text_constants(table: Array, *, pooled: bool = True) -> list[onnx.TensorProto]:
    constants = [
        numpy_helper.from_array(table, "table"),
        numpy_helper.from_array(np.array([-1], dtype=np.int64), "axis_last"),
    ]
    if pooled:
        constants += [
            numpy_helper.from_array(np.array([1], dtype=np.int64), "axis1"),
            numpy_helper.from_array(np.array(1e-9, dtype=np.float32), "tiny"),
        ]
    else:
        constants.append(numpy_helper.from_array(np.array(0.0, dtype=np.float32), "zero"))
    return constants


def token_encoder(folder: Path, *, pooled: bool, hidden: int = 6, seed: int = 1) -> Path:
    """``input_ids``/``attention_mask`` → token vectors ``table[ids]`` ``[batch, seq, hidden]``
    (output ``token_embeddings``), or with ``pooled`` their masked mean ``[batch, hidden]``
    (output ``sentence_embedding``). The table is ``token_table(hidden, seed)``."""
    table = token_table(hidden, seed)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["tokens"])]
    if pooled:
        nodes += _masked_mean_nodes("tokens")
        nodes.append(helper.make_node("Identity", ["mean"], ["sentence_embedding"]))
        out = helper.make_tensor_value_info(
            "sentence_embedding", TensorProto.FLOAT, ["batch", hidden]
        )
    else:
        # The mask must be used, or ONNX Runtime drops the input: add 0 * mask.
        nodes += [
            helper.make_node("Cast", ["attention_mask"], ["mask_f"], to=TensorProto.FLOAT),
            helper.make_node("Unsqueeze", ["mask_f", "axis_last"], ["mask_3d"]),
            helper.make_node("Mul", ["mask_3d", "zero"], ["mask_zero"]),
            helper.make_node("Add", ["tokens", "mask_zero"], ["token_embeddings"]),
        ]
        out = helper.make_tensor_value_info(
            "token_embeddings", TensorProto.FLOAT, ["batch", "seq", hidden]
        )
    graph = helper.make_graph(
        nodes,
        "token_encoder",
        _text_inputs(),
        [out],
        initializer=_text_constants(table, pooled=pooled),
    )
    return save_model(graph, folder / f"encoder_{'pooled' if pooled else 'tokens'}.onnx")


def token_table(hidden: int = 6, seed: int = 1) -> Array:
    """The embedding table of :func:`token_encoder` and :func:`text_classifier`."""
    return np.random.default_rng(seed).normal(size=(vocab_size(), hidden)).astype(np.float32)


@dataclass(frozen=True)
class TextClassifier:
    """What :func:`text_classifier` wrote."""

    model: Path
    tokenizer: Path
    config: Path | None
    labels: tuple[str, ...]


def text_classifier(
    folder: Path,
    *,
    labels: Sequence[str] = ("negative", "neutral", "positive"),
    num_logits: int | None = None,
    config: bool = True,
    hidden: int = 6,
    seed: int = 2,
) -> TextClassifier:
    """A sequence classifier and its files in ``folder``: ``model.onnx``, ``tokenizer.json``
    and (with ``config``) ``config.json`` whose ``id2label`` holds ``labels``.

    ``logits = masked_mean(table[input_ids]) @ W``, ``W`` of shape ``(hidden, num_logits)``;
    ``num_logits`` defaults to ``len(labels)`` (pass another count for a mismatch).
    """
    width = len(labels) if num_logits is None else num_logits
    table = token_table(hidden, seed)
    weight = np.random.default_rng(seed + 1).normal(size=(hidden, width)).astype(np.float32)
    nodes = [helper.make_node("Gather", ["table", "input_ids"], ["tokens"])]
    nodes += _masked_mean_nodes("tokens")
    nodes.append(helper.make_node("MatMul", ["mean", "weight"], ["logits"]))
    graph = helper.make_graph(
        nodes,
        "text_classifier",
        _text_inputs(),
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", width])],
        initializer=[*_text_constants(table), numpy_helper.from_array(weight, "weight")],
    )
    model = save_model(graph, folder / "model.onnx")
    tokenizer = word_tokenizer(folder / "tokenizer.json", max_length=16)
    config_path: Path | None = None
    if config:
        config_path = folder / "config.json"
        id2label = {str(i): label for i, label in enumerate(labels)}
        config_path.write_text(
            json.dumps({"architectures": ["TinyClassifier"], "id2label": id2label}),
            encoding="utf-8",
        )
    return TextClassifier(model, tokenizer, config_path, tuple(labels))
