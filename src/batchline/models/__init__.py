"""Model backends (``pip install 'batchline[onnx]'``).

- :class:`OnnxModel`: any ``.onnx`` file behind a thread-safe pool of ONNX Runtime sessions,
  with a load-time check that the batch axis is dynamic.
- :class:`Embedder`: texts to sentence vectors in two stages (``tokenize``, ``embed_tokens``);
  :meth:`Embedder.default` is all-MiniLM-L6-v2, built to ONNX without torch and cached.
- :class:`TokenizedText`: one tokenized text, the record a batcher queues (cost: its tokens).
- :class:`OnnxTensor`: a graph input or output as ONNX Runtime reports it.
- :func:`pad_sequences`, :func:`stack_equal`, :func:`split_rows`: collate helpers.

Example::

    from batchline.models import Embedder

    vectors = Embedder.default().embed_sync(["hello world"])   # (1, 384) float32
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

if TYPE_CHECKING:
    from batchline.models.onnx.embedder import (
        DEFAULT_TARGET_BATCH_TOKENS,
        Embedder,
        TokenizedText,
        load_tokenizer,
    )
    from batchline.models.onnx.runtime import (
        OnnxModel,
        OnnxTensor,
        pad_sequences,
        split_rows,
        stack_equal,
    )

__all__ = [
    "DEFAULT_TARGET_BATCH_TOKENS",
    "Embedder",
    "OnnxModel",
    "OnnxTensor",
    "TokenizedText",
    "load_tokenizer",
    "pad_sequences",
    "split_rows",
    "stack_equal",
]

# Imported on first use: this package needs its extra only when a name is used.
__getattr__ = lazy_exports(
    __name__,
    {
        "DEFAULT_TARGET_BATCH_TOKENS": "onnx.embedder",
        "Embedder": "onnx.embedder",
        "OnnxModel": "onnx.runtime",
        "OnnxTensor": "onnx.runtime",
        "TokenizedText": "onnx.embedder",
        "load_tokenizer": "onnx.embedder",
        "pad_sequences": "onnx.runtime",
        "split_rows": "onnx.runtime",
        "stack_equal": "onnx.runtime",
    },
)
