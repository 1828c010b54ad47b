"""Only the user's own clients drive the server: a body must be JSON (a cross-site form or
``text/plain`` post is a 415), the ``Host`` must name this server (DNS rebinding is a 421),
no CORS headers unless ``cors_origins`` is given, and ``/ready`` names no models behind an
API key."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from batchline.__main__ import main
from batchline.server import ServerSettings

from .conftest import serving

pytestmark = pytest.mark.anyio

BODY = json.dumps({"input": ["hello there"]}).encode()


async def post(client: httpx.AsyncClient, content_type: str | None, **kw: Any) -> httpx.Response:
    headers = {} if content_type is None else {"content-type": content_type}
    headers.update(kw.pop("headers", {}))
    return await client.post("/v1/embeddings", content=BODY, headers=headers, **kw)


@pytest.mark.parametrize(
    "content_type",
    [
        "text/plain",
        "text/plain; charset=utf-8",
        "application/x-www-form-urlencoded",
        "multipart/form-data; boundary=x",
        "application/jsonx",
        None,
    ],
)
async def test_a_body_that_is_not_declared_json_is_a_415(content_type: str | None) -> None:
    async with serving() as (client, _):
        r = await post(client, content_type)
        assert r.status_code == 415, r.text
        error = r.json()["error"]
        assert error["type"] == "unsupported_media"
        assert "Content-Type: application/json" in error["message"]
        assert (content_type or "no Content-Type").split(";")[0] in error["message"]
        # the server goes on serving
        assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200


@pytest.mark.parametrize(
    "content_type",
    ["application/json", "Application/JSON; charset=utf-8", "application/vnd.api+json"],
)
async def test_json_media_types_are_served(content_type: str) -> None:
    async with serving() as (client, _):
        r = await post(client, content_type)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"]) == 1


async def test_an_oip_request_without_a_content_type_is_json_as_the_protocol_says() -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    async with serving() as (client, _):
        raw = json.dumps(body).encode()
        r = await client.post("/v2/models/fake/infer", content=raw)  # as tritonclient sends
        assert r.status_code == 200, r.text
        r = await client.post("/v2/models/fake/infer", content=raw, headers=FORM)
        assert r.status_code == 415
        r = await client.post("/v1/embeddings", content=BODY)  # elsewhere none is a 415
        assert r.status_code == 415


FORM = {"content-type": "application/x-www-form-urlencoded"}


async def test_a_binary_oip_request_keeps_its_own_content_type() -> None:
    async with serving() as (client, _):
        r = await client.post(
            "/v2/models/fake/infer",
            content=b"{}",
            headers={
                "content-type": "application/octet-stream",
                "inference-header-content-length": "2",
            },
        )
        assert r.status_code == 400, r.text  # past the gate: the codec judged it


@pytest.mark.parametrize(
    "host", ["evil.example", "evil.example:8000", "127.0.0.1.evil.example", "localhost.:x"]
)
async def test_a_foreign_host_is_refused_with_a_json_error(host: str) -> None:
    async with serving() as (client, _):
        r = await post(client, "application/json", headers={"host": host})
        assert r.status_code == 421, r.text
        error = r.json()["error"]
        assert "--allowed-hosts" in error["message"]
        assert (await client.get("/ready", headers={"host": host})).status_code == 421
        assert (await client.get("/metrics", headers={"host": host})).status_code == 421
        # liveness says nothing, whatever the name
        assert (await client.get("/health", headers={"host": host})).status_code == 200


@pytest.mark.parametrize(
    "host", ["localhost", "localhost:8000", "127.0.0.1:1234", "[::1]:8000", "[::1]", "LOCALHOST"]
)
async def test_loopback_names_are_served_with_or_without_a_port(host: str) -> None:
    async with serving() as (client, _):
        r = await post(client, "application/json", headers={"host": host})
        assert r.status_code == 200, r.text


async def test_allowed_hosts_widens_the_names() -> None:
    async with serving(allowed_hosts="api.example.com, *.corp.example") as (client, _):
        for host in ("api.example.com:443", "a.corp.example", "b.a.corp.example", "localhost"):
            r = await post(client, "application/json", headers={"host": host})
            assert r.status_code == 200, (host, r.text)
        for host in ("corp.example", "evil.example", "api.example.com.evil"):
            r = await post(client, "application/json", headers={"host": host})
            assert r.status_code == 421, host
    async with serving(allowed_hosts=["*"]) as (client, _):
        r = await post(client, "application/json", headers={"host": "anything.example"})
        assert r.status_code == 200


def test_host_names_follow_the_bind_address() -> None:
    loopback = {"localhost", "127.0.0.1", "::1"}
    assert ServerSettings().host_names == loopback
    assert ServerSettings(host="::1").host_names == loopback
    assert ServerSettings(host="10.0.0.5").host_names == loopback | {"10.0.0.5"}
    # every interface: reached by names the server cannot know, unless told
    assert ServerSettings(host="0.0.0.0").host_names is None
    assert ServerSettings(host="::", allowed_hosts="api.example.com").host_names == loopback | {
        "api.example.com"
    }
    assert ServerSettings(host="127.0.0.1", allowed_hosts="*").host_names is None


@pytest.mark.parametrize(
    ("key", "value", "says"),
    [
        ("allowed_hosts", "http://api.example.com", "without scheme or path"),
        ("cors_origins", "app.example.com", "scheme://host"),
    ],
)
def test_bad_host_or_origin_is_refused_with_the_form_to_use(
    key: str, value: str, says: str
) -> None:
    from batchline._errors import InputError

    with pytest.raises(InputError, match=says):
        ServerSettings.build({key: value})


async def test_no_cors_headers_unless_origins_are_given() -> None:
    origin = {"origin": "https://app.example"}
    preflight = {
        **origin,
        "access-control-request-method": "POST",
        "access-control-request-headers": "content-type",
    }
    async with serving() as (client, _):
        r = await post(client, "application/json", headers=origin)
        assert r.status_code == 403  # a page of another origin: refused (see below)
        assert not any(k.startswith("access-control-") for k in r.headers)
        r = await client.options("/v1/embeddings", headers=preflight)
        assert not any(k.startswith("access-control-") for k in r.headers)
    async with serving(cors_origins="https://app.example") as (client, _):
        r = await post(client, "application/json", headers=origin)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = await client.options("/v1/embeddings", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        assert "content-type" in r.headers["access-control-allow-headers"].lower()
        r = await post(client, "application/json", headers={"origin": "https://evil.example"})
        assert r.status_code == 403
        assert "access-control-allow-origin" not in r.headers


FOREIGN = [
    {"origin": "https://evil.example"},
    {"origin": "null"},  # a sandboxed frame or a file: page
    {"origin": "http://127.0.0.1:9999"},  # another port is another origin
    {"sec-fetch-site": "cross-site"},  # a GET from another site's page carries no Origin
    {"sec-fetch-site": "same-site"},
]


@pytest.mark.parametrize("headers", FOREIGN)
async def test_a_cross_site_request_is_refused_on_every_route(headers: dict[str, str]) -> None:
    async with serving() as (client, _):
        calls = [
            post(client, "application/json", headers=headers),
            client.get("/v1/models", headers=headers),
            client.get("/health", headers=headers),
            client.post(  # the upload: refused before a byte of it is read
                "/v1/files",
                files={"file": ("a.jsonl", b"{}\n" * 100)},
                data={"purpose": "batch"},
                headers=headers,
            ),
        ]
        for call in calls:
            r = await call
            assert r.status_code == 403, r.text
            error = r.json()["error"]
            assert error["type"] == "cross_origin"
            assert "--cors-origins" in error["message"]
            assert next(iter(headers.values())) in error["message"]
        # the server goes on serving its own clients
        assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200


@pytest.mark.parametrize(
    "headers",
    [
        {},  # curl, the SDKs, drive: no browser headers at all
        {"origin": "http://127.0.0.1"},  # the server's own page
        {"origin": "http://127.0.0.1:80"},  # the scheme's default port is the same origin
        {"sec-fetch-site": "same-origin"},
        {"sec-fetch-site": "none"},  # typed into the address bar
    ],
)
async def test_same_origin_and_non_browser_requests_pass(headers: dict[str, str]) -> None:
    async with serving() as (client, _):
        r = await post(client, "application/json", headers=headers)
        assert r.status_code == 200, r.text


async def test_cors_origins_let_those_pages_through() -> None:
    async with serving(cors_origins="https://app.example,https://b.example") as (client, _):
        for origin in ("https://app.example", "https://B.example"):
            r = await post(client, "application/json", headers={"origin": origin})
            assert r.status_code == 200, r.text
        r = await post(client, "application/json", headers={"origin": "https://c.example"})
        assert r.status_code == 403
    async with serving(cors_origins="*") as (client, _):
        r = await post(client, "application/json", headers={"origin": "https://c.example"})
        assert r.status_code == 200


async def test_ready_names_no_models_behind_an_api_key() -> None:
    async with serving() as (client, _):
        assert (await client.get("/ready")).json() == {"status": "ready", "models": ["fake"]}
    async with serving(api_key="s3cret") as (client, _):
        r = await client.get("/ready")
        assert r.status_code == 200
        assert r.json() == {"status": "ready"}
        assert (await client.get("/health")).status_code == 200
        r = await client.get("/v1/models", headers={"authorization": "Bearer s3cret"})
        assert [m["id"] for m in r.json()["data"]] == ["fake"]


def test_cli_flags_set_allowed_hosts_and_cors_origins(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "serve",
            "--allowed-hosts",
            "api.example.com,*.corp.example",
            "--cors-origins",
            "https://app.example",
            "--print-config",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["allowed_hosts"] == ["api.example.com", "*.corp.example"]
    assert data["cors_origins"] == ["https://app.example"]
