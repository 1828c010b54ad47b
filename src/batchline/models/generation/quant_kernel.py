"""batchline's own int4 and int8 linears for a decode step's few rows (``csrc/quant_gemm.cpp``).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) is fast at one row and slows down
with every row added: on the AMX Xeon it took 2-3.5x a dense bf16 linear at 16 rows. This one
widens each block of 64 codes to bf16 once and sums it against every row: at one row with
AVX512-BF16's ``vdpbf16ps`` (in registers, up to 8 rows a pass), from :data:`AMX_ROWS` rows on
with one AMX tile product per group of 32 inputs and 16 output columns (up to 16 rows a pass).
The scale and the zero of a group are applied once per group in fp32, and the output is
rounded to bf16 once (the C++ source's header has the arithmetic and the packed layout).

Measured on the 2-core AMX Xeon, loaded by other work (``benchmarks/bench_quant_kernel.py``, one
thread, calls of each alternated, median µs per call at 1 / 4 / 8 / 16 rows): SmolLM2-360M's
fused gate/up 960 -> 5,120, dense bf16 615 / 590 / 632 / 799, torch's int4 384 / 606 / 1,132 /
2,179, this kernel 263 / 315 / 378 / 461 (x0.43 / 0.53 / 0.60 / 0.58 of dense); its down
2,560 -> 960, dense 308 / 319 / 330 / 344, this kernel 137 / 160 / 202 / 238 (x0.45 / 0.50 /
0.61 / 0.69); a Qwen2.5-1.5B-sized 1,536 -> 8,960, x0.49 / 0.54 / 0.57 / 0.64. The AMX path
took the vdpbf16ps one's time at one row, and 0.8x / 0.65x / 0.55x / 0.25x of it at 2 / 3 / 4 /
16 rows.

The per-channel int8 linear (:func:`pack_int8`, :func:`int8_linear`) sums the same way, its
codes widened to bf16 by a conversion through fp32 (dearer than int4's table lookup, so it takes
AMX from one row) and its scale applied once at the end: 960 -> 5,120, dense 589 / 576 / 618 /
762 µs, torch's int8 504 / 664 / 1,321 / 2,630, this kernel 337 / 327 / 342 / 395 (x0.57 / 0.57
/ 0.55 / 0.52); 2,560 -> 960 x0.59 / 0.56 / 0.60 / 0.54; 1,536 -> 8,960 x0.60 / 0.62 / 0.59 /
0.58.

Both split their tiles over torch's intra-op threads (the library is built with OpenMP, bound to
torch's runtime: :mod:`~batchline.models.generation.decode_kernel`), the same bits at any
count. At 2 threads, alternated with 1 in one process on the same host (shared, 2026-12-02),
they took x0.46-0.57 of their 1-thread time and x0.32-0.49 of dense bf16's at 2 threads on the
four shapes above at 1-16 rows (docs/generation.md has the table).

For float32 rows quantized to int8 (``csrc/quant_gemm_a8.cpp``) int8 in groups of 32 has a
layout of its own (:func:`pack_int8g`, :func:`int8g_linear`: :func:`int8g_here` says where).

:func:`pack_int4` lays out the codes, scales and zeros of an
:class:`~batchline.models.generation.quant_codes.Int4Codes` (groups of 32,
``(code - 8) * scale + zero``, scales and zeros rounded to bf16) for it, once at load;
:func:`int4_linear` computes ``x @ W.T (+ bias)`` for bf16 ``x``. :func:`own_kernels` says
whether this machine has it: the library built (:func:`~batchline.models.generation.
decode_kernel.decode_kernel`) and a CPU with AVX512-BF16 (elsewhere the library's int ops raise
an error, and ``QuantLinear`` keeps torch's kernels).
"""

from __future__ import annotations

import torch

from batchline._cpu import (
    A8_KERNEL_FLAGS,
    F32_KERNEL_FLAGS,
    host_flags,
    host_kind,
)
from batchline.models.generation.decode_kernel import decode_kernel

