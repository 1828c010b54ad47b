"""open_source beyond one text column: whole records, tensor list columns, and ``.npy`` rows."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline._errors import InputError
from batchline.datasets.sources import BadRecord, Record, Source, file_fingerprint, open_source

from .test_sources import ROWS, items, records, write_rows

TENSOR_ROWS: list[dict[str, Any]] = [
    {
        "id": f"r{i}",
        "pixels": np.arange(12, dtype=np.float32).reshape(3, 2, 2).tolist(),
        "mask": [1, 0, i],
        "lang": "en",
    }
    for i in range(6)
]


def write_jsonl(path: Path, lines: list[object]) -> Path:
    path.write_text(
        "".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
        encoding="utf-8",
    )
    return path


# -- Record.input --------------------------------------------------------------------------------


def test_record_input_is_the_text_unless_a_value_is_set() -> None:
    text = Record(0, "a", "hello")
    row = Record(1, "b", "", {}, {"x": 1})
    assert text.input == "hello"
    assert text.value is None
    assert row.input == {"x": 1}
    assert row.text == ""


@pytest.mark.parametrize("name", ["in.jsonl", "in.csv", "in.parquet", "in.txt"])
def test_text_sources_are_unchanged(tmp_path: Path, name: str) -> None:
    got = records(open_source(write_rows(tmp_path / name, ROWS)))
    assert [r.input for r in got] == [r["text"] for r in ROWS]
    assert all(r.value is None for r in got)


# -- record --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["in.jsonl", "in.csv", "in.parquet"])
def test_record_kind_passes_the_whole_row(tmp_path: Path, name: str) -> None:
    rows = [{"id": f"r{i}", "question": f"q{i}", "n": str(i)} for i in range(5)]
    source = open_source(write_rows(tmp_path / name, rows), input_kind="record")
    got = records(source)
    assert [r.input for r in got] == rows
    assert [r.id for r in got] == [f"r{i}" for i in range(5)]
    # the row is the input: nothing is copied beside it by default
    assert all(r.extra == {} for r in got)
    assert all(r.text == "" for r in got)


@pytest.mark.parametrize("name", ["in.jsonl", "in.csv", "in.parquet"])
def test_record_kind_with_input_columns_copies_the_others(tmp_path: Path, name: str) -> None:
    rows = [{"id": f"r{i}", "a": f"x{i}", "b": f"y{i}", "c": f"z{i}"} for i in range(3)]
    source = open_source(
        write_rows(tmp_path / name, rows), input_kind="record", input_columns=["a", "b"]
    )
    got = records(source)
    assert [r.input for r in got] == [{"a": f"x{i}", "b": f"y{i}"} for i in range(3)]
    assert [r.extra for r in got] == [{"c": f"z{i}"} for i in range(3)]


def test_record_kind_needs_no_text_column(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with pytest.raises(InputError, match="no text column 'text'"):
        open_source(path)
    got = records(open_source(path, input_kind="record"))
    assert [(r.id, r.input) for r in got] == [("0", {"prompt": "a"}), ("1", {"prompt": "b"})]


def test_record_kind_missing_input_field_is_a_bad_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"a": 1}, {"b": 2}, {"a": 3}])
    with pytest.raises(InputError, match="line 2: no input field 'a'"):
        items(open_source(path, input_kind="record", input_columns=["a"]))
    got = items(open_source(path, input_kind="record", input_columns=["a"], on_bad_record="skip"))
    assert isinstance(got[1], BadRecord)
    assert [r.input for r in got if isinstance(r, Record)] == [{"a": 1}, {"a": 3}]


# -- tensors from list columns -------------------------------------------------------------------


@pytest.mark.parametrize("name", ["in.jsonl", "in.parquet"])
def test_tensor_columns_become_arrays(tmp_path: Path, name: str) -> None:
    source = open_source(
        write_rows(tmp_path / name, TENSOR_ROWS),
        input_kind="tensors",
        input_columns=["pixels", "mask"],
    )
    got = records(source)
    assert [r.id for r in got] == [f"r{i}" for i in range(6)]
    for i, r in enumerate(got):
        assert isinstance(r.input, dict)
        assert list(r.input) == ["pixels", "mask"]
        np.testing.assert_array_equal(r.input["pixels"], np.arange(12).reshape(3, 2, 2))
        assert r.input["pixels"].shape == (3, 2, 2)
        np.testing.assert_array_equal(r.input["mask"], [1, 0, i])
        assert r.input["mask"].dtype.kind == "i"
        # the other columns are copied beside the result, the tensors are not
        assert r.extra == {"lang": "en"}


def test_tensor_scalar_numbers_are_zero_dim_arrays(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"x": 1.5}, {"x": True}])
    got = records(open_source(path, input_kind="tensors", input_columns=["x"]))
    assert [r.input["x"].shape for r in got] == [(), ()]  # type: ignore[index]
    assert float(got[0].input["x"]) == 1.5  # type: ignore[index]


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ([[1, 2], [3]], "ragged"),
        ([1, "a"], "not numbers"),
        ([1, None], "not numbers"),
        (None, "is null"),
        ("text", "is str, not a number"),
        ({"a": 1}, "is an object"),
    ],
)
def test_bad_tensor_values_name_their_line(tmp_path: Path, value: object, reason: str) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"x": [1, 2]}, {"x": value}, {"x": [5, 6]}])
    with pytest.raises(InputError, match=f"line 2: input 'x' .*{reason}"):
        items(open_source(path, input_kind="tensors", input_columns=["x"]))
    got = items(open_source(path, input_kind="tensors", input_columns=["x"], on_bad_record="skip"))
    assert [type(i).__name__ for i in got] == ["Record", "BadRecord", "Record"]
    bad = got[1]
    assert isinstance(bad, BadRecord)
    assert bad.index == 1
    assert bad.reason.startswith("line 2: input 'x'")


def test_bad_parquet_tensor_names_its_row(tmp_path: Path) -> None:
    table = pa.table({"x": pa.array([[[1.0, 2.0]], [[1.0], [2.0, 3.0]], None])})
    path = tmp_path / "in.parquet"
    pq.write_table(table, path)
    got = items(open_source(path, input_kind="tensors", input_columns=["x"], on_bad_record="skip"))
    assert isinstance(got[0], Record)
    assert [b.reason for b in got[1:] if isinstance(b, BadRecord)] == [
        "row 1 (0-based): input 'x' is ragged (nested lists of different lengths), not a "
        "rectangular array",
        "row 2 (0-based): input 'x' is null",
    ]


def test_missing_tensor_field_in_a_later_line_is_a_bad_record(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "in.jsonl", [{"x": [1]}, {"y": [2]}])
    with pytest.raises(InputError, match="line 2: no input field 'x'; fields: 'y'"):
        items(open_source(path, input_kind="tensors", input_columns=["x"]))


def test_tensor_columns_are_checked_at_open(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "in.parquet", TENSOR_ROWS)
    with pytest.raises(InputError, match="no input column 'pixel'"):
        open_source(path, input_kind="tensors", input_columns=["pixel"])
    with pytest.raises(InputError, match="column 'lang' holds string, not numbers"):
        open_source(path, input_kind="tensors", input_columns=["lang"])
    with pytest.raises(InputError, match="needs the input columns"):
        open_source(path, input_kind="tensors")
    with pytest.raises(InputError, match="CSV input has no list columns"):
        open_source(
            write_rows(tmp_path / "in.csv", ROWS), input_kind="tensors", input_columns=["text"]
        )
    with pytest.raises(InputError, match="input kind must be"):
        open_source(path, input_kind="images", input_columns=["x"])  # type: ignore[arg-type]
    with pytest.raises(InputError, match="go with the record and tensors"):
        open_source(path, input_columns=["pixels"])


def test_tensor_sources_skip_committed_ranges(tmp_path: Path) -> None:
    rows = [{"id": f"r{i}", "x": [i, i]} for i in range(40)]
    source = open_source(
        write_rows(tmp_path / "in.parquet", rows, row_group_size=10),
        input_kind="tensors",
        input_columns=["x"],
    )
    got = records(source, block_size=7, skip=[(0, 20), (25, 38)])
    assert [r.index for r in got] == [20, 21, 22, 23, 24, 38, 39]
    assert [int(r.input["x"][0]) for r in got] == [20, 21, 22, 23, 24, 38, 39]  # type: ignore[index]
    assert source.total_records == 40


# -- .npy ----------------------------------------------------------------------------------------


@pytest.fixture
def npy(tmp_path: Path) -> tuple[Path, np.ndarray[Any, Any]]:
    data = np.random.default_rng(0).normal(size=(25, 3, 4, 4)).astype(np.float32)
    path = tmp_path / "images.npy"
    np.save(path, data)
    return path, data


def test_npy_rows_are_records(npy: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, data = npy
    source = open_source(path, input_kind="tensors", input_columns=["pixel_values"])
    assert source.format == "npy"
    assert source.total_records == 25
    got = records(source, block_size=10)
    assert [r.index for r in got] == list(range(25))
    assert [r.id for r in got] == [str(i) for i in range(25)]
    for r in got:
        assert isinstance(r.input, dict)
        (array,) = r.input.values()
        assert list(r.input) == ["pixel_values"]
        assert array.dtype == np.float32
        assert not isinstance(array, np.memmap)
        np.testing.assert_array_equal(array, data[r.index])


def test_npy_input_name_defaults_to_input(npy: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, _ = npy
    (first,) = next(open_source(path, input_kind="tensors").iter_blocks(1))
    assert isinstance(first, Record)
    assert list(first.input) == ["input"]  # type: ignore[call-overload]


def test_npy_skips_committed_rows(npy: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, data = npy
    got = records(open_source(path, input_kind="tensors"), skip=[(0, 10), (12, 24)], start=0)
    assert [r.index for r in got] == [10, 11, 24]
    np.testing.assert_array_equal(got[-1].input["input"], data[24])  # type: ignore[index]


def test_npy_refusals(tmp_path: Path, npy: tuple[Path, np.ndarray[Any, Any]]) -> None:
    path, _ = npy
    with pytest.raises(InputError, match="read it with the tensors input kind"):
        open_source(path)
    with pytest.raises(InputError, match="one array, so one input"):
        open_source(path, input_kind="tensors", input_columns=["a", "b"])
    with pytest.raises(InputError, match="no columns, so no id column"):
        open_source(path, input_kind="tensors", id_column="id")
    strings = tmp_path / "s.npy"
    np.save(strings, np.array(["a", "b"]))
    with pytest.raises(InputError, match="not numbers"):
        open_source(strings, input_kind="tensors")
    scalar = tmp_path / "scalar.npy"
    np.save(scalar, np.float32(3))
    with pytest.raises(InputError, match="scalar"):
        open_source(scalar, input_kind="tensors")
    broken = tmp_path / "broken.npy"
    broken.write_bytes(b"not an array")
    with pytest.raises(InputError, match=r"not a readable \.npy"):
        open_source(broken, input_kind="tensors")


# -- resume --------------------------------------------------------------------------------------


def _fingerprint(path: Path, **options: Any) -> str:
    source: Source = open_source(path, input_kind="tensors", **options)
    return source.fingerprint()


def test_fingerprint_of_tensor_inputs_tells_files_apart(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a.npy", tmp_path / "b.npy", tmp_path / "c.npy"
    np.save(a, np.zeros((4, 2), np.float32))
    np.save(b, np.zeros((4, 2), np.float32))
    np.save(c, np.ones((4, 2), np.float32))
    assert _fingerprint(a) == _fingerprint(b) == file_fingerprint(a)
    assert _fingerprint(a) != _fingerprint(c)

    p1 = write_rows(tmp_path / "p1.parquet", TENSOR_ROWS)
    rows = [dict(r) for r in TENSOR_ROWS]
    rows[3]["mask"] = [1, 1, 1]
    p2 = write_rows(tmp_path / "p2.parquet", rows)
    assert _fingerprint(p1, input_columns=["mask"]) == file_fingerprint(p1)
    assert _fingerprint(p1, input_columns=["mask"]) != _fingerprint(p2, input_columns=["mask"])


def test_resuming_a_tensor_source_reads_exactly_the_rest(tmp_path: Path) -> None:
    data = np.arange(30 * 2, dtype=np.int64).reshape(30, 2)
    path = tmp_path / "rows.npy"
    np.save(path, data)
    first = open_source(path, input_kind="tensors", input_columns=["x"])
    done = [r.index for r in records(first, block_size=8)][:13]
    again = open_source(path, input_kind="tensors", input_columns=["x"])
    assert again.fingerprint() == first.fingerprint()
    rest = records(again, skip=[(0, len(done))])
    assert [r.index for r in rest] == list(range(13, 30))
    got = np.stack([r.input["x"] for r in rest])  # type: ignore[index]
    np.testing.assert_array_equal(got, data[13:])
