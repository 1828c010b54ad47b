"""Image folders in ``precision = "bf16"``: each family's image tower on torch in bfloat16
(:mod:`batchline.models.image.torch_image`), against the same folder in fp32 on ONNX Runtime,
through ``load_model`` and the same model classes; the load line says "torch (bf16)"; int8,
a text tower in bf16 and a missing torch are refused in one line each."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_specs
from tests.models.image.conftest import build_folder, pictures

pytest.importorskip("torch")
pytest.importorskip("transformers")

CLASSIFIERS = ["vit", "resnet", "convnext", "swin", "efficientnet"]
#: bf16 keeps 8 bits of mantissa: outputs within this of fp32's (probabilities), or a cosine
#: to fp32's vectors of at least COSINE (auto's gate asks 0.999 on average)
PROBABILITY_TOLERANCE = 0.03
COSINE = 0.999


def _load(folder: Path, precision: str, **options: Any) -> Any:
    task = options.pop("task", None)
    input_kind = options.pop("input_kind", None)
    (spec,) = parse_specs([f"{folder}/"], tasks=[task] if task else [], **options)
    if input_kind is not None:
        spec = spec.with_options(input_kind=input_kind)
    return load_model(spec, Knobs(sessions=1, intra_op_threads=1, precision=precision))


def _both(folder: Path, count: int = 8, **options: Any) -> tuple[Any, list[Any], list[Any]]:
    """The bf16 model, and its results and fp32's on the same pictures."""
    fp32 = _load(folder, "fp32", **options)
    bf16 = _load(folder, "bf16", **options)
    items = [fp32.preprocess(p) for p in pictures(count)]
    return bf16, fp32.run_batch(items), bf16.run_batch(items)


def _scores(results: list[Any], labels: list[str]) -> np.ndarray:
    return np.array([[r["scores"][label] for label in labels] for r in results])


def _cosines(a: list[Any], b: list[Any]) -> np.ndarray:
    x, y = np.stack(a), np.stack(b)
    cos: np.ndarray = np.sum(x * y, axis=1) / (
        np.linalg.norm(x, axis=1) * np.linalg.norm(y, axis=1)
    )
    return cos


@pytest.mark.parametrize("family", CLASSIFIERS)
def test_a_classifier_in_bf16_gives_fp32_s_scores_within_the_tolerance(
    image_folders: Path, image_cache: Path, family: str
) -> None:
    model, want, got = _both(build_folder(image_folders, family))
    assert type(model.model).__name__ == "TorchPixels"
    assert model.model.dtype == "bfloat16"
    assert (model.info.task, model.info.input_kind) == ("classify", "image")
    labels = model.info.details["labels"]
    fp32 = _scores(want, labels)
    diff = np.abs(_scores(got, labels) - fp32)
    assert diff.max() <= PROBABILITY_TOLERANCE
    if np.ptp(fp32) > 0:  # the tiny EfficientNet's scores are flat (1/3 each) in both
        assert diff.max() > 0  # it did run in bf16, not fp32 again


def test_clear_margins_give_the_same_labels(image_folders: Path, image_cache: Path) -> None:
    model, want, got = _both(build_folder(image_folders, "vit"), count=16)
    labels = model.info.details["labels"]
    fp32 = np.sort(_scores(want, labels), axis=1)
    # clear: the two likeliest labels further apart than bf16 can move either
    clear = np.flatnonzero(fp32[:, -1] - fp32[:, -2] > 2 * PROBABILITY_TOLERANCE)
    assert len(clear) >= 12
    assert [got[i]["label"] for i in clear] == [want[i]["label"] for i in clear]


@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("dinov2", {"pooling": "cls"}),
        ("vitmodel", {"pooling": "mean"}),
        ("clip", {"input_kind": "image"}),
        ("siglip", {"input_kind": "image"}),
    ],
)
def test_an_image_tower_in_bf16_gives_fp32_s_vectors(
    image_folders: Path, image_cache: Path, family: str, options: dict[str, Any]
) -> None:
    model, want, got = _both(build_folder(image_folders, family), **options)
    assert type(model.model).__name__ == "TorchPixels"
    assert model.info.task == "embed"
    cosines = _cosines(want, got)
    assert cosines.min() >= COSINE
    assert cosines.min() < 1.0
    assert model.info.details["dim"] == len(want[0])


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_zero_shot_in_bf16_keeps_the_fp32_scale_and_the_labels(
    image_folders: Path, image_cache: Path, family: str
) -> None:
    labels = ("a photo of a cat", "a photo of a dog", "a red car")
    model, want, got = _both(build_folder(image_folders, family), labels=labels)
    fp32 = _load(build_folder(image_folders, family), "fp32", labels=labels)
    # read before the weights were rounded to bf16: exactly the converted graph's
    assert (model.scale, model.bias) == (fp32.scale, fp32.bias)
    diff = np.abs(_scores(got, list(labels)) - _scores(want, list(labels)))
    assert diff.max() <= PROBABILITY_TOLERANCE


