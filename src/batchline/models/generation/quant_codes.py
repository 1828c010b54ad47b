"""The integer codes a quantized linear is built from (:class:`~.quant_linear.QuantLinear`):
int4 in groups with a scale and a zero each (:class:`Int4Codes`, :func:`quantize_int4`; with
8-bit steps for the own kernel's compact layout: :class:`Int4Steps`, :func:`quantize_int4_steps`),
int8 per channel (:func:`quantize_int8`) and int8 in groups of 32 (:func:`quantize_int8_groups`,
a GGUF's Q8_0), which the int4 kernels take as two int4 planes (:func:`int8_group_planes`,
undone by :func:`int8_from_planes`); :func:`pack_planes` lays either out for the own kernels.

The group size, 32: on SmolLM2-135M's real weights (``benchmarks/bench_quant_quality.py``, 4
prompts, 64 answer positions, 2026-12-01) int4 in groups of 32 agreed with bf16's top-1 at 100 %
(mean log-prob 0.4 % off), in groups of 64 at 78 % (45 % off), of 128 at 88 % (19 % off): those
weights come from a Q4_1 file, 32-value blocks, which groups of 32 hold again and wider ones
blur; a GGUF's Q4_0, Q4_1 and Q4_K are all 32-value groups. 32 and 64 took the same time within
the noise; 32 stores 0.63 bytes a weight with bf16 scales and zeros, 64 0.56, and 32 with 8-bit
steps 0.57 (:func:`quantize_int4_steps`, what ``weights=int4`` packs for the own kernels).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

__all__ = [
    "INT4_GROUP_SIZE",
    "INT8_SCALE_STEPS",
    "Int4Codes",
    "Int4Steps",
    "int4_group_size",
    "int4_planes_rows",
    "int8_from_planes",
    "int8_group_planes",
    "pack_int8_groups",
    "pack_planes",
    "quantize_int4",
    "quantize_int4_steps",
    "quantize_int8",
    "quantize_int8_groups",
]

#: The int4 group size (see the module docstring).
INT4_GROUP_SIZE = 32


@dataclass(frozen=True, slots=True)
class Int4Codes:
    """A weight ``(N, K)`` as int4: codes ``(N, K)`` in [0, 15] (uint8), and ``scales`` and
    ``zeros`` ``(N, K // group_size)``; the weight is ``(codes - 8) * scale + zero``."""

    codes: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def dequantize(self, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        """The weight these codes stand for, computed in ``dtype`` (tests: float64)."""
        g = self.group_size
        scales = self.scales.to(dtype).repeat_interleave(g, dim=1)
        zeros = self.zeros.to(dtype).repeat_interleave(g, dim=1)
        return (self.codes.to(dtype) - 8) * scales + zeros


def int4_group_size(in_features: int) -> int:
    """The group size int4 quantizes a linear of ``in_features`` inputs with."""
    if in_features % INT4_GROUP_SIZE:
        raise ValueError(
            f"int4 needs an input width divisible by {INT4_GROUP_SIZE}, got {in_features}"
        )
    return INT4_GROUP_SIZE


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-channel symmetric int8: codes ``(N, K)`` int8 in [-127, 127] and scales ``(N,)``
    float32, each a bf16 value, the weight ``codes * scale`` (an all-zero row gets scale 1).

    The scale, ``max|w| / 127``, is rounded to bf16 before the codes are taken from it: torch's
    int8 kernel takes the scales in the activations' dtype, and a bf16 model's rounded each
    row's scale after its codes, scaling the whole row by up to 2^-9. On SmolLM2-135M in bf16
    (Zen 4, ``benchmarks/bench_quant_quality.py --formats bf16,int8``, 2026-12-04) that took
    int8 to 2.17 % off bf16's mean log-prob, over the 2 % bar; rounded first, 1.65 % (97.5 %
    top-1), its embedding looked up in its head. The largest code stays within 127.25 before
    the clamp: within half a step of its weight."""
    # a float32 copy of its own, computed on in place: one layer's temporaries at a time, not
    # four (a 3B model's gate/up is 200 MB in float32)
    w = weight.detach().to(torch.float32, copy=True)
    low, high = torch.aminmax(w, dim=1)
    scales = (torch.maximum(-low, high) / 127.0).to(torch.bfloat16).float()
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = w.div_(scales[:, None]).round_().clamp_(-127, 127).to(torch.int8)
    return codes, scales


def quantize_int4(weight: torch.Tensor, group_size: int) -> Int4Codes:
    """Group-wise asymmetric int4 of ``weight`` ``(N, K)``: each group's min and max map to
    codes 0 and 15 (a constant group: scale 1, every code 0 and the value in its zero)."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int4 group size {group_size} does not divide {k} input values")
    w = weight.detach().to(torch.float32, copy=True).reshape(n, k // group_size, group_size)
    low, high = torch.aminmax(w, dim=2)
    scales = (high - low) / 15.0
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    codes = w.sub_(low[..., None]).div_(scales[..., None]).round_().clamp_(0, 15)  # in place
    # (code - 8) * scale + zero = code * scale + low
    zeros = low + 8 * scales
    return Int4Codes(codes.reshape(n, k).to(torch.uint8), scales, zeros, group_size)


#: How many times :func:`quantize_int4_steps` refits each group's scale and zero to its codes:
#: one took int4's log-prob drift on SmolLM2-135M (Zen 4, 2026-12-04, the quality gate) from
#: 1.54 to 1.14 % in bf16 and from 1.93 to 1.33 % in float32 on int8 rows (bar 2 %), and a 3B
#: load from ~14.5 to ~19 s; a second lowers a Gaussian weight's squared error 4 % more.
REFITS = 1


@dataclass(frozen=True, slots=True)
class Int4Steps:
    """A weight ``(N, K)`` as int4 in groups of 32 whose scales and zeros are 8-bit steps (the own
    kernel's compact layout, :func:`~.quant_kernel.pack_int4_steps`): codes ``(N, K)`` in [0, 15]
    (uint8); per output row and group a ``step`` and an ``offset`` (uint8, ``(N, K // 32)``);
    per 16 rows (a tile of the layout) and group a ``unit`` (bf16, ``(ceil(N / 16), K // 32)``).
    A row's group has scale ``unit * step`` and zero ``scale * (8 - offset / 16)``: both exact
    in float32, as the kernels compute them."""

    codes: torch.Tensor
    steps: torch.Tensor
    offsets: torch.Tensor
    units: torch.Tensor

    def as_codes(self) -> Int4Codes:
        """The same weight as :class:`Int4Codes` (float32 scales and zeros, exact)."""
        from batchline.models.generation.quant_kernel import step_scales

        units = self.units.repeat_interleave(16, dim=0)[: self.codes.shape[0]]
        scales, zeros = step_scales(units, self.steps, self.offsets)
        return Int4Codes(self.codes, scales, zeros, 32)


def quantize_int4_steps(weight: torch.Tensor, refits: int | None = None) -> Int4Steps:
    """int4 in groups of 32 of ``weight`` ``(N, K)`` with 8-bit steps (:class:`Int4Steps`): 4.53
    bits a weight where bf16 scales and zeros take 5 (a 3B model's linears 1.64 -> 1.49 GiB).

    Per group the range is ``[min(low, 0), max(high, 0)]`` (a group of 32 weights nearly always
    spans 0: then its own min and max). Per 16 rows and group the unit is the least bf16 value at
    least the largest of their ``range / 15``, divided by 255; each row's step the least
    integer whose ``unit * step`` covers its range; its offset the grid's shift, in 16ths of a
    step, that centers the range on the 16 codes; the codes are then taken against that scale
    and zero. Then, ``refits`` times (:data:`REFITS` by default), the scale and zero that fit
    the codes by least squares, rounded to the grid, replace them where the group's squared
    error falls: a range's edges make a coarse grid where the weights' own spacing is finer
    (weights quantized before, as a GGUF's Q4_1 converted to bf16, lie on 16 levels). A group
    of zeros gets step 0 (scale 0): its weights stay 0. Computed by the kernel library's
    ``int4_weight_steps`` (``csrc/quant_steps.cpp``; the own int4 kernels, which alone read
    this layout, need the library too). K must be a multiple of 32."""
    k = weight.shape[1]
    if k % 32:
        raise ValueError(f"int4 group size 32 does not divide {k} input values")
    from batchline.models.generation.decode_kernel import decode_kernel

    if decode_kernel()[0] is None:
        raise RuntimeError(f"int4 with 8-bit steps needs the kernel library: {decode_kernel()[1]}")
    w = weight.detach().to(torch.float32).contiguous()
    codes, steps, offsets, units = torch.ops.batchline.int4_weight_steps(
        w, REFITS if refits is None else refits
    )
    return Int4Steps(codes, steps, offsets, units)


#: How many bf16 values above ``bf16(max|w| / 127)`` :func:`quantize_int8_groups` tries as a
#: group's scale (``benchmarks/bench_int8_scales.py`` has the error and the time of each count).
INT8_SCALE_STEPS = 16


def quantize_int8_groups(
    weight: torch.Tensor, group_size: int, steps: int = INT8_SCALE_STEPS
) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 in groups of ``group_size`` inputs (a GGUF's Q8_0 form): codes ``(N, K)``
    int8 in [-127, 127] and scales ``(N, K // group_size)`` float32, each a bf16 value (the
    own kernel's scales are bf16), the weight ``codes * scale``.

    A group's scale is, of ``bf16(max|w| / 127)`` and the ``steps`` bf16 values above it, the
    first whose codes ``clamp(round(w * (1 / scale)), -127, 127)`` leave the least squared
    error: the max's scale alone is seldom the best for 32 values (``steps`` 0 takes it). With
    16 steps the summed squared error of the int8 codes was x0.80 the max's on
    all-MiniLM-L6-v2's float32 linears and x0.54 on SmolLM2-135M's (its weights come from a
    Q4_1 file: a 16-level grid per 32 values, which some scale above the max's fits). Computed
    by the library's ``int8_weight_groups`` where it runs (groups of 32, float32 rows quantized
    to int8 here: AVX2 at least), else by the same steps in torch. An all-zero group gets scale
    1 and codes 0."""
    n, k = weight.shape
    if k % group_size:
        raise ValueError(f"int8 group size {group_size} does not divide {k} input values")
    w = weight.detach().to(torch.float32)
    if group_size == 32 and _weight_groups_op():
        codes, scales = torch.ops.batchline.int8_weight_groups(w.contiguous(), steps)
        return codes, scales
    groups = w.reshape(n, k // group_size, group_size)
    amax = groups.abs().amax(dim=2)
    base = (amax / 127.0).to(torch.bfloat16).view(torch.int16).to(torch.int32)
    best = best_scales = None
    for step in range(steps + 1):
        scales = (base + step).to(torch.int16).view(torch.bfloat16).float()
        codes = (groups * (1.0 / scales)[..., None]).round_().clamp_(-127, 127)
        error = codes.mul_(scales[..., None]).sub_(groups).square_().sum(dim=2)
        if best is None or best_scales is None:
            best, best_scales = error, scales
        else:
            better = error < best
            best = torch.where(better, error, best)
            best_scales = torch.where(better, scales, best_scales)
    assert best_scales is not None
    scales = torch.where(amax > 0, best_scales, torch.ones_like(best_scales))
    codes = (groups * (1.0 / scales)[..., None]).round_().clamp_(-127, 127)
    return codes.to(torch.int8).reshape(n, k), scales


def _weight_groups_op() -> bool:
    """Whether the library's ``int8_weight_groups`` runs here."""
    from batchline.models.generation.quant_kernel import int8_activations_here

    return int8_activations_here()[0]


def int8_group_planes(
    codes: torch.Tensor, scales: torch.Tensor, group_size: int
) -> list[Int4Codes]:
    """Int8 codes ``(N, K)`` with a scale per group ``(N, K // group_size)`` (a GGUF's Q8_0) as
    two int4 planes whose weights sum to ``codes * scale`` exactly: code = 16 * high + low with
    low in [0, 15] and high in [-8, 7]; the high plane is ``(high + 8 - 8) * 16 * scale``, the
    low one ``(low - 8) * scale + 8 * scale``."""
    # in the codes' own bytes (two's complement), one byte a code: low is the low nibble, and
    # high + 8 the high nibble with its top bit flipped (-8..7 -> 0..15); 16.8M codes in 4-15 ms
    # where int16 arithmetic took 96 (2 threads)
    u = codes.to(torch.int8).view(torch.uint8)
    s = scales.float()
    return [
        Int4Codes((u >> 4) ^ 8, 16 * s, torch.zeros_like(s), group_size),
        Int4Codes(u & 15, s, 8 * s, group_size),
    ]


def int8_from_planes(planes: list[Int4Codes]) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 codes ``(N, K)`` and scales ``(N, K // group_size)`` that
    :func:`int8_group_planes` split into ``planes`` (its inverse)."""
    high, low = planes
    codes = ((high.codes.to(torch.uint8) ^ 8) << 4) | low.codes.to(torch.uint8)
    return codes.view(torch.int8), low.scales


def pack_planes(
    planes: list[Int4Codes],
    dtype: torch.dtype,
    scale_dtype: torch.dtype,
    *,
    int8_rows: bool = False,
) -> list[torch.Tensor]:
    """One int4 plane packed (:func:`~.quant_kernel.pack_int4`), or int8 in groups' two planes:
    as one :func:`~.quant_kernel.pack_int8g` tensor where :func:`~.quant_kernel.int8g_here`
    (for rows summed as int8 where the load takes them: ``int8_rows``)."""
    from batchline.models.generation import quant_kernel

    if len(planes) == 2 and quant_kernel.int8g_here(dtype, scale_dtype, int8_rows=int8_rows):
        return [quant_kernel.pack_int8g(*int8_from_planes(planes))]
    return [quant_kernel.pack_int4(p.codes, p.scales, p.zeros, scale_dtype) for p in planes]


def pack_int8_groups(
    codes: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype,
    scale_dtype: torch.dtype,
    *,
    int8_rows: bool = False,
) -> list[torch.Tensor]:
    """int8 codes ``(N, K)`` with a scale per group of 32 (:func:`quantize_int8_groups`) laid out
    for the own kernels: as one :func:`~.quant_kernel.pack_int8g` tensor where
    :func:`~.quant_kernel.int8g_here`, else as the two int4 planes of :func:`int8_group_planes`
    (:func:`pack_planes`; ``int8_rows`` as there)."""
    from batchline.models.generation import quant_kernel

    if quant_kernel.int8g_here(dtype, scale_dtype, int8_rows=int8_rows):
        return [quant_kernel.pack_int8g(codes, scales)]
    return pack_planes(int8_group_planes(codes, scales, 32), dtype, scale_dtype)


def int4_planes_rows(
    planes: list[Int4Codes], rows: Callable[[torch.Tensor], torch.Tensor]
) -> list[Int4Codes]:
    """``planes`` with ``rows`` (a permutation of the output rows) applied to their codes,
    scales and zeros alike."""
    return [Int4Codes(rows(p.codes), rows(p.scales), rows(p.zeros), p.group_size) for p in planes]
