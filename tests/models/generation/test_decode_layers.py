"""A decode-only step's layers in one call (``csrc/decode_layers.cpp``'s ``DecodeLayers``, taken
by ``LeanForward`` where every layer's products are each one call of the library): every
pass's logits bit for bit those of the layer loop, over prefills, decode-only steps and a step
that mixes decoding rows with a joining prompt, for each product it calls; which models take
it; and its arguments checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation import quant_kernel, torch_engine  # noqa: E402
from batchline.models.generation.decode_kernel import StepProduct  # noqa: E402
from batchline.models.generation.dense_tiles import tile_linear_weights  # noqa: E402
from batchline.models.generation.lean_llama import LeanForward, fuse_projections  # noqa: E402
from batchline.models.generation.quant_linear import use_int8_activations  # noqa: E402
from batchline.models.generation.quantize import quantize_linears  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402

from .conftest import build_tiny_llama, run_mixed_steps  # noqa: E402

#: each product the one call makes, with the rows' dtype its model computes in
PRODUCTS = {
    "int4 on int8 rows": (StepProduct.INT4_A8, torch.float32),
    "int8 layout on int8 rows": (StepProduct.INT8G_A8, torch.float32),
    "int8 layout on bf16 rows as int8": (StepProduct.INT8G_A8, torch.bfloat16),
    "bf16 tiles": (StepProduct.BF16_TILES, torch.bfloat16),
    "int4 on float32 rows": (StepProduct.INT4_F32, torch.float32),
    "int4 on bf16 rows": (StepProduct.INT4_BF16, torch.bfloat16),
    "int4 on bf16 rows, a few as int8": (StepProduct.INT4_BF16_A8, torch.bfloat16),
}


def _runs_here(layout: int) -> None:
    """Skip where this CPU or build does not run ``layout``'s op."""
    if layout == StepProduct.INT4_BF16_A8:
        here, why = quant_kernel.own_kernels(dtype=torch.bfloat16)
        if here:
            here, why = quant_kernel.int8_activations_here()
    elif layout in (StepProduct.INT4_A8, StepProduct.INT8G_A8):
        here, why = quant_kernel.int8_activations_here()
    else:
        dtype = torch.float32 if layout == StepProduct.INT4_F32 else torch.bfloat16
        here, why = quant_kernel.own_kernels(dtype=dtype)
    if not here:
        pytest.skip(f"not run here: {why}")


def _model(product: str, *, bias: bool = False) -> Any:
    """The tiny Llama, fused as the loader fuses it, its linears as ``product`` computes them;
    ``bias``: q/k/v with a bias (Qwen2's)."""
    layout, dtype = PRODUCTS[product]
    _runs_here(layout)
    model = build_tiny_llama()
    if bias:
        for layer in model.model.layers:
            attention = layer.self_attn
            for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
                linear.bias = torch.nn.Parameter(torch.randn(linear.out_features) * 0.1)
    # a bf16 model's int8 layout: made as a float32 model's (weights=int8 in bf16 is int8 per
    # channel), then the rest of it in bf16 (the packed layers keep their bytes)
    int8g = layout == StepProduct.INT8G_A8
    model = model.to(torch.float32 if int8g else dtype)
    fuse_projections(model)
    if layout == StepProduct.BF16_TILES:
        assert tile_linear_weights(model) > 0
        return model
    kind = "int8" if int8g else "int4"
    a8 = layout in (StepProduct.INT4_A8, StepProduct.INT8G_A8)
    scales = torch.bfloat16 if a8 else None  # as the loader packs them for int8 rows
    quantize_linears(model, kind, torch.float32 if int8g else dtype, scale_dtype=scales)
    if a8 or layout == StepProduct.INT4_BF16_A8:
        assert use_int8_activations(model) > 0
    return model.to(dtype)


def _passes(model: Any, monkeypatch: pytest.MonkeyPatch, one_call: bool) -> tuple[list[Any], int]:
    """Every pass's logits of three answers decoding and a fourth joining them, and how many
    passes went through the one call."""
    passes: list[Any] = []
    calls = 0
    real_call = getattr(LeanForward.__call__, "unrecorded", LeanForward.__call__)
    real_one_call = getattr(LeanForward.one_call, "uncounted", LeanForward.one_call)

    def recording(self: Any, *args: Any) -> Any:
        out = real_call(self, *args)
        passes.append(out.clone())
        return out

    def counted(self: Any, dtype: Any) -> Any:
        nonlocal calls
        found = real_one_call(self, dtype)
        if found is None:
            return None
        stack, below = found

        class Counted:
            def forward(self, *args: Any) -> Any:
                nonlocal calls
                calls += 1
                return stack.forward(*args)

        return Counted(), below

    recording.unrecorded = real_call  # type: ignore[attr-defined]
    counted.uncounted = real_one_call  # type: ignore[attr-defined]
    monkeypatch.setattr(LeanForward, "__call__", recording)
    monkeypatch.setattr(LeanForward, "one_call", counted)
    monkeypatch.setattr(
        torch_engine,
        "lean_forward",
        lambda m, ops=None: (LeanForward(m, ops, one_call=one_call), ""),
    )
    engine = TorchStepEngine(model)
    run_mixed_steps(engine)
    return passes, calls


