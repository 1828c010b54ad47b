"""Which of a model's linears become :class:`~.quant_linear.QuantLinear` layers, and how:
the decoder layers' (:func:`quantize_linears`, ``Knobs.weights`` int8 or int4; for the own int4
kernel, q/k/v and gate/up fused as they are packed, :func:`fuse_quantized`), the lm_head's
(:func:`quantize_lm_head`: int8 in groups of 32 where the own kernel runs), each weight packed
for the own int4 kernel a chunk of rows at a time (:func:`pack_own_int4`), and the load log's
account of it (:class:`QuantReport`). The formats, the codes and the layer are
:mod:`~.quant_linear`'s; :mod:`~.engine_layout` calls these a layer at a time."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from batchline.models.generation.quant_codes import (
    INT4_GROUP_SIZE,
    int4_group_size,
    pack_int8_groups,
    quantize_int4,
    quantize_int4_steps,
    quantize_int8,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear

__all__ = [
    "INT8_LAYOUT",
    "PACK_CHUNK_ROWS",
    "PACK_CHUNK_VALUES",
    "QuantReport",
    "Rows",
    "fuse_quantized",
    "int8_groups_head",
    "int8_groups_here",
    "int8_groups_packed",
    "pack_own_int4",
    "quantize_linears",
    "quantize_lm_head",
]


@dataclass(frozen=True, slots=True)
class QuantReport:
    """What :func:`quantize_linears` quantized: how many linears, as what, their weight bytes
    before and after, and whose kernel computes them (said in the load log)."""

    kind: str
    linears: int
    bytes_before: int
    bytes_after: int
    kernel: str = "torch's kernel"
    #: the lm_head's report where :func:`quantize_lm_head` quantized it, else None (kept)
    head: QuantReport | None = None
    #: an lm_head's: how the embedding is looked up where it went int8 with the head
    #: (:func:`~.quant_embedding.embed_quantized`), else None (kept as it was)
    embedding: str | None = None
    #: how the linears are held where the kind does not say it all (:data:`STEPS_LAYOUT`,
    #: :data:`INT8_LAYOUT`)
    layout: str | None = None

    def __add__(self, other: QuantReport) -> QuantReport:
        """Both reports' linears and bytes (one kind, one kernel: layers quantized in turn)."""
        return QuantReport(
            self.kind,
            self.linears + other.linears,
            self.bytes_before + other.bytes_before,
            self.bytes_after + other.bytes_after,
            self.kernel if self.linears else other.kernel,
            self.head or other.head,
            self.embedding or other.embedding,
            self.layout or other.layout,
        )

    @property
    def bytes_text(self) -> str:
        """Its bytes before and after, for the load log."""
        return f"{self.bytes_before / 2**20:.0f} -> {self.bytes_after / 2**20:.0f} MiB"

    @property
    def head_text(self) -> str:
        """This report as an lm_head's, for the load log (the embedding's fate with it)."""
        layout = f" {self.layout}" if self.layout else ""
        text = f"lm_head as {self.kind} in groups of {INT4_GROUP_SIZE}{layout}, {self.bytes_text}"
        return f"{text}; {self.embedding or 'embedding kept'}"

    def __str__(self) -> str:
        head = self.head
        kept = "embedding and lm_head kept" if head is None else head.head_text
        kind = f"{self.kind} {self.layout}" if self.layout else self.kind
        through = f"{self.linears} linears as {kind} through {self.kernel}"
        return f"{through} ({self.bytes_text}; {kept})"


