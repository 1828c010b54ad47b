"""Two backends of Hugging Face weights: a model folder (``PATH/`` of kind ``hf`` that neither
generates nor reads pictures), converted once to ONNX or run on torch (``load.py``); and the
built-in encoder in bf16, run on torch from its weights package (an ``.onnx`` file has no
weights torch can load).
"""

from __future__ import annotations

import logging

from batchline._errors import InputError
from batchline.models.backend import FP32, UNKNOWN, Backend, Footprint, Identity, Loaded, text_input
from batchline.models.common.files import tree
from batchline.models.config import Knobs
from batchline.models.onnx import ONNX, onnx_identity
from batchline.models.protocol import Task
from batchline.models.specs import ModelSpec

__all__ = ["HF_FOLDER", "TORCH_BF16"]

logger = logging.getLogger("batchline.models")


def _folder_claims(spec: ModelSpec, knobs: Knobs) -> bool:
    return spec.kind == "hf" and not spec.generates


def _load_folder(spec: ModelSpec, knobs: Knobs) -> Loaded:
    from batchline.models.hf.load import load_folder_model

    return load_folder_model(spec.with_options(), knobs)  # checked for its resolved task


def _folder_footprint(spec: ModelSpec, knobs: Knobs, task: Task | None) -> Footprint:
    return UNKNOWN  # not measured yet: its first load measures it


def _folder_identity(spec: ModelSpec, knobs: Knobs | None) -> Identity:
    return Identity(tuple(tree(spec.path)))


def _folder_precisions(spec: ModelSpec, task: Task) -> frozenset[str]:
    """An embedder in int8 (its ONNX graph quantized) or bf16 (torch, from the folder's
    weights); a classifier or cross-encoder in bf16 too; anything else as exported."""
    if task == "embed":
        return frozenset({"fp32", "bf16", "int8"})
    return frozenset({"fp32", "bf16"}) if task in ("classify", "score") else FP32


HF_FOLDER = Backend(
    name="hf-folder",
    claims=_folder_claims,
    load=_load_folder,
    footprint=_folder_footprint,
    identity=_folder_identity,
    precisions=_folder_precisions,
    input_kind=text_input,
)


def _bf16(spec: ModelSpec, task: Task) -> frozenset[str]:
    return frozenset({"bf16"})  # what it claims an encoder for


def _bf16_claims(spec: ModelSpec, knobs: Knobs) -> bool:
    return spec.task == "embed" and knobs.precision == "bf16" and spec.kind != "python"


def _load_bf16(spec: ModelSpec, knobs: Knobs) -> Loaded:
    if spec.kind != "builtin":
        raise InputError(
            f"model {spec.name!r}: precision bf16 runs an encoder on torch from its weights, and "
            f"an .onnx file has none torch can load; use precision fp32 or int8, or a model folder"
        )
    from batchline.models.common import minilm
    from batchline.models.hf.load import load_torch_encoder

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


TORCH_BF16 = Backend(
    name="torch-bf16",
    claims=_bf16_claims,
    load=_load_bf16,
    # the ONNX rule on the same weights: bf16 on torch is not measured apart yet
    footprint=ONNX.footprint,
    identity=onnx_identity,
    tokenizer=ONNX.tokenizer,
    precisions=_bf16,
    input_kind=text_input,
)