@pytest.mark.parametrize(
    ("product", "bias"),
    [*((name, False) for name in PRODUCTS), ("int4 on int8 rows", True), ("bf16 tiles", True)],
)
def test_a_decode_only_steps_layers_in_one_call_give_the_loops_bits(
    monkeypatch: pytest.MonkeyPatch, product: str, bias: bool
) -> None:
    one, calls = _passes(_model(product, bias=bias), monkeypatch, one_call=True)
    loop, none = _passes(_model(product, bias=bias), monkeypatch, one_call=False)
    assert calls > 0
    assert none == 0
    assert len(one) == len(loop) > calls  # the prefills and the mixed step went the loop's way
    assert all(torch.equal(a, b) for a, b in zip(one, loop, strict=True))


@pytest.mark.parametrize("below", [2, quant_kernel.A8_BF16_ROWS_AMX])
def test_a_bf16_models_few_rows_as_int8_give_the_loops_bits_on_either_side_of_the_bound(
    monkeypatch: pytest.MonkeyPatch, below: int
) -> None:
    # the steps decode 4, 3, 2 and 1 rows: with the bound at 2 the one call takes bf16 rows for
    # 3 and 4 of them (int4_linear) and int8 ones for a single row (int4_linear_a8)
    monkeypatch.setattr(quant_kernel, "A8_BF16_ROWS", below)
    product = "int4 on bf16 rows, a few as int8"
    one, calls = _passes(_model(product), monkeypatch, one_call=True)
    loop, _ = _passes(_model(product), monkeypatch, one_call=False)
    plain, _ = _passes(_model("int4 on bf16 rows"), monkeypatch, one_call=True)
    assert calls > 0
    assert all(torch.equal(a, b) for a, b in zip(one, loop, strict=True))
    # the prefills' many rows stay bf16; a decode step's few rows differ as int8 rows do
    assert torch.equal(one[0], plain[0])
    assert any(not torch.equal(a, b) for a, b in zip(one, plain, strict=True))


def _lean(model: Any) -> LeanForward:
    lean = TorchStepEngine(model)._lean
    assert lean is not None
    return lean


def test_a_model_with_a_product_of_another_kind_keeps_the_loop() -> None:
    model = _model("int4 on int8 rows")
    mlp = model.model.layers[1].mlp
    mlp.down_proj = torch.nn.Linear(mlp.down_proj.in_features, mlp.down_proj.out_features)
    assert _lean(model).one_call(torch.float32) is None
    assert not TorchStepEngine(model).layers_in_one_call  # what the load log says
    taking = TorchStepEngine(_model("int4 on int8 rows"))
    assert taking.layers_in_one_call
    assert taking.one_row_in_one_region  # what the load log adds
    assert not TorchStepEngine(model).one_row_in_one_region
    assert _lean(_model("int4 on int8 rows")).one_call(torch.float32) is not None
    taken = _lean(_model("int8 layout on int8 rows"))
    assert taken.one_call(torch.float32) is not None
    assert taken.one_call(torch.bfloat16) is not None  # bf16 rows are summed as int8 too
    assert taken.one_call(torch.float16) is None  # rows its products do not take


def test_a_dense_float32_model_keeps_the_loop() -> None:
    model = build_tiny_llama()
    fuse_projections(model)
    assert _lean(model).one_call(torch.float32) is None


def test_its_arguments_are_checked() -> None:
    _lean(_model("int4 on int8 rows"))  # the library loaded
    make = torch.classes.batchline.DecodeLayers
    with pytest.raises(RuntimeError, match="two norms, four products"):
        make([torch.ones(4)], [], [], [0] * 14, 1e-5, 0.5, 2, 4, 512, 5)
    spec = [0, 0] + [7, 16, 1] * 4
    empty = [torch.empty(0)] * 4
    with pytest.raises(RuntimeError, match="op 7 is none of 0-5"):
        make([torch.ones(4)] * 2, empty, empty, spec, 1e-5, 0.5, 2, 4, 512, 5)


