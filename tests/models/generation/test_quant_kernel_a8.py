"""batchline's int4 linear with int8 activations (``csrc/quant_gemm_a8.cpp``): float32 rows
quantized per group of 32 as the header says, bit for bit against the rule written in torch;
the product against the float64 product of the quantized rows and the dequantized weight for
1-17 rows and 300 (past the per-thread buffers) on both layouts; the same bits at any thread
count; its errors; the layers that take it; and which hosts and models take it
(``choose_activations``)."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")

from batchline._cpu import A8_VNNI_FLAGS as A8_VNNI  # noqa: E402
from batchline.models.generation import quant_kernel as ik  # noqa: E402
from batchline.models.generation.quant_codes import (  # noqa: E402
    Int4Codes,
    quantize_int4,
    quantize_int4_steps,
    quantize_int8,
    quantize_int8_groups,
)
from batchline.models.generation.quant_linear import QuantLinear, use_int8_activations  # noqa: E402
from batchline.models.generation.torch_dtype import choose_activations  # noqa: E402

from .gen_helpers import int_planes  # noqa: E402

# float32 sums of exact integer sums: a few float32 steps of the largest output
TOLERANCE = 1e-5
SCALES = pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])


def _codes(n: int, k: int, seed: int, scale_dtype: Any) -> Int4Codes:
    g = torch.Generator().manual_seed(seed)
    q = quantize_int4(torch.randn(n, k, generator=g), 32)
    return Int4Codes(q.codes, q.scales.to(scale_dtype).float(), q.zeros.to(scale_dtype).float(), 32)


def _quantized_rows(x: Any) -> tuple[Any, Any]:
    """The header's rule in torch: per group of 32, scale max|x| / 127 and codes
    round-half-even(x * (127 / max|x|)), float32 throughout; a group of zeros: 0 and 0."""
    groups = x.view(x.shape[0], -1, 32)
    amax = groups.abs().amax(dim=2)
    # a tensor divided by a tensor: torch's ``127 / amax`` multiplies by a reciprocal instead
    inverse = torch.where(amax > 0, torch.full_like(amax, 127) / amax, torch.zeros_like(amax))
    codes = torch.round(groups * inverse[..., None]).to(torch.int8).view_as(x)
    return codes, amax / 127


def _relative(out: Any, reference: Any) -> float:
    return float((out.double() - reference).abs().max() / reference.abs().max())


def test_rows_are_quantized_per_group_of_32_as_the_header_says(a8_library: None) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 128, generator=g) * torch.tensor([1e-3, 1.0, 30.0, 1e4])[
        None
    ].repeat_interleave(32, 1)
    x[2, 32:64] = 0.0  # a group of zeros
    x[3, :32] = torch.arange(32) - 15.5  # ties: x * (127 / 16) lands on halves at 8 of them
    x[4, 64:96] = -2.5  # a constant group: every code -127
    codes, scales = torch.ops.batchline.int8_activations(x)
    want_codes, want_scales = _quantized_rows(x)
    assert codes.dtype == torch.int8
    assert scales.dtype == torch.float32
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)
    assert codes[2, 32:64].eq(0).all()
    assert scales[2, 1] == 0
    assert codes[4, 64:96].eq(-127).all()
    assert int(codes.abs().max()) == 127


@SCALES
@pytest.mark.parametrize("width", [512, 256])  # 512 runs as 256 where VNNI is not built
@pytest.mark.parametrize("rows", [*range(1, 18), 300])  # 300: past the per-thread buffers
def test_the_product_is_the_float64_one_of_the_quantized_rows(
    a8_library: None,
    torch_threads: None,
    rows: int,
    scale_dtype: Any,
    width: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(ik, "A8_WIDTH", width)
    for n, k in ((40, 96), (112, 224), (16, 32)):  # 40: a part tile; 96, 224: odd groups
        q = _codes(n, k, seed=rows * n, scale_dtype=scale_dtype)
        packed = ik.pack_int4(q.codes, q.scales, q.zeros, scale_dtype)
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
        codes, scales = _quantized_rows(x)
        rounded = (codes.double().view(rows, -1, 32) * scales.double()[..., None]).view(rows, k)
        product = rounded @ q.dequantize().T
        bias = torch.randn(n)
        for b in (None, bias):
            out = ik.int4_linear(x, packed, n, b, int8_rows=True)
            assert out.dtype == torch.float32
            assert out.shape == (rows, n)
            reference = product if b is None else product + b.double()
            assert _relative(out, reference) < TOLERANCE, (n, k, b is None)
        # against the rows as they are: the quantizing's error, a few parts in a thousand
        exact = x.double() @ q.dequantize().T
        assert 1e-5 < _relative(ik.int4_linear(x, packed, n, int8_rows=True), exact) < 3e-2


def _packed_each_way(n: int, k: int, seed: int) -> list[tuple[Any, Any]]:
    """One weight per layout the int8-rows ops read, with its op: int4 with bf16 and float32
    scales and zeros and with 8-bit steps, and int8 in groups of 32 in the int8 layout."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    made = []
    for scale_dtype in (torch.bfloat16, torch.float32):
        q = _codes(n, k, seed=seed, scale_dtype=scale_dtype)
        made.append(
            (
                torch.ops.batchline.int4_linear_a8,
                ik.pack_int4(q.codes, q.scales, q.zeros, scale_dtype),
            )
        )
    steps = quantize_int4_steps(w)
    made.append(
        (
            torch.ops.batchline.int4_linear_a8,
            ik.pack_int4_steps(steps.codes, steps.steps, steps.offsets, steps.units),
        )
    )
    made.append((torch.ops.batchline.int8g_linear_a8, ik.pack_int8g(*quantize_int8_groups(w, 32))))
    return made


