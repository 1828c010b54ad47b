"""int4 with 8-bit steps, the layout ``--set weights=int4`` packs for the own kernels
(:func:`~batchline.models.generation.quant_codes.quantize_int4_steps`,
:func:`~batchline.models.generation.quant_kernel.pack_int4_steps`): what the quantizer keeps of a
weight, the layout's bytes, and every kernel that reads it (bf16 rows on vdpbf16ps and AMX,
float32 rows on AVX-512 and AVX2 vectors, float32 rows summed as int8, both dequantizings, the
embedding's row lookups) against the float64 product of the weight it stands for."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    quantize_int4,
    quantize_int4_steps,
)

NEVER = 10**6  # an amx_rows no call reaches: vdpbf16ps only


def _weight(n: int, k: int, seed: int) -> Any:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g)  # rows of unlike scales
    w[1] = 0.5  # a constant row: every group a range [0, 0.5]
    w[2, :32] = 0.0  # a group of zeros
    w[3, -32:] = -torch.rand(32, generator=g) - 1  # a group below 0
    return w


def _relative(out: Any, reference: Any) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


@pytest.fixture(scope="module")
def built() -> None:
    fast, why = ik.own_kernels(dtype=torch.float32)
    if not fast:
        pytest.skip(f"the own int4 kernels do not run here: {why}")


def _reference(w: Any) -> tuple[Any, Any, Any, Any]:
    """The header's first grid, before any refit, in float64 (``w`` a multiple of 16 rows): the
    units (as float64), steps, offsets and codes."""
    rows, k = w.shape
    v = w.double().view(rows, k // 32, 32)
    low, high = v.amin(2).clamp(max=0), v.amax(2).clamp(min=0)
    need = (high - low) / 15
    top = (need.view(rows // 16, 16, -1).amax(1) / 255).float()
    units = top.bfloat16()
    units = torch.where(
        units.float() < top, (units.view(torch.int16) + 1).view(torch.bfloat16), units
    )
    unit = units.double().repeat_interleave(16, dim=0)
    steps = torch.ceil(need / unit).clamp(0, 255)
    scale = unit * steps
    safe = torch.where(scale > 0, scale, 1.0)
    offsets = torch.round(8 * (15 - (high + low) / safe)).clamp(0, 255)
    offsets = torch.where(scale > 0, offsets, 128.0)  # a group of zeros: codes 8
    codes = torch.round(v / safe[..., None] + offsets[..., None] / 16).clamp(0, 15)
    return units, steps, offsets, codes.view(rows, k)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (16, 32), (7, 64)])
def test_each_weight_is_within_half_a_step_of_its_value_and_the_scales_are_exact(
    built: None, n: int, k: int
) -> None:
    w = _weight(n, k, seed=n + k)
    q = quantize_int4_steps(w, refits=0)
    tiles, groups = -(-n // 16), k // 32
    assert q.codes.shape == (n, k)
    assert q.codes.dtype == q.steps.dtype == q.offsets.dtype == torch.uint8
    assert q.steps.shape == q.offsets.shape == (n, groups)
    assert q.units.shape == (tiles, groups)
    assert q.units.dtype == torch.bfloat16
    assert int(q.codes.max()) <= 15
    codes = q.as_codes()
    # the scale is the unit (a bf16 value) times an integer; the zero 1/16ths of the scale
    units = q.units.double().repeat_interleave(16, dim=0)[:n]
    assert torch.equal(codes.scales.double(), units * q.steps.double())
    zeros = codes.scales.double() * (8 - q.offsets.double() / 16)
    assert torch.equal(codes.zeros.double(), zeros)
    error = (codes.dequantize() - w.double()).abs().view(n, groups, 32)
    half_step = codes.scales.double()[..., None] / 2
    assert (error <= half_step * (1 + 1e-5) + 1e-12).all()
    assert codes.dequantize()[2, :32].eq(0).all()  # a group of zeros stays zeros
    assert int(q.steps[2, 0]) == 0
    # each tile's largest range takes most of the 255 steps: no range left coarser than it needs
    assert int(q.steps[:16].max()) >= 250


def test_the_first_grid_is_the_headers_rule(built: None) -> None:
    w = _weight(48, 128, seed=9)
    q = quantize_int4_steps(w, refits=0)
    units, steps, offsets, codes = _reference(w)
    assert torch.equal(q.units, units.bfloat16())
    assert torch.equal(q.steps.double(), steps)
    assert torch.equal(q.offsets.double(), offsets)
    # float32 against float64 arithmetic: a value on a rounding boundary may go either way
    assert (q.codes.double() != codes).double().mean() < 1e-3


@pytest.mark.parametrize("seed", [0, 1])
def test_refits_only_lower_each_groups_error(built: None, seed: int) -> None:
    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(seed))
    errors = []
    for refits in (0, 1, 2):
        q = quantize_int4_steps(w, refits=refits)
        assert torch.equal(q.units, quantize_int4_steps(w, refits=0).units)
        errors.append((q.as_codes().dequantize() - w.double()).square().view(64, 8, 32).sum(2))
    assert (errors[1] <= errors[0] * (1 + 1e-5)).all()
    assert (errors[2] <= errors[1] * (1 + 1e-5)).all()
    assert errors[1].sum() < errors[0].sum()


def test_weights_on_16_levels_are_found_again_by_the_refit(built: None) -> None:
    """A group quantized before (a Q4_1 block: 16 levels d * q + m) whose range is a fraction
    of its tile's: the first grid's scale is whole steps of the tile's unit above d, the refit
    comes back to d's nearest."""
    g = torch.Generator().manual_seed(4)
    d = torch.rand(16, 4, 1, generator=g) * 0.01 + 0.001
    d[0] = 0.05  # one row's range sets the unit; the others' are 5-50x narrower
    q = torch.randint(0, 16, (16, 4, 32), generator=g).float()
    q[..., 0], q[..., 1] = 0, 15  # each block uses its whole range
    w = (d * q - 7.5 * d).reshape(16, 128)
    before = (quantize_int4_steps(w, 0).as_codes().dequantize() - w.double()).square().sum()
    after = (quantize_int4_steps(w, 1).as_codes().dequantize() - w.double()).square().sum()
    assert float(after) < 0.5 * float(before)


