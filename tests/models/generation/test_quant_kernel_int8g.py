"""The int8 layout of int8 in groups of 32 (``quant_kernel.pack_int8g``) and its product with
int8 rows (``int8g_linear_a8`` in ``csrc/quant_gemm_a8.cpp``): the packing round trip, the
product against the float64 product of the quantized rows and the dequantized weight (at the
codes' extremes too, where a 16-bit pair sum would saturate if the kernel let it), the same
bits at any thread count, its errors, and which layers are packed so: int8 in groups for
float32 rows over bf16 scales (int8 rows) and for a bf16 model's rows where the load sums them as
int8, from a model's weights and from a GGUF's Q8_0."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline._cpu import A8_VNNI_FLAGS  # noqa: E402
from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation import quant_linear as ql  # noqa: E402
from batchline.models.generation.decode_kernel import StepProduct  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    int8_from_planes,
    int8_group_planes,
    quantize_int4,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear  # noqa: E402

from .gen_helpers import int_planes  # noqa: E402
from .test_quant_kernel_a8 import TOLERANCE, _relative  # noqa: E402


def _weight(n: int, k: int, seed: int) -> tuple[Any, Any]:
    g = torch.Generator().manual_seed(seed)
    return quantize_int8_groups(torch.randn(n, k, generator=g), 32)


def _rounded_rows(x: Any) -> Any:
    """``x`` as the kernel sees it: each group of 32 quantized to int8 (the library's own
    quantizing, pinned against the header's rule in test_quant_kernel_a8.py)."""
    codes, scales = torch.ops.batchline.int8_activations(x)
    return (codes.double().view(x.shape[0], -1, 32) * scales.double()[..., None]).view(x.shape)


def _float64(codes: Any, scales: Any) -> Any:
    n, k = codes.shape
    return (codes.double().view(n, -1, 32) * scales.double()[..., None]).view(n, k)


def test_packing_keeps_every_code_and_bf16_scale_and_pads_the_last_tile() -> None:
    codes, scales = _weight(37, 96, seed=1)  # 3 tiles, the last with 5 columns
    codes[0, :5] = -128  # a GGUF's Q8_0 block may hold it, though quantizing does not make it
    codes[36, -3:] = 127
    packed = ik.pack_int8g(codes, scales)
    assert packed.shape == (3, 3, ik.BLOCK_INT8)
    assert ik.BLOCK_INT8 == 544
    back, back_scales = ik.unpack_int8g(packed, 37)
    assert torch.equal(back, codes)
    assert torch.equal(back_scales, scales.to(torch.bfloat16))
    # the header's order: chunk c at 64 c, column j's four codes at 64 c + 4 j
    block = packed[1, 2].view(torch.int8)
    for c, j in [(0, 0), (3, 5), (7, 15)]:
        assert torch.equal(
            block[64 * c + 4 * j : 64 * c + 4 * j + 4], codes[16 + j, 64 + 4 * c :][:4]
        )
    pad_codes, pad_scales = ik.unpack_int8g(packed, 48)
    assert not pad_codes[37:].any()
    assert not pad_scales[37:].float().any()
    with pytest.raises(ValueError, match="groups of 32"):
        ik.pack_int8g(codes[:, :40], scales[:, :1])


def test_int8_from_planes_gives_back_the_codes_the_planes_were_split_from() -> None:
    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(4, 1)  # every code, 8 groups
    scales = torch.rand(4, 8) + 0.5
    back, back_scales = int8_from_planes(int8_group_planes(codes, scales, 32))
    assert torch.equal(back, codes)
    assert torch.equal(back_scales, scales)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("width", [512, 256])  # 512 runs as 256 where VNNI is not built
def test_the_product_is_the_float64_one_of_the_quantized_rows(
    a8_library: None, rows: int, with_bias: bool, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ik, "A8_WIDTH", width)
    n, k = 40, 256
    codes, scales = _weight(n, k, seed=rows)
    packed = ik.pack_int8g(codes, scales)
    g = torch.Generator().manual_seed(100 + rows)
    x = torch.randn(rows, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    out = ik.int8g_linear(x, packed, n, bias)
    assert out.shape == (rows, n)
    assert out.dtype == torch.float32
    reference = _rounded_rows(x) @ _float64(codes, scales.to(torch.bfloat16)).T
    if bias is not None:
        reference += bias.double()
    assert _relative(out, reference) < TOLERANCE


@pytest.mark.parametrize("width", [512, 256])
def test_the_codes_extremes_sum_exactly(
    a8_library: None, width: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # |w| = 128 against row codes of +-127 in every position: each vpmaddubsw pair is
    # +-32,512, the most a 16-bit lane holds here; a saturating sum would come out short. On
    # the VNNI path w + 128 reaches 255 and 0 against them.
    monkeypatch.setattr(ik, "A8_WIDTH", width)
    n, k = 16, 64
    codes = torch.full((n, k), -128, dtype=torch.int8)
    codes[1::2] = 127
    scales = torch.ones(n, k // 32)
    x = torch.ones(3, k)
    x[1] = -1
    x[2, ::2] = -1
    out = ik.int8g_linear(x, ik.pack_int8g(codes, scales), n)
    # rows of +-1 quantize to codes +-127 with scale 1 / 127: the product is exact
    want = x.double() @ codes.double().T
    assert torch.equal(out.double(), want)


def test_the_library_picks_each_group_s_scale_as_the_torch_steps_do(
    a8_library: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.generation import quant_codes

    g = torch.Generator().manual_seed(12)
    w = torch.randn(96, 512, generator=g) * torch.logspace(-5, 3, 512)
    w[7, 64:96] = 0.0  # a group of zeros: scale 1, codes 0
    w[8, :32] = -3.0  # a constant group, its max negative
    w[9, 32:64] = torch.arange(32) * 0.25 - 4.0  # values on a grid, halves among them
    for steps in (0, 5, 16):
        codes, scales = torch.ops.batchline.int8_weight_groups(w, steps)
        assert (codes.dtype, scales.dtype) == (torch.int8, torch.float32)
        assert torch.equal(scales, scales.bfloat16().float())
        assert scales[7, 2] == 1
        assert not codes[7, 64:96].any()
        # the codes are the scale's own: clamp(round(w * (1 / scale)))
        inverse = (1.0 / scales).repeat_interleave(32, dim=1)
        assert torch.equal(codes.float(), (w * inverse).round().clamp(-127, 127))
        with monkeypatch.context() as patch:
            patch.setattr(quant_codes, "_weight_groups_op", lambda: False)
            want_codes, want_scales = quant_codes.quantize_int8_groups(w, 32, steps)
        # the error of each group's pick is the least, up to the order float32 sums it in
        errors = [
            (c.double().view(96, 16, 32) * s.double()[..., None] - w.double().view(96, 16, 32))
            .square()
            .sum(dim=2)
            for c, s in ((codes, scales), (want_codes, want_scales))
        ]
        assert bool((errors[0] <= errors[1] * (1 + 1e-5) + 1e-30).all())
        assert float((scales == want_scales).float().mean()) > 0.99
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.batchline.int8_weight_groups(w[:, :40].contiguous(), 16)
    with pytest.raises(RuntimeError, match="steps must be in"):
        torch.ops.batchline.int8_weight_groups(w, 128)


def test_two_threads_give_the_bits_one_thread_gives(a8_library: None) -> None:
    n, k = 200, 1024
    codes, scales = _weight(n, k, seed=9)
    packed = ik.pack_int8g(codes, scales)
    g = torch.Generator().manual_seed(9)
    bias = torch.randn(n, generator=g)
    xs = [torch.randn(rows, k, generator=g) for rows in (1, 5, 16, 40)]
    before = torch.get_num_threads()
    outs: dict[int, list[Any]] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = [ik.int8g_linear(x, packed, n, bias) for x in xs]
    finally:
        torch.set_num_threads(before)
    for one, two in zip(outs[1], outs[2], strict=True):
        assert torch.equal(one, two)


def test_the_vnni_and_avx2_paths_give_the_same_bits(a8_library: None) -> None:
    """The same integer sums (vpdpbusd's over w + 128, less 128 times the row's code sum, against
    vpmaddubsw's over |w| and signed rows) and the same float32 operations per column."""
    if not set(A8_VNNI_FLAGS) <= ik.host_flags():
        pytest.skip("only the AVX2 path is built here (no AVX512-VNNI)")
    op = torch.ops.batchline.int8g_linear_a8
    g = torch.Generator().manual_seed(12)
    for n, k in ((72, 256), (16, 32), (300, 1024)):  # part tiles; 19 tiles over 2 threads
        codes, scales = _weight(n, k, seed=n)
        codes[0, :32] = -128  # a GGUF's Q8_0 may hold it
        packed = ik.pack_int8g(codes, scales)
        bias = torch.randn(n, generator=g)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17):
            x = torch.randn(rows, k, generator=g)
            for b in (None, bias):
                assert torch.equal(op(x, packed, n, b, 512), op(x, packed, n, b, 256)), (n, rows)


def test_no_rows_give_an_empty_product_and_bad_inputs_say_what_is_wrong(a8_library: None) -> None:
    packed = ik.pack_int8g(*_weight(32, 64, seed=2))
    op = torch.ops.batchline.int8g_linear_a8
    assert op(torch.empty(0, 64), packed, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous .* float32 or bfloat16"):
        op(torch.randn(2, 64).half(), packed, 32)
    with pytest.raises(RuntimeError, match="K = 40 is not a multiple of 32"):
        op(torch.randn(2, 40), packed, 32)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        op(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="n = 40 does not fit 2 tiles"):
        op(torch.randn(2, 64), packed, 40)
    q = quantize_int4(torch.randn(32, 64), 32)
    int4 = ik.pack_int4(q.codes, q.scales, q.zeros)
    with pytest.raises(RuntimeError, match="packed must be pack_int8g's"):
        op(torch.randn(2, 64), int4, 32)
    with pytest.raises(RuntimeError, match="width must be 256 or 512, not 128"):
        op(torch.randn(2, 64), packed, 32, None, 128)


def test_a_float32_layer_over_bf16_scales_holds_int8_in_its_layout_at_any_row_count(
    a8_library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, k = 48, 128
    g = torch.Generator().manual_seed(3)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    layer = QuantLinear.int4(
        int_planes(w, "int8g"), bias=bias, dtype=torch.float32, scale_dtype=torch.bfloat16
    )
    assert layer.kind == "int8g"
    assert len(layer._own) == 1
    assert layer._own[0].shape[2] == ik.BLOCK_INT8
    assert layer.weight_bytes == n * k * 17 // 16  # 8.5 bits a weight
    codes, scales = quantize_int8_groups(w, 32)
    weight = _float64(codes, scales)
    assert torch.equal(layer.dequantized(torch.float64), weight)
    x = torch.randn(3, k, generator=g)
    assert _relative(layer(x), _rounded_rows(x) @ weight.T + bias.double()) < TOLERANCE
    # int8_rows is what the layout computes anyway
    layer.int8_rows = False
    assert _relative(layer(x), _rounded_rows(x) @ weight.T + bias.double()) < TOLERANCE
    # bf16 rows: summed as int8 too, the float32 sums rounded once
    bf16 = layer(x.bfloat16())
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16, layer(x.bfloat16().float()).bfloat16())
    # past its row limit the weight is dequantized in chunks of columns and multiplied dense
    monkeypatch.setitem(ql.DENSE_ROWS, "own32a8q", 2)
    monkeypatch.setattr(ql, "DEQUANT_COLS", 32)
    dense = layer(x)
    assert _relative(dense, x.double() @ weight.T + bias.double()) < TOLERANCE
    bf16 = layer(x.bfloat16())  # and bf16 rows dense, the weight dequantized in bf16
    assert bf16.dtype == torch.bfloat16
    assert _relative(bf16, x.double() @ weight.T + bias.double()) < 2e-2
    # float32 scales (float rows asked for): the two int4 planes, as before
    planes = QuantLinear.int4(int_planes(w, "int8g"), dtype=torch.float32)
    assert [p.shape[2] for p in planes._own] == [ik.BLOCK_F32, ik.BLOCK_F32]


def test_stacked_weights_pack_chunk_by_chunk_as_one_weight(
    a8_library: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.generation import quantize

    monkeypatch.setattr(quantize, "PACK_CHUNK_ROWS", 32)
    g = torch.Generator().manual_seed(4)
    weights = [torch.randn(48, 64, generator=g), torch.randn(37, 64, generator=g)]
    packed = quantize.pack_own_int4(weights, quantize._int8_packed, torch.float32, torch.bfloat16)
    whole = ik.pack_int8g(*quantize_int8_groups(torch.cat(weights), 32))
    assert len(packed) == 1
    assert torch.equal(packed[0], whole)


def test_a_q8_0_gguf_with_int8_rows_loads_into_the_int8_layout(
    a8_library: None, tmp_path: Path, torch_threads: None
) -> None:
    pytest.importorskip("gguf")
    pytest.importorskip("transformers")
    from batchline.models.generation.gguf_weights import load_gguf

    from .conftest import TINY_VOCAB, build_tiny_llama
    from .gguf_helpers import dequantized_reference, write_tiny_gguf
    from .test_load import save_tiny_generator

    model = build_tiny_llama()
    path = write_tiny_gguf(tmp_path / "tiny.gguf", model, "Q8_0")
    folder = save_tiny_generator(tmp_path / "folder", model=model)
    loaded, _, report = load_gguf(
        path, dtype=torch.float32, folder=folder, scale_dtype=torch.bfloat16
    )
    assert report.kept == {"Q8_0": 7 * model.config.num_hidden_layers}
    layers = [m for m in loaded.modules() if isinstance(m, QuantLinear)]
    assert layers
    assert all(m.kind == "int8g" for m in layers)
    assert {p.shape[2] for m in layers for p in m._own} == {ik.BLOCK_INT8}
    assert all(len(m._own) == 1 for m in layers)
    x = torch.randint(3, TINY_VOCAB, (1, 12))
    with torch.no_grad():
        got, want = loaded(x).logits, dequantized_reference(path, model)(x).logits
    # the file's fp16 scales rounded to bf16, the rows to 8 bits a group
    assert 0 < _relative(got, want.double()) < 5e-2


def test_a_dense_product_first_made_in_inference_mode_runs_outside_it_after(
    a8_library: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The float32 dense path's buffers (kept per thread) are made as normal tensors: made by a
    call in inference mode (an engine's step), a later call outside it (a test's, a user's)
    still writes them, and a chunk width changed between calls takes buffers of its own."""
    w = torch.randn(40, 96, generator=torch.Generator().manual_seed(6))
    layer = QuantLinear.int4(
        int_planes(w, "int8g"),
        bias=torch.randn(40),
        dtype=torch.float32,
        scale_dtype=torch.bfloat16,
    )
    x = torch.randn(ql.DENSE_ROWS["own32a8q"], 96)
    monkeypatch.setattr(ql, "DEQUANT_COLS", 16)
    with torch.inference_mode():
        inside = layer(x)
    outside = layer(x)
    assert torch.equal(inside, outside)
    monkeypatch.setattr(ql, "DEQUANT_COLS", 32)
    assert torch.allclose(layer(x), outside, rtol=1e-5, atol=1e-4)


def test_a_bf16_model_holds_int8_groups_in_the_int8_layout_only_where_it_sums_rows_as_int8(
    a8_library: None, torch_threads: None
) -> None:
    from batchline.models.generation.quant_codes import pack_int8_groups

    n, k = 48, 128
    g = torch.Generator().manual_seed(5)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    codes, scales = quantize_int8_groups(w, 32)
    bf16 = torch.bfloat16
    assert ik.int8g_here(bf16, bf16, int8_rows=True)
    assert not ik.int8g_here(bf16, bf16)  # bf16 rows: the two planes (AMX tiles from 5 rows)
    assert not ik.int8g_here(torch.float16, bf16, int8_rows=True)
    assert [p.shape[2] for p in pack_int8_groups(codes, scales, bf16, bf16)] == [ik.BLOCK] * 2
    packed = pack_int8_groups(codes, scales, bf16, bf16, int8_rows=True)
    assert [p.shape[2] for p in packed] == [ik.BLOCK_INT8]
    layer = QuantLinear.own_int4(packed, n, k, kind="int8g", bias=bias)
    assert layer.int8_layout
    layer.int8_rows = True
    weight = _float64(codes, scales)
    product = layer.step_product(bf16)
    assert product is not None
    assert product.layout == StepProduct.INT8G_A8
    for rows in (1, 3, 8, 64):  # every row count: the layout has no bf16 path
        x = torch.randn(rows, k, generator=g).bfloat16()
        got = layer(x)
        assert got.dtype == bf16
        # widened exactly, so the float32 rows' sums, rounded to bf16 once
        assert torch.equal(got, layer(x.float()).bfloat16())
        want = _rounded_rows(x.float()) @ weight.T + bias.double()
        assert _relative(got, want) < 1e-2


def test_a_bf16_models_lm_head_is_in_the_int8_layout_with_int8_rows_and_planes_without(
    a8_library: None, torch_threads: None
) -> None:
    from batchline.models.generation.quantize import quantize_lm_head

    bf16 = torch.bfloat16
    here, why = ik.own_kernels(dtype=bf16)
    if not here:
        pytest.skip(f"the own bf16 kernel does not run here: {why}")
    n, k = 48, 128
    for int8_rows, blocks in ((True, [ik.BLOCK_INT8]), (False, [ik.BLOCK] * 2)):
        model = torch.nn.Module()
        model.lm_head = torch.nn.Linear(k, n, bias=False).to(bf16)
        report = quantize_lm_head(model, bf16, bf16, int8_rows=int8_rows)
        assert report is not None
        assert [p.shape[2] for p in model.lm_head._own] == blocks
        assert ("summed as int8" in report.kernel) is int8_rows
