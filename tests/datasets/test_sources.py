"""open_source: every format, numbering, bad input with exact places, skipping, and streaming."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchline._errors import InputError
from batchline.datasets.formats import csv as csv_format
from batchline.datasets.sources import BadRecord, Record, Source, file_fingerprint, open_source

ROWS: list[dict[str, Any]] = [
    {"id": f"r{i}", "text": f"text number {i}", "lang": "en" if i % 2 else "fr"} for i in range(10)
]


def write_rows(path: Path, rows: list[dict[str, Any]], *, row_group_size: int = 4) -> Path:
    """Write ``rows`` in the format named by ``path``'s extension."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    elif path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=row_group_size)
    else:
        path.write_text("".join(r["text"] + "\n" for r in rows), encoding="utf-8")
    return path


def items(source: Source, **kwargs: Any) -> list[Record | BadRecord]:
    return [item for block in source.iter_blocks(**kwargs) for item in block]


def records(source: Source, **kwargs: Any) -> list[Record]:
    got = items(source, **kwargs)
    assert all(isinstance(r, Record) for r in got)
    return [r for r in got if isinstance(r, Record)]


TABULAR = ["in.jsonl", "in.csv", "in.parquet"]


# -- formats ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TABULAR)
def test_tabular_formats_give_the_same_records(tmp_path: Path, name: str) -> None:
    source = open_source(write_rows(tmp_path / name, ROWS))

    got = records(source)

    assert got == [
        Record(i, f"r{i}", f"text number {i}", {"lang": "en" if i % 2 else "fr"}) for i in range(10)
    ]
    assert source.id_column == "id"
    assert source.total_records == 10


def test_text_format_is_one_record_per_line_and_blank_lines_take_no_index(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"\xef\xbb\xbffirst line\r\n\n   \nsecond  line \nthird")

    got = records(open_source(path))

    assert got == [
        Record(0, "0", "first line"),
        Record(1, "1", "second  line "),
        Record(2, "2", "third"),
    ]


def test_format_comes_from_fmt_when_given(tmp_path: Path) -> None:
    path = tmp_path / "notes.md"
    path.write_text("# a heading\nsome prose\n", encoding="utf-8")

    assert [r.text for r in records(open_source(path, fmt="text"))] == ["# a heading", "some prose"]
    jsonl = write_rows(tmp_path / "data.log", ROWS[:2]).rename(tmp_path / "data.log")
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS[:2]), encoding="utf-8")
    assert [r.id for r in records(open_source(jsonl, fmt="jsonl"))] == ["r0", "r1"]


def test_unknown_extension_names_the_supported_ones(tmp_path: Path) -> None:
    path = tmp_path / "data.xlsx"
    path.write_bytes(b"")

    with pytest.raises(InputError, match=r"'\.xlsx'.*\.csv, \.jsonl, .*\.parquet.*\.txt"):
        open_source(path)


def test_unknown_fmt_is_refused(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "in.jsonl", ROWS)
    with pytest.raises(InputError, match="unknown input format 'xml'"):
        open_source(path, fmt="xml")  # type: ignore[arg-type]


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="no such file"):
        open_source(tmp_path / "nope.jsonl")


def test_directory_is_not_a_file(tmp_path: Path) -> None:
    (tmp_path / "d.csv").mkdir()
    with pytest.raises(InputError, match="not a file"):
        open_source(tmp_path / "d.csv")


# -- columns ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", TABULAR)
def test_missing_text_column_lists_the_columns(tmp_path: Path, name: str) -> None:
    path = write_rows(tmp_path / name, ROWS)

    with pytest.raises(InputError, match=r"no text column 'body'.*'id', 'text', 'lang'"):
        open_source(path, text_column="body")


@pytest.mark.parametrize("name", TABULAR)
def test_explicit_id_column_must_exist(tmp_path: Path, name: str) -> None:
    path = write_rows(tmp_path / name, ROWS)

    with pytest.raises(InputError, match=r"no id column 'key'.*'id', 'text', 'lang'"):
        open_source(path, id_column="key")


@pytest.mark.parametrize("name", TABULAR)
def test_without_an_id_column_ids_are_indices(tmp_path: Path, name: str) -> None:
    rows = [{"text": r["text"], "lang": r["lang"]} for r in ROWS]
    source = open_source(write_rows(tmp_path / name, rows))

    assert [r.id for r in records(source)] == [str(i) for i in range(10)]
    assert source.id_column is None


@pytest.mark.parametrize("name", TABULAR)
def test_other_columns_as_ids_and_extras(tmp_path: Path, name: str) -> None:
    source = open_source(
        write_rows(tmp_path / name, ROWS),
        id_column="lang",
        text_column="id",
        extra_columns=["text"],
    )

    first = records(source)[0]

    assert (first.id, first.text, first.extra) == ("fr", "r0", {"text": "text number 0"})


