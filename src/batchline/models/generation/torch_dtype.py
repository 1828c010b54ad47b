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

from batchline._cpu import (
    A8_KERNEL_FLAGS,
    A8_VNNI_FLAGS,
    BF16_FLAGS,
    F32_KERNEL_FLAGS,
    cpu_flags,
    host_kind,
)
from batchline.models.common.torch_weights import pack_linear_weights
from batchline.models.generation.options import (
    ACTIVATION_FORMATS,
    GENERATION_DTYPES,
    WEIGHT_FORMATS,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "KIND_DEFAULTS",
    "ActivationsChoice",
    "DtypeChoice",
    "KindDefaults",
    "WeightsChoice",
    "choose_activations",
    "choose_dtype",
    "choose_precision",
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
    #: what int weights (int8, int4, a GGUF kept quantized) compute in under ``dtype = auto``
    int_dtype: str = "float32"
    #: why, where it is not ``dtype``
    int_measured: str = ""
    #: whether ``dense_linears = auto`` computes a bf16 model's dense linears through the
    #: library's tiles (``dense_tiles.py``) rather than oneDNN, and why
    dense_tiles: bool = False
    dense_measured: str = ""
    #: why ``activations = auto`` sums a bf16 model's rows of int weights as int8 (its few on
    #: an AMX host, every one elsewhere: ``quant_kernel.A8_BF16_ROWS``; empty: it keeps them
    #: bf16)
    bf16_int8_rows: str = ""


_NO_BF16 = KindDefaults(
    "float32",
    False,
    "no native bf16: float32; a GGUF kept quantized where the CPU has AVX2 and FMA (the own "
    "kernel's float32 path), else dequantized: torch's int kernels in float32 took 4-25x a "
    "dense float32 linear (on the AMX host)",
)
#: Why a GGUF computed in float32 keeps its quantized tensors where the CPU has AVX2 and FMA
#: (the own int4 kernel's float32 path, ``csrc/quant_gemm_f32.cpp``), and is dequantized where
#: it has not.
F32_KEPT = (
    "the own int4 kernel's float32 path: a 1.7B-shaped int4 step x0.32 the time of dense "
    "float32 (batch 1, 2-core Ice Lake Xeon, 2026-12-03), x0.28 in AVX2 vectors on the 2-core "
    "AVX2-only EPYC (Zen 2, the same day)"
)
F32_DEQUANTIZED = (
    "no AVX2 and FMA for the own int4 kernel's float32 path, and torch's int kernels in float32 "
    "took 4-25x a dense float32 linear"
)
#: Why a GGUF computed in float32 is dequantized where the CPU has the flags but the kernel
#: library does not run (no compiler, an unwritable kernel folder): torch's int kernels in its
#: place ran the shipped Q4_1 file at 183 ms a token and 5.1 s to a first token, dequantized
#: 53 ms and 0.13 s (2-core Ice Lake Xeon, 2026-12-07).
F32_NOT_BUILT = (
    "dequantized, as the own int4 kernel's float32 path does not run here and torch's int "
    "kernels in float32 took x3.4 a dense float32 model's time a token"
)
#: Each CPU kind's defaults (``batchline._cpu``'s kinds). Measured where it says; the others
#: follow from what their flags lack, and say so.
KIND_DEFAULTS: dict[str, KindDefaults] = {
    "amx": KindDefaults(
        "bfloat16",
        True,
        "measured on the 2-core AMX Xeon (2026-12-01): torch's int4 kernel x0.55, int8 x0.70 "
        "the time of a dense bf16 linear at one row (quant_linear.py)",
        int_dtype="bfloat16",
        int_measured="bf16 rows, on AMX from 2 rows: float32 on int8 rows made a 1.7B server "
        "x1.13-1.15 the tokens/s at one client but x0.75-0.84 at 16 (int4, int8; 2026-12-06)",
        dense_tiles=True,
        dense_measured="the own tiles, on AMX from 2 rows, took x0.82-0.86 oneDNN's time at 1-16 "
        "rows, x0.98-1.17 at 256-512; a 1.7B server made x1.18 oneDNN's tokens/s at 1 and 16 "
        "clients (2026-12-06)",
        bf16_int8_rows="a step's 1-4 rows summed as int8 through VNNI, more as bf16 on AMX: a "
        "1.7B-shaped int4 step at one row x0.80 the time of bf16 rows (x1.17 its floor), a "
        "server x1.23 their tokens/s at one client (360M x1.23, 3B x1.33), the linears alone "
        "x0.58-0.66 at one row, x0.75-0.92 at four (2026-12-06)",
        # A Q8_0 file had computed in float32 on int8 rows here while a bf16 model held int8
        # groups as two int4 planes (its server x1.59 the tokens/s of bf16 at 16 clients); in
        # the int8 layout on bf16 rows (quant_kernel.int8g_here) bf16 made x1.06 float32's at
        # 16 clients and x1.04 at one at 1.7B, x1.00-1.01 at 360M (2026-12-06): one rule now.
    ),
    "avx512-bf16": KindDefaults(
        "bfloat16",
        True,
        "bf16 measured x1.6 faster than float32 (2026-11-24)",
        int_dtype="float32",
        # the figures in full: A8_MEASURED_BF16, said with the activations
        int_measured="on int8 rows, faster than bf16 (a 1.7B server's tokens/s in int4: Zen 4 "
        "EPYC x1.18, 2026-12-04; Zen 5 x1.06-1.10, 2026-12-05; in int8 on Zen 4 x1.57)",
        dense_tiles=True,
        dense_measured="the own tiles took x0.71 oneDNN's time at one row, x0.90 at 16, x0.94-0.99 "
        "at 32-256 (1.7B-shaped linears, Zen 4 EPYC, 2026-12-04)",
        # a bf16 model's int weights (--dtype bfloat16 named: auto takes float32 for them)
        bf16_int8_rows="every row summed as int8 through VNNI (no AMX tiles to take a step's "
        "many), where bf16 rows had run vdpbf16ps (float32 on int8 rows made x1.18 its "
        "tokens/s) and int8 torch's per-channel kernel: against float32 on int8 rows a 1.7B "
        "int4 step x0.91 the time, a 1.7B server x0.98-1.01 the tokens/s in int4 and x1.05-1.12 "
        "in int8 (Zen 4 EPYC, 2026-12-06)",
    ),
    "vnni": KindDefaults(
        "float32",
        False,
        "no native bf16: float32 (measured on the 2-core Ice Lake Xeon, 2026-12-03: bf16, "
        "emulated, took 1.6-2.1x float32's time in a 16-row product, the same at one row); a "
        "GGUF kept quantized, through the own kernel's float32 path",
    ),
    "avx2": KindDefaults(
        "float32",
        True,
        "no native bf16: float32; a GGUF kept quantized, through the own kernel's float32 path "
        "in AVX2 vectors (measured on the 2-core AVX2-only EPYC, Zen 2, 2026-12-03: a 1.7B int4 "
        "server at one client x3.5 the tokens/s of dense float32)",
    ),
    "other": _NO_BF16,
}


def kind_defaults(flags: Collection[str] | None = None) -> tuple[str, KindDefaults]:
    """This CPU's kind (``flags`` default: :func:`cpu_flags`, its own) and the defaults it
    takes."""
    name = host_kind(cpu_flags() if flags is None else flags).name
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
    asked: str,
    *,
    gguf: bool,
    dtype: str,
    flags: Collection[str] | None = None,
    kernel_missing: str | None = None,
) -> WeightsChoice:
    """The weights for ``asked`` (one of ``WEIGHT_FORMATS``) of a model from a GGUF file
    (``gguf``) or a folder, computed in ``dtype`` (``choose_dtype``'s). ``auto`` keeps a GGUF's
    quantized tensors where they compute fast: in bf16 where the host's kind says so
    (:data:`KIND_DEFAULTS`), in float32 where the CPU has AVX2 and FMA (:data:`F32_KEPT`) and the
    kernel library runs (``kernel_missing``: why it does not, as ``quant_kernel.own_kernels``
    says; None where it does); torch's int kernels in float32, elsewhere, are the slow ones."""
    if asked not in WEIGHT_FORMATS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_FORMATS)}, got {asked!r}")
    if asked != "auto":
        return WeightsChoice(asked, "asked for")
    if not gguf:
        return WeightsChoice("float", "auto: a folder's weights as they are")
    name, kind = kind_defaults(flags)
    if dtype != "bfloat16":
        if not set(F32_KERNEL_FLAGS) <= set(cpu_flags() if flags is None else flags):
            why = F32_DEQUANTIZED
        elif kernel_missing is not None:
            why = f"{F32_NOT_BUILT} ({kernel_missing})"
        else:
            return WeightsChoice("gguf", f"auto in float32 on this {name} CPU: {F32_KEPT}")
        return WeightsChoice("float", f"auto in float32 on this {name} CPU: {why}")
    if not kind.gguf_quantized:
        return WeightsChoice("float", f"auto on this {name} CPU: {kind.measured}")
    return WeightsChoice("gguf", f"auto on this {name} CPU: {kind.measured}")


