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
from pathlib import Path
from typing import TYPE_CHECKING

from batchline.knobs import GENERATION_DTYPES, WEIGHT_FORMATS

if TYPE_CHECKING:
    import torch

__all__ = [
    "HOST_KINDS",
    "DtypeChoice",
    "HostKind",
    "WeightsChoice",
    "choose_dtype",
    "choose_weights",
    "cpu_flags",
    "host_kind",
    "pack_linear_weights",
]

# CPU flags (Linux names) of native bf16 arithmetic.
_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


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


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """This CPU's feature flags (Linux ``/proc/cpuinfo``); empty where there is none."""
    try:
        text = cpuinfo.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


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
    found = sorted(set(_BF16_FLAGS) & set(cpu_flags() if flags is None else flags))
    if found:
        return DtypeChoice("bfloat16", f"auto: the CPU has native bf16 ({', '.join(found)})")
    return DtypeChoice("float32", "auto: no native bf16 on this CPU (no avx512_bf16 or amx_bf16)")


@dataclass(frozen=True, slots=True)
class HostKind:
    """A kind of CPU, by its flags, and the defaults it takes: ``dtype`` for ``dtype = auto``
    and whether ``weights = auto`` keeps a GGUF's quantized tensors quantized; ``measured``
    says where the choice comes from."""

    name: str
    flags: tuple[str, ...]  # any of them makes a CPU this kind (the first kind that matches)
    dtype: str
    gguf_quantized: bool
    measured: str


#: The CPU kinds, most capable first. Measured where it says; the others follow from what
#: their flags lack, and say so.
HOST_KINDS = (
    HostKind(
        "amx",
        ("amx_bf16",),
        "bfloat16",
        True,
        "measured on the 2-core AMX Xeon (2026-12-01): torch's int4 kernel x0.55, int8 x0.70 "
        "the time of a dense bf16 linear at one row (quant_linear.py)",
    ),
    HostKind(
        "avx512_bf16",
        ("avx512_bf16",),
        "bfloat16",
        True,
        "bf16 measured x1.6 faster than float32 (2026-11-24); the int kernels not measured on "
        "this kind: taken as on AMX, whose kernels they share without the tiles",
    ),
    HostKind(
        "avx2",
        (),
        "float32",
        False,
        "no native bf16: float32; torch's int kernels in float32 took 4-25x a dense float32 "
        "linear (on the AMX host), so a GGUF is dequantized, as before",
    ),
)


def host_kind(flags: Collection[str] | None = None) -> HostKind:
    """The first of :data:`HOST_KINDS` whose flags this CPU has (``flags`` default:
    :func:`cpu_flags`); the last (``avx2``: neither bf16 flag) otherwise."""
    have = set(cpu_flags() if flags is None else flags)
    for kind in HOST_KINDS:
        if not kind.flags or have & set(kind.flags):
            return kind
    return HOST_KINDS[-1]


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
    quantized tensors where the host's kind says so (:data:`HOST_KINDS`) and the model
    computes in bf16: torch's int kernels in float32 are the slow ones."""
    if asked not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {asked!r}")
    if asked != "auto":
        return WeightsChoice(asked, "asked for")
    if not gguf:
        return WeightsChoice("float", "auto: a folder's weights as they are")
    kind = host_kind(flags)
    if not kind.gguf_quantized:
        return WeightsChoice("float", f"auto on this {kind.name} CPU: {kind.measured}")
    if dtype != "bfloat16":
        return WeightsChoice(
            "float", "auto in float32: torch's int kernels took 4-25x a dense float32 linear"
        )
    return WeightsChoice("gguf", f"auto on this {kind.name} CPU: {kind.measured}")


def pack_linear_weights(model: torch.nn.Module) -> int:
    """Replace ``model``'s fp32 and bf16 ``nn.Linear`` layers on CPU by ones whose weights are
    packed once for oneDNN (the blocked layout its kernels want), and return how many. Nothing
    changes on other devices, or without oneDNN (bf16: without its bf16 support).

    bf16 outputs are the same bit for bit; fp32 ones differ in the last bits (another summation
    order), and SmolLM2's greedy tokens still equal transformers' ``generate`` on the 22-prompt
    test (tests/models/generation/test_smollm2.py). Measured on SmolLM2-135M, one core with
    avx512_bf16, a 16-row decode step, in-process A/B on a busy machine: fp32 750 -> 520 ms,
    bf16 198 -> 139 ms; the 49k-wide lm_head alone: fp32 116 -> 48 ms, bf16 10 -> 5.8 ms.
    The model stays on CPU afterwards (packed weights do not move).
    """
    import torch

    from batchline.models.generation.packed_linear import PackedLinear

    dtypes = set()
    if torch.backends.mkldnn.is_available():  # type: ignore[no-untyped-call]
        dtypes.add(torch.float32)
        if torch.ops.mkldnn._is_mkldnn_bf16_supported():
            dtypes.add(torch.bfloat16)
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if (
                type(child) is torch.nn.Linear
                and child.weight.dtype in dtypes
                and child.weight.device.type == "cpu"
            ):
                swaps.append((parent, name, child))
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    return len(swaps)
