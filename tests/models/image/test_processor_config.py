"""``preprocess_from_config`` against the transformers image processor the same config makes
(its PIL path, as torchvision is not installed): within 1/255 per pixel, on real photographs
(scikit-learn's and scikit-image's) and on synthetic sizes and modes."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError
from batchline.models.image import ImagePreprocess, preprocess_from_config

Image = pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")

# (processor class, the settings a saved config holds beyond its defaults)
CASES: list[tuple[str, dict[str, Any]]] = [
    ("ViTImageProcessorPil", {}),
    ("ViTImageProcessorPil", {"size": {"height": 160, "width": 96}, "resample": 3}),
    ("CLIPImageProcessorPil", {}),
    (
        "CLIPImageProcessorPil",
        {"size": {"shortest_edge": 100}, "crop_size": {"height": 96, "width": 80}},
    ),
    ("BitImageProcessorPil", {"size": {"shortest_edge": 256}}),
    ("SiglipImageProcessorPil", {"size": {"height": 128, "width": 128}}),
    ("ConvNextImageProcessorPil", {"size": {"shortest_edge": 224}, "crop_pct": 0.875}),
    ("ConvNextImageProcessorPil", {"size": {"shortest_edge": 384}}),
    ("EfficientNetImageProcessorPil", {"size": {"height": 120, "width": 120}}),
    (
        "EfficientNetImageProcessorPil",
        {"rescale_offset": True, "include_top": False, "do_center_crop": True},
    ),
    ("ViTImageProcessorPil", {"resample": 0, "do_normalize": False}),
    ("CLIPImageProcessorPil", {"resample": 1, "image_mean": [0.1, 0.2, 0.3], "image_std": 0.7}),
]


def _processor(cls_name: str, settings: dict[str, Any]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, cls_name)(**settings)


def _saved_config(processor: Any) -> dict[str, Any]:
    """What ``save_pretrained`` writes: the processor's settings as a JSON object."""
    config: dict[str, Any] = processor.to_dict()
    return config


def _photos() -> list[Any]:
    from sklearn.datasets import load_sample_images

    photos = [Image.fromarray(a) for a in load_sample_images().images]
    skdata = pytest.importorskip("skimage.data")
    photos += [Image.fromarray(getattr(skdata, n)()) for n in ("astronaut", "coffee", "chelsea")]
    return photos


def _synthetic() -> list[Any]:
    rng = np.random.default_rng(0)
    sizes = [(1, 1), (3, 500), (500, 3), (224, 224), (225, 223), (97, 1031)]
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]
    gray = Image.fromarray(rng.integers(0, 256, (60, 90), dtype=np.uint8))
    rgba = Image.fromarray(rng.integers(0, 256, (70, 50, 4), dtype=np.uint8))
    palette = images[3].convert("P")
    # modes become RGB before preprocessing, as the decoder gives them
    return images + [im.convert("RGB") for im in (gray, rgba, palette)]


def _max_pixel_diff(ours: np.ndarray, theirs: np.ndarray, pre: ImagePreprocess) -> float:
    """The largest difference in units of the 0..1 pixel scale (undoing the std)."""
    std = np.asarray(pre.std if pre.std is not None else (1.0, 1.0, 1.0), np.float32)
    return float((np.abs(ours - theirs) * std[:, None, None]).max())


@pytest.mark.parametrize(("cls_name", "settings"), CASES)
def test_matches_transformers_on_photos_and_synthetic_images(
    cls_name: str, settings: dict[str, Any]
) -> None:
    processor = _processor(cls_name, settings)
    pre = preprocess_from_config(_saved_config(processor))
    for image in _photos() + _synthetic():
        theirs = processor(images=image, return_tensors="np")["pixel_values"][0]
        ours = pre(image)
        assert ours.dtype == np.float32
        assert ours.shape == theirs.shape, (cls_name, image.size)
        assert _max_pixel_diff(ours, theirs, pre) <= 1 / 255, (cls_name, image.size)


def test_an_old_config_with_one_number_and_feature_extractor_type() -> None:
    vit = preprocess_from_config({"feature_extractor_type": "ViTFeatureExtractor", "size": 96})
    assert vit.resize_to == (96, 96)
    clip = preprocess_from_config({"image_processor_type": "CLIPImageProcessor", "size": 96})
    assert clip.shortest_edge == 96
    assert clip.crop_to == (224, 224)


def test_convnext_folds_its_crop_pct_into_resize_and_crop() -> None:
    pre = preprocess_from_config(
        {"image_processor_type": "ConvNextImageProcessor", "size": {"shortest_edge": 224}}
    )
    assert (pre.shortest_edge, pre.crop_to) == (256, (224, 224))


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"image_processor_type": "DetrImageProcessor"}, "supported: ViTImageProcessor"),
        ({}, "image processor 'none'"),
        ({"image_processor_type": "ViTImageProcessor", "size": {"max_height": 3}}, "size"),
        ({"image_processor_type": "ViTImageProcessor", "image_mean": [1, 2]}, "image_mean"),
        ({"image_processor_type": "ViTImageProcessor", "resample": 9}, "resample 9"),
    ],
)
def test_an_unsupported_config_is_one_line(config: dict[str, Any], message: str) -> None:
    with pytest.raises(InputError, match=message) as info:
        preprocess_from_config(config)
    assert "\n" not in str(info.value)