def choose_precision(
    dtype: str,
    weights: str,
    device: str,
    *,
    gguf: bool,
    gguf_float: bool = False,
    flags: Collection[str] | None = None,
    cuda_bf16: bool | None = None,
    kernel_missing: str | None = None,
) -> tuple[DtypeChoice, WeightsChoice]:
    """The dtype and the weights of a model for the knobs ``dtype`` and ``weights`` (one of
    ``GENERATION_DTYPES``, ``WEIGHT_FORMATS``) on ``device``: :func:`choose_dtype`, then
    :func:`choose_weights` in it; where both are ``auto`` choices on a CPU whose kind computes
    int weights in another dtype (:attr:`KindDefaults.int_dtype`: float32 with int8 rows on an
    AVX512-BF16 CPU without AMX), that dtype, and the weights chosen again in it, unless the
    GGUF file's linears are all float (``gguf_float``: nothing int to compute). What the load
    log, the job's identity and the loader all take, so they never disagree."""
    chosen = choose_dtype(dtype, device, flags=flags, cuda_bf16=cuda_bf16)
    held = choose_weights(
        weights, gguf=gguf, dtype=chosen.dtype, flags=flags, kernel_missing=kernel_missing
    )
    if device != "cpu" or held.weights == "float" or (gguf and gguf_float):
        return chosen, held
    name, kind = kind_defaults(flags)
    int_dtype, int_measured = kind.int_dtype, kind.int_measured
    if dtype != "auto":
        if chosen.dtype == int_dtype:
            return chosen, held
        # kept as asked, and the log says what auto would have taken: int8 in bf16 went
        # through torch's kernel on Zen 4, a 360M step x1.41 dense bf16's (2026-12-05)
        hint = (
            f"{chosen.dtype} as asked; dtype auto computes int weights in {int_dtype} on "
            f"this {name} CPU: {int_measured or kind.measured}"
        )
        return chosen, WeightsChoice(held.weights, f"{held.reason}; {hint}")
    if int_dtype == chosen.dtype:
        return chosen, held
    again = choose_weights(
        weights, gguf=gguf, dtype=int_dtype, flags=flags, kernel_missing=kernel_missing
    )
    if again.weights == "float":  # the int weights would not stay int in that dtype
        return chosen, held
    why = f"auto with {held.weights} weights on this {name} CPU: {int_measured}"
    return DtypeChoice(int_dtype, why), again


