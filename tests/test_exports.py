"""Pins the public API: a name added or removed here is a deliberate change."""

from __future__ import annotations

import subprocess
import sys

import batchline

EXPECTED = [
    "BatchPolicy",
    "BatchProcessingError",
    "BatchSizeMismatchError",
    "BatchStats",
    "BatchTimeoutError",
    "BatcherClosedError",
    "BatchlineError",
    "Clock",
    "CostEstimator",
    "DeadlineExceededError",
    "Device",
    "DiskError",
    "DynamicBatcher",
    "EngineGoneError",
    "FixedBatchAxisError",
    "InputError",
    "LoopClock",
    "ManualClock",
    "ModelError",
    "ProcessFn",
    "Prompt",
    "QueueFullError",
    "RecordTooLargeError",
    "State",
    "SyncBatcher",
    "TokenBatcher",
    "TokenEstimator",
    "__version__",
]


def test_public_names_are_pinned_and_sorted() -> None:
    assert batchline.__all__ == EXPECTED
    for name in EXPECTED:
        assert hasattr(batchline, name)


def test_errors_form_one_tree() -> None:
    for name in EXPECTED:
        obj = getattr(batchline, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, batchline.BatchlineError), name


def test_import_batchline_loads_only_the_standard_library() -> None:
    code = (
        "import sys, batchline; heavy = {'numpy', 'onnxruntime', 'pyarrow', 'fastapi', 'ray',"
        " 'tokenizers', 'httpx', 'rich'}; print(sorted(heavy & set(sys.modules)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
