"""Which dtype the torch backend computes in (``Knobs.dtype``: ``auto``, ``float32``,
``bfloat16``), and bf16 weights packed for the CPU's matrix units.

``auto`` takes bfloat16 where the hardware computes it natively — a CUDA device that supports
it, or a CPU with AVX512-BF16 or AMX (its ``/proc/cpuinfo`` flags) — and float32 elsewhere,
where bf16 would be emulated and slower. Measured on SmolLM2-135M, one core with avx512_bf16
(2026-11-24, the machine still quiet, plain ``nn.Linear``): a 16-row decode step ~180 ms in
fp32, ~110 ms in bf16; benchmarks/bench_engine_levers.py compares the dtypes on a workload.

float32 keeps greedy tokens equal to transformers' ``generate`` on the sequence alone; bf16
changes some (benchmarks/bench_dtype.py measures how many, and the demo math accuracy).

Only the standard library at import: the choice is made (and tested) without torch.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import TYPE_CHECKING

from batchline._cpu import BF16_FLAGS, cpu_flags, host_kind
from batchline.knobs import GENERATION_DTYPES, WEIGHT_FORMATS
from batchline.models.common.torch_weights import pack_linear_weights

if TYPE_CHECKING:
    import torch

__all__ = [
    "KIND_DEFAULTS",
    "DtypeChoice",
    "KindDefaults",
    "WeightsChoice",
    "choose_dtype",
    "choose_weights",
    "cpu_flags",
    "kind_defaults",
    "pack_linear_weights",
]


@dataclass(frozen=True, slots=True)
class DtypeChoice:
    """The dtype a model loads in, and why (said in the startup log and the job summary)."""

    dtype: str  # float32 or bfloat16
    reason: str

    def __str__(self) -> str:
        return f"{self.dtype} ({self.reason})"

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return torch.bfloat16 if self.dtype == "bfloat16" else torch.float32


def choose_dtype(
    asked: str,
    device: str,
    *,
    flags: Collection[str] | None = None,
    cuda_bf16: bool | None = None,
) -> DtypeChoice:
    """The dtype for ``asked`` (one of ``GENERATION_DTYPES``) on ``device`` (``cpu``, ``cuda[:N]``).

    ``flags`` (default: :func:`cpu_flags`) and ``cuda_bf16`` (default: torch's
    ``cuda.is_bf16_supported()``) are what ``auto`` looks at; tests pass them by hand.
    """
    if asked not in GENERATION_DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(GENERATION_DTYPES)}, got {asked!r}")
    if asked != "auto":
        return DtypeChoice(asked, "asked for")
    if device.startswith("cuda"):
        if cuda_bf16 is None:
            import torch

            cuda_bf16 = bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
        if cuda_bf16:
            return DtypeChoice("bfloat16", "auto: the CUDA device computes bf16")
        return DtypeChoice("float32", "auto: the CUDA device has no bf16")
    found = sorted(set(BF16_FLAGS) & set(cpu_flags() if flags is None else flags))
    if found:
        return DtypeChoice("bfloat16", f"auto: the CPU has native bf16 ({', '.join(found)})")
    return DtypeChoice("float32", "auto: no native bf16 on this CPU (no avx512_bf16 or amx_bf16)")


@dataclass(frozen=True, slots=True)
class KindDefaults:
    """What a kind of CPU (``batchline._cpu.host_kind``'s name) takes by default: ``dtype`` for
    ``dtype = auto`` and whether ``weights = auto`` keeps a GGUF's quantized tensors quantized;
    ``measured`` says where the choice comes from."""

    dtype: str
    gguf_quantized: bool
    measured: str


_NO_BF16 = KindDefaults(
    "float32",
    False,
    "no native bf16: float32; torch's int kernels in float32 took 4-25x a dense float32 "
    "linear (on the AMX host), so a GGUF is dequantized, as before",
)
#: Each CPU kind's defaults (``batchline._cpu``'s kinds). Measured where it says; the others
#: follow from what their flags lack, and say so.
KIND_DEFAULTS: dict[str, KindDefaults] = {
    "amx": KindDefaults(
        "bfloat16",
        True,
        "measured on the 2-core AMX Xeon (2026-12-01): torch's int4 kernel x0.55, int8 x0.70 "
        "the time of a dense bf16 linear at one row (quant_linear.py)",
    ),
    "avx512-bf16": KindDefaults(
        "bfloat16",
        True,
        "bf16 measured x1.6 faster than float32 (2026-11-24); the int kernels not measured on "
        "this kind: taken as on AMX, whose kernels they share without the tiles",
    ),
    "vnni": _NO_BF16,
    "avx2": _NO_BF16,
    "other": _NO_BF16,
}


def kind_defaults(flags: Collection[str] | None = None) -> tuple[str, KindDefaults]:
    """This CPU's kind (``flags`` default: its own) and the defaults it takes."""
    name = host_kind(flags).name
    return name, KIND_DEFAULTS.get(name, _NO_BF16)


@dataclass(frozen=True, slots=True)
class WeightsChoice:
    """How the torch backend holds the linears (``float``, ``int8``, ``int4``, or ``gguf``: a
    GGUF file's own quantized tensors), and why (said in the load log)."""

    weights: str
    reason: str

    def __str__(self) -> str:
        return f"{self.weights} weights ({self.reason})"


def choose_weights(
    asked: str, *, gguf: bool, dtype: str, flags: Collection[str] | None = None
) -> WeightsChoice:
    """The weights for ``asked`` (one of ``WEIGHT_FORMATS``) of a model from a GGUF file
    (``gguf``) or a folder, computed in ``dtype`` (``choose_dtype``'s). ``auto`` keeps a GGUF's
    quantized tensors where the host's kind says so (:data:`KIND_DEFAULTS`) and the model
    computes in bf16: torch's int kernels in float32 are the slow ones."""
    if asked not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {asked!r}")
    if asked != "auto":
        return WeightsChoice(asked, "asked for")
    if not gguf:
        return WeightsChoice("float", "auto: a folder's weights as they are")
    name, kind = kind_defaults(flags)
    if not kind.gguf_quantized:
        return WeightsChoice("float", f"auto on this {name} CPU: {kind.measured}")
    if dtype != "bfloat16":
        return WeightsChoice(
            "float", "auto in float32: torch's int kernels took 4-25x a dense float32 linear"
        )
    return WeightsChoice("gguf", f"auto on this {name} CPU: {kind.measured}")
