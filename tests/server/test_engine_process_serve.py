"""``serve`` with ``engine_process``: the app's generate model is the tiny random Llama, loaded by
``load_text_generator`` in an engine process of its own; the routes answer through it as they
do through the in-process generator (a completion, a streamed chat, the metrics). An engine
process that dies fails its own model's requests, and the others are served."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("transformers")

from batchline.models.config import Knobs
from batchline.models.generation.engine_process import ProcessGenerator
from batchline.models.generation.fake import FakeEngine
from batchline.models.specs import ModelSpec
from batchline.server import ServerSettings, create_app

from ..models.generation.gen_helpers import load_fake_with
from ..models.generation.test_load import save_tiny_generator
from .conftest import FakeGenerateModel, client_on, settings, wait_for
from .test_generation_routes import sse

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_generator(tmp_path_factory.mktemp("tiny") / "tiny-llama")


async def test_the_routes_answer_through_the_engine_process(tiny_folder: Path) -> None:
    settings = ServerSettings(
        model=[f"gen={tiny_folder}/"],
        engine_process=True,
        dtype="float32",
        max_running_sequences=4,
        request_timeout_s=60.0,
        drain_timeout_s=10.0,
    )
    app = create_app(settings)
    async with client_on(app) as client:
        served = app.state.server.registry.get("gen")
        assert served.info.details["engine_process"] is True
        body = {"model": "gen", "prompt": "hello", "max_tokens": 5, "temperature": 0}
        r = await client.post("/v1/completions", json={**body, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 5
        chat = {
            "model": "gen",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
        }
        whole = await client.post("/v1/chat/completions", json=chat)
        assert whole.status_code == 200, whole.text
        streamed = await client.post("/v1/chat/completions", json={**chat, "stream": True})
        assert streamed.status_code == 200, streamed.text
        events = sse(streamed.text)
        assert events[-1] == "[DONE]"
        text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events[:-1])
        assert text == whole.json()["choices"][0]["message"]["content"]
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        metrics = (await client.get("/metrics")).text
        assert 'model="gen"' in metrics
    generator = served.generator
    assert generator.stats.requests_completed == 3
    assert generator._process.exitcode == 0  # the app's shutdown drained and stopped it


async def test_a_dead_engine_process_fails_its_model_only_and_the_probes_say_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    generators: dict[str, ProcessGenerator] = {}

    def load(spec: ModelSpec, knobs: Knobs) -> FakeGenerateModel:
        generator = ProcessGenerator.launch(load_fake_with, {}, name=spec.name)
        generator.wait_ready()
        generators[spec.name] = generator
        return FakeGenerateModel(spec.name, generator, FakeEngine(), knobs)

    two = settings(model=["a=smollm2", "b=smollm2"], model_name=None)
    app = create_app(two, load_generator=load)
    try:
        async with client_on(app) as client:
            body = {"prompt": "hi", "max_tokens": 3}
            for name in "ab":
                r = await client.post("/v1/completions", json={**body, "model": name})
                assert r.status_code == 200, r.text
            dead = generators["a"]
            assert dead.pid is not None
            os.kill(dead.pid, signal.SIGKILL)
            await wait_for(lambda: dead._gone is not None and "SIGKILL" in dead._gone)
            caplog.clear()
            # the client is told what exited and how (no Retry-After: this one will not
            # come back), and the log is not written again for each request
            r = await client.post("/v1/completions", json={**body, "model": "a"})
            assert r.status_code == 503, r.text
            assert "Retry-After" not in r.headers
            message = r.json()["error"]["message"]
            assert "SIGKILL" in message
            assert "restart the server" in message
            r = await client.post("/v1/completions", json={**body, "model": "b"})
            assert r.status_code == 200, r.text
            # readiness and liveness say so, so that a balancer or an orchestrator acts
            for route in ("/ready", "/health"):
                r = await client.get(route)
                assert r.status_code == 503, (route, r.text)
                assert r.json()["status"] == "failed"
                assert list(r.json()["failed"]) == ["a"]
                assert "SIGKILL" in r.json()["failed"]["a"]
            assert not [r for r in caplog.records if r.exc_info]  # no traceback a request
            assert (await client.get("/v2/health/ready")).json() == {"ready": False}
            assert (await client.get("/v2/health/live")).status_code == 503
    finally:
        for generator in generators.values():
            generator.close()