def test_its_error_is_below_that_of_float_scales_and_zeros(built: None) -> None:
    """4.53 bits a weight where float scales and zeros take more: on a Gaussian weight the
    refitted steps leave less squared error than int4 with float32 scales and zeros from each
    group's min and max; without the refit, within 2 % of it."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(1))
    exact = (quantize_int4(w, 32).dequantize() - w.double()).square().sum()
    first = (quantize_int4_steps(w, 0).as_codes().dequantize() - w.double()).square().sum()
    refit = (quantize_int4_steps(w).as_codes().dequantize() - w.double()).square().sum()
    assert float(first / exact) < 1.02
    assert float(refit / exact) < 0.95


def test_a_non_finite_weight_leaves_its_tiles_other_rows_as_they_were(built: None) -> None:
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(7))
    clean = quantize_int4_steps(w)
    w[0, 3], w[5, 40] = float("nan"), float("inf")
    q = quantize_int4_steps(w)
    assert torch.equal(q.units, clean.units)
    rows = [r for r in range(32) if r not in (0, 5)]
    assert torch.equal(q.codes[rows], clean.codes[rows])
    assert torch.equal(q.steps[rows], clean.steps[rows])


def test_bad_weights_say_what_is_wrong(built: None) -> None:
    with pytest.raises(ValueError, match="does not divide 40"):
        quantize_int4_steps(torch.zeros(16, 40))
    with pytest.raises(RuntimeError, match="refits must be in"):
        quantize_int4_steps(torch.zeros(16, 32), refits=9)


@pytest.mark.parametrize(("n", "k"), [(40, 96), (16, 32)])
def test_the_layout_holds_the_codes_steps_offsets_and_units(built: None, n: int, k: int) -> None:
    q = quantize_int4_steps(_weight(n, k, seed=3))
    packed = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
    assert packed.shape == (-(-n // 16), k // 32, ik.BLOCK_STEPS)
    assert ik.BLOCK_STEPS == 290  # 4.53 bits a weight
    codes, scales, zeros = ik.unpack_int4(packed, n)
    want = q.as_codes()
    assert torch.equal(codes, q.codes)
    assert torch.equal(scales, want.scales)
    assert torch.equal(zeros, want.zeros)
    # block (tile 0, group 0): its 16 steps, 16 offsets and the unit follow the 256 code bytes
    block = packed[0, 0]
    assert torch.equal(block[256:272], q.steps[:16, 0])
    assert torch.equal(block[272:288], q.offsets[:16, 0])
    assert torch.equal(block[288:290].contiguous().view(torch.bfloat16), q.units[0, :1])
    with pytest.raises(ValueError, match="groups of 32"):
        ik.pack_int4_steps(q.codes, q.steps[:1], q.offsets, q.units)


def test_an_embedding_row_looked_up_is_the_dequantized_weights(built: None) -> None:
    q = quantize_int4_steps(_weight(40, 96, seed=5))
    ids = torch.tensor([0, 39, 17, 17, 3])
    got = ik.packed_rows([ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)], ids)
    assert got.dtype == torch.float32
    assert torch.equal(got.double(), q.as_codes().dequantize()[ids])


def test_the_library_dequantizes_each_weight_exactly_in_float32(built: None) -> None:
    n, k = 40, 2048
    q = quantize_int4_steps(_weight(n, k, seed=6))
    exact = q.as_codes().dequantize()
    packed = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
    assert torch.equal(ik.int4_dequantize(packed, n, torch.float32).double(), exact)
    if ik.own_kernels()[0]:  # bf16: one rounding of the float32 value
        assert torch.equal(ik.int4_dequantize(packed, n), exact.float().bfloat16())


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
@pytest.mark.parametrize("width", [512, 256])  # 512 runs as 256 where AVX-512 is not built
def test_float32_rows_are_the_float64_product(
    built: None, torch_threads: None, rows: int, width: int
) -> None:
    for n, k in ((40, 96), (112, 224)):
        q = quantize_int4_steps(_weight(n, k, seed=rows + n))
        packed = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        bias = torch.randn(n)
        reference = x.double() @ q.as_codes().dequantize().T + bias.double()
        out = torch.ops.batchline.int4_linear_f32(x, packed, n, bias, width)
        assert _relative(out, reference) < 1e-5, (n, k)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17])
@pytest.mark.parametrize("width", [512, 256])  # 512 runs as 256 where VNNI is not built
def test_int8_rows_are_the_float64_product_of_the_quantized_rows(
    a8_library: None, torch_threads: None, rows: int, width: int
) -> None:
    for n, k in ((40, 96), (112, 224)):
        q = quantize_int4_steps(_weight(n, k, seed=rows * n))
        packed = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
        codes, scales = torch.ops.batchline.int8_activations(x)
        rounded = (codes.double().view(rows, -1, 32) * scales.double()[..., None]).view(rows, k)
        reference = rounded @ q.as_codes().dequantize().T
        out = torch.ops.batchline.int4_linear_a8(x, packed, n, None, width)
        assert _relative(out, reference) < 1e-5, (n, k)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 17])
@pytest.mark.parametrize("amx_rows", [1, NEVER])  # AMX tiles (where the CPU has them), vdpbf16ps
def test_bf16_rows_are_the_float64_product_rounded_once(
    torch_threads: None, rows: int, amx_rows: int
) -> None:
    if not ik.own_kernels()[0]:
        pytest.skip("the bf16 int4 kernel needs AVX512-BF16")
    for n, k in ((40, 96), (112, 224)):
        q = quantize_int4_steps(_weight(n, k, seed=rows + k))
        packed = ik.pack_int4_steps(q.codes, q.steps, q.offsets, q.units)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).bfloat16()
        reference = x.double() @ q.as_codes().dequantize().T
        out = ik.int4_linear(x, packed, n, amx_rows=amx_rows)
        assert out.dtype == torch.bfloat16
        # fp32 sums of exact products, rounded to bf16 once: within a bf16 step of the largest
        assert _relative(out, reference) < 1e-2, (n, k)
