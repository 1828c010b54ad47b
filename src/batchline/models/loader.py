"""``load_model``: a :class:`~batchline.models.specs.ModelSpec` and the knobs, to a loaded
:class:`~batchline.models.protocol.BatchModel` laid out for batching or for the baseline.

This module resolves the task (:func:`resolve_task`) and asks the registry
(:data:`batchline.models.registry.BACKENDS`) for the first backend that claims the spec; each
backend loads its models in its own package (``models/function.py``, ``models/onnx/``,
``models/hf/``, ``models/image/``), laid out from :class:`~batchline.models.config.Knobs` (batching:
``sessions`` sessions of ``intra_op_threads`` threads, plus a solo session when
``solo_intra_op_threads`` is set; the baseline, ``batching=False``: one session every caller
shares). Every layer that needs a model (``run``, ``serve``, ``bench``, ``tune``, Ray) loads
it here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.onnx import tokenizer_path
from batchline.models.protocol import BatchModel, InputKind, Task
from batchline.models.registry import BACKENDS
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# tokenizer_path is the onnx backend's; named here too, as the spec's other resolver
__all__ = [
    "deterministic",
    "input_kind",
    "load_model",
    "resolve_task",
    "text_tokenizer",
    "tokenizer_path",
]

AnyModel = BatchModel[object, object]


def resolve_task(spec: ModelSpec) -> Task:
    """The spec's task: given (for a ``PATH/`` folder: detected at parse time, or its
    ``--task``), the built-in model's, or the one the first backend that can tell reads off
    it (``module:factory`` → predict; an ``.onnx`` file: its graph says,
    :func:`batchline.models.onnx.graph_task`)."""
    if spec.task is not None:
        return spec.task
    if spec.builtin_task is not None:
        return spec.builtin_task
    task = BACKENDS.task(spec)
    if task is None:
        raise ModelError(f"model {spec.name!r} ({spec.source}): its task is unknown; pass --task")
    return task


def text_tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """The ``tokenizers`` tokenizer a text model's spec reads its texts with, as the backend
    that claims it says (the built-in text models', an ONNX text model's or the one its spec
    names), or ``None`` for a model that takes no text: what a benchmark cuts and counts its
    texts with."""
    return BACKENDS.claiming(spec, Knobs()).tokenizer(spec)


def input_kind(spec: ModelSpec) -> InputKind | None:
    """What the model of ``spec`` takes (texts, pictures, named tensors, records), as the
    backend that claims it tells without loading it; ``None``: only its load tells (a
    ``module:factory``)."""
    task = resolve_task(spec)
    resolved = dataclasses.replace(spec, task=task)
    return BACKENDS.claiming(resolved, Knobs()).input_kind(resolved, task)


def deterministic(spec: ModelSpec, knobs: Knobs) -> bool:
    """Whether the backend that claims ``spec`` gives results that are a function of their
    input alone (``Backend.deterministic``): what a job answers duplicates by."""
    return BACKENDS.claiming(spec, knobs).deterministic


def load_model(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    """Load ``spec`` laid out as ``knobs`` say: the first registered backend that claims it,
    its task resolved (see the module docstring), in a precision the backend computes it in
    (``Backend.precisions``; another is an ``InputError`` in the backend's words)."""
    task = resolve_task(spec)
    resolved = dataclasses.replace(spec, task=task)
    backend = BACKENDS.claiming(resolved, knobs)
    # auto is resolved before the load (jobs/precision.py); here it loads fp32
    if knobs.precision != "auto" and knobs.precision not in backend.precisions(resolved, task):
        raise InputError(backend.refusal(resolved, task, knobs))
    return backend.load(resolved, knobs)
