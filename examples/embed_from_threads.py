"""Embed texts from ordinary threads with the default model (needs batchline[onnx])."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from batchline.models import Embedder


def main() -> np.ndarray:
    embedder = Embedder.default()
    questions = ["How do I batch inference?", "What is padding waste?", "Why is the GPU idle?"]
    with ThreadPoolExecutor(3) as pool:
        vectors = list(pool.map(lambda q: embedder.embed_sync(q)[0], questions))
    matrix = np.stack(vectors)
    print(matrix.shape, np.round(matrix @ matrix.T, 2))
    return matrix


if __name__ == "__main__":
    main()
