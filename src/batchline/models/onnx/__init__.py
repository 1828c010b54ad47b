"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out), each with its ``load_*``
function; ``sessions`` lays out their ONNX Runtime sessions from the knobs, ``runtime`` runs
them, ``embedder`` and ``minilm`` are the text encoder and the built-in model's weights.
Nothing here imports the loader: :func:`batchline.models.loader.load_model` dispatches to
these modules, never the other way round. ``load_tokenizer`` (a ``tokenizer.json`` as the
text models read it), the int8 quality gate of ``quantize``, and what another backend builds
its ONNX models from (``SessionModel``, ``load_sessions_at``, the classifiers' result
``classification`` and ``softmax``, ``load_onnx_embedder``) are the names used from outside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.models.onnx.classify import Classification, classification, softmax
    from batchline.models.onnx.embed import load_onnx_embedder
    from batchline.models.onnx.embedder import load_tokenizer
    from batchline.models.onnx.quantize import (
        GATE,
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
    "Classification",
    "OnnxModel",
    "Quality",
    "SessionModel",
    "cached_quality",
    "classification",
    "compare_vectors",
    "load_onnx_embedder",
    "load_sessions_at",
    "load_tokenizer",
    "measure_quality",
    "softmax",
    "store_quality",
]

__getattr__ = lazy_exports(
    __name__,
    {
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
                "Quality",
                "cached_quality",
                "compare_vectors",
                "measure_quality",
                "store_quality",
            )
        },
    },
)
