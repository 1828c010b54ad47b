"""``module:factory`` models: the user's own Python behind the seam.

``factory()`` may return a ready :class:`~batchline.models.protocol.BatchModel`, or simply a
batch function ``list[record] -> list[result]`` (sync, run in a worker thread, or async), which
:class:`FunctionModel` wraps: each record reaches it whole (a dict of the input row's
columns), its cost is 1 unless the function has a ``cost(record) -> int`` attribute, and each
result is written as is (anything JSON can say; numpy arrays and scalars become lists and
numbers).

Example (``mymod.py``; then ``batchline run data.jsonl --model mymod:factory -o out``)::

    def factory():
        def score(records):
            return [{"length": len(r["text"])} for r in records]
        return score

:data:`PYTHON` is this kind's backend: its task is ``predict``, it cannot tell its memory
before the load, and its results have no identity (its code is not a file read as its
model), so they are never cached.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import cast

from batchline._errors import InputError
from batchline.models.backend import FP32, UNKNOWN, Backend, Footprint, Identity, Loaded
from batchline.models.config import Knobs
from batchline.models.protocol import BatchModel, ModelInfo, Task
from batchline.models.specs import ModelSpec, import_factory

__all__ = ["PYTHON", "FunctionModel", "as_model", "to_jsonable"]

BatchFn = Callable[[list[object]], Sequence[object] | Awaitable[Sequence[object]]]


class FunctionModel:
    """A batch function as a model: task ``predict``, whole records in, values out."""

    def __init__(
        self, fn: BatchFn, *, name: str, cost: Callable[[object], int] | None = None
    ) -> None:
        self._fn = fn
        self._cost = cost
        self._info = ModelInfo(
            name=name, task="predict", input_kind="record", result_column="result"
        )
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            getattr(fn, "__call__", None)  # noqa: B004
        )
        if self.is_async:
            self.run_batch = self._run_async  # type: ignore[method-assign,assignment]

    @property
    def info(self) -> ModelInfo:
        return self._info

    def prepare(self, inputs: Sequence[object]) -> list[object | BaseException]:
        return list(inputs)

    def cost(self, item: object) -> int:
        if self._cost is None:
            return 1
        value = self._cost(item)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise InputError(f"{self._info.name}: cost() must return an int >= 1, got {value!r}")
        return value

    def run_batch(self, batch: list[object]) -> Sequence[object]:
        return cast(Sequence[object], self._fn(batch))

    async def _run_async(self, batch: list[object]) -> Sequence[object]:
        return await cast(Awaitable[Sequence[object]], self._fn(batch))

    def encode(self, result: object) -> object:
        return to_jsonable(result)

    def close(self) -> None:
        close = getattr(self._fn, "close", None)
        if callable(close):
            close()


def as_model(made: object, *, name: str) -> BatchModel[object, object]:
    """What a factory returned, as a model: a model as is, a function wrapped."""
    if isinstance(made, BatchModel):
        return made
    if callable(made):
        cost = getattr(made, "cost", None)
        return FunctionModel(cast(BatchFn, made), name=name, cost=cost if callable(cost) else None)
    raise InputError(
        f"model {name!r}: the factory returned {type(made).__name__}; return a batch function "
        "(list of records -> list of results) or an object with info, prepare, cost, "
        "run_batch, encode and close (batchline.models.protocol.BatchModel)"
    )


def to_jsonable(value: object) -> object:
    """``value`` with numpy arrays and scalars turned into lists and numbers, recursively."""
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_jsonable(v) for v in value]
    tolist = getattr(value, "tolist", None)  # numpy arrays and scalars
    if callable(tolist):
        return tolist()
    raise InputError(
        f"a result of type {type(value).__name__} cannot be written out; return JSON-able "
        "values (dict, list, str, numbers, numpy arrays)"
    )


def _claims(spec: ModelSpec, knobs: Knobs) -> bool:
    return spec.kind == "python"


def _load(spec: ModelSpec, knobs: Knobs) -> Loaded:
    return as_model(import_factory(spec.source), name=spec.name)


def _footprint(spec: ModelSpec, knobs: Knobs, task: Task | None) -> Footprint:
    return UNKNOWN


def _identity(spec: ModelSpec, knobs: Knobs | None) -> Identity | None:
    return None


def _task(spec: ModelSpec) -> Task | None:
    return "predict" if spec.kind == "python" else None


def _precisions(spec: ModelSpec, task: Task) -> frozenset[str]:
    # a function computes as it likes: an embedder is let through in any precision, its knob
    # unread; other tasks take the default line
    return frozenset({"fp32", "bf16", "int8"}) if task == "embed" else FP32


PYTHON = Backend(
    name="python",
    claims=_claims,
    load=_load,
    footprint=_footprint,
    identity=_identity,
    task=_task,
    deterministic=False,
    precisions=_precisions,
)