def quantize_linears(
    model: torch.nn.Module,
    kind: str,
    dtype: torch.dtype,
    layers: Sequence[torch.nn.Module] | None = None,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> QuantReport:
    """Replace the ``nn.Linear`` layers of ``model.model.layers`` (``layers`` of them where
    given: a loader quantizing one layer at a time) (after
    :func:`~batchline.models.generation.lean_llama.fuse_projections`: the fused ones) by
    :class:`QuantLinear` of ``kind`` (``int8`` or ``int4``), scales in ``dtype`` (the own
    kernel's in ``scale_dtype``: :func:`pack_own_int4`). The embedding
    (a lookup) and the lm_head stay as they are. A quantized lm_head would be faster where the
    own kernel has AMX (SmolLM2-1.7B's 49,152 x 2,048, two threads, against bf16 packed: int4
    9.9 -> 3.0 ms at one row, 11.0 -> 6.1 at 16), but fails the quality gate
    (``benchmarks/bench_quant_quality.py``, SmolLM2-135M's real weights, 2026-12-02): with it
    int4 scored 89.8 % top-1 and drifted 11.8 % in log-prob (limit 2 %), int8 97.0 % and 2.5 %;
    with it dense, 98.4 % / 0.4 % and 97.2 % / 1.7 %. An int4 linear needs 16 | outputs and
    32 | inputs (torch's layout): one that has not stays dense (the report counts those
    quantized). ``int8_rows``: the load sums rows as int8 (``int8`` then goes in groups of 32
    where every bf16 row is summed so: :func:`int8_groups_for`)."""
    if kind not in ("int8", "int4"):
        raise ValueError(f"weights must be int8 or int4, got {kind!r}")
    if layers is None:
        layers = [model.model.layers]  # type: ignore[union-attr, list-item]
    swaps: list[tuple[torch.nn.Module, str, torch.nn.Linear]] = []
    for parent in (m for layer in layers for m in layer.modules()):
        for name, child in parent.named_children():
            if type(child) is not torch.nn.Linear or child.weight.device.type != "cpu":
                continue
            n, k = child.weight.shape
            # torch's int4 layout packs 16 output rows at a time, in groups of 32 inputs
            if kind == "int8" or (n % 16 == 0 and k % INT4_GROUP_SIZE == 0):
                swaps.append((parent, name, child))
    own_int4 = _own_int4(kind, dtype)
    int8_groups = kind == "int8" and int8_groups_for(dtype, int8_rows=int8_rows)
    packs_int8 = functools.partial(_int8_packed, int8_rows=int8_rows)
    before = after = 0
    for parent, name, child in swaps:
        weight = child.weight.detach()
        before += weight.numel() * weight.element_size()
        bias = None if child.bias is None else child.bias.detach()
        if int8_groups and weight.shape[1] % INT4_GROUP_SIZE == 0:
            packed = pack_own_int4([weight], packs_int8, dtype, scale_dtype)
            layer = QuantLinear.own_int4(packed, *weight.shape, kind="int8g", bias=bias)
        elif kind == "int8":
            layer = QuantLinear.int8(*quantize_int8(weight), bias=bias, dtype=dtype)
        elif own_int4:  # a chunk of rows at a time: one chunk's temporaries, not the weight's
            int4_group_size(weight.shape[1])  # raises for a width it does not take
            packed = pack_own_int4([weight], _int4_packed, dtype, scale_dtype)
            layer = QuantLinear.own_int4(packed, *weight.shape, bias=bias)
        else:
            codes = quantize_int4(weight, int4_group_size(weight.shape[1]))
            layer = QuantLinear.int4([codes], bias=bias, dtype=dtype)
        after += layer.weight_bytes
        setattr(parent, name, layer)
    own = any(isinstance(m, QuantLinear) and m.own_kernel for x in layers for m in x.modules())
    return QuantReport(
        "int8g" if int8_groups else kind,
        len(swaps),
        before,
        after,
        _kernel_path(kind, dtype, int8_rows=int8_rows and (own_int4 or int8_groups))
        if own
        else "torch's kernel",
        layout=STEPS_LAYOUT if own_int4 and swaps else None,
    )


def int8_groups_for(dtype: torch.dtype, *, int8_rows: bool = False) -> bool:
    """Whether ``weights = int8`` quantizes linears computing in ``dtype`` in groups of 32 (the
    own kernel's int8 layout, or two int4 planes: the lm_head's format, a GGUF Q8_0's) rather
    than per output channel: in float32, and in bf16 where every row is summed as int8
    (``int8_rows`` on a host without AMX: ``quant_kernel.A8_BF16_ROWS``), wherever the own int4
    kernel runs. Per channel, torch's int8 kernel took x2.9 a dense float32 step (SmolLM2-360M's
    shape, batch 1, AVX-512 without BF16) and in bf16 x1.41 a dense bf16 one (Zen 4, 2026-12-05);
    on AMX a bf16 model keeps the own per-channel kernel, whose tiles take a step's many rows
    faster than the int8 layout (``benchmarks/bench_int8_layout_bf16.py``)."""
    from batchline.models.generation import quant_kernel

    bf16_every_row = int8_rows and dtype == torch.bfloat16 and quant_kernel.every_row_int8(dtype)
    return (dtype == torch.float32 or bf16_every_row) and _own_int4("int4", dtype)


#: The rows of a weight quantized and packed for the own kernel at a time (a multiple of its
#: 16-column tiles): one chunk's float32 copy, codes and packing temporaries, not the whole
#: weight's. A 3B shape's int4 load (``benchmarks/bench_quant_step.py --rss``, 2026-12-02)
#: peaked at 2.54 GiB with chunks of 4,096 rows (~300 MB of temporaries for its lm_head's
#: 3,072 inputs), at 2.35 with 1,024; whole weights, at 2.95. With q/k/v and gate/up fused as
#: they are packed (:func:`fuse_quantized`) the peak is the lm_head's: 2.28 GiB with 1,024
#: rows, 2.25 with 256, whose load took 1.9 s longer (17.8 s); the model loaded is 2.22.
PACK_CHUNK_ROWS = 1024
#: A chunk's values at most (8 MiB as float32): a wide weight's chunk is fewer rows. A 3B
#: shape's int4 load in float32 with int8 rows (2026-12-04, Zen 4): chunks of 1,024 rows of
#: its down projection's 8,192 inputs peaked at 2.24 GiB, of 256 at 2.22, what the model
#: loaded holds after one answer; int8 in groups the same way, 3.38 GiB.
PACK_CHUNK_VALUES = 2**21


#: ``pack(rows, dtype, scale_dtype)``: a chunk of a weight's rows quantized and laid out for the
#: own kernels (:func:`~.quant_codes.pack_planes` or :func:`~.quant_codes.pack_int8_groups`).
PackRows = Callable[[torch.Tensor, torch.dtype, torch.dtype], list[torch.Tensor]]


class Rows(Protocol):
    """What :func:`pack_own_int4` reads of a weight ``(N, K)``: its shape, its dtype, and a
    slice of its rows at a time as a tensor. A tensor is one; a GGUF tensor's rows dequantized
    as they are asked for are another (``gguf_weights``: no whole float copy of the weight is
    made)."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def __getitem__(self, rows: slice, /) -> torch.Tensor: ...


def pack_own_int4(
    weights: Sequence[Rows],
    pack: PackRows,
    dtype: torch.dtype = torch.bfloat16,
    scale_dtype: torch.dtype | None = None,
) -> list[torch.Tensor]:
    """The own kernels' packed parts (int4's one plane, int8 in groups' layout or two planes)
    of ``weights`` (each ``(N_i, K)``) stacked by rows: ``pack(rows, dtype, scale_dtype)`` for
    each chunk of rows of each weight in turn (:data:`PACK_CHUNK_ROWS`, fewer for a wide one:
    :data:`PACK_CHUNK_VALUES`), put together (the layout is per 16 rows: the same bytes as one
    pass over the stacked weight, which is never made). Every
    weight but the last has a multiple of 16 rows. The scales are kept in ``scale_dtype``, by
    default bf16, or float32 for a model computing in float32 (``dtype``:
    :func:`~.quant_kernel.scale_dtype_for`).
    Each chunk's pages of a mapped file are given back once it is packed: weights read from
    a file are read once here (an embedding tied to a head packed so is then looked up in the
    head's codes: :mod:`~.quant_embedding`)."""
    from batchline.models.common.torch_weights import file_mappings, release_file_pages
    from batchline.models.generation import quant_kernel

    if any(w.shape[0] % quant_kernel.TILE for w in weights[:-1]):
        shapes = [tuple(w.shape) for w in weights]
        raise ValueError(f"only the last weight stacked may leave a tile part-filled: {shapes}")
    n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
    tiles, groups = -(-n // quant_kernel.TILE), k // quant_kernel.GROUP
    if scale_dtype is None:
        scale_dtype = quant_kernel.scale_dtype_for(dtype)
    files = file_mappings()  # read once: packing maps no file
    packed: list[torch.Tensor] = []
    tile = 0
    for weight in weights:
        tile_rows = max(1, PACK_CHUNK_VALUES // (k * quant_kernel.TILE))
        chunk = min(PACK_CHUNK_ROWS, tile_rows * quant_kernel.TILE)
        for start in range(0, weight.shape[0], chunk):
            rows = weight[start : start + chunk]
            parts = pack(rows, dtype, scale_dtype)
            if not packed:  # the layout's block size is the first chunk's
                packed = [
                    torch.empty((tiles, groups, p.shape[2]), dtype=torch.uint8) for p in parts
                ]
            for part, into in zip(parts, packed, strict=True):
                into[tile : tile + part.shape[0]] = part
            tile += -(-rows.shape[0] // quant_kernel.TILE)
            release_file_pages([rows], files)
    return packed


def fuse_quantized(
    layer: torch.nn.Module,
    kind: str,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> QuantReport | None:
    """Fuse ``layer``'s q/k/v and gate/up linears (its
    :func:`~batchline.models.generation.projections.fusable_groups`) as int4 for the own kernel in
    one pass: each part's rows quantized and packed straight into the fused layer's tiles
    (:func:`pack_own_int4`), so that the fused float copy that fusing first makes is never
    made (a 3B shape's gate/up: 100 MB in bf16 at each layer). What it fused is reported as
    :func:`quantize_linears` reports it (a linear a group); None where it fused nothing: the
    kernel does not run here for ``dtype``, ``kind`` is not int4, or no group's parts
    are plain CPU linears of one width, 16 | rows and 32 | inputs, with a bias each or none.
    The packed bytes are those of fusing and quantizing in turn (the codes are per row).
    ``int8_rows``: the load sums rows as int8 (the report's words for the kernel's path)."""
    if not _own_int4(kind, dtype):
        return None
    from batchline.models.generation import quant_kernel
    from batchline.models.generation.projections import fusable_groups, join_projections

    report: QuantReport | None = None
    for group in fusable_groups(layer):
        if any(x.weight.device.type != "cpu" for x in group.linears):
            continue
        weights = [x.weight.detach() for x in group.linears]
        biases = [x.bias.detach() for x in group.linears if x.bias is not None]
        k = weights[0].shape[1]
        if k % INT4_GROUP_SIZE or any(
            w.shape[1] != k or w.shape[0] % quant_kernel.TILE for w in weights
        ):
            continue  # left to fusing dense, then quantize_linears
        sizes = [w.shape[0] for w in weights]
        joined = QuantLinear.own_int4(
            pack_own_int4(weights, _int4_packed, dtype, scale_dtype),
            sum(sizes),
            k,
            bias=torch.cat(biases) if biases else None,
        )
        join_projections(group.module, group.name, group.parts, joined, sizes)
        before = sum(w.numel() * w.element_size() for w in weights)
        path = _kernel_path("int4", dtype, int8_rows=int8_rows)
        done = QuantReport("int4", 1, before, joined.weight_bytes, path, layout=STEPS_LAYOUT)
        report = done if report is None else report + done
    return report


def _own_int4(kind: str, dtype: torch.dtype) -> bool:
    """Whether ``kind`` linears computing in ``dtype`` take the own int4 kernel here: where
    :meth:`QuantLinear.int4` would (bf16 or float32, groups of its size, the kernel built and
    the CPU able for that dtype)."""
    from batchline.models.generation import quant_kernel

    if kind != "int4" or INT4_GROUP_SIZE != quant_kernel.GROUP:
        return False
    if dtype not in (torch.bfloat16, torch.float32):
        return False
    return quant_kernel.own_kernels(dtype=dtype)[0]


#: The report's words for int8 in groups held in the int8 layout (a head's, in the load log)...
INT8_LAYOUT = "in the int8 layout"
#: ... and for the kernel's path it takes, as any layer's where every row is summed as int8.
_EVERY_ROW_INT8_PATH = "batchline's kernel, every row summed as int8"
#: The report's words for :func:`_int4_packed`'s layout.
STEPS_LAYOUT = "in groups of 32 with 8-bit steps"


def _int4_packed(
    rows: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype
) -> list[torch.Tensor]:
    """int4 for the own kernel with 8-bit steps (:func:`~.quant_codes.quantize_int4_steps`) for
    any ``dtype`` and ``scale_dtype``: 4.53 bits a weight, where bf16 scales take 5 and float32
    ones 6 (whose exactness matters for a GGUF's scales, not for the ones chosen here)."""
    from batchline.models.generation import quant_kernel

    q = quantize_int4_steps(rows)
    return [quant_kernel.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)]


def _int8_packed(
    rows: torch.Tensor, dtype: torch.dtype, scale_dtype: torch.dtype, *, int8_rows: bool = False
) -> list[torch.Tensor]:
    """int8 in groups of 32: the int8 layout where it applies (for rows summed as int8 where
    the load takes them: ``int8_rows``), else its two int4 planes."""
    codes, scales = quantize_int8_groups(rows, 32)
    return pack_int8_groups(codes, scales, dtype, scale_dtype, int8_rows=int8_rows)


def quantize_lm_head(
    model: torch.nn.Module,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> QuantReport | None:
    """Replace ``model.lm_head`` by int8 in groups of 32 (:func:`quantize_int8_groups`),
    computed through the own kernel (in the int8 layout, or as the two int4 planes of
    :func:`~.quant_codes.int8_group_planes`: :func:`~.quant_codes.pack_int8_groups`), where
    that kernel runs here for the activations' ``dtype`` (bf16 or float32: :func:`~batchline.
    models.generation.quant_kernel.own_kernels`) and the head is a plain CPU ``nn.Linear`` of
    32 | inputs; else None, the head kept. The embedding is left as it was: the layout then
    looks it up in this head where the two were tied, or quantizes it the same way
    (:func:`~.quant_embedding.embed_quantized`).

    Why this format (the quality gate and a 360M batch-1 step are in docs/generation.md):
    per-channel int8 and int4 heads failed ``benchmarks/bench_quant_quality.py`` (see
    :func:`quantize_linears`); groups of 32 keep each scale to its own 32 weights, as llama.cpp's
    Q8_0 does. Its two planes read 1.25 bytes a weight where bf16 reads 2; with int8 rows (float32
    ones, or a bf16 model's where the load sums them as int8: ``int8_rows``), in the int8 layout,
    1.06."""
    head = getattr(model, "lm_head", None)
    if type(head) is not torch.nn.Linear or head.weight.device.type != "cpu":
        return None
    bias = None if head.bias is None else head.bias.detach()
    made = int8_groups_head(head.weight.detach(), dtype, scale_dtype, bias, int8_rows=int8_rows)
    if made is None:
        return None
    model.lm_head, report = made
    return report


def int8_groups_head(
    weight: Rows,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
    *,
    int8_rows: bool = False,
) -> tuple[QuantLinear, QuantReport] | None:
    """An lm_head of ``weight`` ``(N, K)`` as int8 in groups of 32 (:func:`int8_groups_packed`)
    and its report, where the own kernel runs here for ``dtype``; else None.
    :func:`quantize_lm_head` makes it of a head's weight, a GGUF's loader of the file's rows as
    it dequantizes them (``gguf_weights``)."""
    packed = int8_groups_packed(weight, dtype, scale_dtype, int8_rows=int8_rows)
    if packed is None:
        return None
    n, k = weight.shape
    layer = QuantLinear.own_int4(packed, n, k, kind="int8g", bias=bias)
    before = n * k * weight.dtype.itemsize
    if layer.int8_layout:
        path, layout = _EVERY_ROW_INT8_PATH, INT8_LAYOUT
    else:
        path, layout = _kernel_path("int4", dtype, int8_rows=int8_rows), None
    return layer, QuantReport("int8g", 1, before, layer.weight_bytes, path, layout=layout)


def int8_groups_packed(
    weight: Rows,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None = None,
    *,
    int8_rows: bool = False,
) -> list[torch.Tensor] | None:
    """``weight`` ``(N, K)`` as int8 in groups of 32 (:func:`quantize_int8_groups`) packed for
    the own kernel (the int8 layout, or two int4 planes: :func:`_int8_packed`), for
    ``QuantLinear.own_int4(planes, N, K, kind="int8g")``, where that kernel runs here for the
    activations' ``dtype`` and 32 | K; else None. What the lm_head takes, and a GGUF's linears
    of a type the kernels do not read (Q6_K: ``gguf_weights``). ``int8_rows``: the load sums
    rows as int8 (:func:`~.quant_codes.pack_planes`)."""
    if not int8_groups_here(weight.shape[1], dtype):
        return None
    pack = functools.partial(_int8_packed, int8_rows=int8_rows)
    return pack_own_int4([weight], pack, dtype, scale_dtype)


def int8_groups_here(in_features: int, dtype: torch.dtype) -> bool:
    """Whether :func:`int8_groups_packed` packs a weight of ``in_features`` inputs here for the
    activations' ``dtype``: the own kernel runs for it, and 32 | inputs."""
    from batchline.models.generation import quant_kernel

    return in_features % quant_kernel.GROUP == 0 and _own_int4("int4", dtype)


def _kernel_path(kind: str, dtype: torch.dtype = torch.bfloat16, *, int8_rows: bool = False) -> str:
    """Which of the own kernel's paths a decode step's rows take, in the load log's words;
    ``int8_rows``: the layers sum their rows as int8 (float32 ones, and bf16 ones below
    :data:`~.quant_kernel.A8_BF16_ROWS`: every one but on AMX, where more go to the tiles)."""
    from batchline.models.generation import quant_kernel

    if int8_rows:
        if quant_kernel.every_row_int8(dtype):
            return _EVERY_ROW_INT8_PATH
        return (
            f"batchline's kernel, fewer than {quant_kernel.A8_BF16_ROWS} rows summed as int8 "
            "and more on AMX tiles"
        )
    if dtype == torch.float32:
        return f"batchline's kernel in {quant_kernel.f32_vectors()}, float32 activations"
    if not quant_kernel.own_kernels(amx=True)[0]:
        return "batchline's kernel on AVX512-BF16"
    if kind == "int8":
        return "batchline's kernel on AMX tiles"
    # one row through vdpbf16ps: as fast as a tile product there, and no tile state to set up
    return f"batchline's kernel on AMX tiles from {quant_kernel.AMX_ROWS} rows"
