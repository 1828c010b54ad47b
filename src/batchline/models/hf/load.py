"""A Hugging Face encoder folder (a ``PATH/`` spec of kind ``hf`` that does not generate) to
a loaded :class:`~batchline.models.protocol.BatchModel`.

The folder was read at parse time (``spec.folder``, :mod:`batchline.models.common.folder`);
here it is converted once to ONNX (:mod:`batchline.models.hf.convert`) and loaded by the ONNX
task model that fits: ``embed`` (pooling and normalization baked into a built graph, else run in
numpy after the session with any Dense modules), ``classify`` and ``score``. A decoder
embedder (last-token pooling over a causal-LM family) runs on torch
(``batchline.models.hf.torch_embed``). The load log (INFO) says what was found and what runs
it.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._commands import install_command
from batchline._errors import InputError, ModelError
from batchline.models.common.folder import FolderModel
from batchline.models.config import Knobs
from batchline.models.hf.convert import convert
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from batchline.models.onnx import EmbedderOptions

__all__ = ["load_folder_model", "load_torch_encoder"]

logger = logging.getLogger("batchline.models")


def load_folder_model(spec: ModelSpec, knobs: Knobs) -> BatchModel[Any, Any]:
    """Load the encoder folder of ``spec`` (kind ``hf``) laid out as ``knobs`` say."""
    if spec.folder is None:
        raise InputError(f"model {spec.name!r} ({spec.source}) is not a model folder")
    found = spec.folder.for_task(spec.task)
    if found.task == "embed":
        return _embedder(spec, found, knobs)
    if found.task in ("classify", "score"):
        if knobs.precision == "bf16":
            return _logits_on_torch(spec, found, knobs)
        converted = convert(found, top="logits")
        _log(spec, found, converted.describe())
        common: dict[str, Any] = {
            "name": spec.name,
            "knobs": knobs,
            "max_length": found.max_seq_length,
        }
        if found.task == "classify":
            from batchline.models.onnx import load_onnx_classifier

            labels = spec.labels or found.labels
            return load_onnx_classifier(
                converted.path, _tokenizer(found), labels=labels, top_k=spec.top_k, **common
            )
        from batchline.models.onnx import load_onnx_scorer

        activation = found.activation
        return load_onnx_scorer(converted.path, _tokenizer(found), activation=activation, **common)
    raise InputError(f"model {spec.name!r}: a {found.describe()} does not do {found.task}")


def _logits_on_torch(spec: ModelSpec, found: FolderModel, knobs: Knobs) -> BatchModel[Any, Any]:
    """A classifier's or a cross-encoder's folder in bf16: the ONNX task model over the
    folder's weights on torch (:mod:`.torch_logits`), the same labels, scores and pairs."""
    what = f"the {found.architecture or found.model_type} {found.task} model in bf16"
    try:
        from batchline.models.hf.torch_logits import (  # type: ignore[import-not-found,unused-ignore]
            load_torch_logits,
        )
    except ImportError as exc:
        raise ModelError(
            f"{found.folder}: {what} runs on torch, and this batchline cannot load it ({exc}); "
            f"{install_command('generate')}"
        ) from None
    from batchline.models.onnx import OnnxClassifier, OnnxScorer, load_tokenizer

    _log(spec, found, "torch (bf16)")
    graph = load_torch_logits(found.folder, knobs, what=what)
    tokenizer, pad_id = load_tokenizer(_tokenizer(found), max_length=found.max_seq_length)
    if found.task == "classify":
        return OnnxClassifier(
            graph,
            tokenizer,
            name=spec.name,
            labels=spec.labels or found.labels,
            top_k=spec.top_k,
            pad_id=pad_id,
        )
    return OnnxScorer(graph, tokenizer, name=spec.name, pad_id=pad_id, activation=found.activation)


