"""batchline's own int4 linear (``csrc/quant_gemm.cpp``): against the float64 product of the
dequantized weight and against torch's int4 kernel, on both of its paths (vdpbf16ps, AMX tiles),
for 1-17 rows, widths that are odd multiples of the group and outputs that are not multiples of
a tile; its packed layout read back; and the fallback where the library or the CPU lacks it."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation import quant_linear, quantize  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    Int4Codes,
    int8_group_planes,
    quantize_int4,
    quantize_int4_steps,
    quantize_int8,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear  # noqa: E402
from batchline.models.generation.quantize import QuantReport, quantize_lm_head  # noqa: E402

NEVER = 1 << 30  # an amx_rows no call reaches: the vdpbf16ps path (or the plain C++ one)
# out is rounded to bf16 once: half a bf16 step of the largest output, with room for fp32 sums
TOLERANCE = 1e-2


@pytest.fixture(scope="module")
def library() -> None:
    fast, why = ik.own_kernels()
    if not fast:
        pytest.skip(f"the int4 kernel does not run vectorized here: {why}")


def _codes(n: int, k: int, seed: int) -> Int4Codes:
    """Random int4 codes of an ``(n, k)`` weight, scales and zeros rounded to bf16 (as packed)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    w[1] = 0.5  # a constant row: scale 1, every code 0
    q = quantize_int4(w, 32)
    return Int4Codes(q.codes, q.scales.bfloat16().float(), q.zeros.bfloat16().float(), 32)


def _relative(out: Any, reference: Any) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


@pytest.mark.parametrize("rows", range(1, 18))
@pytest.mark.parametrize("amx_rows", [1, NEVER])  # AMX tiles (where the CPU has them), vdpbf16ps
def test_the_kernel_is_the_float64_product_of_the_dequantized_weight(
    library: None, torch_threads: None, rows: int, amx_rows: int
) -> None:
    for n, k in ((40, 96), (112, 224), (16, 32)):  # 40: a part tile; 96, 224: odd groups
        q = _codes(n, k, seed=rows * n)
        packed = ik.pack_int4(q.codes, q.scales, q.zeros)
        x = torch.randn(rows, k).bfloat16()
        bias = torch.randn(n)
        product = x.double() @ q.dequantize().T
        for b in (None, bias):
            out = ik.int4_linear(x, packed, n, b, amx_rows=amx_rows)
            assert out.dtype == torch.bfloat16
            assert out.shape == (rows, n)
            reference = product if b is None else product + b.double()
            assert _relative(out, reference) < TOLERANCE, (n, k, b is None)


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17])
def test_the_kernel_agrees_with_torchs_int4_kernel(
    library: None, torch_threads: None, rows: int
) -> None:
    n, k = 48, 160
    q = _codes(n, k, seed=rows)
    x = torch.randn(rows, k).bfloat16()
    expected = QuantLinear.int4([q], dtype=torch.bfloat16, own_kernel=False)(x)
    for amx_rows in (1, NEVER):
        ours = ik.int4_linear(x, ik.pack_int4(q.codes, q.scales, q.zeros), n, amx_rows=amx_rows)
        assert _relative(ours, expected.double()) < TOLERANCE


def test_the_library_splits_work_over_torchs_threads(library: None) -> None:
    # Compiled without OpenMP, at::parallel_for ran every tile on the calling thread whatever
    # torch.set_num_threads said (and a second thread gained nothing); the library now shares
    # torch's OpenMP runtime, so its split follows torch's thread count.
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert torch.ops.batchline.parallel_chunks(100) == threads
            assert torch.ops.batchline.parallel_chunks(1) == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_two_threads_give_the_bits_one_thread_gives(library: None, kind: str) -> None:
    # Each tile's 16 columns are summed by one thread in one order: bit-equal, not just close.
    # 13 tiles, the last a part one, of 1,024 inputs: past the kernels' least share of weight
    # bytes (64 KiB: 6 int4 tiles of 10 KiB, 4 int8 ones of 16 KiB), so two threads split them
    n, k = 200, 1024
    g = torch.Generator().manual_seed(9)
    w = torch.randn(n, k, generator=g)
    bias = torch.randn(n, generator=g)
    if kind == "int4":
        q = quantize_int4(w, 32)
        packed: Any = ik.pack_int4(q.codes, q.scales, q.zeros)
        linear: Any = ik.int4_linear
    else:
        packed = ik.pack_int8(*quantize_int8(w))
        linear = ik.int8_linear
    xs = [torch.randn(rows, k, generator=g).bfloat16() for rows in (1, 5, 16, 17)]
    before = torch.get_num_threads()
    outs: dict[int, list[Any]] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = [
                linear(x, packed, n, b, amx_rows=a)
                for x in xs
                for a in (1, NEVER)  # AMX tiles (where the CPU has them), vdpbf16ps
                for b in (None, bias)
            ]
    finally:
        torch.set_num_threads(before)
    assert len(outs[1]) == len(outs[2]) == 16
    for one, two in zip(outs[1], outs[2], strict=True):
        assert torch.equal(one, two)