def test_the_vnni_and_avx2_paths_give_the_same_bits(a8_library: None) -> None:
    """The same integer sums and the same float32 operations per column: where both are built
    (AVX512-VNNI), any row count gives the same output on every layout, the VNNI path reading
    the rows in blocks of 8 and the AVX2 path row by row; 300 rows are more than the calling
    thread's buffers hold (a prefill chunk's rows, quantized into tensors of their own), their
    last block a part one."""
    if not set(A8_VNNI) <= ik.host_flags():
        pytest.skip("only the AVX2 path is built here (no AVX512-VNNI)")
    g = torch.Generator().manual_seed(5)
    for op, packed in _packed_each_way(72, 256, seed=4):  # 72: a part tile
        bias = torch.randn(72, generator=g)
        for rows in (1, 2, 3, 4, 5, 8, 9, 17, 300):
            x = torch.randn(rows, 256, generator=g)
            assert torch.equal(op(x, packed, 72, bias, 512), op(x, packed, 72, bias, 256)), rows


def test_two_threads_give_the_bits_one_thread_gives(a8_library: None) -> None:
    n, k = 200, 1024  # 13 tiles, the last a part one; rows split for the quantizing too
    g = torch.Generator().manual_seed(9)
    q = quantize_int4(torch.randn(n, k, generator=g), 32)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros, torch.float32)
    bias = torch.randn(n, generator=g)
    xs = [torch.randn(rows, k, generator=g) for rows in (1, 5, 16, 40)]
    before = torch.get_num_threads()
    outs: dict[int, list[Any]] = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            outs[threads] = [ik.int4_linear(x, packed, n, bias, int8_rows=True) for x in xs]
    finally:
        torch.set_num_threads(before)
    for one, two in zip(outs[1], outs[2], strict=True):
        assert torch.equal(one, two)


def test_no_rows_give_an_empty_product_and_bad_inputs_say_what_is_wrong(a8_library: None) -> None:
    q = _codes(32, 64, seed=1, scale_dtype=torch.float32)
    packed = ik.pack_int4(q.codes, q.scales, q.zeros, torch.float32)
    a8 = torch.ops.batchline.int4_linear_a8
    assert a8(torch.empty(0, 64), packed, 32).shape == (0, 32)
    with pytest.raises(RuntimeError, match=r"x must be a contiguous .* float32 or bfloat16"):
        a8(torch.randn(2, 64).half(), packed, 32)
    with pytest.raises(RuntimeError, match="K = 40 is not a multiple of 32"):
        a8(torch.randn(2, 40), packed, 32)
    with pytest.raises(RuntimeError, match="x has 96 inputs, the weight 64"):
        a8(torch.randn(2, 96), packed, 32)
    with pytest.raises(RuntimeError, match="n = 40 does not fit 2 tiles"):
        a8(torch.randn(2, 64), packed, 40)
    with pytest.raises(RuntimeError, match="bias must be"):
        a8(torch.randn(2, 64), packed, 32, torch.randn(32).double())
    with pytest.raises(RuntimeError, match="packed must be"):
        a8(torch.randn(2, 64), packed.view(2, -1), 32)
    with pytest.raises(RuntimeError, match="width must be 256 or 512, not 128"):
        a8(torch.randn(2, 64), packed, 32, None, 128)