def _embedder(spec: ModelSpec, found: FolderModel, knobs: Knobs) -> BatchModel[Any, Any]:
    pooling = spec.pooling if spec.pooling is not None else found.pooling or "mean"
    normalize = spec.normalize if spec.normalize is not None else found.normalize
    if found.decoder:
        if pooling == "none":
            raise InputError(
                f"model {spec.name!r}: a decoder embedder pools its token vectors; "
                "use pooling lasttoken, mean or cls"
            )
        if found.dense:
            raise InputError(
                f"{found.folder}: Dense modules after a decoder embedder are not supported "
                "(it runs on torch, which pools and normalizes only)"
            )
        if knobs.precision == "int8":
            raise InputError(
                f"model {spec.name!r}: {_int8_name(knobs)} quantizes ONNX encoders; "
                "a decoder embedder runs on torch: use precision fp32 or bf16 for it"
            )
        what = f"a decoder embedder ({found.architecture or found.model_type})"
        return _on_torch(spec, found, pooling, normalize, knobs, "torch", what)
    if knobs.precision == "bf16":  # an encoder in bf16: torch, from the folder's weights
        if found.dense:
            raise InputError(
                f"{found.folder}: precision bf16 runs the encoder on torch, which does not run "
                "its Dense modules; use precision fp32 or int8 for it"
            )
        if pooling not in ("mean", "cls", "lasttoken"):
            raise InputError(
                f"model {spec.name!r}: a folder's encoder returns token vectors; "
                "pool them with mean, cls or lasttoken"
            )
        what = f"the {found.architecture or found.model_type} encoder in bf16"
        return _on_torch(spec, found, pooling, normalize, knobs, "torch (bf16)", what)
    from batchline.models.hf.convert import builder_covers
    from batchline.models.onnx import DenseLayer, load_onnx_embedder

    dense = [DenseLayer.load(d) for d in found.dense]
    if builder_covers(found) and pooling in ("mean", "cls"):
        # pooling baked into the graph; normalize too unless Dense layers come between
        baked = normalize and not dense
        converted = convert(found, top="embedding", pooling=pooling, normalize=baked)
        options: EmbedderOptions = {"pooling": "none", "normalize": normalize and bool(dense)}
    elif pooling == "none":
        raise InputError(
            f"model {spec.name!r}: a folder's encoder returns token vectors; "
            "pool them with mean, cls or lasttoken"
        )
    else:
        converted = convert(found, top="hidden")
        options = {"pooling": pooling, "normalize": normalize}
    options["dense"] = dense
    _log(spec, found, converted.describe())
    return load_onnx_embedder(
        converted.path,
        _tokenizer(found),
        name=spec.name,
        knobs=knobs,
        max_length=found.max_seq_length,
        **options,
    )


def _on_torch(
    spec: ModelSpec,
    found: FolderModel,
    pooling: str,
    normalize: bool,
    knobs: Knobs,
    runs_on: str,
    what: str,
) -> BatchModel[Any, Any]:
    """``found``'s encoder as a torch ``embed`` model, said in the load log as ``runs_on``."""
    _log(spec, found, runs_on)
    return load_torch_encoder(
        found.encoder_folder,
        name=spec.name,
        pooling=pooling,
        normalize=normalize,
        max_length=found.max_seq_length,
        knobs=knobs,
        what=what,
    )


def load_torch_encoder(
    folder: Path,
    *,
    name: str,
    pooling: str,
    normalize: bool,
    max_length: int | None,
    knobs: Knobs,
    what: str,
) -> BatchModel[Any, Any]:
    """The transformer in ``folder`` as a torch ``embed`` model, in bf16 when
    ``knobs.precision`` says so (else fp32); ``ModelError`` naming ``what`` and the install
    when torch is missing."""
    try:
        from batchline.models.hf.torch_embed import (  # type: ignore[import-not-found,unused-ignore]
            load_torch_embedder,
        )
    except ImportError as exc:
        raise ModelError(
            f"{folder}: {what} runs on torch, and this batchline cannot load it ({exc}); "
            f"{install_command('generate')}"
        ) from None
    return load_torch_embedder(
        folder,
        name=name,
        pooling=pooling,
        normalize=normalize,
        max_length=max_length,
        knobs=knobs,
        bf16=knobs.precision == "bf16",
    )


def _int8_name(knobs: Knobs) -> str:
    return "--quantize int8" if knobs.quantize is not None else "precision int8"


def _tokenizer(found: FolderModel) -> Path:
    if found.tokenizer is None:  # detection refuses such folders; kept for a changed folder
        raise ModelError(f"{found.folder}: no tokenizer.json")
    return found.tokenizer


def _log(spec: ModelSpec, found: FolderModel, runs: str) -> None:
    logger.info("%s: %s -> %s", spec.name, found.describe(), runs)
