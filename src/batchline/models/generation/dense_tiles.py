"""Dense bf16 linears in the kernel library's tiles (``csrc/dense_tiles.cpp``), for CPUs with
AVX512-BF16.

There oneDNN's bf16 product, its weight packed once (:class:`~batchline.models.common.
packed_linear.PackedLinear`), streams a decode step's weights at about two thirds of the memory's
bandwidth: a 1.7B-shaped batch-1 step took x1.51-2.25 its memory floor (docs/generation.md,
Zen 4). :class:`TiledLinear` holds the weight in tiles of 16 output columns whose 64-byte lines
are ``vdpbf16ps``'s operands, and computes every row count through the library's op: on the
1.7B shape's four linears, 2 threads, Zen 4 EPYC, 2026-12-04, it took x0.71 oneDNN's time at one
row, x0.80 at 4, x0.90-0.92 at 16 and x0.94-0.99 from 32 to 256 rows. The tiles take the
weight's bytes (plus the last tile's padding columns), as oneDNN's packed copy does.

On a CPU with AMX the same tiles are AMX products' operands, and from :data:`AMX_ROWS` rows on
the op multiplies them there (oneDNN multiplies on AMX too, where ``vdpbf16ps`` alone took x1.7
its time at 8 rows): the 1.7B shape's linears took x0.82-0.86 oneDNN's time from 1 to 16 rows,
x0.75-0.86 at 32-64 and x0.98-1.17 at 256-512 (2-core AMX Xeon, 2026-12-06); at one row the two
paths ran alike and ``vdpbf16ps`` is kept.

Where they are taken: :func:`choose_dense` (the ``dense_linears`` knob; ``auto`` follows the
host kind's measured default, :data:`~.torch_dtype.KIND_DEFAULTS`: the tiles on both kinds
with AVX512-BF16).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from batchline.models.generation.decode_kernel import StepProduct

__all__ = [
    "AMX_ROWS",
    "DENSE_LINEARS",
    "DenseChoice",
    "TiledLinear",
    "choose_dense",
    "tile_linear_weights",
    "tile_weight",
]

#: The ``dense_linears`` knob's values.
DENSE_LINEARS = ("auto", "onednn", "tiles")
#: Output columns per tile (``kTile`` in ``csrc/quant_layout.h``).
TILE = 16
#: From this many rows on, a product goes through AMX tiles where the CPU has them (at one row
#: the two paths ran alike; at 2 AMX took x0.89-0.92 vdpbf16ps's time: the module's runs).
AMX_ROWS = 2


@dataclass(frozen=True, slots=True)
class DenseChoice:
    """How the torch backend computes a model's dense linears: ``tiles`` (:class:`TiledLinear`)
    or ``onednn`` (:class:`~batchline.models.common.packed_linear.PackedLinear`), and why."""

    kernel: str
    reason: str

    @property
    def tiles(self) -> bool:
        return self.kernel == "tiles"

    def __str__(self) -> str:
        where = "the own bf16 tiles" if self.tiles else "oneDNN"
        return f"dense linears through {where} ({self.reason})"


def choose_dense(
    asked: str, dtype: torch.dtype, flags: Collection[str] | None = None
) -> DenseChoice:
    """The dense linears' kernel for ``asked`` (one of :data:`DENSE_LINEARS`) in a model
    computing in ``dtype`` on a CPU with ``flags`` (default: this one's). ``auto`` takes the
    tiles where the host kind measured them faster and the model computes in bf16; ``tiles``
    asked where they cannot run raises ``ValueError`` saying why. The library is not loaded
    here: :func:`tile_linear_weights` checks it."""
    from batchline._cpu import cpu_flags
    from batchline.models.generation.torch_dtype import kind_defaults

    if asked not in DENSE_LINEARS:
        raise ValueError(f"dense_linears must be one of {', '.join(DENSE_LINEARS)}, not {asked!r}")
    if asked == "onednn":
        return DenseChoice("onednn", "asked")
    have = set(cpu_flags() if flags is None else flags)
    why_not = ""
    if dtype != torch.bfloat16:
        why_not = f"the tiles compute bf16, the model {str(dtype).removeprefix('torch.')}"
    elif "avx512_bf16" not in have:
        why_not = "the tiles need AVX512-BF16, which this CPU lacks"
    if asked == "tiles":
        if why_not:
            raise ValueError(f"dense_linears=tiles: {why_not}; use auto or onednn")
        return DenseChoice("tiles", "asked")
    if why_not:
        return DenseChoice("onednn", why_not)
    kind, defaults = kind_defaults(have)
    if not defaults.dense_tiles:
        return DenseChoice("onednn", f"{kind} host: {defaults.dense_measured}")
    return DenseChoice("tiles", f"{kind} host: {defaults.dense_measured}")


def tile_weight(weight: torch.Tensor) -> torch.Tensor:
    """A ``(n, K)`` bf16 weight (``K`` even) as ``(ceil(n / 16), K / 2, 16)`` int32 tiles: entry
    ``[t, p, j]`` holds column ``16t+j``'s inputs ``2p`` (low half) and ``2p+1`` (high half),
    the last tile's padding columns zero (``csrc/dense_tiles.cpp``)."""
    n, k = weight.shape
    if weight.dtype != torch.bfloat16 or k % 2:
        raise ValueError(f"tiles take a bf16 weight of even inputs, not {weight.dtype} x {k}")
    count = -(-n // TILE)
    if count * TILE != n:
        padded = weight.new_zeros(count * TILE, k)
        padded[:n] = weight
        weight = padded
    pairs = weight.reshape(count, TILE, k // 2, 2).permute(0, 2, 1, 3).contiguous()
    return pairs.view(torch.int32).reshape(count, k // 2, TILE)


class TiledLinear(torch.nn.Module):
    """``nn.Linear``'s computation in bf16 through the library's tiles (see the module): any
    number of rows, inputs of any leading shape. The bias is kept in float32 and added before
    the one rounding to bf16."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self._tiles = tile_weight(linear.weight.detach())
            bias = linear.bias
            self._bias = None if bias is None else bias.detach().to(torch.float32).contiguous()
        self.bias = linear.bias

    @property
    def weight_bytes(self) -> int:
        """The tiles' bytes (what a product reads: the weight's, and the last tile's padding)."""
        return int(self._tiles.numel()) * 4

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.dtype != torch.bfloat16:
            raise TypeError(f"a tiled linear computes bf16 rows, not {rows.dtype}")
        out: torch.Tensor = torch.ops.batchline.bf16_tiles_linear(
            rows.contiguous(), self._tiles, self.out_features, self._bias, AMX_ROWS
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def step_product(self, dtype: torch.dtype) -> StepProduct | None:
        """Its product of a step's bf16 rows as one call of the library (any number of them)."""
        if dtype != torch.bfloat16:
            return None
        tiles, n = self._tiles, self.out_features
        return StepProduct(
            StepProduct.BF16_TILES, tiles, n, self._bias, extra=AMX_ROWS, rows_below=2**62
        )

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiled"


def tile_linear_weights(model: torch.nn.Module) -> int:
    """Replace ``model``'s bf16 ``nn.Linear`` layers on CPU (inputs even) by
    :class:`TiledLinear` ones, giving back the file pages of the weights replaced, and return how
    many. Raises ``RuntimeError`` where the kernel library cannot run them (not built, or a CPU
    without AVX512-BF16): the caller chose the tiles (:func:`choose_dense`) before loading it."""
    from batchline.models.common.torch_weights import release_file_pages
    from batchline.models.generation.quant_kernel import own_kernels

    swaps = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype == torch.bfloat16
        and child.weight.device.type == "cpu"
        and child.in_features % 2 == 0
    ]
    if not swaps:
        return 0
    runs, why = own_kernels(dtype=torch.bfloat16)
    if not runs:
        raise RuntimeError(f"the own bf16 tiles cannot run here: {why}")
    for parent, name, child in swaps:
        setattr(parent, name, TiledLinear(child))
    release_file_pages(child.weight for _, _, child in swaps)
    return len(swaps)
