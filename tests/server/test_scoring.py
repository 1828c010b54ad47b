"""The score task's routes (``/v1/rerank`` in Cohere's and Jina's shape, ``/v1/score`` in
vLLM's), ``dimensions`` on ``/v1/embeddings``, and ``/tokenize`` / ``/detokenize``."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from batchline.models.protocol import ModelInfo
from batchline.server import create_app

from .conftest import (
    FakeEmbedder,
    client_on,
    fake_generator_loader,
    fake_vector,
    loader,
    settings,
)

pytestmark = pytest.mark.anyio


class FakeScorer:
    """A score model: the share of the query's words found in the document."""

    def __init__(self) -> None:
        self.info = ModelInfo(
            name="rr",
            task="score",
            input_kind="record",
            cost_kind="padded",
            result_kind="value",
            result_column="score",
        )
        self.batches: list[int] = []
        self._lock = threading.Lock()

    def prepare(self, inputs: Sequence[object]) -> list[object]:
        out: list[object] = []
        for x in inputs:
            if isinstance(x, Mapping) and isinstance(x.get("query"), str):
                out.append((x["query"].split(), x["document"].split()))
            else:
                out.append(TypeError("a pair needs query and document"))
        return out

    def cost(self, item: tuple[list[str], list[str]]) -> int:
        return len(item[0]) + len(item[1]) + 3

    def run_batch(self, batch: list[tuple[list[str], list[str]]]) -> list[float]:
        with self._lock:
            self.batches.append(len(batch))
        return [len(set(q) & set(d)) / len(q) for q, d in batch]

    def encode(self, result: float) -> float:
        return result

    def close(self) -> None:
        pass


@asynccontextmanager
async def scoring(**overrides: Any) -> AsyncIterator[tuple[httpx.AsyncClient, FakeScorer]]:
    fake, scorer = FakeEmbedder(), FakeScorer()
    values: dict[str, Any] = {"model_name": None, "model": ["emb=default", "rr=m:rr"]}
    values.update(overrides)
    app = create_app(settings(**values), load_model=loader(fake, ("rr", scorer)))
    async with client_on(app, fake.gate.set) as client:
        yield client, scorer


DOCS = ["the cat sat", "a dog ran far", "the cat ate the fish", "nothing here"]


