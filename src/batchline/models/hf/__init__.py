"""Hugging Face model folders behind the seam: a folder as people hold it (a
sentence-transformers embedder, a sequence classifier, a cross-encoder reranker, a causal LM,
or a folder with a ``model.onnx``) is read once for what it is (``detect``), converted once
to what runs it fast (``convert``), and loaded by the backend that fits (``load``).

Nothing heavy is imported here: the names below load their module on first use, and the
conversion needs torch only where the folder's architecture has no graph builder of our own.
"""

from __future__ import annotations

import importlib

__all__ = ["FolderModel", "convert", "detect_folder", "load_folder_model"]

_WHERE = {
    "FolderModel": "detect",
    "detect_folder": "detect",
    "convert": "convert",
    "load_folder_model": "load",
}


def __getattr__(name: str) -> object:
    if name in _WHERE:
        return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
