"""``batchline run photos/ --engine ray``: an image job on two replicas of a local Ray
instance, each decoding its units' pictures itself, gives the local engine's output; a replica
killed mid-job leaves every picture answered once."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray")
pytest.importorskip("onnxruntime")
pytest.importorskip("PIL")

import ray

from batchline.datasets.sinks import Manifest, read_output
from batchline.integrations.ray import UnitDone, run_on_ray
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs
from batchline.models.image import DecodeOptions
from tests.image_helpers import image_model, photo_folder, write_labels

COUNT = 12


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RAY_AUTH_MODE", "disabled")
        mp.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("ray-images")
    model = image_model(root, size=32, classify=True)
    write_labels(model, ["a", "b", "c", "d", "e"])
    photo_folder(root / "photos", COUNT)
    return model, root / "photos"


def _options(job: tuple[Path, Path], out: Path) -> RunOptions:
    model, photos = job
    return RunOptions(
        input=photos,
        output=out,
        model=str(model),
        knobs=Knobs(sessions=1, max_concurrent_batches=1),
        decode=DecodeOptions(workers=1),
    )


def _rows(out: Path) -> list[dict[str, Any]]:
    return read_output(out).to_pylist()  # type: ignore[no-any-return]


@pytest.fixture(scope="module")
def local(job: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("local") / "out"
    run(_options(job, out))
    return out


def _same(out: Path, want: Path) -> None:
    got = _rows(out)
    assert [r["index"] for r in got] == list(range(COUNT))  # each picture once, in order
    assert got == _rows(want)
    assert Manifest.load(out).settings == Manifest.load(want).settings  # either resumes the other


@pytest.mark.usefixtures("cluster")
def test_an_image_job_on_two_replicas_gives_the_local_output(
    job: tuple[Path, Path], local: Path, tmp_path: Path
) -> None:
    replicas: set[int] = set()
    out = tmp_path / "out"
    run_on_ray(
        _options(job, out),
        replicas=2,
        unit_records=2,
        on_unit=lambda done: replicas.add(done.replica),
    )
    _same(out, local)
    assert replicas == {0, 1}


@pytest.mark.usefixtures("cluster")
def test_a_replica_killed_mid_job_leaves_every_picture_answered_once(
    job: tuple[Path, Path], local: Path, tmp_path: Path
) -> None:
    killed: list[int] = []

    def kill_once(done: UnitDone) -> None:
        if not killed:
            killed.append(done.pid)
            os.kill(done.pid, signal.SIGKILL)

    out = tmp_path / "out"
    summary = run_on_ray(_options(job, out), replicas=2, unit_records=1, on_unit=kill_once)
    _same(out, local)
    assert killed
    assert summary.replica_restarts >= 1 or summary.resubmitted_units >= 1


@pytest.mark.usefixtures("cluster")
def test_duplicate_pictures_are_found_once_per_job_in_the_driver(
    job: tuple[Path, Path], tmp_path: Path
) -> None:
    # 12 files holding 3 distinct pictures, spread over units on two replicas
    model, photos = job
    originals = sorted(p for p in photos.rglob("*.jpg"))[:3]
    folder = tmp_path / "dupes"
    folder.mkdir()
    for i in range(COUNT):
        (folder / f"d{i:02d}.jpg").write_bytes(originals[i % 3].read_bytes())
    options = _options((model, folder), tmp_path / "ray")
    local = run(dataclasses.replace(options, output=tmp_path / "local"))
    summary = run_on_ray(options, replicas=2, unit_records=2)
    assert sum(summary.records_by_node.values()) == 3  # each distinct picture sent once
    assert summary.duplicates == local.duplicates == COUNT - 3
    got, want = _rows(tmp_path / "ray"), _rows(tmp_path / "local")
    assert [r["id"] for r in got] == [r["id"] for r in want]
    assert [r["classification"] for r in got] == [r["classification"] for r in want]
