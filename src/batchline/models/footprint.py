"""``estimate_footprint``: the memory a model will hold, read off its files before its first
load, and the memory its backend's runtime adds once per process.

What a memory budget admits a load on (``batchline.server.residency``). Each backend has its
rule (its :class:`~batchline.models.backend.Backend` ``footprint``: ``onnx_footprint`` in
``models/onnx/backend.py``, the generators' in ``models/generation/backend.py``), measured
once on the models it serves and written down here; a model whose backend does not know
(``module:factory``, a Hugging Face text folder) estimates 0, and its first load measures it.

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

Torch text generators of a Hugging Face folder, measured the same day on a random Llama of
SmolLM2-135M's shape (513 MiB of float32 safetensors, float32 on this CPU): a load grew the
process by 1,029-1,063 MiB and peaked there, so twice the weights (the engine's packed copies
beside the model's), an eighth more at the peak for safety; plus the KV cache at
``kv_token_budget`` positions, read off ``config.json`` (allocated as the traffic needs it, but
all of it is the model's at full load): 720 MiB for SmolLM2 at 16,384 positions in float32.
Importing torch, transformers and the engine adds 345-363 MiB, once. A folder's weights are its
``*.safetensors`` (else ``*.bin``) alone: a GGUF made from it beside them is not read.

A GGUF file on the torch backend (a user's, the built-in ``smollm2``), measured 2026-12-05 on a
2-core Zen 5 EPYC (``VmRSS`` and ``VmHWM`` of ``batchline serve`` once ready, less torch's
runtime): kept quantized, the model held x1.07 (a 1.7B Q8_0) to x1.27 (a 1.7B Q4_K_M) its
file, and the file plus ~200 MiB at 360M and Qwen2.5-0.5B shapes, so 1.3 times the file plus
160 MiB; its load peaked up to a fifth of the file above that (a quarter is counted). Laid out
as float, a folder's rule on its values in the dtype. The KV cache's shape comes from its
header, in the dtype it computes in; a load's peak holds none of it (the traffic takes it).
Where the KV cache is part of a footprint the budget's refusal says that ``--kv-token-budget``
(vLLM: ``--kv-cache-gib``) shrinks it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import cast

from batchline.models.backend import Footprint
from batchline.models.config import Knobs
from batchline.models.protocol import Task
from batchline.models.registry import BACKENDS
from batchline.models.specs import ModelSpec

__all__ = ["Footprint", "estimate_footprint", "runtime_bytes"]

_MIB = 1 << 20

#: Bytes a backend's runtime adds to a process the first time one of its models loads.
RUNTIME_BYTES = {"onnx": 64 * _MIB, "torch": 363 * _MIB}
#: The module whose presence says the runtime is loaded already.
_RUNTIME_MODULE = {"onnx": "onnxruntime", "torch": "torch"}


def estimate_footprint(spec: ModelSpec, knobs: Knobs, task: str | None = None) -> Footprint:
    """The footprint of ``spec`` loaded with ``knobs`` for ``task`` (default: the spec's
    own), as the backend that claims it estimates it from its files (see the module
    docstring); zeros when its files are not there yet (the load will say what is missing)."""
    resolved = task or spec.task or spec.builtin_task
    # a task name from the caller's table: the backends' rules compare it, never trust it
    return BACKENDS.claiming(spec, knobs).footprint(spec, knobs, cast("Task | None", resolved))


def runtime_bytes(runtimes: Iterable[str]) -> int:
    """What the named runtimes will add to this process: those not imported yet."""
    return sum(
        RUNTIME_BYTES.get(r, 0)
        for r in set(runtimes)
        if r in _RUNTIME_MODULE and _RUNTIME_MODULE[r] not in sys.modules
    )