@pytest.mark.parametrize("name", TABULAR)
def test_extra_columns_empty_copies_nothing(tmp_path: Path, name: str) -> None:
    source = open_source(write_rows(tmp_path / name, ROWS), extra_columns=())
    assert all(r.extra == {} for r in records(source))


@pytest.mark.parametrize("name", ["in.csv", "in.parquet"])
def test_unknown_extra_column_is_refused(tmp_path: Path, name: str) -> None:
    with pytest.raises(InputError, match="no column 'url' to copy"):
        open_source(write_rows(tmp_path / name, ROWS), extra_columns=["url"])


def test_jsonl_extra_column_absent_from_a_line_is_null(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"text": "a", "url": "u"}\n{"text": "b"}\n', encoding="utf-8")

    got = records(open_source(path, extra_columns=["url"]))

    assert [r.extra for r in got] == [{"url": "u"}, {"url": None}]


def test_text_input_has_no_columns(tmp_path: Path) -> None:
    path = write_rows(tmp_path / "in.txt", ROWS)
    with pytest.raises(InputError, match="no columns"):
        open_source(path, id_column="id")


def test_parquet_ids_of_other_types_become_strings(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [7, 8], "text": ["a", "b"]}), path)

    assert [r.id for r in records(open_source(path))] == ["7", "8"]


