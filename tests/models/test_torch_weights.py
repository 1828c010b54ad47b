"""A mapped file's pages given back once the weights viewing them are replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from batchline.models.common.torch_weights import (  # noqa: E402
    release_file_pages,
    release_file_ranges,
)

linux_only = pytest.mark.skipif(sys.platform != "linux", reason="madvise and /proc are Linux's")


def _rss_file_kib() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1])
    raise AssertionError("no RssFile in /proc/self/status")


@linux_only
def test_a_mapped_files_pages_go_back_and_its_values_are_read_again(tmp_path: Path) -> None:
    values = torch.arange(4 * 2**20, dtype=torch.float32)  # 16 MiB
    path = tmp_path / "weights.bin"
    path.write_bytes(values.numpy().tobytes())
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    mapped = torch.tensor([], dtype=torch.float32).set_(storage)  # a view of the mapping
    assert float(mapped.sum()) == float(values.sum())  # every page touched
    touched = _rss_file_kib()
    released = release_file_pages([mapped[1:]])  # not page-aligned at its start
    assert 16 * 2**20 - 2 * 4096 <= released < 16 * 2**20
    assert _rss_file_kib() <= touched - 15 * 1024
    assert torch.equal(mapped, values)  # read from the file again


@linux_only
def test_memory_that_maps_no_file_is_never_touched() -> None:
    own = torch.arange(4 * 2**20, dtype=torch.float32)
    assert release_file_pages([own]) == 0
    assert torch.equal(own, torch.arange(4 * 2**20, dtype=torch.float32))


@linux_only
def test_a_numpy_view_of_a_mapped_file_gives_its_pages_back_by_range(tmp_path: Path) -> None:
    """A GGUF file's tensors are numpy views of one np.memmap of it."""
    import numpy as np

    values = np.arange(4 * 2**20, dtype=np.float32)  # 16 MiB
    path = tmp_path / "weights.gguf"
    path.write_bytes(values.tobytes())
    mapped = np.memmap(path, mode="r", dtype=np.uint8)
    view = mapped[100:].view(np.uint8)  # not page-aligned at its start
    view[::4096].sum()  # every page touched
    touched = _rss_file_kib()
    released = release_file_ranges([(view.ctypes.data, view.nbytes)])
    assert 16 * 2**20 - 2 * 4096 <= released < 16 * 2**20
    assert _rss_file_kib() <= touched - 15 * 1024
    assert np.array_equal(mapped.view(np.float32), values)  # read from the file again
    assert release_file_ranges([(values.ctypes.data, values.nbytes)]) == 0  # no file: untouched
