from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A fresh cache folder for built models, set as BATCHLINE_CACHE_DIR for the whole session."""
    folder = tmp_path_factory.mktemp("batchline-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(folder))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield folder


@pytest.fixture(scope="session")
def minilm_path(model_cache: Path) -> Path:
    from batchline.models.onnx.minilm import default_model_path

    return default_model_path()
