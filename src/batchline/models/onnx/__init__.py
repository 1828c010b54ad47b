"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out), each with its ``load_*``
function; ``sessions`` lays out their ONNX Runtime sessions from the knobs, ``runtime`` runs
them, ``embedder`` and ``minilm`` are the text encoder and the built-in model's weights.
``backend`` is the backend the registry holds (:data:`ONNX`: which specs it takes, the task
an ``.onnx`` graph says, its memory and identity). Nothing here imports the loader or the
registry: they ask this backend, never the other way round. ``load_tokenizer`` (a
``tokenizer.json`` as the text models read it), the int8 quality gate of ``quantize``, and
what another backend builds its ONNX models from (``SessionModel``, ``load_sessions_at``, the
classifiers' result ``classification`` and ``softmax``, ``load_onnx_embedder``, the memory
rule ``onnx_footprint``) are the names used from outside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.models.onnx.backend import ONNX, graph_task, onnx_footprint, onnx_identity
    from batchline.models.onnx.classify import Classification, classification, softmax
    from batchline.models.onnx.embed import load_onnx_embedder
    from batchline.models.onnx.embedder import load_tokenizer
    from batchline.models.onnx.quantize import (
        GATE,
        QUANTIZE_VERSION,
        Quality,
        cached_quality,
        compare_vectors,
        measure_quality,
        store_quality,
    )
    from batchline.models.onnx.runtime import OnnxModel
    from batchline.models.onnx.sessions import SessionModel, load_sessions_at

__all__ = [
    "GATE",
    "ONNX",
    "QUANTIZE_VERSION",
    "Classification",
    "OnnxModel",
    "Quality",
    "SessionModel",
    "cached_quality",
    "classification",
    "compare_vectors",
    "graph_task",
    "load_onnx_embedder",
    "load_sessions_at",
    "load_tokenizer",
    "measure_quality",
    "onnx_footprint",
    "onnx_identity",
    "softmax",
    "store_quality",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "ONNX": "backend",
        "graph_task": "backend",
        "onnx_footprint": "backend",
        "onnx_identity": "backend",
        "load_tokenizer": "embedder",
        "Classification": "classify",
        "classification": "classify",
        "softmax": "classify",
        "load_onnx_embedder": "embed",
        "OnnxModel": "runtime",
        "SessionModel": "sessions",
        "load_sessions_at": "sessions",
        **{
            name: "quantize"
            for name in (
                "GATE",
                "QUANTIZE_VERSION",
                "Quality",
                "cached_quality",
                "compare_vectors",
                "measure_quality",
                "store_quality",
            )
        },
    },
)
