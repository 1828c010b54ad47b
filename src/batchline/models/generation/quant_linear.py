"""Weight-only int8 and int4 linears (``Knobs.weights``), and the codes they are built from.

A :class:`QuantLinear` holds its weight as integer codes and per-group scales, and computes
``x @ W.T (+ bias)`` in the activations' dtype: in bf16, int4 in groups of 32 through
batchline's own kernel where the CPU has AVX512-BF16 and int8 where it also has AMX
(:mod:`~batchline.models.generation.quant_kernel`: ~0.45-0.7x a dense bf16 linear at 1-16
rows, where torch's int4 took 0.6x at one row and 2.7-3.1x at 16, its int8 0.8x and 2.8-3.5x),
everything else through torch's CPU kernels:

- ``int8``: one scale per output channel, codes in [-127, 127] (symmetric);
  ``torch.ops.aten._weight_int8pack_mm``.
- ``int4``: one scale and one zero point per group of ``group_size`` input values, codes in
  [0, 15], the weight ``(code - 8) * scale + zero`` (torch's convention);
  ``torch.ops.aten._convert_weight_to_int4pack_for_cpu`` packs the codes once at load and
  ``_weight_int4pack_mm_for_cpu`` computes. A GGUF's Q4_0 and Q4_1 blocks are groups of 32 of
  this form; Q8_0's int8 codes (with a scale per 32) are split into two int4 planes, a high and a
  low nibble, whose products sum to the int8 one (:func:`int8_group_planes`), except for float32
  rows summed as int8, where they are joined again in an int8 layout of their own
  (:func:`~.quant_kernel.pack_int8g`: 8.5 bits a weight, not the planes' 10).

Measured on the 2-core AMX Xeon (one thread, a busy machine, SmolLM2-360M's fused gate/up
960 -> 5,120 and down 2,560 -> 960, µs per call, bf16 activations; dense = bf16 packed for
oneDNN): at 1 row dense 701 / 288, int8 493 / 189, int4 (group 32) 389 / 164, (64) 411 / 146;
at 16 rows dense 743 / 292, int8 2,870 / 1,067, int4 2,963 / 1,031. In float32 activations
the same kernels took 4-25x dense float32. So the int kernels pay at batch 1 in bf16 (x0.55
int4, x0.70 int8 of dense) and not in a 16-row step, nor in float32:
``benchmarks/bench_quant_step.py`` measures a whole decode step against its memory floor.
The group size, 32, is measured in :mod:`~batchline.models.generation.quant_codes`, which
holds the codes these layers are built from.
int8 stays per channel, torch's int8 kernel: on 6 prompts x 16 positions it agreed at 95.8 %
where bf16 itself did at 97.9 % (log-prob 3.1 % off), on 12 x 32 at 97.7 % as bf16 did (1.6 %
off); int8 in groups of 32 (Q8_0's form, the two int4 planes) agreed at 97.9 % on the 6 x 16
(0.7 % off) but took 1.1-1.3x a dense bf16 linear at one row where per channel took 0.6-0.7x,
so it did not pay as a speed format. The figures above are torch's kernels; the own int4
kernel's are in ``quant_kernel.py`` and docs/generation.md.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

# imported as a module: a decode step calls its kernels through it (a function's own import
# took ~2 us a call, ~100 calls a step), and tests patch its attributes
from batchline.models.generation import quant_kernel, quant_streams
from batchline.models.generation.decode_kernel import StepProduct
from batchline.models.generation.dense_tiles import TiledLinear
from batchline.models.generation.quant_codes import (
    Int4Codes,
    pack_planes,
)

__all__ = [
    "DENSE_ROWS",
    "QuantLinear",
    "describe_step_weights",
    "own_int4_packed",
    "require_int_kernels",
    "step_weight_bytes",
    "step_weight_count",
    "step_weight_formats",
    "use_int8_activations",
]

#: From this many rows on (a prefill chunk) a product dequantizes the weight and multiplies it
#: dense: the int kernels' time grows with the rows. SmolLM2's 576 -> 1,536 up-projection, bf16,
#: one thread, a busy machine: int4 11.5 ms at 512 rows where dense took 1.2 ms and unpacking
#: the int4 codes 5.3 ms (even at ~270 rows); int8 0.44 / 1.56 / 12.6 ms at 16 / 64 / 512 rows,
#: its dequantizing ~0.7 ms (even at ~32 rows; 256 rows went 10.9 -> 1.35 ms).
#: Through the own int4 kernel ("own") the time grows ~linearly from 16 rows on; its weight
#: is dequantized for a dense product by the kernel library (``int4_dequantize``: a 2,048 ->
#: 16,384 weight in 18 ms, 160 through ``dequantized``). That weight, kernel against
#: dequantized and dense, 2 threads (2026-12-02): 17.7 / 29.2 ms at 256 rows, 42.8 / 36.6 at
#: 512, 129.5 / 58.8 at 1,024 (8,192 -> 2,048: 11.4 / 15.5, 26.9 / 20.5, 52.1 / 26.5): the
#: kernel below 512 rows.
#: The own int8 kernel ("own8", AMX) takes 2.5x a packed bf16 weight's time at 256 rows, but
#: the layer has no such weight: dequantizing its layout costs ~65 ms a 2,048 -> 16,384
#: weight, where the kernel took 3.4 / 13.4 / 37 / 73 / 87 ms at 64 / 256 / 512 / 768 / 896
#: rows and 114 at 1,024 (dequantized: 65 / 71 / 77 / 90 / 92 and 101; 2026-12-02). From 64
#: rows, as it was, every prefill chunk (up to 512 tokens) dequantized each weight: a 1.7B
#: shape at 16 clients (``benchmarks/bench_sizes.py --servers own-bf16,own-int8 --clients 16``)
#: made 42.9 tok/s in int8, TTFT p50 7.05 s, against bf16's 53.9; from 1,024, 67.1 and 2.98 s
#: against bf16's 56.8.
#: The own int4 layout in float32 ("own32"; "own32g" for int8g's two planes, two passes of the
#: kernel): from 128 rows (64) a product dequantizes 1,024 output columns at a time into a
#: reused buffer and multiplies them dense (``_dense_f32``). Ice Lake, 2 threads, 2026-12-03,
#: kernel against that, ms: 2,048 -> 16,384 at 64 / 128 / 256 / 512 rows 33.7 / 82.3 / 131 / 272
#: against 40.4 / 67.5 / 108 / 190; 8,192 -> 2,048 17.2 / 34.6 / 68.5 / 152 against 18.3 / 27.9
#: / 49.6 / 85.1 (a whole weight dequantized afresh took ~40 ms more at 2,048 -> 16,384).
#: With int8 rows (``own32a8``, ``own32a8g``: :func:`use_int8_activations`) the kernel's integer
#: sums stay ahead of that dense product up to a whole prefill chunk: same host, ms at 16 / 64 /
#: 128 / 256 / 512 rows, 2,048 -> 16,384 int4 2.5 / 10.3 / 19.7 / 38.2 / 90.1 against 15.7 /
#: 27.9 / 46.0 / 78.6 / 136; 8,192 -> 2,048 1.4 / 5.4 / 10.0 / 23.6 / 38.7 against 10.1 / 15.1
#: / 22.1 / 36.8 / 63.8; int8g's two planes 2,048 -> 16,384 5.5 / 21.7 / 40.8 / 91.5 / 184
#: against 30.8 / 44.7 / 61.9 / 98.3 / 193, 8,192 -> 2,048 81.1 against 77.2 at 512.
#: int8g in its own layout (``own32a8q``) stayed ahead of a float32 weight held dense at every
#: row count measured (:func:`~.quant_kernel.int8g_here`): its limit is past any prefill chunk.
DENSE_ROWS = {
    "int8": 32,
    "int4": 256,
    "int8g": 256,
    "own": 512,
    "own8": 1024,
    "own32": 128,
    "own32g": 64,
    "own32a8": 1024,
    "own32a8g": 512,
    "own32a8q": 4096,
}
#: The activation dtypes the own int4 kernel takes (float32 where the CPU has no AVX512-BF16).
_OWN_INT4_DTYPES = (torch.bfloat16, torch.float32)
#: A float32 dense product of the own layout dequantizes this many output columns at a time
#: into a buffer each thread keeps (:meth:`QuantLinear._dense_f32`): a fresh whole weight (a
#: 2,048 -> 16,384 one: 134 MB) took ~40 ms to fault in, as long as dequantizing it.
DEQUANT_COLS = 1024
_scratch = threading.local()


def _own_int4_fits(dtype: torch.dtype, group_size: int) -> bool:
    return dtype in _OWN_INT4_DTYPES and group_size == quant_kernel.GROUP


def _own_int4_here(dtype: torch.dtype, group_size: int) -> bool:
    """Whether :meth:`QuantLinear.int4` computes through the own kernel by default."""
    return _own_int4_fits(dtype, group_size) and quant_kernel.own_kernels(dtype=dtype)[0]


def own_int4_packed(
    planes: list[Int4Codes],
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> list[torch.Tensor] | None:
    """``planes`` packed as :meth:`QuantLinear.int4` packs them by default (for
    :meth:`QuantLinear.own_int4`, kind ``int4`` for one plane, ``int8g`` for two), or None where
    that layer would compute through torch's kernel. Each tile of 16 output rows is packed on
    its own, so linears whose rows are a multiple of 16, packed apart and joined along the
    tiles (``torch.cat``), are the layer their joined planes make: a GGUF's load packs each
    linear as it reads it and never holds a block's codes a byte each. ``int8_rows``: the load
    sums rows as int8 (:func:`~.quant_codes.pack_planes`)."""
    if not _own_int4_here(dtype, planes[0].group_size):
        return None
    scales = scale_dtype or quant_kernel.scale_dtype_for(dtype)
    return pack_planes(planes, dtype, scales, int8_rows=int8_rows)


def require_int_kernels(aten: Any = None) -> None:
    """``ModelError`` where this torch lacks the CPU int8/int4 kernels (added in torch 2.6);
    ``aten``: the op namespace to look in (tests), by default torch's."""
    from batchline._errors import ModelError

    ops = ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu")
    namespace = torch.ops.aten if aten is None else aten
    if not all(hasattr(namespace, op) for op in ops):
        raise ModelError(
            f"int8/int4 weights need torch's CPU kernels (torch 2.6 or later; torch "
            f"{torch.__version__} is installed): upgrade torch, or set weights = 'float'"
        )


