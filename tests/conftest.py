from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# precision = auto measures the host and may choose bf16 or int8, whose vectors differ from
# fp32's in the last digits: the suite would pass on one host and fail on another. Every test,
# and every process it starts, resolves auto to fp32 (batchline.jobs.precision.AUTO_ENV) unless
# marked measure_precision; the choice logic itself is tested on synthetic hosts.
os.environ.setdefault("BATCHLINE_AUTO_PRECISION", "fp32")
# Many tests give a job a fresh cache folder; the compiled CPU kernel is the same for all of
# them. Every test, and every process it starts, keeps it in one folder of the machine's test
# cache (else the user's cache at the session's start): a subprocess job in a fresh cache
# compiled it again, ~45 s of a 120 s limit on two cores beside the other worker.
if "BATCHLINE_KERNEL_DIR" not in os.environ:
    from batchline._cache import kernel_dir

    _shared = os.environ.get("BATCHLINE_TEST_CACHE_DIR")
    os.environ["BATCHLINE_KERNEL_DIR"] = (
        os.path.join(_shared, "kernels") if _shared else str(kernel_dir())
    )


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _measure_precision_where_marked(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    if request.node.get_closest_marker("measure_precision") is not None:
        monkeypatch.delenv("BATCHLINE_AUTO_PRECISION", raising=False)


@pytest.fixture(autouse=True)
def _torch_threads_restored() -> Iterator[None]:
    """Each test leaves torch's intra-op thread count as it found it. A model loaded in float32
    sets every core (``engine_choices.engine_threads``), and the tests after it in the same
    xdist worker then ran on two threads beside the other worker's two: on CI's 2-core machine
    they collapse (a 135M model's 8-token reference ``generate`` passed pytest's 120 s
    timeout inside ``silu``, twice). torch is not imported for a test that does not."""
    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    yield
    torch = sys.modules.get("torch")
    if torch is not None and before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)


# The suite loads torch, ONNX Runtime, Ray's core worker, tokenizers and llguidance into one
# process; their native destructors can run in an order that crashes the interpreter's
# teardown after every test has passed (a SIGSEGV seen once in CI, exit 139 after "1324
# passed"). Once pytest has reported and written everything, leave with its own exit status
# and skip that teardown. BATCHLINE_TEST_FULL_TEARDOWN=1 keeps it, to hunt the crash.
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("BATCHLINE_TEST_FULL_TEARDOWN") == "1" or _EXIT_STATUS not in config.stash:
        return
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])
