"""``load_model``: a :class:`~batchline.models.specs.ModelSpec` and the knobs, to a loaded
:class:`~batchline.models.protocol.BatchModel` laid out for batching or for the baseline.

This module only resolves (the task, :func:`resolve_task`) and dispatches: each model kind
loads itself in its own module (``models/function.py``, ``models/onnx/{embed,classify,score,
predict}.py``, a Hugging Face encoder folder ``models/hf/load.py``, an image folder
``models/image/load.py``), laid out from
:class:`~batchline.knobs.Knobs` (batching: ``sessions``
sessions of ``intra_op_threads`` threads, plus a solo session when ``solo_intra_op_threads``
is set; the baseline, ``batching=False``: one session every caller shares). Every layer that
needs a model (``run``, ``serve``, ``bench``, ``tune``, Ray) loads it here.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import InputError, ModelError
from batchline.knobs import Knobs
from batchline.models.onnx.sessions import tokenizer_path
from batchline.models.protocol import BatchModel, Task
from batchline.models.specs import ModelSpec, import_factory

if TYPE_CHECKING:
    from tokenizers import Tokenizer

# tokenizer_path lives with the ONNX sessions; named here too, as the spec's other resolver
__all__ = ["load_model", "resolve_task", "text_tokenizer", "tokenizer_path"]

AnyModel = BatchModel[object, object]

logger = logging.getLogger("batchline.models")


def resolve_task(spec: ModelSpec) -> Task:
    """The spec's task: given (for a ``PATH/`` folder: detected at parse time, or its
    ``--task``), the built-in model's, or read off an ``.onnx`` file: no
    ``input_ids`` input → predict (but one 4-D input of a spec that reads pictures,
    ``spec.image``, is an image model's); else classify when an output is named ``logits``,
    labels are given or a ``config.json`` with ``id2label`` sits beside it; else embed.
    ``module:factory`` → predict."""
    if spec.task is not None:
        return spec.task
    if spec.builtin_task is not None:
        return spec.builtin_task
    if spec.kind == "python":
        return "predict"
    import onnx

    try:
        graph = onnx.load(str(spec.path), load_external_data=False).graph
    except Exception as exc:
        raise ModelError(f"{spec.path}: not a readable ONNX model: {exc}") from exc
    initializers = {i.name for i in graph.input if i.name in {t.name for t in graph.initializer}}
    inputs = [i for i in graph.input if i.name not in initializers]
    reads_pictures = spec.image is not None and len(inputs) == 1
    if reads_pictures:
        reads_pictures = len(inputs[0].type.tensor_type.shape.dim) == 4
    if "input_ids" not in {i.name for i in inputs} and not reads_pictures:
        return "predict"
    outputs = {o.name for o in graph.output}
    config = spec.path.with_name("config.json")
    if "logits" in outputs or spec.labels is not None or _has_id2label(config):
        return "classify"
    return "embed"


def _has_id2label(config: Path) -> bool:
    import json

    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("id2label"))


def text_tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """The ``tokenizers`` tokenizer a text model's spec reads its texts with (the built-in
    text models', an ONNX text model's or the one its spec names), or ``None`` for a model
    that takes no text: what a benchmark cuts and counts its texts with."""
    from batchline.models.onnx import minilm
    from batchline.models.onnx.embedder import load_tokenizer

    path: Path | None = None
    max_length: int | None = None
    if spec.kind == "builtin" and spec.builtin_task in ("embed", "classify"):
        path, max_length = minilm.weights_dir() / "tokenizer.json", minilm.MAX_LENGTH
    elif spec.kind == "onnx" and resolve_task(spec) in ("embed", "classify"):
        path = tokenizer_path(spec)
    elif spec.kind == "onnx" and spec.tokenizer is not None:
        path = Path(spec.tokenizer)
    if path is None:
        return None
    tokenizer, _ = load_tokenizer(path, max_length=max_length)
    return tokenizer


def load_model(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    """Load ``spec`` laid out as ``knobs`` say (see the module docstring)."""
    task = resolve_task(spec)
    if knobs.precision in ("bf16", "int8") and task != "embed":
        if knobs.quantize is not None:
            raise InputError(
                f"--quantize {knobs.quantize} applies to embedding models; {spec.name!r} has "
                f"task {task!r}: leave --quantize out for it"
            )
        raise InputError(
            f"precision {knobs.precision} applies to embedding models; {spec.name!r} has task "
            f"{task!r}: use precision auto or fp32 for it"
        )
    if task == "generate":
        raise InputError(
            f"model {spec.name!r} generates text: it is served by a text generator, not a "
            "batch function (batchline.models.generation)"
        )
    if spec.kind == "python":
        from batchline.models.function import as_model

        return as_model(import_factory(spec.source), name=spec.name)
    if spec.kind == "hf" and spec.folder is not None and spec.folder.image is not None:
        from batchline.models.image import load_image_folder

        return load_image_folder(spec.with_options(task=task), knobs)
    if spec.kind == "hf":
        from batchline.models.hf.load import load_folder_model

        return load_folder_model(spec.with_options(task=task), knobs)
    if spec.image is not None and task in ("embed", "classify"):  # an .onnx reading pictures
        from batchline.models.image.onnx_image import load_image_model

        return load_image_model(spec.with_options(task=task), knobs)  # type: ignore[return-value]
    if spec.folder is not None:  # a folder holding model.onnx
        logger.info("%s: %s -> ONNX (the folder's own file)", spec.name, spec.folder.describe())
    if task == "embed" and knobs.precision == "bf16":
        return _bf16_embedder(spec, knobs)
    if task == "embed":
        from batchline.models.onnx.embed import load_embedder

        return load_embedder(spec, knobs)  # type: ignore[return-value]
    if task == "classify":
        from batchline.models.onnx.classify import load_classifier

        return load_classifier(spec, knobs)  # type: ignore[return-value]
    if task == "score":
        from batchline.models.onnx.score import load_scorer

        return load_scorer(spec, knobs)  # type: ignore[return-value]
    from batchline.models.onnx.predict import load_predictor

    return load_predictor(spec, knobs)  # type: ignore[return-value]


def _bf16_embedder(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    """The built-in encoder in bf16, on torch from its weights package (an ``.onnx`` file has
    no weights torch can load)."""
    if spec.kind != "builtin":
        raise InputError(
            f"model {spec.name!r}: precision bf16 runs an encoder on torch from its weights, and "
            f"an .onnx file has none torch can load; use precision fp32 or int8, or a model folder"
        )
    from batchline.models.hf.load import load_torch_encoder
    from batchline.models.onnx import minilm

    logger.info("%s: all-MiniLM-L6-v2 -> torch (bf16)", spec.name)
    return load_torch_encoder(
        minilm.weights_dir(),
        name=spec.name,
        pooling=spec.pooling or "mean",
        normalize=True if spec.normalize is None else spec.normalize,
        max_length=minilm.MAX_LENGTH,
        knobs=knobs,
        what="the built-in encoder in bf16",
    )
