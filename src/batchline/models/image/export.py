"""A Hugging Face image folder to one ONNX file per tower, with torch's TorchScript-based
exporter (``torch.onnx.export(..., dynamo=False)``: no ``onnxscript`` needed); torch and
transformers are needed for the conversion only, never to run the result.

What :func:`export_image` writes, by ``head``:

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
from typing import Any, Literal

import numpy as np

from batchline._cache import write_whole
from batchline._errors import ModelError
from batchline.models.hf import OPSET, require_torch

__all__ = ["ImageHead", "export_image"]

ImageHead = Literal["logits", "image_embeds", "text_embeds", "cls", "mean", "mean-all"]
_OUTPUT = {
    "logits": "logits",
    "image_embeds": "image_embeds",
    "text_embeds": "text_embeds",
    "cls": "embedding",
    "mean": "embedding",
    "mean-all": "embedding",
}
#: The exporter keeps weights inline up to protobuf's 2 GiB message limit (less the graph).
_MAX_INLINE_BYTES = 2**31 - 2**26
#: How far the graph may stray from transformers on the probe, relative to the largest output.
_TOLERANCE = 1e-3


def output_name(head: ImageHead) -> str:
    """The graph output :func:`export_image` names for ``head``."""
    return _OUTPUT[head]


def export_image(
    folder: Path, *, head: ImageHead, target: Path, image_size: tuple[int, int] = (224, 224)
) -> None:
    """Convert ``folder``'s model to one ONNX file at ``target`` returning ``head`` (see the
    module docstring); ``image_size`` ``(height, width)`` is what its preprocessing gives.

    Raises ``ModelError`` when torch or transformers is missing (with the install), when the
    folder cannot be loaded, or when the export does not reproduce the model."""
    if head not in _OUTPUT:
        raise ValueError(f"head must be one of {', '.join(_OUTPUT)}, got {head!r}")
    torch, transformers = require_torch(f"converting {folder} to ONNX")
    model = _load(folder, head, transformers, torch)
    arch = type(model).__name__
    fixed = head == "text_embeds" and fixed_text_length(model.config) is not None
    wrapped = _wrap(torch, model, head)
    names = ["pixel_values"]
    if head == "text_embeds":
        names = ["input_ids"] if fixed else ["input_ids", "attention_mask"]
    output = _OUTPUT[head]
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


def _load(folder: Path, head: ImageHead, transformers: ModuleType, torch: ModuleType) -> Any:
    auto = {
        "logits": transformers.AutoModelForImageClassification,
        "image_embeds": transformers.AutoModel,
        "text_embeds": transformers.AutoModel,
    }.get(head, transformers.AutoModel)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model, info = auto.from_pretrained(
                folder,
                dtype=torch.float32,
                local_files_only=True,
                attn_implementation="eager",
                output_loading_info=True,
            )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelError(f"cannot load {folder} as an image model: {exc}") from exc
    missing = [k for k in info.get("missing_keys", ()) if "pooler" not in k]
    if missing:
        shown = ", ".join(sorted(missing)[:4]) + (", ..." if len(missing) > 4 else "")
        raise ModelError(
            f"{folder} does not hold all its weights: {len(missing)} missing ({shown}); "
            "converting it would run random weights"
        )
    return model.eval()


def _features(out: Any) -> Any:
    """``get_*_features`` returns the projected vectors, or (transformers 5) an output whose
    ``pooler_output`` holds them."""
    return out if hasattr(out, "shape") else out.pooler_output


def _wrap(torch: ModuleType, model: Any, head: ImageHead) -> Any:
    class Tower(torch.nn.Module):  # type: ignore[name-defined,misc]
        """The model with positional inputs and one output, as the exporter traces it."""

        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *inputs: Any) -> Any:
            if head == "logits":
                return self.model(pixel_values=inputs[0]).logits
            if head == "image_embeds":
                return _features(self.model.get_image_features(pixel_values=inputs[0]))
            if head == "text_embeds" and len(inputs) == 1:
                return _features(self.model.get_text_features(input_ids=inputs[0]))
            if head == "text_embeds":
                ids, mask = inputs
                return _features(self.model.get_text_features(input_ids=ids, attention_mask=mask))
            hidden = self.model(pixel_values=inputs[0]).last_hidden_state
            if head == "cls":
                return hidden[:, 0]
            return hidden.mean(dim=1) if head == "mean-all" else hidden[:, 1:].mean(dim=1)

    return Tower().eval()


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
