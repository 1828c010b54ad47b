from __future__ import annotations

import os

import pytest

# headless plotting, before anything imports matplotlib
os.environ.setdefault("MPLBACKEND", "Agg")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
