"""The int8-rows kernel's one-row path that reads several tiles at once (``streams``,
``csrc/quant_gemm_a8.cpp``'s ``row_by_tiles_a8``): the bits of one tile at a time for every
layout, part tile, bias and thread count; which hosts and widths take it (``a8_streams``); the
activations' buffers (a call's own tensors for large inputs, the thread's buffers for small
ones) giving the same bits; and a layer's step path (``QuantLinear.step_forward``) giving what
``forward`` gives, whatever the input."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline._cpu import A8_VNNI_FLAGS, CpuModel  # noqa: E402
from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation import quant_streams as qs  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    quantize_int4,
    quantize_int4_steps,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import (  # noqa: E402
    DENSE_ROWS,
    QuantLinear,
    use_int8_activations,
)

ZEN4 = frozenset(["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16"])
AMX = ZEN4 | {"amx_bf16", "amx_int8"}
ICE_LAKE = ZEN4 - {"avx512_bf16"}
ZEN2 = frozenset(["avx2", "fma"])


def _layouts(n: int, k: int, seed: int) -> dict[str, Any]:
    """One random weight in each int4 layout the kernel reads."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    plain = quantize_int4(w, 32)
    steps = quantize_int4_steps(w)
    return {
        "bf16 scales": ik.pack_int4(plain.codes, plain.scales, plain.zeros, torch.bfloat16),
        "float32 scales": ik.pack_int4(plain.codes, plain.scales, plain.zeros, torch.float32),
        "8-bit steps": ik.pack_int4_steps(steps.codes, steps.steps, steps.offsets, steps.units),
    }


@pytest.fixture
def vnni(a8_library: None) -> None:
    if not set(A8_VNNI_FLAGS) <= ik.host_flags():
        pytest.skip("the 512-bit path is not built here (no AVX512-VNNI)")


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_read_several_tiles_at_once_has_the_bits_of_one_tile_at_a_time(
    vnni: None, threads: int
) -> None:
    a8 = torch.ops.batchline.int4_linear_a8
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        # 40: 3 tiles, the last a part one; 300: 19 tiles (a share's tiles not a multiple of
        # 8); 2,048 inputs: 4 shares of 8 tiles and a remainder at 2 threads
        for n, k in ((40, 96), (300, 256), (500, 2048), (16, 32)):
            bias = torch.randn(n, generator=g)
            x = torch.randn(1, k, generator=g)
            for name, packed in _layouts(n, k, seed=n + k).items():
                for b in (None, bias):
                    one = a8(x, packed, n, b, 512, 1)
                    for streams in (2, 4, 8):
                        assert torch.equal(a8(x, packed, n, b, 512, streams), one), (
                            n,
                            k,
                            name,
                            streams,
                            b is None,
                        )
    finally:
        torch.set_num_threads(before)


def test_streams_other_than_1_2_4_8_are_refused(a8_library: None) -> None:
    packed = _layouts(32, 64, seed=1)["8-bit steps"]
    with pytest.raises(RuntimeError, match="streams must be 1, 2, 4 or 8, not 3"):
        torch.ops.batchline.int4_linear_a8(torch.randn(1, 64), packed, 32, None, 512, 3)


def test_several_tiles_are_read_where_they_were_measured_to_pay() -> None:
    """int4: long inputs on Zen 4, the longest on Zen 5 (at 2,048 and 3,072 inputs every count
    above one was slower there), every layer on an AMX host and on Ice Lake; the int8 layout:
    every layer on Zen 5, AMX and Ice Lake (slower alone on Zen 4); one elsewhere."""
    amd4, amd5 = CpuModel("AuthenticAMD", 25), CpuModel("AuthenticAMD", 26)
    assert qs.a8_streams(qs.A8_STREAM_INPUTS, ZEN4, amd4) == qs.A8_STREAMS > 1
    assert qs.a8_streams(8192, ZEN4, amd4) == qs.A8_STREAMS
    assert qs.a8_streams(qs.A8_STREAM_INPUTS - 32, ZEN4, amd4) == 1  # 1.7B's 2,048, 360M's 2,560
    assert qs.a8_streams(qs.A8_STREAM_INPUTS_ZEN5, ZEN4, amd5) == qs.A8_STREAMS_ZEN5 > 1
    assert qs.a8_streams(11008, ZEN4, amd5) == qs.A8_STREAMS_ZEN5
    assert qs.a8_streams(qs.A8_STREAM_INPUTS_ZEN5 - 32, ZEN4, amd5) == 1
    assert qs.a8_streams(3072, ZEN4, amd5) == 1  # a 3B's q/k/v and gate/up: slower at 4
    assert qs.a8_streams(960, ZEN4, amd5, int8_layout=True) == qs.INT8G_STREAMS > 1
    assert qs.a8_streams(8192, ZEN4, amd4, int8_layout=True) == 1
    intel = CpuModel("GenuineIntel", 6)
    for model in (intel, None):  # the kind's flags say AMX, whatever the model
        for inputs in (960, 2048, 8192):
            assert qs.a8_streams(inputs, AMX, model) == qs.A8_STREAMS_AMX > 1
            assert qs.a8_streams(inputs, AMX, model, int8_layout=True) == qs.INT8G_STREAMS
        for inputs in (960, 2048, 8192):  # Ice Lake: both layouts, every layer
            assert qs.a8_streams(inputs, ICE_LAKE, model) == qs.A8_STREAMS_VNNI > 1
            assert qs.a8_streams(inputs, ICE_LAKE, model, int8_layout=True) == qs.A8_STREAMS_VNNI
        # no 512-bit path to read them: AVX2 only, or VNNI in 256-bit vectors (AVX-VNNI)
        for flags in (ZEN2, ZEN2 | {"avx_vnni"}):
            assert qs.a8_streams(8192, flags, model) == 1
            assert qs.a8_streams(8192, flags, model, int8_layout=True) == 1