class QuantLinear(torch.nn.Module):
    """``nn.Linear``'s computation with the weight as int8 or int4 codes (see the module).

    Build it with :meth:`int8` or :meth:`int4`; the scales are kept in ``dtype``, the
    activations' dtype the kernels take (bfloat16 or float32).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        kind: str,
        bias: torch.Tensor | None,
        group_size: int,
    ) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.kind = kind
        self.group_size = group_size
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(), requires_grad=False)
        self._int8: tuple[torch.Tensor, torch.Tensor] | None = None
        self._planes: list[tuple[torch.Tensor, torch.Tensor]] = []  # torch's int4 layout
        self._own: list[torch.Tensor] = []  # or the own kernel's (quant_kernel.pack_int4)
        self._own8: tuple[torch.Tensor, torch.Tensor] | None = None  # quant_kernel.pack_int8
        #: whether ``_own`` is int8 in groups in :func:`~.quant_kernel.pack_int8g`'s layout (set
        #: where ``_own`` is: every forward asks); every row it computes is summed as int8
        self.int8_layout = False
        #: float32 rows through the own int4 kernel, and bf16 ones below
        #: :data:`~.quant_kernel.A8_BF16_ROWS`, quantized to int8 on the way in
        #: (:func:`use_int8_activations`)
        self.int8_rows = False
        #: the tiles a one-row int8-rows product reads at once (:func:`~.quant_streams.a8_streams`,
        #: chosen where ``_own`` is set: it depends on the layout)
        self.streams = 1

    @classmethod
    def int8(
        cls,
        codes: torch.Tensor,
        scales: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        own_kernel: bool | None = None,
    ) -> QuantLinear:
        """Per-channel int8 codes ``(N, K)`` and scales ``(N,)`` (:func:`quantize_int8`).
        ``own_kernel``: whether to compute through batchline's int8 kernel (bf16, inputs in
        multiples of 32; its scales stay float32) or torch's; by default the own one where
        the CPU has AMX (:func:`~batchline.models.generation.quant_kernel.own_kernels`)."""
        n, k = codes.shape
        layer = cls(k, n, kind="int8", bias=bias, group_size=k)
        fits = dtype == torch.bfloat16 and k % quant_kernel.GROUP == 0
        if own_kernel is None:
            own_kernel = fits and quant_kernel.own_kernels(amx=True)[0]
        elif own_kernel and not fits:
            raise ValueError(
                f"the own int8 kernel takes bf16 and inputs in multiples of "
                f"{quant_kernel.GROUP}, not {dtype} and {k}"
            )
        if own_kernel:
            layer._own8 = quant_kernel.pack_int8(codes, scales)
        else:
            layer._int8 = (codes.to(torch.int8).contiguous(), scales.to(dtype).contiguous())
        return layer

    @classmethod
    def int4(
        cls,
        planes: list[Int4Codes],
        *,
        bias: torch.Tensor | None = None,
        dtype: torch.dtype = torch.bfloat16,
        own_kernel: bool | None = None,
        scale_dtype: torch.dtype | None = None,
    ) -> QuantLinear:
        """One int4 plane (:func:`quantize_int4`, a GGUF's Q4_0/Q4_1), or the two of
        :func:`int8_group_planes`, whose products are summed (or, for float32 rows summed as int8,
        joined again in :func:`~.quant_kernel.pack_int8g`'s layout: :func:`pack_planes`).
        ``own_kernel``: whether to compute through batchline's int4 kernel (bf16 or float32,
        groups of 32 only) or torch's; by default the own one where it runs vectorized here
        for ``dtype`` (:func:`~.quant_kernel.own_kernels`). ``scale_dtype``: the own layout's
        scales (by default :func:`~.quant_kernel.scale_dtype_for` ``dtype``)."""
        n, k = planes[0].codes.shape
        kind = "int4" if len(planes) == 1 else "int8g"
        layer = cls(k, n, kind=kind, bias=bias, group_size=planes[0].group_size)
        if own_kernel is None:
            own_kernel = _own_int4_here(dtype, layer.group_size)
        elif own_kernel and not _own_int4_fits(dtype, layer.group_size):
            raise ValueError(
                f"the own int4 kernel takes bf16 or float32 and groups of {quant_kernel.GROUP}, "
                f"not {dtype} and groups of {layer.group_size}"
            )
        if scale_dtype is None:
            scale_dtype = quant_kernel.scale_dtype_for(dtype)
        if own_kernel:
            layer._set_own(pack_planes(planes, dtype, scale_dtype))
            return layer
        for plane in planes:
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
                plane.codes.to(torch.int32).contiguous(), 1
            )
            # the kernel's layout: (K // group_size, N, 2), scale then zero
            scales_zeros = torch.stack((plane.scales.T, plane.zeros.T), dim=2).to(dtype)
            layer._planes.append((packed, scales_zeros.contiguous()))
        return layer

    @classmethod
    def own_int4(
        cls,
        packed: list[torch.Tensor],
        n: int,
        k: int,
        *,
        kind: str = "int4",
        bias: torch.Tensor | None = None,
    ) -> QuantLinear:
        """A layer of the own int4 kernel's planes packed already
        (:func:`~batchline.models.generation.quantize.pack_own_int4`):
        one for ``int4``, two for ``int8g``."""
        layer = cls(k, n, kind=kind, bias=bias, group_size=quant_kernel.GROUP)
        layer._set_own(list(packed))
        return layer

    def _set_own(self, packed: list[torch.Tensor]) -> None:
        """Hold ``packed``, the own kernels' tensors: int4 planes, or one int8 layout, and the
        streams a one-row product of it reads."""
        self._own = packed
        self.int8_layout = bool(packed) and packed[0].shape[2] == quant_kernel.BLOCK_INT8
        self.streams = quant_streams.a8_streams(self.in_features, int8_layout=self.int8_layout)

    @property
    def own_kernel(self) -> bool:
        """Whether batchline's own kernel computes this layer (else torch's)."""
        return bool(self._own) or self._own8 is not None

    @property
    def weight_bytes(self) -> int:
        """The bytes this layer's weight (codes, scales, zeros) occupies."""
        tensors = [t for pair in self._planes for t in pair] + self._own
        tensors += list(self._own8 or ())
        if self._int8 is not None:
            tensors += list(self._int8)
        return sum(t.numel() * t.element_size() for t in tensors)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The weight's rows ``ids`` ``(m,)`` as ``(m, K)`` in ``dtype``, read from the own
        kernel's packed blocks of those rows alone (:func:`~.quant_kernel.rows_in`: an
        embedding looked up in a tied head). Only the own kernel's layouts have it: torch's
        would dequantize the whole weight at every lookup, a step's cost."""
        if not self._own:
            raise ValueError(
                f"rows are read from the own kernel's layouts, not a {self.kind} layer's"
            )
        return quant_kernel.rows_in(self._own, ids, self.out_features, dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight ``(N, K)`` in ``dtype``, computed from the codes as the kernels compute
        it (a new tensor each call)."""
        n, k = self.out_features, self.in_features
        if self._int8 is not None:
            codes, scales = self._int8
            return codes.to(dtype) * scales.to(dtype)[:, None]
        if self._own8 is not None:
            codes, scales = quant_kernel.unpack_int8(self._own8, n)
            return (codes.to(dtype) * scales.to(dtype)[:, None]).contiguous()
        if self.int8_layout:
            return _int8g_weight(self._own[0], n, dtype)
        out = torch.zeros(n, k, dtype=dtype)
        g = self.group_size
        for packed in self._own:
            codes, scales, zeros = quant_kernel.unpack_int4(packed, n)
            s, z = scales.to(dtype)[..., None], zeros.to(dtype)[..., None]
            out += ((codes.to(dtype).view(n, k // g, g) - 8) * s + z).view(n, k)
        for packed, scales_zeros in self._planes:
            codes = _unpack_int4(packed, n, k).to(dtype).view(n, k // g, g)
            s = scales_zeros[..., 0].T.to(dtype)[..., None]
            z = scales_zeros[..., 1].T.to(dtype)[..., None]
            out += ((codes - 8) * s + z).view(n, k)
        return out

    def _dense_weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The weight in ``dtype`` for a dense product: a bf16 one of the own int4 kernel's
        single plane from the kernel library's dequantizing (:func:`~.quant_kernel.
        int4_dequantize`, rounded once), any other from :meth:`dequantized`."""
        # bf16 only: float32 rows take _dense_f32; int8g has two planes or the int8 layout
        own_int4 = len(self._own) == 1 and not self.int8_layout
        if dtype == torch.bfloat16 and own_int4 and self._own_takes(dtype):
            return quant_kernel.int4_dequantize(self._own[0], self.out_features, dtype)
        return self.dequantized(dtype)

    def _own_takes(self, dtype: torch.dtype) -> bool:
        """Whether the own kernel computes rows of ``dtype``: the int8 one bf16 rows, the int4
        one float32 rows, and bf16 ones where its scales are bf16 (the layer was built where
        the CPU runs its dtype), the int8 layout's float32 rows."""
        if self._own8 is not None:
            return dtype == torch.bfloat16
        if not self._own:
            return False
        if self.int8_layout:  # summed as int8: float32 rows, or bf16 ones widened exactly
            return dtype in (torch.float32, torch.bfloat16)
        return dtype == torch.float32 or (
            dtype == torch.bfloat16
            and self._own[0].shape[2] in (quant_kernel.BLOCK, quant_kernel.BLOCK_STEPS)
        )

    def _dense_f32(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (float32) times the own layout's weight, dense, :data:`DEQUANT_COLS` output
        columns at a time: each chunk dequantized (its planes summed) into a buffer this thread
        keeps, then one dense product, so no whole float32 copy of the weight is made."""
        n, k = self.out_features, self.in_features
        # one buffer per plane, input width and chunk: int8g's second plane is summed in place.
        # Made outside inference mode: a normal tensor is written in place in either mode, one
        # made inside could not be written by a later call outside it.
        buffers: dict[tuple[int, int, int], torch.Tensor] = _scratch.__dict__.setdefault(
            "buffers", {}
        )
        mine = []
        for i in range(len(self._own)):
            key = (i, k, DEQUANT_COLS)
            if key not in buffers:
                with torch.inference_mode(False):
                    buffers[key] = torch.empty(DEQUANT_COLS, k)
            mine.append(buffers[key])
        out = torch.empty(flat.shape[0], n)
        for c0 in range(0, n, DEQUANT_COLS):
            cols = min(DEQUANT_COLS, n - c0)
            tiles = slice(c0 // quant_kernel.TILE, -(-(c0 + cols) // quant_kernel.TILE))
            if self.int8_layout:
                weight = _int8g_weight(self._own[0][tiles], cols, torch.float32, mine[0])
            else:
                weight = quant_kernel.int4_dequantize(
                    self._own[0][tiles], cols, torch.float32, mine[0]
                )
            for plane, buffer in zip(self._own[1:], mine[1:], strict=True):
                weight.add_(quant_kernel.int4_dequantize(plane[tiles], cols, torch.float32, buffer))
            bias = None if self.bias is None else self.bias[c0 : c0 + cols].float()
            out[:, c0 : c0 + cols] = torch.nn.functional.linear(flat, weight, bias)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # a step's rows: no reshape and view (~3 us of a ~20 us call)
            return self._rows(x)
        flat = x.reshape(-1, self.in_features)
        return self._rows(flat).view(*x.shape[:-1], self.out_features)

    def _rows(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat (rows, in_features) @ W.T (+ bias)``."""
        few = flat.shape[0] < DENSE_ROWS[self._dense_key(flat.dtype)]
        if few and self._own_takes(flat.dtype):  # a decode step's rows, the first test
            return self._own_forward(flat)
        if not few and flat.dtype == torch.float32 and self._own:  # own int4
            return self._dense_f32(flat)
        bias = None if self.bias is None else self.bias.to(flat.dtype)
        if not few:
            return torch.nn.functional.linear(flat, self._dense_weight(flat.dtype), bias)
        if self.own_kernel:  # activations of another dtype than the layer was built for
            return torch.nn.functional.linear(flat, self.dequantized(flat.dtype), bias)
        if self._int8 is not None:
            codes, scales = self._int8
            out = torch.ops.aten._weight_int8pack_mm(flat, codes, scales.to(flat.dtype))
        else:
            out = None
            for packed, scales_zeros in self._planes:
                part = torch.ops.aten._weight_int4pack_mm_for_cpu(
                    flat, packed, self.group_size, scales_zeros.to(flat.dtype)
                )
                out = part if out is None else out + part
        assert out is not None
        if self.bias is not None:
            out = out + self.bias
        result: torch.Tensor = out
        return result

    def step_product(self, dtype: torch.dtype) -> StepProduct | None:
        """This layer's product of a step's rows of ``dtype`` as one call of the kernel
        library, where it is one (the own kernel's, one plane, few rows): what
        :meth:`step_forward` calls, and what ``csrc/decode_layers.cpp`` calls for it; else
        None."""
        if len(self._own) != 1 or not self._own_takes(dtype):
            return None
        if self.int8_rows and (dtype == torch.float32 or self.int8_layout):
            layout = StepProduct.INT8G_A8 if self.int8_layout else StepProduct.INT4_A8
            extra = self.streams
        elif self.int8_layout:  # its rows are summed as int8 only
            return None
        elif dtype == torch.float32:
            layout, extra = StepProduct.INT4_F32, quant_kernel.F32_WIDTH
        elif self.int8_rows:
            layout, extra = StepProduct.INT4_BF16_A8, self.streams
        else:
            layout, extra = StepProduct.INT4_BF16, quant_kernel.AMX_ROWS
        bias = None if self.bias is None else self.bias.detach().float().contiguous()
        below = DENSE_ROWS[self._dense_key(dtype)]
        return StepProduct(layout, self._own[0], self.out_features, bias, extra, below)

    def step_forward(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """:meth:`forward` for a step loop that calls it many times a step: where this layer
        sums float32 rows as int8 in one plane (``int8_rows``), a 2-D float32 input of fewer
        rows than it computes dense goes to the kernel's op in one call, without
        :meth:`_rows`'s choosing (~3 us of Python a call, against 12-30 us of product at a
        360M shape's one row); any other input through :meth:`forward`, as before."""
        product = self.step_product(torch.float32) if self.int8_rows else None
        if product is None:
            return self.forward
        packed, n, bias, extra = product.packed, product.n, product.bias, product.extra
        limit, forward = product.rows_below, self.forward
        if product.layout == StepProduct.INT8G_A8:
            int8g, width_for = torch.ops.batchline.int8g_linear_a8, quant_kernel.int8g_width

            def op(x: torch.Tensor) -> torch.Tensor:
                width = width_for(x.shape[0], extra)
                return int8g(x, packed, n, bias, width, extra)  # type: ignore[no-any-return]

        else:
            int4, width = torch.ops.batchline.int4_linear_a8, quant_kernel.A8_WIDTH

            def op(x: torch.Tensor) -> torch.Tensor:
                return int4(x, packed, n, bias, width, extra)  # type: ignore[no-any-return]

        def step(x: torch.Tensor) -> torch.Tensor:
            if x.dim() == 2 and x.dtype == torch.float32 and x.shape[0] < limit:
                return op(x.contiguous())
            return forward(x)

        return step

    def _dense_key(self, dtype: torch.dtype) -> str:
        """This layer's entry of :data:`DENSE_ROWS` for rows of ``dtype``."""
        if self._own8 is not None:
            return "own8"
        if self.int8_layout:
            return "own32a8q"
        if self._own and dtype == torch.float32:
            if self.int8_rows:
                return "own32a8" if len(self._own) == 1 else "own32a8g"
            return "own32" if len(self._own) == 1 else "own32g"
        if self._own:
            return "own"
        return self.kind

    def _own_forward(self, flat: torch.Tensor) -> torch.Tensor:
        """``flat`` (bf16 or float32 rows) through the own int8 kernel, or the int4 one plane
        by plane, the bias (in float32) added in the first plane's sums."""
        bias = None if self.bias is None else self.bias.float()
        if self._own8 is not None:
            return quant_kernel.int8_linear(flat, self._own8, self.out_features, bias)
        if self.int8_layout:
            return quant_kernel.int8g_linear(
                flat, self._own[0], self.out_features, bias, streams=self.streams
            )
        # int4_linear says which rows go int8: every float32 row, a few bf16 ones
        a8, streams = self.int8_rows, self.streams
        out = quant_kernel.int4_linear(
            flat, self._own[0], self.out_features, bias, int8_rows=a8, streams=streams
        )
        for packed in self._own[1:]:
            out = out + quant_kernel.int4_linear(
                flat, packed, self.out_features, int8_rows=a8, streams=streams
            )
        return out

    def extra_repr(self) -> str:
        group = "" if self.kind == "int8" else f", group_size={self.group_size}"
        group += ", own kernel" if self.own_kernel else ""
        group += ", int8 activations" if self.int8_rows else ""
        sizes = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{sizes}, {self.kind}{group}"


def _int8g_weight(
    packed: torch.Tensor, n: int, dtype: torch.dtype, into: torch.Tensor | None = None
) -> torch.Tensor:
    """The weight ``(n, K)`` in ``dtype`` of :func:`~.quant_kernel.pack_int8g`'s layout:
    ``code * scale`` in float32, rounded to ``dtype`` once; float32 only: written into the
    first ``n`` rows of ``into`` where given (:meth:`QuantLinear._dense_f32`'s buffer)."""
    codes, scales = quant_kernel.unpack_int8g(packed, n)
    group = quant_kernel.GROUP
    shape = (n, codes.shape[1] // group, group)
    if into is not None:
        weight = into[:n]
        torch.mul(codes.view(shape), scales.float()[..., None], out=weight.view(shape))
        return weight
    weight = codes.float().view(shape) * scales.float()[..., None]
    return weight.view(n, -1).to(dtype)


def _unpack_int4(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The codes ``(N, K)`` of torch's CPU int4 layout (``_convert_weight_to_int4pack_for_cpu``,
    torch 2.13, read from its output): blocks of 64 rows, each K-major with row j in the low
    nibble and row j + 32 in the high one, then the last ``N % 64`` rows, K-major, rows 2j and
    2j + 1 in one byte (tests/models/generation/test_quant.py pins it)."""
    flat = packed.reshape(-1)
    full = n // 64 * 64
    head = flat[: full * k // 2].reshape(n // 64, k, 32)
    rows = torch.cat((head & 15, head >> 4), dim=2).permute(0, 2, 1).reshape(full, k)
    if full == n:
        return rows
    tail = flat[full * k // 2 :].reshape(k, (n - full) // 2)
    rest = torch.stack((tail & 15, tail >> 4), dim=2).reshape(k, n - full).T
    return torch.cat((rows, rest))


def step_weight_bytes(model: torch.nn.Module) -> int:
    """The weight bytes a decode step reads: every linear's (int8/int4 codes and scales, dense
    weights, the lm_head's), the embedding's looked-up rows left out."""
    return sum(step_weight_formats(model, torch.float32).values())


def step_weight_count(model: torch.nn.Module) -> int:
    """The weights a decode step multiplies: each linear's inputs x outputs, whatever its
    format (a model's size for the engine's thread count, before or after quantizing)."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear | TiledLinear):
            count += module.in_features * module.out_features
        elif isinstance(module, torch.nn.Linear):
            count += module.weight.numel()
    return count


#: The dense dtypes' short names, as the load log says them.
_DENSE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def step_weight_formats(model: torch.nn.Module, dense: torch.dtype) -> dict[str, int]:
    """:func:`step_weight_bytes` by format, largest first: ``int4``, ``int8`` and ``int8g`` (a
    GGUF's Q8_0, int8 in groups of 32) for the :class:`QuantLinear` layers, the dtype's short
    name (``bf16``, ``fp32``) for the dense ones; a linear packed for oneDNN is in ``dense``,
    the dtype the model was loaded in, one in the own tiles in bf16 (the tiles' bytes)."""
    from batchline.models.common.packed_linear import PackedLinear

    formats: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear):
            name, size = module.kind, module.weight_bytes
        elif isinstance(module, PackedLinear):
            name, size = _DENSE_NAMES.get(dense, str(dense)), module.weight_bytes
        elif isinstance(module, TiledLinear):
            name, size = "bf16", module.weight_bytes
        elif isinstance(module, torch.nn.Linear):
            weight = module.weight
            name = _DENSE_NAMES.get(weight.dtype, str(weight.dtype))
            size = weight.numel() * weight.element_size()
        else:
            continue
        formats[name] = formats.get(name, 0) + size
    return dict(sorted(formats.items(), key=lambda item: -item[1]))


def use_int8_activations(model: torch.nn.Module) -> int:
    """Have each of ``model``'s linears the own int4 kernel computes quantize its float32 rows,
    or its bf16 ones below :data:`~.quant_kernel.A8_BF16_ROWS` (a step's few on AMX, every one
    elsewhere), to int8 on the way in (``int8_rows``); the number of such linears. The caller
    has checked that the kernel runs here (:func:`~.quant_kernel.int8_activations_here`)."""
    count = 0
    for module in model.modules():
        if isinstance(module, QuantLinear) and module._own:
            module.int8_rows = True
            count += 1
    return count


def describe_step_weights(model: torch.nn.Module, dense: torch.dtype) -> str:
    """The load log's words for what a decode step reads: ``"1,162 MiB (int4 868, bf16 294)"``."""
    formats = step_weight_formats(model, dense)
    parts = ", ".join(f"{name} {size / 2**20:,.0f}" for name, size in formats.items())
    return f"{sum(formats.values()) / 2**20:,.0f} MiB ({parts})"
