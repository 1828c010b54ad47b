"""A Hugging Face ``preprocessor_config.json`` to an :class:`ImagePreprocess`, as the
folder's own transformers image processor would read it (its PIL path).

A saved config names its processor (``image_processor_type``, or the older
``feature_extractor_type``) and the settings that differ from that class's defaults; the
defaults of the classes batchline reads are written down here (:data:`PROCESSORS`), so that
no transformers import is needed to preprocess. What each class does beyond resize, crop,
rescale and normalize folds into those steps:

- ``ConvNextImageProcessor`` (ConvNeXt, ResNet, RegNet): below 384 pixels it resizes the
  shorter side to ``shortest_edge / crop_pct`` and center-crops ``shortest_edge`` square;
  from 384 up it resizes to a square;
- ``EfficientNetImageProcessor``: ``rescale_offset`` subtracts 1 after rescaling and
  ``include_top`` divides by ``std`` a second time: both become the mean and std applied.

Example::

    preprocess = preprocess_from_config(read_processor_config(Path("vit/")))
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batchline._errors import InputError
from batchline.models.image.preprocess import RESAMPLE_NAMES, ImagePreprocess

__all__ = ["PROCESSORS", "preprocess_from_config", "read_processor_config"]

_STANDARD = ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5))
_CLIP = ((0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711))

#: The defaults of each processor class read here: what a saved config leaves out.
PROCESSORS: dict[str, dict[str, Any]] = {
    "ViTImageProcessor": {
        "size": {"height": 224, "width": 224},
        "resample": 2,
        "do_center_crop": False,
        "mean_std": _STANDARD,
        "square": True,
    },
    "CLIPImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": True,
        "mean_std": _CLIP,
        "square": False,
    },
    "BitImageProcessor": {
        "size": {"shortest_edge": 224},
        "crop_size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": True,
        "mean_std": _CLIP,
        "square": False,
    },
    "SiglipImageProcessor": {
        "size": {"height": 224, "width": 224},
        "resample": 3,
        "do_center_crop": False,
        "mean_std": _STANDARD,
        "square": True,
    },
    "ConvNextImageProcessor": {
        "size": {"shortest_edge": 384},
        "resample": 3,
        "do_center_crop": False,
        "mean_std": ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)),
        "square": False,
        "crop_pct": 224 / 256,
    },
    "EfficientNetImageProcessor": {
        "size": {"height": 346, "width": 346},
        "crop_size": {"height": 289, "width": 289},
        "resample": 3,
        "do_center_crop": False,
        "mean_std": _STANDARD,
        "square": True,
        "rescale_offset": False,
        "include_top": True,
    },
}


def read_processor_config(folder: Path) -> dict[str, Any]:
    """``folder/preprocessor_config.json`` as a mapping; an :class:`InputError` line when it is
    missing or not a JSON object."""
    from batchline.models.hf import read_json_object

    return read_json_object(folder / "preprocessor_config.json", folder)


def _processor_name(config: Mapping[str, Any]) -> str:
    name = str(config.get("image_processor_type") or config.get("feature_extractor_type") or "")
    name = name.removesuffix("Pil").removesuffix("Fast")
    return name.replace("FeatureExtractor", "ImageProcessor")


def _size(value: object, *, square: bool, what: str) -> dict[str, int]:
    """A size as ``{"height", "width"}`` or ``{"shortest_edge"}`` (an int is either, as the
    class's ``default_to_square`` says, the way transformers reads an old config)."""
    if isinstance(value, int) and not isinstance(value, bool):
        return {"height": value, "width": value} if square else {"shortest_edge": value}
    if isinstance(value, Mapping):
        out = {k: v for k, v in value.items() if isinstance(v, int) and v > 0}
        if "height" in out and "width" in out:
            return {"height": out["height"], "width": out["width"]}
        if "shortest_edge" in out and "longest_edge" not in out:
            return {"shortest_edge": out["shortest_edge"]}
    raise InputError(
        f"preprocessor_config.json: {what} {value!r} is not supported; supported: "
        '{"height": H, "width": W}, {"shortest_edge": N} or one number'
    )


def _triple(value: object, what: str) -> tuple[float, float, float]:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, list | tuple) and len(value) == 3:
        try:
            a, b, c = (float(v) for v in value)
        except (TypeError, ValueError):
            pass
        else:
            return (a, b, c)
    raise InputError(f"preprocessor_config.json: {what} must be three numbers, got {value!r}")


def preprocess_from_config(config: Mapping[str, Any]) -> ImagePreprocess:
    """The :class:`ImagePreprocess` that matches the transformers image processor a
    ``preprocessor_config.json`` describes (see the module docstring)."""
    name = _processor_name(config)
    defaults = PROCESSORS.get(name)
    if defaults is None:
        known = ", ".join(PROCESSORS)
        raise InputError(
            f"preprocessor_config.json names image processor {name or 'none'!r}; supported: "
            f"{known}; for another, export the model to model.onnx and give --image-size, "
            "--mean and --std"
        )

    def get(key: str, default: object = None) -> Any:
        value = config.get(key)
        return defaults.get(key, default) if value is None else value

    resample = get("resample", 2)
    if resample not in RESAMPLE_NAMES:
        raise InputError(f"preprocessor_config.json: resample {resample!r} is not a PIL filter")
    square = bool(defaults["square"])
    shortest_edge: int | None = None
    resize_to: tuple[int, int] | None = None
    crop_to: tuple[int, int] | None = None
    if get("do_resize", True):
        size = _size(get("size"), square=square, what="size")
        if name == "ConvNextImageProcessor":
            if "shortest_edge" not in size:
                raise InputError("preprocessor_config.json: a ConvNeXt size needs shortest_edge")
            edge = size["shortest_edge"]
            if edge < 384:
                shortest_edge, crop_to = int(edge / float(get("crop_pct"))), (edge, edge)
            else:
                resize_to = (edge, edge)
        elif "shortest_edge" in size:
            shortest_edge = size["shortest_edge"]
        else:
            resize_to = (size["height"], size["width"])
    if get("do_center_crop"):
        crop = _size(get("crop_size"), square=True, what="crop_size")
        if "height" not in crop:
            raise InputError("preprocessor_config.json: crop_size needs height and width")
        if crop_to is not None:
            raise InputError(
                "preprocessor_config.json: a ConvNeXt resize below 384 crops already; "
                "do_center_crop as well is not supported"
            )
        crop_to = (crop["height"], crop["width"])
    rescale: float | None = (
        float(get("rescale_factor", 1 / 255)) if get("do_rescale", True) else None
    )
    offset = 1.0 if rescale is not None and get("rescale_offset", False) else 0.0
    default_mean, default_std = defaults["mean_std"]
    mean = (0.0, 0.0, 0.0)
    std = (1.0, 1.0, 1.0)
    if get("do_normalize", True):
        mean = _triple(config.get("image_mean", default_mean), "image_mean")
        std = _triple(config.get("image_std", default_std), "image_std")
    if get("include_top", False):  # EfficientNet divides by std once more
        std_again = _triple(config.get("image_std", default_std), "image_std")
        std = (std[0] * std_again[0], std[1] * std_again[1], std[2] * std_again[2])
    mean = (mean[0] + offset, mean[1] + offset, mean[2] + offset)
    plain = mean == (0.0, 0.0, 0.0) and std == (1.0, 1.0, 1.0)
    return ImagePreprocess(
        shortest_edge=shortest_edge,
        resize_to=resize_to,
        crop_to=crop_to,
        resample=RESAMPLE_NAMES[resample],
        rescale_factor=rescale,
        mean=None if plain else mean,
        std=None if plain else std,
    )
