"""Image models: what an image model needs done to a picture before its batch runs, and the
Hugging Face image folders behind the seam (classifiers, CLIP and SigLIP, DINOv2).

The package face: code outside ``batchline.models`` imports from here, never from the inner
modules. Pillow, numpy, ONNX Runtime and torch are imported where used, so importing this
face costs nothing: the model names below load their module on first use.

- ``preprocess``: :class:`ImagePreprocess`, resize, crop, rescale and normalize as one value;
- ``processor_config``: :func:`preprocess_from_config`, an ``ImagePreprocess`` from a folder's
  ``preprocessor_config.json``;
- ``decode``: :class:`ImageRef` (where a picture's bytes are) and :func:`decode_image`;
- ``pool``: :class:`DecodePool`, decode and preprocess in worker processes, bounded in bytes;
- :class:`ImageOptions` (``models/common/image_options.py``, as the spec holds it): a plain
  ONNX model's ``--image-size``/``--mean``/``--std``;
- ``onnx_image``: the plain ONNX image model;
- ``backend``: the image backend the registry holds (folders and a plain ``.onnx``);
- ``hf_image`` and ``load``: the Hugging Face image folders (classifier, embedder, zero-shot).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports
from batchline.models.common.image_options import ImageOptions
from batchline.models.image.decode import (
    DEFAULT_MAX_PIXELS,
    IMAGE_SUFFIXES,
    ImageRef,
    TooManyPixelsError,
    decode_image,
)
from batchline.models.image.pool import (
    Decoded,
    DecodeOptions,
    DecodePool,
    DecodeStats,
    choose_workers,
    content_key,
)
from batchline.models.image.preprocess import PICTURE_TOKENS, ImagePreprocess
from batchline.models.image.processor_config import preprocess_from_config

if TYPE_CHECKING:
    from batchline.models.image.hf_image import (
        ImageClassifier,
        ImageEmbedder,
        PaddedTextEmbedder,
        ZeroShotClassifier,
    )
    from batchline.models.image.load import load_image_folder

__all__ = [
    "DEFAULT_MAX_PIXELS",
    "IMAGE_SUFFIXES",
    "PICTURE_TOKENS",
    "DecodeOptions",
    "DecodePool",
    "DecodeStats",
    "Decoded",
    "ImageClassifier",
    "ImageEmbedder",
    "ImageOptions",
    "ImagePreprocess",
    "ImageRef",
    "PaddedTextEmbedder",
    "TooManyPixelsError",
    "ZeroShotClassifier",
    "choose_workers",
    "content_key",
    "decode_image",
    "load_image_folder",
    "preprocess_from_config",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "ImageClassifier": "hf_image",
        "ImageEmbedder": "hf_image",
        "PaddedTextEmbedder": "hf_image",
        "ZeroShotClassifier": "hf_image",
        "load_image_folder": "load",
    },
)
