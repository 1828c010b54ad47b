"""ModelSelection: one declaration of the model flags, shared by run, bench and tune."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest

from batchline.bench.runner import BenchOptions, TuneOptions
from batchline.jobs.options import GenerateOptions, RunOptions
from batchline.models.selection import ModelSelection, add_model_arguments, model_options


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_arguments(p)
    return p.parse_args(argv)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--model", "clf.onnx", "--task", "classify", "--labels", "neg, pos"],
        ["--model", "enc.onnx", "--tokenizer", "t.json", "--pooling", "cls", "--no-normalize"],
        ["--normalize"],
    ],
)
def test_flags_to_options_and_back(argv: list[str]) -> None:
    """What tune prints for the next command names the same model the flags named."""
    selection = ModelSelection(**model_options(parse(argv)))
    again = ModelSelection(**model_options(parse(selection.model_argv())))
    assert again == selection
    assert sorted(selection.model_argv()) == sorted(a.replace("neg, pos", "neg,pos") for a in argv)


def test_defaults_are_the_flags_defaults() -> None:
    assert ModelSelection(**model_options(parse([]))) == ModelSelection()
    selection = ModelSelection(**model_options(parse(["--labels", "a,b", "--tokenizer", "x"])))
    assert selection.labels == ("a", "b")
    assert selection.tokenizer == Path("x")


@pytest.mark.parametrize("cls", [RunOptions, GenerateOptions, BenchOptions, TuneOptions])
def test_every_option_class_takes_the_fields_from_the_one_declaration(cls: type) -> None:
    own = {f.name: f for f in dataclasses.fields(cls)}
    for field in dataclasses.fields(ModelSelection):
        assert own[field.name].default == field.default
        assert own[field.name].type == field.type
    assert issubclass(cls, ModelSelection)
