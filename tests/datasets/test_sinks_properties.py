"""Property: whatever the arrival order and wherever a run crashes, resuming gives every record
exactly once, as a row or as a skip."""

from __future__ import annotations

import os
import tempfile
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchline.datasets import sinks
from batchline.datasets.sinks import ChunkWriter, read_output, read_skipped


class Crash(Exception):
    """Stands for the process dying at this point."""


def crash_on_replace(at: int) -> Any:
    """An ``os.replace`` that dies on its ``at``-th call: midway through some commit."""
    calls = {"n": 0}
    real = os.replace

    def replace(src: Any, dst: Any) -> None:
        calls["n"] += 1
        if calls["n"] == at:
            raise Crash
        real(src, dst)

    return replace


@st.composite
def runs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(0, 40))
    return {
        "n": n,
        "chunk_size": draw(st.integers(1, 8)),
        "fmt": draw(st.sampled_from(["parquet", "jsonl"])),
        "skipped": draw(st.frozensets(st.integers(0, n - 1), max_size=n)) if n else frozenset(),
        # each interrupted run: its arrival order, how many arrive, and which os.replace dies
        "crashes": draw(
            st.lists(
                st.tuples(
                    st.permutations(range(n)),
                    st.integers(0, n),
                    st.none() | st.integers(1, 12),
                ),
                max_size=2,
            )
        ),
        "final_order": draw(st.permutations(range(n))),
    }


def feed(w: ChunkWriter, order: list[int], skipped: frozenset[int]) -> None:
    for i in order:
        if w.is_committed(i):
            continue
        if i in skipped:
            w.skip(i, f"r{i}", "bad")
        else:
            w.write(i, f"r{i}", np.full(3, i, dtype=np.float32))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(run=runs())
def test_resume_after_any_crash_is_exactly_once(run: dict[str, Any]) -> None:
    n, skipped = run["n"], run["skipped"]
    options = {"fmt": run["fmt"], "chunk_size": run["chunk_size"], "meta": {"input": "x"}}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        for order, arrivals, die_at in run["crashes"]:
            w = ChunkWriter(out, resume=True, **options)
            patch: AbstractContextManager[Any] = (
                mock.patch.object(sinks.os, "replace", crash_on_replace(die_at))
                if die_at is not None
                else nullcontext()
            )
            try:
                with patch:
                    feed(w, list(order)[:arrivals], skipped)
            except Crash:
                pass
            del w  # dropped as a killed process would drop it: no close, no finish

        w = ChunkWriter(out, resume=True, **options)
        feed(w, list(run["final_order"]), skipped)
        w.finish(n)

        table = read_output(out)
        kept = [i for i in range(n) if i not in skipped]
        assert table.column("index").to_pylist() == kept
        assert table.column("id").to_pylist() == [f"r{i}" for i in kept]
        assert [v[0] for v in table.column("embedding").to_pylist()] == [float(i) for i in kept]
        assert read_skipped(out) == [
            {"index": i, "id": f"r{i}", "reason": "bad"} for i in sorted(skipped)
        ]
        assert not [p for p in os.listdir(out) if p.endswith(".tmp")]
