"""An image model's preprocessing, as one picklable value: resize, center crop, rescale,
normalize, to a float32 ``(channels, height, width)`` array.

One :class:`ImagePreprocess` describes what a model wants (read from a Hugging Face folder's
``preprocessor_config.json``, or from ``--image-size``/``--mean``/``--std`` for a plain ONNX
model). It travels to the decode worker processes whole, so it holds plain values only, and
it tells the decoder how small a JPEG may be decoded (:meth:`ImagePreprocess.draft_size`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

__all__ = ["PICTURE_TOKENS", "RESAMPLE_NAMES", "ImagePreprocess"]

#: How many of a batch's target tokens (``target_batch_tokens``, 512 by default) one picture
#: stands for when an image model's batches form: 512 / 64 = batches of 8 pictures (raise the
#: target for larger batches, on a GPU). A picture's cost stays 1 (what ``usage`` counts). At
#: one token a picture, a deep queue made batches as large as the pictures in flight, and every
#: picture of a batch waits for all of it, while on a CPU larger batches buy nothing: ViT-S/16
#: on ONNX Runtime, 2 sessions x 1 thread, the AMX Xeon (2026-12-02), ran 23.8, 23.4 and 22.7
#: pictures/s in batches of 8, 16 and 32.
PICTURE_TOKENS = 64

#: Pillow's resampling filters by name (the numbers are Pillow's and transformers' ``resample``).
RESAMPLE_NAMES: dict[int, str] = {
    0: "nearest",
    1: "lanczos",
    2: "bilinear",
    3: "bicubic",
    4: "box",
    5: "hamming",
}


@dataclass(frozen=True)
class ImagePreprocess:
    """How one RGB picture becomes a model's input.

    Steps, each skipped when its field is ``None``: resize so the shorter side is
    ``shortest_edge`` (aspect kept), or to the fixed ``resize_to`` ``(height, width)``; center
    crop to ``crop_to`` ``(height, width)``; multiply by ``rescale_factor``; subtract ``mean``
    and divide by ``std`` per channel.

    Example, a ViT classifier's::

        ImagePreprocess(resize_to=(224, 224), resample="bilinear", mean=(0.5,) * 3, std=(0.5,) * 3)
    """

    shortest_edge: int | None = None
    resize_to: tuple[int, int] | None = None
    crop_to: tuple[int, int] | None = None
    resample: str = "bicubic"
    rescale_factor: float | None = 1 / 255
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None

    def __post_init__(self) -> None:
        if self.shortest_edge is not None and self.resize_to is not None:
            raise ValueError("give shortest_edge or resize_to, not both")
        if self.shortest_edge is not None and self.shortest_edge < 1:
            raise ValueError(f"shortest_edge must be >= 1, got {self.shortest_edge}")
        for name in ("resize_to", "crop_to"):
            value = getattr(self, name)
            if value is not None and (len(value) != 2 or min(value) < 1):
                raise ValueError(f"{name} must be (height, width) of sizes >= 1, got {value!r}")
        if self.resample not in RESAMPLE_NAMES.values():
            names = ", ".join(sorted(RESAMPLE_NAMES.values()))
            raise ValueError(f"resample must be one of {names}, got {self.resample!r}")
        if (self.mean is None) != (self.std is None):
            raise ValueError("give mean and std together")

    @property
    def output_size(self) -> tuple[int, int] | None:
        """The ``(height, width)`` every output has, when it does not depend on the input."""
        return self.crop_to or self.resize_to

    def draft_size(self) -> tuple[int, int] | None:
        """The smallest ``(width, height)`` the decoder may reduce a picture to before
        :meth:`__call__` (JPEG's DCT scaling), keeping at least the size the resize asks for."""
        if self.resize_to is not None:
            return (self.resize_to[1], self.resize_to[0])
        if self.shortest_edge is not None:
            return (self.shortest_edge, self.shortest_edge)
        return None

    def __call__(self, image: Image.Image) -> np.ndarray:
        """The float32 ``(3, height, width)`` input for one RGB picture."""
        import numpy as np
        from PIL import Image

        resample = Image.Resampling[self.resample.upper()]
        if self.shortest_edge is not None:
            width, height = image.size
            short, long = (width, height) if width <= height else (height, width)
            new_short, new_long = self.shortest_edge, int(self.shortest_edge * long / short)
            size = (new_short, new_long) if width <= height else (new_long, new_short)
            image = image.resize(size, resample=resample)
        elif self.resize_to is not None:
            image = image.resize((self.resize_to[1], self.resize_to[0]), resample=resample)
        if self.crop_to is not None:
            crop_h, crop_w = self.crop_to
            width, height = image.size
            top, left = (height - crop_h) // 2, (width - crop_w) // 2
            image = image.crop((left, top, left + crop_w, top + crop_h))
        pixels: np.ndarray = np.asarray(image, dtype=np.float32)
        if self.rescale_factor is not None:
            pixels = pixels * np.float32(self.rescale_factor)
        if self.mean is not None and self.std is not None:
            mean, std = np.asarray(self.mean, np.float32), np.asarray(self.std, np.float32)
            pixels = (pixels - mean) / std
        return np.ascontiguousarray(pixels.transpose(2, 0, 1))
