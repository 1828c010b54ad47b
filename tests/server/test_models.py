"""Several models in one app: routing by name and task, /v1/models, /classify, the Open
Inference Protocol routes, and 429s that are all-or-nothing and per model."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import numpy as np
import pytest

from batchline.models.protocol import ModelInfo
from batchline.server import create_app

from .conftest import FakeEmbedder, client_on, fake_vector, loader, settings, wait_for

pytestmark = pytest.mark.anyio

LABELS = ("neg", "pos")


class FakeClassifier:
    """A classify model: ``pos`` when the text has an even number of words."""

    def __init__(self) -> None:
        self.info = ModelInfo(
            name="clf",
            task="classify",
            cost_kind="padded",
            details={"labels": list(LABELS)},
        )
        self.closed = False

    def prepare(self, inputs: Sequence[object]) -> list[object]:
        return [str(x).split() for x in inputs]

    def cost(self, item: list[str]) -> int:
        return len(item) + 2

    def run_batch(self, batch: list[list[str]]) -> list[dict[str, Any]]:
        out = []
        for words in batch:
            pos = 0.75 if len(words) % 2 == 0 else 0.25
            scores = {"neg": 1 - pos, "pos": pos}
            label = max(scores, key=lambda k: scores[k])
            out.append({"label": label, "score": scores[label], "scores": scores})
        return out

    def encode(self, result: dict[str, Any]) -> dict[str, Any]:
        return result

    def close(self) -> None:
        self.closed = True


class Doubler:
    """A predict model of named tensors: ``x`` FP32 ``[-1, 2]`` -> ``y = 2x``; gated."""

    def __init__(self, *, gated: bool = False) -> None:
        self.info = ModelInfo(
            name="pred",
            task="predict",
            input_kind="tensors",
            details={
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}],
            },
        )
        self.gate = threading.Event()
        if not gated:
            self.gate.set()
        self.batches: list[int] = []

    def prepare(self, inputs: Sequence[object]) -> list[object]:
        out: list[object] = []
        for row in inputs:
            if not isinstance(row, dict) or set(row) != {"x"}:
                out.append(ValueError("a row is {'x': array of 2}"))
                continue
            out.append(np.asarray(row["x"], dtype=np.float32))
        return out

    def cost(self, item: object) -> int:
        return 1

    def run_batch(self, batch: list[Any]) -> list[dict[str, Any]]:
        if not self.gate.wait(timeout=30):
            raise RuntimeError("test gate never opened")
        self.batches.append(len(batch))
        return [{"y": 2 * x} for x in batch]

    def encode(self, result: dict[str, Any]) -> dict[str, Any]:
        return {k: v.tolist() for k, v in result.items()}

    def close(self) -> None:
        pass


class Records:
    """A predict model of whole records (no tensor metadata)."""

    info = ModelInfo(name="rec", task="predict", input_kind="record")

    def prepare(self, inputs: Sequence[object]) -> list[object]:
        return list(inputs)

    def cost(self, item: object) -> int:
        return 1

    def run_batch(self, batch: list[object]) -> list[object]:
        return batch

    def encode(self, result: object) -> object:
        return result

    def close(self) -> None:
        pass


MODELS = ["emb=default", "clf=m:clf", "pred=m:pred", "rec=m:rec"]


@asynccontextmanager
async def several(
    fake: FakeEmbedder | None = None,
    doubler: Doubler | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[httpx.AsyncClient, Any]]:
    fake = fake or FakeEmbedder()
    load = loader(
        fake,
        ("clf", FakeClassifier()),
        ("pred", doubler or Doubler()),
        ("rec", Records()),
    )
    values: dict[str, Any] = {"model_name": None, "model": MODELS}
    values.update(overrides)
    app = create_app(settings(**values), load_model=load)

    def release() -> None:
        fake.gate.set()
        if doubler is not None:
            doubler.gate.set()

    async with client_on(app, release) as client:
        yield client, app


def _infer_body(rows: list[list[float]], **extra: Any) -> dict[str, Any]:
    return {
        "inputs": [{"name": "x", "datatype": "FP32", "shape": [len(rows), 2], "data": rows}],
        **extra,
    }


async def test_models_lists_every_model_with_its_task() -> None:
    async with several() as (client, app):
        r = await client.get("/v1/models")
        assert r.status_code == 200
        cards = r.json()["data"]
        assert [(c["id"], c["task"]) for c in cards] == [
            ("emb", "embed"),
            ("clf", "classify"),
            ("pred", "predict"),
            ("rec", "predict"),
        ]
        assert set(app.state.server.registry.batchers()) == {"emb", "clf", "pred", "rec"}
        r = await client.get("/ready")
        assert r.json()["models"] == ["emb", "clf", "pred", "rec"]


async def test_each_route_serves_its_task() -> None:
    fake = FakeEmbedder()
    async with several(fake) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": ["a b"], "model": "emb"})
        assert r.status_code == 200
        assert r.json()["model"] == "emb"
        assert np.allclose(r.json()["data"][0]["embedding"], fake_vector(fake, "a b"))
        # without 'model': the first model of the route's task
        r = await client.post("/v1/embeddings", json={"input": "a b"})
        assert r.status_code == 200
        assert r.json()["model"] == "emb"
        r = await client.post("/generate", json={"prompts": ["a"]})
        assert r.status_code == 400
        assert "no model served here does generate" in r.json()["error"]["message"]

        r = await client.post("/classify", json={"model": "clf", "input": ["one two", "three"]})
        assert r.status_code == 200
        assert r.json() == {
            "results": [{"label": "pos", "score": 0.75}, {"label": "neg", "score": 0.75}]
        }
        r = await client.post("/classify", json={"input": ["x y"], "return_all_scores": True})
        assert r.status_code == 200
        (result,) = r.json()["results"]
        assert result["scores"] == {"neg": 0.25, "pos": 0.75}

        r = await client.post("/v2/models/pred/infer", json=_infer_body([[1, 2], [3, 4]], id="q"))
        assert r.status_code == 200
        body = r.json()
        assert body["model_name"] == "pred"
        assert body["id"] == "q"
        (out,) = body["outputs"]
        assert (out["name"], out["datatype"], out["shape"]) == ("y", "FP32", [2, 2])
        assert np.allclose(np.asarray(out["data"]).reshape(2, 2), [[2, 4], [6, 8]])


async def test_a_model_of_another_task_is_400_naming_its_task() -> None:
    async with several() as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": "x", "model": "clf"})
        assert r.status_code == 400
        message = r.json()["error"]["message"]
        assert "'clf' does classify" in message
        assert "/classify" in message
        r = await client.post("/classify", json={"input": ["x"], "model": "emb"})
        assert r.status_code == 400
        assert "'emb' does embed" in r.json()["error"]["message"]
        r = await client.post("/v1/embeddings", json={"input": "x", "model": "pred"})
        assert r.status_code == 400
        assert "does predict" in r.json()["error"]["message"]
        # a record model has no tensors to speak the Open Inference Protocol with
        r = await client.post("/v2/models/rec/infer", json=_infer_body([[1, 2]]))
        assert r.status_code == 400
        assert "whole records" in r.json()["error"]


async def test_no_model_of_the_task_is_400() -> None:
    async with several(model=["pred=m:pred"]) as (client, _app):
        r = await client.post("/v1/embeddings", json={"input": "x"})
        assert r.status_code == 400
        assert "no model served here does embed" in r.json()["error"]["message"]
        assert "pred (predict)" in r.json()["error"]["message"]


async def test_an_unknown_model_is_404_listing_the_models() -> None:
    async with several() as (client, _app):
        for path, body in (
            ("/v1/embeddings", {"input": "x", "model": "nope"}),
            ("/classify", {"input": ["x"], "model": "nope"}),
        ):
            r = await client.post(path, json=body)
            assert r.status_code == 404
            message = r.json()["error"]["message"]
            assert "'nope' is not served here" in message
            assert "emb (embed), clf (classify), pred (predict), rec (predict)" in message
        r = await client.post("/v2/models/nope/infer", json=_infer_body([[1, 2]]))
        assert r.status_code == 404
        assert "emb (embed)" in r.json()["error"]
        assert (await client.get("/v2/models/nope")).status_code == 404
        assert (await client.get("/v2/models/nope/ready")).status_code == 404


async def test_oip_metadata_health_and_binary_outputs() -> None:
    async with several() as (client, _app):
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert (await client.get("/v2/health/ready")).json() == {"ready": True}
        assert (await client.get("/v2")).json()["name"] == "batchline"
        meta = (await client.get("/v2/models/pred")).json()
        assert meta["name"] == "pred"
        assert meta["inputs"] == [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}]
        assert meta["outputs"] == [{"name": "y", "datatype": "FP32", "shape": [-1, 2]}]
        emb = (await client.get("/v2/models/emb")).json()
        assert emb["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
        assert emb["outputs"] == [{"name": "embedding", "datatype": "FP32", "shape": [-1, 8]}]
        r = await client.get("/v2/models/pred/ready")
        assert r.json() == {"name": "pred", "ready": True}

        body = _infer_body([[1, 2]], parameters={"binary_data_output": True})
        r = await client.post("/v2/models/pred/infer", json=body)
        assert r.status_code == 200
        length = int(r.headers["Inference-Header-Content-Length"])
        header = json.loads(r.content[:length])
        assert header["outputs"][0]["parameters"] == {"binary_data_size": 8}
        assert np.frombuffer(r.content[length:], "<f4").tolist() == [2.0, 4.0]

        r = await client.post(
            "/v2/models/pred/infer",
            json={
                "inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 3], "data": [1, 2, 3]}]
            },
        )
        assert r.status_code == 400
        assert set(r.json()) == {"error"}


async def test_embed_and_classify_over_oip() -> None:
    fake = FakeEmbedder()
    async with several(fake) as (client, _app):
        texts = ["a b", "c"]
        body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [2], "data": texts}]}
        r = await client.post("/v2/models/emb/infer", json=body)
        assert r.status_code == 200
        (out,) = r.json()["outputs"]
        assert out["shape"] == [2, 8]
        got = np.asarray(out["data"], dtype=np.float32).reshape(2, 8)
        assert np.allclose(got, np.stack([fake_vector(fake, t) for t in texts]))
        r = await client.post("/v2/models/clf/infer", json=body)
        assert r.status_code == 200
        outputs = {o["name"]: o for o in r.json()["outputs"]}
        assert outputs["label"]["data"] == ["pos", "neg"]
        assert outputs["score"]["data"] == [0.75, 0.75]
        assert outputs["scores"]["shape"] == [2, 2]


async def test_oip_rows_from_concurrent_clients_share_batches() -> None:
    doubler = Doubler(gated=True)
    async with several(doubler=doubler) as (client, app):
        batcher = app.state.server.registry.batchers()["pred"]
        first = asyncio.ensure_future(
            client.post("/v2/models/pred/infer", json=_infer_body([[0, 1]]))
        )
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        others = [
            asyncio.ensure_future(
                client.post("/v2/models/pred/infer", json=_infer_body([[i, i], [i, -i]]))
            )
            for i in range(3)
        ]
        await wait_for(lambda: batcher.queue_depth == 6)
        doubler.gate.set()
        responses = await asyncio.gather(first, *others)
        assert [r.status_code for r in responses] == [200] * 4
        assert doubler.batches == [1, 6]  # the three requests' rows went out as one batch
        out = responses[2].json()["outputs"][0]
        assert np.asarray(out["data"]).reshape(2, 2).tolist() == [[2, 2], [2, -2]]


async def test_a_full_queue_is_429_all_or_nothing_and_per_model() -> None:
    doubler = Doubler(gated=True)
    async with several(
        doubler=doubler, max_queue_size=2, max_batch_size=1, max_inputs_per_request=2
    ) as (client, app):
        batcher = app.state.server.registry.batchers()["pred"]
        capacity = batcher.queue_capacity
        blocker = asyncio.ensure_future(
            client.post("/v2/models/pred/infer", json=_infer_body([[0, 0]]))
        )
        await wait_for(lambda: batcher.stats.in_flight_batches == 1)
        queued = []
        for i in range((capacity - 1) // 2):
            queued.append(
                asyncio.ensure_future(
                    client.post("/v2/models/pred/infer", json=_infer_body([[i, i], [i, i]]))
                )
            )
        if (capacity - 1) % 2:
            queued.append(
                asyncio.ensure_future(
                    client.post("/v2/models/pred/infer", json=_infer_body([[9, 9]]))
                )
            )
        await wait_for(lambda: batcher.queue_depth == capacity - 1)
        # two rows, one free place: refused whole, nothing queued, the protocol's error body
        r = await client.post("/v2/models/pred/infer", json=_infer_body([[5, 5], [6, 6]]))
        assert r.status_code == 429
        assert r.headers["Retry-After"] == "1"
        assert set(r.json()) == {"error"}
        assert batcher.queue_depth == capacity - 1
        # another model's queue is its own: its request is queued, not refused; it runs when
        # the device's one slot (held by pred's blocked batch) frees
        emb = asyncio.ensure_future(
            client.post("/v1/embeddings", json={"input": ["a", "b"], "model": "emb"})
        )
        emb_batcher = app.state.server.registry.batchers()["emb"]
        await wait_for(lambda: emb_batcher.queue_depth == 2)
        assert not emb.done()
        doubler.gate.set()
        assert (await emb).status_code == 200
        assert emb_batcher.stats.device_wait_s > 0
        assert (await blocker).status_code == 200
        assert [(await q).status_code for q in queued] == [200] * len(queued)
        assert batcher.stats.total_submitted == capacity
        metrics = (await client.get("/metrics")).text
        assert 'batchline_requests_rejected_total{model="pred",reason="queue_full"} 1.0' in metrics
        assert 'batchline_records_total{model="emb",outcome="completed"} 2.0' in metrics


async def test_models_are_closed_at_shutdown_and_weights_checked() -> None:
    clf = FakeClassifier()
    app = create_app(
        settings(model_name=None, model=["emb=default", "clf=m:clf"], model_weights={"clf": 2}),
        load_model=loader(FakeEmbedder(), ("clf", clf)),
    )
    async with app.router.lifespan_context(app):
        assert not clf.closed
    assert clf.closed
    from batchline._errors import InputError

    bad = create_app(
        settings(model_name=None, model=["emb=default"], model_weights={"zzz": 2}),
        load_model=loader(FakeEmbedder()),
    )
    with pytest.raises(InputError, match="model_weights names zzz"):
        async with bad.router.lifespan_context(bad):
            pass


async def test_several_models_share_one_device_with_their_weights(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from batchline import Device
    from batchline.server import batcher as batcher_module
    from batchline.server.app import CPU_RESERVE_S

    calls: list[tuple[object, object]] = []
    real_engine = batcher_module.ModelBatcher

    def engine(model: Any, knobs: Any, **kwargs: Any) -> Any:
        calls.append((kwargs["device"], kwargs["weight"]))
        return real_engine(model, knobs, **kwargs)

    monkeypatch.setattr(batcher_module, "ModelBatcher", engine)
    async with several(
        model=["emb=default", "clf=m:clf"], model_weights={"clf": 2.5}, sessions=2
    ) as (client, app):
        assert (await client.post("/v1/embeddings", json={"input": "x"})).status_code == 200
        (device, w_emb), (same, w_clf) = calls
        assert isinstance(device, Device)
        assert same is device
        assert device.slots == 2
        assert device.reserve_s == CPU_RESERVE_S > 0  # on a CPU: room for a light model
        assert (w_emb, w_clf) == (1.0, 2.5)
        assert all(b.device is device for b in app.state.server.registry.batchers().values())
        text = (await client.get("/metrics")).text
        assert 'batchline_device_wait_seconds_total{model="clf"} 0.0' in text
    calls.clear()
    async with several(model=["emb=default"]) as (_client, app):  # one model: its own slots
        assert calls == [(None, 1.0)]
        assert app.state.server.registry.batchers()["emb"].device is None


async def test_one_model_is_retrieved_as_the_list_gives_it() -> None:
    openai = pytest.importorskip("openai")
    async with several() as (client, _app):
        listed = (await client.get("/v1/models")).json()["data"]
        for card in listed:
            r = await client.get(f"/v1/models/{card['id']}")
            assert r.status_code == 200, r.text
            assert r.json() == card
        r = await client.get("/v1/models/nope")
        assert r.status_code == 404
        error = r.json()["error"]
        assert error["type"] == "model_not_found"
        assert "emb (embed), clf (classify)" in error["message"]
        api = openai.AsyncOpenAI(base_url="http://127.0.0.1/v1", api_key="x", http_client=client)
        model = await api.models.retrieve("emb")
        assert (model.id, model.owned_by) == ("emb", "batchline")
        with pytest.raises(openai.NotFoundError, match="not served here"):
            await api.models.retrieve("nope")


async def test_oip_probes_are_open_and_inference_needs_the_key() -> None:
    async with several(api_key="k3y") as (client, _app):
        assert (await client.get("/v2/health/live")).status_code == 200
        assert (await client.get("/v2/health/ready")).status_code == 200
        r = await client.post("/v2/models/pred/infer", json=_infer_body([[1, 2]]))
        assert r.status_code == 401
        r = await client.post(
            "/v2/models/pred/infer",
            json=_infer_body([[1, 2]]),
            headers={"Authorization": "Bearer k3y"},
        )
        assert r.status_code == 200
        assert (await client.get("/v2/models/pred")).status_code == 401
