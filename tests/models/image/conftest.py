"""Tiny random-weight Hugging Face image folders, one per family, built with transformers'
config classes and saved with ``save_pretrained`` beside their processor configs (and, for
CLIP, a small word-level ``tokenizer.json``). They import torch and transformers, or skip."""

from __future__ import annotations

import json
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

WORDS = ["a", "photo", "of", "cat", "dog", "car", "the", "red", "blue", "on", "mat"]
LABELS = {0: "tabby", 1: "beagle", 2: "sports car"}
SIZE = 32


def _vit(**extra: Any) -> dict[str, Any]:
    return {
        "image_size": SIZE,
        "patch_size": 8,
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 37,
        **extra,
    }


def _text(vocab: int) -> dict[str, Any]:
    return {
        "vocab_size": vocab,
        "hidden_size": 32,
        "intermediate_size": 37,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "max_position_embeddings": 16,
        "bos_token_id": 1,
        "eos_token_id": 2 + 1,  # not 2: transformers' legacy argmax pooling is for id 2 only
        "pad_token_id": 0,
    }


def write_tokenizer(folder: Path) -> int:
    """A word-level tokenizer that adds ``<bos> ... <eos>`` as CLIP's does; its vocab size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {"<pad>": 0, "<bos>": 1, "<unk>": 2, "<eos>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="<bos> $A <eos>", special_tokens=[("<bos>", 1), ("<eos>", 3)]
    )
    tok.enable_padding(pad_id=0, pad_token="<pad>")
    tok.save(str(folder / "tokenizer.json"))
    return len(vocab)


def _processor(name: str, **settings: Any) -> Any:
    import transformers

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return getattr(transformers, f"{name}Pil")(**settings)


def _vit_processor() -> Any:
    return _processor("ViTImageProcessor", size={"height": SIZE, "width": SIZE})


def _convnext_processor() -> Any:
    return _processor("ConvNextImageProcessor", size={"shortest_edge": SIZE}, crop_pct=0.875)


#: family → (model class, config class, config kwargs, processor factory)
FAMILIES: dict[str, tuple[str, str, Callable[[], dict[str, Any]], Callable[[], Any]]] = {
    "vit": ("ViTForImageClassification", "ViTConfig", lambda: _vit(), _vit_processor),
    "resnet": (
        "ResNetForImageClassification",
        "ResNetConfig",
        lambda: {"embedding_size": 8, "hidden_sizes": [8, 16], "depths": [1, 1]},
        _convnext_processor,
    ),
    "convnext": (
        "ConvNextForImageClassification",
        "ConvNextConfig",
        lambda: {"num_stages": 2, "hidden_sizes": [8, 16], "depths": [1, 1]},
        _convnext_processor,
    ),
    "swin": (
        "SwinForImageClassification",
        "SwinConfig",
        lambda: {
            "image_size": SIZE,
            "patch_size": 4,
            "embed_dim": 8,
            "depths": [1, 1],
            "num_heads": [1, 2],
            "window_size": 4,
        },
        _vit_processor,
    ),
    "efficientnet": (
        "EfficientNetForImageClassification",
        "EfficientNetConfig",
        lambda: {
            "image_size": SIZE,
            "width_coefficient": 0.1,
            "depth_coefficient": 0.1,
            "hidden_dim": 128,  # the top conv: round_filters(1280 * 0.1)
        },
        lambda: _processor("EfficientNetImageProcessor", size={"height": SIZE, "width": SIZE}),
    ),
    "dinov2": (
        "Dinov2Model",
        "Dinov2Config",
        lambda: _vit(),
        lambda: _processor(
            "BitImageProcessor",
            size={"shortest_edge": SIZE + 4},
            crop_size={"height": SIZE, "width": SIZE},
        ),
    ),
    "vitmodel": ("ViTModel", "ViTConfig", lambda: _vit(), _vit_processor),
}


def build_folder(root: Path, family: str) -> Path:
    """A saved random-weight ``family`` folder under ``root`` (made once per root)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder = root / family
    if (folder / "config.json").is_file():
        return folder
    torch.manual_seed(0)
    if family in ("clip", "siglip"):
        folder.mkdir(parents=True)
        vocab = write_tokenizer(folder)
        prefix = "CLIP" if family == "clip" else "Siglip"
        config = getattr(transformers, f"{prefix}Config")(
            text_config=_text(vocab),
            vision_config={k: v for k, v in _vit().items()},
            **({"projection_dim": 16} if family == "clip" else {}),
        )
        model = getattr(transformers, f"{prefix}Model")(config)
        if family == "clip":
            processor = _processor(
                "CLIPImageProcessor",
                size={"shortest_edge": SIZE},
                crop_size={"height": SIZE, "width": SIZE},
            )
        else:
            processor = _processor("SiglipImageProcessor", size={"height": SIZE, "width": SIZE})
    else:
        model_cls, config_cls, kwargs, make_processor = FAMILIES[family]
        extra: dict[str, Any] = {}
        if model_cls.endswith("ForImageClassification"):
            extra = {"id2label": dict(LABELS), "label2id": {v: k for k, v in LABELS.items()}}
        config = getattr(transformers, config_cls)(**kwargs(), **extra)
        model = getattr(transformers, model_cls)(config)
        processor = make_processor()
    with torch.no_grad():  # random weights of a visible size: a tiny init gives flat outputs
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.3)
    model.eval().save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def pictures(count: int, seed: int = 0) -> list[Any]:
    """RGB pictures of mixed sizes, the real photographs of scikit-learn among them."""
    from PIL import Image
    from sklearn.datasets import load_sample_images

    rng = np.random.default_rng(seed)
    photos = [Image.fromarray(a) for a in load_sample_images().images]
    sizes = [(40, 50), (64, 32), (33, 33), (120, 80), (32, 32)]
    out = list(photos)
    while len(out) < count:
        h, w = sizes[len(out) % len(sizes)]
        out.append(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)))
    return out[:count]


@pytest.fixture(scope="module", autouse=True)
def image_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A cache folder of the module's own (conversions seen fresh, the session's cache left
    as the other model tests expect it); torch on one thread, as the machine is shared."""
    folder = tmp_path_factory.mktemp("image-cache")
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHLINE_CACHE_DIR", str(folder))
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield folder


@pytest.fixture(scope="session")
def image_folders(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("image-folders")


def read_json(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return data
