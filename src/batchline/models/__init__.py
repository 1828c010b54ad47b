"""Model backends (``pip install 'batchline[onnx]'``).

- :class:`OnnxModel`: any ``.onnx`` file behind a thread-safe pool of ONNX Runtime sessions,
  with a load-time check that the batch axis is dynamic.
- :func:`pad_sequences`, :func:`stack_equal`, :func:`split_rows`: collate helpers.
"""

from __future__ import annotations

from batchline.models.onnxruntime import (
    OnnxModel,
    TensorSpec,
    pad_sequences,
    split_rows,
    stack_equal,
)

__all__ = [
    "OnnxModel",
    "TensorSpec",
    "pad_sequences",
    "split_rows",
    "stack_equal",
]
