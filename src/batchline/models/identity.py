"""What identifies a model's results, for a result cache: the files its weights and tokenizer
are read from, the spec's options that change what it computes, and the versions of what runs
it. Two loads with the same identity give the same result for the same input (up to the last
bits a batch's padding may move). A text generator's identity also holds what its knobs change
in the tokens: the backend (torch or vLLM), the dtype it computes in (``auto`` as chosen on
this machine) and the kind of device.

A file of at most :data:`HASHED_BYTES` is identified by its content; a larger one (weights)
by its size and modification time, so that a job does not read gigabytes to start: a weights
file rewritten in place changes its modification time. A user's Python model
(``module:factory``) has no identity (its code is not a file we can read as its model), so
its results are never cached.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

from batchline.knobs import Knobs
from batchline.models.specs import ModelSpec

__all__ = ["HASHED_BYTES", "model_identity"]

#: Files up to this size are identified by their content, larger ones by size and mtime.
HASHED_BYTES = 64 << 20


def model_identity(spec: ModelSpec, knobs: Knobs | None = None) -> str | None:
    """A hex digest that changes when the model's files, its spec's options or the versions
    of batchline and ONNX Runtime change; None for a Python model. A text generator's
    (``spec.generates``) changes with what ``knobs`` change in its tokens too
    (:func:`_generation_options`); a batch model's ignores ``knobs`` but ``precision`` (as
    chosen: the job resolves ``auto`` first), int8 and bf16 vectors differing in the bits."""
    if spec.kind == "python":
        return None
    digest = hashlib.sha256()
    options: dict[str, object] = {
        "kind": spec.kind,
        "task": spec.task,
        "labels": spec.labels,
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "versions": [_version("batchline"), _version("onnxruntime")],
    }
    if spec.image is not None:  # a plain .onnx reading pictures: its preprocessing flags
        options["image"] = [spec.image.size, spec.image.mean, spec.image.std]
    # only when set, so that the identities of models without them stay as they were
    options.update({k: v for k, v in (("top_k", spec.top_k), ("input", spec.input_kind)) if v})
    if spec.generates:
        options.update(_generation_options(spec, knobs or Knobs()))
    elif knobs is not None and knobs.precision == "int8":
        from batchline.models.onnx.quantize import QUANTIZE_VERSION

        options["quantize"] = ["int8", QUANTIZE_VERSION]
    elif knobs is not None and knobs.precision == "bf16":
        options["precision"] = ["bf16", _version("torch"), _version("transformers")]
    digest.update(json.dumps(options, sort_keys=True).encode())
    for path in _files(spec):
        _add_file(digest, path)
    return digest.hexdigest()


def _generation_options(spec: ModelSpec, knobs: Knobs) -> dict[str, object]:
    """What changes a generator's tokens beyond its files: the backend and its version, the
    dtype (float32 and bf16 round differently), the kind of device (CPU and CUDA kernels
    differ in the last bits), and for ``smollm2`` the version of the GGUF's conversion. Not
    the batching kind nor the caps: greedy and seeded tokens do not depend on them."""
    from batchline.models.generation import choose_dtype

    backend = knobs.generation_backend
    runs_it = ["vllm"] if backend == "vllm" else ["torch", "transformers"]
    options: dict[str, object] = {
        "task": "generate",
        "backend": backend,
        "dtype": choose_dtype(knobs.dtype, knobs.device).dtype,
        "weights": _weights(spec, knobs),
        "device": "cuda" if knobs.device.startswith("cuda") else knobs.device,
        "generation_versions": [_version(p) for p in runs_it],
    }
    if spec.kind == "builtin":
        from batchline.models.generation.smollm2 import CONVERTER_VERSION

        options["converter"] = CONVERTER_VERSION
    return options


def _weights(spec: ModelSpec, knobs: Knobs) -> str:
    """How the torch backend holds the weights (quantized ones round differently)."""
    from batchline.models.generation import choose_dtype
    from batchline.models.generation.torch_dtype import choose_weights

    if knobs.generation_backend == "vllm":
        return "float"
    dtype = choose_dtype(knobs.dtype, knobs.device).dtype
    gguf = spec.kind in ("builtin", "gguf")
    return choose_weights(knobs.weights, gguf=gguf, dtype=dtype).weights


def _files(spec: ModelSpec) -> list[Path]:
    if spec.kind == "builtin":
        from batchline.models.builtin import BUILTIN_MODELS

        return _tree(BUILTIN_MODELS[spec.source].package_dir())
    if spec.kind == "onnx":
        files = [spec.path]
        # the tokenizer beside it, or the one the spec names
        tokenizer = spec.tokenizer or spec.path.with_name("tokenizer.json")
        return [*files, tokenizer] if tokenizer.is_file() else files
    if spec.kind == "gguf":
        return [spec.path]
    return _tree(spec.path)  # a Hugging Face folder


def _tree(folder: Path) -> list[Path]:
    """The folder's files, but hidden ones and Python's bytecode (written when imported)."""
    return sorted(
        p
        for p in folder.rglob("*")
        if p.is_file()
        and p.suffix != ".pyc"
        and not any(
            part.startswith(".") or part == "__pycache__" for part in p.relative_to(folder).parts
        )
    )


def _add_file(digest: hashlib._Hash, path: Path) -> None:
    stat = path.stat()
    digest.update(f"\0{path.name}\0{stat.st_size}\0".encode())
    if stat.st_size > HASHED_BYTES:
        digest.update(str(stat.st_mtime_ns).encode())
        return
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ""