@dataclass(frozen=True, slots=True)
class ActivationsChoice:
    """What the own int4 kernel multiplies a model's int weights by (``float`` rows, or
    ``int8``: quantized per group of 32 on the way in: every float32 row, a bf16 model's few
    rows), and why (said in the load log)."""

    activations: str
    reason: str

    def __str__(self) -> str:
        return f"{self.activations} activations ({self.reason})"


#: Why ``activations = auto`` takes int8 rows on a CPU with AVX512-VNNI and no native bf16, where
#: float32 is the dtype for speed (``choose_dtype``'s auto).
A8_MEASURED = (
    "int8 rows through VNNI: on the 2-core Ice Lake Xeon (2026-12-03) a 1.7B-shaped int4 server "
    "made x1.95 the tokens/s of float rows at 16 clients and x1.30 at one (TTFT x0.46), and the "
    "quality gate in float32 passed (int8 98.0 % top-1, int4 98.2 %, the Q4_1 file 98.5 %)"
)
#: Why it takes them on a CPU with AVX2 and no VNNI (the vpmaddubsw path), measured there.
A8_MEASURED_AVX2 = (
    "int8 rows through AVX2's vpmaddubsw: on the 2-core AVX2-only EPYC (Zen 2, 2026-12-03) a "
    "1.7B-shaped int4 step took x0.81 the time of float rows at one row, the 2,048 -> 16,384 "
    "product x0.41-0.45 at 4-16 rows; the same integer sums and float32 operations as the VNNI "
    "path, whose quality gate passed on Ice Lake"
)
#: Why it keeps float rows where the CPU's int weights compute in bf16 (AMX): float32 there
#: comes from the user, and the rows are kept as asked.
A8_NATIVE_BF16 = "float32 on a CPU whose int weights compute in bf16: the rows kept as they are"
#: Why it takes them on a CPU with native bf16 but no AMX, where ``auto`` computes int weights
#: in float32 (:func:`choose_precision`), measured there.
A8_MEASURED_BF16 = (
    "int8 rows through VNNI: on the 2-core AVX512-BF16 EPYC (Zen 4, 2026-12-04) a 1.7B-shaped "
    "int4 step took x0.84 the time of bf16 rows (int8 x0.56), and a server made x1.18 their "
    "tokens/s at 16 clients"
)
A8_FLOAT32_ASKED = (
    "float32 asked for: its rows are kept exact (activations = 'int8' quantizes them there)"
)


