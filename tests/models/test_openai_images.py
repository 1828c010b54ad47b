"""How pictures are read from OpenAI-style bodies (``batchline.models.openai.images``): data
URIs, bare base64 and URLs; vLLM's conversations; infinity's list; and each refusal's text,
which never holds the input."""

from __future__ import annotations

import base64

import pytest

from batchline.jobs.requests import embedding_line
from batchline.models.openai.images import (
    InputMessage,
    PictureRef,
    PictureTooLarge,
    picture_of,
    request_inputs,
)
from batchline.models.openai.requests import EmbeddingRequest

PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 40
B64 = base64.b64encode(PNG).decode()


def test_a_picture_comes_as_a_data_uri_bare_base64_or_a_url() -> None:
    assert picture_of(f"data:image/png;base64,{B64}", max_bytes=1000) == PictureRef(data=PNG)
    assert picture_of(f"DATA:image/PNG;charset=x;base64,{B64}", max_bytes=1000).data == PNG
    assert picture_of(B64, max_bytes=1000) == PictureRef(data=PNG)
    assert picture_of("https://example.com/a.jpg", max_bytes=10).url == "https://example.com/a.jpg"


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:image/png;base64,!!!!SECRET!!!!", "malformed"),
        ("data:text/plain;base64,SECRET", "must hold an image"),
        ("data:image/png,SECRET", "must be base64"),
        ("data:image/pngSECRET", "needs a comma"),
        ("file:///etc/SECRET", "an image is a data URI"),
        ("", "is empty"),
    ],
)
def test_each_bad_picture_is_one_error_that_does_not_echo_it(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says) as caught:
        picture_of(url, max_bytes=1000)
    assert "SECRET" not in str(caught.value)


def test_a_picture_over_the_byte_limit_is_refused_before_it_is_decoded() -> None:
    with pytest.raises(PictureTooLarge, match="limit of 10 bytes"):
        picture_of(f"data:image/png;base64,{B64}", max_bytes=10)


def _message(*parts: dict[str, object]) -> InputMessage:
    return InputMessage.model_validate({"role": "user", "content": list(parts)})


def test_a_conversation_gives_one_input_and_a_list_one_per_picture() -> None:
    image = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{B64}"}}
    kind, inputs = request_inputs(None, [_message(image)], "text", max_bytes=1000)
    assert (kind, inputs) == ("image", [PictureRef(data=PNG)])
    text = _message({"type": "text", "text": "a"}, {"type": "text", "text": "cat"})
    assert request_inputs(None, [text], "text", max_bytes=1000) == ("text", ["a\ncat"])
    kind, inputs = request_inputs([B64, B64], None, "image", max_bytes=1000)
    assert (kind, len(inputs)) == ("image", 2)
    assert request_inputs("hi", None, "text", max_bytes=1000) == ("text", ["hi"])
    with pytest.raises(ValueError, match="not both"):
        request_inputs("hi", [text], "text", max_bytes=1000)
    with pytest.raises(ValueError, match="'input' is missing"):
        request_inputs(None, None, "text", max_bytes=1000)


def test_a_batch_line_carries_its_pictures_and_never_a_url() -> None:
    body = EmbeddingRequest.model_validate({"input": [B64, B64], "modality": "image"})
    line = embedding_line(body, 8, "emb")
    assert (line.texts, line.pictures, line.items) == ((), (PNG, PNG), (PNG, PNG))
    text = embedding_line(EmbeddingRequest.model_validate({"input": "hi"}), 8, "emb")
    assert (text.items, text.pictures) == (("hi",), ())
    remote = EmbeddingRequest.model_validate({"input": ["http://x/a.jpg"], "modality": "image"})
    with pytest.raises(ValueError, match="URLs are not fetched"):
        embedding_line(remote, 8, "emb")
