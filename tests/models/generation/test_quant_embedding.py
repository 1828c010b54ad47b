"""An embedding looked up in int8 in groups of 32 (``quant_embedding``): the rows read from each
packed layout (``quant_kernel.packed_rows``) against the unpacked weight in float64, a tied
embedding looked up in the quantized lm_head (no float table kept), an untied one quantized on
its own, Gemma's scale applied once, and the lean step and transformers' module tree
computing the same tokens on the result."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation.decode_kernel import decode_kernel  # noqa: E402
from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.engine_layout import lay_out_weights  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    int8_group_planes,
    quantize_int4,
    quantize_int8_groups,
)
from batchline.models.generation.quant_embedding import QuantEmbedding  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine, _compute_dtype  # noqa: E402

from .conftest import TINY_VOCAB, build_tiny_llama  # noqa: E402
from .gen_helpers import greedy_reference  # noqa: E402

# rows from the first and the last (part-filled) tile, a tile's last column, one asked twice
IDS = [0, 15, 16, 36, 3, 15]


def _float64(codes: Any, scales: Any) -> Any:
    n, k = codes.shape
    return (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k)


def test_each_layouts_rows_are_read_exactly_from_their_blocks() -> None:
    g = torch.Generator().manual_seed(3)
    weight = torch.randn(37, 96, generator=g)  # 3 tiles, the last with 5 columns
    codes, scales = quantize_int8_groups(weight, 32)
    expected = _float64(codes, scales)[IDS]
    ids = torch.tensor(IDS)
    assert torch.equal(ik.packed_rows([ik.pack_int8g(codes, scales)], ids).double(), expected)
    for scale_dtype in (torch.bfloat16, torch.float32):  # int8 in groups' two int4 planes
        planes = [
            ik.pack_int4(p.codes, p.scales, p.zeros, scale_dtype)
            for p in int8_group_planes(codes, scales, 32)
        ]
        assert torch.equal(ik.packed_rows(planes, ids).double(), expected)
    int4 = quantize_int4(weight, 32)  # one int4 plane: (code - 8) * scale + zero, in float32
    packed = ik.pack_int4(int4.codes, int4.scales, int4.zeros, torch.float32)
    got = ik.packed_rows([packed], ids)
    assert got.dtype == torch.float32
    reference = int4.dequantize(torch.float64)[IDS]
    assert (got.double() - reference).abs().max() <= 2**-21 * reference.abs().max()


def test_the_librarys_int8_lookup_gives_the_strided_views_bits_in_each_dtype() -> None:
    if decode_kernel()[0] is None:
        pytest.skip("no batchline kernel library here")
    g = torch.Generator().manual_seed(4)
    weight = torch.randn(37, 96, generator=g) * 3
    packed = ik.pack_int8g(*quantize_int8_groups(weight, 32))
    ids = torch.tensor(IDS)
    reference = ik.packed_rows([packed], ids)  # float32, each value exact
    lookup = torch.ops.batchline.int8g_rows
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.float64):
        got = lookup(packed, ids, 37, dtype)
        assert got.dtype == dtype
        assert got.shape == (len(IDS), 96)
        assert torch.equal(got, reference.to(dtype)), dtype
    # QuantLinear.rows' choice: the library's lookup for the int8 layout, the views otherwise
    assert torch.equal(ik.rows_in([packed], ids, 37, torch.bfloat16), reference.bfloat16())
    int4 = quantize_int4(weight, 32)
    plane = [ik.pack_int4(int4.codes, int4.scales, int4.zeros, torch.bfloat16)]
    expected = ik.packed_rows(plane, ids).bfloat16()
    assert torch.equal(ik.rows_in(plane, ids, 37, torch.bfloat16), expected)
    assert lookup(packed, ids[:0], 37, torch.float32).shape == (0, 96)
    for bad in (37, -1):  # a padding column of the last tile, and below the first
        with pytest.raises(RuntimeError, match=rf"id {bad} is out of \[0, 37\)"):
            lookup(packed, torch.tensor([1, bad]), 37, torch.float32)
    with pytest.raises(RuntimeError, match="do not fill 3 tiles"):
        lookup(packed, ids, 32, torch.float32)
    with pytest.raises(RuntimeError, match="544"):
        lookup(packed[:, :, :512].contiguous(), ids, 37, torch.float32)


def _tied_llama() -> Any:
    model = build_tiny_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def _own_kernel(dtype: Any) -> None:
    if not ik.own_kernels(dtype=dtype)[0]:
        pytest.skip(f"the own int kernels do not run here for {dtype}")


def _engine_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    engine = TorchStepEngine(model)
    assert engine.forward == "lean"
    engine.add_request(GenerationRequest("a", tuple(prompt), SamplingParams(max_tokens=n)))
    got: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            got.extend(out.token_ids)
    return got


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_tied_embedding_is_looked_up_in_the_quantized_head_and_its_table_let_go(
    weights: str, torch_threads: None
) -> None:
    _own_kernel(torch.float32)
    model = _tied_llama()
    table = model.model.embed_tokens.weight.detach().clone()
    layout = lay_out_weights(model, weights, torch.float32)
    assert layout.quantized is not None
    assert "lm_head as int8g in groups of 32" in str(layout.quantized)
    assert str(layout.quantized).endswith("embedding looked up in the lm_head's int8g)")
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding)
    assert embedding._weight[0] is model.lm_head  # one copy of the codes, the head's
    assert not any(p.shape == table.shape for p in model.parameters())  # no float table
    assert _compute_dtype(model) == torch.float32  # the keys' and values' dtype
    ids = torch.tensor([IDS, IDS[::-1]])  # (batch, tokens), as transformers calls it
    rows = embedding(ids)
    assert rows.shape == (2, len(IDS), table.shape[1])
    assert rows.dtype == torch.float32
    codes, scales = quantize_int8_groups(table, 32)  # what the head holds
    assert torch.equal(rows[0].double(), _float64(codes, scales)[IDS])
    assert (rows[0] - table[IDS]).abs().max() <= table.abs().max() / 127  # a Q8_0's error
    prompt = [5, 9, 14, 3, 7, 22, 11]
    with torch.inference_mode():
        assert _engine_greedy(model, prompt, 8) == greedy_reference(model, prompt, 8)


def test_an_untied_embedding_goes_int8_in_groups_on_its_own(torch_threads: None) -> None:
    _own_kernel(torch.float32)
    model = build_tiny_llama()  # its embedding and lm_head are two weights
    table = model.model.embed_tokens.weight.detach().clone()
    layout = lay_out_weights(model, "int4", torch.float32)
    assert layout.quantized is not None
    assert "embedding as int8g in groups of 32, 0 -> 0 MiB" in str(layout.quantized)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding)
    assert embedding._weight[0] is not model.lm_head
    assert embedding.weight_bytes == table.numel() * 17 // 16  # int8, a bf16 scale per 32
    ids = torch.arange(TINY_VOCAB)
    codes, scales = quantize_int8_groups(table, 32)
    assert torch.equal(embedding(ids).double(), _float64(codes, scales))


def test_float_weights_keep_the_embedding(torch_threads: None) -> None:
    model = _tied_llama()
    lay_out_weights(model, "float", torch.float32)
    assert type(model.model.embed_tokens) is torch.nn.Embedding


def test_gemmas_scaled_embedding_is_scaled_once_on_the_lean_step_as_in_the_module_tree(
    torch_threads: None,
) -> None:
    from .test_families import build

    _own_kernel(torch.float32)
    model = build("gemma2")  # its embedding scales by sqrt(hidden)
    scale = model.model.embed_tokens.embed_scale
    lay_out_weights(model, "int4", torch.float32)
    embedding = model.model.embed_tokens
    assert isinstance(embedding, QuantEmbedding)
    ids = torch.tensor([1, 4, 9])
    unscaled = embedding._weight[0].rows(ids, torch.float32)
    assert torch.equal(embedding(ids), unscaled * scale.float())
    prompt = [5, 9, 14, 3, 7, 22, 11]
    with torch.inference_mode():
        assert _engine_greedy(model, prompt, 6) == greedy_reference(model, prompt, 6)
