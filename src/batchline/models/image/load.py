"""A Hugging Face image folder (``spec.folder.layout == "image"``) to a loaded batch model.

The folder was read at parse time (:func:`batchline.models.hf.detect_folder`): an
``*ForImageClassification`` model, CLIP or SigLIP (two towers), or an image encoder (DINOv2,
``ViTModel``). Here its ``preprocessor_config.json`` becomes the model's
:class:`~batchline.models.image.ImagePreprocess`, each tower it needs is converted once to
ONNX and cached (:func:`batchline.models.hf.convert_with`), and the model that fits is built:

- a classifier → :class:`~batchline.models.image.hf_image.ImageClassifier`;
- an image encoder, or a two-tower folder loaded for images →
  :class:`~batchline.models.image.hf_image.ImageEmbedder`;
- a two-tower folder loaded for texts (``spec.input_kind == "text"``, the default for
  ``embed``) → the ONNX text embedder over its text tower (SigLIP's:
  :class:`~batchline.models.image.hf_image.PaddedTextEmbedder`), so that ``run texts.txt
  --model clip/`` gives vectors in the pictures' space;
- a two-tower folder with labels (``classify``) →
  :class:`~batchline.models.image.hf_image.ZeroShotClassifier`, the labels embedded once here.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from batchline._errors import InputError, ModelError
from batchline.models.config import Knobs
from batchline.models.hf import FolderModel, convert_with
from batchline.models.image.hf_image import (
    ImageClassifier,
    ImageEmbedder,
    PaddedTextEmbedder,
    ZeroShotClassifier,
)
from batchline.models.image.preprocess import ImagePreprocess
from batchline.models.image.processor_config import preprocess_from_config, read_processor_config
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from pathlib import Path

    from batchline.models.image.export import ImageHead

__all__ = ["load_image_folder"]

logger = logging.getLogger("batchline.models")

#: Changes when what the exporter writes changes, so that older cached graphs are not reused.
EXPORT_VERSION = 1


def load_image_folder(spec: ModelSpec, knobs: Knobs) -> BatchModel[Any, Any]:
    """Load the image folder of ``spec`` laid out as ``knobs`` say (see the module docstring)."""
    if spec.folder is None or spec.folder.image is None:
        raise InputError(f"model {spec.name!r} ({spec.source}) is not an image model folder")
    if knobs.quantize is not None:
        raise InputError(
            f"--quantize {knobs.quantize} quantizes text encoders; {spec.name!r} is an image "
            "model: leave --quantize out for it"
        )
    found = spec.folder.for_task(spec.task)
    preprocess = preprocess_from_config(read_processor_config(found.folder))
    size = preprocess.output_size
    if size is None:
        raise InputError(
            f"{found.folder}: its preprocessor_config.json resizes the shorter side without a "
            "center crop, so pictures keep varying sizes; a batch needs one size"
        )
    normalize = spec.normalize if spec.normalize is not None else found.normalize
    if found.image == "classifier":
        path = _convert(found, "logits", size)
        _log(spec, found, path)
        return ImageClassifier(
            _sessions(path, knobs),
            preprocess,
            name=spec.name,
            labels=spec.labels or found.labels,
            top_k=spec.top_k,
        )
    if found.image == "encoder":
        pooling = spec.pooling or found.pooling or "cls"
        if pooling not in ("cls", "mean"):
            raise InputError(
                f"model {spec.name!r}: an image encoder pools its patch tokens with cls or "
                f"mean, not {pooling}"
            )
        head: ImageHead = "cls"
        if pooling == "mean":  # a sentence-transformers layout's mean takes every token
            head = "mean" if found.assumed else "mean-all"
        path = _convert(found, head, size)
        _log(spec, found, path)
        return ImageEmbedder(
            _sessions(path, knobs),
            preprocess,
            name=spec.name,
            output_name="embedding",
            normalize=normalize,
        )
    if found.task == "classify":
        return _zero_shot(spec, found, preprocess, knobs)
    if spec.input_kind == "image":
        path = _convert(found, "image_embeds", size)
        _log(spec, found, path)
        return ImageEmbedder(
            _sessions(path, knobs),
            preprocess,
            name=spec.name,
            output_name="image_embeds",
            normalize=normalize,
        )
    text_model: BatchModel[Any, Any] = _text_tower(spec, found, knobs, normalize=normalize)
    return text_model


def _zero_shot(
    spec: ModelSpec, found: FolderModel, preprocess: ImagePreprocess, knobs: Knobs
) -> BatchModel[Any, Any]:
    import onnx

    labels = spec.labels
    if not labels:
        raise InputError(f"model {spec.name!r}: zero-shot classification needs --labels")
    assert preprocess.output_size is not None
    texts = _text_tower(spec, found, Knobs(sessions=1, intra_op_threads=1), normalize=True)
    try:
        prepared = texts.prepare(list(labels))
        bad = next((p for p in prepared if isinstance(p, BaseException)), None)
        if bad is not None:
            raise InputError(f"model {spec.name!r}: a label cannot be tokenized ({bad})")
        vectors = list(texts.run_batch(prepared))
    finally:
        texts.close()
    import numpy as np

    path = _convert(found, "image_embeds", preprocess.output_size)
    meta = {p.key: p.value for p in onnx.load(str(path), load_external_data=False).metadata_props}
    try:
        scale = float(np.exp(float(meta["batchline.logit_scale"])))
    except (KeyError, ValueError):
        raise ModelError(f"{path}: the converted graph does not say its logit scale") from None
    siglip = _siglip(found)
    bias = float(meta.get("batchline.logit_bias", 0.0)) if siglip else 0.0
    _log(spec, found, path)
    return ZeroShotClassifier(
        _sessions(path, knobs),
        preprocess,
        name=spec.name,
        labels=labels,
        label_vectors=np.asarray(np.stack(vectors), np.float32),
        scale=scale,
        bias=bias,
        activation="sigmoid" if siglip else "softmax",
        top_k=spec.top_k,
    )


def _text_tower(spec: ModelSpec, found: FolderModel, knobs: Knobs, *, normalize: bool) -> Any:
    from batchline.models.onnx import load_onnx_embedder

    if found.tokenizer is None:
        raise InputError(
            f"{found.folder}: texts need the text tower's tokenizer.json beside the model "
            "(save the processor with its fast tokenizer: "
            "AutoProcessor.from_pretrained(...).save_pretrained(folder))"
        )
    path = _convert(found, "text_embeds", (0, 0))
    _log(spec, found, path)
    if _siglip(found):
        from batchline.models.onnx import load_sessions_at, load_tokenizer

        length = _text_length(found) or 64
        tokenizer, pad_id = load_tokenizer(found.tokenizer, max_length=length)
        return PaddedTextEmbedder(
            load_sessions_at(path, knobs),
            tokenizer,
            name=spec.name,
            length=length,
            pad_id=pad_id,
            normalize=normalize,
        )
    return load_onnx_embedder(
        path,
        found.tokenizer,
        name=spec.name,
        knobs=knobs,
        max_length=_text_length(found),
        pooling="none",
        normalize=normalize,
    )


def _siglip(found: FolderModel) -> bool:
    return found.model_type == "siglip" or found.architecture == "SiglipModel"


def _text_length(found: FolderModel) -> int | None:
    import json

    config = json.loads((found.folder / "config.json").read_text(encoding="utf-8"))
    text = config.get("text_config") or {}
    length = text.get("max_position_embeddings") if isinstance(text, dict) else None
    return length if isinstance(length, int) and length > 0 else None


def _convert(found: FolderModel, head: ImageHead, size: tuple[int, int]) -> Path:
    from batchline.models.image.export import export_image

    options = {"head": head, "size": list(size), "v": EXPORT_VERSION}
    return convert_with(
        found,
        "image-exporter",
        options,
        lambda target: export_image(found.folder, head=head, target=target, image_size=size),
    ).path


def _sessions(path: Path, knobs: Knobs) -> Any:
    from batchline.models.onnx import load_sessions_at

    return load_sessions_at(path, knobs)


def _log(spec: ModelSpec, found: FolderModel, path: Path) -> None:
    logger.info("%s: %s -> ONNX (cached at %s)", spec.name, found.describe(), path)
