"""Tiny Hugging Face folders for the folder tests: JSON-only shapes for detection (no torch),
and random-weight BERT models saved with ``save_pretrained`` for the conversion tests
(those import torch and transformers, or skip)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "query", "document", "paris"]
#: The tiny tokenizer's vocabulary: its specials, the letters and WORDS.
BERT_VOCAB = 5 + 26 + len(WORDS)


def write_json(path: Path, data: object) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")
    return path


def st_modules(
    folder: Path,
    *,
    pooling: str | list[str] | dict[str, Any] = "mean",
    dense: list[dict[str, Any]] | None = None,
    normalize: bool = False,
    max_seq_length: int | None = 48,
) -> Path:
    """Write a sentence-transformers layout over the transformer at ``folder``'s root."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}
    ]
    pool = pooling if isinstance(pooling, dict) else {"pooling_mode": pooling}
    write_json(folder / "1_Pooling" / "config.json", {"embedding_dimension": 32, **pool})
    modules.append(
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    )
    for i, config in enumerate(dense or []):
        idx = len(modules)
        path = f"{idx}_Dense"
        write_json(folder / path / "config.json", config)
        modules.append(
            {
                "idx": idx,
                "name": str(idx),
                "path": path,
                "type": "sentence_transformers.models.Dense",
            }
        )
        _dense_weights(folder / path, config, seed=i)
    if normalize:
        idx = len(modules)
        modules.append(
            {
                "idx": idx,
                "name": str(idx),
                "path": f"{idx}_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    if max_seq_length is not None:
        write_json(folder / "sentence_bert_config.json", {"max_seq_length": max_seq_length})
    write_json(folder / "modules.json", modules)
    return folder


def _dense_weights(path: Path, config: dict[str, Any], *, seed: int) -> None:
    import numpy as np

    try:
        from safetensors.numpy import save_file
    except ImportError:  # detection-only tests need a file, not readable weights
        (path / "model.safetensors").write_bytes(b"")
        return
    rng = np.random.default_rng(seed)
    shape = (int(config["out_features"]), int(config["in_features"]))
    save_file(
        {
            "linear.weight": rng.normal(0, 0.3, shape).astype(np.float32),
            "linear.bias": rng.normal(0, 0.1, shape[0]).astype(np.float32),
        },
        str(path / "model.safetensors"),
    )


def save_tokenizer(folder: Path) -> None:
    """A tiny WordPiece tokenizer with BERT's single and pair templates."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertTokenizerFast

    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {t: i for i, t in enumerate(specials + list("abcdefghijklmnopqrstuvwxyz") + WORDS)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", 2), ("[SEP]", 3)],
    )
    fast = BertTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        model_max_length=64,
    )
    fast.save_pretrained(folder)


def tiny_bert(*, labels: int | None = None, seed: int = 0, **config: Any) -> Any:
    """A random 2-layer BERT (hidden 32, the tiny tokenizer's vocabulary) in eval mode:
    ``BertModel``, or a sequence classifier with ``labels`` labels (``L0``, ``L1``...);
    ``config`` overrides ``BertConfig``'s fields (``hidden_act="relu"``...)."""
    import torch
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    settings: dict[str, Any] = {
        "vocab_size": BERT_VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "intermediate_size": 64,
        "max_position_embeddings": 64,
        "initializer_range": 0.2,
    }
    bert_config = BertConfig(**{**settings, **config})
    if labels is None:
        model: Any = BertModel(bert_config)
    else:
        bert_config.num_labels = labels
        bert_config.id2label = {i: f"L{i}" for i in range(labels)}
        bert_config.label2id = {f"L{i}": i for i in range(labels)}
        model = BertForSequenceClassification(bert_config)
    return model.eval()


def tiny_roberta(*, labels: int | None = None, seed: int = 0) -> Any:
    """A random 1-layer RoBERTa (hidden 32) in eval mode with one token type, as
    roberta-base's ``config.json`` has: ``RobertaModel``, or a sequence classifier with
    ``labels`` labels (another architecture than the lean forward's)."""
    import torch
    from transformers import RobertaConfig, RobertaForSequenceClassification, RobertaModel

    torch.manual_seed(seed)
    config = RobertaConfig(
        vocab_size=BERT_VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=70,
        pad_token_id=0,
        type_vocab_size=1,
    )
    if labels is None:
        model: Any = RobertaModel(config)
    else:
        config.num_labels = labels
        model = RobertaForSequenceClassification(config)
    return model.eval()


def save_bert(folder: Path, *, labels: int | None = None, seed: int = 0) -> Path:
    """:func:`tiny_bert` saved with ``save_pretrained``, with its tokenizer."""
    tiny_bert(labels=labels, seed=seed).save_pretrained(folder)
    save_tokenizer(folder)
    return folder


@pytest.fixture(scope="module")
def torch_ready() -> None:
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("sentence_transformers")
    torch.set_num_threads(1)


@pytest.fixture(scope="module", autouse=True)
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder of the module's own, so conversions are seen fresh."""
    folder = tmp_path_factory.mktemp("hf-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(folder))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield folder
