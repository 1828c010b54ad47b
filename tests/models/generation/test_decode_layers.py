"""A decode-only step's layers in one call (``csrc/decode_layers.cpp``'s ``DecodeLayers``, taken
by ``LeanForward`` where every layer's products sum float32 rows as int8): every pass's logits
bit for bit those of the layer loop, over prefills, decode-only steps and a step that mixes
decoding rows with a joining prompt; which models take it; and its arguments checked."""

from __future__ import annotations

from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.generation import torch_engine  # noqa: E402
from batchline.models.generation.engine import GenerationRequest, SamplingParams  # noqa: E402
from batchline.models.generation.lean_llama import LeanForward, fuse_projections  # noqa: E402
from batchline.models.generation.quant_linear import use_int8_activations  # noqa: E402
from batchline.models.generation.quantize import quantize_linears  # noqa: E402
from batchline.models.generation.torch_engine import TorchStepEngine  # noqa: E402

from .conftest import build_tiny_llama  # noqa: E402


def _model(kind: str, *, bias: bool = False) -> Any:
    """The tiny Llama, fused as the loader fuses it, its linears ``kind`` in float32 with int8
    rows (as ``--set weights=int4`` runs on a CPU with AVX512-VNNI); ``bias``: q/k/v with a
    bias (Qwen2's)."""
    model = build_tiny_llama()
    if bias:
        for layer in model.model.layers:
            attention = layer.self_attn
            for linear in (attention.q_proj, attention.k_proj, attention.v_proj):
                linear.bias = torch.nn.Parameter(torch.randn(linear.out_features) * 0.1)
    fuse_projections(model)
    quantize_linears(model, kind, torch.float32, scale_dtype=torch.bfloat16)  # as loaded
    assert use_int8_activations(model) > 0
    return model


class _Counted:
    """``DecodeLayers`` with its forward calls counted."""

    def __init__(self, stack: Any) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args: Any) -> Any:
        self.calls += 1
        return self.stack.forward(*args)


def _passes(model: Any, monkeypatch: pytest.MonkeyPatch, one_call: bool) -> tuple[list[Any], int]:
    """Every pass's logits of three answers decoding and a fourth joining them, and how many
    passes went through the one call."""
    passes: list[Any] = []
    real_call = getattr(LeanForward.__call__, "unrecorded", LeanForward.__call__)

    def recording(self: Any, *args: Any) -> Any:
        out = real_call(self, *args)
        passes.append(out.clone())
        return out

    recording.unrecorded = real_call  # type: ignore[attr-defined]
    monkeypatch.setattr(LeanForward, "__call__", recording)
    monkeypatch.setattr(
        torch_engine,
        "lean_forward",
        lambda m, ops=None: (LeanForward(m, ops, one_call=one_call), ""),
    )
    engine = TorchStepEngine(model)
    lean = engine._lean
    assert lean is not None
    counted = None
    if lean._one_call is not None:
        counted = _Counted(lean._one_call[0])
        lean._one_call = (counted, lean._one_call[1])
    for i, length in enumerate((5, 9, 3)):
        params = SamplingParams(max_tokens=6 + i, ignore_eos=True)
        engine.add_request(GenerationRequest(f"r{i}", tuple(range(3, 3 + length)), params))
    for _ in range(3):
        engine.step()
    late = SamplingParams(max_tokens=4, ignore_eos=True)  # joins while the others decode
    engine.add_request(GenerationRequest("late", tuple(range(7, 18)), late))
    while engine.has_unfinished():
        engine.step()
    return passes, 0 if counted is None else counted.calls


@pytest.mark.parametrize(("kind", "bias"), [("int4", False), ("int8", False), ("int4", True)])
def test_a_decode_only_steps_layers_in_one_call_give_the_loops_bits(
    a8_library: None, monkeypatch: pytest.MonkeyPatch, kind: str, bias: bool
) -> None:
    one, calls = _passes(_model(kind, bias=bias), monkeypatch, one_call=True)
    loop, none = _passes(_model(kind, bias=bias), monkeypatch, one_call=False)
    assert calls > 0
    assert none == 0
    assert len(one) == len(loop) > calls  # the prefills and the mixed step went the loop's way
    assert all(torch.equal(a, b) for a, b in zip(one, loop, strict=True))


def test_a_model_with_a_dense_product_keeps_the_loop(a8_library: None) -> None:
    model = _model("int4")
    layer = model.model.layers[1].mlp
    dense = torch.nn.Linear(layer.down_proj.in_features, layer.down_proj.out_features, bias=False)
    layer.down_proj = dense
    assert TorchStepEngine(model)._lean._one_call is None
    assert TorchStepEngine(_model("int4"))._lean._one_call is not None


def test_a_dense_model_keeps_the_loop() -> None:
    model = build_tiny_llama()
    fuse_projections(model)
    lean = TorchStepEngine(model)._lean
    assert lean is not None
    assert lean._one_call is None


def test_its_arguments_are_checked(a8_library: None) -> None:
    torch_engine.TorchStepEngine(_model("int4"))  # the library loaded
    make = torch.classes.batchline.DecodeLayers
    with pytest.raises(RuntimeError, match="two norms, four products"):
        make([torch.ones(4)], [], [], [0] * 14, 1e-5, 0.5, 2, 4)
    spec = [0, 0] + [7, 16, 1] * 4
    with pytest.raises(RuntimeError, match="layout 0"):
        make([torch.ones(4)] * 2, [torch.empty(0)] * 4, [torch.empty(0)] * 4, spec, 1e-5, 0.5, 2, 4)
