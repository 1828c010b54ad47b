"""Random request bodies never get a 5xx, and the server keeps serving after them."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from .conftest import FakeEmbedder, serving

pytestmark = pytest.mark.anyio

# Text with lone surrogates, control characters and astral characters mixed in.
_chars = st.one_of(
    st.characters(),
    st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
    st.sampled_from(["\x00", "\n", "\u2028", "\U0001f600", '"', "\\"]),
)
_text = st.text(alphabet=_chars, max_size=40)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.integers(min_value=10**30, max_value=10**60),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0]),
    _text,
)
_json = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=6),
        st.dictionaries(_text, inner, max_size=5),
    ),
    max_leaves=25,
)
_texts = st.one_of(_text, st.lists(_text, max_size=8))
_embedding_body = st.fixed_dictionaries(
    {"input": st.one_of(_texts, _json)},
    optional={
        "model": st.one_of(st.just("fake"), _json),
        "encoding_format": st.one_of(st.sampled_from(["float", "base64"]), _json),
        "dimensions": st.one_of(st.just(8), _json),
        "user": _json,
    },
)
_generate_body = st.fixed_dictionaries(
    {"prompts": st.one_of(st.lists(_text, max_size=8), _json)},
    optional={"task_id": _json},
)


def _encode(value: Any) -> bytes:
    # ensure_ascii: lone surrogates become \\udXXX escapes; NaN/Infinity are written as such
    return json.dumps(value, allow_nan=True).encode("ascii")


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with serving(FakeEmbedder(max_length=8)) as (c, _app):
        yield c


_fuzz = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@_fuzz
@given(body=st.one_of(_embedding_body, _json))
async def test_embeddings_never_5xx(client: httpx.AsyncClient, body: Any) -> None:
    r = await client.post(
        "/v1/embeddings", content=_encode(body), headers={"content-type": "application/json"}
    )
    assert r.status_code < 500, r.text
    assert r.status_code in (200, 400, 404, 413, 422)
    r.json()  # always valid JSON


@_fuzz
@given(body=st.one_of(_generate_body, _json))
async def test_generate_never_5xx(client: httpx.AsyncClient, body: Any) -> None:
    r = await client.post(
        "/generate", content=_encode(body), headers={"content-type": "application/json"}
    )
    assert r.status_code in (200, 400, 413, 422), r.text
    r.json()


@_fuzz
@given(raw=st.binary(max_size=200))
async def test_raw_bytes_never_5xx(client: httpx.AsyncClient, raw: bytes) -> None:
    for path in ("/v1/embeddings", "/generate"):
        r = await client.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code in (200, 400, 413, 422), r.text


async def test_still_serving_after_junk(client: httpx.AsyncClient) -> None:
    for raw in (b'{"input": NaN}', b'{"input": "\\ud800"}', b"\x00" * 10, b"[[[[[[[[[["):
        await client.post("/v1/embeddings", content=raw)
    r = await client.post("/v1/embeddings", json={"input": "fine"})
    assert r.status_code == 200
