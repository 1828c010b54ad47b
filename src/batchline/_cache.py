"""Where batchline keeps what it builds once: the default model's ONNX graph, the smollm2
safetensors folder, the demo corpus and prompts. Standard library only (platformdirs is
imported when no ``BATCHLINE_CACHE_DIR`` is set)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir() -> Path:
    """``$BATCHLINE_CACHE_DIR`` if set, else the platform's user cache directory for batchline."""
    env = os.environ.get("BATCHLINE_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("batchline"))
