"""The image backend: a Hugging Face image folder (a classifier, CLIP/SigLIP, DINOv2:
``load.py``) and a plain ``.onnx`` that reads pictures (a spec with ``--image-size``,
``--mean`` or ``--std``, of task ``embed`` or ``classify``: ``onnx_image.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchline.models.backend import Backend, Footprint, Identity, Loaded
from batchline.models.common.files import size, tree
from batchline.models.config import Knobs
from batchline.models.image.precisions import image_folder, precisions, refusal, text_tower
from batchline.models.onnx import ONNX, onnx_footprint, onnx_identity
from batchline.models.protocol import InputKind, Task
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["IMAGE"]


def _claims(spec: ModelSpec, knobs: Knobs) -> bool:
    if image_folder(spec):
        return True
    reads_pictures = spec.image is not None and spec.kind not in ("hf", "python")
    return reads_pictures and spec.task in ("embed", "classify")


def _input_kind(spec: ModelSpec, task: Task) -> InputKind:
    # a two-tower folder loaded for its text tower embeds texts
    return "text" if image_folder(spec) and text_tower(spec, task) else "image"


def _load(spec: ModelSpec, knobs: Knobs) -> Loaded:
    spec = spec.with_options()  # checked for its resolved task
    if image_folder(spec):
        from batchline.models.image.load import load_image_folder

        return load_image_folder(spec, knobs)
    from batchline.models.image.onnx_image import load_image_model

    return load_image_model(spec, knobs)


def _footprint(spec: ModelSpec, knobs: Knobs, task: Task | None) -> Footprint:
    """A folder: the ONNX rule with its fp32 weights standing in for the graph (not measured
    yet; an overestimate for one of CLIP's two towers), a text model's extra for a text
    tower; a plain ``.onnx``: the ONNX rule."""
    if not image_folder(spec):
        return ONNX.footprint(spec, knobs, task)
    assert spec.folder is not None
    return onnx_footprint(size(spec.folder.weights), knobs, task, text=text_tower(spec, task))


def _identity(spec: ModelSpec, knobs: Knobs | None) -> Identity:
    if image_folder(spec):
        return Identity(tuple(tree(spec.path)))
    return onnx_identity(spec, knobs)


def _tokenizer(spec: ModelSpec) -> Tokenizer | None:
    """None: what this backend claims reads pictures (a folder's image tower, or a plain
    ``.onnx`` whose spec reads pictures); serve's start-up check asked a picture model for a
    tokenizer.json, and refused it."""
    return None


IMAGE = Backend(
    name="image",
    claims=_claims,
    load=_load,
    footprint=_footprint,
    identity=_identity,
    tokenizer=_tokenizer,
    precisions=precisions,
    refusal=refusal,
    input_kind=_input_kind,
)
