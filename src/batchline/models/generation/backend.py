"""The text generators' backend (``smollm2``, a causal-LM folder, a ``.gguf``): a spec that
generates is served by a text generator (:func:`~batchline.models.generation.load_text_generator`),
not loaded as a batch function, so this backend's ``load`` refuses it; its memory and its
identity are asked like any other backend's.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchline._errors import InputError
from batchline.models.backend import Backend, Footprint, Identity, Loaded
from batchline.models.builtin import BUILTIN_MODELS
from batchline.models.common.files import size, tree, version
from batchline.models.generation.options import GenerationBackendOptions
from batchline.models.protocol import Task
from batchline.models.specs import ModelSpec

__all__ = ["GENERATION"]


def _claims(spec: ModelSpec, knobs: GenerationBackendOptions) -> bool:
    return spec.generates


def _load(spec: ModelSpec, knobs: GenerationBackendOptions) -> Loaded:
    raise InputError(
        f"model {spec.name!r} generates text: it is served by a text generator, not a "
        "batch function (batchline.models.generation)"
    )


def _footprint(spec: ModelSpec, knobs: GenerationBackendOptions, task: Task | None) -> Footprint:
    """Twice the weights (the engine's packed copies beside the model's), an eighth more at
    the peak, plus the KV cache (measured: ``models/footprint.py``)."""
    folder = _folder(spec)
    weights = size(folder)
    if not weights or folder is None:
        return Footprint(0, 0)
    steady = 2 * weights + _kv_bytes(folder / "config.json", knobs)
    return Footprint(steady, steady + weights // 4, "torch")


def _folder(spec: ModelSpec) -> Path | None:
    if spec.kind == "builtin":
        from batchline.models.generation.smollm2 import converted_folder

        return converted_folder()  # float32 safetensors, once converted (the GGUF is Q4)
    return spec.path if spec.kind in ("hf", "gguf") else None


def _kv_bytes(config: Path, knobs: GenerationBackendOptions) -> int:
    """A generator's KV cache: vLLM's ``kv_cache_gib`` (1 GiB on CPU by default), else
    ``kv_token_budget`` positions of the shape its ``config.json`` gives (0 where it does
    not say)."""
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


def _identity(spec: ModelSpec, knobs: GenerationBackendOptions | None) -> Identity:
    """What changes a generator's tokens beyond its files: the backend and its version, the
    dtype (float32 and bf16 round differently), the kind of device (CPU and CUDA kernels
    differ in the last bits), and for ``smollm2`` the version of the GGUF's conversion. Not
    the batching kind nor the caps: greedy and seeded tokens do not depend on them."""
    knobs = knobs or GenerationBackendOptions()
    backend = knobs.generation_backend
    runs_it = ["vllm"] if backend == "vllm" else ["torch", "transformers"]
    dtype, weights = _precision(spec, knobs)
    options: dict[str, object] = {
        "task": "generate",
        "backend": backend,
        "dtype": dtype,
        "weights": weights,
        "device": "cuda" if knobs.device.startswith("cuda") else knobs.device,
        "generation_versions": [version(p) for p in runs_it],
    }
    if spec.kind == "builtin":
        from batchline.models.generation.smollm2 import CONVERTER_VERSION

        options["converter"] = CONVERTER_VERSION
    return Identity(_files(spec), options)


def _precision(spec: ModelSpec, knobs: GenerationBackendOptions) -> tuple[str, str]:
    """The dtype it computes in and how the torch backend holds the weights (quantized ones
    round differently); vLLM's weights as the files hold them."""
    from batchline.models.generation.engine_choices import laid_out_as, spec_precision
    from batchline.models.generation.torch_dtype import choose_dtype

    if knobs.generation_backend == "vllm":
        return choose_dtype(knobs.dtype, knobs.device).dtype, "float"
    dtype, weights = spec_precision(spec, knobs)
    return dtype.dtype, laid_out_as(spec, weights.weights)


def _files(spec: ModelSpec) -> tuple[Path, ...]:
    if spec.kind == "builtin":
        return tuple(tree(BUILTIN_MODELS[spec.source].package_dir()))
    if spec.kind == "gguf":
        return (spec.path,)
    return tuple(tree(spec.path))  # a Hugging Face folder


GENERATION = Backend(
    name="generation",
    claims=_claims,
    load=_load,
    footprint=_footprint,
    identity=_identity,
)
