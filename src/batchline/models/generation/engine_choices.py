"""What a torch-engine load decides before it reads a weight: the dtype a model computes in and
the weights it is held in (:func:`precision_for`, the host's kind by way of
:func:`~batchline.models.generation.torch_dtype.choose_precision`), what the own int4 kernel
multiplies (:func:`activations_for`), what computes the dense linears (:func:`dense_for`), the
dtype a folder's weights are read in to be quantized (:func:`stored_bf16`), and the threads the
engine computes on (:func:`engine_threads`). Each is checked against the device and the knobs so
that a bad choice fails before anything is read."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

from batchline._errors import InputError
from batchline.knobs import machine_cores
from batchline.models.generation.options import TorchEngineOptions
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    import torch

    from batchline.models.generation.dense_tiles import DenseChoice
    from batchline.models.generation.torch_dtype import (
        ActivationsChoice,
        DtypeChoice,
        WeightsChoice,
    )

__all__ = [
    "MULTI_THREAD_WEIGHTS",
    "activations_for",
    "dense_for",
    "engine_threads",
    "precision_for",
    "spec_activations",
    "stored_bf16",
]


def precision_for(
    spec: ModelSpec, knobs: TorchEngineOptions, device: torch.device
) -> tuple[DtypeChoice, WeightsChoice]:
    """The dtype ``spec`` computes in and the weights it is held in (``knobs.dtype`` and
    ``knobs.weights``, ``auto`` by the host: ``choose_precision``), checked against ``device``
    before anything is read."""
    from batchline.models.generation.torch_dtype import WeightsChoice

    choice, weights = spec_precision(spec, knobs)
    if weights.weights in ("int8", "int4") and device.type != "cpu":
        raise InputError(
            f"weights = {weights.weights!r} computes through torch's CPU kernels: on "
            f"{device.type} leave weights 'auto' or 'float'"
        )
    if weights.weights != "float":
        from batchline.models.generation.quant_linear import require_int_kernels

        require_int_kernels()
    if weights.weights == "gguf" and device.type != "cpu":
        weights = WeightsChoice("float", f"{device.type}: the int kernels are torch's CPU ones")
    return choice, weights


def spec_precision(spec: ModelSpec, knobs: TorchEngineOptions) -> tuple[DtypeChoice, WeightsChoice]:
    """``choose_precision`` for ``spec`` and the knobs' dtype, weights and device: what the
    loader, the load log and the job's identity all take."""
    from batchline.models.generation.torch_dtype import choose_precision

    gguf, gguf_float = is_gguf(spec), float_gguf(spec)
    return choose_precision(
        knobs.dtype,
        knobs.weights,
        knobs.device,
        gguf=gguf,
        gguf_float=gguf_float,
        kernel_missing=_f32_kernel_missing(knobs) if gguf and not gguf_float else None,
    )


def _f32_kernel_missing(knobs: TorchEngineOptions) -> str | None:
    """Why the own int4 kernel's float32 path does not run here (``quant_kernel.own_kernels``:
    the library built, or loaded from the kernel folder), None where it does: what ``auto``
    asks before it keeps a GGUF's blocks in float32. Asked only of a quantized GGUF whose
    weights ``auto`` chooses on the CPU, so that nothing else builds the library for it."""
    if knobs.weights != "auto" or knobs.device != "cpu":
        return None
    import torch

    from batchline.models.generation.quant_kernel import own_kernels

    runs, why = own_kernels(dtype=torch.float32)
    return None if runs else why


def is_gguf(spec: ModelSpec) -> bool:
    """Whether ``spec`` is read from a GGUF file (a user's, or the built-in ``smollm2``)."""
    return spec.kind in ("builtin", "gguf")


def float_gguf(spec: ModelSpec) -> bool:
    """Whether ``spec`` is a user's GGUF file whose layers' linears are all float
    (:func:`~.gguf_header.gguf_float_linears`); False for anything else."""
    if spec.kind != "gguf":
        return False
    from batchline.models.generation.gguf_header import gguf_float_linears

    return gguf_float_linears(spec.path)


def laid_out_as(spec: ModelSpec, weights: str) -> str:
    """How ``spec``'s weights are laid out once loaded (``lay_out_weights``'s ``weights``) and
    what the job's identity names: ``gguf`` for a file whose linears are all float
    (:func:`float_gguf`) is ``float``, laid out as a float folder is, its lm_head kept in the
    model's dtype (a quantized file's head goes to int8 in groups of 32, as its linears are
    int); else ``weights``."""
    return "float" if weights == "gguf" and float_gguf(spec) else weights


