from __future__ import annotations

from typing import Any

import pytest

from batchline._clock import ManualClock


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def clock() -> ManualClock:
    """The endpoint pool's manual clock (routing and set-aside tests)."""
    return ManualClock()


@pytest.fixture
def prober(clock: ManualClock) -> Any:
    """test_endpoints' fake ``/ready`` prober on that clock."""
    from tests.driver.test_endpoints import Prober

    return Prober(clock)
