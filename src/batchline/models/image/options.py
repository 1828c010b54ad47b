"""What ``--image-size``, ``--mean`` and ``--std`` say about a plain ONNX image model whose
folder has no processor config: one frozen value on the model spec (standard library only,
as the spec is)."""

from __future__ import annotations

from dataclasses import dataclass

from batchline._errors import InputError
from batchline.models.image.preprocess import ImagePreprocess

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "ImageOptions"]

#: The mean and standard deviation most ImageNet-trained models were normalized with.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: The evaluation crop's share of the resized picture (224 of 256: torchvision's and timm's).
_CROP_SHARE = 0.875


@dataclass(frozen=True)
class ImageOptions:
    """A plain ONNX model's preprocessing as the flags give it; ``None`` fields take their
    default (the model's fixed input size, ImageNet's mean and std).

    Set on a spec (even with every field ``None``), it also says "this ``.onnx`` reads
    pictures": a model with one NCHW input is then an image model, not a tensor model.
    """

    size: int | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.size is not None and self.size < 1:
            raise InputError(f"--image-size must be >= 1, got {self.size}")
        for name in ("mean", "std"):
            value = getattr(self, name)
            if value is not None and len(value) != 3:
                raise InputError(f"--{name} takes three numbers (R,G,B), got {list(value)}")
        if self.std is not None and min(self.std) <= 0:
            raise InputError(f"--std must be positive, got {list(self.std)}")

    def preprocess(self, model_size: tuple[int, int] | None) -> ImagePreprocess:
        """Resize the shorter side to ``size / 0.875``, center crop ``size`` x ``size``,
        rescale to [0, 1] and normalize. ``model_size``: the model's fixed ``(H, W)``, used
        when ``size`` is not given."""
        if self.size is not None:
            crop = (self.size, self.size)
        elif model_size is not None:
            crop = model_size
        else:
            raise InputError(
                "the model's input size is not fixed in its graph: pass --image-size N (the "
                "side of the square picture it was trained on, e.g. 224)"
            )
        return ImagePreprocess(
            shortest_edge=max(1, round(min(crop) / _CROP_SHARE)),
            crop_to=crop,
            resample="bilinear",
            rescale_factor=1 / 255,
            mean=self.mean or IMAGENET_MEAN,
            std=self.std or IMAGENET_STD,
        )