def test_the_load_line_says_torch_bf16(
    image_folders: Path, image_cache: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="batchline.models"):
        _load(build_folder(image_folders, "vit"), "bf16")
    assert "vit: image classifier" in caplog.text
    assert "-> torch (bf16)" in caplog.text
    assert "-> ONNX" not in caplog.text


def test_int8_and_a_text_tower_in_bf16_are_refused_in_one_line(image_folders: Path) -> None:
    vit = build_folder(image_folders, "vit")
    with pytest.raises(InputError, match="precision int8 quantizes text encoders") as caught:
        _load(vit, "int8")
    assert "\n" not in str(caught.value)
    assert "use precision auto, fp32 or bf16" in str(caught.value)
    with pytest.raises(InputError, match="precision int8 quantizes text encoders"):
        _load(build_folder(image_folders, "dinov2"), "int8")  # an embedder: the same line
    clip = build_folder(image_folders, "clip")
    with pytest.raises(InputError, match="its text tower runs on ONNX Runtime") as caught:
        _load(clip, "bf16")  # embed, texts: the text tower
    assert "\n" not in str(caught.value)


def test_without_torch_bf16_names_the_install(
    image_folders: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_folder(image_folders, "vit")
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if not installed
    with pytest.raises(ModelError) as caught:
        _load(folder, "bf16")
    message = str(caught.value)
    assert "\n" not in message
    assert "in precision bf16" in message
    assert "torch is missing" in message
    assert "pip install torch==2.13.0" in message


def test_a_run_job_in_bf16_says_so_in_its_summary(
    image_folders: Path, image_cache: Path, tmp_path: Path
) -> None:
    pytest.importorskip("pyarrow")
    from batchline.datasets.sinks import read_output
    from batchline.jobs.options import RunOptions
    from batchline.jobs.run import run
    from batchline.models.image import DecodeOptions

    photos = tmp_path / "photos"
    photos.mkdir()
    for i, picture in enumerate(pictures(5)):
        picture.save(photos / f"p{i}.png")
    folder = build_folder(image_folders, "dinov2")
    vectors = {}
    for precision in ("fp32", "bf16"):
        summary = run(
            RunOptions(
                input=photos,
                output=tmp_path / precision,
                model=f"{folder}/",
                knobs=Knobs(sessions=1, max_concurrent_batches=1, precision=precision),
                decode=DecodeOptions(workers=1),
            )
        )
        assert summary.records == 5
        assert dict(summary.rows())["precision"] == (
            f"{precision} on {'torch' if precision == 'bf16' else 'onnxruntime'} (asked for)"
        )
        rows = sorted(read_output(tmp_path / precision).to_pylist(), key=lambda r: r["id"])
        vectors[precision] = [np.asarray(r["embedding"], np.float32) for r in rows]
    assert _cosines(vectors["fp32"], vectors["bf16"]).min() >= COSINE


def test_a_plain_onnx_reading_pictures_refuses_bf16_and_int8(tmp_path: Path) -> None:
    from batchline.models.image import ImageOptions
    from batchline.models.specs import parse_spec
    from tests.image_helpers import image_model

    graph = image_model(tmp_path, size=32, classify=False)
    spec = parse_spec(str(graph)).with_options(task="embed", image=ImageOptions(32))
    for precision in ("bf16", "int8"):
        with pytest.raises(InputError, match="runs as it was exported") as caught:
            load_model(spec, Knobs(sessions=1, precision=precision))
        assert "\n" not in str(caught.value)
        assert "use precision auto or fp32" in str(caught.value)
    model = load_model(spec, Knobs(sessions=1, precision="fp32"))
    assert model.info.input_kind == "image"
