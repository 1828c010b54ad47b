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
from batchline.models.protocol import BatchModel, Task
from batchline.models.registry import BACKENDS
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# tokenizer_path is the onnx backend's; named here too, as the spec's other resolver
__all__ = ["deterministic", "load_model", "resolve_task", "text_tokenizer", "tokenizer_path"]

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


def deterministic(spec: ModelSpec, knobs: Knobs) -> bool:
    """Whether the backend that claims ``spec`` gives results that are a function of their
    input alone (``Backend.deterministic``): what a job answers duplicates by."""
    return BACKENDS.claiming(spec, knobs).deterministic


def load_model(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    """Load ``spec`` laid out as ``knobs`` say: the first registered backend that claims it,
    its task resolved (see the module docstring)."""
    task = resolve_task(spec)
    # an image folder's backend says itself what it runs in which precision
    image_folder = spec.folder is not None and spec.folder.image is not None
    if knobs.precision == "int8" and task != "embed" and not image_folder:
        if knobs.quantize is not None:
            raise InputError(
                f"--quantize {knobs.quantize} applies to embedding models; {spec.name!r} has "
                f"task {task!r}: leave --quantize out for it"
            )
        raise InputError(
            f"precision int8 applies to embedding models; {spec.name!r} has task "
            f"{task!r}: use precision auto, fp32 or bf16 for it"
        )
    if knobs.precision == "bf16" and task in ("classify", "score") and spec.kind != "hf":
        raise InputError(
            f"precision bf16 runs a {task} model from its Hugging Face folder's weights on "
            f"torch; {spec.name!r} ({spec.source}) is no such folder: use precision auto or "
            "fp32 for it"
        )
    if knobs.precision == "bf16" and task not in ("embed", "classify", "score"):
        raise InputError(
            f"precision bf16 applies to embedding, classify and score models; {spec.name!r} "
            f"has task {task!r}: use precision auto or fp32 for it"
        )
    resolved = dataclasses.replace(spec, task=task)
    return BACKENDS.claiming(resolved, knobs).load(resolved, knobs)
