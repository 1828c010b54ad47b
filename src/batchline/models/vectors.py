"""What callers do to an embedding model's vectors after the model: Matryoshka truncation
(OpenAI's ``dimensions``), for ``/v1/embeddings`` and OpenAI batch files alike. numpy only."""

from __future__ import annotations

import numpy as np

from batchline._types import Vector

__all__ = ["shorten"]


def shorten(vector: Vector, dimensions: int) -> Vector:
    """The first ``dimensions`` of ``vector``, L2-normalized again (a zero vector stays zero).

    Meaningful for models trained for it (Matryoshka embeddings); any model's vector can be
    cut, as OpenAI's API does.
    """
    if dimensions < 1:
        raise ValueError(f"dimensions must be >= 1, got {dimensions}")
    head = np.asarray(vector[:dimensions], dtype=np.float32)
    norm = float(np.linalg.norm(head))
    return head / np.float32(norm) if norm > 0 else head
