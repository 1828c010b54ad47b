"""What identifies a model's results, for a result cache: the files its weights and tokenizer
are read from, the spec's options that change what it computes, and the versions of what runs
it. Two loads with the same identity give the same result for the same input (up to the last
bits a batch's padding may move). A text generator's identity also holds what its knobs change
in the tokens: the backend (torch or vLLM), the dtype it computes in (``auto`` as chosen on
this machine) and the kind of device.

The backend that claims a spec names its files and what else changes its results (its
:class:`~batchline.models.backend.Backend` ``identity``); this module adds the spec's options
and hashes them. A file of at most :data:`HASHED_BYTES` is identified by its content; a
larger one (weights) by its size and modification time, so that a job does not read
gigabytes to start: a weights file rewritten in place changes its modification time. A
user's Python model (``module:factory``) has no identity (its code is not a file we can read
as its model), so its results are never cached.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from batchline.knobs import Knobs
from batchline.models.common.files import version
from batchline.models.registry import BACKENDS
from batchline.models.specs import ModelSpec

__all__ = ["HASHED_BYTES", "model_identity"]

#: Files up to this size are identified by their content, larger ones by size and mtime.
HASHED_BYTES = 64 << 20


def model_identity(spec: ModelSpec, knobs: Knobs | None = None) -> str | None:
    """A hex digest that changes when the model's files, its spec's options or the versions
    of batchline and ONNX Runtime change; None for a model whose backend cannot identify it
    (a Python model). A text generator's (``spec.generates``) changes with what ``knobs``
    change in its tokens too (its backend's options); a batch model's ignores ``knobs`` but
    ``precision`` (as chosen: the job resolves ``auto`` first), int8 and bf16 vectors
    differing in the bits."""
    own = BACKENDS.claiming(spec, knobs or Knobs()).identity(spec, knobs)
    if own is None:
        return None
    digest = hashlib.sha256()
    options: dict[str, object] = {
        "kind": spec.kind,
        "task": spec.task,
        "labels": spec.labels,
        "pooling": spec.pooling,
        "normalize": spec.normalize,
        "versions": [version("batchline"), version("onnxruntime")],
    }
    if spec.image is not None:  # a plain .onnx reading pictures: its preprocessing flags
        options["image"] = [spec.image.size, spec.image.mean, spec.image.std]
    # only when set, so that the identities of models without them stay as they were
    options.update({k: v for k, v in (("top_k", spec.top_k), ("input", spec.input_kind)) if v})
    if not spec.generates:  # a generator's dtype is its backend's option
        options.update(_precision(knobs))
    options.update(own.options)
    digest.update(json.dumps(options, sort_keys=True).encode())
    for path in own.files:
        _add_file(digest, path)
    return digest.hexdigest()


def _precision(knobs: Knobs | None) -> dict[str, object]:
    """What an embedding model's precision changes in its vectors' bits (any backend's)."""
    if knobs is not None and knobs.precision == "int8":
        from batchline.models.onnx import QUANTIZE_VERSION

        return {"quantize": ["int8", QUANTIZE_VERSION]}
    if knobs is not None and knobs.precision == "bf16":
        return {"precision": ["bf16", version("torch"), version("transformers")]}
    return {}


def _add_file(digest: hashlib._Hash, path: Path) -> None:
    stat = path.stat()
    digest.update(f"\0{path.name}\0{stat.st_size}\0".encode())
    if stat.st_size > HASHED_BYTES:
        digest.update(str(stat.st_mtime_ns).encode())
        return
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
