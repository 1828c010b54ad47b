"""``decode_image``: every mode to RGB, EXIF orientation, the first frame of an animation,
draft decoding that keeps the outputs, and each bad picture as one ``InputError``."""

from __future__ import annotations

import io
import struct
import zlib

import numpy as np
import pytest

pytest.importorskip("PIL")

from PIL import Image

from batchline._errors import InputError
from batchline.models.image import ImagePreprocess, ImageRef, decode_image
from tests.image_helpers import jpeg_bytes, picture, png_bytes


def _rgb(data: bytes, **kwargs: object) -> np.ndarray:
    return np.asarray(decode_image(data, **kwargs))  # type: ignore[arg-type]


def test_rgba_is_composited_on_white_as_transformers_does() -> None:
    rgba = Image.new("RGBA", (4, 3), (10, 20, 30, 0))  # fully transparent
    rgba.putpixel((0, 0), (200, 100, 50, 255))  # one opaque pixel
    got = _rgb(png_bytes(rgba))
    assert got.shape == (3, 4, 3)
    assert got[0, 0].tolist() == [200, 100, 50]
    assert got[1, 1].tolist() == [255, 255, 255]


@pytest.mark.parametrize("mode", ["L", "P", "CMYK", "LA", "1"])
def test_other_modes_become_rgb(mode: str) -> None:
    image = picture(3, mode=mode)
    out = io.BytesIO()
    image.save(out, "TIFF" if mode == "CMYK" else "PNG")
    got = decode_image(out.getvalue())
    assert got.mode == "RGB"
    assert got.size == image.size
    if mode == "L":  # grey stays grey: the three channels equal the one
        pixels = np.asarray(got)
        assert (pixels[..., 0] == np.asarray(image)).all()
        assert (pixels[..., 0] == pixels[..., 2]).all()


def test_a_16_bit_picture_is_scaled_to_8_bits_not_clipped() -> None:
    values = np.array([[0, 257 * 128, 65535]], dtype=np.uint16)
    got = _rgb(png_bytes(Image.fromarray(values)))
    assert got[0, :, 0].tolist() == [0, 128, 255]


def test_exif_orientation_is_applied() -> None:
    image = picture(1, size=(40, 20))
    exif = Image.Exif()
    exif[0x0112] = 6  # turned 90 degrees: shown upright, it is 20 wide and 40 high
    out = io.BytesIO()
    image.save(out, "JPEG", exif=exif.tobytes())
    assert decode_image(out.getvalue()).size == (20, 40)


def test_an_animation_gives_its_first_frame_without_decoding_the_others() -> None:
    frames = [Image.new("P", (8, 8), i % 200) for i in range(3000)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:], duration=10)
    first = decode_image(out.getvalue())
    assert first.size == (8, 8)
    palette_colour = frames[0].convert("RGB").getpixel((0, 0))
    assert first.getpixel((3, 3)) == palette_colour


def _png_declaring(width: int, height: int) -> bytes:
    """A small PNG whose header declares ``width`` x ``height`` (its data is one row)."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        crc = zlib.crc32(kind + body) & 0xFFFFFFFF
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    data = zlib.compress(b"\x00" * (width + 1))
    return (
        b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")
    )


def test_a_decompression_bomb_is_refused_from_its_header_naming_the_limit() -> None:
    bomb = _png_declaring(30_000, 30_000)
    assert len(bomb) < 100_000
    with pytest.raises(
        InputError, match=r"900,000,000 pixels.*limit is 100,000,000.*--max-image-pixels"
    ):
        decode_image(bomb, max_pixels=100_000_000)


def test_the_pixel_limit_can_be_raised_and_lowered() -> None:
    small = png_bytes(picture(0, size=(20, 10)))
    with pytest.raises(InputError, match="limit is 199"):
        decode_image(small, max_pixels=199)
    assert decode_image(small, max_pixels=200).size == (20, 10)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "empty"),
        (b"this is a text file, not a photo\n", "starts with the text"),
        (jpeg_bytes(0, size=(64, 64))[:300], "decode|truncated|readable"),
    ],
    ids=["zero-bytes", "text-named-jpg", "truncated-jpeg"],
)
def test_a_bad_picture_is_an_input_error(data: bytes, message: str) -> None:
    with pytest.raises(InputError, match=message):
        decode_image(data)


def test_an_image_ref_reads_a_span_or_names_an_unreadable_file(tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "blob"
    path.write_bytes(b"xxABCyy")
    assert ImageRef(path=str(path), offset=2, size=3).read() == b"ABC"
    with pytest.raises(InputError, match="ends before"):
        ImageRef(path=str(path), offset=5, size=3).read()
    (tmp_path / "gone.jpg").symlink_to(tmp_path / "nowhere.jpg")
    with pytest.raises(InputError, match=r"cannot read .*gone\.jpg"):
        ImageRef(path=str(tmp_path / "gone.jpg")).read()


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _photos() -> list[Image.Image]:
    sklearn = pytest.importorskip("sklearn.datasets")
    photos = [Image.fromarray(a) for a in sklearn.load_sample_images().images]
    # and each at 12 MP, as a camera writes them
    return photos + [p.resize((4000, 3000), Image.Resampling.BICUBIC) for p in photos]


@pytest.mark.parametrize("size", [64, 224])
def test_draft_decoding_keeps_the_model_input_of_real_photographs(size: int) -> None:
    preprocess = ImagePreprocess(
        shortest_edge=size,
        crop_to=(size, size),
        mean=(0.485, 0.456, 0.406),
        std=(0.229, 0.224, 0.225),
    )
    drafted = 0
    for photo in _photos():
        out = io.BytesIO()
        photo.save(out, "JPEG", quality=92)
        data = out.getvalue()
        full = preprocess(decode_image(data))
        reduced_image = decode_image(data, draft=preprocess.draft_size())
        drafted += reduced_image.size != photo.size
        assert min(reduced_image.size) >= size  # never below what the resize asks for
        assert _cosine(preprocess(reduced_image), full) >= 0.999
    assert drafted >= 2  # the draft did reduce the large ones
