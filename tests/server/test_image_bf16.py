"""``batchline serve`` of an image folder with ``--set precision=bf16``: the classifier runs on
torch in bfloat16, says so in its load line, and answers ``/v1/classify`` in infinity's shape
with the labels the fp32 model gives where they are clear."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("fastapi")

from batchline.__main__ import main
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_spec
from batchline.server import ServerSettings, create_app
from tests.models.image.conftest import build_folder, pictures

from .conftest import client_on

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module", autouse=True)
def _cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(tmp_path_factory.mktemp("image-cache")))
        yield


def _uri(picture: Any) -> str:
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def _config(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main([*argv, "--print-config"]) == 0
    data: dict[str, Any] = json.loads(capsys.readouterr().out)
    return data


async def test_serve_with_precision_bf16_classifies_on_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    folder = build_folder(tmp_path, "vit")
    config = _config(
        ["serve", "--model", f"vit={folder}/", "--sessions", "1", "--set", "precision=bf16"],
        capsys,
    )
    assert config["precision"] == "bf16"
    config["request_timeout_s"] = 60.0
    photos = pictures(6)
    fp32 = load_model(parse_spec(f"vit={folder}/"), Knobs(sessions=1, precision="fp32"))
    want = fp32.run_batch([fp32.preprocess(p) for p in photos])
    app = create_app(ServerSettings.model_validate(config))
    with caplog.at_level("INFO", logger="batchline.models"):
        async with client_on(app) as client:
            response = await client.post(
                "/v1/classify",
                json={"model": "vit", "input": [_uri(p) for p in photos], "modality": "image"},
            )
    assert response.status_code == 200, response.text
    got = response.json()["results"]
    assert len(got) == len(photos)
    assert "vit: image classifier" in caplog.text
    assert "-> torch (bf16)" in caplog.text
    assert "vit: precision bf16 on torch (asked for)" in caplog.text
    clear = 0
    for answer, expected in zip(got, want, strict=True):
        assert answer["score"] == pytest.approx(expected["score"], abs=0.03)
        ranked = sorted(expected["scores"].values(), reverse=True)
        if ranked[0] - ranked[1] > 0.06:  # clear: bf16 cannot move either that far
            assert answer["label"] == expected["label"]
            clear += 1
    assert clear >= 4
