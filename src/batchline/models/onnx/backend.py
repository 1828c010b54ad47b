"""The ONNX backend: the built-in embedder and any ``PATH.onnx`` (or a folder's
``model.onnx``), loaded for its task: ``embed``, ``classify``, ``score`` or ``predict``.

A file that names no task says it in its graph (:func:`graph_task`). The memory rule
(:func:`onnx_footprint`) is the one other backends that run ONNX sessions use too.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import ModelError
from batchline.models.backend import FP32, Backend, Footprint, Identity, Loaded, text_input
from batchline.models.builtin import BUILTIN_MODELS
from batchline.models.common.files import size, tree
from batchline.models.onnx.options import SessionOptions
from batchline.models.protocol import Task
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["ONNX", "graph_task", "onnx_footprint", "onnx_identity"]

logger = logging.getLogger("batchline.models")

_MIB = 1 << 20
#: An ONNX model's memory beside its graph's copies: tokenizer and session arenas for a text
#: model, arenas for a tensor model (measured: ``models/footprint.py``).
TEXT_EXTRA_BYTES = 70 * _MIB
TENSOR_EXTRA_BYTES = 8 * _MIB


def graph_task(spec: ModelSpec) -> Task | None:
    """An ``.onnx`` file's task, read off its graph: no ``input_ids`` input → predict (but one
    4-D input of a spec that reads pictures, ``spec.image``, is an image model's); else
    classify when an output is named ``logits``, labels are given or a ``config.json`` with
    ``id2label`` sits beside it; else embed. ``None`` for a spec of another kind."""
    if spec.kind != "onnx":
        return None
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
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and bool(data.get("id2label"))


def _claims(spec: ModelSpec, knobs: SessionOptions) -> bool:
    return spec.kind in ("builtin", "onnx") and not spec.generates


def _load(spec: ModelSpec, knobs: SessionOptions) -> Loaded:
    if spec.folder is not None:  # a folder holding model.onnx
        logger.info("%s: %s -> ONNX (the folder's own file)", spec.name, spec.folder.describe())
    if spec.task == "embed":
        from batchline.models.onnx.embed import load_embedder

        return load_embedder(spec, knobs)
    if spec.task == "classify":
        from batchline.models.onnx.classify import load_classifier

        return load_classifier(spec, knobs)
    if spec.task == "score":
        from batchline.models.onnx.score import load_scorer

        return load_scorer(spec, knobs)
    from batchline.models.onnx.predict import load_predictor

    return load_predictor(spec, knobs)


def onnx_footprint(
    graph_bytes: int, knobs: SessionOptions, task: Task | None, *, text: bool
) -> Footprint:
    """A model of ONNX sessions: one copy of its graph per session (a text embedder's solo
    session counted), plus its tokenizer and arenas (``text``) or its arenas alone; the peak
    adds a quarter of the graph. Zeros for a graph that is not there yet."""
    if not graph_bytes:
        return Footprint(0, 0)
    sessions = knobs.sessions if knobs.batching else 1
    if task == "embed" and knobs.batching and knobs.solo_intra_op_threads:
        sessions += 1  # an embedder's solo session (models/onnx/embed.py)
    steady = graph_bytes * sessions + (TEXT_EXTRA_BYTES if text else TENSOR_EXTRA_BYTES)
    return Footprint(steady, steady + graph_bytes // 4, "onnx")


def _footprint(spec: ModelSpec, knobs: SessionOptions, task: Task | None) -> Footprint:
    return onnx_footprint(size(_graph(spec)), knobs, task, text=task != "predict")


def _graph(spec: ModelSpec) -> Path | None:
    if spec.kind == "builtin":
        try:
            from batchline.models.onnx.minilm import weights_dir

            return weights_dir() / "model.safetensors"  # the graph holds these, as float32
        except Exception:  # the weights package is missing: the load will say so
            return None
    return spec.path


def onnx_identity(spec: ModelSpec, knobs: SessionOptions | None) -> Identity:
    """A built-in model's package files, or an ``.onnx`` file and the tokenizer beside it (or
    the one its spec names)."""
    if spec.kind == "builtin":
        return Identity(tuple(tree(BUILTIN_MODELS[spec.source].package_dir())))
    tokenizer = spec.tokenizer or spec.path.with_name("tokenizer.json")
    files = (spec.path, tokenizer) if tokenizer.is_file() else (spec.path,)
    return Identity(files)


def _tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """The built-in text models' tokenizer, an ``.onnx`` text model's (:func:`tokenizer_path`),
    or the one the spec of another ``.onnx`` names."""
    from batchline.models.common.minilm import MAX_LENGTH, weights_dir
    from batchline.models.onnx.embedder import load_tokenizer
    from batchline.models.onnx.sessions import tokenizer_path

    path: Path | None = None
    max_length: int | None = None
    if spec.kind == "builtin" and spec.builtin_task in ("embed", "classify"):
        path, max_length = weights_dir() / "tokenizer.json", MAX_LENGTH
    elif spec.kind == "onnx" and (spec.task or graph_task(spec)) in ("embed", "classify"):
        path = tokenizer_path(spec)
    elif spec.kind == "onnx" and spec.tokenizer is not None:
        path = Path(spec.tokenizer)
    if path is None:
        return None
    tokenizer, _ = load_tokenizer(path, max_length=max_length)
    return tokenizer


def _precisions(spec: ModelSpec, task: Task) -> frozenset[str]:
    """An embedder in int8 too (its graph quantized, ``embed.py``); bf16 is torch's, from
    weights (the torch-bf16 backend's for the built-in encoder)."""
    return frozenset({"fp32", "int8"}) if task == "embed" else FP32


ONNX = Backend(
    name="onnx",
    claims=_claims,
    load=_load,
    footprint=_footprint,
    identity=onnx_identity,
    task=graph_task,
    tokenizer=_tokenizer,
    precisions=_precisions,
    input_kind=text_input,
)
