"""``batchline run --engine ray`` end to end, on Ray clusters started by the tests.

Slow (each Ray start takes seconds): deselect with ``-m "not slow"``. To keep the module short,
one Ray instance serves each class (a local ``ray.init(num_cpus=4)``, then a simulated two-node
cluster); only the first test lets ``run_on_ray`` start and stop Ray itself.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("ray")

import ray

from batchline.__main__ import main
from batchline._errors import InputError, ModelError
from batchline.datasets.sinks import Manifest, read_output, read_skipped
from batchline.integrations import ray as ray_engine
from batchline.integrations.ray import UnitDone, default_replica_knobs, run_on_ray
from batchline.integrations.ray_replica import ReplicaReady
from batchline.integrations.ray_units import UnitPlan
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs
from batchline.models.protocol import ModelInfo

CHUNK = 40
UNIT = 20  # two units per chunk: a chunk is committed by whichever of its units lands last
SENTENCE = (
    "batching keeps the device busy while requests queue up; padding wastes work, "
    "so similar lengths share a batch and ünïcödé text is fine too"
)
WORDS = SENTENCE.split(" ")


def _text(i: int) -> str:
    n = 2 + (i * 7) % 37
    return " ".join(WORDS[(i + j) % len(WORDS)] for j in range(n))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """240 records of 2-38 words with a copied column; record 17 is malformed JSON."""
    path = tmp_path_factory.mktemp("data") / "docs.jsonl"
    lines = [json.dumps({"id": f"d{i}", "text": _text(i), "url": f"u/{i}"}) for i in range(240)]
    lines[17] = '{"id": "d17", "text": '
    path.write_text("\n".join(lines) + "\n")
    return path


def _options(dataset: Path, out: Path, **changes: Any) -> RunOptions:
    base: dict[str, Any] = {
        "input": dataset,
        "output": out,
        "chunk_size": CHUNK,
        "copy_columns": ["url"],
        "on_bad_record": "skip",
    }
    return RunOptions(**{**base, **changes})


@pytest.fixture(scope="module")
def reference(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The local engine's output for the dataset: what every Ray run must reproduce."""
    out = tmp_path_factory.mktemp("ref") / "local"
    run(_options(dataset, out))
    return out


def assert_same_output(out: Path, ref: Path) -> None:
    """Same rows (ids, indices, copied column), vectors within 1e-5, same skips and settings."""
    got, want = read_output(out), read_output(ref)
    ids = got.column("id").to_pylist()
    assert len(ids) == len(set(ids)), "a record was written twice"
    assert ids == want.column("id").to_pylist()
    assert got.column("index").to_pylist() == want.column("index").to_pylist()
    assert got.column("url").to_pylist() == want.column("url").to_pylist()
    np.testing.assert_allclose(
        np.stack(got.column("embedding").to_numpy(zero_copy_only=False)),
        np.stack(want.column("embedding").to_numpy(zero_copy_only=False)),
        atol=1e-5,
    )
    assert read_skipped(out) == read_skipped(ref)
    got_manifest, want_manifest = Manifest.load(out), Manifest.load(ref)
    assert got_manifest.complete
    assert got_manifest.settings == want_manifest.settings  # either engine resumes the other
    assert sorted(p.name for p in out.glob("part-*")) == sorted(p.name for p in ref.glob("part-*"))


def _descendants() -> dict[int, str]:
    """This process's descendants (pid -> name), from /proc."""
    parents: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        close = stat.rindex(")")
        names[int(entry)] = stat[stat.index("(") + 1 : close]
        parents[int(entry)] = int(stat[close + 2 :].split()[1])
    found: dict[int, str] = {}
    todo = [os.getpid()]
    while todo:
        pid = todo.pop()
        for child, parent in parents.items():
            if parent == pid and child not in found:
                found[child] = names[child]
                todo.append(child)
    return found


