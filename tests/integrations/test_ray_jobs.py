"""Every job kind on ``batchline run --engine ray``: text generation, an OpenAI batch file and
a score job give the local engine's output; a killed replica, a killed driver and a record
that kills replicas leave every record answered once (or reported failed).

One local Ray instance (4 logical CPUs) serves the module; its workers import the test's own
``module:factory`` models from a folder on their ``PYTHONPATH``. The generator is the tiny
random Llama of ``tests/jobs/test_generate.py`` (greedy, float32: the same text on any engine).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("ray")
pytest.importorskip("transformers")
pytest.importorskip("onnxruntime")

import ray

from batchline.datasets.sinks import Manifest, read_output, read_skipped
from batchline.integrations.ray import RayGenerateSummary, UnitDone, run_on_ray
from batchline.jobs.generate import GenerateOptions
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs
from tests.integrations.test_ray import two_nodes  # noqa: F401  (the two-node fixture)
from tests.jobs.test_generate import _KILL_AFTER_CHUNK
from tests.jobs.test_run_score import SCORER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PROMPTS = [f"{i} + {i * 7 % 13} = ?" + " and then" * (i % 5) for i in range(24)]
MAX_TOKENS = 6
CHUNK = 5

POISON = textwrap.dedent(
    """
    import os

    def factory():
        def length(records):
            if any(r["text"] == "poison" for r in records):
                os._exit(1)  # the replica's process dies, as on a segfault or the OOM killer
            return [{"length": len(r["text"])} for r in records]
        return length
    """
)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder of importable models: ``poison:factory``, ``reranker:factory``."""
    folder = tmp_path_factory.mktemp("models")
    (folder / "poison.py").write_text(POISON)
    (folder / "reranker.py").write_text(SCORER)
    return folder


@pytest.fixture(scope="module")
def cluster(models: Path) -> Iterator[str]:
    """A local Ray instance whose workers can import ``models``; its address."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        path = os.environ.get("PYTHONPATH")
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(models), path) if p))
        mp.syspath_prepend(str(models))
        context = ray.init(
            address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING"
        )
        try:
            yield context.address_info["gcs_address"]
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import torch

    from tests.models.generation.test_load import save_tiny_generator

    torch.set_num_threads(1)
    return save_tiny_generator(tmp_path_factory.mktemp("gen") / "tiny")


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rows = [{"id": f"p{i}", "prompt": p, "tag": f"t{i}"} for i, p in enumerate(PROMPTS)]
    return write_jsonl(tmp_path_factory.mktemp("prompts") / "prompts.jsonl", rows)


def generate_options(tiny: Path, src: Path, out: Path, **changes: Any) -> GenerateOptions:
    values: dict[str, Any] = {
        "input": src,
        "output": out,
        "model": f"{tiny}/",
        "max_tokens": MAX_TOKENS,
        "chunk_size": CHUNK,
        "copy_columns": ("tag",),
        "knobs": Knobs(dtype="float32", max_running_sequences=4),
        **changes,
    }
    return GenerateOptions(**values)


@pytest.fixture(scope="module")
def local_output(tiny: Path, prompts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local engine's output: what every Ray run must give."""
    out = tmp_path_factory.mktemp("local") / "out"
    run(generate_options(tiny, prompts, out))
    return out


def rows(out: Path) -> list[dict[str, Any]]:
    return read_output(out).to_pylist()  # type: ignore[no-any-return]


def assert_same_rows(out: Path, want: Path) -> None:
    got = rows(out)
    assert [r["index"] for r in got] == list(range(len(PROMPTS)))  # each once, in order
    assert got == rows(want)
    assert Manifest.load(out).settings == Manifest.load(want).settings  # either resumes the other


