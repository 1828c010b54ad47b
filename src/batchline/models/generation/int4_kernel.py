"""batchline's own int4 linear for a decode step's few rows (``csrc/quant_gemm.cpp``).

torch's CPU int4 kernel (``_weight_int4pack_mm_for_cpu``) is fast at one row and slows down
with every row added: on the AMX Xeon it took 3.5-4x a dense bf16 linear at 16 rows. This one
unpacks each block of 64 codes to bf16 once, in registers, and sums it against up to 8 rows
with AVX512-BF16's ``vdpbf16ps``; the scale and the zero of a group are applied once per group
in fp32 (see the C++ source's header for the arithmetic and the packed layout).

:func:`pack_int4` lays out the codes, scales and zeros of an
:class:`~batchline.models.generation.quant_linear.Int4Codes` (groups of 32,
``(code - 8) * scale + zero``, scales and zeros rounded to bf16) for it, once at load; :func:`int4_linear` computes ``x @ W.T (+ bias)`` for bf16 ``x``. :func:`int4_kernel`
says whether this machine has it: the library built (:func:`~batchline.models.generation.
decode_kernel.decode_kernel`) and a CPU with AVX512-BF16 (elsewhere the library computes the
same sums in plain C++, which is correct but not fast, so the callers keep torch's kernel).
"""

from __future__ import annotations

import torch

from batchline.models.generation.decode_kernel import _cpu_flags, decode_kernel

__all__ = ["AMX_ROWS", "GROUP", "TILE", "int4_kernel", "int4_linear", "pack_int4", "unpack_int4"]

#: The inputs per group, and the output columns per tile, of the packed layout.
GROUP = 32
TILE = 16
#: From this many rows on the kernel sums through AMX tiles (where the CPU has them), below it
#: through vdpbf16ps (see the module docstring).
AMX_ROWS = 2


def int4_kernel() -> tuple[bool, str]:
    """``(True, where the library is)`` where :func:`int4_linear` runs vectorized here, else
    ``(False, why not)``."""
    op, where = decode_kernel()
    if op is None:
        return False, where
    if "avx512_bf16" not in _cpu_flags().split():
        return False, "the CPU has no AVX512-BF16"
    return True, where


def pack_int4(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
    """The ``(tiles, K // 32, 320)`` uint8 layout the kernel reads of int4 ``codes`` ``(N, K)``
    with ``scales`` and ``zeros`` ``(N, K // 32)``: per 16 output columns and group, 256 bytes
    of codes then the 16 scales and 16 zeros as bf16 (the last tile padded with weight 0)."""
    n, k = codes.shape
    if k % GROUP or scales.shape != (n, k // GROUP) or zeros.shape != scales.shape:
        raise ValueError(
            f"the int4 kernel takes groups of {GROUP}: codes {tuple(codes.shape)} with scales "
            f"{tuple(scales.shape)} and zeros {tuple(zeros.shape)}"
        )
    tiles, groups = -(-n // TILE), k // GROUP
    pad = tiles * TILE - n
    c = codes.to(torch.uint8)
    s, z = scales.to(torch.bfloat16), zeros.to(torch.bfloat16)
    if pad:
        c = torch.cat((c, torch.full((pad, k), 8, dtype=torch.uint8)))
        s = torch.cat((s, torch.zeros(pad, groups, dtype=torch.bfloat16)))
        z = torch.cat((z, torch.zeros(pad, groups, dtype=torch.bfloat16)))
    # (tile, column i, group, chunk, nibble h, t): input 4 * chunk + 2 * h + t of the group
    v = c.reshape(tiles, TILE, groups, 8, 2, 2).permute(0, 2, 3, 4, 1, 5)
    chunks = (v[:, :, :, 0] | (v[:, :, :, 1] << 4)).reshape(tiles, groups, 256)
    sz = torch.stack((s.reshape(tiles, TILE, groups), z.reshape(tiles, TILE, groups)), dim=1)
    # (tile, scale|zero, column, group) -> (tile, group, scale|zero, column), as bytes
    sz_bytes = sz.permute(0, 3, 1, 2).contiguous().view(torch.uint8).reshape(tiles, groups, 64)
    return torch.cat((chunks, sz_bytes), dim=2).contiguous()


def unpack_int4(packed: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The codes ``(n, K)`` (uint8), scales and zeros ``(n, K // 32)`` (bf16) that
    :func:`pack_int4` packed."""
    tiles, groups, _ = packed.shape
    chunks = packed[:, :, :256].reshape(tiles, groups, 8, TILE, 2)
    v = torch.stack((chunks & 15, chunks >> 4), dim=3)  # (tile, group, chunk, h, i, t)
    codes = v.permute(0, 4, 1, 2, 3, 5).reshape(tiles * TILE, groups * GROUP)
    sz = packed[:, :, 256:].contiguous().view(torch.bfloat16).reshape(tiles, groups, 2, TILE)
    sz = sz.permute(2, 0, 3, 1).reshape(2, tiles * TILE, groups)
    return codes[:n], sz[0, :n], sz[1, :n]


def int4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    amx_rows: int = AMX_ROWS,
) -> torch.Tensor:
    """``x (rows, K) @ W.T (+ bias)`` in bf16, ``W`` the ``n`` columns :func:`pack_int4`
    packed, ``bias`` float32 ``(n,)``; from ``amx_rows`` rows on through AMX tiles where the
    CPU has them. The library must have been loaded (:func:`int4_kernel`)."""
    out: torch.Tensor = torch.ops.batchline.int4_linear(x.contiguous(), packed, n, bias, amx_rows)
    return out