__all__ = [
    "A8_BF16_ROWS",
    "A8_BF16_ROWS_AMX",
    "A8_WIDTH",
    "AMX_ROWS",
    "BLOCK",
    "BLOCK_F32",
    "BLOCK_INT8",
    "BLOCK_STEPS",
    "EVERY_ROW",
    "F32_WIDTH",
    "GROUP",
    "INT8G_WIDE_ROWS",
    "INT8_AMX_ROWS",
    "TILE",
    "every_row_int8",
    "f32_vectors",
    "int4_dequantize",
    "int4_linear",
    "int8_activations_here",
    "int8_linear",
    "int8g_here",
    "int8g_linear",
    "int8g_width",
    "own_kernels",
    "pack_int4",
    "pack_int4_steps",
    "pack_int8",
    "pack_int8g",
    "packed_rows",
    "rows_in",
    "scale_dtype_for",
    "step_scales",
    "unpack_int4",
    "unpack_int8",
    "unpack_int8g",
]

#: The inputs per group, and the output columns per tile, of the packed layout.
GROUP = 32
TILE = 16
#: The bytes of one tile's group in :func:`pack_int4`'s layout: its codes, scales and zeros
#: (bf16), and with float32 scales and zeros (a float32 model's: exact, as float32 promises).
BLOCK = GROUP * TILE // 2 + 2 * TILE * 2
BLOCK_F32 = GROUP * TILE // 2 + 2 * TILE * 4
#: The same with 8-bit steps of a bf16 unit (:func:`pack_int4_steps`): 16 steps, 16 offsets,
#: the unit; 4.53 bits a weight.
BLOCK_STEPS = GROUP * TILE // 2 + 2 * TILE + 2
#: The bytes of one tile's group in :func:`pack_int8g`'s layout: 512 int8 codes, 16 bf16 scales
#: (8.5 bits a weight, as a GGUF's Q8_0).
BLOCK_INT8 = GROUP * TILE + TILE * 2
#: From this many rows on the kernel sums through AMX tiles (where the CPU has them), below it
#: through vdpbf16ps: at one row the two took the same time (vdpbf16ps 5-10 % less).
AMX_ROWS = 2
#: int8's: widening int8 codes to bf16 costs more than int4's table lookup, so vdpbf16ps took
#: 1.2-2x AMX's time at one row already (960 -> 5,120: 789 against 387 µs; torch's int8 618);
#: ``QuantLinear`` takes the own int8 kernel only where the CPU has AMX.
INT8_AMX_ROWS = 1
#: The vector width :func:`int4_linear` takes for float32 rows where the library has both
#: paths (AVX-512; an AVX2-only build has the 256-bit one alone). Ice Lake, 2 threads, float32
#: scales, 2026-12-03, ms at 1 / 4 / 16 rows: 2,048 -> 16,384 512-bit 1.11 / 2.13 / 7.65, 256-bit
#: 1.81 / 3.19 / 12.8, dense float32 5.22 / 11.4 / 16.0; 8,192 -> 2,048 0.48 / 1.11 / 4.41,
#: 0.60 / 1.74 / 6.28, 2.27 / 5.16 / 7.17.
F32_WIDTH = 512
#: The path :func:`int4_linear` and :func:`int8g_linear` take for int8 rows where the library
#: has both (AVX512-VNNI): vpdpbusd on 512-bit vectors; elsewhere AVX2's vpmaddubsw is the only
#: one (the same bits).
A8_WIDTH = 512
#: A row bound no step reaches: "every row".
EVERY_ROW = 1 << 30
#: On an AMX host, below this many bf16 rows an int4 product with int8 rows (``int8_rows``:
#: ``activations = auto`` there) quantizes them to int8 per group of 32 and sums integers
#: through VNNI (``int4_linear_a8``, bf16 in and out); from it on, bf16 rows as without (AMX
#: tiles). AMX Xeon, 2 threads, 8-bit-step int4, 2026-12-06, int8 rows' time over bf16 rows'
#: at 1, 2, 4, 6, 8 rows: 2,048 -> 16,384 x0.58, x0.59, x0.75, x0.82, x0.92; 8,192 -> 2,048 x0.62,
#: x0.64, x0.78, x0.85, x0.92; 960 -> 5,120 x0.66, x0.77, x0.92, x1.03, x1.13 (x1.22-1.49 at
#: 12-16 rows): at one row vdpbf16ps spends two cycles a product, and unpacking the codes for
#: it as many again, where one vpdpbusd sums twice the inputs of codes masked out in place.
A8_BF16_ROWS_AMX = 5
#: Below this many bf16 rows an int4 product with int8 rows takes them as int8 (what
#: :func:`int4_linear` and ``csrc/decode_layers.cpp`` read): :data:`A8_BF16_ROWS_AMX` on an AMX
#: host, every row on any other (:data:`EVERY_ROW`; the product computes dense from
#: ``quant_linear.DENSE_ROWS`` rows as before). Without tiles a bf16 row's alternative is
#: ``vdpbf16ps``, which lost to int8 rows at every count measured: on Zen 4 (2 threads) float32
#: models on int8 rows made a 1.7B int4 server x1.18 bf16 rows' tokens/s (2026-12-04), and a
#: bf16 model with every row as int8 x0.98-1.06 float32's at 16 clients, x1.01-1.07 at one
#: (2026-12-06, ``torch_dtype.KIND_DEFAULTS``).
A8_BF16_ROWS = A8_BF16_ROWS_AMX if host_kind(host_flags()).name == "amx" else EVERY_ROW

