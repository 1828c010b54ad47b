"""The backend registry: the loader, the footprint estimate and the identity ask the first
backend that claims a spec, in the registry's order; a toy backend added in one module and one
registration line (``tests/toy_backend.py``) is loaded, sized, identified and run by
``batchline run`` like a built-in one, and leaves nothing behind once its block ends."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError, ModelError
from batchline.models.backend import Backend, Registry
from batchline.models.config import Knobs
from batchline.models.footprint import estimate_footprint
from batchline.models.identity import model_identity
from batchline.models.loader import load_model, resolve_task, text_tokenizer
from batchline.models.registry import BACKENDS
from batchline.models.specs import parse_spec
from tests.toy_backend import TOY, TOY_FOOTPRINT, ToyEmbedder, toy_vector

BUILT_IN = ["generation", "python", "image", "hf-folder", "torch-bf16", "onnx"]


@pytest.fixture
def toy() -> Iterator[Backend]:
    with BACKENDS.registered(TOY) as backend:
        yield backend


def test_the_built_in_backends_are_asked_in_order() -> None:
    assert BACKENDS.names() == BUILT_IN
    knobs = Knobs()
    assert BACKENDS.claiming(parse_spec("default"), knobs).name == "onnx"
    assert BACKENDS.claiming(parse_spec("smollm2"), knobs).name == "generation"
    assert BACKENDS.claiming(parse_spec("mymod:factory"), knobs).name == "python"
    # the built-in encoder in bf16 is torch's, ahead of ONNX's
    embed = parse_spec("default").with_options(task="embed")
    assert BACKENDS.claiming(embed, Knobs(precision="bf16")).name == "torch-bf16"
    assert BACKENDS.claiming(embed, Knobs(precision="fp32")).name == "onnx"


def test_a_generator_is_refused_as_a_batch_model() -> None:
    with pytest.raises(InputError, match="generates text"):
        load_model(parse_spec("smollm2"), Knobs())


def test_the_toy_backend_loads_sizes_and_identifies_its_specs(toy: Backend) -> None:
    assert BACKENDS.names() == ["toy", *BUILT_IN]
    spec = parse_spec("toy:hello")
    assert resolve_task(spec) == "embed"  # the toy's task hook, ahead of python's predict
    model = load_model(spec, Knobs())
    assert isinstance(model, ToyEmbedder)
    assert model.info.name == "hello"
    assert estimate_footprint(spec, Knobs()) == TOY_FOOTPRINT
    identity = model_identity(spec)
    assert identity is not None
    assert len(identity) == 64
    assert model_identity(parse_spec("toy:other")) not in (None, identity)
    assert text_tokenizer(spec) is None  # the toy names no tokenizer: a benchmark counts none


def test_the_toy_leaves_nothing_behind(toy: Backend) -> None:
    assert "toy" in BACKENDS.names()
    seen: list[list[str]] = []

    def failing_block() -> None:
        with BACKENDS.registered(Backend(*_fields("second"))):
            seen.append(BACKENDS.names())
            raise RuntimeError("the block fails")

    with pytest.raises(RuntimeError, match="the block fails"):
        failing_block()
    assert seen == [["second", "toy", *BUILT_IN]]
    assert BACKENDS.names() == ["toy", *BUILT_IN]


def test_without_the_toy_its_spec_is_a_python_module_again() -> None:
    spec = parse_spec("toy:hello")
    assert BACKENDS.claiming(spec, Knobs()).name == "python"
    assert resolve_task(spec) == "predict"
    with pytest.raises(InputError, match="cannot import 'toy'"):
        load_model(spec, Knobs())


def test_a_backend_name_is_registered_once() -> None:
    registry = Registry()
    registry.register(TOY)
    with pytest.raises(ValueError, match="registered already"):
        registry.register(TOY)
    registry.unregister("toy")
    assert registry.names() == []
    with pytest.raises(ModelError, match="no backend takes it"):
        registry.claiming(parse_spec("toy:hello"), Knobs())
    assert registry.task(parse_spec("toy:hello")) is None


def test_run_embeds_a_text_file_with_the_toy(toy: Backend, tmp_path: Path) -> None:
    from batchline.datasets.sinks import read_output
    from batchline.jobs.run import RunOptions, run

    texts = ["a cat", "the quick brown fox", "I", "one more line here"]
    src = tmp_path / "in.txt"
    src.write_text("".join(t + "\n" for t in texts))
    summary = run(RunOptions(input=src, output=tmp_path / "out", model="toy:hello"))
    assert summary.records == len(texts)
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == [str(i) for i in range(len(texts))]
    got = np.stack([np.asarray(v, dtype=np.float32) for v in table.column("embedding")])
    np.testing.assert_array_equal(got, np.stack([toy_vector(t) for t in texts]))


def _fields(name: str) -> tuple[Any, ...]:
    return (name, TOY.claims, TOY.load, TOY.footprint, TOY.identity)


def test_the_loader_asks_the_backend_which_precisions_it_takes(toy: Backend) -> None:
    spec = parse_spec("toy:hello")
    # the toy declares none: fp32 alone, and the default line for the rest
    with pytest.raises(InputError, match="precision int8 applies to embedding models"):
        load_model(spec, Knobs(precision="int8"))
    assert isinstance(load_model(spec, Knobs(precision="fp32")), ToyEmbedder)
    refused: list[tuple[str, str]] = []

    def refusal(spec: Any, task: str, asked: Any) -> str:
        refused.append((task, asked.precision))
        return f"the toy computes {spec.name} in int8 only"

    int8_only = dataclasses.replace(
        TOY, name="int8-toy", precisions=lambda spec, task: frozenset({"int8"}), refusal=refusal
    )
    with BACKENDS.registered(int8_only):
        assert isinstance(load_model(spec, Knobs(precision="int8")), ToyEmbedder)
        assert isinstance(load_model(spec, Knobs()), ToyEmbedder)  # auto: never refused
        with pytest.raises(InputError, match="the toy computes hello in int8 only"):
            load_model(spec, Knobs(precision="bf16"))
    assert refused == [("embed", "bf16")]


@pytest.mark.parametrize(
    ("source", "task", "takes"),
    [
        ("default", "embed", {"fp32", "int8"}),  # bf16: the torch-bf16 backend's
        ("smollm2", "generate", {"fp32"}),
        ("mymod:factory", "predict", {"fp32"}),
        ("mymod:factory", "embed", {"fp32", "bf16", "int8"}),  # let through, its knob unread
    ],
)
def test_the_built_in_backends_declare_their_precisions(
    source: str, task: Any, takes: set[str]
) -> None:
    spec = parse_spec(source).with_options(task=task)
    assert BACKENDS.claiming(spec, Knobs()).precisions(spec, task) == takes


def test_a_backend_tells_what_a_model_takes_before_it_loads(tmp_path: Path) -> None:
    from batchline.models.common.image_options import ImageOptions
    from batchline.models.loader import input_kind
    from tests.models.onnx_builders import image_classifier

    assert input_kind(parse_spec("default")) == "text"
    assert input_kind(parse_spec("smollm2")) == "text"
    assert input_kind(parse_spec("mymod:factory")) is None  # only its load tells
    graph = image_classifier(tmp_path)
    assert input_kind(parse_spec(str(graph))) == "tensors"  # a predict model's tensors
    pictures = parse_spec(str(graph)).with_options(task="classify", image=ImageOptions(8))
    assert input_kind(pictures) == "image"
