"""Image models: what an image model needs done to a picture before its batch runs.

The package face: code outside ``batchline.models`` imports from here, never from the inner
modules. Pillow and numpy are imported where used, so importing this face costs nothing.

- ``preprocess``: :class:`ImagePreprocess`, resize, crop, rescale and normalize as one value;
- ``decode``: :class:`ImageRef` (where a picture's bytes are) and :func:`decode_image`;
- ``pool``: :class:`DecodePool`, decode and preprocess in worker processes, bounded in bytes;
- ``options``: :class:`ImageOptions`, a plain ONNX model's ``--image-size``/``--mean``/``--std``;
- ``onnx_image``: the plain ONNX image model (loaded by ``models/loader.py``).
"""

from __future__ import annotations

from batchline.models.image.decode import (
    DEFAULT_MAX_PIXELS,
    IMAGE_SUFFIXES,
    ImageRef,
    decode_image,
)
from batchline.models.image.options import ImageOptions
from batchline.models.image.pool import (
    Decoded,
    DecodeOptions,
    DecodePool,
    DecodeStats,
    choose_workers,
    content_key,
)
from batchline.models.image.preprocess import ImagePreprocess

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE_SUFFIXES",
    "DecodeOptions",
    "DecodePool",
    "DecodeStats",
    "Decoded",
    "ImageOptions",
    "ImagePreprocess",
    "ImageRef",
    "choose_workers",
    "content_key",
    "decode_image",
]
