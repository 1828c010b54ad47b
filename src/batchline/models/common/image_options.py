"""What ``--image-size``, ``--mean`` and ``--std`` say about a plain ONNX image model whose
folder has no processor config: one frozen value on the model spec (standard library only,
as the spec is). The image backend turns it into the model's preprocessing
(``models/image/onnx_image.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from batchline._errors import InputError

__all__ = ["ImageOptions"]


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