# -- no Ray needed -------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [1, 7, 40, 100, 1000])
@pytest.mark.parametrize("target", [1, 3, 20, 256])
def test_units_are_slices_of_one_chunk_or_whole_chunks(chunk_size: int, target: int) -> None:
    plan = UnitPlan(chunk_size, target)
    n = 3 * chunk_size + 5
    keys = [plan.key(i) for i in range(n)]
    assert keys == sorted(keys)  # each unit is a contiguous run of indices
    units: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        units.setdefault(k, []).append(i)
    for indices in units.values():
        lo, hi = indices[0], indices[-1]
        assert len(indices) <= target
        whole_chunks = lo % chunk_size == 0 and ((hi + 1) % chunk_size == 0 or hi == n - 1)
        assert lo // chunk_size == hi // chunk_size or whole_chunks


def _ready(max_running: int = 0, in_flight: int = 0) -> ReplicaReady:
    return ReplicaReady("node", 1, 0.0, ModelInfo(name="m", task="embed"), max_running, in_flight)


@pytest.mark.parametrize(
    ("max_running", "in_flight", "unit", "want"),
    [
        (0, 0, 256, 2),  # a batch model: units_per_replica
        (16, 64, 8, 4),  # its running batch (2 units) and two more
        (17, 68, 8, 5),  # a partial unit counts whole
        (256, 1024, 8, 34),  # vLLM's max_num_seqs: still bounded by the batch, not the queue
        (4, 4, 8, 1),  # a queue smaller than a unit: one at a time
    ],
)
def test_a_generator_replica_takes_units_to_fill_its_batch_and_two_more(
    max_running: int, in_flight: int, unit: int, want: int
) -> None:
    from batchline.integrations.ray import _capacity

    assert _capacity(_ready(max_running, in_flight), unit, units_per_replica=2) == want


def test_the_summary_says_each_precision_the_replicas_chose() -> None:
    from batchline.integrations.ray import _replica_precision

    def ready(precision: str) -> ReplicaReady:
        return dataclasses.replace(_ready(), precision=precision)

    bf16, fp32 = "bf16 on torch (auto on amx: ...)", "fp32 on onnxruntime (auto on avx2: ...)"
    assert _replica_precision([ready(bf16), ready(bf16)]) == bf16
    assert _replica_precision([ready(bf16), ready(fp32), ready(bf16)]) == (
        f"2 replicas: {bf16}; 1 replica: {fp32}"
    )
    assert _replica_precision([ready(""), ready("")]) == ""  # a generator's replicas


