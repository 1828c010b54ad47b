"""A Hugging Face image folder (``spec.folder.layout == "image"``) to a loaded batch model.

The folder was read at parse time (:func:`batchline.models.hf.detect_folder`): an
``*ForImageClassification`` model, CLIP or SigLIP (two towers), or an image encoder (DINOv2,
``ViTModel``). Here its ``preprocessor_config.json`` becomes the model's
:class:`~batchline.models.image.ImagePreprocess`, each tower it needs is converted once to
ONNX and cached (:func:`batchline.models.hf.convert_with`), and the model that fits is built
(``precision = "bf16"``: each image tower runs on torch in bfloat16 instead, read through the
same head: :mod:`.torch_image`; text towers stay on ONNX Runtime):

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
from batchline.models.image.precisions import int8_refusal, text_tower_refusal
from batchline.models.image.preprocess import ImagePreprocess
from batchline.models.image.processor_config import preprocess_from_config, read_processor_config
from batchline.models.image.torch_image import TorchPixels, load_torch_pixels
from batchline.models.onnx import Graph
from batchline.models.protocol import BatchModel
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from pathlib import Path

    from batchline.models.image.heads import ImageHead

__all__ = ["load_image_folder"]

logger = logging.getLogger("batchline.models")

#: Changes when what the exporter writes changes, so that older cached graphs are not reused.
EXPORT_VERSION = 1


def load_image_folder(spec: ModelSpec, knobs: Knobs) -> BatchModel[Any, Any]:
    """Load the image folder of ``spec`` laid out as ``knobs`` say (see the module docstring)."""
    if spec.folder is None or spec.folder.image is None:
        raise InputError(f"model {spec.name!r} ({spec.source}) is not an image model folder")
    if knobs.precision == "int8":  # what --quantize int8 sets too
        raise InputError(int8_refusal(spec, knobs))
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
        return ImageClassifier(
            _graph(spec, found, "logits", size, knobs),
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
        return ImageEmbedder(
            _graph(spec, found, head, size, knobs),
            preprocess,
            name=spec.name,
            output_name="embedding",
            normalize=normalize,
        )
    if found.task == "classify":
        return _zero_shot(spec, found, preprocess, knobs)
    if spec.input_kind == "image":
        return ImageEmbedder(
            _graph(spec, found, "image_embeds", size, knobs),
            preprocess,
            name=spec.name,
            output_name="image_embeds",
            normalize=normalize,
        )
    if knobs.precision == "bf16":
        raise InputError(text_tower_refusal(spec))
    text_model: BatchModel[Any, Any] = _text_tower(spec, found, knobs, normalize=normalize)
    return text_model


def _zero_shot(
    spec: ModelSpec, found: FolderModel, preprocess: ImagePreprocess, knobs: Knobs
) -> BatchModel[Any, Any]:
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

    graph = _graph(spec, found, "image_embeds", preprocess.output_size, knobs)
    if isinstance(graph, TorchPixels):
        meta = {
            f"batchline.{name}": repr(value)
            for name, value in (
                ("logit_scale", graph.logit_scale),
                ("logit_bias", graph.logit_bias),
            )
            if value is not None
        }
    else:
        import onnx

        proto = onnx.load(str(graph.path), load_external_data=False)
        meta = {p.key: p.value for p in proto.metadata_props}
    try:
        scale = float(np.exp(float(meta["batchline.logit_scale"])))
    except (KeyError, ValueError):
        raise ModelError(f"{graph.path}: the model does not say its logit scale") from None
    siglip = _siglip(found)
    bias = float(meta.get("batchline.logit_bias", 0.0)) if siglip else 0.0
    return ZeroShotClassifier(
        graph,
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


def _graph(
    spec: ModelSpec, found: FolderModel, head: ImageHead, size: tuple[int, int], knobs: Knobs
) -> Graph:
    """What the image tower runs on: torch in bf16 (``knobs.precision``), else its graph,
    converted once, on ONNX Runtime's sessions; said in the load log."""
    if knobs.precision == "bf16":
        graph = load_torch_pixels(found.folder, head=head, knobs=knobs)
        logger.info("%s: %s -> torch (bf16)", spec.name, found.describe())
        return graph
    from batchline.models.onnx import load_sessions_at

    path = _convert(found, head, size)
    _log(spec, found, path)
    return load_sessions_at(path, knobs)


def _log(spec: ModelSpec, found: FolderModel, path: Path) -> None:
    logger.info("%s: %s -> ONNX (cached at %s)", spec.name, found.describe(), path)
