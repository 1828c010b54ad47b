"""Image folders refused, or their inputs, in one clear line each: a missing torch at
conversion names the install, a folder without weights, texts given to an image-only model,
bad options (``--top-k``, an empty labels file), a processor config that gives pictures of
varying sizes, and a bad picture is one input's error, not the batch's."""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.identity import model_identity
from batchline.models.loader import load_model
from batchline.models.selection import parse_labels
from batchline.models.specs import parse_spec, parse_specs
from tests.models.image.conftest import build_folder, pictures, read_json

pytest.importorskip("torch")

KNOBS = Knobs(sessions=1, intra_op_threads=1)


def _one_line(exc: pytest.ExceptionInfo[BaseException]) -> str:
    message = str(exc.value)
    assert "\n" not in message
    return message


def test_a_missing_torch_at_conversion_names_the_install(
    image_folders: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_folder(image_folders, "vit")
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if not installed
    with pytest.raises(ModelError) as caught:
        load_model(parse_spec(f"{folder}/"), KNOBS)
    message = _one_line(caught)
    assert "pip install torch==2.13.0" in message
    assert "torch is missing" in message


def test_an_image_folder_without_weights_is_refused(image_folders: Path, tmp_path: Path) -> None:
    folder = tmp_path / "noweights"
    shutil.copytree(build_folder(image_folders, "vit"), folder)
    (folder / "model.safetensors").unlink()
    with pytest.raises(InputError, match="without weights") as caught:
        parse_spec(f"{folder}/")
    _one_line(caught)


def test_texts_to_an_image_only_model_and_bad_options_are_refused(image_folders: Path) -> None:
    vit = build_folder(image_folders, "vit")
    with pytest.raises(InputError, match="takes images, not texts"):
        parse_spec(f"{vit}/").with_options(input_kind="text")
    with pytest.raises(InputError, match="--top-k must be >= 1"):
        parse_specs([f"{vit}/"], top_k=0)
    with pytest.raises(InputError, match="it does classify, not embed"):
        parse_specs([f"{vit}/"], tasks=["embed"])
    clip = build_folder(image_folders, "clip")
    with pytest.raises(InputError, match="zero-shot classification takes images"):
        parse_specs([f"{clip}/"], labels=("a", "b")).pop().with_options(input_kind="text")
    with pytest.raises(InputError, match="--top-k goes with the classify task"):
        parse_specs([f"{clip}/"], top_k=2)


def test_a_labels_file_is_one_label_a_line_and_an_empty_one_is_refused(tmp_path: Path) -> None:
    labels = tmp_path / "labels.txt"
    labels.write_text("a cat\n\n  a dog \n", encoding="utf-8")
    assert parse_labels(str(labels)) == ("a cat", "a dog")
    assert parse_labels("a cat, a dog") == ("a cat", "a dog")
    labels.write_text("\n", encoding="utf-8")
    with pytest.raises(argparse.ArgumentTypeError, match="holds no label"):
        parse_labels(str(labels))


def test_a_processor_config_of_varying_sizes_is_refused_at_load(
    image_folders: Path, tmp_path: Path
) -> None:
    folder = tmp_path / "varying"
    shutil.copytree(build_folder(image_folders, "dinov2"), folder)
    config = read_json(folder / "preprocessor_config.json")
    config["do_center_crop"] = False
    (folder / "preprocessor_config.json").write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(InputError, match="a batch needs one size") as caught:
        load_model(parse_spec(f"{folder}/"), KNOBS)
    _one_line(caught)


def test_a_bad_picture_is_that_inputs_error(image_folders: Path, image_cache: Path) -> None:
    model = load_model(parse_spec(f"{build_folder(image_folders, 'vit')}/"), KNOBS)
    good = pictures(1)[0]
    prepared = model.prepare([good, "not a picture", np.zeros((3, 5, 5), np.float32)])
    assert isinstance(prepared[0], np.ndarray)
    assert prepared[0].shape == (3, 32, 32)
    assert isinstance(prepared[1], InputError)
    assert isinstance(prepared[2], InputError)
    assert "preprocessed to [3, 32, 32]" in str(prepared[2])
    gray = good.convert("L")  # any mode is made RGB first
    assert np.array_equal(model.prepare([gray])[0], model.preprocess(gray.convert("RGB")))


def test_top_k_and_the_input_kind_change_the_models_identity(image_folders: Path) -> None:
    clip = build_folder(image_folders, "clip")
    texts = parse_spec(f"{clip}/")
    images = texts.with_options(input_kind="image")
    zero_shot = parse_specs([f"{clip}/"], labels=("a", "b")).pop()
    top = zero_shot.with_options(top_k=1)
    ids = {model_identity(s) for s in (texts, images, zero_shot, top)}
    assert len(ids) == 4
