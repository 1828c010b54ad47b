"""Dense bf16 linears in the kernel library's tiles (``dense_tiles.py``, ``csrc/dense_tiles.cpp``):
the layout, the choice per CPU kind, and the op against float64 references of the bf16 weight
(the op's tests skip where the CPU has no AVX512-BF16)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline._errors import InputError  # noqa: E402
from batchline.models.generation.dense_tiles import (  # noqa: E402
    TILE,
    TiledLinear,
    choose_dense,
    tile_linear_weights,
    tile_weight,
)

# flag sets of each kind (batchline._cpu.host_kind's names)
ZEN4 = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx512_bf16")
AMX = (*ZEN4, "amx_bf16", "amx_int8", "amx_tile")
ICE_LAKE = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni")
ZEN2 = ("avx2", "fma")
NEVER = 1 << 30  # an amx_rows no call reaches: the vdpbf16ps path


@pytest.fixture(scope="module")
def tiles_here(torch_threads: None) -> None:
    from batchline.models.generation.quant_kernel import own_kernels

    runs, why = own_kernels(dtype=torch.bfloat16)
    if not runs:
        pytest.skip(f"the own bf16 tiles do not run here: {why}")


def _reference(x: Any, linear: Any) -> Any:
    """``linear(x)`` in float64 from the bf16 rows and weight (the bias as stored)."""
    out = x.double() @ linear.weight.double().T
    return out if linear.bias is None else out + linear.bias.double()


def test_a_tile_holds_sixteen_columns_input_pairs_and_pads_the_last_with_zeros() -> None:
    weight = torch.randn(37, 6).to(torch.bfloat16)
    tiles = tile_weight(weight)
    assert tiles.shape == (3, 3, TILE)
    assert tiles.dtype == torch.int32
    halves = tiles.view(torch.int16).reshape(3, 3, TILE, 2)  # little-endian: the low half first
    for t in range(3):
        for p in range(3):
            for j in range(TILE):
                column = TILE * t + j
                pair = halves[t, p, j].view(torch.bfloat16)
                if column < 37:
                    assert torch.equal(pair, weight[column, 2 * p : 2 * p + 2])
                else:
                    assert torch.equal(pair, torch.zeros(2, dtype=torch.bfloat16))


def test_tiles_refuse_an_odd_input_count_and_float32() -> None:
    with pytest.raises(ValueError, match="even inputs"):
        tile_weight(torch.zeros(16, 5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="float32"):
        tile_weight(torch.zeros(16, 4))


@pytest.mark.parametrize(
    ("flags", "kernel", "said"),
    [
        (ZEN4, "tiles", "avx512-bf16 host: the own tiles took"),
        (AMX, "tiles", "amx host: the own tiles, on AMX from 2 rows"),
        (ICE_LAKE, "onednn", "AVX512-BF16, which this CPU lacks"),
        (ZEN2, "onednn", "AVX512-BF16, which this CPU lacks"),
    ],
)
def test_auto_takes_the_tiles_only_where_the_kind_measured_them(
    flags: tuple[str, ...], kernel: str, said: str
) -> None:
    chosen = choose_dense("auto", torch.bfloat16, flags)
    assert chosen.kernel == kernel
    assert said in chosen.reason


def test_a_float32_model_and_a_named_kernel() -> None:
    float32 = choose_dense("auto", torch.float32, ZEN4)
    assert float32.kernel == "onednn"
    assert float32.reason == "the tiles compute bf16, the model float32"
    assert choose_dense("onednn", torch.bfloat16, ZEN4).kernel == "onednn"
    assert choose_dense("tiles", torch.bfloat16, AMX).kernel == "tiles"  # asked: kept
    with pytest.raises(ValueError, match=r"tiles need AVX512-BF16.*use auto or onednn"):
        choose_dense("tiles", torch.bfloat16, ZEN2)
    with pytest.raises(ValueError, match="the tiles compute bf16, the model float32"):
        choose_dense("tiles", torch.float32, ZEN4)
    with pytest.raises(ValueError, match="dense_linears must be one of auto, onednn, tiles"):
        choose_dense("fast", torch.bfloat16, ZEN4)


def _op(tiled: Any, x: Any, amx_rows: int) -> Any:
    """The op on ``tiled``'s tiles, AMX from ``amx_rows`` rows on where the CPU has it."""
    return torch.ops.batchline.bf16_tiles_linear(
        x, tiled._tiles, tiled.out_features, tiled._bias, amx_rows
    )


@pytest.mark.parametrize("n", [16, 37, 100])
@pytest.mark.parametrize("k", [2, 30, 96, 256])
@pytest.mark.parametrize("bias", [False, True])
def test_the_op_equals_a_float64_product_of_the_bf16_weight(
    tiles_here: None, n: int, k: int, bias: bool
) -> None:
    torch.manual_seed(n * k + bias)
    linear = torch.nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    tiled = TiledLinear(linear)
    for rows in (1, 2, 3, 4, 5, 8, 9, 16, 17, 31, 32, 33, 40):
        x = torch.randn(rows, k).to(torch.bfloat16)
        # as a model calls it, then AMX for every row count and for none (inputs a multiple of
        # 32 on a CPU with AMX: else the vdpbf16ps path each time)
        for got in (tiled(x), _op(tiled, x, 1), _op(tiled, x, NEVER)):
            assert got.dtype == torch.bfloat16
            assert got.shape == (rows, n)
            # the sums are float32's (bf16 products are exact in it), the output rounded once
            torch.testing.assert_close(got.double(), _reference(x, linear), rtol=2**-8, atol=1e-5)