async def test_rerank_ranks_best_first_in_cohere_and_jina_shape() -> None:
    async with scoring() as (client, scorer):
        r = await client.post(
            "/v1/rerank", json={"model": "rr", "query": "the cat", "documents": DOCS}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["model"] == "rr"
        assert body["id"].startswith("rerank-")
        got = [(x["index"], x["relevance_score"], x["document"]["text"]) for x in body["results"]]
        assert got == [
            (0, 1.0, "the cat sat"),
            (2, 1.0, "the cat ate the fish"),
            (1, 0.0, "a dog ran far"),
            (3, 0.0, "nothing here"),
        ]
        # one padded token count per pair: 2 query words + document words + 3 specials
        assert body["usage"]["total_tokens"] == sum(2 + len(d.split()) + 3 for d in DOCS)
        # the pairs of one request went through the batcher together
        assert sum(scorer.batches) == 4


async def test_rerank_top_n_objects_and_no_documents() -> None:
    async with scoring() as (client, _):
        r = await client.post(
            "/rerank",
            json={
                "query": "the fish",
                "documents": [{"text": d} for d in DOCS],
                "top_n": 2,
                "return_documents": False,
            },
        )
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == [2, 0]
        assert all("document" not in x for x in results)


@pytest.mark.parametrize(
    ("body", "status", "words"),
    [
        ({"query": "", "documents": ["a"]}, 400, '\\"query\\" is empty'),
        ({"query": "a", "documents": []}, 400, '\\"documents\\" must be a non-empty list'),
        ({"query": "a", "documents": ["x", ""]}, 400, '\\"documents[1]\\" is empty'),
        ({"query": "a", "documents": ["x"], "top_n": 0}, 422, "top_n"),
        ({"query": "a", "documents": [1]}, 422, "documents"),
        ({"query": "a", "documents": ["x"] * 33}, 413, "at most 32"),
        ({"query": "a", "documents": ["x"], "model": "emb"}, 400, "/v1/embeddings"),
        ({"query": "a", "documents": ["x"], "model": "nope"}, 404, "rr (score)"),
    ],
)
async def test_rerank_refuses_bad_requests(body: dict[str, Any], status: int, words: str) -> None:
    async with scoring() as (client, _):
        r = await client.post("/v1/rerank", json=body)
        assert r.status_code == status, r.text
        assert words in r.text


async def test_embed_route_names_the_rerank_route_for_a_score_model() -> None:
    async with scoring() as (client, _):
        r = await client.post("/v1/embeddings", json={"model": "rr", "input": "a"})
        assert r.status_code == 400
        assert "POST /v1/rerank" in r.json()["error"]["message"]


async def test_score_pairs_one_text_1_with_each_text_2_or_zips_two_lists() -> None:
    async with scoring() as (client, _):
        r = await client.post(
            "/v1/score", json={"model": "rr", "text_1": "the cat", "text_2": DOCS[:2]}
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["object"] == "list"
        assert [(d["index"], d["object"], d["score"]) for d in body["data"]] == [
            (0, "score", 1.0),
            (1, "score", 0.0),
        ]
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] == 8 + 9
        r = await client.post(
            "/score", json={"text_1": ["a dog", "the x"], "text_2": ["a dog ran", "the cat"]}
        )
        assert [d["score"] for d in r.json()["data"]] == [1.0, 0.5]
        r = await client.post("/v1/score", json={"text_1": ["a", "b"], "text_2": ["a", "b", "c"]})
        assert r.status_code == 400
        assert "one text_1, or two lists of one length" in r.text


async def test_dimensions_truncate_and_renormalize() -> None:
    fake = FakeEmbedder()
    app = create_app(settings(), load_model=loader(fake))
    async with client_on(app, fake.gate.set) as client:
        r = await client.post("/v1/embeddings", json={"input": ["a b c"], "dimensions": 3})
        assert r.status_code == 200, r.text
        got = np.asarray(r.json()["data"][0]["embedding"], dtype=np.float32)
        full = fake_vector(fake, "a b c")[:3]
        np.testing.assert_allclose(got, full / np.linalg.norm(full), rtol=1e-6)
        assert abs(float(np.linalg.norm(got)) - 1.0) < 1e-6
        # the model's own size is accepted as it is
        r = await client.post("/v1/embeddings", json={"input": "a", "dimensions": 8})
        assert len(r.json()["data"][0]["embedding"]) == 8
        for bad in (9, 0, -1):
            r = await client.post("/v1/embeddings", json={"input": "a", "dimensions": bad})
            assert r.status_code == 400, bad
            assert "'dimensions' must be between 1 and 8" in r.text


async def test_tokenize_and_detokenize_round_trip_on_a_text_model() -> None:
    async with scoring() as (client, _):
        r = await client.post("/tokenize", json={"model": "emb", "prompt": "hello big world"})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["count"] == 5
        assert body["tokens"][0] == 101
        assert body["tokens"][-1] == 102
        assert body["max_model_len"] == 16  # the fake tokenizer's truncation
        plain = await client.post(
            "/tokenize",
            json={"model": "emb", "prompt": "hello big world", "add_special_tokens": False},
        )
        assert plain.json()["tokens"] == body["tokens"][1:-1]
        r = await client.post("/detokenize", json={"model": "emb", "tokens": body["tokens"]})
        assert r.status_code == 200, r.text
        assert r.json() == {"prompt": "hello big world"}


@pytest.mark.parametrize(
    ("path", "body", "status", "words"),
    [
        ("/tokenize", {"prompt": "a"}, 400, "name one in 'model'"),
        ("/tokenize", {"model": "emb"}, 400, "one of 'prompt' or 'messages'"),
        ("/tokenize", {"model": "nope", "prompt": "a"}, 404, "not served here"),
        (
            "/tokenize",
            {"model": "emb", "messages": [{"role": "user", "content": "a"}]},
            400,
            "generate model",
        ),
        ("/detokenize", {"model": "emb", "tokens": [7]}, 400, "cannot be decoded"),
        ("/detokenize", {"model": "emb", "tokens": [101, 31000]}, 400, "outside the vocabulary"),
        ("/detokenize", {"model": "emb", "tokens": [-1]}, 422, "tokens"),
    ],
)
async def test_tokenize_refuses_bad_requests(
    path: str, body: dict[str, Any], status: int, words: str
) -> None:
    async with scoring() as (client, _):
        r = await client.post(path, json=body)
        assert r.status_code == status, r.text
        assert words in r.text


async def test_tokenize_a_generate_model_takes_prompt_and_messages() -> None:
    app = create_app(
        settings(model_name=None, model=["gen=smollm2"]),
        load_model=loader(FakeEmbedder()),
        load_generator=fake_generator_loader(),
    )
    async with client_on(app) as client:
        r = await client.post("/tokenize", json={"prompt": "hi"})
        assert r.status_code == 200, r.text
        ids = r.json()["tokens"]
        assert r.json()["max_model_len"] > 0
        chat = await client.post(
            "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.json()["count"] > len(ids)  # the chat template's role markers
        r = await client.post("/detokenize", json={"tokens": ids})
        assert r.json() == {"prompt": "hi"}
