"""A Hugging Face image folder to one ONNX file per tower, with torch's TorchScript-based
exporter (``torch.onnx.export(..., dynamo=False)``: no ``onnxscript`` needed); torch and
transformers are needed for the conversion only, never to run the result.

What :func:`export_image` writes, by ``head`` (the heads themselves: :mod:`.heads`, which the
torch runner calls too):

- ``logits``: an ``*ForImageClassification`` model, ``pixel_values`` ``(batch, 3, H, W)`` →
  ``logits`` ``(batch, num_labels)``;
- ``image_embeds``: CLIP's or SigLIP's vision tower and projection (``get_image_features``)
  → ``(batch, dim)``, unnormalized; the graph's metadata keeps the model's ``logit_scale``
  and ``logit_bias`` (for zero-shot classification);
- ``text_embeds``: their text tower (``get_text_features``), ``input_ids`` and
  ``attention_mask`` ``(batch, sequence)`` → ``(batch, dim)``; SigLIP's text tower reads the
  last of a fixed number of tokens (padding included, as it was trained), so its graph takes
  ``input_ids`` alone, ``(batch, text length)``;
- ``cls`` / ``mean``: an image encoder (DINOv2, ``ViTModel``) → the first token of its last
  hidden state, or the mean of its patch tokens (the first token left out), ``(batch, dim)``;
  ``mean-all``: the mean of every token, the first included (a sentence-transformers
  ``Pooling`` module's mean over an image encoder).

Only the batch axis is dynamic for pictures (the preprocessing fixes their size). The graph
is checked against the model on a probe batch of another size than the traced one, and
written whole or not at all.

Example::

    export_image(Path("vit-classifier/"), head="logits", target=Path("cache/vit.onnx"),
                 image_size=(224, 224))
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from batchline._cache import write_whole
from batchline._errors import ModelError
from batchline.models.hf import OPSET, require_torch
from batchline.models.image.heads import ImageHead, load_head_model, output_name, wrap_head

__all__ = ["ImageHead", "export_image", "output_name"]

#: The exporter keeps weights inline up to protobuf's 2 GiB message limit (less the graph).
_MAX_INLINE_BYTES = 2**31 - 2**26
#: How far the graph may stray from transformers on the probe, relative to the largest output.
_TOLERANCE = 1e-3


def export_image(
    folder: Path, *, head: ImageHead, target: Path, image_size: tuple[int, int] = (224, 224)
) -> None:
    """Convert ``folder``'s model to one ONNX file at ``target`` returning ``head`` (see the
    module docstring); ``image_size`` ``(height, width)`` is what its preprocessing gives.

    Raises ``ModelError`` when torch or transformers is missing (with the install), when the
    folder cannot be loaded, or when the export does not reproduce the model."""
    output = output_name(head)  # checks the head
    torch, transformers = require_torch(f"converting {folder} to ONNX")
    model = load_head_model(folder, head, transformers, torch, attn_implementation="eager")
    arch = type(model).__name__
    fixed = head == "text_embeds" and fixed_text_length(model.config) is not None
    wrapped = wrap_head(torch, model, head)
    names = ["pixel_values"]
    if head == "text_embeds":
        names = ["input_ids"] if fixed else ["input_ids", "attention_mask"]
    probe = _probe(model, head, image_size, rows=2, seed=0)
    axes: dict[str, dict[int, str]] = {n: {0: "batch"} for n in names}
    if head == "text_embeds" and not fixed:
        axes = {n: {0: "batch", 1: "sequence"} for n in names}
    axes[output] = {0: "batch"}
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.", dir=target.parent) as tmp:
        traced = Path(tmp) / "model.onnx"
        try:
            with warnings.catch_warnings(), torch.no_grad():
                warnings.simplefilter("ignore")  # tracer warnings: the probe check decides
                torch.onnx.export(
                    wrapped,
                    tuple(torch.from_numpy(probe[n]) for n in names),
                    str(traced),
                    input_names=names,
                    output_names=[output],
                    dynamic_axes=axes,
                    opset_version=OPSET,
                    dynamo=False,
                )
        except Exception as exc:  # the exporter raises many kinds; all mean "cannot convert"
            first = str(exc).splitlines()[0] if str(exc) else ""
            raise ModelError(
                f"{arch} cannot be exported to ONNX by torch {torch.__version__}: "
                f"{type(exc).__name__}: {first}"
            ) from exc
        data = _finish(traced, model, head, arch)
    _check(torch, wrapped, names, output, data, _probe(model, head, image_size, rows=3, seed=1))
    write_whole(target, data, "cache.hf")


def fixed_text_length(config: Any) -> int | None:
    """The length every text is padded to, for a text tower that pools the last position
    (SigLIP: its ``text_config.max_position_embeddings``); ``None`` for CLIP's, which pools
    the end-of-text token of a text of any length."""
    if getattr(config, "model_type", None) != "siglip":
        return None
    length = int(config.text_config.max_position_embeddings)
    return length


def _probe(
    model: Any, head: ImageHead, image_size: tuple[int, int], *, rows: int, seed: int
) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    if head != "text_embeds":
        pixels = rng.standard_normal((rows, 3, *image_size)).astype(np.float32)
        return {"pixel_values": pixels}
    text = model.config.text_config
    vocab = int(text.vocab_size)
    lengths = [7, 4, 2][:rows] if rows <= 3 else [5] * rows
    fixed = fixed_text_length(model.config)
    width = fixed or max(lengths)
    ids = rng.integers(1, vocab - 1, size=(rows, width), dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    eos = getattr(text, "eos_token_id", None)
    pad = getattr(text, "pad_token_id", None)
    if isinstance(eos, int) and 0 <= eos < vocab and eos != 2:
        ids[ids == eos] = 1
        ids[np.arange(rows), np.array(lengths) - 1] = eos  # a text ends with its eos token
    ids[mask == 0] = pad if isinstance(pad, int) and 0 <= pad < vocab else 0
    if fixed is not None:
        return {"input_ids": ids}
    return {"input_ids": ids, "attention_mask": mask}


def _finish(traced: Path, model: Any, head: ImageHead, arch: str) -> bytes:
    import onnx

    proto = onnx.load(str(traced))
    meta = {"batchline.architecture": arch, "batchline.head": head}
    for name in ("logit_scale", "logit_bias"):
        value = getattr(model, name, None)
        if value is not None:
            meta[f"batchline.{name}"] = repr(float(value.detach().reshape(-1)[0]))
    for key, value in meta.items():
        entry = proto.metadata_props.add()
        entry.key, entry.value = key, value
    if sum(len(t.raw_data) for t in proto.graph.initializer) > _MAX_INLINE_BYTES:
        raise ModelError(
            f"{arch} holds more than 2 GB of weights: image models that large are not "
            "converted yet; export it yourself to model.onnx in the folder"
        )
    data: bytes = proto.SerializeToString()
    return data


def _check(
    torch: ModuleType,
    wrapped: Any,
    names: list[str],
    output: str,
    graph: bytes,
    feeds: dict[str, np.ndarray],
) -> None:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
    got = session.run([output], feeds)[0]
    with torch.no_grad():
        want = wrapped(*(torch.from_numpy(feeds[n]) for n in names)).numpy()
    arch = type(wrapped.model).__name__
    if got.shape != want.shape:
        raise ModelError(
            f"the ONNX export of {arch} gives {output} of shape {list(got.shape)} where "
            f"transformers gives {list(want.shape)}: this model cannot be converted"
        )
    diff = float(np.abs(got - want).max())
    scale = max(1.0, float(np.abs(want).max()))
    if not diff <= _TOLERANCE * scale:
        raise ModelError(
            f"the ONNX export of {arch} differs from transformers by {diff:.3g} on a probe "
            "batch: it cannot be converted correctly; export it yourself to model.onnx"
        )
