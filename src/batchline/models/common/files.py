"""A model's files as its identity and its footprint read them (standard library only)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

__all__ = ["size", "tree", "version"]


def tree(folder: Path) -> list[Path]:
    """The folder's files, but hidden ones and Python's bytecode (written when imported)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix != ".pyc"
        and not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(folder).parts
        )
    )


def size(path: Path | None) -> int:
    """A file's size (with torch.onnx's external ``.data`` beside it), or a folder's; 0 when
    it is not there."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        data = path.with_name(path.name + ".data")
        return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def version(package: str) -> str:
    """An installed distribution's version, ``""`` when it is not installed."""
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
