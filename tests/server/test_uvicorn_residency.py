"""On-demand models in one real ``batchline serve`` (uvicorn, 127.0.0.1): the default
embedder and a 192 MiB ONNX MLP, whose footprints together exceed ``--memory-budget``. The
server starts with neither loaded; each loads on its first request, evicting the other
(idle) one; every request is answered; SIGTERM exits 0. The budget is set from what a first
server measures on this machine (its reserve, each model's need), not from figures of another
machine: CI once had a reserve too large for a fixed 450 MiB."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from .test_uvicorn import Server, run_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

FEATURES, HIDDEN, OUT = 2048, 24_576, 4  # the first weight: 2048 x 24576 float32 = 192 MiB


def big_mlp(folder: Path) -> Path:
    """``input`` ``[batch, 2048]`` → ``scores`` ``[batch, 4]`` through a 192 MiB layer."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w1 = (rng.standard_normal((FEATURES, HIDDEN), dtype=np.float32) * 0.01).astype(np.float32)
    w2 = rng.standard_normal((HIDDEN, OUT), dtype=np.float32)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["input", "w1"], ["hidden"]),
            helper.make_node("Relu", ["hidden"], ["act"]),
            helper.make_node("MatMul", ["act", "w2"], ["scores"]),
        ],
        "big_mlp",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", FEATURES])],
        [helper.make_tensor_value_info("scores", TensorProto.FLOAT, ["batch", OUT])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = folder / "big_mlp.onnx"
    onnx.save(model, str(path))
    return path


def cards(server: Server) -> dict[str, dict[str, Any]]:
    status, _, body = server.get("/v1/models")
    assert status == 200
    return {c["id"]: c for c in json.loads(body)["data"]}


def embed(server: Server) -> int:
    status, _, body = server.post("/v1/embeddings", {"model": "emb", "input": ["hello", "there"]})
    assert status in (200, 503), body
    if status != 200:
        print(body.decode())  # the cause, in the failure's captured output
    return status


def infer(server: Server) -> int:
    body = {
        "inputs": [
            {"name": "input", "datatype": "FP32", "shape": [1, FEATURES], "data": [0.5] * FEATURES}
        ]
    }
    status, _, answer = server.post("/v2/models/mlp/infer", body)
    if status != 200:
        print(answer.decode())
    return status


def serve_both(mlp: Path, budget: int) -> Any:
    return run_server(
        "--model",
        "emb=default",
        "--model",
        f"mlp={mlp}",
        "--task",
        "mlp=predict",
        "--sessions",
        "1",
        "--memory-budget",
        str(budget),
    )


def measure_needs(mlp: Path) -> tuple[int, dict[str, int]]:
    """Under a budget that holds both: the server's reserve and what each model needs to load
    (the most of its estimate, its measured footprint and its load's peak). These vary from
    machine to machine (ONNX Runtime's arenas, the allocator), so the test measures them."""
    with serve_both(mlp, 4 << 30) as server:
        before = cards(server)
        assert embed(server) == 200
        assert infer(server) == 200
        after = cards(server)
        assert {n: c["state"] for n, c in after.items()} == {"emb": "resident", "mlp": "resident"}
        reserved = int(server.metric("batchline_memory_reserved_bytes"))
        assert server.metric("batchline_memory_budget_bytes") == 4 << 30
    needs = {
        n: max(before[n]["footprint_bytes"], c["footprint_bytes"], c["load_peak_bytes"])
        for n, c in after.items()
    }
    return reserved, needs


def test_two_models_over_budget_take_turns(tmp_path: Path) -> None:
    mlp = big_mlp(tmp_path)
    reserved, needs = measure_needs(mlp)
    assert 0 < reserved < 1 << 30
    # room for either with a third of the smaller to spare, never for both
    room = max(needs.values()) + min(needs.values()) // 3
    assert sum(needs.values()) > room
    with serve_both(mlp, reserved + room) as server:
        listed = cards(server)
        assert {n: c["state"] for n, c in listed.items()} == {"emb": "unloaded", "mlp": "unloaded"}
        assert listed["mlp"]["footprint_bytes"] >= FEATURES * HIDDEN * 4  # the weights' size
        assert embed(server) == 200
        emb = cards(server)["emb"]
        assert (emb["state"], emb["footprint_measured"]) == ("resident", True)
        assert emb["load_peak_bytes"] > 0
        assert infer(server) == 200  # no room beside emb: emb (idle) is evicted first
        listed = cards(server)
        states = {n: c["state"] for n, c in listed.items()}
        assert states == {"emb": "unloaded", "mlp": "resident"}, json.dumps(listed)
        assert embed(server) == 200
        assert cards(server)["emb"]["state"] == "resident"
        assert server.metric('batchline_model_evictions_total{model="emb",reason="room"}') == 1
        assert server.metric('batchline_model_loads_total{model="emb",outcome="ok"}') == 2
        assert server.metric('batchline_model_loads_total{model="mlp",outcome="ok"}') == 1
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        log = server.log.read_text()
    assert "model mlp loaded in" in log
