"""SoloWideEmbedder: a lone batch takes the wide session, concurrent ones the narrow."""

from __future__ import annotations

import threading
import time

from batchline.server import SoloWideEmbedder

from .conftest import FakeEmbedder


def test_lone_batches_go_wide_and_overlapping_ones_narrow() -> None:
    narrow, wide = FakeEmbedder(), FakeEmbedder(gated=True)
    emb = SoloWideEmbedder(narrow, wide)
    assert emb.dim == narrow.dim
    assert emb.tokenizer is narrow.tokenizer
    toks = emb.tokenize(["one two", "three"])

    first = threading.Thread(target=emb.embed_tokens, args=(toks[:1],))
    first.start()
    for _ in range(1000):  # bounded wait until the first batch is inside the wide session
        if emb.solo_batches == 1:
            break
        time.sleep(0.005)
    out = emb.embed_tokens(toks[1:])  # starts while the first runs: narrow, not blocked
    assert out.shape == (1, narrow.dim)
    assert narrow.batches == [[len(toks[1])]]
    wide.gate.set()
    first.join(timeout=30)
    assert wide.batches == [[len(toks[0])]]

    emb.embed_tokens(toks)  # nothing else running: wide again
    assert (emb.solo_batches, emb.shared_batches) == (2, 1)
    assert wide.batches[-1] == [len(t) for t in toks]


def test_model_threads_can_step_back_for_the_event_loop() -> None:
    import os
    import sys

    from batchline.server.state import _lower_thread_priority

    if not sys.platform.startswith("linux"):
        return
    seen: list[tuple[int, int]] = []

    def work() -> None:
        tid = threading.get_native_id()
        before = os.getpriority(os.PRIO_PROCESS, tid)
        _lower_thread_priority(3)
        seen.append((before, os.getpriority(os.PRIO_PROCESS, tid)))

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=30)
    ((before, after),) = seen
    assert after == min(19, before + 3)
    main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert main == before  # only that thread changed