@pytest.mark.parametrize("amx_rows", [1, NEVER])
def test_a_row_gets_the_same_bits_alone_in_any_batch_and_at_any_thread_count(
    tiles_here: None, amx_rows: int
) -> None:
    # on each path alike (AMX's for every row count where the CPU has it, and vdpbf16ps's)
    torch.manual_seed(1)
    tiled = TiledLinear(torch.nn.Linear(512, 200).to(torch.bfloat16))
    x = torch.randn(37, 512).to(torch.bfloat16)
    batch = _op(tiled, x, amx_rows)
    for rows in ((0, 1), (7, 8), (8, 24), (16, 17), (18, 37), (5, 38)):
        assert torch.equal(_op(tiled, x[slice(*rows)], amx_rows), batch[slice(*rows)])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(_op(tiled, x, amx_rows), batch)
    finally:
        torch.set_num_threads(threads)


def test_inputs_of_any_leading_shape_and_views(tiles_here: None) -> None:
    torch.manual_seed(2)
    linear = torch.nn.Linear(64, 48).to(torch.bfloat16)
    tiled = TiledLinear(linear)
    x = torch.randn(2, 3, 128).to(torch.bfloat16)[..., ::2]  # not contiguous
    got = tiled(x)
    assert got.shape == (2, 3, 48)
    torch.testing.assert_close(got.double(), _reference(x, linear), rtol=2**-8, atol=1e-5)
    with pytest.raises(TypeError, match=r"bf16 rows, not torch\.float32"):
        tiled(x.float())
    assert tiled.weight_bytes == 3 * 32 * TILE * 4


def test_a_model_swaps_its_bf16_linears_and_keeps_the_rest(tiles_here: None) -> None:
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16).to(torch.bfloat16),
        torch.nn.Linear(16, 5).to(torch.bfloat16),
        torch.nn.Linear(5, 4).to(torch.bfloat16),  # odd inputs: left as it is
        torch.nn.Linear(4, 4),  # float32: left
    )
    assert tile_linear_weights(model) == 2
    kinds = [type(m) for m in model]
    assert kinds == [TiledLinear, TiledLinear, torch.nn.Linear, torch.nn.Linear]


def test_a_bf16_model_laid_out_in_tiles_computes_its_logits(tiles_here: None) -> None:
    from batchline.models.generation.engine_layout import lay_out_weights

    from .conftest import TINY_VOCAB, build_tiny_llama

    tiled = build_tiny_llama().to(torch.bfloat16)
    packed = build_tiny_llama().to(torch.bfloat16)
    linears = sum(isinstance(m, torch.nn.Linear) for m in packed.modules())
    layout = lay_out_weights(tiled, "float", torch.bfloat16, tiles=True)
    reference = lay_out_weights(packed, "float", torch.bfloat16)
    assert (layout.tiled, layout.packed, layout.fused) == (
        reference.packed,
        0,
        reference.fused,
    )
    assert reference.packed < linears  # the fused ones count once
    assert not any(isinstance(m, torch.nn.Linear) for m in tiled.modules())
    x = torch.randint(3, TINY_VOCAB, (2, 9))
    with torch.inference_mode():
        ours, theirs = tiled(x).logits.float(), packed(x).logits.float()
    # bf16 both ways, summed in other orders: within a few of bf16's steps of the logits' scale
    assert (ours - theirs).abs().max() <= 0.05 * theirs.abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9


def test_tiles_asked_for_a_float32_model_fail_before_loading() -> None:
    from batchline.models.config import Knobs
    from batchline.models.generation.engine_choices import dense_for

    with pytest.raises(InputError, match="dense_linears=tiles: the tiles compute bf16"):
        dense_for(Knobs(dense_linears="tiles"), torch.float32)


def test_a_load_says_which_kernel_its_dense_linears_took(
    tiles_here: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    folder = save_tiny_generator(tmp_path_factory.mktemp("tiles") / "tiny-llama")
    spec = parse_spec(f"{folder}/")
    said = {}
    for kernel in ("tiles", "onednn"):
        knobs = Knobs(dtype="bfloat16", weights="float", dense_linears=kernel)
        loaded = load_text_generator(spec, knobs)
        said[kernel] = (loaded.info.details["dense_linears"], loaded.weights)
        loaded.close()
    assert said == {
        "tiles": ("tiles", "float, dense linears in the own bf16 tiles"),
        "onednn": ("onednn", "float"),
    }


def test_without_the_kernel_library_auto_keeps_onednn_and_tiles_are_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from batchline.models.config import Knobs
    from batchline.models.generation import dense_tiles, quant_kernel
    from batchline.models.generation.engine_choices import dense_for

    monkeypatch.setattr(dense_tiles, "choose_dense", lambda asked, dtype: _tiles_asked(asked))
    monkeypatch.setattr(quant_kernel, "own_kernels", lambda **_: (False, "no C++ compiler"))
    fallback = dense_for(Knobs(dense_linears="auto"), torch.bfloat16)
    assert fallback.kernel == "onednn"
    assert fallback.reason == "auto: the own tiles do not run here: no C++ compiler"
    with pytest.raises(InputError, match="dense_linears=tiles cannot run here: no C"):
        dense_for(Knobs(dense_linears="tiles"), torch.bfloat16)


def _tiles_asked(asked: str) -> Any:
    """What ``choose_dense`` answers on a host whose kind takes the tiles."""
    from batchline.models.generation.dense_tiles import DenseChoice

    return DenseChoice("tiles", "asked" if asked == "tiles" else "avx512-bf16 host")
