"""Where batchline keeps what it builds once: the default model's ONNX graph, the smollm2
safetensors folder, the demo corpus and prompts; and how such a file is written whole.
Standard library only (platformdirs is imported when no ``BATCHLINE_CACHE_DIR`` is set)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir", "make_cache_folder", "write_whole"]


def cache_dir() -> Path:
    """``$BATCHLINE_CACHE_DIR`` if set, else the platform's user cache directory for batchline."""
    env = os.environ.get("BATCHLINE_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("batchline"))


def make_cache_folder(folder: Path) -> None:
    """Create ``folder`` (and its parents) for something built once; ``ModelError`` saying how
    to point the cache elsewhere when it cannot be made."""
    from batchline._errors import ModelError

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelError(
            f"cannot create the model cache folder {folder}: {exc}; "
            "set BATCHLINE_CACHE_DIR to a writable folder"
        ) from exc


def write_whole(path: Path, data: bytes, site: str) -> None:
    """Write ``data`` to ``path`` through a temporary file beside it, fsync'd and renamed over
    it: a reader never sees half a file, and two processes writing at once both end with a
    whole one (``batchline._fsio.write_whole``; ``site`` names the write for its tests)."""
    from batchline import _fsio

    _fsio.write_whole(path, data, site)