#: The fewest rows the int8 layout's product (:func:`int8g_linear`) takes through the 512-bit
#: path (VNNI, 8 rows a pass) rather than the 256-bit one (4): Zen 4, 2 threads, 2026-12-05,
#: 512 / 256 time at 1, 2, 4, 8, 16 rows: x0.99-1.12, x1.02-1.10, x0.84-1.03, x0.50-0.68,
#: x0.50-0.54 (960 -> 49,152, 960 -> 5,120, 2,048 -> 16,384, 8,192 -> 2,048, from memory).
INT8G_WIDE_ROWS = 4


def own_kernels(*, amx: bool = False, dtype: torch.dtype = torch.bfloat16) -> tuple[bool, str]:
    """``(True, where the library is)`` where :func:`int4_linear` runs vectorized here for
    ``dtype`` activations (bf16: AVX512-BF16; float32: AVX2 and FMA; with ``amx``:
    :func:`int8_linear` through AMX tiles, bf16 only), else ``(False, why not)``."""
    op, where = decode_kernel()
    if op is None:
        return False, where
    flags = host_flags()
    if dtype == torch.float32:
        if amx:
            return False, "the own int8 kernel takes bf16 activations"
        if not set(F32_KERNEL_FLAGS) <= set(flags):
            return False, "the CPU has no AVX2 and FMA"
        return True, where
    if dtype != torch.bfloat16:
        return False, f"the own kernels take bf16 or float32 activations, not {dtype}"
    if "avx512_bf16" not in flags:
        return False, "the CPU has no AVX512-BF16"
    if amx and "amx_bf16" not in flags:
        return False, "the CPU has no AMX"
    return True, where


def every_row_int8(dtype: torch.dtype) -> bool:
    """Whether a layer that sums its rows as int8 (``int8_rows``) sums every row of ``dtype``
    so: float32 rows always, bf16 ones where :data:`A8_BF16_ROWS` is every row (no AMX)."""
    return dtype == torch.float32 or A8_BF16_ROWS == EVERY_ROW


def int8_activations_here() -> tuple[bool, str]:
    """``(True, where the library is)`` where :func:`int4_linear` can quantize float32 rows to
    int8 on the way in (``int8_rows``: AVX2 and FMA at least, ``csrc/quant_gemm_a8.cpp``), else
    ``(False, why not)``."""
    op, where = decode_kernel()
    if op is None:
        return False, where
    missing = [f for f in A8_KERNEL_FLAGS if f not in host_flags()]
    if missing:
        return False, f"the CPU has no {', '.join(missing)}"
    return True, where


def scale_dtype_for(dtype: torch.dtype, *, int8_rows: bool = False) -> torch.dtype:
    """The dtype :func:`pack_int4` keeps the scales of a model computing in ``dtype`` in (a
    GGUF's int4 planes and int8's two planes; int4 quantized at load takes 8-bit steps,
    :func:`pack_int4_steps`, whatever the rows): float32 for float32 rows (exact: a GGUF's
    fp16 scales), else bf16:
    for bf16 rows, and for float32 rows summed as int8 (``int8_rows``), whose product is not
    float32's anyway. bf16 scales make a block 320 bytes, not 384: 5 bits a weight, not 6, and
    a batch-1 step streams its weights from memory. On the AVX2-only EPYC (Zen 2, 2 threads,
    2026-12-03, 10 copies of each weight) int8 rows over bf16 scales took x0.79 the time of
    float32 ones at one row of 2,048 -> 16,384 and x0.82 of 8,192 -> 2,048 (x0.88 / x0.93 at
    4 rows; x1.02-1.03 at 16 and 64, where the sums dominate). Rounding a scale or zero to bf16
    moves it by at most 2^-9 of itself; int8 in groups (:func:`~.quant_linear.
    quantize_int8_groups`) rounds its scales to bf16 before it takes its codes."""
    return torch.float32 if dtype == torch.float32 and not int8_rows else torch.bfloat16


