"""The engine's layout made a layer at a time (fuse, quantize, pack) computes what the whole-model
passes computed, and gives back the file pages of exactly the weights it replaced."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from batchline.models.common import torch_weights  # noqa: E402
from batchline.models.generation.engine_layout import lay_out_weights  # noqa: E402
from batchline.models.generation.lean_llama import fuse_projections  # noqa: E402
from batchline.models.generation.quant_embedding import (  # noqa: E402
    QuantEmbedding,
    embed_quantized,
    tied_embedding,
)
from batchline.models.generation.quantize import quantize_linears, quantize_lm_head  # noqa: E402

from .conftest import TINY_VOCAB, build_tiny_llama  # noqa: E402

# a layer's linears, as transformers names them before fusing, by the block holding them
_LINEARS = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory, torch_threads: None) -> Path:
    """The tiny Llama saved in bf16 (safetensors: transformers maps it and hands out views)."""
    path = tmp_path_factory.mktemp("tiny-llama-bf16")
    build_tiny_llama().to(torch.bfloat16).save_pretrained(path)
    return path


def _load(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model, _ = torch_weights.from_pretrained_quietly(
        AutoModelForCausalLM, folder, dtype=torch.bfloat16
    )
    return model.eval()


@pytest.mark.parametrize("weights", ["int4", "int8", "float"])
def test_a_layer_at_a_time_computes_what_the_whole_model_passes_did(
    folder: Path, weights: str
) -> None:
    whole = _load(folder)
    fused = fuse_projections(whole)
    report = quantize_linears(whole, weights, torch.bfloat16) if weights != "float" else None
    if report is not None:  # the lm_head too, where the own kernel runs, and the embedding
        tied = tied_embedding(whole)
        head = quantize_lm_head(whole, torch.bfloat16)
        if head is not None:
            words = embed_quantized(whole, tied, torch.bfloat16)
            head = dataclasses.replace(head, embedding=words)
        report = dataclasses.replace(report, head=head)
    packed = torch_weights.pack_linear_weights(whole)
    layered = _load(folder)
    layout = lay_out_weights(layered, weights, torch.bfloat16)
    assert (layout.fused, layout.quantized, layout.packed) == (fused, report, packed)
    x = torch.randint(3, TINY_VOCAB, (2, 7))
    with torch.inference_mode():
        assert torch.equal(layered(x).logits, whole(x).logits)


@pytest.mark.parametrize("weights", ["int4", "float"])
def test_the_replaced_weights_pages_go_back_and_nothing_else(
    folder: Path, weights: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _load(folder)
    layers = list(model.model.layers)
    originals = {
        getattr(getattr(layer, block), name).weight.data_ptr()
        for layer in layers
        for block, names in _LINEARS.items()
        for name in names
    }
    norms = {p.data_ptr() for layer in layers for n, p in layer.named_parameters() if "norm" in n}
    embedding, lm_head = model.model.embed_tokens.weight, model.lm_head.weight  # not tied here
    given: list[int] = []
    real = torch_weights.release_file_pages

    def spy(tensors: Any, files: Any = None) -> int:
        tensors = list(tensors)
        given.extend(t.data_ptr() for t in tensors)
        return real(tensors, files)

    monkeypatch.setattr(torch_weights, "release_file_pages", spy)
    lay_out_weights(model, weights, torch.bfloat16)
    # what the model computes with afterwards; packed weights (bf16 on a CPU whose oneDNN
    # computes it) are held outside its parameters, so a packed layer's original is gone too
    held = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    assert len(originals) == 14
    replaced = originals - held
    # q/k/v and gate/up are fused on every host: at least those five of each layer's seven
    assert len(replaced) >= 10
    assert replaced <= set(given)  # fused, quantized or packed away: given back
    assert not held & set(given)  # nothing still computed with
    assert not norms & set(given)
    # the lm_head goes back where it was packed or quantized with the layers, else it stays
    assert (lm_head.data_ptr() in given) == (lm_head.data_ptr() not in held)
    # the embedding goes int8 with the head, which is quantized with int4 layers where the own
    # kernel runs for bf16 rows; elsewhere (no AVX512-BF16: Ice Lake) the head may be packed
    # for oneDNN instead, gone from the parameters all the same, and the embedding stays
    from batchline.models.generation import quant_kernel

    own = quant_kernel.own_kernels(dtype=torch.bfloat16)[0]
    quantized = isinstance(model.model.embed_tokens, QuantEmbedding)
    assert quantized == (weights == "int4" and own)
    assert not quantized or lm_head.data_ptr() not in held
    assert (embedding.data_ptr() in given) == quantized


@pytest.mark.parametrize("weights", ["int4", "int8"])
def test_a_bf16_folder_quantized_for_float32_computes_what_it_did_read_in_float32(
    folder: Path, weights: str
) -> None:
    """A float32 model's int weights are quantized from the folder's own bf16 and the rest
    widened to float32 a layer at a time: the same codes and logits as reading the folder in
    float32 first (twice the memory of the file before the first layer was quantized)."""
    from transformers import AutoModelForCausalLM

    from batchline.models.generation.engine_choices import stored_bf16

    assert stored_bf16(folder) == torch.bfloat16  # the loader reads this folder so
    wide, _ = torch_weights.from_pretrained_quietly(
        AutoModelForCausalLM, folder, dtype=torch.float32
    )
    lay_out_weights(wide.eval(), weights, torch.float32)
    narrow = _load(folder)
    layout = lay_out_weights(narrow, weights, torch.float32)
    assert layout.quantized is not None
    assert layout.quantized.kind.startswith(weights)  # int8 in groups: int8g
    held = [*narrow.parameters(), *narrow.buffers()]
    assert all(t.dtype == torch.float32 for t in held if t.is_floating_point())
    x = torch.randint(3, TINY_VOCAB, (2, 7))
    with torch.inference_mode():
        assert torch.equal(narrow(x).logits, wide(x).logits)


def test_a_bf16_models_head_is_in_the_int8_layout_where_the_load_sums_rows_as_int8(
    folder: Path,
) -> None:
    from batchline.models.generation import quant_kernel
    from batchline.models.generation.quant_linear import QuantLinear, use_int8_activations

    for here, why in (
        quant_kernel.own_kernels(dtype=torch.bfloat16),
        quant_kernel.int8_activations_here(),
    ):
        if not here:
            pytest.skip(f"not run here: {why}")
    planes, layout = _load(folder), _load(folder)
    kept = lay_out_weights(planes, "int4", torch.bfloat16).quantized
    made = lay_out_weights(layout, "int4", torch.bfloat16, int8_rows=True).quantized
    assert kept is not None
    assert kept.head is not None
    assert made is not None
    assert made.head is not None
    assert isinstance(planes.lm_head, QuantLinear)
    assert isinstance(layout.lm_head, QuantLinear)
    assert not planes.lm_head.int8_layout
    assert layout.lm_head.int8_layout
    assert "int8 layout" in made.head.head_text  # what the load log says
    assert "int8 layout" not in kept.head.head_text
    assert made.head.bytes_after < kept.head.bytes_after  # 8.5 bits a weight, not 10
    for model in (planes, layout):
        use_int8_activations(model)
    x = torch.randint(3, TINY_VOCAB, (1, 5))
    with torch.inference_mode():
        want, got = planes(x).logits.double(), layout(x).logits.double()
    # the same codes and scales, the rows quantized to int8 per group either way
    assert ((got - want).norm() / want.norm()).item() < 2e-2
