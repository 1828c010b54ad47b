"""A GGUF file told apart from its header, before anything is loaded: whether the engine runs
its architecture, whether its layers' linears are float or mostly int8 in groups of 32 (what
the dtype is chosen by), and its tensors' names in transformers' Llama/Qwen2 module tree.
:mod:`~.gguf_weights` loads the file on these."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import ModelError

if TYPE_CHECKING:
    from batchline.models.generation.gguf_file import GgufFile

__all__ = [
    "GGUF_ARCHITECTURES",
    "gguf_architecture",
    "gguf_float_linears",
    "read_gguf_file",
]

#: The GGUF architectures (``general.architecture``) the engine runs, and their transformers
#: model type.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}

# the float types: a linear of one is dequantized into the model's dtype, as the file asks
_DENSE = ("F32", "F16", "BF16")

# GGUF tensor names (after ``blk.N.``) -> the module path in a Llama/Qwen2 layer
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_float_linears(path: Path) -> bool:
    """Whether every linear weight of the layers in the GGUF file at ``path`` is of a float
    type (F32, F16, BF16: an unquantized file), so that its dtype is chosen as a float
    folder's: kept quantized files compute int weights in float32 on int8 rows where that
    pays, which made a bf16 file's 1.7B step x1.97 the time of the same weights as a folder
    in bf16 (143 against 72.5 ms, Zen 5, 2026-12-05). The loader, the load log and the job's
    identity each ask: the file's header is read once per version of the file."""
    try:
        stat = path.stat()
    except OSError:  # read, uncached: the reader says what is wrong with the file
        return _float_linears_of.__wrapped__(path, 0, 0)
    return _float_linears_of(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=32)
def _float_linears_of(path: Path, mtime_ns: int, size: int) -> bool:
    """:func:`gguf_float_linears` of the file as it is at ``mtime_ns`` and ``size``."""
    from gguf import GGMLQuantizationType

    linears = [
        GGMLQuantizationType(t.tensor_type).name
        for t in read_gguf_file(path).tensors
        if (name := _hf_name(t.name)) is not None
        and name.startswith("model.layers.")
        and name.endswith("_proj.weight")
    ]
    return bool(linears) and all(kind in _DENSE for kind in linears)


def gguf_architecture(path: Path) -> str:
    """The file's ``general.architecture``; ``ModelError`` where the engine does not run it."""
    return _architecture(read_gguf_file(path), path)


def read_gguf_file(path: Path) -> GgufFile:
    """The GGUF file at ``path`` (:func:`~.gguf_file.read_gguf`); ``ModelError`` saying why
    where it cannot be read."""
    from batchline.models.generation.gguf_file import read_gguf

    try:
        return read_gguf(path)
    except ImportError as exc:
        raise ModelError(f"reading a GGUF file needs gguf: pip install gguf ({exc})") from exc
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read the GGUF file {path}: {exc}") from exc


def _architecture(file: GgufFile, path: Path) -> str:
    arch = file.metadata.get("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        runs = ", ".join(GGUF_ARCHITECTURES)
        raise ModelError(
            f"{path.name}: a GGUF of architecture {arch!r}, which the engine does not run "
            f"(it runs {runs})"
        )
    return str(arch)


def _block_of(name: str) -> int | None:
    """The block (layer) index of a GGUF tensor's name (``blk.N.*``), else None."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1])
    return None


def _hf_name(name: str) -> str | None:
    """A GGUF tensor's name in transformers' Llama/Qwen2 module tree (None: not a parameter)."""
    parts = name.split(".")
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 2 and parts[0] in _TOP_NAMES:
        return f"{_TOP_NAMES[parts[0]]}.{parts[1]}"
    return None
