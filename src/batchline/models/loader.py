"""``load_model``: a :class:`~batchline.models.specs.ModelSpec` and the knobs, to a loaded
:class:`~batchline.models.protocol.BatchModel` laid out for batching or for the baseline.

Layout from :class:`~batchline.knobs.Knobs`: batching gets ``sessions`` sessions of
``intra_op_threads`` threads (one per batch in flight) on ``device``, plus a solo session when
``solo_intra_op_threads`` is set; the baseline (``batching=False``) gets one session that
every caller uses at once, with ``intra_op_threads`` threads. Every layer that needs a model
(``run``, ``serve``, ``bench``, ``tune``, Ray) loads it here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchline._errors import InputError, ModelError
from batchline.knobs import Knobs
from batchline.models.protocol import BatchModel, Task
from batchline.models.specs import ModelSpec, import_factory

__all__ = ["load_model", "load_sessions", "resolve_task", "tokenizer_path"]

AnyModel = BatchModel[object, object]


def resolve_task(spec: ModelSpec) -> Task:
    """The spec's task: given, the built-in model's, or read off an ``.onnx`` file: no
    ``input_ids`` input → predict; else classify when an output is named ``logits``, labels
    are given or a ``config.json`` with ``id2label`` sits beside it; else embed.
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
    inputs = [i.name for i in graph.input if i.name not in initializers]
    if "input_ids" not in inputs:
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


def tokenizer_path(spec: ModelSpec) -> Path:
    """The tokenizer of an ``.onnx`` text model: the spec's, or ``tokenizer.json`` beside it."""
    if spec.tokenizer is not None:
        if not spec.tokenizer.is_file():
            raise InputError(f"{spec.tokenizer}: no such tokenizer file")
        return spec.tokenizer
    guess = spec.path.with_name("tokenizer.json")
    if not guess.is_file():
        raise InputError(
            f"no tokenizer for {spec.path}: pass a tokenizer.json (--tokenizer PATH) or put one "
            f"beside the model (looked for {guess})"
        )
    return guess


def load_sessions(spec: ModelSpec, knobs: Knobs, **options: Any) -> Any:
    """The ``OnnxModel`` of an ``.onnx`` spec in the knobs' layout: ``knobs.sessions`` sessions
    for batching, or one session every caller shares for the baseline; ``knobs.intra_op_threads``
    threads each, on ``knobs.providers``. ``options`` go to ``OnnxModel.load``."""
    from batchline.models.onnx.runtime import OnnxModel

    return OnnxModel.load(
        spec.path,
        sessions=knobs.sessions if knobs.batching else 1,
        intra_op_threads=knobs.intra_op_threads,
        providers=knobs.providers,
        shared=not knobs.batching,
        **options,
    )


def load_model(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    """Load ``spec`` laid out as ``knobs`` say (see the module docstring)."""
    task = resolve_task(spec)
    if task == "generate":
        raise InputError(
            f"model {spec.name!r} generates text: it is served by a text generator, not a "
            "batch function (batchline.models.generation)"
        )
    if spec.kind == "python":
        from batchline.models.function import as_model

        return as_model(import_factory(spec.source), name=spec.name)
    if task == "embed":
        return _load_embedder(spec, knobs)
    if task == "classify":
        from batchline.models.onnx.classify import load_classifier

        return load_classifier(spec, knobs)  # type: ignore[return-value]
    from batchline.models.onnx.predict import load_predictor

    return load_predictor(spec, knobs)  # type: ignore[return-value]


def _load_embedder(spec: ModelSpec, knobs: Knobs) -> AnyModel:
    from batchline.models.onnx import minilm
    from batchline.models.onnx.embed import TextEmbedder
    from batchline.models.onnx.embedder import Embedder

    options: dict[str, Any] = {}
    if spec.normalize is not None:
        options["normalize"] = spec.normalize
    if spec.pooling is not None:
        options["pooling"] = spec.pooling
    if spec.kind == "builtin":
        path = minilm.default_model_path()
        tok = minilm.weights_dir() / "tokenizer.json"
        max_length: int | None = minilm.MAX_LENGTH
    else:
        path, tok, max_length = spec.path, tokenizer_path(spec), None

    def make(sessions: int, threads: int, *, shared: bool = False) -> Embedder:
        return Embedder.from_onnx(
            path,
            tok,
            max_length=max_length,
            sessions=sessions,
            intra_op_threads=threads,
            providers=knobs.providers,
            shared=shared,
            **options,
        )

    if not knobs.batching:
        return TextEmbedder(make(1, knobs.intra_op_threads, shared=True), name=spec.name)  # type: ignore[return-value]
    main = make(knobs.sessions, knobs.intra_op_threads)
    solo = knobs.solo_intra_op_threads
    wide = make(1, solo) if solo is not None and solo > knobs.intra_op_threads else None
    return TextEmbedder(main, name=spec.name, solo=wide)  # type: ignore[return-value]
