"""``batchline run photos/ --model FOLDER/`` end to end through the CLI, for every kind of
Hugging Face image folder: a classifier, CLIP's image tower, zero-shot labels, DINOv2, and a
folder holding its own ``model.onnx`` beside its processor config. Each output is checked
against the same model called directly on the same decoded pixels; texts given to a model
that reads pictures are refused once, up front."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline.__main__ import main
from batchline.models.config import Knobs
from batchline.models.image import decode_image
from batchline.models.loader import load_model
from batchline.models.specs import ModelSpec, parse_spec
from tests.models.image.conftest import build_folder, pictures

pytest.importorskip("pyarrow")
pytest.importorskip("torch")

KNOBS = Knobs(sessions=1, intra_op_threads=1)


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Seven pictures of mixed sizes and formats (the real photographs as JPEG), in a tree."""
    root = tmp_path_factory.mktemp("photos")
    (root / "more").mkdir()
    for i, picture in enumerate(pictures(7)):
        where = root / "more" if i % 2 else root
        picture.save(where / (f"p{i}.jpg" if i < 2 else f"p{i}.png"))
    return root


def _run(photos: Path, out: Path, *args: str) -> list[dict[str, Any]]:
    from batchline.datasets.sinks import read_output

    assert main(["run", f"{photos}/", "-o", str(out), "--quiet", *args]) == 0
    return sorted(read_output(out).to_pylist(), key=lambda row: str(row["id"]))


def _direct(spec: ModelSpec, photos: Path) -> dict[str, Any]:
    """The model of ``spec`` called on each picture as the decode workers prepare it."""
    model = load_model(spec, KNOBS)
    try:
        preprocess = getattr(model, "preprocess")  # noqa: B009 (an image model's attribute)
        ids = sorted(str(p.relative_to(photos)) for p in photos.rglob("p*.*"))
        draft = preprocess.draft_size()
        pixels = [preprocess(decode_image((photos / i).read_bytes(), draft=draft)) for i in ids]
        return dict(zip(ids, model.run_batch(model.prepare(pixels)), strict=True))
    finally:
        model.close()


def _same_labels(rows: list[dict[str, Any]], want: dict[str, Any]) -> None:
    assert [row["id"] for row in rows] == sorted(want)
    for row in rows:
        got, expected = row["classification"], want[row["id"]]
        assert got["label"] == expected["label"]
        assert got["score"] == pytest.approx(expected["score"], abs=1e-5)


def _same_vectors(rows: list[dict[str, Any]], want: dict[str, Any]) -> None:
    assert [row["id"] for row in rows] == sorted(want)
    got = np.array([row["embedding"] for row in rows], np.float32)
    expected = np.stack([want[row["id"]] for row in rows])
    assert got.shape == expected.shape
    assert np.abs(got - expected).max() <= 1e-5


def test_a_classifier_labels_every_picture_as_the_model_does(
    image_folders: Path, photos: Path, tmp_path: Path
) -> None:
    folder = build_folder(image_folders, "vit")
    rows = _run(photos, tmp_path / "out", "--model", f"{folder}/")
    _same_labels(rows, _direct(parse_spec(f"{folder}/"), photos))
    assert {row["classification"]["label"] for row in rows} <= {"tabby", "beagle", "sports car"}


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_a_two_tower_folder_embeds_pictures_with_its_image_tower(
    image_folders: Path, photos: Path, tmp_path: Path, family: str
) -> None:
    folder = build_folder(image_folders, family)
    rows = _run(photos, tmp_path / "out", "--model", f"{folder}/")
    spec = parse_spec(f"{folder}/").with_options(input_kind="image")
    _same_vectors(rows, _direct(spec, photos))


def test_labels_on_a_clip_folder_classify_pictures_zero_shot(
    image_folders: Path, photos: Path, tmp_path: Path
) -> None:
    folder = build_folder(image_folders, "clip")
    labels = "a cat,a dog,the red car"
    rows = _run(photos, tmp_path / "out", "--model", f"{folder}/", "--labels", labels)
    spec = parse_spec(f"{folder}/").with_options(labels=tuple(labels.split(",")))
    _same_labels(rows, _direct(spec, photos))
    assert {row["classification"]["label"] for row in rows} <= set(labels.split(","))


def _index(photos: Path, path: Path, column: str) -> Path:
    """A JSONL file beside ``photos`` naming each picture (by its path) in ``column``."""
    import json

    ids = sorted(str(p.relative_to(photos)) for p in photos.rglob("p*.*"))
    lines = [{"id": i, column: str(photos / i)} for i in ids]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def _run_file(data: Path, out: Path, *args: str) -> list[dict[str, Any]]:
    from batchline.datasets.sinks import read_output

    assert main(["run", str(data), "-o", str(out), "--quiet", *args]) == 0
    return sorted(read_output(out).to_pylist(), key=lambda row: str(row["id"]))