def choose_activations(
    asked: str,
    *,
    weights: str,
    dtype: str,
    dtype_asked: bool = False,
    flags: Collection[str] | None = None,
) -> ActivationsChoice:
    """The activations for ``asked`` (one of ``ACTIVATION_FORMATS``) of a model held in
    ``weights`` (``choose_weights``'s) computing in ``dtype``; ``dtype_asked`` when the user
    named that dtype rather than ``auto`` choosing it. int8 rows apply to int
    weights (``int8``, ``int4``, ``gguf``) in float32, every row, and in bf16, a step's few rows
    (below ``quant_kernel.A8_BF16_ROWS``); they need AVX2 and FMA (``A8_KERNEL_FLAGS``): asked
    for where either fails, a :class:`ValueError` says which. ``auto`` takes them in float32
    only where float32 was itself chosen for speed (a user who names float32 gets float32
    arithmetic), in bf16 where the host's kind measured them (:attr:`KindDefaults.
    bf16_int8_rows`)."""
    if asked not in ACTIVATION_FORMATS:
        raise ValueError(
            f"activations must be one of {', '.join(ACTIVATION_FORMATS)}, got {asked!r}"
        )
    if asked == "float":
        return ActivationsChoice("float", "asked for")
    if dtype not in ("float32", "bfloat16") or weights == "float":
        if asked == "int8":
            raise ValueError(
                "activations = 'int8' applies to int8, int4 or GGUF weights computed in float32 "
                f"or bfloat16; this model computes in {dtype} with {weights} weights"
            )
        return ActivationsChoice("float", "auto: only int weights take int8 rows")
    found = set(cpu_flags() if flags is None else flags)
    missing = [f for f in A8_KERNEL_FLAGS if f not in found]
    if missing and asked == "int8":
        raise ValueError(f"activations = 'int8' needs {', '.join(missing)}, which this CPU lacks")
    if asked == "int8":
        return ActivationsChoice("int8", "asked for")
    if missing:
        return ActivationsChoice("float", f"auto: the CPU has no {', '.join(missing)}")
    name, kind = kind_defaults(found)
    if dtype == "bfloat16":
        if kind.bf16_int8_rows:
            return ActivationsChoice("int8", f"auto on this {name} CPU: {kind.bf16_int8_rows}")
        return ActivationsChoice("float", f"auto: bf16 rows on this {name} CPU")
    if dtype_asked:
        return ActivationsChoice("float", f"auto: {A8_FLOAT32_ASKED}")
    if host_kind(found).bf16:
        if kind.int_dtype == "float32":  # chosen so by choose_precision
            return ActivationsChoice("int8", f"auto: {A8_MEASURED_BF16}")
        return ActivationsChoice("float", f"auto: {A8_NATIVE_BF16}")
    if all(f in found for f in A8_VNNI_FLAGS):
        return ActivationsChoice("int8", f"auto: {A8_MEASURED}")
    return ActivationsChoice("int8", f"auto: {A8_MEASURED_AVX2}")
