"""Hugging Face image folders end to end in-process: detected from their JSON, converted once
to ONNX, loaded through ``load_model``, and compared with transformers on the same pixels
(max abs difference <= 1e-4 in fp32). The decode worker pool is not involved: pictures are
preprocessed here with ``model.preprocess`` and the batch runs with ``run_batch``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._errors import InputError
from batchline.models.config import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_specs
from tests.models.image.conftest import LABELS, build_folder, pictures

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

KNOBS = Knobs(sessions=1, intra_op_threads=1)
CLASSIFIERS = ["vit", "resnet", "convnext", "swin", "efficientnet"]


def _load(folder: Path, **options: Any) -> Any:
    task = options.pop("task", None)
    input_kind = options.pop("input_kind", None)
    (spec,) = parse_specs([f"{folder}/"], tasks=[task] if task else [], **options)
    if input_kind is not None:
        spec = spec.with_options(input_kind=input_kind)
    return load_model(spec, KNOBS)


def _pixels(model: Any, count: int = 6) -> tuple[list[np.ndarray], Any]:
    items = [model.preprocess(p) for p in pictures(count)]
    return items, torch.from_numpy(np.stack(items))


def _reference(folder: Path, auto: str) -> Any:
    return getattr(transformers, auto).from_pretrained(folder, attn_implementation="eager").eval()


@pytest.mark.parametrize("family", CLASSIFIERS)
def test_a_classifier_matches_transformers(
    image_folders: Path, image_cache: Path, family: str
) -> None:
    folder = build_folder(image_folders, family)
    model = _load(folder)
    assert model.info.task == "classify"
    assert model.info.input_kind == "image"
    assert model.info.details["labels"] == list(LABELS.values())
    items, pixels = _pixels(model)
    results = model.run_batch(items)
    with torch.no_grad():
        want = _reference(folder, "AutoModelForImageClassification")(pixels).logits.softmax(-1)
    got = np.array([[r["scores"][label] for label in LABELS.values()] for r in results])
    assert np.abs(got - want.numpy()).max() <= 1e-4
    labels = [LABELS[int(i)] for i in want.argmax(-1)]
    assert [r["label"] for r in results] == labels
    # the file is cached: a second load converts nothing
    assert model.model.path.parent == image_cache / "hf"
    again = _load(folder)
    assert again.model.path == model.model.path


def test_top_k_keeps_the_likeliest_labels_best_first(
    image_folders: Path, image_cache: Path
) -> None:
    model = _load(build_folder(image_folders, "vit"), top_k=2)
    full = _load(build_folder(image_folders, "vit"))
    items, _ = _pixels(model, 3)
    for short, whole in zip(model.run_batch(items), full.run_batch(items), strict=True):
        ranked = sorted(whole["scores"].items(), key=lambda kv: -kv[1])[:2]
        assert [(e["label"], e["score"]) for e in short["top_k"]] == ranked
        assert (short["label"], short["score"]) == ranked[0]
        assert "scores" not in short


@pytest.mark.parametrize(("family", "pooling"), [("dinov2", "cls"), ("vitmodel", "mean")])
def test_an_image_encoder_matches_transformers(
    image_folders: Path, image_cache: Path, family: str, pooling: str
) -> None:
    folder = build_folder(image_folders, family)
    model = _load(folder, pooling=pooling)
    assert (model.info.task, model.info.result_kind) == ("embed", "vector")
    items, pixels = _pixels(model)
    got = np.stack(model.run_batch(items))
    with torch.no_grad():
        hidden = _reference(folder, "AutoModel")(pixels).last_hidden_state
    want = hidden[:, 0] if pooling == "cls" else hidden[:, 1:].mean(1)
    want = torch.nn.functional.normalize(want, dim=-1).numpy()
    assert np.abs(got - want).max() <= 1e-4


def _sentence_transformers_layout(
    root: Path, name: str, pooling: dict[str, bool], *, normalize: bool, dense: bool = False
) -> Path:
    """The ``vitmodel`` folder copied under ``name`` with a sentence-transformers
    ``modules.json`` (Transformer, Pooling, then Dense and Normalize where asked)."""
    import json
    import shutil

    folder = root / name
    if folder.exists():
        shutil.rmtree(folder)
    shutil.copytree(build_folder(root, "vitmodel"), folder)
    kinds = [("", "Transformer"), ("1_Pooling", "Pooling")]
    kinds += [("2_Dense", "Dense")] * dense + [("3_Normalize", "Normalize")] * normalize
    modules = [
        {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
        for i, (path, kind) in enumerate(kinds)
    ]
    (folder / "1_Pooling").mkdir()
    (folder / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    (folder / "modules.json").write_text(json.dumps(modules))
    return folder


@pytest.mark.parametrize(
    ("mode", "normalize"), [("pooling_mode_mean_tokens", False), ("pooling_mode_cls_token", True)]
)
def test_an_image_encoder_pools_as_its_modules_json_says(
    image_folders: Path, image_cache: Path, mode: str, normalize: bool
) -> None:
    folder = _sentence_transformers_layout(
        image_folders, f"st-{mode}", {mode: True}, normalize=normalize
    )
    model = _load(folder)  # no --pooling: the folder's Pooling module decides
    items, pixels = _pixels(model, 4)
    got = np.stack(model.run_batch(items))
    with torch.no_grad():
        hidden = _reference(folder, "AutoModel")(pixels).last_hidden_state
    # sentence-transformers' mean takes every token, the first one too
    want = hidden.mean(1) if mode == "pooling_mode_mean_tokens" else hidden[:, 0]
    if normalize:
        want = torch.nn.functional.normalize(want, dim=-1)
    assert np.abs(got - want.numpy()).max() <= 1e-4
    # and not what the other reading would give
    other = hidden[:, 1:].mean(1) if mode == "pooling_mode_mean_tokens" else hidden.mean(1)
    assert np.abs(got - other.numpy()).max() > 1e-3


def test_a_dense_module_after_an_image_encoder_is_refused(
    image_folders: Path, image_cache: Path
) -> None:
    folder = _sentence_transformers_layout(
        image_folders, "st-dense", {"pooling_mode_cls_token": True}, normalize=False, dense=True
    )
    (folder / "2_Dense").mkdir()
    with pytest.raises(InputError, match="Dense module after an image encoder"):
        _load(folder)


def _clip_reference(folder: Path) -> Any:
    return _reference(folder, "CLIPModel")


def _features(out: Any) -> Any:
    return out if isinstance(out, torch.Tensor) else out.pooler_output


def test_clip_embeds_pictures_and_texts_into_one_space(
    image_folders: Path, image_cache: Path
) -> None:
    from tokenizers import Tokenizer

    folder = build_folder(image_folders, "clip")
    images = _load(folder, input_kind="image")
    texts = _load(folder)  # a text dataset: the text tower, the default for embed
    assert (images.info.input_kind, texts.info.input_kind) == ("image", "text")
    items, pixels = _pixels(images)
    got_images = np.stack(images.run_batch(items))
    words = ["a photo of a cat", "the red car", "dog", "a blue dog on the mat"]
    got_texts = np.stack(texts.run_batch(texts.prepare(words)))
    assert got_images.shape[1] == got_texts.shape[1] == 16
    reference = _clip_reference(folder)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoded = tok.encode_batch(words)
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    with torch.no_grad():
        want_images = _features(reference.get_image_features(pixel_values=pixels))
        want_texts = _features(reference.get_text_features(input_ids=ids, attention_mask=mask))
    normalize = torch.nn.functional.normalize
    assert np.abs(got_images - normalize(want_images, dim=-1).numpy()).max() <= 1e-4
    assert np.abs(got_texts - normalize(want_texts, dim=-1).numpy()).max() <= 1e-4


def test_clip_classifies_zero_shot_over_the_given_labels(
    image_folders: Path, image_cache: Path, tmp_path: Path
) -> None:
    from tokenizers import Tokenizer

    folder = build_folder(image_folders, "clip")
    labels = ("a photo of a cat", "a photo of a dog", "a red car")
    model = _load(folder, labels=labels)  # labels without a task: zero-shot classify
    assert (model.info.task, model.info.input_kind) == ("classify", "image")
    items, pixels = _pixels(model)
    results = model.run_batch(items)
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    encoded = tok.encode_batch(list(labels))
    ids = torch.tensor([e.ids for e in encoded])
    mask = torch.tensor([e.attention_mask for e in encoded])
    with torch.no_grad():
        out = _clip_reference(folder)(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    want = out.logits_per_image.softmax(-1).numpy()
    got = np.array([[r["scores"][label] for label in labels] for r in results])
    assert np.abs(got - want).max() <= 1e-4
    assert [r["label"] for r in results] == [labels[int(i)] for i in want.argmax(-1)]


def test_zero_shot_without_labels_is_one_line(image_folders: Path) -> None:
    folder = build_folder(image_folders, "clip")
    with pytest.raises(InputError, match="--labels") as info:
        parse_specs([f"{folder}/"], tasks=["classify"])
    assert "\n" not in str(info.value)


def _siglip_ids(folder: Path, texts: list[str]) -> Any:
    """SigLIP's text input as it was trained: every text padded to the full 16 positions."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.enable_padding(pad_id=0, pad_token="<pad>", length=16)
    return torch.tensor([e.ids for e in tok.encode_batch(texts)])


