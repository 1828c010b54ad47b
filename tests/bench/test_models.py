"""``batchline bench`` and ``batchline tune`` on any model behind the seam: a ``module:factory``
batch function and a small ONNX image classifier (``--task predict``), in-process, end to end
through ``batchline.__main__.main``, with tiny durations (no timing assertions)."""

from __future__ import annotations

import asyncio
import itertools
import json
import shlex
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from batchline.__main__ import main
from batchline._errors import InputError
from batchline.bench.inputs import (
    DYNAMIC_DIM,
    InputOptions,
    load_model_inputs,
    random_tensor_rows,
)
from batchline.bench.loadgen import LoadPoint, PointResult
from batchline.bench.model import LoadedModels, model_spec
from batchline.bench.targets import oip_body, oip_url
from batchline.bench.tune import GPU_TOKEN_BUDGETS, planned_trials, search_space, tune
from batchline.models.config import Knobs

_names = itertools.count()

BATCH_FUNCTION = """
import asyncio

def factory():
    def score(records):
        return [{"chars": len(str(r.get("text", "")))} for r in records]
    return score

def async_factory():
    async def score(records):
        await asyncio.sleep(0)
        return [len(str(r.get("text", ""))) for r in records]
    return score
"""


@pytest.fixture
def factory_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A module with batch functions, importable under a name of its own per test."""
    name = f"bench_batch_fn_{next(_names)}_{tmp_path.name.replace('-', '_')}"
    folder = tmp_path / "code"
    folder.mkdir()
    (folder / f"{name}.py").write_text(BATCH_FUNCTION)
    monkeypatch.syspath_prepend(str(folder))
    return name


@pytest.fixture
def records(tmp_path: Path) -> Path:
    path = tmp_path / "records.jsonl"
    rows = [{"id": i, "text": "word " * (i % 7 + 1)} for i in range(30)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def image_model(tmp_path: Path) -> Path:
    pytest.importorskip("onnxruntime")
    from tests.models.onnx_builders import image_classifier

    return image_classifier(tmp_path / "models")


ALL_CONFIGS = ("baseline", "batchline defaults", "classic timeout", "mine")


def _bench(argv: Sequence[str], out: Path, config: Path) -> dict[str, object]:
    code = main(
        [
            "bench",
            *argv,
            "--load", "closed:3",
            "--duration", "0.2",
            "--warmup", "0.05",
            "--config", str(config),
            "-o", str(out),
            "--quiet",
        ]
    )  # fmt: skip
    assert code == 0
    md = (out / "report.md").read_text()
    for name in ALL_CONFIGS:
        assert f"| {name} | closed | 3 clients |" in md
    assert (out / "throughput-closed.png").is_file()
    assert (out / "p99-closed.png").is_file()
    data: dict[str, object] = json.loads((out / "results.json").read_text())
    points = data["points"]
    assert isinstance(points, list)
    assert [p["config"] for p in points] == list(ALL_CONFIGS)
    assert all(p["completed"] > 0 and p["errors"] == 0 for p in points)
    return data


@pytest.mark.parametrize("factory", ["factory", "async_factory"])
def test_bench_a_batch_function(
    factory_module: str, factory: str, records: Path, tmp_path: Path
) -> None:
    config = tmp_path / "mine.json"
    Knobs(target_batch_tokens=8, max_batch_size=8).dump(config)
    data = _bench(
        ["--model", f"{factory_module}:{factory}", "--inputs", str(records)],
        tmp_path / "report",
        config,
    )
    assert data["model"] == f"{factory_module}:{factory} (predict)"
    assert data["inputs"] == f"30 records from {records}"


def test_bench_an_onnx_image_classifier(image_model: Path, tmp_path: Path) -> None:
    config = tmp_path / "mine.json"
    Knobs(sessions=1, intra_op_threads=1, max_concurrent_batches=1).dump(config)
    data = _bench(["--model", str(image_model), "--task", "predict"], tmp_path / "random", config)
    assert "random rows (seed 0); per row: input [3, 8, 8] float32" in str(data["inputs"])
    # rows from a .npy file
    rows = tmp_path / "images.npy"
    np.save(rows, np.random.default_rng(1).normal(size=(12, 3, 8, 8)).astype(np.float32))
    data = _bench(
        ["--model", str(image_model), "--task", "predict", "--inputs", str(rows)],
        tmp_path / "npy",
        config,
    )
    assert data["inputs"] == f"12 rows from {rows}; per row: input [3, 8, 8] float32"


def test_tune_a_batch_function_writes_what_run_reads(
    factory_module: str,
    records: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    out = tmp_path / "tuned.json"
    spec = f"{factory_module}:factory"
    code = main(
        [
            "tune",
            "--model", spec,
            "--inputs", str(records),
            "--p99-ms", "60000",
            "--load", "closed:2",
            "--budget-s", "2",
            "--duration", "0.1",
            "-o", str(out),
        ]
    )  # fmt: skip
    printed = capsys.readouterr()
    assert code == 0, printed.err
    knobs = Knobs.load(out)
    measured = json.loads(out.read_text())["measured"]
    assert measured["model"] == spec
    assert knobs.batching == (measured["verdict"] == "batching")
    # the commands tune prints name the model, and run reads the file it wrote
    commands = [
        shlex.split(line.strip())
        for line in printed.out.splitlines()
        if line.startswith("  batchline ")
    ]
    run_argv = next(argv for argv in commands if argv[1] == "run")
    assert run_argv[2:] == ["--config", str(out), "--model", spec]
    results = tmp_path / "results"
    assert main([*run_argv[1:], str(records), "-o", str(results), "--quiet"]) == 0
    manifest = json.loads((results / "_manifest.json").read_text())
    assert manifest["total_records"] == 30


# -- the loader, inputs and routes ---------------------------------------------------------


def test_the_loader_keeps_one_model_per_layout(image_model: Path) -> None:
    loader = LoadedModels(model_spec(str(image_model), task="predict"))
    two = loader.load(Knobs(sessions=2, max_concurrent_batches=2))
    assert loader.load(Knobs(sessions=2, target_batch_tokens=64)) is two
    assert loader.load(Knobs(sessions=1)) is not two
    assert loader.load(Knobs(batching=False, sessions=1)) is not two
    assert loader.tokenizer() is None
    loader.release(keep=[Knobs(sessions=2)])
    assert loader.load(Knobs(sessions=2)) is two
    loader.close()
    assert loader.load(Knobs(sessions=2)) is not two


def test_the_loader_resolves_auto_once_as_run_does(monkeypatch: pytest.MonkeyPatch) -> None:
    # bench and tune load what run would: auto resolved by jobs.precision (stubbed here: the
    # choice logic has its own tests), once, and every later layout loads that precision
    import batchline.jobs.precision as precision
    import batchline.models.loader as loader_module
    from batchline.jobs.precision import Choice

    resolved: list[Knobs] = []
    loaded: list[Knobs] = []

    def resolve(spec: object, knobs: Knobs) -> tuple[Knobs, Choice]:
        resolved.append(knobs)
        return knobs.replace(precision="bf16"), Choice("bf16", "auto on amx: stub", "torch")

    def load(spec: object, knobs: Knobs) -> object:
        loaded.append(knobs)
        return object()

    monkeypatch.setattr(precision, "resolve_knobs", resolve)
    monkeypatch.setattr(loader_module, "load_model", load)
    loader = LoadedModels(model_spec("default"))
    first = loader.load(Knobs(sessions=2))
    assert loader.load(Knobs(sessions=2, target_batch_tokens=64)) is first
    loader.load(Knobs(sessions=1))
    assert [k.sessions for k in resolved] == [2]
    assert [k.precision for k in loaded] == ["bf16", "bf16"]
    assert loader.choice is not None
    assert loader.choice.precision == "bf16"
    # asked for: loaded as asked, a layout of its own, nothing resolved
    loader.load(Knobs(sessions=2, precision="fp32"))
    assert [k.precision for k in loaded] == ["bf16", "bf16", "fp32"]
    assert len(resolved) == 1


def test_a_batch_function_is_loaded_once(factory_module: str) -> None:
    loader = LoadedModels(f"{factory_module}:factory")
    model = loader.load(Knobs())
    assert loader.load(Knobs(batching=False, sessions=1)) is model
    assert model.info.input_kind == "record"


def test_model_spec_refuses_a_generator() -> None:
    with pytest.raises(InputError, match="bench --task generate"):
        model_spec("smollm2")


def test_random_tensor_rows_follow_the_model_inputs() -> None:
    specs = [
        {"name": "values", "datatype": "FP32", "shape": [-1, -1]},
        {"name": "weight", "datatype": "INT64", "shape": [-1]},
        {"name": "mask", "datatype": "BOOL", "shape": [-1, 2]},
    ]
    inputs = random_tensor_rows(specs, count=5, seed=3)
    assert len(inputs.items) == 5
    row = inputs.items[0]
    assert row["values"].shape == (DYNAMIC_DIM,)
    assert row["values"].dtype == np.float32
    assert row["weight"].shape == ()
    assert row["weight"].dtype == np.int64
    assert row["mask"].shape == (2,)
    assert row["mask"].dtype == np.bool_
    again = random_tensor_rows(specs, count=5, seed=3).items[0]
    assert np.array_equal(again["values"], row["values"])
    # big rows: the sample stays small in memory
    big = [{"name": "image", "datatype": "FP32", "shape": [-1, 3, 512, 512]}]
    assert len(random_tensor_rows(big, count=2_000).items) == 21
    with pytest.raises(InputError, match="--inputs"):
        random_tensor_rows([{"name": "s", "datatype": "BYTES", "shape": [-1]}])


def test_lengths_go_with_texts_only() -> None:
    with pytest.raises(InputError, match="--lengths"):
        load_model_inputs("record", InputOptions(lengths="short"))
    with pytest.raises(InputError, match="tokenizer"):
        load_model_inputs("text", InputOptions(lengths="short"), tokenizer=None)


def test_records_default_to_the_demo_corpus() -> None:
    inputs = load_model_inputs("record", InputOptions(count=10, seed=1))
    assert len(inputs.items) == 10
    assert all(isinstance(r, dict) and "text" in r for r in inputs.items)
    assert inputs.description == "10 records from the demo corpus"


def test_oip_requests() -> None:
    assert oip_url("http://h:8000", "resnet") == "http://h:8000/v2/models/resnet/infer"
    assert oip_url("http://h:8000/", "a b") == "http://h:8000/v2/models/a%20b/infer"
    assert oip_url("http://h/v2/models/m/infer", "x") == "http://h/v2/models/m/infer"
    assert oip_url("http://h:8000", "m", action="") == "http://h:8000/v2/models/m"
    assert oip_body("hi") == {
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]
    }
    body = oip_body({"input": np.arange(4, dtype=np.float32).reshape(2, 2)})
    assert body == {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [1, 2, 2], "data": [0, 1, 2, 3]}]
    }


# -- the GPU branch of the search (pure: runs without a GPU) ---------------------------------


def test_gpu_search_tries_fewer_sessions_and_larger_budgets() -> None:
    splits, first = search_space(16, "cuda:1")
    assert splits == [(2, 1), (1, 1)]
    assert first.device == "cuda:1"
    assert first.target_batch_tokens == 2048
    assert planned_trials(16, "cuda") == 1 + 2 + 3 + 1 + 2
    cpu_splits, cpu_first = search_space(4)
    assert cpu_splits[0] == (4, 1)
    assert cpu_first.sessions == 4


@pytest.mark.anyio
async def test_tune_on_a_gpu_measures_gpu_settings() -> None:
    seen: list[Knobs] = []

    async def measure(
        label: str, knobs: Knobs, points: Sequence[LoadPoint], duration_s: float
    ) -> list[PointResult]:
        seen.append(knobs)
        rps = 100.0 * (knobs.target_batch_tokens / 1024 if knobs.batching else 1)
        return [
            PointResult(
                config=label,
                kind=p.kind,
                offered=p.value,
                duration_s=duration_s,
                sent=10,
                completed=10,
                errors=0,
                achieved_rps=rps,
                p50_ms=5.0,
                p95_ms=8.0,
                p99_ms=10.0,
            )
            for p in points
        ]

    clock = iter(float(i) for i in range(10_000))
    result = await tune(
        measure,
        points=[LoadPoint("closed", 8)],
        p99_budget_ms=100,
        budget_s=10_000,
        cores=16,
        device="cuda",
        duration_s=1,
        now=lambda: next(clock),
    )
    assert all(k.device == "cuda" for k in seen)
    assert {k.target_batch_tokens for k in seen if k.batching} >= set(GPU_TOKEN_BUDGETS)
    assert max(k.sessions for k in seen) == 2
    assert result.decision.recommended is not None
    assert result.decision.recommended.knobs.target_batch_tokens == 8192


# -- HTTP: the Open Inference Protocol route against a small fake server ---------------------


class FakeOipServer:
    """``GET /v2/models/m`` (metadata of a one-input FP32 model) and ``POST .../infer``."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, object]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while line := await reader.readline():
                method, target, _ = line.decode().split(" ", 2)
                length = 0
                while (header := await reader.readline()) not in (b"\r\n", b""):
                    name, _, value = header.partition(b":")
                    if name.lower() == b"content-length":
                        length = int(value)
                body = await reader.readexactly(length)
                if method == "GET" and target == "/v2/models/m":
                    answer = {
                        "name": "m",
                        "inputs": [{"name": "x", "datatype": "FP32", "shape": [-1, 2]}],
                        "outputs": [{"name": "y", "datatype": "FP32", "shape": [-1]}],
                    }
                else:
                    assert (method, target) == ("POST", "/v2/models/m/infer")
                    self.bodies.append(json.loads(body))
                    answer = {"outputs": [{"name": "y", "datatype": "FP32", "shape": [1]}]}
                data = json.dumps(answer).encode()
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(data) + data)
                await writer.drain()
        finally:
            writer.close()


