"""CSV rows that pyarrow's block reader cannot take as they come (issue 53): a cell larger than
a block is read (the block grows, and the reader goes on from where it was, each row once); a
row whose cell is not UTF-8 is named, and skipped under ``--on-bad-record skip``; a cell past
the largest block is named in one error."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("pyarrow")

from batchline._errors import InputError
from batchline.datasets.formats import csv as csv_format
from batchline.datasets.sources import BadRecord, Record, open_source


def _write(path: Path, big: int, *, at: int = 5, rows: int = 9) -> Path:
    lines = ["id,text"]
    for i in range(rows):
        text = '"' + "x\ny" * (big // 3) + '"' if i == at else f"small {i}"
        lines.append(f"r{i},{text}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _items(path: Path, policy: str = "raise") -> list[Record | BadRecord]:
    source = open_source(path, id_column="id", on_bad_record=policy)  # type: ignore[arg-type]
    return [item for block in source.iter_blocks(4) for item in block]


def test_a_cell_larger_than_a_block_is_read_each_row_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(csv_format, "_READ_BLOCK_BYTES", 1024)
    items = _items(_write(tmp_path / "big.csv", 50_000))  # 1 KiB x 4^3 takes it
    assert [r.id for r in items] == [f"r{i}" for i in range(9)]
    assert all(isinstance(r, Record) for r in items)
    big = items[5]
    assert isinstance(big, Record)
    assert big.text == "x\ny" * (50_000 // 3)


def test_a_ten_megabyte_cell_reads_at_the_default_block(tmp_path: Path) -> None:
    items = _items(_write(tmp_path / "big.csv", 10 << 20, at=2, rows=4))
    assert [len(r.text) for r in items if isinstance(r, Record)] == [7, 7, 3 * ((10 << 20) // 3), 7]


def test_a_cell_past_the_largest_block_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(csv_format, "_READ_BLOCK_BYTES", 1024)
    monkeypatch.setattr(csv_format, "_MAX_BLOCK_BYTES", 4096)
    named = r"row 7 \(the header is row 1\): it holds more than 4,096 bytes.*--on-bad-record skip"
    with pytest.raises(InputError, match=named):
        _items(_write(tmp_path / "big.csv", 50_000))


def test_a_row_that_is_not_utf8_is_named_and_skipped_under_skip(tmp_path: Path) -> None:
    path = tmp_path / "bytes.csv"
    path.write_bytes(b"id,text\nr0,fine\nr1,bad \xff\xfe here\nr2,also fine\n")
    with pytest.raises(InputError, match=r"row 3 \(the header is row 1\): column 'text' is not"):
        _items(path)
    items = _items(path, "skip")
    assert [type(r).__name__ for r in items] == ["Record", "BadRecord", "Record"]
    bad = items[1]
    assert isinstance(bad, BadRecord)
    assert bad.id == "r1"
    assert (
        bad.reason
        == "row 3 (the header is row 1): column 'text' is not UTF-8 text (byte 4 of its cell)"
    )


def test_a_row_past_the_largest_block_is_skipped_under_skip_and_the_rest_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(csv_format, "_READ_BLOCK_BYTES", 1024)
    monkeypatch.setattr(csv_format, "_MAX_BLOCK_BYTES", 4096)
    path = _write(tmp_path / "big.csv", 50_000, rows=12)
    with path.open("a") as f:  # a second one, an empty line and a row too short after it
        f.write('r12,"' + "z" * 9000 + '"\n\nr13\nr14,last\n')
    items = _items(path, "skip")
    assert [(type(r).__name__, r.index) for r in items] == [
        *(("Record", i) for i in range(5)),
        ("BadRecord", 5),
        *(("Record", i) for i in range(6, 12)),
        ("BadRecord", 12),
        ("BadRecord", 13),
        ("Record", 14),
    ]
    big = items[5]
    assert isinstance(big, BadRecord)
    assert big.reason.startswith("row 7 (the header is row 1): it holds more than 4,096 bytes")
    assert big.raw.startswith('r5,"x\ny')  # what it held, in part
    assert [r.id for r in items if isinstance(r, Record)] == [
        *(f"r{i}" for i in range(12) if i != 5),
        "r14",
    ]
    assert "expected 2 fields, got 1" in items[-2].reason  # type: ignore[union-attr]