def test_settings_errors_need_no_cluster(dataset: Path, tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--no-batching"):
        run_on_ray(_options(dataset, tmp_path / "a", knobs=Knobs(batching=False)))
    with pytest.raises(InputError, match="--replicas must be >= 1"):
        run_on_ray(_options(dataset, tmp_path / "b"), replicas=0)
    for cpus in (0.0, float("inf"), float("nan")):  # inf once overflowed into a traceback
        with pytest.raises(InputError, match="--cpus-per-replica must be a number > 0"):
            run_on_ray(_options(dataset, tmp_path / "c"), cpus_per_replica=cpus)
    assert not ray.is_initialized()


def test_an_address_nobody_listens_on_fails_fast_and_writes_nothing(
    dataset: Path, tmp_path: Path
) -> None:
    with pytest.raises(InputError, match=r"cannot connect to a Ray cluster at 127\.0\.0\.1:1"):
        run_on_ray(_options(dataset, tmp_path / "out"), address="127.0.0.1:1")
    assert not (tmp_path / "out").exists()
    assert not ray.is_initialized()


def test_address_without_engine_ray_is_a_one_line_error(
    dataset: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["run", str(dataset), "-o", str(tmp_path / "o"), "--replicas", "3", "--quiet"])
    assert code == 2
    flags = "--address, --replicas and --cpus-per-replica"
    assert f"{flags} go with --engine ray" in capsys.readouterr().err


# -- run_on_ray starting and stopping its own Ray ------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_cli_engine_ray_starts_ray_and_leaves_no_process_behind(
    dataset: Path, reference: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not ray.is_initialized()
    env_before = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_USAGE_STATS_ENABLED")}
    before = _descendants()
    during: dict[int, str] = {}
    replica_pids: set[int] = set()
    real_run_on_ray = ray_engine.run_on_ray

    def spy(options: RunOptions, **kwargs: Any) -> Any:
        def on_unit(done: UnitDone) -> None:
            replica_pids.add(done.pid)
            during.update(_descendants())

        return real_run_on_ray(options, on_unit=on_unit, **kwargs)

    monkeypatch.setattr(ray_engine, "run_on_ray", spy)  # the CLI imports it when it runs
    out = tmp_path / "out"
    args = ["run", str(dataset), "-o", str(out), "--engine", "ray", "--replicas", "2"]
    args += ["--chunk-size", str(CHUNK), "--copy-column", "url", "--on-bad-record", "skip"]
    assert main([*args, "--quiet"]) == 0
    assert not ray.is_initialized()
    assert_same_output(out, reference)
    assert {k: os.environ.get(k) for k in env_before} == env_before
    # ray.shutdown() has signalled its processes; give them a moment to exit.
    deadline = time.monotonic() + 30
    while (left := set(_descendants()) - set(before)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"left behind: {[_descendants().get(p) for p in left]}"
    # The check saw Ray's processes while the job ran: the replicas, the raylet, the GCS.
    assert replica_pids <= set(during)
    assert {"raylet", "gcs_server"} <= set(during.values())


# -- one local Ray instance with 4 logical CPUs --------------------------------------------------


@pytest.fixture(scope="class")
def local_ray() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
        try:
            yield
        finally:
            ray.shutdown()


class _Interrupt(Exception):
    pass


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.usefixtures("local_ray")
class TestLocalRay:
    def test_output_equals_the_local_run(
        self, dataset: Path, reference: Path, tmp_path: Path
    ) -> None:
        out = tmp_path / "out"
        summary = run_on_ray(_options(dataset, out), replicas=2, unit_records=UNIT)
        assert_same_output(out, reference)
        assert summary.records == 239
        assert summary.skipped == 1
        assert summary.total_records == 240
        assert summary.units == 12
        assert summary.resubmitted_units == 0
        assert sum(summary.records_by_node.values()) == 239
        assert summary.replica_cpu_s > 0
        # the replicas' precision, as a local run says it (auto pinned to fp32 in tests)
        assert summary.precision.startswith("fp32 on onnxruntime (auto, set by")
        assert ray.is_initialized()  # not ours to stop

    def test_duplicates_are_found_once_per_job_not_once_per_replica(self, tmp_path: Path) -> None:
        # 200 records holding 13 distinct texts, spread over units on two replicas
        src = tmp_path / "dupes.jsonl"
        rows = [{"id": f"r{i}", "text": _text(i % 13)} for i in range(200)]
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        local = run(_options(src, tmp_path / "local", copy_columns=[]))
        out = tmp_path / "ray"
        summary = run_on_ray(_options(src, out, copy_columns=[]), replicas=2, unit_records=UNIT)
        assert summary.duplicates == local.duplicates == 200 - 13
        assert set(summary.records_by_node.values()) <= {13}  # computed once, on one node
        got, want = read_output(out), read_output(tmp_path / "local")
        assert got.column("id").to_pylist() == want.column("id").to_pylist()
        np.testing.assert_allclose(
            np.stack(got.column("embedding").to_numpy(zero_copy_only=False)),
            np.stack(want.column("embedding").to_numpy(zero_copy_only=False)),
            atol=1e-5,
        )

    def test_an_interrupted_run_resumes_to_the_same_output(
        self, dataset: Path, reference: Path, tmp_path: Path
    ) -> None:
        out = tmp_path / "out"
        seen: list[UnitDone] = []

        def interrupt_after_five_units(done: UnitDone) -> None:
            seen.append(done)
            if len(seen) == 5:
                raise _Interrupt

        with pytest.raises(_Interrupt):
            run_on_ray(
                _options(dataset, out),
                unit_records=UNIT,
                units_per_replica=1,
                on_unit=interrupt_after_five_units,
            )
        partial = Manifest.load(out)
        assert not partial.complete
        assert 1 <= len(partial.chunks) < 6

        resumed = run_on_ray(_options(dataset, out, resume=True), unit_records=UNIT)
        assert_same_output(out, reference)
        assert resumed.already_done == len(partial.chunks) * CHUNK
        assert resumed.records + resumed.skipped + resumed.already_done == 240

        again = run_on_ray(_options(dataset, out, resume=True))  # finished: nothing to do
        assert again.records == 0
        assert again.already_done == 240

    def test_a_model_that_cannot_load_is_one_clear_error(
        self, dataset: Path, tmp_path: Path
    ) -> None:
        missing = _options(
            dataset, tmp_path / "out", model=str(tmp_path / "missing.onnx"), tokenizer=dataset
        )
        with pytest.raises(InputError, match=r"missing.onnx: no such model file"):
            run_on_ray(missing, start_timeout_s=120)  # seen by the driver, before any replica
        broken = tmp_path / "broken.onnx"
        broken.write_bytes(b"not an ONNX graph")
        options = _options(dataset, tmp_path / "out", model=str(broken), tokenizer=dataset)
        with pytest.raises(ModelError, match=r"could not load the model: "):
            run_on_ray(options, start_timeout_s=120)  # seen by the replicas as they start
        assert not (tmp_path / "out").exists()

    def test_a_gpu_replica_reserves_a_gpu(self, dataset: Path, tmp_path: Path) -> None:
        """This cluster has no GPU: a replica on device cuda cannot be placed, and says why."""
        options = _options(dataset, tmp_path / "out")
        knobs = default_replica_knobs(options.knobs).replace(device="cuda")
        with pytest.raises(
            ModelError, match=r"needs 1 CPU\(s\) and 1 GPU .* has 4 CPU\(s\) and 0 GPU"
        ):
            run_on_ray(options, replicas=1, replica_knobs=knobs, start_timeout_s=3)
        assert not (tmp_path / "out").exists()  # nothing was written


# -- a simulated two-node cluster ----------------------------------------------------------------


@pytest.fixture(scope="class")
def two_nodes() -> Iterator[tuple[str, set[str]]]:
    """A head (2 CPUs) and a worker node (2 CPUs) on this machine: (address, node ids)."""
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False}
        )
        try:
            worker = cluster.add_node(num_cpus=2)
            yield cluster.address, {cluster.head_node.node_id, worker.node_id}
        finally:
            cluster.shutdown()