def test_the_packed_layout_holds_every_code_scale_and_zero(torch_threads: None) -> None:
    n, k = 24, 96  # two tiles, the second half padding
    q = _codes(n, k, seed=3)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros)
    assert packed.shape == (2, 3, 320)
    assert packed.dtype == torch.uint8
    for row in range(32):
        tile, i = divmod(row, 16)
        for g in range(3):
            block = packed[tile, g]
            sz = block[256:].view(torch.bfloat16).float()
            for kk in range(32):
                chunk, r = divmod(kk, 4)
                byte = int(block[32 * chunk + 2 * i + (r & 1)])
                code = byte & 15 if r < 2 else byte >> 4
                if row < n:
                    assert code == int(q.codes[row, 32 * g + kk])
                else:
                    assert code == 8  # padding: weight (8 - 8) * 0 + 0
            if row < n:
                assert float(sz[i]) == float(q.scales[row, g])
                assert float(sz[16 + i]) == float(q.zeros[row, g])
            else:
                assert float(sz[i]) == 0.0
                assert float(sz[16 + i]) == 0.0
    # and read back whole
    codes, scales, zeros = ik.unpack_int4(packed, n)
    assert torch.equal(codes, q.codes)
    assert torch.equal(scales.float(), q.scales)
    assert torch.equal(zeros.float(), q.zeros)


@pytest.mark.parametrize(("n", "k"), [(24, 96), (48, 64), (40, 2048)])
def test_the_library_dequantizes_each_weight_rounded_once(
    library: None, torch_threads: None, n: int, k: int
) -> None:
    q = _codes(n, k, seed=n + k)  # 24 and 40 leave the last tile part-filled
    packed = ik.pack_int4(q.codes, q.scales, q.zeros)
    codes = q.codes.double().view(n, k // 32, 32)
    exact = ((codes - 8) * q.scales.double()[..., None] + q.zeros.double()[..., None]).view(n, k)
    got = ik.int4_dequantize(packed, n)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, exact.float().bfloat16())  # fp32's fma, then bf16: one rounding
    with pytest.raises(RuntimeError, match=r"does not fit \d+ tiles of 16"):
        ik.int4_dequantize(packed, n + 16)


