"""DatasetSelection: one declaration of what a job reads and writes (run and drive)."""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

import pytest

from batchline.datasets.selection import (
    DatasetSelection,
    add_dataset_arguments,
    dataset_options,
)
from batchline.driver.drive import DriveOptions
from batchline.jobs.options import RunOptions


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("input", nargs="?", type=Path)
    add_dataset_arguments(p)
    return p.parse_args(argv)


def test_the_flags_defaults_are_the_fields_defaults() -> None:
    # (--copy-column appends to a list of its own)
    assert DatasetSelection(**dataset_options(parse([]))) == DatasetSelection(copy_columns=[])


def test_flags_fill_every_field() -> None:
    args = parse(
        shlex.split(
            "in.csv -o out --text-column body --id-column key --format csv --output-format jsonl "
            "--copy-column a --copy-column b --resume --on-bad-record skip --limit 7"
        )
    )
    assert DatasetSelection(**dataset_options(args)) == DatasetSelection(
        input=Path("in.csv"),
        output=Path("out"),
        text_column="body",
        id_column="key",
        input_format="csv",
        output_format="jsonl",
        copy_columns=["a", "b"],
        resume=True,
        on_bad_record="skip",
        limit=7,
    )


@pytest.mark.parametrize("cls", [RunOptions, DriveOptions])
def test_run_and_drive_take_the_fields_from_the_one_declaration(cls: type) -> None:
    own = {f.name: f for f in dataclasses.fields(cls)}
    for field in dataclasses.fields(DatasetSelection):
        assert own[field.name].default == field.default
    assert issubclass(cls, DatasetSelection)
