"""``precision = "auto"`` for a text classifier's or a cross-encoder's folder: bf16 on torch
measured against fp32 on ONNX Runtime (:mod:`batchline.jobs.precision` makes the choice, keeps
it and says why, and times the candidates; this module gives the inputs and compares the
outputs).

- A classifier classifies the gate's demo-corpus texts; its label probabilities are compared
  with fp32's by mean cosine, its labels by top-1 agreement.
- A cross-encoder scores :data:`QUERIES` queries against :data:`DOCUMENTS` documents each (the
  demo corpus's texts: query ``i`` is text ``i``, its documents the texts that follow it);
  per query, its scores are compared with fp32's by the cosine of their deviations from the
  query's mean score (1: the same ranking and spacing), and the best document by top-1
  agreement.

The gate is :data:`~batchline.jobs.precision_gate.AUTO_GATE` (cosine 0.999, top-1 95 %), as
for an image classifier; the neighbours' overlap is an embedder's figure and is not measured.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from batchline.jobs.precision_gate import Figures

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["DOCUMENTS", "QUERIES", "compare", "gate_inputs", "rows"]

#: A cross-encoder's gate: this many queries, each against this many documents.
QUERIES = 32
DOCUMENTS = 16


def gate_inputs(task: str, texts: Sequence[str]) -> list[Any]:
    """What a ``task`` model runs at the gate: ``texts`` for a classifier; for a
    cross-encoder, ``[query, document]`` pairs of them (see the module docstring)."""
    if task == "classify":
        return list(texts)
    width = QUERIES + DOCUMENTS
    if len(texts) < width:
        raise ValueError(f"the cross-encoder's gate needs {width} texts, got {len(texts)}")
    return [[texts[q], texts[q + 1 + d]] for q in range(QUERIES) for d in range(DOCUMENTS)]


def rows(task: str, results: Sequence[Any]) -> npt.NDArray[np.float32]:
    """One batch's results as rows: a classifier's probabilities in its labels' order, a
    cross-encoder's one score each."""
    import numpy as np

    if task == "classify":
        labels = list(results[0]["scores"]) if results else []
        return np.array([[r["scores"][k] for k in labels] for r in results], dtype=np.float32)
    return np.array(results, dtype=np.float32).reshape(len(results), 1)


def compare(
    task: str, rate: float, want: npt.NDArray[np.float32], got: npt.NDArray[np.float32]
) -> Figures:
    """A candidate's :class:`Figures` from its rows ``got`` against fp32's ``want``."""
    import numpy as np

    if task == "score":  # one row of scores per query, centred on the query's mean
        want = want.reshape(-1, DOCUMENTS)
        got = got.reshape(-1, DOCUMENTS)
        want = want - want.mean(axis=1, keepdims=True)
        got = got - got.mean(axis=1, keepdims=True)
    size_want = np.linalg.norm(want, axis=1)
    size_got = np.linalg.norm(got, axis=1)
    # a row flat in both (every document scored alike) agrees; flat in one only does not
    flat_want, flat_got = size_want < 1e-12, size_got < 1e-12
    sizes = np.where(flat_want | flat_got, 1.0, size_want * size_got)
    cosines = np.where(
        flat_want | flat_got, (flat_want & flat_got).astype(float), (want * got).sum(1) / sizes
    )
    top1 = float(np.mean(want.argmax(axis=1) == got.argmax(axis=1)))
    return Figures(rate, float(np.mean(cosines)), None, top1_agreement=top1)
