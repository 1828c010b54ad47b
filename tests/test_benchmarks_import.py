"""Every benchmark script imports, and says in its docstring what it measures: a name moved
inside the package breaks a script at its first line, long before anyone runs it at full size
(bench_images.py read a method that had moved, and the two image benchmarks built on it could
not start)."""

from __future__ import annotations

import pytest

from .benchmark_scripts import BENCHMARKS, load_benchmark


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_the_benchmark_imports(script: str, monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark(script, monkeypatch)
    assert module.__doc__, f"{script} says what it measures and how to run it in its docstring"
