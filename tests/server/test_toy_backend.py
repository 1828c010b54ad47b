"""``serve`` with a backend it was not written for: the toy of ``tests/toy_backend.py``,
registered for the test's block only, loaded by the app's own loader (no ``load_model``
given) and answering ``/v1/embeddings`` with its vectors."""

from __future__ import annotations

import numpy as np
import pytest

from batchline.models.registry import BACKENDS
from batchline.server import create_app
from tests.toy_backend import TOY, toy_vector

from .conftest import client_on, settings

pytestmark = pytest.mark.anyio


async def test_serve_answers_embeddings_from_a_registered_toy_backend() -> None:
    texts = ["a cat", "the quick brown fox"]
    with BACKENDS.registered(TOY):
        app = create_app(settings(model=["toy:hello"], model_name=None))
        async with client_on(app) as client:
            cards = (await client.get("/v1/models")).json()["data"]
            assert [(c["id"], c["task"]) for c in cards] == [("hello", "embed")]
            r = await client.post("/v1/embeddings", json={"model": "hello", "input": texts})
            assert r.status_code == 200, r.text
            body = r.json()
    assert "toy" not in BACKENDS.names()
    got = np.array([d["embedding"] for d in body["data"]], dtype=np.float32)
    np.testing.assert_array_equal(got, np.stack([toy_vector(t) for t in texts]))
    assert body["usage"]["prompt_tokens"] == 2 + 4  # the toy's cost: a text's words