def _one_row_stack(product: str, *, streams: int, gelu: bool = False, bias: bool = False) -> Any:
    """The one call over a model wide enough that every product's tiles split over two
    threads (hidden 512, intermediate 1,536), its linears reading ``streams`` tiles at once."""
    from batchline.models.generation.decode_layers import layers_in_one_call

    layout, dtype = PRODUCTS[product]
    _runs_here(layout)
    model = build_tiny_llama(hidden_size=512, intermediate_size=1536)
    if bias:  # q/k/v's (Qwen2's), and one down product's
        attention, mlp = model.model.layers[0].self_attn, model.model.layers[1].mlp
        for linear in (attention.q_proj, attention.k_proj, attention.v_proj, mlp.down_proj):
            linear.bias = torch.nn.Parameter(torch.randn(linear.out_features) * 0.1)
    int8g = layout == StepProduct.INT8G_A8
    fuse_projections(model)
    quantize_linears(model, "int8" if int8g else "int4", dtype, scale_dtype=torch.bfloat16)
    assert use_int8_activations(model) > 0
    layers = list(model.model.layers)
    for module in layers:
        for linear in (module.self_attn.qkv_proj, module.self_attn.o_proj):
            linear.streams = streams
        for linear in (module.mlp.gate_up_proj, module.mlp.down_proj):
            linear.streams = streams
    lean = _lean(model)  # the library loaded
    norms = [(m.input_layernorm.weight, m.post_attention_layernorm.weight) for m in layers]
    found = layers_in_one_call(
        layers,
        norms,
        dtype,
        gelu=gelu,
        eps=1e-5,
        scale=lean._scaling,
        heads=lean._heads,
    )
    assert found is not None
    return found[0]


@pytest.mark.parametrize(
    ("product", "streams", "gelu", "bias"),
    [
        ("int4 on int8 rows", 1, False, False),
        ("int4 on int8 rows", 4, True, True),
        ("int4 on int8 rows", 8, False, False),
        ("int8 layout on int8 rows", 1, False, True),  # one row on the 256-bit path
        ("int8 layout on int8 rows", 2, True, False),  # ... and on the 512-bit one
    ],
)
def test_one_float32_row_in_one_region_a_layer_gives_the_ops_bits(
    product: str, streams: int, gelu: bool, bias: bool
) -> None:
    stack = _one_row_stack(product, streams=streams, gelu=gelu, bias=bias)
    assert stack.one_row()
    generator = torch.Generator().manual_seed(3)
    layers, dim, kv_heads, capacity, hi = stack.size(), 128, 2, 24, 17
    h = torch.randn(1, 512, generator=generator)
    keys = [torch.randn(2, kv_heads, capacity, dim, generator=generator) for _ in range(layers)]
    values = [torch.randn(2, kv_heads, capacity, dim, generator=generator) for _ in range(layers)]
    angles = torch.rand(1, 1, dim, generator=generator) * 3
    cos, sin = angles.cos(), angles.sin()
    first = torch.tensor([4])

    def forward(one_row: bool) -> tuple[Any, list[Any], list[Any]]:
        assert stack.use_one_row(one_row) == one_row
        k, v = [t.clone() for t in keys], [t.clone() for t in values]
        return stack.forward(h, cos, sin, k, v, first, hi), k, v

    before = torch.get_num_threads()
    runs = []
    try:
        for threads in (2, 1):  # on two, the tiles and heads split as the ops split them
            torch.set_num_threads(threads)
            runs += [forward(True), forward(False)]
    finally:
        torch.set_num_threads(before)
        stack.use_one_row(True)
    region = runs[0]
    assert not torch.equal(region[0], h)
    for other in runs[1:]:  # op by op, and both ways on one thread: the same bits
        assert torch.equal(region[0], other[0])
        for ours, theirs in zip(region[1] + region[2], other[1] + other[2], strict=True):
            assert torch.equal(ours, theirs)  # the store's new column the same too
    # arguments the attention does not take go op by op, whose checks name them
    with pytest.raises(RuntimeError, match="hi outside the buffers"):
        stack.forward(h, cos, sin, keys, values, first, capacity)
    with pytest.raises(RuntimeError, match="first"):
        stack.forward(h, cos, sin, keys, values, torch.tensor([hi + 1]), hi)


def test_only_float32_rows_of_int8_row_products_take_one_region() -> None:
    assert _lean(_model("int4 on int8 rows")).one_call(torch.float32)[0].one_row()
    for product in ("int4 on float32 rows", "bf16 tiles"):
        layout, dtype = PRODUCTS[product]
        _runs_here(layout)
        stack, _ = _lean(_model(product)).one_call(dtype)
        assert not stack.one_row()
        assert not stack.use_one_row(True)


def test_a_region_given_fewer_threads_than_torch_asks_still_computes_every_part() -> None:
    # OMP_THREAD_LIMIT=1 caps the region at one thread while torch still reports two: the work
    # splits among the threads the region has, not those asked for
    _runs_here(StepProduct.INT4_A8)
    test = "test_one_float32_row_in_one_region_a_layer_gives_the_ops_bits"
    code = (
        "import sys; from tests.models.generation import test_decode_layers as t; "
        f"t.{test}('int4 on int8 rows', 4, False, True); "
        "import torch; torch.set_num_threads(2); assert torch.get_num_threads() == 2"
    )
    env = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
