"""OpenAI's embeddings response as JSON text (``batchline.models.openai.embeddings``): what
the route and the batch files both write."""

from __future__ import annotations

import base64
import json

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from batchline.models.openai.embeddings import embeddings_json, vector_json

finite32 = st.floats(width=32, allow_nan=False, allow_infinity=False)


@given(arrays(np.float32, st.integers(1, 64), elements=finite32))
def test_floats_read_back_to_the_same_float32(vector: np.ndarray) -> None:
    back = np.asarray(json.loads(vector_json(vector)), dtype=np.float32)
    assert np.array_equal(back, vector)


def test_base64_is_little_endian_float32() -> None:
    vector = np.array([0.5, -1.25, 3.0], dtype=np.float32)
    text = json.loads(vector_json(vector, as_base64=True))
    assert np.frombuffer(base64.b64decode(text), dtype="<f4").tolist() == [0.5, -1.25, 3.0]


def test_a_vector_json_has_no_number_for_is_still_written() -> None:
    vector = np.array([1.0, np.nan], dtype=np.float32)
    assert json.loads(vector_json(vector))[1] != json.loads(vector_json(vector))[1]  # NaN


def test_the_response_has_openais_shape() -> None:
    vectors = [np.array([1, 0], dtype=np.float32), np.array([0, 1], dtype=np.float32)]
    body = json.loads(embeddings_json(vectors, model='m "1"', tokens=7))
    assert body == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": [1, 0]},
            {"object": "embedding", "index": 1, "embedding": [0, 1]},
        ],
        "model": 'm "1"',
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
