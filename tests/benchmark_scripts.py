"""A script of ``benchmarks/`` loaded as a module, for the tests of its pieces."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(script: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """``benchmarks/<script>`` as the module ``_benchmark_<stem>``, with ``benchmarks/`` on the
    path (the scripts import their neighbours: ``_servers``, ``bench_vs_vllm``...) and the module
    in ``sys.modules`` (dataclasses look theirs up there); ``monkeypatch`` undoes both."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    name = f"_benchmark_{Path(script).stem}"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    return module
