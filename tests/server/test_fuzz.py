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
        await client.post(
            "/v1/embeddings", content=raw, headers={"content-type": "application/json"}
        )
    r = await client.post("/v1/embeddings", json={"input": "fine"})
    assert r.status_code == 200


@pytest.fixture
async def several_client() -> AsyncIterator[httpx.AsyncClient]:
    from .test_models import several

    async with several() as (c, _app):
        yield c


_classify_body = st.fixed_dictionaries(
    {"input": st.one_of(_texts, _json)},
    optional={
        "model": st.one_of(st.sampled_from(["clf", "emb", "nope"]), _json),
        "return_all_scores": _json,
    },
)
_tensor = st.fixed_dictionaries(
    {
        "name": st.one_of(st.sampled_from(["x", "text"]), _json),
        "datatype": st.one_of(st.sampled_from(["FP32", "BYTES", "INT64", "BF16"]), _json),
        "shape": st.one_of(st.lists(st.integers(-2, 4), max_size=3), _json),
        "data": _json,
    },
    optional={"parameters": _json},
)
_infer_body = st.fixed_dictionaries(
    {"inputs": st.one_of(st.lists(_tensor, max_size=3), _json)},
    optional={"id": _json, "outputs": _json, "parameters": _json},
)


@_fuzz
@given(body=st.one_of(_classify_body, _json))
async def test_classify_never_5xx(several_client: httpx.AsyncClient, body: Any) -> None:
    r = await several_client.post(
        "/classify", content=_encode(body), headers={"content-type": "application/json"}
    )
    assert r.status_code in (200, 400, 404, 413, 422), r.text
    r.json()


@_fuzz
@given(
    name=st.sampled_from(["pred", "emb", "clf", "rec", "nope"]),
    body=st.one_of(_infer_body, _json),
)
async def test_oip_infer_never_5xx(several_client: httpx.AsyncClient, name: str, body: Any) -> None:
    r = await several_client.post(
        f"/v2/models/{name}/infer",
        content=_encode(body),
        headers={"content-type": "application/json"},
    )
    assert r.status_code in (200, 400, 404, 413), r.text
    assert set(r.json()) == ({"error"} if r.status_code != 200 else set(r.json()))


@_fuzz
@given(raw=st.binary(max_size=200), header=st.one_of(st.none(), st.text(max_size=6)))
async def test_oip_raw_bytes_never_5xx(
    several_client: httpx.AsyncClient, raw: bytes, header: str | None
) -> None:
    headers = {"content-type": "application/octet-stream"}
    if header is not None and header.isascii() and header.isprintable():
        headers["Inference-Header-Content-Length"] = header
    r = await several_client.post("/v2/models/pred/infer", content=raw, headers=headers)
    if "Inference-Header-Content-Length" not in headers:
        # without the binary header the body is JSON by the protocol: octet-stream is a 415
        assert r.status_code == 415, r.text
        return
    assert r.status_code in (400, 413), r.text
    assert set(r.json()) == {"error"}
