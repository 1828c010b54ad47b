"""The measurement behind ``precision = "auto"`` (:mod:`batchline.jobs.precision` chooses,
keeps the answer and says why): each candidate loaded in the job's layout, timed on the gate's
inputs in two rounds (all of them, then every second one) that alternate the candidates, a
candidate's speed its better round, its outputs compared with fp32's.

The loop is one for texts, a classifier's or cross-encoder's inputs and pictures; what differs
is a :class:`Trial`: how the inputs are prepared, cut into batches and run, and how a
candidate's outputs compare (the pictures': :mod:`batchline.jobs.precision_pictures`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchline._errors import BatchlineError
from batchline.jobs.precision_gate import Figures
from batchline.models.config import Knobs
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

__all__ = ["TEXTS", "Trial", "measure", "prepared", "stacked", "token_batches"]


def stacked(results: Sequence[Any]) -> npt.NDArray[np.float32]:
    """One batch's vectors as rows."""
    import numpy as np

    return np.asarray(np.stack(results), dtype=np.float32)


def token_batches(items: Sequence[Any], knobs: Knobs) -> list[list[int]]:
    """``items``' indexes in length-sorted batches of at most ``target_batch_tokens`` padded
    tokens and ``max_batch_size`` items: how a job batches texts."""
    order = sorted(range(len(items)), key=lambda i: len(items[i]))
    groups: list[list[int]] = [[]]
    for i in order:
        current = groups[-1]
        over = (len(current) + 1) * len(items[i]) > knobs.target_batch_tokens
        if current and (over or len(current) >= knobs.max_batch_size):
            groups.append(current := [])
        current.append(i)
    return groups


def prepared(
    model: Any, inputs: Sequence[Any], *, refused: str = "input cannot be run"
) -> list[Any]:
    """``model``'s items for ``inputs``; one it cannot prepare is a ``BatchlineError`` (a gate
    input that ``refused``: its error)."""
    items: list[Any] = model.prepare(list(inputs))
    bad = next((x for x in items if isinstance(x, BaseException)), None)
    if bad is not None:
        raise BatchlineError(f"a gate {refused}: {bad}")
    return items


def _vectors(model: Any, batch: list[Any]) -> npt.NDArray[np.float32]:
    return stacked(model.run_batch(batch))


def _vector_figures(rate: float, want: Any, got: Any) -> Figures:
    from batchline.models.onnx import compare_vectors

    quality = compare_vectors(want, got)
    return Figures(rate, quality.mean_cosine, quality.top10_overlap)


@dataclass(frozen=True, slots=True)
class Trial:
    """How :func:`measure` runs a candidate on the gate's inputs and judges its outputs:

    - ``prepare(model, inputs)``: the items the model runs (an input it cannot prepare is an
      error); ``shared``: prepared once, by fp32's model, for every candidate (pictures: their
      preprocessing is the same in every precision), else by each candidate;
    - ``batches(items, knobs)``: the batches, as lists of indexes, the job's budget makes;
    - ``run(model, batch)``: one batch's outputs as rows (default: an embedder's vectors);
    - ``warm``: one untimed batch before a candidate's first round (oneDNN builds its kernels
      on the first);
    - ``compare(rate, fp32's rows, its rows)``: a candidate's figures (``None``: vectors'
      mean cosine and top-10 neighbours, fp32's own overlap 1.0).
    """

    prepare: Callable[[Any, Sequence[Any]], list[Any]] = prepared
    shared: bool = False
    batches: Callable[[Sequence[Any], Knobs], list[list[int]]] = token_batches
    run: Callable[[Any, list[Any]], npt.NDArray[np.float32]] = _vectors
    warm: bool = False
    compare: Callable[[float, Any, Any], Figures] | None = None


#: An embedder on texts: each candidate tokenizes them, in the job's token batches.
TEXTS = Trial()


class _ThisThreadsInfo(logging.Filter):
    """Drops the records below WARNING that one thread logs."""

    def __init__(self) -> None:
        super().__init__()
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or record.thread != self._thread