def spec_activations(
    spec: ModelSpec, knobs: TorchEngineOptions, weights: str, dtype: str
) -> ActivationsChoice:
    """``choose_activations`` for ``spec`` held in ``weights`` as laid out (:func:`laid_out_as`:
    a GGUF of float linears is ``float``) computing in ``dtype``, and the knobs' activations
    and dtype: what the loader and the job's identity both take. ``ValueError`` where ``int8``
    is asked and does not apply."""
    from batchline.models.generation.torch_dtype import choose_activations

    return choose_activations(
        knobs.activations,
        weights=weights,
        dtype=dtype,
        dtype_asked=knobs.dtype != "auto",
    )


def activations_for(
    spec: ModelSpec, knobs: TorchEngineOptions, weights: str, dtype: str
) -> ActivationsChoice:
    """What the own int4 kernel multiplies (:func:`spec_activations`), checked before
    anything is read: ``int8`` asked where it does not apply or cannot run is an error. A bf16
    model's int weights take int8 rows only through the own bf16 int4 kernel, so where that
    does not run here (no AVX512-BF16: torch's kernels instead) they cannot either."""
    import torch

    from batchline.models.generation.quant_kernel import int8_activations_here, own_kernels
    from batchline.models.generation.torch_dtype import ActivationsChoice

    try:
        chosen = spec_activations(spec, knobs, weights, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if chosen.activations == "int8":
        here, why = int8_activations_here()  # the kernel library built and loaded
        if here and dtype == "bfloat16":
            here, why = own_kernels(dtype=torch.bfloat16)
        if not here and knobs.activations == "int8":
            raise InputError(f"activations = 'int8' cannot run here: {why}")
        if not here:
            return ActivationsChoice("float", f"auto: the int8 kernel does not run here: {why}")
    return chosen


def dense_for(knobs: TorchEngineOptions, dtype: torch.dtype) -> DenseChoice:
    """What computes the dense linears (``knobs.dense_linears``), checked before anything is
    read: ``tiles`` asked where they cannot run is an error; ``auto`` takes oneDNN where the
    kernel library that holds the tiles is not built (no compiler), saying why."""
    from batchline.models.generation import quant_kernel
    from batchline.models.generation.dense_tiles import DenseChoice, choose_dense

    try:
        chosen = choose_dense(knobs.dense_linears, dtype)
    except ValueError as exc:
        raise InputError(str(exc)) from exc
    if chosen.tiles:
        runs, why = quant_kernel.own_kernels(dtype=dtype)  # builds the library where it can
        if not runs and knobs.dense_linears == "tiles":
            raise InputError(f"dense_linears=tiles cannot run here: {why}")
        if not runs:
            return DenseChoice("onednn", f"auto: the own tiles do not run here: {why}")
    return chosen


def stored_bf16(folder: Path) -> torch.dtype | None:
    """bf16 where ``folder``'s config says its weights are stored in it, else None."""
    import torch

    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None  # load_causal_lm says what is wrong with the folder
    stored = config.get("dtype") or config.get("torch_dtype")
    return torch.bfloat16 if stored == "bfloat16" else None


#: From this many weights a decode step multiplies (its linears' inputs x outputs, whatever their
#: format) a bfloat16 engine computes on every core: the step is long enough that a second
#: thread pays (see :func:`engine_threads`).
MULTI_THREAD_WEIGHTS = 250_000_000


def engine_threads(
    knobs: TorchEngineOptions, dtype: torch.dtype, step_weights: int | None = None
) -> int:
    """The CPU threads the torch engine computes on: ``knobs.generation_threads`` where set;
    else every core (:func:`~batchline.knobs.machine_cores`) in float32, and in bfloat16 every
    core for a model whose step multiplies ``step_weights`` >= :data:`MULTI_THREAD_WEIGHTS`
    (``None``: not known yet, while loading), one below.

    Measured through ``serve``, 16 streaming chat clients, 2-core hosts, quiet. SmolLM2-135M
    (``bench_vs_vllm.py``, AVX-512, 2026-11-28): float32 331 tokens/s on two threads, 279 on
    one; bfloat16 438 and 439, since its step's other ops and the front end take the second
    core's time back. A 1.7B shape (``bench_sizes.py``, AMX, 2026-12-02): bfloat16 60.5 against
    40.0 (6.4 against 3.7 at one client), int4 73.7 against 49.6. A 360M shape's batch-1 step:
    40 ms on two threads against 67 (``bench_quant_step.py``). With two other busy processes,
    two float32 threads made 0.81x of one: set ``generation_threads = 1`` where work shares
    the cores."""
    if knobs.generation_threads is not None:
        return knobs.generation_threads
    import torch

    if dtype == torch.float32:
        return machine_cores()
    large = step_weights is not None and step_weights >= MULTI_THREAD_WEIGHTS
    return machine_cores() if large else 1
