"""``estimate_footprint``: the memory a model will hold, read off its files before its first
load, and the memory its backend's runtime adds once per process.

What a memory budget admits a load on (``batchline.server.residency``). Each backend has its
rule, measured once on the models it serves and written down here; a model of no known
backend (``module:factory``) estimates 0, and its first load measures it.

ONNX (``PATH.onnx`` and the built-in embedder), measured 2026-11-27 on all-MiniLM-L6-v2 (an
86 MiB graph) with ONNX Runtime 1.31, CPU, RSS before and after ``load_model`` and its peak
(``VmHWM``, reset before it), three loads each: 2, 3 and 4 sessions (1-3 batching sessions and
serve's solo session) grew the process by 244, 317 and 409 MiB and peaked 8-23 MiB above
that. So a model holds one copy of its graph per session (the weights, prepacked), plus
~70 MiB of tokenizer and arenas for a text model; the peak adds a quarter of the graph. A
192 MiB tensor model in one session grew it by ~196 MiB (``tests/server/
test_uvicorn_residency.py``): 8 MiB beside its graph. Importing ``onnxruntime`` and
``tokenizers`` adds 64 MiB to a process, once.

Image folders (``models/image``): not measured yet; the ONNX rule above, with the folder's
fp32 weights file standing in for the graph (the converted tower holds those weights, or a
part of them for one of CLIP's two towers: an overestimate), and a tensor model's extra, a
text model's for a text tower.

Torch text generators (a Hugging Face folder, ``smollm2`` once converted), measured the same
day on a random Llama of SmolLM2-135M's shape (513 MiB of float32 safetensors, float32 on this
CPU): a load grew the process by 1,029-1,063 MiB and peaked there, so twice the weights (the
engine's packed copies beside the model's), an eighth more at the peak for safety; plus the
KV cache at ``kv_token_budget`` positions, read off ``config.json`` (allocated as the traffic
needs it, but all of it is the model's at full load): 720 MiB for SmolLM2 at 16,384 positions
in float32. Importing torch, transformers and the engine adds 345-363 MiB, once.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from batchline.knobs import Knobs
from batchline.models.specs import ModelSpec

__all__ = ["Footprint", "estimate_footprint", "runtime_bytes"]

_MIB = 1 << 20

#: Bytes a backend's runtime adds to a process the first time one of its models loads.
RUNTIME_BYTES = {"onnx": 64 * _MIB, "torch": 363 * _MIB}
#: The module whose presence says the runtime is loaded already.
_RUNTIME_MODULE = {"onnx": "onnxruntime", "torch": "torch"}
#: An ONNX model's memory beside its graph's copies: tokenizer and session arenas for a text
#: model, arenas for a tensor model.
_ONNX_TEXT_EXTRA_BYTES = 70 * _MIB
_ONNX_TENSOR_EXTRA_BYTES = 8 * _MIB


@dataclass(frozen=True, slots=True)
class Footprint:
    """A model's expected memory: what it holds once loaded, what its load needs at its peak,
    and the runtime it loads (``""``: none known)."""

    steady_bytes: int
    peak_bytes: int
    runtime: str = ""


def estimate_footprint(spec: ModelSpec, knobs: Knobs, task: str | None = None) -> Footprint:
    """The footprint of ``spec`` loaded with ``knobs`` for ``task`` (default: the spec's
    own), from its files (see the module docstring); zeros when its files are not there yet
    (the load will say what is missing)."""
    if spec.generates:
        folder = _generator_folder(spec)
        weights = _size(folder)
        if not weights or folder is None:
            return Footprint(0, 0)
        steady = 2 * weights + _kv_bytes(folder / "config.json", knobs)
        return Footprint(steady, steady + weights // 4, "torch")
    if spec.kind == "python":
        return Footprint(0, 0)
    graph = _size(_onnx_file(spec))
    if not graph:
        return Footprint(0, 0)
    task = task or spec.task or spec.builtin_task
    sessions = knobs.sessions if knobs.batching else 1
    if task == "embed" and knobs.batching and knobs.solo_intra_op_threads:
        sessions += 1  # an embedder's solo session (models/onnx/embed.py)
    extra = _ONNX_TENSOR_EXTRA_BYTES if task == "predict" else _ONNX_TEXT_EXTRA_BYTES
    if _image_folder(spec) and not _text_tower(spec, task):
        extra = _ONNX_TENSOR_EXTRA_BYTES
    steady = graph * sessions + extra
    return Footprint(steady, steady + graph // 4, "onnx")


def runtime_bytes(runtimes: Iterable[str]) -> int:
    """What the named runtimes will add to this process: those not imported yet."""
    return sum(
        RUNTIME_BYTES.get(r, 0)
        for r in set(runtimes)
        if r in _RUNTIME_MODULE and _RUNTIME_MODULE[r] not in sys.modules
    )


def _onnx_file(spec: ModelSpec) -> Path | None:
    if spec.kind == "builtin":
        try:
            from batchline.models.onnx.minilm import weights_dir

            return weights_dir() / "model.safetensors"  # the graph holds these, as float32
        except Exception:  # the weights package is missing: the load will say so
            return None
    if _image_folder(spec):
        assert spec.folder is not None
        return spec.folder.weights
    return spec.path if spec.kind == "onnx" else None


def _image_folder(spec: ModelSpec) -> bool:
    return spec.kind == "hf" and spec.folder is not None and spec.folder.image is not None


def _text_tower(spec: ModelSpec, task: str | None) -> bool:
    """A two-tower image folder loaded for texts (``models/image/load.py``)."""
    two_towers = spec.folder is not None and spec.folder.image == "two-tower"
    return two_towers and task == "embed" and spec.input_kind != "image"


def _generator_folder(spec: ModelSpec) -> Path | None:
    if spec.kind == "builtin":
        from batchline.models.generation.smollm2 import converted_folder

        return converted_folder()  # float32 safetensors, once converted (the GGUF is Q4)
    return spec.path if spec.kind in ("hf", "gguf") else None


def _kv_bytes(config: Path, knobs: Knobs) -> int:
    """A generator's KV cache: vLLM's ``kv_cache_gib`` (1 GiB on CPU by default), else
    ``kv_token_budget`` positions of the shape its ``config.json`` gives (0 where it does
    not say)."""
    import json

    if knobs.generation_backend == "vllm":
        return int((knobs.kv_cache_gib or 1) * (1 << 30))

    try:
        c = json.loads(config.read_text(encoding="utf-8"))
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return 0
    width = 2 if knobs.dtype in ("bfloat16", "float16") else 4  # auto: float32 where no bf16
    return 2 * layers * kv_heads * head_dim * width * knobs.kv_token_budget


def _size(path: Path | None) -> int:
    """A file's size (with torch.onnx's external ``.data`` beside it), or a folder's."""
    if path is None or not path.exists():
        return 0
    if path.is_file():
        data = path.with_name(path.name + ".data")
        return path.stat().st_size + (data.stat().st_size if data.is_file() else 0)
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
