"""Image models: what an image model needs done to a picture before its batch runs, and the
Hugging Face image folders behind the seam (classifiers, CLIP and SigLIP, DINOv2).

The package face: code outside ``batchline.models`` imports from here, never from the inner
modules. Pillow, numpy, ONNX Runtime and torch are imported where used, so importing this
face costs nothing: the model names below load their module on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports
from batchline.models.image.preprocess import ImagePreprocess
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
    "ImageClassifier",
    "ImageEmbedder",
    "ImagePreprocess",
    "PaddedTextEmbedder",
    "ZeroShotClassifier",
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
