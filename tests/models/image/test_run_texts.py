"""``batchline run texts.txt --model clip/``: a text dataset goes through the text tower of a
CLIP folder, giving vectors of the pictures' space (the image datasets' side of ``run`` comes
with the decode pipeline)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from batchline.__main__ import main
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_spec
from tests.models.image.conftest import build_folder, pictures

pytest.importorskip("pyarrow")
pytest.importorskip("torch")


def test_run_embeds_texts_with_the_text_tower(image_folders: Path, tmp_path: Path) -> None:
    from batchline.datasets.sinks import read_output

    folder = build_folder(image_folders, "clip")
    texts = ["a photo of a cat", "the red car", "dog"]
    data = tmp_path / "captions.txt"
    data.write_text("\n".join(texts) + "\n")
    out = tmp_path / "out"
    assert main(["run", str(data), "--model", f"{folder}/", "-o", str(out), "--quiet"]) == 0
    got = np.array([row["embedding"] for row in read_output(out).to_pylist()], np.float32)
    knobs = Knobs(sessions=1, intra_op_threads=1)
    text_model = load_model(parse_spec(f"{folder}/"), knobs)
    want = np.stack(text_model.run_batch(text_model.prepare(texts)))
    assert np.abs(got - want).max() <= 1e-5
    # comparable with the pictures' vectors: unit vectors of the projection's width
    images = load_model(parse_spec(f"{folder}/").with_options(input_kind="image"), knobs)
    vectors = np.stack(images.run_batch([images.preprocess(p) for p in pictures(2)]))
    assert got.shape[1] == vectors.shape[1] == 16
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
