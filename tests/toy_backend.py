"""A toy backend, whole in this one module: what a new model kind writes to be served by
``run`` and ``serve``. Its specs are ``toy:NAME``; its model embeds a text as three counts
(characters, words, vowels), so a test knows every vector it must get back.

A test registers it for a ``with`` block (the one registration line)::

    with BACKENDS.registered(TOY):
        ...
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from batchline.knobs import Knobs
from batchline.models.backend import Backend, Footprint, Identity, Loaded
from batchline.models.protocol import ModelInfo, Task
from batchline.models.specs import ModelSpec

#: What the toy's footprint hook says, so that a test can see it was asked.
TOY_FOOTPRINT = Footprint(12_345, 23_456, "toy")


def toy_vector(text: str) -> np.ndarray[Any, Any]:
    """The vector the toy model gives ``text``: its characters, words and vowels."""
    vowels = sum(text.lower().count(v) for v in "aeiou")
    return np.array([len(text), len(text.split()), vowels], dtype=np.float32)


class ToyEmbedder:
    """Texts to three counts; a text costs its words (at least 1)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.batches: list[int] = []
        self.closed = False

    @property
    def info(self) -> ModelInfo:
        return ModelInfo(
            name=self.name,
            task="embed",
            result_kind="vector",
            result_column="embedding",
            details={"dim": 3},
        )

    def prepare(self, inputs: Sequence[object]) -> list[str | BaseException]:
        return [t if isinstance(t, str) else TypeError("the toy embeds texts") for t in inputs]

    def cost(self, item: str) -> int:
        return max(1, len(item.split()))

    def run_batch(self, batch: list[str]) -> list[np.ndarray[Any, Any]]:
        self.batches.append(len(batch))
        return [toy_vector(t) for t in batch]

    def encode(self, result: np.ndarray[Any, Any]) -> object:
        return result

    def close(self) -> None:
        self.closed = True


def _claims(spec: ModelSpec, knobs: Knobs) -> bool:
    return spec.source.startswith("toy:")


def _load(spec: ModelSpec, knobs: Knobs) -> Loaded:
    return ToyEmbedder(spec.name)


def _footprint(spec: ModelSpec, knobs: Knobs, task: Task | None) -> Footprint:
    return TOY_FOOTPRINT


def _identity(spec: ModelSpec, knobs: Knobs | None) -> Identity:
    return Identity(files=(), options={"toy": spec.source})


def _task(spec: ModelSpec) -> Task | None:
    return "embed" if spec.source.startswith("toy:") else None


TOY = Backend(
    name="toy", claims=_claims, load=_load, footprint=_footprint, identity=_identity, task=_task
)
