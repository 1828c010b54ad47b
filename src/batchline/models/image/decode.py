"""One picture's bytes to an RGB Pillow image: what every image model's input goes through
first, in the decode worker processes (:mod:`batchline.models.image.pool`) or inline.

:class:`ImageRef` says where a picture's bytes are (a file, a span of a ``.tar`` shard, or the
bytes themselves) as a small picklable value, so a dataset reader hands out references and
only a decode worker reads the bytes. :func:`decode_image` turns bytes into RGB: EXIF
orientation applied, alpha composited on white (as transformers' ``convert_to_rgb`` does),
palette, grayscale, CMYK and 16-bit images converted, the first frame of an animation, a JPEG
decoded at reduced scale when ``draft`` allows it, and a picture whose header declares more
than ``max_pixels`` refused before any pixel is decoded (a decompression bomb).

Every failure is an :class:`~batchline._errors.InputError` naming what is wrong with the
picture: it is that record's error, never the job's.

    >>> image = decode_image(Path("cat.jpg").read_bytes(), draft=(224, 224), max_pixels=10**8)
"""

from __future__ import annotations

import io
import re
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchline._errors import InputError

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["DEFAULT_MAX_PIXELS", "IMAGE_SUFFIXES", "ImageRef", "TooManyPixelsError", "decode_image"]

#: Pictures larger than this many pixels are refused unless told otherwise (about 13,000 x
#: 13,000; a 12 MP camera photo is well under it, a decompression bomb well over it).
DEFAULT_MAX_PIXELS = 178_956_970
#: What a folder's files must end with to be read as pictures (case-insensitive).
IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm"}
)
_ORIENTATION = 0x0112
_SWAPS_AXES = frozenset({5, 6, 7, 8})  # EXIF orientations that turn the picture by 90 degrees


class TooManyPixelsError(InputError):
    """A picture declares more pixels than the limit (a decompression bomb, or a limit set
    too low): raised by :func:`decode_image` from the header alone."""


@dataclass(frozen=True, slots=True)
class ImageRef:
    """Where one picture's bytes are: ``data`` itself, or ``size`` bytes of the file ``path``
    from ``offset`` (a member of a ``.tar`` shard; ``size=None``: the whole file)."""

    path: str | None = None
    offset: int = 0
    size: int | None = None
    data: bytes | None = None

    def __post_init__(self) -> None:
        if (self.path is None) == (self.data is None):
            raise ValueError("an ImageRef holds a path or data, one of them")

    @property
    def nbytes(self) -> int:
        """The bytes it holds or names (0 when a whole file's size is not known yet)."""
        if self.data is not None:
            return len(self.data)
        return self.size or 0

    def read(self) -> bytes:
        """The picture's bytes; ``InputError`` naming the file when it cannot be read."""
        if self.data is not None:
            return self.data
        assert self.path is not None
        try:
            with open(self.path, "rb") as f:
                if self.offset:
                    f.seek(self.offset)
                data = f.read() if self.size is None else f.read(self.size)
        except OSError as exc:
            raise InputError(f"cannot read {self.path}: {exc.strerror or exc}") from None
        if self.size is not None and len(data) != self.size:
            raise InputError(f"{self.path}: ends before the picture's {self.size:,} bytes")
        return data


def decode_image(
    data: bytes, *, draft: tuple[int, int] | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Image.Image:
    """``data`` as an RGB image (see the module docstring).

    ``draft``: the smallest ``(width, height)`` the caller will resize to; a JPEG is then
    decoded at 1/2, 1/4 or 1/8 scale where that stays at least this size (Pillow's
    ``draft``). ``max_pixels``: the most pixels a picture may declare.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    if not data:
        raise InputError("the file is empty (0 bytes), not a picture")
    with warnings.catch_warnings():
        # the limit is ours (max_pixels), checked below from the header alone
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:  # Pillow's own limit, where it is set
            found = re.search(r"\((\d+) pixels\)", str(exc))
            what = f"{int(found.group(1)):,} pixels" if found else str(exc)
            raise TooManyPixelsError(_too_large(what, max_pixels)) from None
        except UnidentifiedImageError:
            raise InputError(f"not a picture Pillow can read ({_head(data)})") from None
        except (OSError, ValueError, SyntaxError) as exc:
            raise InputError(f"not a readable picture: {exc}") from None
    width, height = image.size
    if width * height > max_pixels:
        raise TooManyPixelsError(
            _too_large(f"{width} x {height} = {width * height:,} pixels", max_pixels)
        )
    try:
        if draft is not None and image.format == "JPEG":
            want = draft
            orientation = image.getexif().get(_ORIENTATION)
            if orientation in _SWAPS_AXES:
                want = (draft[1], draft[0])
            image.draft("RGB", want)
        image.load()  # the first frame only: an animation's others are never decoded
        return _to_rgb(ImageOps.exif_transpose(image))
    except InputError:
        raise
    except Exception as exc:  # Pillow's decoders raise OSError, ValueError, SyntaxError, ...
        raise InputError(f"cannot decode the picture: {exc}") from None


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB, whatever the mode: alpha composited on white, 16-bit and float scaled to 8 bits."""
    from PIL import Image

    mode = image.mode
    if mode == "RGB":
        return image
    if mode in ("I;16", "I;16B", "I;16L", "I;16N", "I", "F"):
        import numpy as np

        pixels = np.asarray(image, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") or pixels.max(initial=0) > 255 else 255.0
        if mode == "F":
            top = 1.0 if pixels.max(initial=0) <= 1.0 else 255.0
        grey = np.clip(np.rint(pixels * (255.0 / top)), 0, 255).astype(np.uint8)
        return Image.fromarray(grey).convert("RGB")
    has_alpha = mode in ("RGBA", "LA", "PA", "RGBa", "La") or (
        mode == "P" and "transparency" in image.info
    )
    if has_alpha:
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image.convert("RGB")


def _too_large(what: str, max_pixels: int) -> str:
    return (
        f"the picture is too large ({what}; the limit is {max_pixels:,} pixels): a "
        "decompression bomb, or pass a higher --max-image-pixels to read it"
    )


def _head(data: bytes) -> str:
    """What the bytes start with, for a message about a file that is no picture."""
    head = data[:16]
    if all(32 <= b < 127 or b in (9, 10, 13) for b in head):
        return f"it starts with the text {head.decode('ascii')!r}"
    return f"{len(data):,} bytes starting {head[:8].hex(' ')}"
