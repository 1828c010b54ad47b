"""Image models: what an image model needs done to a picture before its batch runs.

The package face: code outside ``batchline.models`` imports from here, never from the inner
modules. Pillow and numpy are imported where used, so importing this face costs nothing.
"""

from __future__ import annotations

from batchline.models.image.preprocess import ImagePreprocess
from batchline.models.image.processor_config import preprocess_from_config

__all__ = ["ImagePreprocess", "preprocess_from_config"]
