"""Every benchmark script imports, and says in its docstring what it measures: a name moved
inside the package breaks a script at its first line, long before anyone runs it at full size
(bench_images.py read a method that had moved, and the two image benchmarks built on it could
not start)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_benchmark_imports(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    name = f"_benchmark_{script[:-3]}"
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / script)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{script} says what it measures and how to run it in its docstring"
