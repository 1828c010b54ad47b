"""``load_torch_embedder``: a tiny random Qwen3 decoder in the Qwen3-Embedding layout (a
sentence-transformers folder: last-token pooling, Normalize) gives sentence-transformers' vectors
(max abs diff ≤ 1e-4), each text's the same whether batched or alone (right padding, each row's
own last token)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from batchline._commands import install_command  # noqa: E402
from batchline._errors import InputError, ModelError  # noqa: E402
from batchline.knobs import Knobs  # noqa: E402
from batchline.models.hf.torch_embed import load_torch_embedder  # noqa: E402
from batchline.models.protocol import BatchModel  # noqa: E402

from ..generation.test_load import save_tiny_generator  # noqa: E402

HIDDEN = 32
TEXTS = ["a", "the quick brown fox", "héllo wörld, 12345", "x y", "a longer text " * 6]


def _save_sentence_transformers_folder(folder: Path) -> Path:
    config = transformers.Qwen3Config(
        vocab_size=320,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    save_tiny_generator(folder, model=transformers.Qwen3Model(config), chat_template=False)
    # Qwen3-Embedding's tokenizer pads on the left: sentence-transformers then batches so
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    settings["padding_side"] = "left"
    (folder / "tokenizer_config.json").write_text(json.dumps(settings))
    modules = [
        ("0", "", "Transformer"),
        ("1", "1_Pooling", "Pooling"),
        ("2", "2_Normalize", "Normalize"),
    ]
    (folder / "modules.json").write_text(
        json.dumps(
            [
                {"idx": i, "name": n, "path": p, "type": f"sentence_transformers.models.{t}"}
                for i, (n, p, t) in enumerate(modules)
            ]
        )
    )
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 64, "do_lower_case": False})
    )
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": HIDDEN,
                "pooling_mode_cls_token": False,
                "pooling_mode_mean_tokens": False,
                "pooling_mode_max_tokens": False,
                "pooling_mode_lasttoken": True,
                "include_prompt": True,
            }
        )
    )
    (folder / "2_Normalize").mkdir()
    return folder


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    return _save_sentence_transformers_folder(tmp_path_factory.mktemp("st") / "qwen3-emb")


def _load(folder: Path, pooling: str = "lasttoken", normalize: bool = True) -> Any:
    return load_torch_embedder(
        folder,
        name="qwen3-emb",
        pooling=pooling,
        normalize=normalize,
        max_length=64,
        knobs=Knobs(intra_op_threads=1),
    )


def _embed(model: Any, texts: list[str]) -> np.ndarray[Any, Any]:
    return np.stack(model.run_batch(model.prepare(texts)))


def test_it_is_an_embed_model(folder: Path) -> None:
    model = _load(folder)
    assert isinstance(model, BatchModel)
    info = model.info
    assert (info.task, info.input_kind, info.cost_kind) == ("embed", "text", "padded")
    assert (info.result_kind, info.result_column) == ("vector", "embedding")
    assert (info.max_tokens, info.details) == (64, {"dim": HIDDEN})
    items = model.prepare(["abc", 3])
    assert model.cost(items[0]) == 3  # one byte a token, no special tokens in this tokenizer
    assert isinstance(items[1], TypeError)
    assert isinstance(model.prepare([""])[0], InputError)
    assert len(model.prepare(["z" * 500])[0]) == 64  # truncated at max_length
    assert model.run_batch([]) == []
    model.close()


def test_vectors_equal_sentence_transformers(folder: Path) -> None:
    st = pytest.importorskip("sentence_transformers")
    reference = st.SentenceTransformer(str(folder), device="cpu", local_files_only=True)
    assert reference.tokenizer.padding_side == "left"
    want = reference.encode(TEXTS, batch_size=len(TEXTS), convert_to_numpy=True)
    got = _embed(_load(folder), TEXTS)
    assert got.shape == (len(TEXTS), HIDDEN)
    assert np.abs(got - want).max() <= 1e-4


@pytest.mark.parametrize(("pooling", "normalize"), [("lasttoken", True), ("mean", False)])
def test_vectors_equal_a_hand_computation_and_do_not_depend_on_the_batch(
    folder: Path, pooling: str, normalize: bool
) -> None:
    model = _load(folder, pooling, normalize)
    batched = _embed(model, TEXTS)
    reference = transformers.AutoModel.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    for i, text in enumerate(TEXTS):
        ids = torch.tensor([tokenizer(text, truncation=True, max_length=64)["input_ids"]])
        with torch.no_grad():
            hidden = reference(input_ids=ids).last_hidden_state[0]  # the text alone, no padding
        want = hidden[-1] if pooling == "lasttoken" else hidden.mean(0)
        if normalize:
            want = want / want.norm()
        assert np.abs(batched[i] - want.numpy()).max() <= 1e-4, text
        alone = _embed(model, [text])[0]
        assert np.abs(alone - batched[i]).max() <= 1e-5
    assert np.allclose(np.linalg.norm(batched, axis=1), 1.0, atol=1e-5) == normalize


def test_bad_arguments_and_missing_torch_are_one_clear_line(
    folder: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match="pooling must be one of lasttoken, mean, cls"):
        _load(folder, pooling="max")
    with pytest.raises(ModelError, match="cannot load the embedder"):
        _load(tmp_path)
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ModelError) as caught:
        _load(folder)
    message = str(caught.value)
    assert "\n" not in message
    assert "transformers is missing" in message
    assert install_command("generate") in message
    assert "torch==2.13.0" in message


@pytest.mark.parametrize("which", ["qwen3", "minilm"])
def test_texts_are_tokenized_directly_to_the_folders_tokenizers_ids(
    folder: Path, which: str
) -> None:
    from batchline.models.common.minilm import weights_dir

    path = folder if which == "qwen3" else weights_dir()
    model = _load(path, pooling="mean")
    assert model._direct is not None  # the fast path is taken for both kinds of folder
    texts = [*TEXTS, "naïve  東京 [SEP] <|endoftext|>", "word " * 300]
    want = model.tokenizer(texts, truncation=True, max_length=64, padding=False)["input_ids"]
    got = model.prepare(texts)
    assert [list(t.ids) for t in got] == want
    assert [list(t.ids) for t in model.prepare(texts[:1])] == want[:1]
    assert len(got[-1]) == 64


def test_a_tokenizer_the_direct_path_would_change_is_kept() -> None:
    from batchline.models.hf.torch_embed import direct_tokenizer

    class Adds:
        """A transformers-like tokenizer whose class adds a token of its own to every text."""

        def __init__(self, inner: Any) -> None:
            self.backend_tokenizer = inner.backend_tokenizer
            self._inner = inner

        def __call__(self, texts: list[str], **kw: Any) -> dict[str, list[list[int]]]:
            return {"input_ids": [[7, *ids] for ids in self._inner(texts, **kw)["input_ids"]]}

    from batchline.models.common.minilm import weights_dir

    inner = transformers.AutoTokenizer.from_pretrained(weights_dir(), local_files_only=True)
    assert direct_tokenizer(inner, 64) is not None
    assert direct_tokenizer(Adds(inner), 64) is None
    assert direct_tokenizer(object(), 64) is None  # a slow tokenizer has no backend
