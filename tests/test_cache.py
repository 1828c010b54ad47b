"""``batchline._cache``: where things built once are kept, and the one error when they cannot be."""

from __future__ import annotations

from pathlib import Path

import pytest

from batchline._cache import kernel_dir, make_cache_folder, write_whole
from batchline._errors import ModelError


def test_a_cache_folder_is_made_or_the_error_says_how_to_move_it(tmp_path: Path) -> None:
    folder = tmp_path / "a" / "b"
    make_cache_folder(folder)
    make_cache_folder(folder)  # already there: fine
    assert folder.is_dir()
    blocked = tmp_path / "file"
    blocked.write_text("not a folder")
    with pytest.raises(
        ModelError,
        match=r"cannot create the model cache folder .*file/sub: .*"
        r"set BATCHLINE_CACHE_DIR to a writable folder",
    ):
        make_cache_folder(blocked / "sub")


def test_a_file_is_written_whole(tmp_path: Path) -> None:
    target = tmp_path / "deep" / "graph.onnx"
    write_whole(target, b"bytes", "cache.test")
    assert target.read_bytes() == b"bytes"
    assert [p.name for p in target.parent.iterdir()] == ["graph.onnx"]  # no temporary left


def test_the_kernel_folder_is_its_own_setting_else_the_caches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("BATCHLINE_KERNEL_DIR", raising=False)
    assert kernel_dir() == tmp_path / "cache" / "kernels"
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", str(tmp_path / "shared"))
    assert kernel_dir() == tmp_path / "shared"
    monkeypatch.setenv("BATCHLINE_KERNEL_DIR", "")  # empty: unset
    assert kernel_dir() == tmp_path / "cache" / "kernels"