def int8g_here(dtype: torch.dtype, scale_dtype: torch.dtype, *, int8_rows: bool = False) -> bool:
    """Whether int8 in groups of 32 (a GGUF's Q8_0, ``int8g``) is packed in :func:`pack_int8g`'s
    layout for rows of ``dtype`` over ``scale_dtype`` scales: float32 rows summed as int8 (their
    scales bf16: :func:`scale_dtype_for`), and bf16 rows where the load sums a step's few as int8
    (``int8_rows``: an AMX host's ``activations = auto``), where that kernel runs here; elsewhere
    it is the two int4 planes of :func:`~.quant_codes.int8_group_planes`. The int8 layout sums
    bf16 rows as int8 at any row count; on the AMX Xeon (2 threads, 4 copies of each weight,
    2026-12-06, ``benchmarks/bench_int8_layout_bf16.py``) it took x0.70-0.81 the planes' time at
    1-64 rows of a 360M's lm_head (960 -> 49,152; the planes: int8 rows to 4 rows, AMX tiles
    from 5), x0.70-0.87 of a 1.7B's (2,048 -> 49,152), x0.65-0.84 of 2,048 -> 16,384 and
    8,192 -> 2,048, x0.51-0.66 at 256 rows. On the AVX2-only EPYC (Zen 2, 2
    threads, 2026-12-03, 6 copies of each weight) it took x0.78 the two planes' time at one row of
    2,048 -> 16,384 and x0.80 of 8,192 -> 2,048, x0.71-0.74 at 4 rows, x0.64-0.69 at 16 to 1,024:
    it reads 8.5 bits a weight, not 10, and sums each code once, not each plane's. It stayed
    ahead of a float32 weight held dense, not even dequantized, at every row count measured:
    same host, ms at 64 / 256 / 512 / 1,024 rows, 2,048 -> 16,384 25.7 / 103 / 213 / 433 against
    71.2 / 180 / 317 / 602; 8,192 -> 2,048 12.6 / 49.8 / 101 / 208 against 24.2 / 67.7 / 128 /
    245."""
    rows = dtype == torch.float32 or (dtype == torch.bfloat16 and int8_rows)
    return rows and scale_dtype == torch.bfloat16 and int8_activations_here()[0]


def f32_vectors() -> str:
    """The vectors :func:`int4_linear` sums float32 rows in here, in the load log's words."""
    wide = F32_WIDTH == 512 and "avx512f" in host_flags()
    return "AVX-512 vectors" if wide else "AVX2 vectors"