@pytest.mark.parametrize("threads", [1, 2])
def test_a_row_of_the_int8_layout_read_several_tiles_at_once_has_the_narrow_path_s_bits(
    vnni: None, threads: int
) -> None:
    """One row on the 512-bit path, 1 to 8 tiles at a time, against the 256-bit path's one tile
    at a time (the path it takes without streams): part tiles, shares of tiles not a multiple of
    the streams, codes of -128, a bias or none."""
    op = torch.ops.batchline.int8g_linear_a8
    g = torch.Generator().manual_seed(13)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for n, k in ((40, 96), (300, 256), (500, 2048), (16, 32)):
            codes, scales = quantize_int8_groups(torch.randn(n, k, generator=g), 32)
            codes[0, :32] = -128
            packed = ik.pack_int8g(codes, scales)
            x = torch.randn(1, k, generator=g)
            bias = torch.randn(n, generator=g)
            for b in (None, bias):
                narrow = op(x, packed, n, b, 256, 1)
                for streams in (1, 2, 4, 8):
                    assert torch.equal(op(x, packed, n, b, 512, streams), narrow), (n, k, streams)
                assert torch.equal(ik.int8g_linear(x, packed, n, b, streams=4), narrow)
    finally:
        torch.set_num_threads(before)


def test_the_int8_layout_refuses_streams_other_than_1_2_4_8(a8_library: None) -> None:
    codes, scales = quantize_int8_groups(torch.randn(32, 64), 32)
    with pytest.raises(RuntimeError, match="streams must be 1, 2, 4 or 8, not 5"):
        torch.ops.batchline.int8g_linear_a8(
            torch.randn(1, 64), ik.pack_int8g(codes, scales), 32, None, 512, 5
        )


def test_the_int8_layout_takes_the_wide_path_for_one_row_only_with_streams() -> None:
    assert ik.int8g_width(1) == 256
    assert ik.int8g_width(1, 4) == ik.A8_WIDTH
    assert ik.int8g_width(2, 4) == 256  # streams are a one-row path
    assert ik.int8g_width(ik.INT8G_WIDE_ROWS) == ik.A8_WIDTH


def test_large_inputs_quantized_into_their_own_tensors_give_each_row_s_bits(
    a8_library: None,
) -> None:
    """40 rows of 2,048 inputs (81,920: over the thread's buffers) against each row alone (in
    them); rows summed together or alone give the same bits."""
    n, k = 72, 2048
    packed = _layouts(n, k, seed=3)["8-bit steps"]
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(4))
    bias = torch.randn(n)
    together = ik.int4_linear(x, packed, n, bias, int8_rows=True)
    small = torch.randn(3, 64)  # the buffers written by another shape between the calls
    small_packed = _layouts(16, 64, seed=5)["bf16 scales"]
    for m in range(40):
        ik.int4_linear(small, small_packed, 16, int8_rows=True)
        alone = ik.int4_linear(x[m : m + 1], packed, n, bias, int8_rows=True)
        assert torch.equal(alone[0], together[m]), m


def _marked(kind: str, n: int, k: int, bias: bool) -> QuantLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k))
    b = torch.randn(n) if bias else None
    if kind == "int4":
        s = quantize_int4_steps(w)
        packed = [ik.pack_int4_steps(s.codes, s.steps, s.offsets, s.units)]
    else:
        packed = [ik.pack_int8g(*quantize_int8_groups(w, 32))]
    layer = QuantLinear.own_int4(packed, n, k, kind=kind, bias=b)
    assert use_int8_activations(torch.nn.Sequential(layer)) == 1
    return layer


@pytest.mark.parametrize("kind", ["int4", "int8g"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("streams", [1, 4])
def test_a_layer_s_step_path_gives_what_forward_gives_for_any_input(
    a8_library: None, kind: str, bias: bool, streams: int
) -> None:
    layer = _marked(kind, 40, 128, bias)
    layer.streams = streams  # whatever this host takes: a row several tiles at a time too
    step = layer.step_forward()
    assert step != layer.forward  # the op called straight
    limit = DENSE_ROWS["own32a8" if kind == "int4" else "own32a8q"]
    g = torch.Generator().manual_seed(8)
    inputs = [
        torch.randn(1, 128, generator=g),  # a decode step's row
        torch.randn(5, 128, generator=g),
        torch.randn(2, 3, 128, generator=g),  # 3-D: through forward
        torch.randn(limit, 128, generator=g),  # dense from here on: through forward
        torch.randn(8, 256, generator=g)[:, ::2],  # not contiguous
        torch.randn(2, 128, generator=g).bfloat16(),  # another dtype: through forward
    ]
    with torch.inference_mode():
        for x in inputs:
            assert torch.equal(step(x), layer(x)), (tuple(x.shape), x.dtype)


def test_a_layer_without_int8_rows_steps_through_forward(a8_library: None) -> None:
    w = torch.randn(32, 64)
    planes = [quantize_int4(w, 32)]
    layer = QuantLinear.int4(planes, dtype=torch.float32)
    assert not layer.int8_rows
    assert layer.step_forward() == layer.forward
