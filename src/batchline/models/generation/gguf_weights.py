"""A GGUF causal LM loaded with its quantized tensors kept quantized (``Knobs.weights``).

The file's Q4_0, Q4_1 and Q4_K tensors become int4 :class:`~.quant_linear.QuantLinear` layers of
32-value groups (a Q4_K super-block is eight of them, each with its scale and min) and its Q8_0
ones two int4 planes (:func:`~.quant_codes.int8_group_planes`), straight from the blocks'
bytes: the codes and the fp16 scales (and Q4_1's mins) carry over as they are
(:func:`gguf_int4`; tests compare them with gguf-py's own dequantization, bit for bit). The own
int4 kernel holds the scales in bf16 for bf16 activations (on AVX512-BF16), so each fp16 scale
rounds to bf16's 8 bits, and so it does for float32 ones summed as int8 rows (the
``activations`` auto takes on a CPU without native bf16: fewer bytes a step), and in float32 for
float32 ones, exact; torch's kernels, elsewhere, take them in the activations' dtype. No float
copy of a quantized linear is made. A linear of another block type (Q6_K: 16-value groups, which
the int4 kernels do not take; Q5_K, Q5_0 and the rest) is dequantized by gguf-py into float32
and, where the own kernel runs, quantized again to int8 in groups of 32 (the lm_head's format:
``quantize.int8_groups_packed``): a Q4_K_M file's attn_v and ffn_down in half its layers are
Q6_K, which in the model's dtype (float32 on int8 rows) made a 1.7B's step read 1,872 MiB
where int8 groups read 1,167. Tensors of the float types (F32, F16, BF16), and the others where the
own kernel does not run, are dequantized into the model's dtype; the load log counts each. The
embedding, a lookup, is dequantized into the model's dtype; so is the lm_head (which the loader
then packs as int8 in groups of 32 where the own kernel runs: ``quantize.quantize_lm_head``,
unless the file's linears are all float: ``engine_choices.laid_out_as``), or it stays tied to
the embedding where the file has no ``output.weight``.

The architecture comes from the file: Llama and Qwen2 (``general.architecture``); any other is
refused in one line naming it. The config is transformers' reading of the file's metadata, the
tokenizer and its chat template the file's (through transformers), unless ``folder`` gives both
(the built-in ``smollm2``'s converted folder, converted once already).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchline._errors import ModelError
from batchline.models.generation.gguf_header import (
    _DENSE,
    _architecture,
    _block_of,
    _hf_name,
    gguf_float_linears,
    read_gguf_file,
)

if TYPE_CHECKING:
    import numpy as np
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from batchline.models.generation.quant_codes import Int4Codes
    from batchline.models.generation.quant_linear import QuantLinear
    from batchline.models.generation.quantize import QuantReport

__all__ = [
    "LOADER_VERSION",
    "GgufLoad",
    "gguf_int4",
    "load_gguf",
]

logger = logging.getLogger("batchline.generation")

#: Which reading of a file's weights a completion came from, in a generator's identity: what
#: changes the tokens a file gives moves it, so that no cached completion of an earlier reading
#: is served (2: a Llama 3.x file's rope_freqs applied, 2026-12-06).
LOADER_VERSION = 2

# A block's bytes per type: Q4_0 = fp16 scale + 16 bytes of nibbles; Q4_1 adds an fp16 min;
# Q8_0 = fp16 scale + 32 int8.
_BLOCK = 32
# Q4_K = 256-value super-blocks: fp16 d and dmin, 12 bytes of eight 6-bit scales and mins, 128
# bytes of nibbles; each 32-value sub-block is (d * scale) * q - dmin * min.
_KEPT = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34, "Q4_K": 144}


@dataclass
class GgufLoad:
    """What :func:`load_gguf` loaded, for the load log."""

    architecture: str
    kept: dict[str, int] = field(default_factory=dict)  # GGUF type -> linears kept quantized
    # GGUF type -> linears dequantized and quantized again to int8 in groups of 32
    requantized: dict[str, int] = field(default_factory=dict)
    dequantized: dict[str, int] = field(default_factory=dict)  # GGUF type -> tensors
    weight_bytes: int = 0
    #: the lm_head made int8 in groups of 32 as it was read (the embedding's fate with it)
    head: QuantReport | None = None
    #: the rotary frequencies were divided by the file's ``rope_freqs`` factors (Llama 3.x)
    rope_factors: bool = False

    def __str__(self) -> str:
        kept = ", ".join(f"{n} {t}" for t, n in sorted(self.kept.items())) or "none"
        dense = ", ".join(f"{n} {t}" for t, n in sorted(self.dequantized.items())) or "none"
        again = ", ".join(f"{n} {t}" for t, n in sorted(self.requantized.items()))
        again = f"; as int8 in groups of 32: {again}" if again else ""
        head = f"; {self.head.head_text}" if self.head is not None else ""
        rope = "; rotary frequencies scaled by the file's rope_freqs" if self.rope_factors else ""
        return (
            f"GGUF {self.architecture}: linears kept quantized: {kept}{again}; dequantized to "
            f"the model's dtype: {dense}; {self.weight_bytes / 2**20:.0f} MiB of weights"
            f"{head}{rope}"
        )


def gguf_int4(kind: str, blocks: np.ndarray) -> list[Int4Codes]:
    """A Q4_0, Q4_1, Q8_0 or Q4_K tensor's raw bytes ``(N, K / 32 * block bytes)`` as the int4
    plane(s) of :class:`~.quant_linear.QuantLinear`, in 32-value groups, without loss: Q4_0
    ``(q - 8) * d``: scale d, zero 0; Q4_1 ``q * d + m``: scale d, zero ``m + 8 d``; Q8_0 the two
    planes of its int8 codes; Q4_K each 32-value sub-block (:func:`_q4_k`). Scales and zeros
    are float32 (an fp16 d and m, and their sums, are exact there)."""
    import numpy as np
    import torch

    from batchline.models.generation.quant_codes import Int4Codes, int8_group_planes

    n = blocks.shape[0]
    per = blocks.reshape(n, -1, _KEPT[kind])  # (N, blocks, block bytes)
    if kind == "Q4_K":
        return [_q4_k(per)]
    d = torch.from_numpy(_halves(per[..., :2]))
    if kind == "Q8_0":
        codes = np.ascontiguousarray(per[..., 2:]).view(np.int8).reshape(n, -1)
        return int8_group_planes(torch.from_numpy(codes.copy()), d, _BLOCK)
    nibbles = per[..., 4:] if kind == "Q4_1" else per[..., 2:]
    # a block's values 0..15 are the low nibbles of its 16 bytes, 16..31 the high ones
    codes = np.concatenate((nibbles & 0x0F, nibbles >> 4), axis=-1).reshape(n, -1)
    if kind == "Q4_1":
        zeros = torch.from_numpy(_halves(per[..., 2:4])) + 8 * d
    else:
        zeros = torch.zeros_like(d)
    return [Int4Codes(torch.from_numpy(codes.copy()), d, zeros, _BLOCK)]


def _q4_k(per: np.ndarray) -> Int4Codes:
    """Q4_K super-blocks ``(N, blocks, 144)`` as int4 groups of 32: scale ``d * sc``, zero
    ``8 * d * sc - dmin * m`` (float32: an fp16 times a 6-bit integer is exact there)."""
    import numpy as np
    import torch

    from batchline.models.generation.quant_codes import Int4Codes

    n, blocks = per.shape[:2]
    d, dmin = _halves(per[..., 0:2]), _halves(per[..., 2:4])
    packed = per[..., 4:16].reshape(n, blocks, 3, 4)  # gguf-py's get_scale_min, per block
    low, high, both = packed[..., 0, :], packed[..., 1, :], packed[..., 2, :]
    sc = np.concatenate([low & 0x3F, (both & 0x0F) | ((low >> 2) & 0x30)], axis=-1)
    mins = np.concatenate([high & 0x3F, (both >> 4) | ((high >> 2) & 0x30)], axis=-1)
    scales = d[..., None] * sc.astype(np.float32)  # (N, blocks, 8)
    offsets = dmin[..., None] * mins.astype(np.float32)
    # four 32-byte chunks, each the low nibbles of one sub-block and the high of the next
    nibbles = (
        per[..., 16:].reshape(n, blocks, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8)[:, None]
    )
    codes = (nibbles & 0x0F).reshape(n, -1)
    zeros = 8 * scales - offsets
    return Int4Codes(
        torch.from_numpy(codes.copy()),
        torch.from_numpy(scales.reshape(n, -1)),
        torch.from_numpy(zeros.reshape(n, -1)),
        _BLOCK,
    )


def _halves(pairs: np.ndarray) -> np.ndarray:
    """Byte pairs ``(..., 2)`` as the fp16 values they hold, in float32 (exact)."""
    import numpy as np

    return np.ascontiguousarray(pairs).view(np.float16)[..., 0].astype(np.float32)


def _unpermute_rows(x: torch.Tensor, heads: int) -> torch.Tensor:
    """Undo llama.cpp's conversion's permutation of a Llama q or k projection's output rows
    (it interleaves each head's two rotary halves), as transformers' GGUF reader undoes it."""
    rows = x.shape[0]
    return x.reshape(heads, rows // heads // 2, 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def load_gguf(
    path: Path,
    *,
    dtype: torch.dtype,
    folder: Path | None = None,
    scale_dtype: torch.dtype | None = None,
    pack_head: bool = False,
    int8_rows: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, GgufLoad]:
    """The causal LM in the GGUF file at ``path`` with its Q4_0, Q4_1 and Q8_0 linears kept
    quantized, in ``dtype`` on CPU, its tokenizer, and what was loaded how. ``folder``: a
    Hugging Face folder of the same model to take the config and tokenizer from.
    ``scale_dtype``: the own kernel's scales (:meth:`~.quant_linear.QuantLinear.int4`'s).
    ``pack_head``: the lm_head (a tied one from the embedding's rows) and an untied embedding
    made int8 in groups of 32 as they are read, a chunk of rows at a time, where the layout
    would make them so of their float copy (:func:`~.engine_layout.lay_out_weights`; the bits
    are the same): the own kernel runs for ``dtype`` and the file's linears are not all float.
    The engine's load asks for it; without it they are in ``dtype``, as the file's values.
    ``int8_rows``: the load sums rows as int8, so int8 in groups of 32 (Q8_0, the types
    requantized so, the head) goes to the int8 layout in bf16 too
    (:func:`~.quant_kernel.int8g_here`)."""
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    from batchline.models.common.torch_weights import (
        file_mappings,
        quiet_transformers,
        release_file_ranges,
        trim_heap,
    )
    from batchline.models.generation.gguf_meta import gguf_config_and_tokenizer
    from batchline.models.generation.quant_codes import int4_planes_rows
    from batchline.models.generation.quant_embedding import QuantEmbedding, int8g_table
    from batchline.models.generation.quant_linear import own_int4_packed
    from batchline.models.generation.quantize import (
        int8_groups_head,
        int8_groups_here,
        int8_groups_packed,
    )

    file = read_gguf_file(path)
    arch = _architecture(file, path)
    if folder is None:
        config, tokenizer = gguf_config_and_tokenizer(path, file.header_bytes, file.metadata)
    with quiet_transformers():
        if folder is not None:
            config = AutoConfig.from_pretrained(folder, local_files_only=True)
            tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    if folder is not None and (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    report = GgufLoad(arch)
    kept: dict[str, list[Int4Codes] | _Packed] = {}  # the linears kept quantized, by module path
    requantized: dict[str, list[torch.Tensor]] = {}  # the linears packed as int8 in groups
    tied = not any(t.name == "output.weight" for t in file.tensors)
    # Where the layout would make the lm_head int8 in groups of 32 (the own kernel runs for
    # dtype; the file's linears are not all float: engine_choices.laid_out_as), the head and the
    # embedding are made so here, from the file's rows a chunk at a time: their float copy, the
    # largest tensor of a load, is never made whole (a 3B shape's float32 embedding, 576 MiB,
    # had been held until the layout packed the head: a 3B Q4_K_M server's peak RSS 3.71-3.76
    # GB, now 3.17, the model loaded 2.53; Zen 5, 2026-12-05).
    hidden = int(config.hidden_size)
    pack_head = pack_head and int8_groups_here(hidden, dtype) and not gguf_float_linears(path)
    embedding_words: str | None = None

    def read_head(owner_path: str, data: np.ndarray, qtype: Any) -> bool:
        """The lm_head (a tied one from the embedding's rows) or an untied embedding as int8
        in groups of 32, looked up in by :class:`QuantEmbedding`; False where the head was
        not made so (then read as the other tensors are)."""
        nonlocal embedding_words
        rows = _FileRows(data, qtype, dtype)
        if owner_path == "model.embed_tokens" and not tied:
            table, embedding_words = int8g_table(rows, dtype)
            model.model.embed_tokens = QuantEmbedding(table, dtype)
            report.weight_bytes += table.weight_bytes
            return True
        made = int8_groups_head(rows, dtype, scale_dtype, int8_rows=int8_rows)
        if made is None:
            return False
        model.lm_head, report.head = made
        report.weight_bytes += report.head.bytes_after
        if tied:
            model.model.embed_tokens = QuantEmbedding(model.lm_head, dtype)
            embedding_words = "embedding looked up in the lm_head's int8g"
        return True

    rope_factors: torch.Tensor | None = None

    def read(tensor: Any) -> None:
        nonlocal rope_factors
        if tensor.name == "rope_freqs.weight":
            # a Llama 3.x file's rotary scaling: llama.cpp's converter writes the factors that
            # divide each frequency here, and no config key says that the model has any
            qtype = GGMLQuantizationType(tensor.tensor_type)
            rope_factors = _owned_float32(dequantize(np.asarray(tensor.data), qtype)).reshape(-1)
            return
        target = _hf_name(tensor.name)
        if target is None:
            return  # the config computes what else there is
        owner_path, attr = target.rsplit(".", 1)
        owner = model.get_submodule(owner_path)
        qtype = GGMLQuantizationType(tensor.tensor_type)
        kind = qtype.name
        permute = heads if owner_path.endswith("q_proj") else kv_heads
        permute_rows = arch == "llama" and owner_path.endswith(("q_proj", "k_proj"))
        data = np.asarray(tensor.data)
        head_rows = attr == "weight" and owner_path in ("lm_head", "model.embed_tokens")
        if pack_head and head_rows and read_head(owner_path, data, qtype):
            release_file_ranges([(tensor.data.ctypes.data, tensor.data.nbytes)], files)
            return
        is_linear = attr == "weight" and isinstance(owner, torch.nn.Linear)
        fits = tensor.data.shape[0] % 16 == 0  # torch's int4 layout packs 16 rows at a time
        if is_linear and kind in _KEPT and owner_path != "lm_head" and fits:
            planes = gguf_int4(kind, data)
            if permute_rows:
                planes = int4_planes_rows(planes, functools.partial(_unpermute_rows, heads=permute))
            # made layers below, q/k/v and gate/up joined; packed now where the own kernel
            # computes them (a byte a code is 3.5 times the file's Q4 bytes: a block's codes
            # held whole until its layers were made set a load's peak)
            packed = own_int4_packed(planes, dtype, scale_dtype, int8_rows=int8_rows)
            n, k = planes[0].codes.shape
            kept[owner_path] = planes if packed is None else _Packed(packed, n, k, len(planes))
            del planes
            trim_heap()
            report.kept[kind] = report.kept.get(kind, 0) + 1
            return
        requantize = is_linear and kind not in _DENSE and owner_path != "lm_head"
        rows = _FileRows(data, qtype, torch.float32) if requantize else None
        if rows is not None and int8_groups_here(rows.shape[1], dtype):
            # a block type the kernels do not read (Q6_K, Q5_K, ...): int8 in groups of 32 from
            # its float32 values where the own kernel runs, not the model's dtype, a chunk of
            # rows at a time (a whole 3B ffn_down in float32 is 100 MB)
            weight = _unpermute_rows(rows[:], permute) if permute_rows else rows
            packed = int8_groups_packed(weight, dtype, scale_dtype, int8_rows=int8_rows)
            if packed is not None:
                requantized[owner_path] = packed
                report.requantized[kind] = report.requantized.get(kind, 0) + 1
                return
        values = _owned_float32(dequantize(data, qtype))
        if permute_rows:
            values = _unpermute_rows(values, permute)
        if kind not in _DENSE:
            report.dequantized[kind] = report.dequantized.get(kind, 0) + 1
        values = values.to(dtype)
        setattr(owner, attr, torch.nn.Parameter(values, requires_grad=False))
        report.weight_bytes += values.numel() * values.element_size()

    # A block's linears are made (packed, q/k/v and gate/up joined) as soon as its every tensor
    # is read, and its pages of the file given back: its codes, unpacked a byte each, are held
    # for one block, not the whole model (a 3B Q4_K_M file of 1.8 GB had peaked at 6.6 GB RSS).
    by_block: dict[int | None, list[Any]] = {}
    for tensor in file.tensors:
        by_block.setdefault(_block_of(tensor.name), []).append(tensor)
    left = {block: len(tensors) for block, tensors in by_block.items()}
    files = file_mappings()
    for tensor in file.tensors:
        read(tensor)
        block = _block_of(tensor.name)
        left[block] -= 1
        if block is not None and left[block] == 0:
            prefix = f"model.layers.{block}."
            mine = {p: kept.pop(p) for p in list(kept) if p.startswith(prefix)}
            report.weight_bytes += _make_layers(model, mine, dtype, scale_dtype)
            again = {p: requantized.pop(p) for p in list(requantized) if p.startswith(prefix)}
            report.weight_bytes += _make_int8_layers(model, again)
            ranges = ((t.data.ctypes.data, t.data.nbytes) for t in by_block[block])
            release_file_ranges(ranges, files)
            # the block's temporaries given back before the next block's are made: the heap
            # had kept them (a server's peak RSS: 1.7B Q8_0 3.20 -> 2.85 GB, 3B Q4_K_M 3.17 ->
            # 3.00, the models loaded 2.27 and 2.53; Zen 5, 2026-12-05)
            trim_heap()
    report.weight_bytes += _make_layers(model, kept, dtype, scale_dtype)
    report.weight_bytes += _make_int8_layers(model, requantized)
    if report.head is not None:
        report.head = dataclasses.replace(report.head, embedding=embedding_words)
    elif tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _rebuild_rotary(model, config, rope_factors, path)
    report.rope_factors = rope_factors is not None
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    missing += [name for name, b in model.named_buffers() if b.is_meta]
    if missing:
        raise ModelError(f"{path.name}: the file holds no tensor for {', '.join(missing[:4])}")
    model.eval()
    return model, tokenizer, report


class _FileRows:
    """A GGUF tensor's rows ``(N, K)`` dequantized by gguf-py a slice at a time, into
    ``dtype`` (a :class:`~.quantize.Rows`): each slice the values the whole tensor dequantized
    would hold in those rows, its groups of 32 packed as the whole's would be."""

    def __init__(self, data: np.ndarray, qtype: Any, dtype: torch.dtype) -> None:
        from gguf.quants import quant_shape_from_byte_shape

        self._data, self._qtype, self.dtype = data, qtype, dtype
        # a block type's rows are bytes; a float type's, its values
        shape = data.shape
        if data.dtype == "uint8":
            shape = quant_shape_from_byte_shape(shape, qtype)
        self.shape = (int(shape[0]), int(shape[1]))

    def __getitem__(self, rows: slice, /) -> torch.Tensor:
        from gguf import dequantize

        return _owned_float32(dequantize(self._data[rows], self._qtype)).to(self.dtype)


def _owned_float32(values: np.ndarray) -> torch.Tensor:
    """gguf-py's dequantized ``values`` as a float32 tensor of memory of its own: ``dequantize``
    makes a new array for every type but F32, which it gives as a view of the file's read-only
    mapping, so that one alone is copied (the file's pages are given back after each block).
    Copying every one made a second float32 copy of each for a moment (a 1.7B's untied head:
    403 MB); llama.cpp's files hold that head and the embedding first, before any block, so a
    load's peak did not move (an untied 1.7B Q4_K_M: 2.63-2.69 GiB either way, Zen 5)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.require(values, np.float32, ["C", "W"]))


@dataclass(frozen=True)
class _Packed:
    """A linear kept quantized, packed for the own kernel (:func:`~.quant_linear.own_int4_packed`):
    ``n`` outputs, ``k`` inputs, from ``planes`` int4 planes (one: int4; two: int8 in groups)."""

    packed: list[torch.Tensor]
    n: int
    k: int
    planes: int

    @property
    def kind(self) -> str:
        return "int4" if self.planes == 1 else "int8g"


# the linears a layer's q/k/v and gate/up products join (lean_llama's fused names)
_JOINED = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
)


def _make_layers(
    model: Any,
    kept: dict[str, list[Int4Codes] | _Packed],
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
) -> int:
    """The int4 layers of the ``kept`` linears (their planes, or packed already), with the
    biases the file gave the linears (read into the meta-built ``nn.Linear``s); a layer's
    q/k/v and gate/up joined into one each where all are kept alike with as many planes (one
    product at a step, as ``fuse_projections`` joins float ones: the same values, as each
    output row is its own; packed ones joined along their tiles). Returns their bytes."""
    import torch

    from batchline.models.generation.projections import join_projections

    def bias_of(path: str) -> torch.Tensor | None:
        bias = model.get_submodule(path).bias
        return None if bias is None else bias.detach()

    total = 0
    for q_path in [p for p in kept if p.endswith(".self_attn.q_proj")]:
        prefix = q_path.removesuffix(".self_attn.q_proj")
        for owner, name, parts in _JOINED:
            paths = [f"{prefix}.{owner}.{part}" for part in parts]
            found = [kept[p] for p in paths if p in kept]
            biases = [b for b in map(bias_of, paths) if b is not None]
            if len(found) < len(parts) or len({_alike(p) for p in found}) != 1:
                continue
            if 0 < len(biases) < len(parts):
                continue  # some with a bias, some without: left separate
            bias = torch.cat(biases) if biases else None
            fused = _layer(_joined(found), bias, dtype, scale_dtype)
            sizes = [_outputs(p) for p in found]
            join_projections(model.get_submodule(f"{prefix}.{owner}"), name, parts, fused, sizes)
            total += fused.weight_bytes
            for p in paths:
                del kept[p]
    for path, linear in kept.items():
        single = _layer(linear, bias_of(path), dtype, scale_dtype)
        parent, name = path.rsplit(".", 1)
        setattr(model.get_submodule(parent), name, single)
        total += single.weight_bytes
    return total


def _layer(
    linear: list[Int4Codes] | _Packed,
    bias: torch.Tensor | None,
    dtype: torch.dtype,
    scale_dtype: torch.dtype | None,
) -> QuantLinear:
    from batchline.models.generation.quant_linear import QuantLinear

    if isinstance(linear, _Packed):
        return QuantLinear.own_int4(linear.packed, linear.n, linear.k, kind=linear.kind, bias=bias)
    return QuantLinear.int4(linear, bias=bias, dtype=dtype, scale_dtype=scale_dtype)


def _joined(found: list[list[Int4Codes] | _Packed]) -> list[Int4Codes] | _Packed:
    """Linears kept alike (:func:`_alike`) as one, their outputs one after another: packed
    ones along their tiles (each linear's outputs a multiple of 16: a tile is its own)."""
    import torch

    from batchline.models.generation.quant_codes import Int4Codes

    packed = [p for p in found if isinstance(p, _Packed)]
    if packed:
        tiles = [torch.cat(each) for each in zip(*(p.packed for p in packed), strict=True)]
        return _Packed(tiles, sum(p.n for p in packed), packed[0].k, packed[0].planes)
    planes = [p for p in found if not isinstance(p, _Packed)]
    return [
        Int4Codes(
            torch.cat([p[i].codes for p in planes]),
            torch.cat([p[i].scales for p in planes]),
            torch.cat([p[i].zeros for p in planes]),
            planes[0][i].group_size,
        )
        for i in range(len(planes[0]))
    ]


def _outputs(linear: list[Int4Codes] | _Packed) -> int:
    return linear.n if isinstance(linear, _Packed) else int(linear[0].codes.shape[0])


def _alike(linear: list[Int4Codes] | _Packed) -> tuple[str, int]:
    """What linears joined into one product share: packed or not, and their planes."""
    if isinstance(linear, _Packed):
        return "packed", linear.planes
    return "codes", len(linear)


def _make_int8_layers(model: Any, requantized: dict[str, list[torch.Tensor]]) -> int:
    """The int8 layers (in groups of 32, the own kernel's) of the ``requantized`` linears'
    packed parts, with the biases the file gave them; returns their bytes."""
    from batchline.models.generation.quant_linear import QuantLinear

    total = 0
    for path, planes in requantized.items():
        linear = model.get_submodule(path)
        n, k = linear.weight.shape
        bias = None if linear.bias is None else linear.bias.detach()
        layer = QuantLinear.own_int4(planes, n, k, kind="int8g", bias=bias)
        parent, name = path.rsplit(".", 1)
        setattr(model.get_submodule(parent), name, layer)
        total += layer.weight_bytes
    return total


def _rebuild_rotary(model: Any, config: Any, factors: torch.Tensor | None, path: Path) -> None:
    """The rotary embedding's inverse frequencies, built on meta with the model: computed on
    CPU from the config, as transformers computes them, each divided by the file's
    ``rope_freqs`` factor where it has them (as llama.cpp applies them: for a Llama 3.x, what
    transformers' ``llama3`` rope type computes from its config)."""
    import torch

    with torch.device("cpu"):
        rotary = type(model.model.rotary_emb)(config=config)
    if factors is not None:
        frequencies = rotary.inv_freq
        if factors.shape != frequencies.shape:
            raise ModelError(
                f"{path.name}: rope_freqs holds {factors.numel()} factors, the model's rotary "
                f"embedding {frequencies.numel()} frequencies"
            )
        rotary.inv_freq = frequencies / factors
        original = getattr(rotary, "original_inv_freq", None)
        if original is not None:
            rotary.original_inv_freq = original / factors
    model.model.rotary_emb = rotary
