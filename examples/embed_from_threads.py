"""Embed texts from ordinary threads with the default model (needs batchline[onnx]).

A ``TokenBatcher`` runs the embedder's batch stage (``embed_tokens``), and ``SyncBatcher``
runs that batcher on an event loop of its own, in a background thread; every worker thread
tokenizes its text, submits it there and blocks for the vector. Texts from different threads
meet in the one queue and share model calls: the run prints how many texts went into each
call on average.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from batchline import BatchStats, SyncBatcher, TokenBatcher
from batchline.models import Embedder

TOPICS = ["batch inference", "padding waste", "an idle GPU", "queue backpressure"]
FORMS = ["How do I measure {}?", "What causes {}?", "Why should I care about {}?"]
QUESTIONS = [form.format(topic) for topic in TOPICS for form in FORMS] * 2


def main() -> tuple[np.ndarray, BatchStats]:
    embedder = Embedder.default()
    token_batcher = TokenBatcher(
        lambda texts: list(embedder.embed_tokens(texts)),  # one padded batch, one session
        target_batch_tokens=512,  # padded tokens per model call
        max_concurrent_batches=embedder.model.sessions,
    )
    with SyncBatcher(token_batcher) as batcher:  # starts the batcher on its loop thread

        def ask(question: str) -> np.ndarray:
            (tokens,) = embedder.tokenize([question])
            return batcher.run(tokens)  # waits here while other threads' texts join the batch

        with ThreadPoolExecutor(8) as pool:
            matrix = np.stack(list(pool.map(ask, QUESTIONS)))
    stats = batcher.stats
    print(
        f"{len(QUESTIONS)} texts from 8 threads in {stats.total_batches} model calls: "
        f"{stats.avg_batch_size:.1f} texts per call"
    )
    print("similarity of the first three:")
    print(np.round(matrix[:3] @ matrix[:3].T, 2))
    return matrix, stats


if __name__ == "__main__":
    main()
