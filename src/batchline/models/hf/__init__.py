"""Hugging Face model folders behind the seam: a folder as people hold it (a
sentence-transformers embedder, a sequence classifier, a cross-encoder reranker, a causal LM,
or a folder with a ``model.onnx``) is read once for what it is as every spec is parsed
(``models/common/folder.py``), converted once to what runs it fast (``convert``), and loaded
by the backend that fits (``load``, registered by ``backend``).

Nothing heavy is imported here: the names below load their module on first use, and the
conversion needs torch only where the folder's architecture has no graph builder of our own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline._lazy import lazy_exports

# read with the standard library alone, by specs too: below every backend, in models/common/
from batchline.models.common.folder import FolderModel, detect_folder, read_json_object

if TYPE_CHECKING:
    from batchline.models.hf.convert import convert, convert_with
    from batchline.models.hf.export import OPSET, require_torch
    from batchline.models.hf.load import load_folder_model

__all__ = [
    "OPSET",
    "FolderModel",
    "convert",
    "convert_with",
    "detect_folder",
    "load_folder_model",
    "read_json_object",
    "require_torch",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "convert": "convert",
        "convert_with": "convert",
        "OPSET": "export",
        "require_torch": "export",
        "load_folder_model": "load",
    },
)
