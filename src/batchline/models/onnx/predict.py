"""``predict``: any ONNX model, tensors in, tensors out (an image classifier, a regressor, ...).

:class:`OnnxPredictor` is the :class:`~batchline.models.protocol.BatchModel` for a model whose
every input and output has a dynamic first (batch) dimension. A record is one row: a mapping
of input name to that row's array, the batch axis left out (a model with one input also takes
a bare array). ``prepare`` checks each row against the model (names, element type, shape),
so a bad row fails alone; a batch stacks its rows, and rows whose dynamic dimensions differ
run as separate model calls, never padded together. Each result is ``{output name: the row's
array}`` in the model's element type: a float32 output stays float32 in a Parquet output
(``batchline.datasets.columns``) and becomes JSON numbers only where JSON is written.

Element types: a row is cast to the input's type when no value changes (ints and bools to
floats; floats with whole values, and ints in range, to ints; float64 to float32 unless a
finite value overflows); anything else is refused, naming the input.

Example::

    model = load_predictor(parse_spec("resnet.onnx"), knobs)
    (row,) = model.prepare([{"input": np.zeros((3, 224, 224), np.float32)}])
    (result,) = model.run_batch([row])        # {"logits": array of shape (1000,)}
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from batchline._errors import InputError, ModelError
from batchline._types import Array
from batchline.models.onnx.options import SessionOptions
from batchline.models.onnx.runtime import OnnxModel, OnnxTensor, stack_equal
from batchline.models.onnx.sessions import SessionModel, load_sessions_at
from batchline.models.protocol import ModelInfo
from batchline.models.specs import ModelSpec

__all__ = ["OnnxPredictor", "TensorRow", "load_predictor"]


@dataclass(frozen=True, slots=True, eq=False)
class TensorRow:
    """One prepared record: input name → that row's array, in the model's element types."""

    arrays: Mapping[str, Array]

    @property
    def shapes(self) -> tuple[tuple[int, ...], ...]:
        """The row's shapes, input by input: rows stack together only when these are equal."""
        return tuple(a.shape for a in self.arrays.values())


