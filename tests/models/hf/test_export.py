"""``export_encoder``: tiny random-weight encoders of each architecture, saved with
``save_pretrained``, converted to ONNX and run by ONNX Runtime, equal transformers in fp32 on
padded batches of other shapes than the traced one (max abs diff ≤ 1e-4), for both heads."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
ort = pytest.importorskip("onnxruntime")

from batchline._commands import install_command  # noqa: E402
from batchline._errors import ModelError  # noqa: E402
from batchline.models.hf import export  # noqa: E402
from batchline.models.hf.export import export_encoder  # noqa: E402

VOCAB = 100
_SIZES = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4}

# architecture -> (config class, its options: hidden 32, 2 layers, a small vocabulary)
CONFIGS: dict[str, tuple[str, dict[str, Any]]] = {
    "bert": ("BertConfig", {**_SIZES, "intermediate_size": 64, "max_position_embeddings": 64}),
    # RoBERTa and XLM-R as released: one token type, positions offset by the pad id
    "roberta": (
        "RobertaConfig",
        {**_SIZES, "intermediate_size": 64, "max_position_embeddings": 66, "type_vocab_size": 1},
    ),
    "xlm-roberta": (
        "XLMRobertaConfig",
        {**_SIZES, "intermediate_size": 64, "max_position_embeddings": 66, "type_vocab_size": 1},
    ),
    "distilbert": (
        "DistilBertConfig",
        {"dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64, "max_position_embeddings": 64},
    ),
    "mpnet": ("MPNetConfig", {**_SIZES, "intermediate_size": 64, "max_position_embeddings": 66}),
    # local attention of 16 tokens every other layer: the probe's 23 tokens go beyond it
    "modernbert": (
        "ModernBertConfig",
        {
            **_SIZES,
            "intermediate_size": 64,
            "max_position_embeddings": 64,
            "global_attn_every_n_layers": 2,
            "local_attention": 16,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "cls_token_id": 1,
            "sep_token_id": 2,
        },
    ),
}
HEADS = ("hidden", "logits")


def _save(root: Path, arch: str, head: str) -> Path:
    config_class, options = CONFIGS[arch]
    config = getattr(transformers, config_class)(vocab_size=VOCAB, num_labels=3, **options)
    auto = (
        transformers.AutoModel
        if head == "hidden"
        else transformers.AutoModelForSequenceClassification
    )
    torch.manual_seed(0)
    model = auto.from_config(config)
    folder = root / f"{arch}-{head}"
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("encoders")
    return {(a, h): _save(root, a, h) for a in CONFIGS for h in HEADS}


@pytest.fixture(scope="module")
def exported(
    folders: dict[tuple[str, str], Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, str], Path]:
    out = tmp_path_factory.mktemp("onnx")
    targets = {}
    for (arch, head), folder in folders.items():
        targets[arch, head] = out / f"{arch}-{head}.onnx"
        export_encoder(folder, head=head, target=targets[arch, head])  # type: ignore[arg-type]
    return targets


def _batch(config: Any, lengths: list[int], *, pairs: bool) -> dict[str, np.ndarray[Any, Any]]:
    rng = np.random.default_rng(7)
    width = max(lengths)
    ids = rng.integers(5, VOCAB, size=(len(lengths), width), dtype=np.int64)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids[mask == 0] = config.pad_token_id or 0
    feeds = {"input_ids": ids, "attention_mask": mask}
    if pairs:  # a second segment in each row, as a cross-encoder's (query, document)
        feeds["token_type_ids"] = (np.arange(width)[None, :] >= 3).astype(np.int64) * mask
    return feeds


@pytest.mark.slow  # the first one converts all twelve (~15 s on a shared 2-core machine)
@pytest.mark.parametrize("head", HEADS)
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_export_equals_transformers_on_a_padded_batch(
    arch: str,
    head: str,
    folders: dict[tuple[str, str], Path],
    exported: dict[tuple[str, str], Path],
) -> None:
    target = exported[arch, head]
    assert [p.name for p in target.parent.glob(f"{target.name}*")] == [target.name]  # one file
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    pairs = arch == "bert"  # the only one here with two token types
    expected = ["input_ids", "attention_mask"] + (["token_type_ids"] if pairs else [])
    assert names == expected
    assert all(i.type == "tensor(int64)" for i in session.get_inputs())
    (output,) = session.get_outputs()
    meta = session.get_modelmeta().custom_metadata_map
    assert (meta["batchline.architecture"], meta["batchline.head"]) == (arch, head)
    assert output.type == "tensor(float)"
    auto = (
        transformers.AutoModel
        if head == "hidden"
        else transformers.AutoModelForSequenceClassification
    )
    reference = auto.from_pretrained(folders[arch, head], dtype=torch.float32).eval()
    for lengths in ([23, 9, 1, 17], [4]):  # neither is the traced (2, 8) shape
        feeds = _batch(reference.config, lengths, pairs=pairs)
        got = session.run(None, feeds)[0]
        with torch.no_grad():
            out = reference(**{k: torch.from_numpy(v) for k, v in feeds.items()})
        if head == "hidden":
            assert output.name == "last_hidden_state"
            want = out.last_hidden_state.numpy()
            assert got.shape == (len(lengths), max(lengths), 32)
            real = feeds["attention_mask"].astype(bool)  # padding positions are not compared
            assert np.abs(got - want)[real].max() <= 1e-4
        else:
            assert output.name == "logits"
            want = out.logits.numpy()
            assert got.shape == (len(lengths), 3)
            assert np.abs(got - want).max() <= 1e-4


def test_a_graph_over_two_gigabytes_keeps_its_weights_in_one_file_beside_it(
    folders: dict[tuple[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "MAX_INLINE_BYTES", 0)  # as if the weights were over 2 GB
    target = tmp_path / "big.onnx"
    export_encoder(folders["bert", "hidden"], head="hidden", target=target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    assert target.stat().st_size < (tmp_path / "big.onnx.data").stat().st_size
    session = ort.InferenceSession(str(target), providers=["CPUExecutionProvider"])
    feeds = _batch(transformers.BertConfig(), [6, 3], pairs=True)
    assert session.run(None, feeds)[0].shape == (2, 6, 32)


def test_a_logits_export_of_a_folder_without_a_classifier_is_refused(
    folders: dict[tuple[str, str], Path], tmp_path: Path
) -> None:
    with pytest.raises(ModelError, match="does not hold a trained sequence classifier") as e:
        export_encoder(folders["bert", "hidden"], head="logits", target=tmp_path / "x.onnx")
    assert "bert" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_an_export_that_does_not_reproduce_the_model_is_refused_and_not_written(
    folders: dict[tuple[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(export, "_TOLERANCE", -1.0)  # no graph can pass: the check runs
    with pytest.raises(ModelError, match=r"export of mpnet differs .* cannot be converted"):
        export_encoder(folders["mpnet", "hidden"], head="hidden", target=tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no temp left


def test_missing_torch_says_the_exact_install_in_one_line(
    folders: dict[tuple[str, str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` fails as if not installed
    with pytest.raises(ModelError) as caught:
        export_encoder(folders["bert", "hidden"], head="hidden", target=tmp_path / "b.onnx")
    message = str(caught.value)
    assert "\n" not in message
    assert install_command("generate") in message
    assert "torch==2.13.0" in message
    assert "(bert)" in message
    assert "torch is missing" in message


def test_a_folder_without_config_and_an_unknown_head_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match=r"cannot read .*config\.json"):
        export_encoder(tmp_path, head="hidden", target=tmp_path / "x.onnx")
    with pytest.raises(ValueError, match="head must be hidden or logits"):
        export_encoder(tmp_path, head="pooled", target=tmp_path / "x.onnx")  # type: ignore[arg-type]
