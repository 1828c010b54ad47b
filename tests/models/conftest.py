from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("onnxruntime")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def _model_cache_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batchline-cache")


@pytest.fixture
def model_cache(_model_cache_folder: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The session's fresh cache folder for built models, set as BATCHLINE_CACHE_DIR for this
    test only: a session-long setting would reach whichever tests a worker runs next."""
    monkeypatch.setenv("BATCHLINE_CACHE_DIR", str(_model_cache_folder))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return _model_cache_folder


@pytest.fixture(scope="session")
def minilm_path(_model_cache_folder: Path) -> Path:
    """The MiniLM graph, built once a session into the fresh cache folder."""
    from batchline.models.onnx.minilm import default_model_path

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(_model_cache_folder))
        mp.setenv("HF_HUB_OFFLINE", "1")
        return default_model_path()