def pack_int4(
    codes: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    scale_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """The ``(tiles, K // 32, BLOCK)`` uint8 layout the kernel reads of int4 ``codes`` ``(N, K)``
    with ``scales`` and ``zeros`` ``(N, K // 32)``: per 16 output columns and group, 256 bytes
    of codes then the 16 scales and 16 zeros in ``scale_dtype`` (bf16: :data:`BLOCK` bytes; a
    float32 model's float32: :data:`BLOCK_F32`, which only the float32 kernel reads); the last
    tile padded with weight 0."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP) or zeros.shape != scales.shape:
        raise ValueError(
            f"the int4 kernel takes groups of {GROUP}: codes {tuple(codes.shape)} with scales "
            f"{tuple(scales.shape)} and zeros {tuple(zeros.shape)}"
        )
    if scale_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"the int4 layout keeps its scales in bf16 or float32, not {scale_dtype}")
    tiles, groups = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    s, z = scales.to(scale_dtype), zeros.to(scale_dtype)
    if pad:
        s = torch.cat((s, torch.zeros(pad, groups, dtype=scale_dtype)))
        z = torch.cat((z, torch.zeros(pad, groups, dtype=scale_dtype)))
    sz = torch.stack((s.reshape(tiles, TILE, groups), z.reshape(tiles, TILE, groups)), dim=1)
    # (tile, scale|zero, column, group) -> (tile, group, scale|zero, column), as bytes
    sz_bytes = sz.permute(0, 3, 1, 2).contiguous().view(torch.uint8).reshape(tiles, groups, -1)
    return torch.cat((_code_chunks(codes, tiles), sz_bytes), dim=2).contiguous()


def pack_int4_steps(
    codes: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor, units: torch.Tensor
) -> torch.Tensor:
    """The ``(tiles, K // 32, BLOCK_STEPS)`` uint8 layout the kernels read of int4 with 8-bit
    steps (:func:`~.quant_codes.quantize_int4_steps`'s codes ``(N, K)``, steps and offsets
    ``(N, K // 32)``, units ``(tiles, K // 32)``): per 16 output columns and group, the 256
    bytes of codes of :func:`pack_int4`, then the 16 steps, the 16 offsets and the unit (bf16);
    the last tile padded with weight 0 (step 0)."""
    n, k = codes.shape
    tiles, groups = -(-n // TILE), k // GROUP
    shapes_fit = steps.shape == offsets.shape == (n, groups) and units.shape == (tiles, groups)
    if k % GROUP or not shapes_fit:
        raise ValueError(
            f"the int4 layout takes groups of {GROUP}: codes {tuple(codes.shape)}, steps "
            f"{tuple(steps.shape)}, offsets {tuple(offsets.shape)}, units {tuple(units.shape)}"
        )
    pad = tiles * TILE - n
    so = torch.stack((steps, offsets)).to(torch.uint8)
    if pad:
        so = torch.cat((so, torch.zeros(2, pad, groups, dtype=torch.uint8)), dim=1)
    # (step|offset, tile, column, group) -> (tile, group, step|offset, column)
    so = so.reshape(2, tiles, TILE, groups).permute(1, 3, 0, 2).reshape(tiles, groups, 2 * TILE)
    unit = units.to(torch.bfloat16).contiguous().view(torch.uint8).reshape(tiles, groups, 2)
    return torch.cat((_code_chunks(codes, tiles), so, unit), dim=2).contiguous()


def step_scales(
    units: torch.Tensor, steps: torch.Tensor, offsets: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales and zeros of 8-bit steps (:func:`pack_int4_steps`), elementwise over
    tensors that broadcast (``units`` as bf16 values): ``scale = unit * step``, ``zero = scale *
    (8 - offset / 16)``, both exact in float32, as the kernels compute them."""
    scales = units.float() * steps.float()
    return scales, scales * (8 - offsets.float() / 16)


def _code_chunks(codes: torch.Tensor, tiles: int) -> torch.Tensor:
    """The ``(tiles, K // 32, 256)`` code bytes of :func:`pack_int4`'s layout (the last tile
    padded with code 8)."""
    n, k = codes.shape
    groups = k // GROUP
    c = codes.to(torch.uint8)
    if tiles * TILE > n:
        c = torch.cat((c, torch.full((tiles * TILE - n, k), 8, dtype=torch.uint8)))
    # (tile, column i, group, chunk, nibble h, t): input 4 * chunk + 2 * h + t of the group
    v = c.reshape(tiles, TILE, groups, 8, 2, 2).permute(0, 2, 3, 4, 1, 5)
    return (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(tiles, groups, 256)


def unpack_int4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes ``(n, K)`` (uint8), scales and zeros ``(n, K // 32)`` (in the layout's bf16 or
    float32; float32 for :func:`pack_int4_steps`'s, exact) that :func:`pack_int4` packed."""
    tiles, groups, block = packed.shape
    chunks = packed[:, :, :256].reshape(tiles, groups, 8, TILE, 2)
    v = torch.stack((chunks & 15, chunks >> 4), dim=3)  # (tile, group, chunk, h, i, t)
    codes = v.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, groups * GROUP)
    if block == BLOCK_STEPS:
        so = packed[:, :, 256 : 256 + 2 * TILE].reshape(tiles, groups, 2, TILE)
        so = so.permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)
        unit = packed[:, :, 256 + 2 * TILE :].contiguous().view(torch.bfloat16)
        units = unit.float().reshape(tiles, groups).repeat_interleave(TILE, dim=0)
        scales, zeros = step_scales(units, so[0], so[1])
        return codes[:n], scales[:n], zeros[:n]
    scale_dtype = torch.float32 if block == BLOCK_F32 else torch.bfloat16
    sz = packed[:, :, 256:].contiguous().view(scale_dtype).reshape(tiles, groups, 2, TILE)
    sz = sz.permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)
    return codes[:n], sz[0, :n], sz[1, :n]


def pack_int8(codes: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``(tiles, K // 2, 32)`` int8 layout the kernel reads of per-channel int8 ``codes``
    ``(N, K)`` (K a multiple of 32), and the ``scales`` ``(N,)`` as float32 padded to the
    tiles: per 16 output columns and input pair, byte ``2i + t`` the code of column ``i`` at
    the pair's input ``t``."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n,):
        raise ValueError(
            f"the int8 kernel takes inputs in multiples of {GROUP} and a scale per output: "
            f"codes {tuple(codes.shape)} with scales {tuple(scales.shape)}"
        )
    tiles = -(-n // TILE)
    pad = tiles * TILE - n
    c = torch.cat((codes.to(torch.int8), torch.zeros(pad, k, dtype=torch.int8)))
    s = torch.cat((scales.float(), torch.zeros(pad)))
    packed = c.reshape(tiles, TILE, k // 2, 2).permute(0, 2, 1, 3).reshape(tiles, k // 2, 32)
    return packed.contiguous(), s.contiguous()


def unpack_int8(
    packed: tuple[torch.Tensor, torch.Tensor], n: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``(n, K)`` (int8) and the float32 scales ``(n,)`` :func:`pack_int8` packed."""
    codes, scales = packed
    tiles, pairs, _ = codes.shape
    rows = codes.reshape(tiles, pairs, TILE, 2).permute(0, 2, 1, 3).reshape(tiles * TILE, 2 * pairs)
    return rows[:n], scales[:n]


def pack_int8g(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The ``(tiles, K // 32, BLOCK_INT8)`` uint8 layout :func:`int8g_linear` reads of int8
    ``codes`` ``(N, K)`` with a scale per group of 32 inputs ``(N, K // 32)`` (the weight
    ``codes * scale``; a GGUF's Q8_0): per 16 output columns and group, chunk ``c`` (inputs
    ``4c .. 4c + 3``) at byte ``64 c``, column ``j``'s four codes at ``64 c + 4 j`` in input
    order, then the 16 scales in bf16; the last tile padded with weight 0."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP):
        raise ValueError(
            f"the int8 layout takes groups of {GROUP}: codes {tuple(codes.shape)} with scales "
            f"{tuple(scales.shape)}"
        )
    tiles, groups = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    c = torch.cat((codes.to(torch.int8), torch.zeros(pad, k, dtype=torch.int8)))
    s = torch.cat((scales.to(torch.bfloat16), torch.zeros(pad, groups, dtype=torch.bfloat16)))
    # (tile, column, group, chunk, input) -> (tile, group, chunk, column, input)
    chunks = c.reshape(tiles, TILE, groups, 8, 4).permute(0, 2, 3, 1, 4).reshape(tiles, groups, -1)
    scale_bytes = s.reshape(tiles, TILE, groups).permute(0, 2, 1).contiguous().view(torch.uint8)
    return torch.cat((chunks.view(torch.uint8), scale_bytes), dim=2).contiguous()


def unpack_int8g(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The codes ``(n, K)`` (int8) and bf16 scales ``(n, K // 32)`` :func:`pack_int8g` packed."""
    tiles, groups, _ = packed.shape
    chunks = packed[:, :, : GROUP * TILE].view(torch.int8).reshape(tiles, groups, 8, TILE, 4)
    codes = chunks.permute(0, 3, 1, 2, 4).reshape(tiles * TILE, groups * GROUP)
    scales = packed[:, :, GROUP * TILE :].contiguous().view(torch.bfloat16)
    return codes[:n], scales.permute(0, 2, 1).reshape(tiles * TILE, groups)[:n]


def packed_rows(packed: list[torch.Tensor], ids: torch.Tensor) -> torch.Tensor:
    """The rows ``ids`` ``(m,)`` of a weight the own kernels hold (an int4 plane's
    :func:`pack_int4` layout, one :func:`pack_int8g` tensor, or int8 in groups' two int4 planes,
    summed), as float32 ``(m, K)``: an embedding's lookups in an lm_head quantized with it.
    Only the blocks of the rows asked are read, through strided views of the packed bytes (a
    row is one column of its tile). int8 in groups' values are exact in float32 (a code times
    a bf16 scale; its two planes' parts sum to that), an int4 plane's ``(code - 8) * scale +
    zero`` rounded once."""
    tile, column = ids // TILE, ids % TILE
    rows = None
    for part in packed:
        _, groups, block = part.shape
        if block == BLOCK_INT8:
            codes = _strided(part, (8, TILE, 4), (64, 4, 1))[tile, :, :, column]  # (m, g, 8, 4)
            scales = _strided(part, (TILE, 2), (2, 1), GROUP * TILE)[tile, :, column]
            scale = scales.contiguous().view(torch.bfloat16).float()  # (m, g, 1)
            value = codes.view(torch.int8).reshape(-1, groups, GROUP).float() * scale
        else:
            pairs = _strided(part, (8, TILE, 2), (32, 2, 1))[tile, :, :, column]  # (m, g, 8, 2)
            # a byte's low nibble is input 4c + t, its high one 4c + 2 + t
            codes = torch.stack((pairs & 15, pairs >> 4), dim=3).reshape(-1, groups, GROUP)
            scale, zero = _column_scales(part, tile, column)  # (m, g, 1) each
            value = (codes.float() - 8) * scale + zero
        rows = value if rows is None else rows + value
    assert rows is not None, "no packed weight"
    return rows.reshape(ids.shape[0], -1)


def rows_in(
    packed: list[torch.Tensor], ids: torch.Tensor, n: int, dtype: torch.dtype
) -> torch.Tensor:
    """:func:`packed_rows` of a weight of ``n`` columns in ``dtype``: the same bits, the int8
    layout's through the library's ``int8g_rows`` (``csrc/quant_rows.cpp``; a layout the
    library's linears alone read, so it is loaded), one call where the strided views take ~15
    ops (a step's lookup of one SmolLM2-360M token, cold: ~0.2 ms -> ~0.07; Zen 4 EPYC)."""
    if len(packed) == 1 and packed[0].shape[2] == BLOCK_INT8:
        rows: torch.Tensor = torch.ops.batchline.int8g_rows(packed[0], ids.long(), n, dtype)
        return rows
    return packed_rows(packed, ids).to(dtype)


def _column_scales(
    part: torch.Tensor, tile: torch.Tensor, column: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The float32 scales and zeros ``(m, groups, 1)`` of the columns ``column`` of tiles
    ``tile`` of an int4 plane, read through strided views (any of :func:`pack_int4`'s layouts)."""
    block = part.shape[2]
    if block == BLOCK_STEPS:
        so = _strided(part, (2, TILE), (TILE, 1), 256)[tile, :, :, column].float()  # (m, g, 2)
        unit = _strided(part, (2,), (1,), 256 + 2 * TILE)[tile].contiguous()  # (m, g, 2)
        return step_scales(unit.view(torch.bfloat16), so[:, :, :1], so[:, :, 1:])
    width = 4 if block == BLOCK_F32 else 2  # the scales' bytes
    sz = _strided(part, (2, TILE, width), (TILE * width, width, 1), 256)
    sz = sz[tile, :, :, column].contiguous()  # (m, g, 2, width)
    sz = sz.view(torch.float32 if width == 4 else torch.bfloat16).float()  # (m, g, 2, 1)
    return sz[:, :, 0], sz[:, :, 1]


def _strided(
    part: torch.Tensor, inner: tuple[int, ...], strides: tuple[int, ...], offset: int = 0
) -> torch.Tensor:
    """``part`` ``(tiles, groups, block)`` uint8 seen as ``(tiles, groups, *inner)`` with
    ``strides`` inside a block, from byte ``offset`` of each block: no copy."""
    tiles, groups, block = part.shape
    return part.as_strided(
        (tiles, groups, *inner), (groups * block, block, *strides), part.storage_offset() + offset
    )


def int8g_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    streams: int = 1,
) -> torch.Tensor:
    """``x (rows, K) @ W.T (+ bias)`` for float32 ``x``, ``W`` the ``n`` columns
    :func:`pack_int8g` packed, ``bias`` float32 ``(n,)``: each row quantized to int8 per group of
    32 on the way in and summed in integers (``csrc/quant_gemm_a8.cpp``, the path
    :func:`int8g_width` says; one row ``streams`` tiles at a time; the library loaded and
    :func:`int8_activations_here`)."""
    rows = x.shape[0]
    out: torch.Tensor = torch.ops.batchline.int8g_linear_a8(
        x.contiguous(), packed, n, bias, int8g_width(rows, streams), streams
    )
    return out


def int8g_width(rows: int, streams: int = 1) -> int:
    """The path the int8 layout's product takes for ``rows`` rows: :data:`A8_WIDTH` from
    :data:`INT8G_WIDE_ROWS` rows on, and for one row read ``streams`` tiles at a time where that
    is more than one; else the 256-bit one (one tile at a time)."""
    return A8_WIDTH if rows >= INT8G_WIDE_ROWS or (rows == 1 and streams > 1) else 256


def int8_linear(
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor],
    n: int,
    bias: torch.Tensor | None = None,
    *,
    amx_rows: int = INT8_AMX_ROWS,
) -> torch.Tensor:
    """:func:`int4_linear` for the per-channel int8 weight :func:`pack_int8` packed (AMX by
    default from :data:`INT8_AMX_ROWS` rows on)."""
    codes, scales = packed
    out: torch.Tensor = torch.ops.batchline.int8_linear(
        x.contiguous(), codes, scales, n, bias, amx_rows
    )
    return out


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    amx_rows: int = AMX_ROWS,
    int8_rows: bool = False,
    streams: int = 1,
) -> torch.Tensor:
    """``x (rows, K) @ W.T (+ bias)`` in ``x``'s dtype (bf16, or float32 through
    ``csrc/quant_gemm_f32.cpp``), ``W`` the ``n`` columns :func:`pack_int4` packed, ``bias``
    float32 ``(n,)``; bf16 rows from ``amx_rows`` rows on through AMX tiles where the CPU has
    them; with ``int8_rows``, float32 rows, and fewer bf16 rows than :data:`A8_BF16_ROWS`,
    quantized to int8 per group of 32 on the way in and summed in integers
    (``csrc/quant_gemm_a8.cpp``: :func:`int8_activations_here`), one row ``streams`` tiles at
    a time (:func:`~.quant_streams.a8_streams`). The library must have been loaded
    (:func:`own_kernels` for that dtype)."""
    ops = torch.ops.batchline
    if int8_rows and (x.dtype == torch.float32 or x.shape[0] < A8_BF16_ROWS):
        quantized: torch.Tensor = ops.int4_linear_a8(
            x.contiguous(), packed, n, bias, A8_WIDTH, streams
        )
        return quantized
    if x.dtype == torch.float32:
        result: torch.Tensor = ops.int4_linear_f32(x.contiguous(), packed, n, bias, F32_WIDTH)
        return result
    out: torch.Tensor = ops.int4_linear(x.contiguous(), packed, n, bias, amx_rows)
    return out


def int4_dequantize(
    packed: torch.Tensor,
    n: int,
    dtype: torch.dtype = torch.bfloat16,
    into: torch.Tensor | None = None,
) -> torch.Tensor:
    """The weight ``(n, K)`` of the ``n`` columns :func:`pack_int4` packed, in ``dtype`` (bf16
    or float32): each ``(code - 8) * scale + zero`` in fp32, rounded to ``dtype`` once: a dense
    product of many rows takes it (a 2,048 -> 16,384 weight in bf16: 18 ms, where
    :func:`unpack_int4` and torch's arithmetic took 160). float32 only: written into the first
    ``n`` rows of ``into`` where given (a buffer reused: a fresh 134 MB one took as long to fault
    in as the dequantizing). The library must have been loaded (:func:`own_kernels`)."""
    if into is not None and dtype != torch.float32:
        raise ValueError("int4_dequantize writes into a buffer of float32 only")
    if dtype == torch.float32:
        result: torch.Tensor = torch.ops.batchline.int4_dequantize_f32(packed, n, into)
        return result
    out: torch.Tensor = torch.ops.batchline.int4_dequantize(packed, n)
    return out
