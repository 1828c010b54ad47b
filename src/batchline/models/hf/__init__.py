"""Hugging Face model folders behind the seam: a folder as people hold it (a
sentence-transformers embedder, a sequence classifier, a cross-encoder reranker, a causal LM,
or a folder with a ``model.onnx``) is read once for what it is (``detect``), converted once
to what runs it fast (``convert``), and loaded by the backend that fits (``load``).

Nothing heavy is imported here: the names below load their module on first use, and the
conversion needs torch only where the folder's architecture has no graph builder of our own.
"""

from __future__ import annotations

from batchline._lazy import lazy_exports

__all__ = ["FolderModel", "convert", "detect_folder", "load_folder_model"]

__getattr__ = lazy_exports(
    __name__,
    {
        "FolderModel": "detect",
        "detect_folder": "detect",
        "convert": "convert",
        "load_folder_model": "load",
    },
)