def test_a_layer_of_many_rows_multiplies_the_dequantized_weight_dense(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    q = _codes(40, 96, seed=8)
    layer = QuantLinear.int4([q], own_kernel=True)
    rows = quant_linear.DENSE_ROWS["own"]
    x = torch.randn(rows, 96).bfloat16()
    reference = x.double() @ q.dequantize().T
    calls: list[int] = []
    real = ik.int4_dequantize

    def spy(packed: torch.Tensor, n: int, dtype: Any = torch.bfloat16) -> torch.Tensor:
        calls.append(n)
        return real(packed, n, dtype)

    monkeypatch.setattr(ik, "int4_dequantize", spy)
    assert _relative(layer(x), reference) < TOLERANCE
    assert calls == [40]
    assert _relative(layer(x[: rows - 1]), reference[: rows - 1]) < TOLERANCE
    assert calls == [40]  # one row fewer: the kernel


def test_no_rows_give_an_empty_product_and_bad_inputs_say_what_is_wrong(library: None) -> None:
    q = _codes(32, 64, seed=1)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros)
    assert ik.int4_linear(torch.empty(0, 64, dtype=torch.bfloat16), packed, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ik.int4_linear(torch.randn(2, 64).half(), packed, 32)  # float32 takes its own path
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        ik.int4_linear(torch.randn(2, 96).bfloat16(), packed, 32)
    with pytest.raises(RuntimeError, match="n = 40 does not fit 2 tiles"):
        ik.int4_linear(torch.randn(2, 64).bfloat16(), packed, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        ik.int4_linear(torch.randn(2, 64).bfloat16(), packed, 32, torch.randn(32).bfloat16())
    wide = quantize_int4(torch.randn(16, 128), 64)
    with pytest.raises(ValueError, match=r"groups of 32: codes \(16, 128\) with scales \(16, 2\)"):
        ik.pack_int4(wide.codes, wide.scales, wide.zeros)


def test_without_the_library_or_avx512_bf16_the_kernel_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ik, "decode_kernel", lambda: (None, "no C++ compiler (c++ not found)"))
    assert ik.own_kernels() == (False, "no C++ compiler (c++ not found)")
    monkeypatch.setattr(ik, "decode_kernel", lambda: (object(), "/cache/kernels/lib.so"))
    monkeypatch.setattr(ik, "host_flags", lambda: frozenset(["fpu", "avx2", "avx512f"]))
    assert ik.own_kernels() == (False, "the CPU has no AVX512-BF16")
    monkeypatch.setattr(
        ik, "host_flags", lambda: frozenset(["fpu", "avx2", "avx512f", "avx512_bf16"])
    )
    assert ik.own_kernels() == (True, "/cache/kernels/lib.so")


def test_quant_linear_computes_through_the_own_kernel_where_it_runs(
    library: None, torch_threads: None
) -> None:
    q = _codes(80, 96, seed=11)
    bias = torch.randn(80).bfloat16()
    ours = QuantLinear.int4([q], bias=bias, dtype=torch.bfloat16)
    theirs = QuantLinear.int4([q], bias=bias, dtype=torch.bfloat16, own_kernel=False)
    assert "own kernel" in repr(ours)
    assert "own kernel" not in repr(theirs)
    assert ours.weight_bytes == 80 * 96 // 2 + 80 * 3 * 4  # codes, then bf16 scales and zeros
    assert torch.equal(ours.dequantized(torch.float64), q.dequantize())
    reference = q.dequantize()
    for shape in ((1, 96), (2, 5, 96), (300, 96)):  # a leading batch shape; a prefill chunk
        x = torch.randn(*shape).bfloat16()
        expected = x.double() @ reference.T + bias.double()
        out = ours(x)
        assert out.shape == (*shape[:-1], 80)
        assert _relative(out, expected) < TOLERANCE
        assert _relative(theirs(x), expected) < TOLERANCE
    # float32 activations into a layer built for bf16: the float32 kernel (on every CPU with
    # AVX512-BF16, which has AVX-512), within float32's tolerance of the same weight
    x = torch.randn(3, 96)
    assert _relative(ours(x), x.double() @ reference.T + bias.double()) < 1e-5


def test_q8_0s_two_planes_sum_through_the_own_kernel(library: None, torch_threads: None) -> None:
    codes, _ = quantize_int8(torch.randn(48, 128))
    scales = torch.rand(48, 4) / 100 + 1e-3
    planes = int8_group_planes(codes, scales.bfloat16().float(), 32)
    layer = QuantLinear.int4(planes, dtype=torch.bfloat16)
    assert layer.kind == "int8g"
    assert "own kernel" in repr(layer)
    weight = codes.double() * scales.bfloat16().double().repeat_interleave(32, 1)
    x = torch.randn(6, 128).bfloat16()
    assert _relative(layer(x), x.double() @ weight.T) < TOLERANCE


def test_the_lm_head_goes_int8_in_groups_of_32_through_the_own_kernel(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from .conftest import build_tiny_llama

    model = build_tiny_llama().to(torch.bfloat16)
    weight = model.lm_head.weight.detach().clone()  # (320, 64)
    assert quantize_lm_head(build_tiny_llama().half(), torch.float16) is None  # no kernel
    report = quantize_lm_head(model, torch.bfloat16)
    assert report is not None
    assert (report.kind, report.linears) == ("int8g", 1)
    assert report.bytes_before == weight.numel() * 2
    assert report.bytes_after < report.bytes_before
    head = model.lm_head
    assert isinstance(head, QuantLinear)
    assert head.own_kernel
    assert head.kind == "int8g"
    codes, scales = quantize_int8_groups(weight, 32)
    expected = (codes.double().view(320, 2, 32) * scales.double()[..., None]).view(320, 64)
    assert torch.equal(head.dequantized(torch.float64), expected)  # the two planes sum exactly
    g = torch.Generator().manual_seed(5)
    for rows in (1, 3, 16):
        x = torch.randn(rows, 64, generator=g).bfloat16()
        assert _relative(head(x), x.double() @ expected.T) < TOLERANCE
    # a head quantized a chunk of rows at a time packs what one pass packs
    monkeypatch.setattr(quantize, "PACK_CHUNK_ROWS", 48)
    chunked = build_tiny_llama().to(torch.bfloat16)
    quantize_lm_head(chunked, torch.bfloat16)
    assert all(torch.equal(a, b) for a, b in zip(chunked.lm_head._own, head._own, strict=True))
    words = str(QuantReport("int4", 8, 4096, 1024, "a kernel", head=report))
    assert "lm_head as int8g in groups of 32, 0 -> 0 MiB; embedding kept" in words


def test_a_layer_quantized_a_chunk_of_rows_at_a_time_packs_what_one_pass_packs(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.generation.lean_llama import fuse_projections

    from .conftest import build_tiny_llama

    model = build_tiny_llama().to(torch.bfloat16)
    fuse_projections(model)  # gate/up: 256 rows, q/k/v: 128
    linears = {
        name: module.weight.detach().clone()
        for name, module in model.model.layers.named_modules()
        if isinstance(module, torch.nn.Linear)
    }
    monkeypatch.setattr(quantize, "PACK_CHUNK_ROWS", 48)  # chunks that end inside a weight
    # and fewer rows where the inputs are wider (64: 32 rows; down's 128: 16)
    monkeypatch.setattr(quantize, "PACK_CHUNK_VALUES", 32 * 64)
    calls: list[int] = []
    real = quantize._int4_packed

    def spy(rows: Any, dtype: Any, scale_dtype: Any) -> Any:
        calls.append(rows.shape[0])
        return real(rows, dtype, scale_dtype)

    monkeypatch.setattr(quantize, "_int4_packed", spy)
    quantize.quantize_linears(model, "int4", torch.bfloat16)
    assert max(calls) == 32
    assert 16 in calls
    for name, weight in linears.items():
        layer = model.model.layers.get_submodule(name)
        q = quantize_int4_steps(weight)
        whole = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
        assert layer.own_kernel
        assert torch.equal(layer._own[0], whole), name


def test_fusing_as_packed_gives_the_layer_that_fusing_then_quantizing_gives(
    library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    import copy

    import transformers

    from batchline.models.generation.lean_llama import fuse_projections

    config = transformers.Qwen2Config(  # q/k/v with biases
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    torch.manual_seed(3)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval()
    twice = copy.deepcopy(model)
    monkeypatch.setattr(quantize, "PACK_CHUNK_ROWS", 48)  # chunks that end inside a part
    layer = model.model.layers[0]
    report = quantize.fuse_quantized(layer, "int4", torch.bfloat16)
    fuse_projections(twice)
    expected = quantize.quantize_linears(twice, "int4", torch.bfloat16)
    assert report is not None
    assert report.linears == 2
    for block, name in (("self_attn", "qkv_proj"), ("mlp", "gate_up_proj")):
        mine = getattr(getattr(layer, block), name)
        theirs = getattr(getattr(twice.model.layers[0], block), name)
        assert isinstance(mine, QuantLinear)
        assert mine.own_kernel
        assert torch.equal(mine._own[0], theirs._own[0]), name
        assert (mine.bias is None) == (theirs.bias is None)
        assert mine.bias is None or torch.equal(mine.bias, theirs.bias)
    fused = [layer.self_attn.qkv_proj, layer.mlp.gate_up_proj]
    assert report.bytes_after == sum(m.weight_bytes for m in fused)
    assert report.bytes_before == sum(2 * m.in_features * m.out_features for m in fused)
    assert report.kernel == expected.kernel
    # the parts are views of the fused layer, as fusing leaves them
    assert type(layer.self_attn.k_proj) is type(twice.model.layers[0].self_attn.k_proj)
    # o_proj and down_proj are left to quantize_linears; then both models compute alike
    quantize.quantize_linears(model, "int4", torch.bfloat16)
    x = torch.randint(3, 320, (1, 5))
    with torch.inference_mode():
        assert torch.equal(model(x).logits, twice(x).logits)
    # fused already: nothing more to do
    assert quantize.fuse_quantized(layer, "int4", torch.bfloat16) is None
    # not for int8; for int4 computing in float32 too, through the float32 path's kernel
    plain = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).eval().model.layers[0]
    assert quantize.fuse_quantized(plain, "int8", torch.bfloat16) is None
    in_f32 = quantize.fuse_quantized(copy.deepcopy(plain), "int4", torch.float32)
    assert in_f32 is not None
    assert in_f32.linears == 2
    assert "float32" in in_f32.kernel
    plain.self_attn.k_proj.bias = None  # a bias on q and v only: left to fusing in turn
    only_mlp = quantize.fuse_quantized(plain, "int4", torch.bfloat16)
    assert only_mlp is not None
    assert only_mlp.linears == 1
    assert not hasattr(plain.self_attn, "qkv_proj")
    assert hasattr(plain.mlp, "gate_up_proj")


def test_packing_stacked_weights_wants_whole_tiles_but_for_the_last(library: None) -> None:
    planes = quantize._int4_packed
    with pytest.raises(ValueError, match="only the last weight stacked"):
        quantize.pack_own_int4([torch.randn(24, 64), torch.randn(16, 64)], planes)
    stacked = quantize.pack_own_int4([torch.randn(32, 64), torch.randn(24, 64)], planes)
    assert stacked[0].shape[0] == 4  # 56 rows: three tiles and a part-filled one


def test_quant_linear_keeps_torchs_kernel_where_the_own_one_does_not_run(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    monkeypatch.setattr(ik, "own_kernels", lambda **_: (False, "the CPU has no AVX512-BF16"))
    q = _codes(48, 96, seed=5)
    layer = QuantLinear.int4([q], dtype=torch.bfloat16)
    assert "own kernel" not in repr(layer)
    x = torch.randn(4, 96).bfloat16()
    assert _relative(layer(x), x.double() @ q.dequantize().T) < TOLERANCE
    assert "own kernel" not in repr(QuantLinear.int4([q], dtype=torch.float32))
    # groups of 64, or float16, keep torch's kernel wherever the own one runs
    monkeypatch.setattr(ik, "own_kernels", lambda **_: (True, "/cache/kernels/lib.so"))
    assert "own kernel" not in repr(QuantLinear.int4([q], dtype=torch.float16))
    wide = quantize_int4(torch.randn(48, 128), 64)
    assert "own kernel" not in repr(QuantLinear.int4([wide], dtype=torch.bfloat16))
    with pytest.raises(
        ValueError,
        match=r"takes bf16 or float32 and groups of 32, not torch\.bfloat16 and groups of 64",
    ):
        QuantLinear.int4([wide], dtype=torch.bfloat16, own_kernel=True)


@pytest.fixture(scope="module")
def amx_library() -> None:
    fast, why = ik.own_kernels(amx=True)
    if not fast:
        pytest.skip(f"the int8 kernel does not run through AMX here: {why}")


@pytest.mark.parametrize("rows", range(1, 18))
def test_the_int8_kernel_is_the_float64_product_of_codes_and_scales(
    library: None, torch_threads: None, rows: int
) -> None:
    for n, k in ((40, 96), (112, 224), (16, 32)):
        g = torch.Generator().manual_seed(rows * n)
        codes, scales = quantize_int8(torch.randn(n, k, generator=g))
        packed = ik.pack_int8(codes, scales)
        x = torch.randn(rows, k, generator=g).bfloat16()
        bias = torch.randn(n, generator=g)
        product = x.double() @ (codes.double() * scales.double()[:, None]).T
        for amx_rows in (1, NEVER):  # AMX tiles where the CPU has them; vdpbf16ps
            for b in (None, bias):
                out = ik.int8_linear(x, packed, n, b, amx_rows=amx_rows)
                assert out.shape == (rows, n)
                reference = product if b is None else product + b.double()
                assert _relative(out, reference) < TOLERANCE, (n, k, amx_rows, b is None)


def test_the_int8_layout_reads_back_and_bad_inputs_say_what_is_wrong(library: None) -> None:
    codes, scales = quantize_int8(torch.randn(24, 64))
    packed = ik.pack_int8(codes, scales)
    assert packed[0].shape == (2, 32, 32)
    assert packed[1].shape == (32,)
    assert int(packed[0][0, 5, 2 * 3 + 1]) == int(codes[3, 11])  # column 3, input 2 * 5 + 1
    back, back_scales = ik.unpack_int8(packed, 24)
    assert torch.equal(back, codes)
    assert torch.equal(back_scales, scales)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        ik.int8_linear(torch.randn(2, 96).bfloat16(), packed, 24)
    with pytest.raises(
        ValueError, match=r"multiples of 32 and a scale per output: codes \(8, 48\)"
    ):
        ik.pack_int8(*quantize_int8(torch.randn(8, 48)))


def test_quant_linear_computes_int8_through_the_own_kernel_where_the_cpu_has_amx(
    amx_library: None, torch_threads: None
) -> None:
    codes, scales = quantize_int8(torch.randn(80, 96))
    bias = torch.randn(80).bfloat16()
    ours = QuantLinear.int8(codes, scales, bias=bias, dtype=torch.bfloat16)
    assert "own kernel" in repr(ours)
    assert ours.weight_bytes == 80 * 96 + 80 * 4  # int8 codes, float32 scales
    weight = codes.double() * scales.double()[:, None]
    assert torch.equal(ours.dequantized(torch.float64), weight)
    for shape in ((1, 96), (2, 5, 96), (100, 96)):  # a leading batch shape; a prefill chunk
        x = torch.randn(*shape).bfloat16()
        out = ours(x)
        assert out.shape == (*shape[:-1], 80)
        assert _relative(out, x.double() @ weight.T + bias.double()) < TOLERANCE
    x = torch.randn(3, 96)  # float32 activations: the dequantized weight, dense
    assert _relative(ours(x), x.double() @ weight.T + bias.double()) < TOLERANCE


def test_int8_keeps_torchs_kernel_without_amx(
    monkeypatch: pytest.MonkeyPatch, torch_threads: None
) -> None:
    codes, scales = quantize_int8(torch.randn(48, 96))
    monkeypatch.setattr(ik, "decode_kernel", lambda: (object(), "/cache/kernels/lib.so"))
    monkeypatch.setattr(ik, "host_flags", lambda: frozenset(["avx512f", "avx512_bf16"]))
    assert ik.own_kernels(amx=True) == (False, "the CPU has no AMX")
    assert ik.own_kernels() == (True, "/cache/kernels/lib.so")
    layer = QuantLinear.int8(codes, scales, dtype=torch.bfloat16)
    assert "own kernel" not in repr(layer)
    x = torch.randn(4, 96).bfloat16()
    weight = codes.double() * scales.bfloat16().double()[:, None]
    assert _relative(layer(x), x.double() @ weight.T) < TOLERANCE
    with pytest.raises(ValueError, match="takes bf16 and inputs in multiples of 32, not"):
        QuantLinear.int8(*quantize_int8(torch.randn(8, 48)), own_kernel=True)


@pytest.mark.parametrize("kind", ["int4", "int8"])
def test_a_quantized_model_through_the_own_kernels_gives_the_float32_models_tokens(
    library: None, torch_threads: None, kind: str
) -> None:
    pytest.importorskip("transformers")
    from batchline.models.generation.lean_llama import fuse_projections
    from batchline.models.generation.quantize import quantize_linears

    from .conftest import TINY_VOCAB, build_tiny_llama
    from .gen_helpers import dequantize_quant_linears

    if kind == "int8" and not ik.own_kernels(amx=True)[0]:
        pytest.skip("int8 takes the own kernel only where the CPU has AMX")
    model = build_tiny_llama().to(torch.bfloat16)
    fuse_projections(model)
    report = quantize_linears(model, kind, torch.bfloat16)
    layers = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(layers) == report.linears == 8
    assert all("own kernel" in repr(m) for m in layers)
    said = "int4 in groups of 32 with 8-bit steps" if kind == "int4" else kind
    assert f"8 linears as {said} through batchline's kernel on " in str(report)
    x = torch.randint(3, TINY_VOCAB, (2, 9))
    with torch.no_grad():
        ours = model(x).logits
        # the same weights, dequantized, as dense float32 linears in a float32 model
        dequantize_quant_linears(model)
        reference = model.float()(x).logits
    # bf16 activations round where float32 does not: the top two logits are 0.04 apart at some
    # positions of this random model
    assert (ours.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    assert _relative(ours, reference.double()) < 0.05
