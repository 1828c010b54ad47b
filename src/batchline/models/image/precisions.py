"""Which precisions the image backend computes a model in, and the lines that refuse the others.

An image folder's towers run in fp32 on ONNX Runtime or in bf16 on torch (``torch_image.py``);
int8 quantizes text encoders only, and a two-tower folder loaded for texts runs its text tower
on ONNX Runtime, so in fp32. A plain ``.onnx`` that reads pictures runs as it was exported.
The loader asks :func:`precisions` before it loads (``Backend.precisions``); ``load.py`` and
``onnx_image.py`` refuse with the same lines when they are called directly.

Standard library only.
"""

from __future__ import annotations

from batchline.models.backend import FP32, Asked, precision_refusal
from batchline.models.protocol import Task
from batchline.models.specs import ModelSpec

__all__ = [
    "image_folder",
    "int8_refusal",
    "plain_onnx_refusal",
    "precisions",
    "refusal",
    "text_tower",
    "text_tower_refusal",
]


def image_folder(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a Hugging Face image folder (else a plain ``.onnx`` that reads
    pictures)."""
    return spec.kind == "hf" and spec.folder is not None and spec.folder.image is not None


def text_tower(spec: ModelSpec, task: Task | None) -> bool:
    """Whether ``spec`` is a two-tower folder loaded for its text tower (embedding texts)."""
    assert spec.folder is not None
    return spec.folder.image == "two-tower" and task == "embed" and spec.input_kind != "image"


def precisions(spec: ModelSpec, task: Task) -> frozenset[str]:
    """An image folder's towers in fp32 or bf16 (a text tower in fp32 alone); a plain
    ``.onnx`` as exported."""
    if not image_folder(spec) or task not in ("embed", "classify", "score"):
        return FP32
    return FP32 if text_tower(spec, task) else frozenset({"fp32", "bf16"})


def refusal(spec: ModelSpec, task: Task, asked: Asked) -> str:
    """The line refusing what :func:`precisions` leaves out."""
    if image_folder(spec):
        if asked.precision == "int8":
            return int8_refusal(spec, asked)
        if asked.precision == "bf16" and text_tower(spec, task):
            return text_tower_refusal(spec)
    elif task == "embed":
        return plain_onnx_refusal(spec, asked.precision)
    return precision_refusal(spec, task, asked)


def int8_refusal(spec: ModelSpec, asked: Asked) -> str:
    if asked.quantize is not None:
        return (
            f"--quantize {asked.quantize} quantizes text encoders; {spec.name!r} is an image "
            "model: leave --quantize out for it"
        )
    return (
        f"precision int8 quantizes text encoders; {spec.name!r} is an image model: use "
        "precision auto, fp32 or bf16 for it"
    )


def text_tower_refusal(spec: ModelSpec) -> str:
    return (
        f"model {spec.name!r}: precision bf16 runs image towers on torch, and its text "
        "tower runs on ONNX Runtime: use precision auto or fp32 for texts"
    )


def plain_onnx_refusal(spec: ModelSpec, precision: str) -> str:
    return (
        f"model {spec.name!r}: a plain .onnx that reads pictures runs as it was exported; "
        f"precision {precision} is for Hugging Face folders (bf16: an image folder's "
        "weights on torch): use precision auto or fp32 for it"
    )
