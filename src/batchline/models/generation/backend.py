"""The text generators' backend (``smollm2``, a causal-LM folder, a ``.gguf``): a spec that
generates is served by a text generator (:func:`~batchline.models.generation.load_text_generator`),
not loaded as a batch function, so this backend's ``load`` refuses it; its memory and its
identity are asked like any other backend's.
"""

from __future__ import annotations

import json
from pathlib import Path

from batchline._errors import InputError, ModelError
from batchline._sizes import format_size
from batchline.models.backend import Backend, Footprint, Identity, Loaded, text_input
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
    """A GGUF file's model on the torch backend: :func:`_gguf_footprint`. A folder's: twice
    its weights (the engine's packed copies beside the model's), an eighth more at the peak,
    plus the KV cache (measured: ``models/footprint.py``)."""
    if knobs.generation_backend != "vllm" and spec.kind in ("builtin", "gguf"):
        return _gguf_footprint(spec, knobs)
    folder = _folder(spec)
    weights = _weights_bytes(folder)
    if not weights or folder is None:
        return Footprint(0, 0)
    kv = _kv_bytes(folder / "config.json", knobs)
    return Footprint(2 * weights + kv, 2 * weights + kv + weights // 4, "torch", _advice(kv, knobs))


def _advice(kv: int, knobs: GenerationBackendOptions) -> str:
    """What shrinks a generator's footprint where its KV cache is part of it."""
    if not kv:
        return ""
    if knobs.generation_backend == "vllm":
        return f"lower --kv-cache-gib ({format_size(kv)} of it is vLLM's KV cache)"
    positions = f"{knobs.kv_token_budget:,} positions"
    return f"lower --kv-token-budget ({format_size(kv)} of it is the KV cache of {positions})"


def _weights_bytes(folder: Path | None) -> int:
    """The bytes of the weight files transformers loads from a folder (its ``*.safetensors``,
    else its ``*.bin``), not the rest it may hold (a GGUF made from it, an ONNX export); a
    file's own size (a vLLM ``.gguf``)."""
    if folder is None or not folder.is_dir():
        return size(folder)
    for pattern in ("*.safetensors", "*.bin"):
        files = [p for p in folder.glob(pattern) if p.is_file()]
        if files:
            return sum(p.stat().st_size for p in files)
    return size(folder)


#: A GGUF kept quantized holds its file's bytes times this, plus :data:`GGUF_EXTRA`: once
#: loaded, a server's resident memory less torch's runtime was x1.07 the file (a 1.7B Q8_0) to
#: x1.27 (a 1.7B Q4_K_M: its Q6_K linears held as int8 in groups of 32, 8.5 bits a weight where
#: the file has 6.6, and its Q4_K ones with a bf16 scale and zero a group, 5 where it has 4.5),
#: and the file plus ~200 MiB at 360M and Qwen2.5-0.5B shapes (Zen 5, 2026-12-05).
GGUF_HELD = 1.3
GGUF_EXTRA = 160 << 20


def _gguf_footprint(spec: ModelSpec, knobs: GenerationBackendOptions) -> Footprint:
    """What the torch backend's model of a GGUF file (a user's, or the built-in ``smollm2``'s)
    holds, zeros where the file is not there or not one the reader reads (the load says so).
    Kept quantized (``weights`` ``gguf``), the file's bytes
    by :data:`GGUF_HELD` plus :data:`GGUF_EXTRA`; laid out otherwise (float, or quantized again
    from a float copy), a folder's rule on its weights in ``dtype``: twice them. Plus the KV
    cache of ``kv_token_budget`` positions of the shape its header gives, in ``dtype`` (float32
    on int8 rows where ``auto`` takes it). The load peaks a quarter of the weights above them
    (kept: measured up to a fifth of the file, the block being made, ~0.5 GB at 3B), before
    any of the KV cache is taken."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from batchline.models.generation.gguf_header import read_gguf_file
    from batchline.models.generation.smollm2 import gguf_path

    try:
        dtype, weights = _precision(spec, knobs)
        path = spec.path if spec.kind == "gguf" else gguf_path()
        file = read_gguf_file(path)
        file_bytes = path.stat().st_size
    except (ModelError, OSError):
        return Footprint(0, 0)
    width = 2 if dtype in ("bfloat16", "float16") else 4
    if weights == "gguf":
        held = int(GGUF_HELD * file_bytes) + GGUF_EXTRA
    else:
        values = 0
        for t in file.tensors:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(t.tensor_type)]
            values += t.data.nbytes // block_bytes * block
        held = 2 * values * width
    metadata = file.metadata
    arch = metadata.get("general.architecture")
    try:
        layers = int(metadata[f"{arch}.block_count"])
        heads = int(metadata[f"{arch}.attention.head_count"])
        kv_heads = int(metadata.get(f"{arch}.attention.head_count_kv") or heads)
        head_dim = int(
            metadata.get(f"{arch}.attention.key_length")
            or int(metadata[f"{arch}.embedding_length"]) // heads
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        layers = kv_heads = head_dim = 0  # a header that does not say the shape: weights only
    kv = _kv_positions_bytes(layers, kv_heads, head_dim, dtype, knobs)
    # the KV cache grows with the traffic after the load: its peak is the weights' alone
    return Footprint(held + kv, held + held // 4, "torch", _advice(kv, knobs))


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
    return _kv_positions_bytes(layers, kv_heads, head_dim, knobs.dtype, knobs)  # auto: float32


def _kv_positions_bytes(
    layers: int, kv_heads: int, head_dim: int, dtype: str, knobs: GenerationBackendOptions
) -> int:
    """Keys and values of ``kv_token_budget`` positions of that shape in ``dtype`` (2 bytes a
    value for bf16 and fp16, else 4)."""
    width = 2 if dtype in ("bfloat16", "float16") else 4
    return 2 * layers * kv_heads * head_dim * width * knobs.kv_token_budget


def _identity(spec: ModelSpec, knobs: GenerationBackendOptions | None) -> Identity:
    """What changes a generator's tokens beyond its files: the backend and its version, the
    dtype (float32 and bf16 round differently), the weights and int8 rows where taken, the
    kind of device (CPU and CUDA kernels differ in the last bits), and for ``smollm2`` the
    version of the GGUF's conversion. Not the batching kind nor the caps: greedy and seeded
    tokens depend on them only as far as a row's last bits do (the int kernels take other
    paths at other row counts: vdpbf16ps at one row and AMX from two, int8 rows below
    ``quant_kernel.A8_BF16_ROWS`` on AMX hosts)."""
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
    if backend != "vllm" and _int8_rows(spec, knobs, dtype, weights):
        options["activations"] = "int8"  # rows rounded to 8 bits: other tokens
    if spec.kind == "builtin":
        from batchline.models.generation.smollm2 import CONVERTER_VERSION

        options["converter"] = CONVERTER_VERSION
    elif spec.kind == "gguf" and backend != "vllm":
        from batchline.models.generation.gguf_weights import LOADER_VERSION

        options["gguf_loader"] = LOADER_VERSION
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


def _int8_rows(spec: ModelSpec, knobs: GenerationBackendOptions, dtype: str, weights: str) -> bool:
    """Whether the torch backend's int kernel takes int8 rows for ``spec`` held in ``weights``
    (as laid out) computing in ``dtype`` on a CPU, as its load chooses them from the host's
    flags (``spec_activations``; a host whose kernel library then fails to build computes
    float rows under an int8 identity: a result not found, never a wrong one served)."""
    from batchline.models.generation.engine_choices import spec_activations

    if knobs.device != "cpu":
        return False
    try:
        return spec_activations(spec, knobs, weights, dtype).activations == "int8"
    except ValueError:  # refused at load, before any token
        return False


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
    input_kind=text_input,
)