@pytest.mark.usefixtures("cluster")
def test_generation_on_two_replicas_gives_the_local_engine_s_texts(
    tiny: Path, prompts: Path, local_output: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    summary = run_on_ray(generate_options(tiny, prompts, out), replicas=2, unit_records=2)
    assert_same_rows(out, local_output)
    assert isinstance(summary, RayGenerateSummary)
    assert summary.records == len(PROMPTS)
    completion_tokens = sum(r["completion_tokens"] for r in rows(out))
    assert summary.generated_tokens == completion_tokens > 0
    assert len(summary.tokens_by_replica) == 2
    assert all(t > 0 for t in summary.tokens_by_replica)  # both replicas generated
    assert summary.in_flight_limit > 0
    labels = dict(summary.rows())
    assert "tokens/s by replica" in labels


@pytest.mark.usefixtures("cluster")
def test_a_replica_killed_mid_generation_has_every_prompt_answered_once(
    tiny: Path, prompts: Path, local_output: Path, tmp_path: Path
) -> None:
    killed: list[int] = []

    def kill_once(done: UnitDone) -> None:
        if not killed:
            killed.append(done.pid)
            os.kill(done.pid, signal.SIGKILL)

    out = tmp_path / "out"
    summary = run_on_ray(
        generate_options(tiny, prompts, out), replicas=2, unit_records=1, on_unit=kill_once
    )
    assert_same_rows(out, local_output)
    assert killed
    assert summary.replica_restarts >= 1 or summary.resubmitted_units >= 1


def test_a_driver_killed_with_sigkill_resumes_locally_to_the_same_output(
    cluster: str, tiny: Path, prompts: Path, local_output: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    args = ["run", str(prompts), "--model", f"{tiny}/", "-o", str(out), "--chunk-size",
            str(CHUNK), "--max-tokens", str(MAX_TOKENS), "--max-running-sequences", "4",
            "--copy-column", "tag", "--dtype", "float32", "--quiet"]  # fmt: skip
    ray_args = ["--engine", "ray", "--address", cluster, "--replicas", "2"]
    killed = subprocess.run(
        [sys.executable, "-c", _KILL_AFTER_CHUNK, *args, *ray_args],
        env=os.environ.copy(),
        capture_output=True,
        timeout=240,
    )
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    partial = Manifest.load(out)
    assert len(partial.chunks) == 2
    assert not partial.complete

    from batchline.__main__ import main

    assert main([*args, "--resume"]) == 0  # the local engine takes the Ray run's output over
    assert_same_rows(out, local_output)


@pytest.mark.usefixtures("cluster")
def test_a_record_that_kills_its_replica_each_time_is_reported_failed(tmp_path: Path) -> None:
    data = [{"id": f"r{i}", "text": "poison" if i == 13 else f"text {i}"} for i in range(40)]
    src = write_jsonl(tmp_path / "data.jsonl", data)
    out = tmp_path / "out"
    options = RunOptions(
        input=src, output=out, model="poison:factory", chunk_size=10, on_bad_record="skip"
    )
    summary = run_on_ray(options, replicas=2, unit_records=8, max_restarts=20)
    written = rows(out)
    assert [r["index"] for r in written] == [i for i in range(40) if i != 13]
    assert all(json.loads(r["result"]) == {"length": len(f"text {r['index']}")} for r in written)
    (skipped,) = read_skipped(out)
    assert skipped["index"] == 13
    assert "the replica running it died each of the 3 times it was tried" in skipped["reason"]
    assert summary.skipped == 1
    assert summary.resubmitted_units >= 3


@pytest.mark.usefixtures("cluster")
def test_a_score_job_on_ray_reads_the_named_pair_columns(tmp_path: Path) -> None:
    pairs = [
        {"q": "red apple", "passage": "an apple that is red"},
        {"q": "red apple", "passage": None},
        {"q": "green", "passage": "green tea"},
    ]
    src = write_jsonl(tmp_path / "pairs.jsonl", pairs)
    options = RunOptions(
        input=src,
        output=tmp_path / "out",
        model="reranker:factory",
        input_columns=("q", "passage"),
        on_bad_record="skip",
    )
    run_on_ray(options, replicas=1)
    table = rows(tmp_path / "out")
    assert [(r["index"], r["score"]) for r in table] == [(0, 1.0), (2, 1.0)]
    (skipped,) = read_skipped(tmp_path / "out")
    assert "a pair needs a query and a document text" in skipped["reason"]


def _split(path: Path) -> tuple[list[dict[str, Any]], list[list[float]]]:
    """An output file's lines without ``created`` and their embeddings, and the embeddings
    (compared within float tolerance: batches may differ in padding)."""
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    vectors: list[list[float]] = []
    for line in lines:
        body = (line.get("response") or {}).get("body") or {}
        body.pop("created", None)
        for item in body.get("data", []) if body.get("object") == "list" else []:
            vectors.append(item.pop("embedding"))
    return lines, vectors


@pytest.mark.usefixtures("cluster")
def test_a_mixed_openai_batch_file_on_ray_equals_the_local_file(tiny: Path, tmp_path: Path) -> None:
    def chat(i: int) -> dict[str, Any]:
        body = {"model": "gpt-test", "max_tokens": 5, "temperature": 0,
                "messages": [{"role": "user", "content": f"question {i}"}]}  # fmt: skip
        return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}

    def embed(i: int) -> dict[str, Any]:
        body = {"model": "emb", "input": [f"text {i}", f"more text {i}"]}
        return {"custom_id": f"e{i}", "method": "POST", "url": "/v1/embeddings", "body": body}

    lines = [chat(i) if i % 3 else embed(i) for i in range(18)]
    lines[7] = {**lines[7], "url": "/v1/unknown"}  # a bad line: an error line, as locally
    src = write_jsonl(tmp_path / "requests.jsonl", lines)
    models = ("emb=default", f"gpt-test={tiny}/")

    def options(out: Path) -> GenerateOptions:
        return GenerateOptions(
            input=src, output=out, model=models[0], models=models, knobs=Knobs(dtype="float32")
        )

    local, on_ray = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    run(options(local))
    summary = run_on_ray(options(on_ray), replicas=2)
    got, vectors = _split(on_ray)
    want, want_vectors = _split(local)
    assert [g["custom_id"] for g in got] == [line["custom_id"] for line in lines]
    assert got == want
    assert len(vectors) == len(want_vectors) == 2 * 6
    np.testing.assert_allclose(vectors, want_vectors, atol=1e-5)
    assert got[7]["error"] is not None
    assert summary.output == on_ray
    assert summary.records == 17


@pytest.mark.usefixtures("cluster")
def test_duplicate_batch_lines_are_found_once_per_job_in_the_driver(
    tiny: Path, tmp_path: Path
) -> None:
    """Lines of one body (but their custom_id) are answered once; a chat line sampled without
    a seed is never answered from another's (its completion is a draw of its own)."""

    def line(i: int, url: str, body: dict[str, Any]) -> dict[str, Any]:
        return {"custom_id": f"l{i}", "method": "POST", "url": url, "body": body}

    def greedy(k: int) -> dict[str, Any]:
        return {"model": "gpt-test", "max_tokens": 4, "temperature": 0,
                "messages": [{"role": "user", "content": f"question {k}"}]}  # fmt: skip

    sampled = {"model": "gpt-test", "max_tokens": 4, "temperature": 1.0,
               "messages": [{"role": "user", "content": "a draw"}]}  # fmt: skip
    seeded = {**sampled, "seed": 7}
    lines = []
    for i in range(24):  # 24 lines, 3 embedding bodies, 2 greedy, 1 seeded, 4 unseeded draws
        if i % 4 == 0:
            lines.append(line(i, "/v1/embeddings", {"model": "emb", "input": f"text {i % 3}"}))
        elif i % 4 == 1:
            lines.append(line(i, "/v1/chat/completions", greedy(i // 4 % 2)))
        elif i % 4 == 2:
            lines.append(line(i, "/v1/chat/completions", seeded))
        else:
            lines.append(line(i, "/v1/chat/completions", sampled if i < 16 else seeded))
    src = write_jsonl(tmp_path / "requests.jsonl", lines)
    models = ("emb=default", f"gpt-test={tiny}/")
    options = GenerateOptions(
        input=src,
        output=tmp_path / "ray.jsonl",
        model=models[0],
        models=models,
        knobs=Knobs(dtype="float32"),
    )
    summary = run_on_ray(options, replicas=2, unit_records=4)
    unseeded = sum(1 for x in lines if x["body"] is sampled)
    assert unseeded == 4
    # computed: 3 texts + 2 greedy + 1 seeded + every unseeded draw
    assert sum(summary.records_by_node.values()) == 3 + 2 + 1 + unseeded
    out = [json.loads(x) for x in (tmp_path / "ray.jsonl").read_text().splitlines()]
    assert [o["custom_id"] for o in out] == [x["custom_id"] for x in lines]
    assert all(o["error"] is None for o in out)
    by_body: dict[str, Any] = {}
    for x, o in zip(lines, out, strict=True):
        if x["body"] is sampled:
            continue
        body = o["response"]["body"]
        answer = body["data"] if "data" in body else body["choices"]
        assert by_body.setdefault(json.dumps(x["body"], sort_keys=True), answer) == answer


@pytest.fixture
def without_the_module_cluster() -> None:
    """Disconnect from the module's Ray instance: ``run_on_ray`` would use an open connection
    rather than the address it is given."""
    ray.shutdown()


@pytest.mark.usefixtures("without_the_module_cluster")
def test_generation_on_a_simulated_two_node_cluster_uses_both_nodes(
    two_nodes: tuple[str, set[str]],  # noqa: F811  (test_ray.py's fixture)
    tiny: Path,
    prompts: Path,
    local_output: Path,
    tmp_path: Path,
) -> None:
    """Last in the module: it leaves the module's Ray instance for the two-node cluster of
    ``test_ray.py`` (a head and a worker of 2 CPUs each, ``ray.cluster_utils``)."""
    address, node_ids = two_nodes
    out = tmp_path / "out"
    summary = run_on_ray(
        generate_options(tiny, prompts, out), address=address, replicas=2, unit_records=2
    )
    assert not ray.is_initialized()  # disconnected; the cluster runs on
    assert_same_rows(out, local_output)
    assert set(summary.nodes) == node_ids
