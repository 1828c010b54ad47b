"""batchline's int4 linear for float32 activations (``csrc/quant_gemm_f32.cpp``), the one a model
computing in float32 takes on a CPU without AVX512-BF16: on both of its paths (AVX-512 vectors
where the CPU has them; AVX2's, the only path of an AVX2-only host, run here too) against the
float64 product of the dequantized weight for 1-17 rows, its dequantized weight bit for bit, the
same bits at any thread count, its errors; and the layers, the lm_head and a whole model."""

from __future__ import annotations

import threading
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation import quant_linear  # noqa: E402
from batchline.models.generation.quant_codes import Int4Codes, quantize_int4, quantize_int8_groups  # noqa: E402
from batchline.models.generation.quant_linear import QuantLinear  # noqa: E402
from batchline.models.generation.quantize import quantize_linears, quantize_lm_head  # noqa: E402

from .gen_helpers import int_planes  # noqa: E402

# float32 sums of float32 products, in another order than float64's: a few float32 steps of the
# largest output (the bf16 kernel's tolerance is 1e-2)
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def library() -> None:
    fast, why = ik.own_kernels(dtype=torch.float32)
    if not fast:
        pytest.skip(f"the float32 int4 kernel does not run here: {why}")


def _codes(n: int, k: int, seed: int, scale_dtype: Any = torch.bfloat16) -> Int4Codes:
    """Random int4 codes of an ``(n, k)`` weight, scales and zeros rounded to ``scale_dtype``
    (as packed)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[1] = 0.5  # a constant row: scale 1, every code 0
    q = quantize_int4(w, 32)
    scales, zeros = q.scales.to(scale_dtype).float(), q.zeros.to(scale_dtype).float()
    return Int4Codes(q.codes, scales, zeros, 32)


# the layouts the kernel reads: bf16 scales (a bf16 model's), float32 ones (a float32 model's)
SCALES = pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
# its paths: AVX-512 vectors (a build without AVX-512 takes the other), AVX2's
WIDTHS = pytest.mark.parametrize("width", [512, 256])


def _linear(x: Any, packed: Any, n: int, bias: Any, width: int) -> Any:
    return torch.ops.batchline.int4_linear_f32(x, packed, n, bias, width)


def _relative(out: Any, reference: Any) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


@WIDTHS
@SCALES
@pytest.mark.parametrize("rows", range(1, 18))
def test_the_kernel_is_the_float64_product_of_the_dequantized_weight(
    library: None, torch_threads: None, rows: int, scale_dtype: Any, width: int
) -> None:
    for n, k in ((40, 96), (112, 224), (16, 32)):  # 40: a part tile; 96, 224: odd groups
        q = _codes(n, k, seed=rows * n, scale_dtype=scale_dtype)
        packed = ik.pack_int4(q.codes, q.scales, q.zeros, scale_dtype)
        x = torch.randn(rows, k)
        bias = torch.randn(n)
        product = x.double() @ q.dequantize().T
        for b in (None, bias):
            out = _linear(x, packed, n, b, width)
            assert out.dtype == torch.float32
            assert out.shape == (rows, n)
            reference = product if b is None else product + b.double()
            assert _relative(out, reference) < TOLERANCE, (n, k, b is None)


@WIDTHS
@SCALES
def test_two_threads_give_the_bits_one_thread_gives(
    library: None, scale_dtype: Any, width: int
) -> None:
    # 13 tiles of 1,024 inputs (10-12 KiB each, the last a part one): two threads split them
    n, k = 200, 1024
    g = torch.Generator().manual_seed(9)
    q = quantize_int4(torch.randn(n, k, generator=g), 32)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros, scale_dtype)
    bias = torch.randn(n, generator=g)
    xs = [torch.randn(rows, k, generator=g) for rows in (1, 5, 16, 17)]
    before = torch.get_num_threads()
    outs: dict[int, list[Any]] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = [_linear(x, packed, n, b, width) for x in xs for b in (None, bias)]
            outs[threads].append(ik.int4_dequantize(packed, n, torch.float32))
    finally:
        torch.set_num_threads(before)
    assert len(outs[1]) == len(outs[2]) == 9
    for one, two in zip(outs[1], outs[2], strict=True):
        assert torch.equal(one, two)


@SCALES
@pytest.mark.parametrize(("n", "k"), [(24, 96), (48, 64), (40, 2048)])
def test_the_library_dequantizes_each_weight_to_float32_rounded_once(
    library: None, torch_threads: None, n: int, k: int, scale_dtype: Any
) -> None:
    q = _codes(n, k, seed=n + k, scale_dtype=scale_dtype)  # 24, 40: a part-filled last tile
    packed = ik.pack_int4(q.codes, q.scales, q.zeros, scale_dtype)
    assert packed.shape[2] == (ik.BLOCK_F32 if scale_dtype == torch.float32 else ik.BLOCK)
    codes, scales, zeros = ik.unpack_int4(packed, n)  # the layout reads back
    assert torch.equal(codes, q.codes)
    assert scales.dtype == zeros.dtype == scale_dtype
    assert torch.equal(scales.float(), q.scales)
    assert torch.equal(zeros.float(), q.zeros)
    codes = q.codes.double().view(n, k // 32, 32)
    exact = ((codes - 8) * q.scales.double()[..., None] + q.zeros.double()[..., None]).view(n, k)
    got = ik.int4_dequantize(packed, n, torch.float32)
    assert got.dtype == torch.float32
    assert torch.equal(got, exact.float())
    with pytest.raises(RuntimeError, match=f"n = {n + 16} does not fit"):
        ik.int4_dequantize(packed, n + 16, torch.float32)


def test_no_rows_give_an_empty_product_and_bad_inputs_say_what_is_wrong(library: None) -> None:
    q = _codes(32, 64, seed=1)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros)
    assert ik.int4_linear(torch.empty(0, 64), packed, 32).shape == (0, 32)
    f32 = torch.ops.batchline.int4_linear_f32
    with pytest.raises(RuntimeError, match=r"x must be a contiguous .* float32"):
        f32(torch.randn(2, 64).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        ik.int4_linear(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="n = 40 does not fit 2 tiles"):
        ik.int4_linear(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        ik.int4_linear(torch.randn(2, 64), packed, 32, torch.randn(32).bfloat16())
    with pytest.raises(RuntimeError, match="packed must be"):
        ik.int4_linear(torch.randn(2, 64), packed.view(2, -1), 32)
    with pytest.raises(RuntimeError, match="width must be 256 or 512, not 128"):
        _linear(torch.randn(2, 64), packed, 32, None, 128)
    # the float32-scale layout is the float32 kernel's alone (bf16 rows: refused, as they are
    # on a CPU without AVX512-BF16)
    wide = ik.pack_int4(q.codes, q.scales, q.zeros, torch.float32)
    with pytest.raises(RuntimeError, match=r"not float32 ones|built for a CPU without AVX512-BF16"):
        ik.int4_linear(torch.randn(2, 64).bfloat16(), wide, 32)
    with pytest.raises(ValueError, match=r"scales in bf16 or float32, not torch\.float16"):
        ik.pack_int4(q.codes, q.scales, q.zeros, torch.float16)


def test_which_kernels_run_follows_the_flags_for_each_dtype(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ik, "decode_kernel", lambda: (None, "no C++ compiler (c++ not found)"))
    assert ik.own_kernels(dtype=torch.float32) == (False, "no C++ compiler (c++ not found)")
    monkeypatch.setattr(ik, "decode_kernel", lambda: (object(), "/cache/kernels/lib.so"))
    for flags, bf16, f32, vectors in (
        ("fpu avx", False, False, "AVX2 vectors"),  # no AVX2: torch's kernels
        ("fpu avx2 fma", False, True, "AVX2 vectors"),  # AVX2 only: the 256-bit path
        ("fpu avx2 fma avx512f avx512_vnni", False, True, "AVX-512 vectors"),  # Ice Lake
        ("fpu avx2 fma avx512f avx512_bf16", True, True, "AVX-512 vectors"),
        ("fpu avx2 fma avx512f avx512_bf16 amx_bf16 amx_int8", True, True, "AVX-512 vectors"),
    ):
        monkeypatch.setattr(ik, "host_flags", lambda flags=flags: frozenset(flags.split()))
        assert ik.own_kernels()[0] == bf16, flags
        assert ik.own_kernels(dtype=torch.float32)[0] == f32, flags
        monkeypatch.setattr(ik, "F32_WIDTH", 512)
        assert ik.f32_vectors() == vectors, flags
        monkeypatch.setattr(ik, "F32_WIDTH", 256)
        assert ik.f32_vectors() == "AVX2 vectors", flags
        # the int8 kernel (AMX) takes bf16 only
        assert ik.own_kernels(amx=True, dtype=torch.float32) == (
            False,
            "the own int8 kernel takes bf16 activations",
        )
    monkeypatch.setattr(ik, "host_flags", lambda: frozenset(["fpu", "avx2"]))
    assert ik.own_kernels(dtype=torch.float32) == (False, "the CPU has no AVX2 and FMA")
    assert ik.own_kernels(dtype=torch.float16)[1].startswith("the own kernels take bf16 or")


def test_a_float32_layer_computes_through_the_kernel_and_goes_dense_for_many_rows(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = _codes(80, 96, seed=11)
    bias = torch.randn(80)
    layer = QuantLinear.int4([q], bias=bias, dtype=torch.float32)
    assert "own kernel" in repr(layer)
    assert layer.weight_bytes == 80 * 96 // 2 + 80 * 3 * 8  # codes, float32 scales and zeros
    reference = q.dequantize()
    calls: list[tuple[int, Any]] = []
    real = ik.int4_dequantize

    def spy(packed: torch.Tensor, n: int, dtype: Any = torch.bfloat16, into: Any = None) -> Any:
        calls.append((n, dtype))
        return real(packed, n, dtype, into)

    monkeypatch.setattr(ik, "int4_dequantize", spy)
    dense_rows = quant_linear.DENSE_ROWS["own32"]
    for shape in ((1, 96), (2, 5, 96), (dense_rows - 1, 96)):
        x = torch.randn(*shape)
        out = layer(x)
        assert out.dtype == torch.float32
        assert out.shape == (*shape[:-1], 80)
        assert _relative(out, x.double() @ reference.T + bias.double()) < TOLERANCE
    assert calls == []  # the kernel up to DENSE_ROWS["own32"] rows
    x = torch.randn(dense_rows, 96)
    assert _relative(layer(x), x.double() @ reference.T + bias.double()) < TOLERANCE
    assert calls == [(80, torch.float32)]  # then the weight, dequantized, dense
    # bf16 rows into the float32 layout (no kernel reads it in bf16): dequantized in Python
    x = torch.randn(3, 96).bfloat16()
    assert _relative(layer(x), x.double() @ reference.T + bias.bfloat16().double()) < 2e-2
    assert calls == [(80, torch.float32)]
    # a bf16 layer's layout takes float32 rows through the same kernel
    bf16_layer = QuantLinear.int4([q], bias=bias, dtype=torch.bfloat16, own_kernel=True)
    x = torch.randn(3, 96)
    assert _relative(bf16_layer(x), x.double() @ reference.T + bias.double()) < TOLERANCE
    # groups of 64 keep torch's kernel, and asking for the own one says why not
    wide = quantize_int4(torch.randn(48, 128), 64)
    assert "own kernel" not in repr(QuantLinear.int4([wide], dtype=torch.float32))
    with pytest.raises(ValueError, match=r"bf16 or float32 and groups of 32, not torch\.float32"):
        QuantLinear.int4([wide], dtype=torch.float32, own_kernel=True)


@pytest.mark.parametrize("kind", ["int4", "int8g"])
def test_a_dense_product_dequantizes_a_chunk_of_columns_at_a_time(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # 200 outputs in chunks of 64 columns (the last a part one, 8 columns: a part tile too)
    monkeypatch.setattr(quant_linear, "DEQUANT_COLS", 64)
    monkeypatch.setattr(quant_linear, "_scratch", threading.local())
    n, k = 200, 128
    w = torch.randn(n, k)
    planes = int_planes(w, kind)
    bias = torch.randn(n)
    layer = QuantLinear.int4(planes, bias=bias, dtype=torch.float32)
    assert layer.kind == kind
    assert layer.own_kernel
    reference = layer.dequantized(torch.float64)
    rows = quant_linear.DENSE_ROWS["own32"]
    for count in (rows, rows + 3):
        x = torch.randn(count, k)
        out = layer(x)
        assert out.shape == (count, n)
        assert _relative(out, x.double() @ reference.T + bias.double()) < TOLERANCE
    # the buffers are this thread's, one per plane, input width and chunk width (DEQUANT_COLS rows)
    planes = 1 if kind == "int4" else 2
    assert sorted(quant_linear._scratch.buffers) == [(i, 128, 64) for i in range(planes)]
    assert {tuple(b.shape) for b in quant_linear._scratch.buffers.values()} == {(64, 128)}


def test_the_float32_lm_head_goes_int8_in_groups_of_32_through_the_kernel(
    library: None, torch_threads: None
) -> None:
    from .conftest import build_tiny_llama

    model = build_tiny_llama()
    weight = model.lm_head.weight.detach().clone()  # (320, 64)
    report = quantize_lm_head(model, torch.float32)
    assert report is not None
    assert report.kernel == f"batchline's kernel in {ik.f32_vectors()}, float32 activations"
    head = model.lm_head
    assert isinstance(head, QuantLinear)
    assert head.kind == "int8g"
    assert head.own_kernel
    codes, scales = quantize_int8_groups(weight, 32)
    expected = (codes.double().view(320, 2, 32) * scales.double()[..., None]).view(320, 64)
    x = torch.randn(3, 64)
    assert _relative(head(x), x.double() @ expected.T) < TOLERANCE


@pytest.mark.parametrize(("kind", "layers"), [("int4", "int4"), ("int8", "int8g")])
def test_a_float32_model_quantized_gives_the_dequantized_models_tokens(
    library: None, torch_threads: None, kind: str, layers: str
) -> None:
    # int8 in float32 goes int8 in groups of 32, two int4 planes through the float32 kernel:
    # torch's per-channel int8 kernel took 2.9x a dense float32 step
    pytest.importorskip("transformers")
    from batchline.models.generation.lean_llama import fuse_projections

    from .conftest import TINY_VOCAB, build_tiny_llama
    from .gen_helpers import dequantize_quant_linears

    model = build_tiny_llama()
    fuse_projections(model)
    report = quantize_linears(model, kind, torch.float32)
    path = f"batchline's kernel in {ik.f32_vectors()}, float32 activations"
    said = "int4 in groups of 32 with 8-bit steps" if layers == "int4" else layers
    expected = f"8 linears as {said} through {path}"
    assert expected in str(report)
    quantized = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(quantized) == 8
    assert all(m.kind == layers for m in quantized)
    assert all("own kernel" in repr(m) for m in quantized)
    x = torch.randint(3, TINY_VOCAB, (2, 9))
    with torch.no_grad():
        ours = model(x).logits
        dequantize_quant_linears(model)
        reference = model(x).logits
    # float32 throughout: the same weights, summed in another order
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))
    assert _relative(ours, reference.double()) < 1e-4