def test_the_load_log_names_int8_rows_where_the_load_sums_them(
    a8_library: None, torch_threads: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the load sums rows as int8, the report says so, not the float path the rows no
    longer take (it said "in AVX-512 vectors, float32 activations" beside "int8 activations"):
    every row in float32, and in bf16 where no AMX tiles take a step's many rows."""
    from batchline.models.generation.lean_llama import fuse_projections
    from batchline.models.generation.quantize import _kernel_path, quantize_linears

    from .conftest import build_tiny_llama

    every = "batchline's kernel, every row summed as int8"
    monkeypatch.setattr(ik, "A8_BF16_ROWS", ik.EVERY_ROW)  # a host without AMX
    assert _kernel_path("int4", torch.float32, int8_rows=True) == every
    assert _kernel_path("int4", torch.bfloat16, int8_rows=True) == every
    model = build_tiny_llama()
    fuse_projections(model)
    report = quantize_linears(model, "int4", torch.float32, int8_rows=True)
    assert f"through {every} (" in str(report)
    plain = quantize_linears(build_tiny_llama(), "int4", torch.float32)
    assert "float32 activations" in str(plain)
    assert every not in str(plain)
    monkeypatch.setattr(ik, "A8_BF16_ROWS", ik.A8_BF16_ROWS_AMX)  # an AMX host
    assert _kernel_path("int4", torch.float32, int8_rows=True) == every
    assert _kernel_path("int4", torch.bfloat16, int8_rows=True) == (
        f"batchline's kernel, fewer than {ik.A8_BF16_ROWS_AMX} rows summed as int8 and more on "
        "AMX tiles"
    )


@pytest.mark.parametrize("kind", ["int4", "int8g"])
def test_a_layer_marked_takes_int8_rows_and_a_bf16_row_does_not(
    a8_library: None, torch_threads: None, kind: str
) -> None:
    n, k = 48, 128
    w = torch.randn(n, k)
    planes = int_planes(w, kind)
    bias = torch.randn(n)
    layer = QuantLinear.int4(planes, bias=bias, dtype=torch.float32)
    dense = QuantLinear.int8(*quantize_int8(w), bias=None, dtype=torch.float32)  # torch's
    model = torch.nn.Sequential(layer, torch.nn.Linear(n, n), dense)
    assert use_int8_activations(model) == 1  # the own kernel's layer only
    assert layer.int8_rows
    assert not dense.int8_rows
    assert "int8 activations" in repr(layer)
    x = torch.randn(3, k)
    codes, scales = _quantized_rows(x)
    rounded = (codes.double().view(3, -1, 32) * scales.double()[..., None]).view(3, k)
    weight = layer.dequantized(torch.float64)
    assert _relative(layer(x), rounded @ weight.T + bias.double()) < TOLERANCE
    layer.int8_rows = False
    assert _relative(layer(x), x.double() @ weight.T + bias.double()) < TOLERANCE


@pytest.mark.parametrize("kind", ["int4", "int8g"])
def test_a_bf16_layer_marked_sums_its_few_rows_as_int8_and_more_as_bf16(
    a8_library: None, torch_threads: None, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not ik.own_kernels(dtype=torch.bfloat16)[0]:
        pytest.skip("the own kernel takes no bf16 rows here (no AVX512-BF16)")
    # the AMX hosts' bound, whatever this host's is (every row where it has no AMX)
    monkeypatch.setattr(ik, "A8_BF16_ROWS", ik.A8_BF16_ROWS_AMX)
    n, k = 48, 128
    w = torch.randn(n, k)
    bias = torch.randn(n)
    layer = QuantLinear.int4(int_planes(w, kind), bias=bias, dtype=torch.bfloat16)
    plain = QuantLinear.int4(int_planes(w, kind), bias=bias, dtype=torch.bfloat16)
    assert use_int8_activations(torch.nn.Sequential(layer)) == 1
    weight = layer.dequantized(torch.float64)
    for rows in (1, ik.A8_BF16_ROWS - 1, ik.A8_BF16_ROWS, 16):
        x = torch.randn(rows, k).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16
        if rows >= ik.A8_BF16_ROWS:  # bf16 rows, as an unmarked layer sums them
            assert torch.equal(out, plain(x))
            continue
        # the float32 rows' product, each plane's rounded to bf16 once, its bias in the first
        want = None
        for i, packed in enumerate(layer._own):
            part = torch.ops.batchline.int4_linear_a8(
                x.float(), packed, n, bias.float() if i == 0 else None
            ).bfloat16()
            want = part if want is None else want + part
        assert torch.equal(out, want)
        codes, scales = _quantized_rows(x.float())
        rounded = (codes.double().view(rows, -1, 32) * scales.double()[..., None]).view(rows, k)
        assert _relative(out, rounded @ weight.T + bias.double()) < 1e-2  # bf16's rounding


NO_BF16_VNNI = frozenset(["avx2", "fma", "avx512f", "avx512bw", "avx512_vnni"])  # Ice Lake
AVX2_ONLY = frozenset(["avx2", "fma"])
NO_AVX2 = frozenset(["sse4_2", "avx"])
AVX_VNNI = AVX2_ONLY | {"avx_vnni"}  # 256-bit VNNI only: the kernel's 512-bit path is not there
AVX512_BF16 = NO_BF16_VNNI | {"avx512_bf16"}
AMX = AVX512_BF16 | {"amx_bf16", "amx_int8"}


def test_which_models_and_hosts_take_int8_rows() -> None:
    from batchline.models.generation import torch_dtype

    def choose(asked: str, weights: str, dtype: str, flags: Any) -> tuple[str, str]:
        got = choose_activations(asked, weights=weights, dtype=dtype, flags=flags)
        return got.activations, got.reason

    for weights in ("int8", "int4", "gguf"):
        assert choose("int8", weights, "float32", NO_BF16_VNNI) == ("int8", "asked for")
        assert choose("float", weights, "float32", NO_BF16_VNNI) == ("float", "asked for")
        # where float32 is the dtype for speed (no native bf16), measured
        auto = ("int8", f"auto: {torch_dtype.A8_MEASURED}")
        assert choose("auto", weights, "float32", NO_BF16_VNNI) == auto
        # float32 named by the user keeps float32 arithmetic; int8 still when asked for
        named = choose_activations(
            "auto", weights=weights, dtype="float32", dtype_asked=True, flags=NO_BF16_VNNI
        )
        assert (named.activations, named.reason) == (
            "float",
            f"auto: {torch_dtype.A8_FLOAT32_ASKED}",
        )
        also = choose_activations(
            "int8", weights=weights, dtype="float32", dtype_asked=True, flags=NO_BF16_VNNI
        )
        assert also.activations == "int8"
        # float32 on AMX (where int weights compute in bf16) comes from the user: kept as asked
        kept = ("float", f"auto: {torch_dtype.A8_NATIVE_BF16}")
        assert choose("auto", weights, "float32", AMX) == kept
        # on AVX512-BF16 without AMX, auto computes int weights in float32 on int8 rows
        bf16_host = ("int8", f"auto: {torch_dtype.A8_MEASURED_BF16}")
        assert choose("auto", weights, "float32", AVX512_BF16) == bf16_host
        for flags in (AVX512_BF16, AMX):
            assert choose("int8", weights, "float32", flags) == ("int8", "asked for")
        # AVX2 without VNNI: the vpmaddubsw path, measured on its own host
        avx2 = ("int8", f"auto: {torch_dtype.A8_MEASURED_AVX2}")
        assert choose("auto", weights, "float32", AVX2_ONLY) == avx2
        assert choose("auto", weights, "float32", AVX_VNNI) == avx2  # 256-bit VNNI: that path
        assert choose("auto", weights, "float32", NO_AVX2) == (
            "float",
            "auto: the CPU has no avx2, fma",
        )
        with pytest.raises(ValueError, match="needs avx2, fma, which this CPU lacks"):
            choose("int8", weights, "float32", NO_AVX2)
        # bf16 models: rows as int8 where the kind measured it (a step's few on AMX, every
        # one on AVX512-BF16 without it, where bf16 is named), asked or not; a named bf16 is
        # no reason to keep them, bf16 not being exact arithmetic
        for kind, flags in (("amx", AMX), ("avx512-bf16", AVX512_BF16)):
            rows = torch_dtype.KIND_DEFAULTS[kind].bf16_int8_rows
            assert rows
            assert choose("auto", weights, "bfloat16", flags) == (
                "int8",
                f"auto on this {kind} CPU: {rows}",
            )
            named_bf16 = choose_activations(
                "auto", weights=weights, dtype="bfloat16", dtype_asked=True, flags=flags
            )
            assert named_bf16.activations == "int8"
        assert choose("auto", weights, "bfloat16", NO_BF16_VNNI) == (
            "float",
            "auto: bf16 rows on this vnni CPU",
        )
        for flags in (AMX, AVX512_BF16):
            assert choose("int8", weights, "bfloat16", flags) == ("int8", "asked for")
    assert choose("auto", "float", "float32", NO_BF16_VNNI) == (
        "float",
        "auto: only int weights take int8 rows",
    )
    assert choose("auto", "float", "bfloat16", AMX)[0] == "float"
    for dtype in ("float32", "bfloat16"):
        refused = f"bfloat16; this model computes in {dtype} with float"
        with pytest.raises(ValueError, match=refused):
            choose("int8", "float", dtype, AMX)
    with pytest.raises(ValueError, match="computes in float16 with int4"):
        choose("int8", "int4", "float16", AMX)
    with pytest.raises(ValueError, match="activations must be one of auto, float, int8"):
        choose("int4", "int4", "float32", NO_BF16_VNNI)


def test_int8_rows_asked_where_they_cannot_apply_are_refused_before_any_weight_is_read(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("transformers")
    from batchline._errors import InputError
    from batchline.models.config import Knobs
    from batchline.models.generation import load as load_module
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    folder = save_tiny_generator(tmp_path / "tiny")
    read: list[Any] = []
    monkeypatch.setattr(load_module, "_load_weights", lambda *args: read.append(args))
    spec = parse_spec(f"{folder}/")
    for knobs, message in (
        (Knobs(dtype="bfloat16"), "computes in bfloat16 with float weights"),
        (Knobs(dtype="float32"), "computes in float32 with float weights"),
    ):
        with pytest.raises(InputError, match=message):
            load_module.load_text_generator(spec, knobs.replace(activations="int8"))
    monkeypatch.setattr(load_module, "_load_weights", lambda *args: read.append(args))
    # a CPU with the flags, where the kernel library did not build or load
    from batchline.models.generation import torch_dtype

    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: NO_BF16_VNNI)
    monkeypatch.setattr(ik, "int8_activations_here", lambda: (False, "the library did not build"))
    knobs = Knobs(dtype="float32", weights="int4", activations="int8")
    with pytest.raises(InputError, match="'int8' cannot run here: the library did not build"):
        load_module.load_text_generator(spec, knobs)
    # bf16 rows go int8 only through the own bf16 int4 kernel: a CPU without it is told so
    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: AMX)
    monkeypatch.setattr(ik, "int8_activations_here", lambda: (True, ""))
    monkeypatch.setattr(ik, "own_kernels", lambda **_: (False, "the CPU has no AVX512-BF16"))
    knobs = Knobs(dtype="bfloat16", weights="int4", activations="int8")
    with pytest.raises(InputError, match="'int8' cannot run here: the CPU has no AVX512-BF16"):
        load_module.load_text_generator(spec, knobs)
    assert read == []
    with pytest.raises(InputError, match="activations must be one of auto, float, int8"):
        Knobs(activations="int4")


def test_auto_takes_int8_rows_only_where_float32_was_chosen_not_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A user who names float32 (as the vLLM comparison does) gets float32 arithmetic: on an
    Ice Lake-like host ``auto`` quantizes the rows only when ``dtype = auto`` chose float32."""
    from batchline.models.config import Knobs
    from batchline.models.generation import torch_dtype
    from batchline.models.generation.engine_choices import activations_for
    from batchline.models.specs import parse_spec

    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: NO_BF16_VNNI)
    monkeypatch.setattr(ik, "int8_activations_here", lambda: (True, ""))
    assert torch_dtype.choose_dtype("auto", "cpu").dtype == "float32"
    weights, spec = "gguf", parse_spec("smollm2")
    chosen = activations_for(spec, Knobs(), weights, "float32")
    assert chosen.activations == "int8"
    named = activations_for(spec, Knobs(dtype="float32"), weights, "float32")
    assert (named.activations, named.reason) == ("float", f"auto: {torch_dtype.A8_FLOAT32_ASKED}")
    asked = Knobs(dtype="float32", activations="int8")
    assert activations_for(spec, asked, weights, "float32").activations == "int8"


def test_a_float32_int4_model_asked_for_int8_rows_takes_them_and_says_so(
    a8_library: None, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    folder = save_tiny_generator(tmp_path / "tiny")
    knobs = Knobs(dtype="float32", weights="int4", activations="int8")
    with caplog.at_level("INFO", logger="batchline"):
        loaded = load_text_generator(parse_spec(f"{folder}/"), knobs)
    try:
        assert "int8 activations (asked for), scales in bf16" in caplog.text
        assert loaded.info.details["activations"] == "int8"
        model = loaded.engine._model
        own = [m for m in model.modules() if isinstance(m, QuantLinear) and m.own_kernel]
        assert own
        assert all(m.int8_rows for m in own)
        # int4 quantized at load has 8-bit steps: 290-byte blocks, not float32's 384; the head
        # (int8 in groups) is in the int8 layout, 544 bytes a block
        blocks: dict[str, set[int]] = {}
        for m in own:
            blocks.setdefault(m.kind, set()).update(p.shape[2] for p in m._own)
        assert blocks == {"int4": {ik.BLOCK_STEPS}, "int8g": {ik.BLOCK_INT8}}
        assert model.lm_head.kind == "int8g"
        assert len(model.lm_head._own) == 1
        x = torch.randint(3, 100, (1, 7))
        with torch.inference_mode():
            rows = model(x).logits
            for m in own:
                m.int8_rows = False
            floats = model(x).logits
        # the same weights; the rows rounded to 8 bits per group of 32 on the way in
        assert 0 < _relative(rows, floats.double()) < 5e-2
    finally:
        loaded.close()


def test_int4_quantized_at_load_takes_8_bit_steps_whatever_the_rows(
    a8_library: None, tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    pytest.importorskip("transformers")
    from batchline.models.config import Knobs
    from batchline.models.generation.load import load_text_generator
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    assert ik.scale_dtype_for(torch.float32) == torch.float32
    assert ik.scale_dtype_for(torch.float32, int8_rows=True) == torch.bfloat16
    assert ik.scale_dtype_for(torch.bfloat16) == torch.bfloat16
    folder = save_tiny_generator(tmp_path / "tiny")
    knobs = Knobs(dtype="float32", weights="int4", activations="float")
    with caplog.at_level("INFO", logger="batchline"):
        loaded = load_text_generator(parse_spec(f"{folder}/"), knobs)
    try:
        own = [
            m for m in loaded.engine._model.modules() if isinstance(m, QuantLinear) and m.own_kernel
        ]
        assert own
        assert not any(m.int8_rows for m in own)
        # float32 scales (exact) are a GGUF's and the int8 head's planes; the int4 chosen at
        # load is 8-bit steps
        blocks = {m.kind: {p.shape[2] for p in m._own} for m in own}
        assert blocks == {"int4": {ik.BLOCK_STEPS}, "int8g": {ik.BLOCK_F32}}
        assert "scales in bf16" not in caplog.text
    finally:
        loaded.close()


def test_a_generators_identity_names_int8_rows_where_its_load_takes_them(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """A completion computed on int8 rows is not served again for float rows (and back): the
    identity says int8 where the load would take them, from the same choice."""
    pytest.importorskip("transformers")
    from batchline.models.config import Knobs
    from batchline.models.generation import torch_dtype
    from batchline.models.generation.backend import GENERATION
    from batchline.models.specs import parse_spec

    from .test_load import save_tiny_generator

    spec = parse_spec(f"{save_tiny_generator(tmp_path / 'tiny')}/")
    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: AMX)
    int4 = GENERATION.identity(spec, Knobs(weights="int4")).options
    assert (int4["dtype"], int4["activations"]) == ("bfloat16", "int8")  # AMX: a step's few rows
    floats = GENERATION.identity(spec, Knobs(weights="int4", activations="float")).options
    assert "activations" not in floats
    assert {k: v for k, v in int4.items() if k != "activations"} == floats
    # no int weights, no int8 rows: the dense model's identity is as it always was
    assert "activations" not in GENERATION.identity(spec, Knobs()).options
    # AVX512-BF16 without AMX: float32 on int8 rows by default, every row as int8 in a named
    # bf16 (bf16 rows through vdpbf16ps before 2026-12-06)
    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: AVX512_BF16)
    zen4 = GENERATION.identity(spec, Knobs(weights="int4")).options
    assert (zen4["dtype"], zen4["activations"]) == ("float32", "int8")
    named = GENERATION.identity(spec, Knobs(weights="int4", dtype="bfloat16")).options
    assert (named["dtype"], named["activations"]) == ("bfloat16", "int8")
    # an Ice Lake's named bf16 (no native bf16) keeps its rows: nothing measured there
    monkeypatch.setattr(torch_dtype, "cpu_flags", lambda: NO_BF16_VNNI)
    assert (
        "activations"
        not in GENERATION.identity(spec, Knobs(weights="int4", dtype="bfloat16")).options
    )
