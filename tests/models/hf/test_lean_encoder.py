"""The lean BERT forward against transformers' ``BertModel`` on random tiny BERTs: the same
hidden states for every real token (fp32: to float rounding; bf16: as close to fp32 as
transformers' own bf16), whatever a text is batched with, and ``None`` for the models it does
not reproduce."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchline.models.config import Knobs  # noqa: E402
from batchline.models.hf.lean_encoder import ROW_STEP, LeanBertEncoder, lean_encoder  # noqa: E402
from batchline.models.hf.torch_embed import load_torch_embedder  # noqa: E402
from tests.models.hf.conftest import BERT_VOCAB, save_bert, tiny_bert, tiny_roberta  # noqa: E402

pytestmark = pytest.mark.usefixtures("torch_ready")

#: Lengths that put the batch's row count off and on a multiple of ROW_STEP.
LENGTHS = (7, 3, 12, 1, 9)


def batch(lengths: tuple[int, ...] = LENGTHS, seed: int = 1) -> tuple[Any, Any]:
    """Right-padded ids (pad id 0) and their mask."""
    generator = torch.Generator().manual_seed(seed)
    ids = torch.zeros((len(lengths), max(lengths)), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        ids[row, :n] = torch.randint(1, BERT_VOCAB, (n,), generator=generator)
        mask[row, :n] = 1
    return ids, mask


def real_tokens(hidden: Any, mask: Any) -> np.ndarray[Any, Any]:
    out: np.ndarray[Any, Any] = hidden[mask.bool()].float().numpy()
    return out


def transformers_hidden(model: Any, ids: Any, mask: Any) -> Any:
    with torch.inference_mode():
        return model(input_ids=ids, attention_mask=mask).last_hidden_state


@pytest.mark.parametrize("activation", ["gelu", "gelu_new", "relu"])
def test_fp32_hidden_states_are_transformers_for_every_real_token(activation: str) -> None:
    model = tiny_bert(hidden_act=activation)
    ids, mask = batch()
    lean = lean_encoder(model)
    assert isinstance(lean, LeanBertEncoder)
    with torch.inference_mode():
        ours = lean(ids, mask)
    assert ours.shape == (len(LENGTHS), max(LENGTHS), 32)
    want = real_tokens(transformers_hidden(model, ids, mask), mask)
    np.testing.assert_allclose(real_tokens(ours, mask), want, atol=2e-5, rtol=0)


def test_a_texts_hidden_states_do_not_depend_on_its_batch() -> None:
    """Alone (a row count off ROW_STEP) or among longer texts (more rows, another rounding
    and padding on its right), a text gets the same hidden states."""
    lean = lean_encoder(tiny_bert())
    assert lean is not None
    ids, mask = batch()
    assert (ids.numel() % ROW_STEP) != 0
    with torch.inference_mode():
        together = lean(ids, mask)
        for row, n in enumerate(LENGTHS):
            alone = lean(ids[row : row + 1, :n], mask[row : row + 1, :n])
            np.testing.assert_allclose(
                alone[0].numpy(), together[row, :n].numpy(), atol=2e-5, rtol=0
            )


def test_bf16_hidden_states_stay_as_close_to_fp32_as_transformers_bf16() -> None:
    model = tiny_bert()
    ids, mask = batch()
    want = real_tokens(transformers_hidden(model, ids, mask), mask)
    half = tiny_bert().to(torch.bfloat16)
    lean = lean_encoder(half)
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert lean is None  # oneDNN has no bf16 here: transformers' forward keeps the model
        return
    assert lean is not None
    with torch.inference_mode():
        ours = lean(ids, mask)
    assert ours.dtype == torch.bfloat16
    theirs = real_tokens(transformers_hidden(half, ids, mask), mask)
    error = np.abs(real_tokens(ours, mask) - want).max()
    assert error > 0  # it ran in bf16
    assert error <= 2 * np.abs(theirs - want).max() + 1e-2


@pytest.mark.parametrize(
    "config",
    [
        {"position_embedding_type": "relative_key"},
        {"hidden_act": "silu"},
        {"is_decoder": True},
    ],
)
def test_a_bert_the_lean_forward_does_not_reproduce_keeps_transformers(
    config: dict[str, Any],
) -> None:
    assert lean_encoder(tiny_bert(**config)) is None


def test_another_architecture_keeps_transformers() -> None:
    assert lean_encoder(tiny_roberta()) is None


def test_the_torch_embedder_runs_a_bert_folder_lean_with_transformers_vectors(
    tmp_path: Path,
) -> None:
    folder = save_bert(tmp_path / "bert")
    options: dict[str, Any] = {
        "name": "b",
        "pooling": "mean",
        "normalize": True,
        "max_length": None,
        "knobs": Knobs(intra_op_threads=1),
    }
    lean = load_torch_embedder(folder, **options)
    plain = load_torch_embedder(folder, lean=False, **options)
    assert isinstance(lean.model, LeanBertEncoder)
    assert not isinstance(plain.model, LeanBertEncoder)
    texts = ["hello world", "the cat sat on the mat", "paris"]
    ours = lean.embed_tokens(lean.prepare(texts))  # type: ignore[arg-type]
    want = plain.embed_tokens(plain.prepare(texts))  # type: ignore[arg-type]
    np.testing.assert_allclose(ours, want, atol=1e-5, rtol=0)
