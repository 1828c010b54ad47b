"""Where batchline keeps what it builds once: the default model's ONNX graph, the smollm2
safetensors folder, a GGUF file's config and tokenizer, the demo corpus and prompts; and how
such a file (:func:`write_whole`) or folder (:func:`build_folder_whole`) is written whole.
Standard library only (platformdirs is imported when no ``BATCHLINE_CACHE_DIR`` is set)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

__all__ = ["build_folder_whole", "cache_dir", "kernel_dir", "make_cache_folder", "write_whole"]

#: A scratch folder this old was left by a killed build (a live one takes minutes at most).
STALE_SCRATCH_S = 3600.0


def cache_dir() -> Path:
    """``$BATCHLINE_CACHE_DIR`` if set, else the platform's user cache directory for batchline."""
    env = os.environ.get("BATCHLINE_CACHE_DIR")
    if env:
        return Path(env)
    import platformdirs

    return Path(platformdirs.user_cache_dir("batchline"))


def kernel_dir() -> Path:
    """Where compiled CPU kernels are kept: ``$BATCHLINE_KERNEL_DIR`` if set, else ``kernels/``
    in :func:`cache_dir`. A kernel's file is named by its sources, compiler, torch and CPU
    flags, so one folder serves every cache folder on a machine: a job run with a cache folder
    of its own loads the kernel built once instead of compiling it again (~45 s on two cores)."""
    env = os.environ.get("BATCHLINE_KERNEL_DIR")
    return Path(env) if env else cache_dir() / "kernels"


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


def build_folder_whole(target: Path, build: Callable[[Path], None], site: str) -> None:
    """Make the cache folder ``target`` whole or not at all: ``build`` fills a scratch folder
    beside it, which is then renamed into place, so a reader sees every file or none. Where
    another process renamed its own first (``target`` has a ``config.json``), theirs stays and
    ours is dropped. Scratch folders of ``target`` left by a killed build are removed first.
    Raises ``ModelError`` where the cache folder cannot be made, and what ``build`` or the
    rename raises (the scratch folder removed); ``site`` names the rename for the fault tests
    (``batchline._fsio.checkpoint``)."""
    from batchline._fsio import checkpoint

    root = target.parent
    make_cache_folder(root)
    now = time.time()
    for old in root.glob(f".{target.name}.*.tmp"):
        with contextlib.suppress(OSError):
            if now - old.stat().st_mtime > STALE_SCRATCH_S:
                shutil.rmtree(old, ignore_errors=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=root))
    try:
        build(scratch)
        try:
            checkpoint(site, "rename", target)
            os.rename(scratch, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        if scratch.exists():
            shutil.rmtree(scratch, ignore_errors=True)