class OnnxPredictor(SessionModel):
    """An ONNX model as a batch model (task ``predict``): rows of named tensors in and out.

    The model's batch axis must be dynamic (:meth:`OnnxModel.load` checks it at load and
    says how to re-export a model where it is not).
    """

    def __init__(self, model: OnnxModel, *, name: str) -> None:
        self.model = model
        self._inputs = {spec.name: spec for spec in model.inputs}
        # resolved once, here: an element type batchline cannot feed fails at load
        self._dtypes = {spec.name: spec.dtype for spec in model.inputs}
        self._info = ModelInfo(
            name=name,
            task="predict",
            input_kind="tensors",
            cost_kind="additive",
            result_kind="tensors",
            result_column="outputs",
            details={
                "inputs": [s.spec().as_dict() for s in model.inputs],
                "outputs": [s.spec().as_dict() for s in model.outputs],
            },
        )

    def prepare(self, inputs: Sequence[object]) -> list[TensorRow | BaseException]:
        """Check and cast each row; a row that does not fit is an ``InputError`` of its own."""
        out: list[TensorRow | BaseException] = []
        for value in inputs:
            try:
                out.append(self.prepare_one(value))
            except InputError as exc:
                out.append(exc)
        return out

    def prepare_one(self, value: object) -> TensorRow:
        """One row as a :class:`TensorRow`; raises ``InputError`` saying what does not fit."""
        names = list(self._inputs)
        if isinstance(value, Mapping):
            given = {str(k): v for k, v in value.items()}
        elif len(names) == 1 and not isinstance(value, str | bytes):
            given = {names[0]: value}
        else:
            raise InputError(
                f"{self.model.path.name} takes the inputs {names}: pass each row as a mapping "
                f"of input name to array, got {type(value).__name__}"
            )
        missing = [n for n in names if n not in given]
        unknown = [n for n in given if n not in self._inputs]
        if missing or unknown:
            parts = [f"missing {missing}"] if missing else []
            parts += [f"unknown {unknown}"] if unknown else []
            raise InputError(
                f"the row's inputs do not match {self.model.path.name}: {'; '.join(parts)}; "
                f"the model takes {names}"
            )
        return TensorRow({n: self._check(self._inputs[n], given[n]) for n in names})

    def _check(self, spec: OnnxTensor, value: object) -> Array:
        try:
            arr = np.asarray(value)
        except ValueError as exc:  # a ragged nested list
            raise InputError(f"input '{spec.name}' is not a rectangular array: {exc}") from None
        fixed = [d if isinstance(d, int) and d >= 0 else None for d in spec.shape[1:]]
        shown = [d if d is not None else "any" for d in fixed]
        fits = arr.ndim == len(fixed) and all(
            want is None or want == got for want, got in zip(fixed, arr.shape, strict=True)
        )
        if not fits:
            hint = ""
            if arr.ndim == len(fixed) + 1 and arr.shape[0] == 1:
                hint = "; a row leaves the batch axis out"
            raise InputError(
                f"input '{spec.name}' takes rows of shape {shown} (the batch axis left out), "
                f"got {list(arr.shape)}{hint}"
            )
        return _cast(spec.name, arr, self._dtypes[spec.name])

    def cost(self, item: TensorRow) -> int:
        return 1

    def run_batch(self, batch: list[TensorRow]) -> list[dict[str, Array]]:
        """Stack rows of equal shapes into one model call each (rows differing in a dynamic
        dimension are not padded together); results in the batch's order."""
        groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
        for i, row in enumerate(batch):
            groups.setdefault(row.shapes, []).append(i)
        results: list[dict[str, Array]] = [{} for _ in batch]
        for members in groups.values():
            feeds = {
                name: stack_equal([batch[i].arrays[name] for i in members]) for name in self._inputs
            }
            outputs = self.model.run(feeds)
            for name, out in outputs.items():
                if out.ndim == 0 or out.shape[0] != len(members):
                    raise ModelError(
                        f"{self.model.path.name} returned output '{name}' of shape "
                        f"{list(out.shape)} for {len(members)} rows; each output needs one "
                        "row per input row"
                    )
                for j, i in enumerate(members):
                    results[i][name] = out[j]
        return results

    def __repr__(self) -> str:
        return f"OnnxPredictor({self.model.path.name!r}, inputs={list(self._inputs)})"


def _cast(name: str, arr: Array, dtype: np.dtype[np.generic]) -> Array:
    """``arr`` as ``dtype`` when no value changes; else an ``InputError`` naming the input."""
    if arr.dtype == dtype:
        return arr
    src, dst = arr.dtype.kind, dtype.kind
    refused = InputError(
        f"input '{name}' takes {dtype.name} values, got {arr.dtype.name}"
        + (" values that would change when cast" if src in "biuf" and dst in "biuf" else "")
    )
    if dst == "O":  # string tensors
        if src in "UO":
            return arr.astype(object)
        raise refused
    if src not in "biuf" or dst not in "biuf":
        raise refused
    with np.errstate(all="ignore"):
        cast = arr.astype(dtype)
    if dst == "f":
        # float64 -> float32 rounds (expected of float inputs), but must not overflow to inf
        if np.any(np.isfinite(arr) & ~np.isfinite(cast)):
            raise refused
        return cast
    # ints and bools: only when every value survives the round trip (no fraction, no overflow)
    with np.errstate(all="ignore"):
        same = np.array_equal(cast.astype(arr.dtype), arr)
    if not same:
        raise refused
    return cast


def load_predictor(spec: ModelSpec, knobs: SessionOptions) -> OnnxPredictor:
    """Load any ``.onnx`` model laid out as ``knobs`` say (``task="predict"``).

    Batching: ``knobs.sessions`` sessions of ``knobs.intra_op_threads`` threads; the baseline
    (``batching=False``): one session every caller shares. A model with a fixed batch
    dimension is refused with :class:`~batchline.FixedBatchAxisError`, which says how to
    re-export it.
    """
    if spec.tokenizer is not None:
        raise InputError(
            f"model {spec.name!r}: a tokenizer goes with the embed and classify tasks, not "
            "predict (tensors in, tensors out)"
        )
    return OnnxPredictor(load_sessions_at(spec.path, knobs), name=spec.name)