def test_an_image_folder_reads_a_files_image_column_when_none_is_named(
    image_folders: Path, photos: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    vit, clip = build_folder(image_folders, "vit"), build_folder(image_folders, "clip")
    index = _index(photos, tmp_path / "index.jsonl", "image")
    rows = _run_file(index, tmp_path / "vit", "--model", f"{vit}/")
    _same_labels(rows, _direct(parse_spec(f"{vit}/"), photos))
    # a two-tower folder embeds the column's pictures, and a file without one its texts
    rows = _run_file(index, tmp_path / "clip", "--model", f"{clip}/")
    _same_vectors(rows, _direct(parse_spec(f"{clip}/").with_options(input_kind="image"), photos))
    captions = tmp_path / "captions.jsonl"
    captions.write_text('{"id": "c0", "text": "a photo of a cat"}\n')
    (row,) = _run_file(captions, tmp_path / "texts", "--model", f"{clip}/")
    assert len(row["embedding"]) == 16
    # a file without the column: one line naming the flag and the columns it has
    other = _index(photos, tmp_path / "other.jsonl", "file")
    capsys.readouterr()
    assert main(["run", str(other), "--model", f"{vit}/", "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "no picture column 'image'" in err
    assert "'id', 'file'" in err
    assert "--image-column" in err
    assert not (tmp_path / "o").exists()


def test_dinov2_embeds_pictures(image_folders: Path, photos: Path, tmp_path: Path) -> None:
    folder = build_folder(image_folders, "dinov2")
    rows = _run(photos, tmp_path / "out", "--model", f"{folder}/")
    _same_vectors(rows, _direct(parse_spec(f"{folder}/"), photos))


def test_a_folder_with_its_own_model_onnx_is_preprocessed_as_its_config_says(
    image_folders: Path, image_cache: Path, photos: Path, tmp_path: Path
) -> None:
    hf = build_folder(image_folders, "vit")
    want = _direct(parse_spec(f"{hf}/"), photos)  # converts the folder once, into the cache
    (converted,) = (image_cache / "hf").glob("vit-*.onnx")
    folder = tmp_path / "vit-onnx"
    folder.mkdir()
    shutil.copy(converted, folder / "model.onnx")
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(hf / name, folder / name)
    rows = _run(photos, tmp_path / "out", "--model", f"{folder}/")
    # the ViT config resizes straight to 32 x 32 with mean/std 0.5; the plain-ONNX default
    # (shorter side to 37, crop, ImageNet's mean and std) would give other scores
    _same_labels(rows, want)


@pytest.mark.parametrize(
    ("family", "labels", "says"),
    [
        ("vit", None, "reads pictures: give a folder of pictures"),
        ("dinov2", None, "reads pictures: give a folder of pictures"),
        ("clip", "a cat,a dog", "leaving out --labels"),
    ],
)
def test_texts_on_a_model_that_reads_pictures_are_refused_in_one_line(
    image_folders: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    family: str,
    labels: str | None,
    says: str,
) -> None:
    folder = build_folder(image_folders, family)
    data = tmp_path / "texts.txt"
    data.write_text("a photo of a cat\nthe red car\n")
    out = tmp_path / "out"
    argv = ["run", str(data), "--model", f"{folder}/", "-o", str(out), "--quiet"]
    capsys.readouterr()
    assert main(argv + (["--labels", labels] if labels else [])) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "texts.txt holds texts" in err
    assert says in err
    assert not out.exists()


def test_a_missing_input_is_named_as_missing_not_as_texts(
    image_folders: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = build_folder(image_folders, "vit")
    capsys.readouterr()
    assert main(["run", f"{tmp_path}/photoz/", "--model", f"{folder}/", "--quiet"]) == 2
    assert capsys.readouterr().err.strip().endswith("photoz: no such file or folder")


def test_a_batch_file_s_embeddings_lines_carry_pictures_as_data_uris(
    image_folders: Path, photos: Path, tmp_path: Path
) -> None:
    import base64
    import json

    folder = build_folder(image_folders, "dinov2")
    want = {
        row["id"]: row["embedding"]
        for row in _run(photos, tmp_path / "run", "--model", f"{folder}/")
    }
    ids = sorted(want)

    def uri(i: str) -> str:
        return "data:image/png;base64," + base64.b64encode((photos / i).read_bytes()).decode()

    bodies = [
        {"input": [uri(ids[0]), uri(ids[1])], "modality": "image"},  # infinity's shape
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "image_url", "image_url": {"url": uri(ids[2])}}],
                }
            ]
        },
        {"input": ["https://example.com/cat.jpg"], "modality": "image"},
        {"input": ["a photo of a cat"]},  # a text for a model that reads pictures
    ]
    lines = [
        {
            "custom_id": f"r{k}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": "dino", **b},
        }
        for k, b in enumerate(bodies)
    ]
    src = tmp_path / "batch.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "answers.jsonl"
    assert main(["run", str(src), "--model", f"dino={folder}/", "-o", str(out), "--quiet"]) == 0
    answers = {a["custom_id"]: a for a in map(json.loads, out.read_text().splitlines())}
    got = [d["embedding"] for k in ("r0", "r1") for d in answers[k]["response"]["body"]["data"]]
    expected = np.array([want[i] for i in ids[:3]], np.float32)
    assert np.abs(np.array(got, np.float32) - expected).max() <= 1e-5
    assert "URLs are not fetched" in answers["r2"]["error"]["message"]
    assert "takes images" in answers["r3"]["error"]["message"]