@pytest.mark.anyio
async def test_bench_over_the_open_inference_protocol(tmp_path: Path) -> None:
    from batchline.bench.report import write_report
    from batchline.bench.runner import BenchOptions, run_bench_async

    fake = FakeOipServer()
    server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        options = BenchOptions(
            target=url,
            route="oip",
            model="m",
            loads=[LoadPoint("closed", 2)],
            duration_s=0.2,
            warmup_s=0.05,
        )
        result = await run_bench_async(options)
    finally:
        server.close()
    (config,) = result.configurations
    assert config.url == f"{url}/v2/models/m/infer"
    assert result.points[0].completed > 0
    assert result.points[0].errors == 0
    assert "random rows" in result.inputs
    sent = fake.bodies[0]["inputs"]
    assert isinstance(sent, list)
    (tensor,) = sent
    assert tensor["name"] == "x"
    assert tensor["shape"] == [1, 2]
    files = write_report(result, tmp_path / "report")
    assert "/v2/models/m/infer" in files["report"].read_text()


def test_bench_an_onnx_text_classifier(tmp_path: Path) -> None:
    pytest.importorskip("onnxruntime")
    from tests.models.onnx_builders import WORDS, text_classifier

    files = text_classifier(tmp_path / "clf")
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(" ".join(WORDS[i : i + 3 + i % 5]) for i in range(20)) + "\n")
    out = tmp_path / "report"
    argv = ["bench", "--model", str(files.model), "--task", "classify", "--inputs", str(texts)]
    argv += ["--lengths", "short", "--compare", "baseline,defaults", "--load", "closed:2"]
    argv += ["--duration", "0.2", "--warmup", "0", "-o", str(out), "--quiet"]
    assert main(argv) == 0
    data = json.loads((out / "results.json").read_text())
    assert data["model"] == f"{files.model} (classify)"
    assert "short lengths 8-24; tokens per text" in data["inputs"]
    assert [p["config"] for p in data["points"]] == ["baseline", "batchline defaults"]
    assert all(p["completed"] > 0 and p["errors"] == 0 for p in data["points"])
