"""``batchline run`` over pictures: a folder, a column of paths or bytes, WebDataset shards;
a plain ONNX NCHW model classifying or embedding them; bad pictures as one record's error;
duplicates, the cache, ``--limit`` and a resumed ``kill -9``."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.importorskip("onnxruntime")
pytest.importorskip("PIL")

from PIL import Image

from batchline.__main__ import main
from batchline.datasets.sinks import PAUSE_AFTER_CHUNKS_ENV, read_output, read_skipped
from batchline.jobs.options import RunOptions
from batchline.jobs.run import run
from batchline.models.config import Knobs
from batchline.models.image import DecodeOptions
from tests.image_helpers import (
    image_model,
    jpeg_bytes,
    photo_folder,
    picture,
    png_bytes,
    write_labels,
)
from tests.models.test_image_decode import _png_declaring

LABELS = ["cat", "dog", "car", "tree", "boat"]


@pytest.fixture
def classifier(tmp_path: Path) -> Path:
    path = image_model(tmp_path, size=32, classify=True)
    write_labels(path, LABELS)
    return path


def _options(src: Path, model: Path, out: Path, **more: object) -> RunOptions:
    settings: dict[str, object] = {"decode": DecodeOptions(workers=2), **more}
    return RunOptions(
        input=src,
        output=out,
        model=str(model),
        knobs=Knobs(sessions=1, max_concurrent_batches=1),
        **settings,  # type: ignore[arg-type]
    )


def _inline(model_path: Path, pictures: list[bytes], **spec: object) -> list[object]:
    """What the model gives for ``pictures`` decoded in this process, one batch."""
    from batchline.models.loader import load_model

    options = RunOptions(model=str(model_path), input=model_path.parent, **spec)  # type: ignore[arg-type]
    model = load_model(options.parse_spec(None), Knobs(sessions=1))
    items = model.prepare(pictures)
    return list(model.run_batch(items))


def test_a_folder_is_classified_every_picture_once_ids_its_relative_paths(
    tmp_path: Path, classifier: Path
) -> None:
    names = photo_folder(tmp_path / "photos", 7)
    summary = run(_options(tmp_path / "photos", classifier, tmp_path / "out"))
    table = read_output(tmp_path / "out")
    assert table.column("id").to_pylist() == names  # recursive, sorted, relative
    assert summary.records == 7
    assert summary.skipped == 0
    got = table.column("classification").to_pylist()
    want = _inline(classifier, [(tmp_path / "photos" / n).read_bytes() for n in names])
    for row, expected in zip(got, want, strict=True):
        assert row["label"] == expected["label"]  # type: ignore[index]
        assert row["label"] in LABELS
        assert row["score"] == pytest.approx(expected["score"], abs=1e-6)  # type: ignore[index]
        assert max(row["scores"], key=row["scores"].get) == row["label"]
        assert sorted(row["scores"]) == sorted(LABELS)
    assert "decode" in summary.time_split
    assert "waiting" in summary.time_split


def test_top_k_from_the_command_line_keeps_the_likeliest_pictures_labels(
    tmp_path: Path, classifier: Path
) -> None:
    photo_folder(tmp_path / "photos", 3)
    argv = ["run", str(tmp_path / "photos"), "--model", str(classifier), "--top-k", "2"]
    assert main([*argv, "-o", str(tmp_path / "out"), "--quiet"]) == 0
    for row in read_output(tmp_path / "out").column("classification").to_pylist():
        assert [e["label"] for e in row["top_k"]][:1] == [row["label"]]
        assert len(row["top_k"]) == 2
        assert row["top_k"][0]["score"] >= row["top_k"][1]["score"]


def test_an_embedder_of_any_size_takes_image_size_and_writes_fixed_vectors(
    tmp_path: Path,
) -> None:
    model = image_model(tmp_path, size=None, classify=False)
    names = photo_folder(tmp_path / "photos", 4)
    run(_options(tmp_path / "photos", model, tmp_path / "out", image_size=24))
    table = read_output(tmp_path / "out")
    assert pa.types.is_list(table.schema.field("embedding").type)
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    want = _inline(model, [(tmp_path / "photos" / n).read_bytes() for n in names], image_size=24)
    np.testing.assert_allclose(vectors, np.stack(want), atol=1e-5)  # type: ignore[arg-type]


def test_without_a_fixed_size_or_image_size_the_error_says_what_to_pass(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = image_model(tmp_path, size=None, classify=False)
    photo_folder(tmp_path / "photos", 2)
    rc = main(["run", str(tmp_path / "photos"), "--model", str(model), "-o", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "--image-size" in err[0]


def _bad_folder(root: Path) -> dict[str, str]:
    """Good pictures and one of each bad kind; the bad ones' names and what their skip says."""
    photo_folder(root, 3)
    frames = [Image.new("P", (16, 16), i % 250) for i in range(2000)]
    out = io.BytesIO()
    frames[0].save(out, "GIF", save_all=True, append_images=frames[1:])
    (root / "animated.gif").write_bytes(out.getvalue())  # good: its first frame
    (root / "truncated.jpg").write_bytes(jpeg_bytes(9, size=(64, 64))[:400])
    (root / "text.jpg").write_text("hello, I am not a photo\n")
    (root / "empty.jpg").write_bytes(b"")
    (root / "bomb.png").write_bytes(_png_declaring(30_000, 30_000))
    (root / "dangling.jpg").symlink_to(root / "nowhere.jpg")
    (root / "loop.jpg").symlink_to(root / "loop.jpg")
    (root / "sub" / "back").symlink_to(root)  # a folder loop: walked once, not forever
    return {
        "truncated.jpg": "(?i)truncated",
        "text.jpg": "starts with the text",
        "empty.jpg": "empty",
        "bomb.png": "900,000,000 pixels",
        "dangling.jpg": "cannot read",
        "loop.jpg": "cannot read",
    }


