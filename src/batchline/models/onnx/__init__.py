"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out), each with its ``load_*``
function; ``sessions`` lays out their ONNX Runtime sessions from the knobs, ``runtime`` runs
them, ``embedder`` and ``minilm`` are the text encoder and the built-in model's weights.
``backend`` is the backend the registry holds (:data:`ONNX`: which specs it takes, the task
an ``.onnx`` graph says, its memory and identity). Nothing here imports the loader or the
registry: they ask this backend, never the other way round. ``load_tokenizer`` (a
``tokenizer.json`` as the text models read it), the int8 quality gate of ``quantize``, and
what another backend builds its ONNX models from (``SessionModel``, ``load_sessions_at``, the
classifiers' result ``classification`` and ``softmax``, the task loaders, the text classifier
and cross-encoder over any ``TextGraph`` (``OnnxClassifier``, ``OnnxScorer``: the graph
protocols ``Graph`` and ``TextGraph`` are what another runtime implements), the BERT graph
builder, the text record ``TokenizedText`` and its collate ``pad_sequences``, the memory rule
``onnx_footprint``) are the names used from outside: another backend imports them from here,
never from this package's modules."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.models.onnx.backend import ONNX, graph_task, onnx_footprint, onnx_identity
    from batchline.models.onnx.bert import BUILDER_VERSION, bert_covers, build_bert
    from batchline.models.onnx.classify import (
        Classification,
        OnnxClassifier,
        classification,
        labels_from_config,
        load_onnx_classifier,
        softmax,
    )
    from batchline.models.onnx.embed import load_onnx_embedder
    from batchline.models.onnx.embedder import (
        DenseLayer,
        EmbedderOptions,
        TokenizedText,
        load_tokenizer,
    )
    from batchline.models.onnx.options import PRECISIONS, Precision, SessionOptions
    from batchline.models.onnx.quantize import (
        GATE,
        QUANTIZE_VERSION,
        Quality,
        cached_quality,
        compare_vectors,
        measure_quality,
        store_quality,
    )
    from batchline.models.onnx.runtime import OnnxModel, OnnxTensor, pad_sequences
    from batchline.models.onnx.score import OnnxScorer, load_onnx_scorer
    from batchline.models.onnx.sessions import (
        Graph,
        SessionModel,
        Shaped,
        TextGraph,
        load_sessions_at,
        tokenizer_path,
    )

#: Each name this face exports, and the module of this package it lives in.
_HOMES = {
    "backend": ("ONNX", "graph_task", "onnx_footprint", "onnx_identity"),
    "bert": ("BUILDER_VERSION", "bert_covers", "build_bert"),
    "classify": (
        "Classification",
        "OnnxClassifier",
        "classification",
        "labels_from_config",
        "load_onnx_classifier",
        "softmax",
    ),
    "embed": ("load_onnx_embedder",),
    "embedder": ("DenseLayer", "EmbedderOptions", "TokenizedText", "load_tokenizer"),
    "options": ("PRECISIONS", "Precision", "SessionOptions"),
    "quantize": (
        "GATE",
        "QUANTIZE_VERSION",
        "Quality",
        "cached_quality",
        "compare_vectors",
        "measure_quality",
        "store_quality",
    ),
    "runtime": ("OnnxModel", "OnnxTensor", "pad_sequences"),
    "score": ("OnnxScorer", "load_onnx_scorer"),
    "sessions": (
        "Graph",
        "SessionModel",
        "Shaped",
        "TextGraph",
        "load_sessions_at",
        "tokenizer_path",
    ),
}

__all__ = [
    "BUILDER_VERSION",
    "GATE",
    "ONNX",
    "PRECISIONS",
    "QUANTIZE_VERSION",
    "Classification",
    "DenseLayer",
    "EmbedderOptions",
    "Graph",
    "OnnxClassifier",
    "OnnxModel",
    "OnnxScorer",
    "OnnxTensor",
    "Precision",
    "Quality",
    "SessionModel",
    "SessionOptions",
    "Shaped",
    "TextGraph",
    "TokenizedText",
    "bert_covers",
    "build_bert",
    "cached_quality",
    "classification",
    "compare_vectors",
    "graph_task",
    "labels_from_config",
    "load_onnx_classifier",
    "load_onnx_embedder",
    "load_onnx_scorer",
    "load_sessions_at",
    "load_tokenizer",
    "measure_quality",
    "onnx_footprint",
    "onnx_identity",
    "pad_sequences",
    "softmax",
    "store_quality",
    "tokenizer_path",
]

__getattr__ = lazy_exports(
    __name__, {name: module for module, names in _HOMES.items() for name in names}
)
