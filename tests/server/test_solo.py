"""What serve was tuned with, kept by the engine layer: a lone batch takes the wide (solo)
session and overlapping ones the narrow, and the model's threads run at a lower priority."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from batchline.models.batching import ModelBatcher, lower_thread_priority
from batchline.models.onnx.embed import TextEmbedder

from .conftest import FakeEmbedder, settings


def test_lone_batches_go_wide_and_overlapping_ones_narrow() -> None:
    narrow, wide = FakeEmbedder(), FakeEmbedder(gated=True)
    emb = TextEmbedder(narrow, name="fake", solo=wide)  # type: ignore[arg-type]
    assert emb.dim == narrow.dim
    toks: Any = emb.prepare(["one two", "three"])

    first = threading.Thread(target=emb.run_batch, args=(toks[:1],))
    first.start()
    for _ in range(1000):  # bounded wait until the first batch is inside the wide session
        if emb.solo_batches == 1:
            break
        time.sleep(0.005)
    out = emb.run_batch(toks[1:])  # starts while the first runs: narrow, not blocked
    assert len(out) == 1
    assert narrow.batches == [[len(toks[1])]]
    wide.gate.set()
    first.join(timeout=30)
    assert wide.batches == [[len(toks[0])]]

    emb.run_batch(toks)  # nothing else running: wide again
    assert (emb.solo_batches, emb.shared_batches) == (2, 1)
    assert wide.batches[-1] == [len(t) for t in toks]


def test_serve_defaults_keep_the_solo_session_and_the_nice_threads() -> None:
    s = settings()
    assert s.knobs.solo_intra_op_threads == 2
    assert s.model_thread_nice == 5
    assert s.knobs.target_batch_tokens == 256
    assert s.knobs.max_batch_size == 64


def test_model_threads_can_step_back_for_the_event_loop() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("nice is per thread on Linux only")
    seen: list[tuple[int, int]] = []

    def work() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        lower_thread_priority(3)
        seen.append((before, os.getpriority(os.PRIO_PROCESS, tid)))

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    ((before, after),) = seen
    assert after == min(19, before + 3)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert main == before  # only that thread changed


@pytest.mark.anyio
async def test_the_engine_runs_a_sync_model_on_niced_threads() -> None:
    if not sys.platform.startswith("linux"):
        pytest.skip("nice is per thread on Linux only")
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    seen: list[int] = []

    class Probe(TextEmbedder):
        def run_batch(self, batch: list[Any]) -> list[Any]:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return super().run_batch(batch)

    model = Probe(FakeEmbedder(), name="fake")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="thread_nice"):
        ModelBatcher(model, settings().knobs, thread_nice=-1)
    async with ModelBatcher(model, settings().knobs, thread_nice=4) as engine:
        futures = engine.submit_many_nowait(model.prepare(["a b", "c"]))  # type: ignore[arg-type]
        for f in futures:
            await f
    assert seen
    assert all(p == min(19, main + 4) for p in seen)