def test_siglip_embeds_pictures_and_texts_into_one_space(
    image_folders: Path, image_cache: Path
) -> None:
    folder = build_folder(image_folders, "siglip")
    images = _load(folder, input_kind="image")
    texts = _load(folder)
    items, pixels = _pixels(images)
    got_images = np.stack(images.run_batch(items))
    words = ["a photo of a cat", "dog", "the red car on the mat"]
    got_texts = np.stack(texts.run_batch(texts.prepare(words)))
    reference = _reference(folder, "SiglipModel")
    with torch.no_grad():
        want_images = _features(reference.get_image_features(pixel_values=pixels))
        want_texts = _features(reference.get_text_features(input_ids=_siglip_ids(folder, words)))
    normalize = torch.nn.functional.normalize
    assert np.abs(got_images - normalize(want_images, dim=-1).numpy()).max() <= 1e-4
    assert np.abs(got_texts - normalize(want_texts, dim=-1).numpy()).max() <= 1e-4


def test_siglip_classifies_zero_shot_with_a_sigmoid_per_label(
    image_folders: Path, image_cache: Path, tmp_path: Path
) -> None:
    folder = build_folder(image_folders, "siglip")
    labels = ["a photo of a cat", "a photo of a dog", "a red car"]
    labels_file = tmp_path / "labels.txt"
    labels_file.write_text("\n".join(labels) + "\n\n", encoding="utf-8")
    from batchline.models.selection import parse_labels

    model = _load(folder, labels=parse_labels(str(labels_file)))
    items, pixels = _pixels(model)
    results = model.run_batch(items)
    with torch.no_grad():
        out = _reference(folder, "SiglipModel")(
            input_ids=_siglip_ids(folder, labels), pixel_values=pixels
        )
    want = torch.sigmoid(out.logits_per_image).numpy()
    got = np.array([[r["scores"][label] for label in labels] for r in results])
    assert np.abs(got - want).max() <= 1e-4


def test_detection_describes_each_family(image_folders: Path) -> None:
    from batchline.models.hf import detect_folder

    lines = {f: detect_folder(build_folder(image_folders, f)).describe() for f in ("vit", "clip")}
    assert (
        lines["vit"]
        == "image classifier (ViTForImageClassification, 3 labels: tabby, beagle, sports car)"
    )
    assert lines["clip"] == "image-text embedder (CLIPModel, texts and images)"