@contextlib.contextmanager
def _loads_unsaid() -> Iterator[None]:
    """A candidate's own load lines (``all-MiniLM-L6-v2 -> torch (bf16)``) left out while it
    loads to be measured: the measurement said what it loads, and the job's own load says its
    line after; a first run printed the chosen one's twice. Warnings still go out, and other
    threads' lines (``serve`` loading another model) are kept. A logger's filter sees only the
    records logged on it: the loaders say what they load on ``batchline.models`` itself (a
    child logger's lines would pass)."""
    models_log = logging.getLogger("batchline.models")
    unsaid = _ThisThreadsInfo()
    models_log.addFilter(unsaid)
    try:
        yield
    finally:
        models_log.removeFilter(unsaid)


def measure(
    spec: ModelSpec,
    knobs: Knobs,
    names: Sequence[str],
    inputs: Callable[[], Sequence[Any]],
    *,
    trial: Trial = TEXTS,
) -> dict[str, Figures]:
    """Each of ``names`` (``fp32`` first) loaded in ``knobs``' layout: its speed and its
    outputs against fp32's on ``inputs`` (texts, a cross-encoder's pairs, pictures), run as
    ``trial`` says (see the module docstring). A candidate that fails to load or run is kept
    with its error; fp32 failing raises."""
    from batchline.models.loader import load_model

    gate = list(inputs())
    models: dict[str, Any] = {}
    errors: dict[str, str] = {}
    try:
        for name in names:
            try:
                with _loads_unsaid():
                    models[name] = load_model(spec, knobs.replace(precision=name, quantize=None))
            except (BatchlineError, ImportError, OSError, RuntimeError) as exc:
                if name == "fp32":
                    raise
                errors[name] = f"did not load: {exc}"
        shared = trial.prepare(models["fp32"], gate) if trial.shared else None
        speed: dict[str, list[float]] = {name: [] for name in models}
        outputs: dict[str, npt.NDArray[np.float32]] = {}
        for half in (slice(None), slice(None, None, 2)):  # all of them, then every second
            for name, model in list(models.items()):
                try:
                    items = shared[half] if shared is not None else trial.prepare(model, gate[half])
                    warm = trial.warm and name not in outputs
                    got, rate = _timed_rows(model, items, knobs, trial, warm=warm)
                except Exception as exc:  # a backend's own error: the candidate is out
                    if name == "fp32":
                        raise
                    errors[name] = f"failed: {exc}"
                    models.pop(name).close()
                    continue
                speed[name].append(rate)
                outputs.setdefault(name, got)
    finally:
        for model in models.values():
            model.close()
    out = {"fp32": Figures(max(speed["fp32"]), top10_overlap=None if trial.compare else 1.0)}
    for name in names[1:]:
        if name in errors:
            out[name] = Figures(error=errors[name])
            continue
        figure = trial.compare or _vector_figures
        out[name] = figure(max(speed[name]), outputs["fp32"], outputs[name])
    return out


def _timed_rows(
    model: Any, items: Sequence[Any], knobs: Knobs, trial: Trial, *, warm: bool
) -> tuple[npt.NDArray[np.float32], float]:
    """``items``' output rows (in order) from ``model`` in ``trial``'s batches,
    ``max_concurrent_batches`` at a time (after one untimed batch when ``warm``), and the
    items/s of the model calls."""
    import numpy as np

    groups = trial.batches(items, knobs)
    workers = max(1, min(knobs.max_concurrent_batches, knobs.sessions if knobs.batching else 1))
    if warm:
        trial.run(model, [items[i] for i in groups[0]])
    out: npt.NDArray[np.float32] | None = None
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="precision") as pool:
        runs = pool.map(lambda g: (g, trial.run(model, [items[i] for i in g])), groups)
        for group, rows in runs:
            if out is None:
                out = np.zeros((len(items), rows.shape[1]), dtype=np.float32)
            out[group] = rows
    rate = len(items) / max(time.perf_counter() - start, 1e-9)
    assert out is not None
    return out, rate