def test_parquet_text_column_must_hold_strings(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": [7, 8], "text": ["a", "b"]}), path)

    with pytest.raises(InputError, match="column 'id' holds int64, not text"):
        open_source(path, text_column="id")


def test_csv_reads_every_column_as_text(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text('id,text,n\n001,"quoted, with\nnewline",1\n002,,2.5\n', encoding="utf-8")

    got = records(open_source(path))

    assert got == [
        Record(0, "001", "quoted, with\nnewline", {"n": "1"}),
        Record(1, "002", "", {"n": "2.5"}),
    ]


def test_csv_repeated_header_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text("text,text\na,b\n", encoding="utf-8")
    with pytest.raises(InputError, match="repeats the column 'text'"):
        open_source(path)


def test_a_csv_quote_never_closed_is_refused_naming_its_line(tmp_path: Path) -> None:
    """The rows after a quote the file never closes had been read into that one value,
    silently: 4 records became 2. A quote inside an unquoted value (an odd count of quotes,
    too) and a value that is quoted and closed over several lines are read as before."""
    path = tmp_path / "in.csv"
    path.write_text('id,text\na,hello\nb,"never closed\nc,world\nd,again\n', encoding="utf-8")
    with pytest.raises(InputError, match=r'line 3: a quoted value opens there .* twice: ""'):
        open_source(path)
    path.write_text('id,text\na,5" screen\nb,"two\nlines"\nc,ok\n', encoding="utf-8")
    assert [r.text for r in records(open_source(path))] == ['5" screen', "two\nlines", "ok"]


# -- bad records -----------------------------------------------------------------------------------


def jsonl_with_problems(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    lines = [
        '{"id": "a", "text": "fine"}',  # line 1, index 0
        "",  # line 2: blank, no index
        '{"id": "b", "text": "fine too"',  # line 3, index 1: malformed
        '{"id": "c", "text": null}',  # line 4, index 2
        '{"id": "d", "text": 12}',  # line 5, index 3
        '["not", "an", "object"]',  # line 6, index 4
        '{"id": "f", "body": "x"}',  # line 7, index 5: no text field
        '{"id": "g", "text": "last"}',  # line 8, index 6
    ]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_bad_jsonl_raises_with_the_line_number(tmp_path: Path) -> None:
    source = open_source(jsonl_with_problems(tmp_path))

    with pytest.raises(InputError, match=r"bad\.jsonl: line 3: malformed JSON"):
        items(source)


def test_bad_jsonl_records_are_yielded_when_skipping(tmp_path: Path) -> None:
    source = open_source(jsonl_with_problems(tmp_path), on_bad_record="skip")

    got = items(source)

    assert [type(r).__name__ for r in got] == [
        "Record",
        "BadRecord",
        "BadRecord",
        "BadRecord",
        "BadRecord",
        "BadRecord",
        "Record",
    ]
    assert [r.index for r in got] == list(range(7))
    bad = [r for r in got if isinstance(r, BadRecord)]
    assert [b.reason.split(":")[0] for b in bad] == [
        "line 3",
        "line 4",
        "line 5",
        "line 6",
        "line 7",
    ]
    assert "malformed JSON" in bad[0].reason
    assert bad[0].raw == '{"id": "b", "text": "fine too"'
    assert "is null" in bad[1].reason
    assert "is a number, not a string" in bad[2].reason
    assert "not a JSON object but list" in bad[3].reason
    assert "no text field 'text'; fields: 'id', 'body'" in bad[4].reason
    assert [b.id for b in bad] == ["1", "c", "d", "4", "f"]
    assert source.total_records == 7


def test_jsonl_line_without_a_requested_id_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"key": "k1", "text": "a"}\n{"text": "b"}\n', encoding="utf-8")

    with pytest.raises(InputError, match="line 2: no id field 'key'"):
        items(open_source(path, id_column="key"))


def test_jsonl_null_id_is_bad(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_text('{"id": "x", "text": "a"}\n{"id": null, "text": "b"}\n', encoding="utf-8")

    with pytest.raises(InputError, match="line 2: id 'id' is null"):
        items(open_source(path))


def test_csv_row_with_wrong_field_count(tmp_path: Path) -> None:
    path = tmp_path / "in.csv"
    path.write_text('id,text\na,one\nb,"two\nlines"\nc,three,extra\nd,four\n', encoding="utf-8")

    with pytest.raises(
        InputError, match=r"row 4 \(the header is row 1\): expected 2 fields, got 3"
    ):
        items(open_source(path))
    got = items(open_source(path, on_bad_record="skip"))
    assert [(type(r).__name__, r.index, r.id) for r in got] == [
        ("Record", 0, "a"),
        ("Record", 1, "b"),
        ("BadRecord", 2, "2"),
        ("Record", 3, "d"),
    ]
    bad = got[2]
    assert isinstance(bad, BadRecord)
    assert bad.raw == "c,three,extra"


def test_parquet_null_text_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "in.parquet"
    pq.write_table(pa.table({"text": ["a", "b", None, "d"]}), path, row_group_size=2)

    with pytest.raises(InputError, match=r"row 2 \(0-based\): text 'text' is null"):
        items(open_source(path))
    got = items(open_source(path, on_bad_record="skip"))
    assert [type(r).__name__ for r in got] == ["Record", "Record", "BadRecord", "Record"]


def test_text_line_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "in.txt"
    path.write_bytes(b"good\n\nbad \xff byte\nalso good\n")

    with pytest.raises(InputError, match="line 3: not UTF-8"):
        items(open_source(path))
    got = items(open_source(path, on_bad_record="skip"))
    assert [(type(r).__name__, r.index) for r in got] == [
        ("Record", 0),
        ("BadRecord", 1),
        ("Record", 2),
    ]


def test_empty_files_are_empty_datasets_except_headerless_csv(tmp_path: Path) -> None:
    for name in ("e.jsonl", "e.txt", "e.csv"):
        (tmp_path / name).write_bytes(b"\n")
    for name in ("e.jsonl", "e.txt"):
        source = open_source(tmp_path / name)
        assert items(source) == []
        assert source.total_records == 0
    with pytest.raises(InputError, match="cannot read the CSV header"):
        open_source(tmp_path / "e.csv")


# -- blocks and skipping ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*TABULAR, "in.txt"])
def test_blocks_are_bounded_and_concatenate_to_the_whole(tmp_path: Path, name: str) -> None:
    rows = [{"id": f"r{i}", "text": f"t{i}"} for i in range(103)]
    source = open_source(write_rows(tmp_path / name, rows, row_group_size=10))

    blocks = list(source.iter_blocks(block_size=7))

    assert all(0 < len(b) <= 7 for b in blocks)
    assert [r.index for b in blocks for r in b] == list(range(103))
    assert [r.index for r in source] == list(range(103))  # and it can be read again


@pytest.mark.parametrize("name", [*TABULAR, "in.txt"])
def test_start_and_skip_ranges_leave_out_exactly_those_indices(tmp_path: Path, name: str) -> None:
    rows = [{"id": f"r{i}", "text": f"t{i}"} for i in range(50)]
    source = open_source(write_rows(tmp_path / name, rows, row_group_size=10))

    got = [
        r.index for r in items(source, block_size=4, start=3, skip=[(10, 20), (18, 25), (40, 41)])
    ]

    assert got == [i for i in range(3, 50) if not (10 <= i < 25 or i == 40)]
    assert source.total_records == 50


def test_bad_records_inside_skipped_ranges_are_not_reported(tmp_path: Path) -> None:
    source = open_source(jsonl_with_problems(tmp_path))  # raising mode

    assert [r.index for r in items(source, skip=[(1, 6)])] == [0, 6]


def test_parquet_row_groups_inside_skipped_ranges_are_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = [{"id": f"r{i}", "text": f"t{i}"} for i in range(100)]
    source = open_source(write_rows(tmp_path / "in.parquet", rows, row_group_size=10))
    read: list[int] = []
    real = pq.ParquetFile.iter_batches

    def spy(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        read.extend(kwargs["row_groups"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)

    got = [r.index for r in items(source, skip=[(0, 30), (35, 60)])]

    assert got == [*range(30, 35), *range(60, 100)]
    assert read == [3, 6, 7, 8, 9]  # groups 0-2 and 4-5 lie inside the skipped ranges


@pytest.mark.parametrize("bad", [{"block_size": 0}, {"start": -1}])
def test_iter_blocks_validates_arguments(tmp_path: Path, bad: dict[str, int]) -> None:
    source = open_source(write_rows(tmp_path / "in.jsonl", ROWS))
    with pytest.raises(ValueError, match="must be >= "):
        next(source.iter_blocks(**bad))


# -- streaming -------------------------------------------------------------------------------------

BIG = 200_000


@pytest.mark.parametrize(("name", "tail"), [("big.jsonl", b"{oops\n"), ("big.txt", b"\xff\n")])
def test_line_formats_stream_the_file(tmp_path: Path, name: str, tail: bytes) -> None:
    """Lines appended after the first block was yielded are still read: nothing was loaded ahead."""
    path = tmp_path / name
    with open(path, "w", encoding="utf-8") as f:
        for i in range(BIG):
            f.write(
                json.dumps({"text": f"record {i}"}) + "\n"
                if name.endswith("jsonl")
                else f"record {i}\n"
            )
    blocks = open_source(path).iter_blocks(1000)

    first = next(blocks)
    with open(path, "ab") as f:
        f.write(tail)

    assert [r.index for r in first] == list(range(1000))
    with pytest.raises(InputError, match=f"line {BIG + 1}:"):
        for _ in blocks:
            pass


def test_csv_streams_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.csv"
    with open(path, "w", encoding="utf-8") as f:
        f.write("id,text\n")
        f.writelines(f"{i},record number {i}\n" for i in range(BIG))
    pulls: list[int] = []
    real_open = csv_format.pa_csv.open_csv

    class CountingReader:
        def __init__(self, reader: Any) -> None:
            self._reader = reader

        def read_next_batch(self) -> Any:
            batch = self._reader.read_next_batch()
            pulls.append(batch.num_rows)
            return batch

        def close(self) -> None:
            self._reader.close()

    def counting_open(*args: Any, **kwargs: Any) -> Any:
        return CountingReader(real_open(*args, **kwargs))

    source = open_source(path)
    monkeypatch.setattr(csv_format.pa_csv, "open_csv", counting_open)
    blocks = source.iter_blocks(1000)

    next(blocks)
    assert len(pulls) == 1  # one parser block, not the file
    assert pulls[0] < BIG

    total = 1000 + sum(len(b) for b in blocks)
    assert total == BIG
    assert len(pulls) > 3
    assert source.total_records == BIG


def test_parquet_streams_row_groups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "big.parquet"
    with pq.ParquetWriter(path, pa.schema([("text", pa.string())])) as writer:
        for g in range(20):
            texts = [f"record {i}" for i in range(g * 10_000, (g + 1) * 10_000)]
            writer.write_table(pa.table({"text": texts}))
    read: list[int] = []
    real = pq.ParquetFile.iter_batches

    def spy(self: Any, *args: Any, **kwargs: Any) -> Iterator[Any]:
        read.extend(kwargs["row_groups"])
        return real(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    source = open_source(path)
    blocks = source.iter_blocks(1000)

    next(blocks)
    assert read == [0]

    assert 1000 + sum(len(b) for b in blocks) == BIG
    assert read == list(range(20))


# -- fingerprint -----------------------------------------------------------------------------------


def test_fingerprint_tells_files_apart(tmp_path: Path) -> None:
    a = write_rows(tmp_path / "a.jsonl", ROWS)
    b = write_rows(tmp_path / "b.jsonl", ROWS)
    c = write_rows(tmp_path / "c.jsonl", [*ROWS[:-1], {**ROWS[-1], "text": "changed!"}])

    assert file_fingerprint(a) == file_fingerprint(b) == open_source(a).fingerprint()
    assert file_fingerprint(a) != file_fingerprint(c)


def test_a_folder_given_to_a_text_model_is_named_a_folder_not_pictures(tmp_path: Path) -> None:
    """A folder is read as pictures whatever it holds (here a finished job's output): the error
    says that, and names the files a text model reads, not that the folder holds pictures."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "part-000000.parquet").write_bytes(b"")
    with pytest.raises(InputError) as caught:
        open_source(folder)
    message = str(caught.value)
    assert "is a folder, which run reads as pictures" in message
    assert "holds pictures" not in message
    assert ".jsonl, .csv, .parquet" in message
