"""What an image folder's model is read through: its head (the one output an image model
uses), written once for both runners. The ONNX exporter (:mod:`.export`) traces these heads;
the torch runner (:mod:`.torch_image`) calls them; so the two return the same thing.

The heads, by name:

- ``logits``: an ``*ForImageClassification`` model, ``pixel_values`` ``(batch, 3, H, W)`` →
  ``logits`` ``(batch, num_labels)``;
- ``image_embeds``: CLIP's or SigLIP's vision tower and projection (``get_image_features``)
  → ``(batch, dim)``, unnormalized;
- ``text_embeds``: their text tower (``get_text_features``) → ``(batch, dim)``, from
  ``input_ids`` (and ``attention_mask``, CLIP's);
- ``cls`` / ``mean``: an image encoder (DINOv2, ``ViTModel``) → the first token of its last
  hidden state, or the mean of its patch tokens (the first token left out), ``(batch, dim)``;
  ``mean-all``: the mean of every token, the first included (a sentence-transformers
  ``Pooling`` module's mean over an image encoder).

torch and transformers are passed in by the caller (which imported them, or said how to
install them): importing this module costs nothing.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any, Literal

from batchline._errors import ModelError

__all__ = ["ImageHead", "load_head_model", "output_name", "wrap_head"]

ImageHead = Literal["logits", "image_embeds", "text_embeds", "cls", "mean", "mean-all"]
_OUTPUT: dict[str, str] = {
    "logits": "logits",
    "image_embeds": "image_embeds",
    "text_embeds": "text_embeds",
    "cls": "embedding",
    "mean": "embedding",
    "mean-all": "embedding",
}


def output_name(head: ImageHead) -> str:
    """The output ``head`` is named by (the ONNX graph's, the torch runner's)."""
    if head not in _OUTPUT:
        raise ValueError(f"head must be one of {', '.join(_OUTPUT)}, got {head!r}")
    return _OUTPUT[head]


def load_head_model(
    folder: Path,
    head: ImageHead,
    transformers: ModuleType,
    torch: ModuleType,
    *,
    attn_implementation: str | None = None,
) -> Any:
    """``folder``'s model in float32, in eval mode, as ``head`` reads it (the classifier's
    class for ``logits``, ``AutoModel`` for the others); ``ModelError`` when it does not load
    or lacks weights (random ones would be run)."""
    auto = {
        "logits": transformers.AutoModelForImageClassification,
        "image_embeds": transformers.AutoModel,
        "text_embeds": transformers.AutoModel,
    }.get(head, transformers.AutoModel)
    options: dict[str, Any] = {}
    if attn_implementation is not None:
        options["attn_implementation"] = attn_implementation
    from batchline.models.common.torch_weights import from_pretrained_quietly

    try:
        model, info = from_pretrained_quietly(auto, folder, dtype=torch.float32, **options)
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


def wrap_head(torch: ModuleType, model: Any, head: ImageHead) -> Any:
    """``model`` as a module of positional inputs (``pixel_values``; a text tower's
    ``input_ids`` and, CLIP's, ``attention_mask``) and the one output ``head`` names."""

    class Tower(torch.nn.Module):  # type: ignore[name-defined,misc]
        """The model with positional inputs and one output, as the exporter traces it and
        the torch runner calls it."""

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
