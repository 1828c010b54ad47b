"""``.npy``: one array; each row along axis 0 is a record (one tensor input), ids are indices."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from batchline._errors import InputError
from batchline._types import Array
from batchline.datasets.formats.base import Item, Record, Skipper, Source

__all__ = ["NpySource"]


class NpySource(Source):
    def _read_columns(self) -> bool:
        self._refuse_columns("a .npy file", "the row indices")
        array = self._npy_array()
        self.columns = self.input_columns
        self.extra_columns = ()
        self.total_records = int(array.shape[0])
        return False

    def _npy_array(self) -> Array:
        try:
            array = np.load(self.path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError) as exc:
            raise InputError(f"{self.path}: not a readable .npy array: {exc}") from None
        if not isinstance(array, np.ndarray):
            raise InputError(f"{self.path}: holds several arrays (.npz), not one .npy array")
        if array.ndim < 1:
            raise InputError(f"{self.path}: holds a scalar; records are the rows along axis 0")
        if array.dtype.kind not in "biuf":
            raise InputError(
                f"{self.path}: holds {array.dtype} values, not numbers, so not a tensor input"
            )
        return array

    def _items(self, skipper: Skipper, block_size: int) -> Iterator[Item]:
        array = self._npy_array()
        name = self.input_columns[0]
        rows = int(array.shape[0])
        for index in range(rows):
            if skipper.skipped(index):
                continue
            # a copy: the block in memory, not a view that keeps reading the mapped file
            yield Record(index, str(index), "", {}, {name: np.array(array[index])})
        self.total_records = rows