def test_each_bad_picture_is_listed_with_one_line_and_the_others_written(
    tmp_path: Path, classifier: Path
) -> None:
    bad = _bad_folder(tmp_path / "photos")
    summary = run(_options(tmp_path / "photos", classifier, tmp_path / "out", on_bad_record="skip"))
    written = read_output(tmp_path / "out").column("id").to_pylist()
    assert sorted(written) == sorted(["animated.gif", "p00.jpg", "p01.jpg", "sub/p02.png"])
    skipped = {row["id"]: row for row in read_skipped(tmp_path / "out")}
    assert set(skipped) == set(bad)
    import re

    for name, pattern in bad.items():
        assert re.search(pattern, skipped[name]["reason"]), skipped[name]
        assert "\n" not in skipped[name]["reason"]
    assert summary.records == 4
    assert summary.skipped == len(bad)


def test_a_bad_picture_stops_the_job_naming_it_by_default(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photo_folder(tmp_path / "photos", 2)
    (tmp_path / "photos" / "text.jpg").write_text("not a photo")
    rc = main(
        ["run", str(tmp_path / "photos"), "--model", str(classifier), "-o", str(tmp_path / "o")]
    )
    assert rc == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "'text.jpg'" in err[0]
    assert "--on-bad-record skip" in err[0]


def test_the_same_bytes_are_computed_once_and_the_cache_keys_them_by_content(
    tmp_path: Path, classifier: Path
) -> None:
    root = tmp_path / "photos"
    photo_folder(root, 3)
    (root / "copy.jpg").write_bytes((root / "p00.jpg").read_bytes())
    first = run(_options(root, classifier, tmp_path / "a", cache=tmp_path / "cache"))
    assert first.duplicates == 1
    assert first.cached == 0
    rows = {r["id"]: r["classification"] for r in read_output(tmp_path / "a").to_pylist()}
    assert rows["copy.jpg"] == rows["p00.jpg"]
    (root / "new.jpg").write_bytes(jpeg_bytes(77))
    second = run(_options(root, classifier, tmp_path / "b", cache=tmp_path / "cache", dedupe=False))
    assert second.cached == 4  # the old pictures' bytes; new.jpg is computed
    again = {r["id"]: r["classification"] for r in read_output(tmp_path / "b").to_pylist()}
    assert {k: again[k] for k in rows} == rows
    # a cached picture is not even decoded: with a limit no picture passes, they still come
    strict = DecodeOptions(workers=1, max_pixels=1)
    third = run(_options(root, classifier, tmp_path / "c", cache=tmp_path / "cache", decode=strict))
    assert third.cached == 5
    assert third.records == 5
    assert read_output(tmp_path / "c").column("id").to_pylist() == sorted(again)


def test_limit_takes_the_first_pictures(tmp_path: Path, classifier: Path) -> None:
    names = photo_folder(tmp_path / "photos", 6)
    run(_options(tmp_path / "photos", classifier, tmp_path / "out", limit=2))
    assert read_output(tmp_path / "out").column("id").to_pylist() == names[:2]


def test_a_column_of_relative_paths_or_of_bytes(tmp_path: Path, classifier: Path) -> None:
    names = photo_folder(tmp_path / "data" / "pics", 3)
    rows = [{"id": f"r{i}", "file": f"pics/{n}", "caption": f"c{i}"} for i, n in enumerate(names)]
    rows.append({"id": "r3", "file": "pics/missing.jpg", "caption": "gone"})
    csv_path = tmp_path / "data" / "index.csv"
    csv_path.write_text(
        "id,file,caption\n" + "".join(f"{r['id']},{r['file']},{r['caption']}\n" for r in rows)
    )
    run(
        _options(
            csv_path, classifier, tmp_path / "o1", image_column="file", on_bad_record="skip",
            copy_columns=["caption"],
        )
    )  # fmt: skip
    table = read_output(tmp_path / "o1")
    assert table.column("id").to_pylist() == ["r0", "r1", "r2"]
    assert table.column("caption").to_pylist() == ["c0", "c1", "c2"]
    assert [s["id"] for s in read_skipped(tmp_path / "o1")] == ["r3"]

    blobs = [(tmp_path / "data" / "pics" / n).read_bytes() for n in names]
    parquet = tmp_path / "data" / "blobs.parquet"
    pq.write_table(pa.table({"image": blobs, "name": names}), parquet)
    run(_options(parquet, classifier, tmp_path / "o2", image_column="image"))
    assert (
        read_output(tmp_path / "o2").column("classification").to_pylist()
        == table.column("classification").to_pylist()
    )


@pytest.mark.parametrize("on_bad_record", ["skip", "fail"])
def test_a_null_picture_cell_gives_the_same_reason_skipped_or_failed(
    tmp_path: Path, classifier: Path, on_bad_record: str
) -> None:
    parquet = tmp_path / "blobs.parquet"
    pq.write_table(pa.table({"id": ["a", "b"], "image": [jpeg_bytes(0), None]}), parquet)
    options = _options(
        parquet, classifier, tmp_path / "o", image_column="image", on_bad_record=on_bad_record
    )
    if on_bad_record == "fail":
        with pytest.raises(Exception, match=r"no picture \(the column is empty or null\)"):
            run(options)
        return
    summary = run(options)
    (skipped,) = read_skipped(tmp_path / "o")
    assert skipped["id"] == "b"
    assert skipped["reason"].endswith("no picture (the column is empty or null)")
    assert summary.empty_texts == 0  # a picture job has no texts to be empty


def test_an_onnx_told_how_to_read_pictures_reads_a_files_image_column_by_default(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    names = photo_folder(tmp_path / "pics", 3)
    index = tmp_path / "index.csv"
    index.write_text("id,image\n" + "".join(f"r{i},pics/{n}\n" for i, n in enumerate(names)))
    argv = ["run", str(index), "--model", str(classifier), "--image-size", "32", "--quiet"]
    assert main([*argv, "-o", str(tmp_path / "o1")]) == 0
    assert main([*argv, "--image-column", "image", "-o", str(tmp_path / "o2")]) == 0
    got = read_output(tmp_path / "o1")
    assert got.column("id").to_pylist() == ["r0", "r1", "r2"]
    assert got.equals(read_output(tmp_path / "o2"))
    index.write_text("id,file\nr0,pics/p00.jpg\n")
    capsys.readouterr()
    assert main([*argv, "-o", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no picture column 'image'" in err
    assert "'id', 'file'" in err
    assert "--image-column" in err


def _shard(path: Path, start: int, count: int) -> list[str]:
    keys = []
    with tarfile.open(path, "w") as tar:
        for i in range(start, start + count):
            key = f"{i:09d}"
            keys.append(key)
            for suffix, data in (
                ("jpg", jpeg_bytes(i)),
                ("txt", f"caption {i}".encode()),
                ("json", json.dumps({"url": f"http://x/{i}", "width": 48}).encode()),
            ):
                info = tarfile.TarInfo(f"{key}.{suffix}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return keys


@pytest.mark.parametrize("given", ["file", "folder", "braces"])
def test_webdataset_shards_as_a_file_a_folder_or_a_brace_pattern(
    tmp_path: Path, classifier: Path, given: str
) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    keys = _shard(shards / "00000.tar", 0, 3) + _shard(shards / "00001.tar", 3, 2)
    src = {
        "file": shards / "00000.tar",
        "folder": shards,
        "braces": shards / "{00000..00001}.tar",
    }[given]
    run(_options(src, classifier, tmp_path / "out", copy_columns=["txt", "url"]))
    table = read_output(tmp_path / "out")
    want = keys[:3] if given == "file" else keys
    assert table.column("id").to_pylist() == want
    assert table.column("txt").to_pylist() == [f"caption {int(k)}" for k in want]
    assert table.column("url").to_pylist() == [f"http://x/{int(k)}" for k in want]
    labels = table.column("classification").to_pylist()
    inline = _inline(classifier, [jpeg_bytes(int(k)) for k in want])
    assert [r["label"] for r in labels] == [r["label"] for r in inline]  # type: ignore[index]


def test_a_damaged_shard_is_one_bad_record_and_the_other_shards_go_on(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A shard cut short: its samples before the damage run, the damage is one bad record
    (listed under skip, naming the shard), the next shard runs. The whole job had stopped
    before its first picture, whatever --on-bad-record said."""
    shards = tmp_path / "shards"
    shards.mkdir()
    first = _shard(shards / "00000.tar", 0, 2)
    cut = _shard(shards / "00001.tar", 2, 3)
    last = _shard(shards / "00002.tar", 5, 2)
    whole = (shards / "00001.tar").read_bytes()
    (shards / "00001.tar").write_bytes(whole[: len(whole) * 6 // 10])
    run(_options(shards, classifier, tmp_path / "out", on_bad_record="skip"))
    ids = read_output(tmp_path / "out").column("id").to_pylist()
    kept = [k for k in cut if k in ids]
    assert ids == first + kept + last
    assert 0 < len(kept) < len(cut)
    skipped = read_skipped(tmp_path / "out")
    assert [s["id"] for s in skipped] == ["00001.tar#damaged"]
    assert "the shard is damaged after sample" in str(skipped[0]["reason"])
    capsys.readouterr()
    argv = ["run", str(shards), "--model", str(classifier), "-o", str(tmp_path / "stopped")]
    assert main(argv) == 2  # by default, the job stops at it, in one line
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert "00001.tar: the shard is damaged after sample" in err[0]
    assert "--on-bad-record skip" in err[0]


def test_a_killed_job_resumed_writes_every_picture_exactly_once(
    tmp_path: Path, classifier: Path
) -> None:
    names = photo_folder(tmp_path / "photos", 30)
    out = tmp_path / "out"
    argv = [
        sys.executable, "-m", "batchline", "run", "--quiet", str(tmp_path / "photos"),
        "--model", str(classifier), "-o", str(out), "--chunk-size", "4", "--max-batch-size", "4",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", PAUSE_AFTER_CHUNKS_ENV: "2"}
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    manifest = out / "_manifest.json"
    try:
        for _ in range(2400):  # bounded wait (at most ~2 min) for the first committed chunks
            if proc.poll() is not None:
                break
            if manifest.exists() and len(json.loads(manifest.read_text())["chunks"]) >= 2:
                break
            time.sleep(0.05)
        assert proc.poll() is None, "the job ended before it could be killed"
        helpers = _descendants(proc.pid)  # the decode workers and their fork server
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
        if proc.stderr is not None:
            proc.stderr.close()
    assert len(json.loads(manifest.read_text())["chunks"]) == 2
    for _ in range(100):  # bounded: the workers notice within about a second
        if not any(Path(f"/proc/{pid}").exists() for pid in helpers):
            break
        time.sleep(0.1)
    assert helpers
    assert not any(Path(f"/proc/{pid}").exists() for pid in helpers), "orphaned decode workers"
    done = subprocess.run(
        [*argv, "--resume"], env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True,
        text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = read_output(out)
    assert table.column("index").to_pylist() == list(range(30))
    assert table.column("id").to_pylist() == names
    run(_options(tmp_path / "photos", classifier, tmp_path / "whole"))
    assert (
        table.column("classification").to_pylist()
        == read_output(tmp_path / "whole").column("classification").to_pylist()
    )


def _descendants(root: int) -> list[int]:
    """Every process below ``root`` (Linux's /proc)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    found, frontier = [], [root]
    while frontier:
        parent = frontier.pop()
        children = [pid for pid, ppid in parents.items() if ppid == parent]
        found += children
        frontier += children
    return found


def test_a_text_model_on_pictures_says_to_give_an_image_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    photo_folder(tmp_path / "photos", 1)
    rc = main(["run", str(tmp_path / "photos"), "-o", str(tmp_path / "o")])
    assert rc == 2
    assert "give an image model" in capsys.readouterr().err


def test_pictures_in_every_mode_run(tmp_path: Path, classifier: Path) -> None:
    root = tmp_path / "photos"
    root.mkdir()
    for mode in ("L", "RGBA", "P", "CMYK"):
        image = picture(5, mode=mode)
        if mode == "CMYK":
            image.save(root / "cmyk.jpg", "JPEG")
        else:
            (root / f"{mode.lower()}.png").write_bytes(png_bytes(image))
    summary = run(_options(root, classifier, tmp_path / "out"))
    assert summary.records == 4
    assert summary.skipped == 0


def test_without_pillow_an_image_job_names_the_install(tmp_path: Path, classifier: Path) -> None:
    from batchline._commands import install_command
    from tests.test_cli_imports import _blocked

    photo_folder(tmp_path / "photos", 1)
    argv = ["run", str(tmp_path / "photos"), "--model", str(classifier), "-o", str(tmp_path / "o")]
    done = _blocked(["PIL"], [argv])
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [2]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "needs the 'jobs' extra (PIL is not installed)" in lines[0]
    assert lines[0].endswith(f"run: {install_command('jobs')}")  # this environment's command


def test_a_missing_picture_column_says_which_flag_names_it(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "index.csv").write_text("id,file\na,x.jpg\n")
    argv = ["run", str(tmp_path / "index.csv"), "--model", str(classifier)]
    rc = main([*argv, "--image-column", "path", "-o", str(tmp_path / "o")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "no picture column 'path'" in err
    assert "--image-column" in err


def _device_module(root: Path, name: str, before_batch: str) -> str:
    """A ``module:factory`` picture model written as ``root/NAME.py`` (importable from
    ``root``): 8 x 8 inputs, a vector of 2 each; ``before_batch`` (Python, its batch in
    ``batch``) runs at the start of every ``run_batch``. Its spec."""
    lines = textwrap.dedent(before_batch).strip().splitlines()
    body = "\n".join(f"        {line}" for line in lines)
    (root / f"{name}.py").write_text(
        "import os, signal, time\n"
        "import numpy as np\n"
        "from batchline.models.image import ImagePreprocess\n"
        "from batchline.models.protocol import ModelInfo\n"
        "done = [0]\n"
        "class Device:\n"
        "    preprocess = ImagePreprocess(resize_to=(8, 8))\n"
        f"    info = ModelInfo(name={name!r}, task='embed', input_kind='image', "
        "result_kind='vector')\n"
        "    def prepare(self, inputs):\n"
        "        return list(inputs)\n"
        "    def cost(self, item):\n"
        "        return 1\n"
        "    def run_batch(self, batch):\n"
        f"{body}\n"
        "        return [np.full(2, float(x.mean()), np.float32) for x in batch]\n"
        "    def encode(self, result):\n"
        "        return result\n"
        "    def close(self):\n"
        "        pass\n"
        "def factory():\n"
        "    return Device()\n"
    )
    return f"{name}:factory"


def test_decode_workers_are_cut_to_what_keeps_a_slow_model_fed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # far slower than decoding a small picture
    model = _device_module(tmp_path, "slowdevice", "time.sleep(0.02 * len(batch))")
    monkeypatch.syspath_prepend(str(tmp_path))
    photo_folder(tmp_path / "photos", 40)
    options = RunOptions(
        input=tmp_path / "photos",
        output=tmp_path / "out",
        model=model,
        knobs=Knobs(sessions=1, max_concurrent_batches=1, max_batch_size=4),
        decode=DecodeOptions(workers=None),
    )
    summary = run(options)
    assert summary.records == 40
    assert "(1 of " in summary.time_split  # one process keeps a 20 ms/picture model fed


def test_a_stopped_image_job_keeps_the_pictures_its_model_did(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ctrl-C once the model has done 120 of 300 pictures: what it did is kept, but for the
    blocks still in flight, and ``--resume`` does the rest, each picture once. Written a block
    of 256 at a time, such a stop had kept none of them."""
    stop_at_the_120th = """
    done[0] += len(batch)
    if done[0] >= int(os.environ["STOP_AFTER_PICTURES"]) > done[0] - len(batch):
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, once this many pictures are done
    """
    model = _device_module(tmp_path, "stoppingdevice", stop_at_the_120th)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("STOP_AFTER_PICTURES", "120")
    names = photo_folder(tmp_path / "photos", 300)
    options = RunOptions(
        input=tmp_path / "photos",
        output=tmp_path / "out",
        model=model,
        chunk_size=8,
        knobs=Knobs(sessions=1, max_concurrent_batches=1, max_batch_size=8),
        decode=DecodeOptions(workers=1),
    )
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            run(options)
    finally:
        signal.signal(signal.SIGINT, before)
    from batchline.datasets.manifest import Manifest

    kept = Manifest.load(tmp_path / "out").records_kept
    assert 32 <= kept <= 120  # a block in flight may be withdrawn; none is written twice
    monkeypatch.setenv("STOP_AFTER_PICTURES", "100000")
    summary = run(dataclasses.replace(options, resume=True))
    assert summary.records == 300 - kept
    table = read_output(tmp_path / "out")
    assert table.column("index").to_pylist() == list(range(300))
    assert table.column("id").to_pylist() == names


def test_a_resume_with_another_decode_is_refused_naming_it(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--no-draft`` changes the pixels and ``--max-image-pixels`` which pictures are
    refused: a resume that gives another had gone on, two decodes in one output. Left at
    their defaults they are not written, so a resume of an older output still goes on."""
    photo_folder(tmp_path / "photos", 4)
    argv = ["run", str(tmp_path / "photos"), "--model", str(classifier), "--quiet"]
    assert main([*argv, "-o", str(tmp_path / "a"), "--limit", "2"]) == 0
    again = [*argv, "-o", str(tmp_path / "a"), "--limit", "2", "--resume"]
    assert main([*again, "--no-draft"]) == 2
    assert "draft was 'unset', now False" in capsys.readouterr().err
    assert main([*again, "--max-image-pixels", "1000000"]) == 2
    assert "max_image_pixels was 'unset', now 1000000" in capsys.readouterr().err
    assert main(again) == 0
    assert main([*argv, "-o", str(tmp_path / "b"), "--no-draft", "--limit", "2"]) == 0
    assert main([*argv, "-o", str(tmp_path / "b"), "--limit", "2", "--resume"]) == 2
    assert "draft was False, now 'unset'" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [[], ["--image-size", "32"]])
@pytest.mark.parametrize("name", ["nothere", "nothere/", "nothere.jsonl"])
def test_a_missing_folder_is_named_as_missing(
    tmp_path: Path,
    classifier: Path,
    capsys: pytest.CaptureFixture[str],
    name: str,
    flags: list[str],
) -> None:
    # before what the input holds decides anything: a mistyped path does not hold texts
    rc = main(["run", f"{tmp_path}/{name}", "--model", str(classifier), *flags])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"{name.rstrip('/')}: no such file or folder")
    assert len(err.splitlines()) == 1


@pytest.mark.parametrize("pixels", ["0", "-1"])
def test_a_pixel_limit_below_one_is_refused_not_the_default(
    tmp_path: Path, classifier: Path, capsys: pytest.CaptureFixture[str], pixels: str
) -> None:
    photo_folder(tmp_path / "photos", 1)
    argv = ["run", str(tmp_path / "photos"), "--model", str(classifier)]
    assert main([*argv, "--max-image-pixels", pixels, "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"--max-image-pixels must be >= 1, got {pixels}")
    assert not (tmp_path / "o").exists()


def test_a_script_without_a_main_guard_runs_an_image_job(tmp_path: Path, classifier: Path) -> None:
    photo_folder(tmp_path / "photos", 3)
    script = tmp_path / "job.py"
    script.write_text(
        "from pathlib import Path\n"
        "from batchline.jobs.options import RunOptions\n"
        "from batchline.jobs.run import run\n"
        f"summary = run(RunOptions(input=Path({str(tmp_path / 'photos')!r}), "
        f"output=Path({str(tmp_path / 'out')!r}), model={str(classifier)!r}))\n"
        "print('records', summary.records)\n"
    )  # no `if __name__ == "__main__"`: the decode workers must not import it again
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "records 3"


def test_picture_ref_reads_every_shape_a_column_holds(tmp_path: Path) -> None:
    from batchline.jobs.images import picture_ref
    from batchline.models.image import ImageRef

    assert picture_ref(b"abc", tmp_path) == ImageRef(data=b"abc")
    assert picture_ref("a/b.jpg", tmp_path) == ImageRef(path=str(tmp_path / "a" / "b.jpg"))
    assert picture_ref("/abs/c.jpg", tmp_path) == ImageRef(path="/abs/c.jpg")
    # Hugging Face datasets' Image feature: {"bytes", "path"}, the bytes first
    assert picture_ref({"bytes": b"xy", "path": "p.jpg"}, tmp_path) == ImageRef(data=b"xy")
    assert picture_ref({"bytes": None, "path": "p.jpg"}, tmp_path) == ImageRef(
        path=str(tmp_path / "p.jpg")
    )
    assert "empty or null" in str(picture_ref(None, tmp_path))
    assert "empty" in str(picture_ref(b"", tmp_path))
    assert "holds int" in str(picture_ref(7, tmp_path))
    for url in ("http://example.com/x.jpg", "s3://bucket/x.jpg"):
        assert picture_ref(url, tmp_path) == (
            f"{url} is a URL: run reads local files only (give the picture's path)"
        )


def test_a_url_in_a_path_column_is_named_as_given_not_as_a_missing_file(
    tmp_path: Path, classifier: Path
) -> None:
    photo_folder(tmp_path / "pics", 1)
    index = tmp_path / "paths.csv"
    index.write_text("id,path\na,pics/p00.jpg\nb,http://example.com/x.jpg\n")
    options = _options(index, classifier, tmp_path / "o", image_column="path", on_bad_record="skip")
    assert run(options).records == 1
    (skipped,) = read_skipped(tmp_path / "o")
    assert "http://example.com/x.jpg is a URL: run reads local files only" in skipped["reason"]
