"""ONNX models behind the seam, one module per task: ``embed`` (text encoders), ``classify``
(sequence classifiers) and ``predict`` (tensors in, tensors out), each with its ``load_*``
function; ``sessions`` lays out their ONNX Runtime sessions from the knobs, ``runtime`` runs
them, ``embedder`` and ``minilm`` are the text encoder and the built-in model's weights.
Nothing here imports the loader: :func:`batchline.models.loader.load_model` dispatches to
these modules, never the other way round. ``load_tokenizer`` (a ``tokenizer.json`` as the
text models read it) and the int8 quality gate of ``quantize`` are the names used from
outside."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.models.onnx.embedder import load_tokenizer
    from batchline.models.onnx.quantize import (
        GATE,
        Quality,
        cached_quality,
        compare_vectors,
        measure_quality,
        store_quality,
    )

__all__ = [
    "GATE",
    "Quality",
    "cached_quality",
    "compare_vectors",
    "load_tokenizer",
    "measure_quality",
    "store_quality",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "load_tokenizer": "embedder",
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