def _kill_once(pids: list[int]) -> Any:
    """An ``on_unit`` hook that SIGKILLs the process of the replica that finished first."""

    def hook(done: UnitDone) -> None:
        if not pids:
            pids.append(done.pid)
            os.kill(done.pid, signal.SIGKILL)

    return hook


@pytest.mark.slow
@pytest.mark.timeout(240)
class TestTwoNodes:
    """``run_on_ray(address=...)`` connects to the running cluster and disconnects at the end."""

    def test_both_nodes_work_and_a_killed_replica_is_restarted(
        self, two_nodes: tuple[str, set[str]], dataset: Path, reference: Path, tmp_path: Path
    ) -> None:
        address, node_ids = two_nodes
        out = tmp_path / "out"
        killed: list[int] = []
        summary = run_on_ray(
            _options(dataset, out),
            address=address,
            replicas=2,
            unit_records=UNIT,
            on_unit=_kill_once(killed),
        )
        assert not ray.is_initialized()  # disconnected; the cluster itself runs on
        assert_same_output(out, reference)
        assert set(summary.nodes) == node_ids  # work landed on both nodes
        assert summary.replica_restarts >= 1  # Ray restarted the killed process
        assert killed
        assert not Path(f"/proc/{killed[0]}").exists()

    def test_a_replica_lost_for_good_has_its_units_sent_elsewhere(
        self, two_nodes: tuple[str, set[str]], dataset: Path, reference: Path, tmp_path: Path
    ) -> None:
        address, _ = two_nodes
        out = tmp_path / "out"
        killed: list[int] = []
        summary = run_on_ray(
            _options(dataset, out),
            address=address,
            replicas=2,
            unit_records=UNIT,
            max_restarts=0,
            max_task_retries=0,
            on_unit=_kill_once(killed),
        )
        assert_same_output(out, reference)
        assert summary.resubmitted_units >= 1
        assert summary.replica_restarts == 0
