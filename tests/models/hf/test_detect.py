"""Folder detection from JSON alone: every supported shape, the task overrides, and a
one-line error for every refused shape (no torch needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from batchline._errors import InputError
from batchline.models.common.folder import detect_folder
from batchline.models.specs import parse_spec, parse_specs
from tests.models.hf.conftest import st_modules, write_json

BERT = {"architectures": ["BertModel"], "model_type": "bert", "max_position_embeddings": 512}


def folder(
    tmp_path: Path,
    config: dict[str, Any] | None = BERT,
    *,
    weights: str | None = "model.safetensors",
    tokenizer: bool = True,
    name: str = "m",
) -> Path:
    path = tmp_path / name
    path.mkdir(parents=True)
    if config is not None:
        write_json(path / "config.json", config)
    if weights:
        (path / weights).write_bytes(b"")
    if tokenizer:
        write_json(path / "tokenizer.json", {})
    return path


def classifier(labels: int) -> dict[str, Any]:
    return {
        "architectures": ["BertForSequenceClassification"],
        "model_type": "bert",
        "id2label": {str(i): f"L{i}" for i in range(labels)},
    }


def refused(path: Path, match: str, *, task: str | None = None) -> str:
    with pytest.raises(InputError, match=match) as info:
        parse_specs([f"{path}/"], tasks=[task] if task else [])
    message = str(info.value)
    assert "\n" not in message
    return message


# -- what is detected ----------------------------------------------------------------------


def test_a_legacy_sentence_transformers_folder_embeds_with_its_pooling(tmp_path: Path) -> None:
    path = st_modules(
        folder(tmp_path),
        pooling={"pooling_mode_mean_tokens": True, "pooling_mode_cls_token": False},
        normalize=True,
        max_seq_length=256,
    )
    spec = parse_spec(f"{path}/")
    assert (spec.kind, spec.task, spec.name, spec.generates) == ("hf", "embed", "m", False)
    found = spec.folder
    assert found is not None
    assert (found.pooling, found.normalize, found.max_seq_length) == ("mean", True, 256)
    assert found.describe() == (
        "sentence-transformers folder (BertModel, mean pooling, normalized, 256 tokens)"
    )


def test_cls_pooling_dense_and_normalize_are_read(tmp_path: Path) -> None:
    dense = {
        "in_features": 32,
        "out_features": 16,
        "bias": True,
        "activation_function": "torch.nn.modules.activation.Tanh",
    }
    path = st_modules(folder(tmp_path), pooling="cls", dense=[dense], normalize=True)
    found = detect_folder(path)
    assert (found.task, found.pooling, found.normalize) == ("embed", "cls", True)
    (layer,) = found.dense
    assert (layer.in_features, layer.out_features, layer.activation) == (32, 16, "tanh")
    assert "dense 32->16 tanh" in found.describe()


def test_a_transformer_module_in_its_own_subfolder(tmp_path: Path) -> None:
    root = tmp_path / "old"
    inner = folder(root, name="0_Transformer")  # its tokenizer.json beside the weights
    write_json(root / "1_Pooling" / "config.json", {"pooling_mode": "mean"})
    write_json(
        root / "modules.json",
        [
            {"idx": 0, "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
            {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        ],
    )
    found = detect_folder(root)
    assert (found.task, found.encoder_folder, found.weights, found.tokenizer) == (
        "embed",
        inner,
        inner / "model.safetensors",
        inner / "tokenizer.json",
    )


def test_a_decoder_embedder_pools_its_last_token(tmp_path: Path) -> None:
    qwen = {"architectures": ["Qwen3Model"], "model_type": "qwen3"}
    path = st_modules(folder(tmp_path, qwen), pooling="lasttoken", normalize=True)
    found = detect_folder(path)
    assert (found.task, found.pooling, found.decoder) == ("embed", "lasttoken", True)


def test_a_plain_encoder_is_assumed_mean_pooled_and_normalized(tmp_path: Path) -> None:
    found = detect_folder(folder(tmp_path))
    assert (found.task, found.pooling, found.normalize, found.assumed) == (
        "embed",
        "mean",
        True,
        True,
    )
    assert "no modules.json: pooling assumed" in found.describe()
    assert found.max_seq_length == 512  # the position table, with no tokenizer_config


def test_a_sequence_classifier_classifies_with_its_labels(tmp_path: Path) -> None:
    path = folder(tmp_path / "x", classifier(3))
    write_json(path / "tokenizer_config.json", {"model_max_length": 128})
    spec = parse_spec(f"{path}/")
    assert spec.task == "classify"
    assert spec.folder is not None
    assert (spec.folder.labels, spec.folder.max_seq_length) == (("L0", "L1", "L2"), 128)
    assert spec.folder.describe() == (
        "sequence classifier (BertForSequenceClassification, 3 labels: L0, L1, L2)"
    )


def test_one_label_or_a_cross_encoder_layout_scores(tmp_path: Path) -> None:
    one = detect_folder(folder(tmp_path, classifier(1), name="one"))
    assert (one.task, one.layout, one.activation) == ("score", "transformers", "sigmoid")
    ce = folder(tmp_path, classifier(1), name="ce")
    write_json(ce / "modules.json", [{"idx": 0, "path": "", "type": "x.Transformer"}])
    write_json(
        ce / "config_sentence_transformers.json",
        {"model_type": "CrossEncoder", "activation_fn": "torch.nn.modules.linear.Identity"},
    )
    found = detect_folder(ce)
    assert (found.task, found.layout, found.activation) == ("score", "cross-encoder", "identity")
    old = folder(
        tmp_path,
        {**classifier(1), "sentence_transformers": {"activation_fn": "torch.nn.Sigmoid"}},
        name="old",
    )
    assert detect_folder(old).layout == "cross-encoder"
    # a cross-encoder with several labels (NLI) classifies
    nli = folder(tmp_path, {**classifier(3), "sentence_transformers": {}}, name="nli")
    assert detect_folder(nli).task == "classify"


def test_a_causal_lm_generates_without_tokenizer_json(tmp_path: Path) -> None:
    path = folder(tmp_path, {"architectures": ["LlamaForCausalLM"]}, tokenizer=False)
    spec = parse_spec(f"{path}/")
    assert (spec.kind, spec.task, spec.generates) == ("hf", "generate", True)
    refused(path, "causal-LM folder .*does generate, not embed", task="embed")


def test_a_folder_with_model_onnx_is_the_onnx_path(tmp_path: Path) -> None:
    path = folder(tmp_path, None, weights="model.onnx")
    spec = parse_spec(f"{path}/")
    assert (spec.kind, spec.source, spec.task, spec.name) == (
        "onnx",
        str(path / "model.onnx"),
        None,
        "m",
    )
    assert parse_specs([f"{path}/"], tasks=["score"])[0].task == "score"
    refused(path, "cannot generate text", task="generate")
    scorer = folder(tmp_path, classifier(1), weights="model.onnx", name="s")
    assert parse_spec(f"{scorer}/").task == "score"
    assert parse_spec(
        f"{folder(tmp_path, classifier(2), weights='model.onnx', name='c')}/"
    ).task == ("classify")


def test_a_causal_lm_with_an_onnx_graph(tmp_path: Path) -> None:
    """onnxruntime-genai's folder (model.onnx beside a *ForCausalLM config) is refused; with
    the safetensors weights there too, the folder generates as any causal LM."""
    llama = {"architectures": ["LlamaForCausalLM"]}
    genai = folder(tmp_path, llama, weights="model.onnx", name="genai")
    refused(genai, r"a causal LM as ONNX \(model\.onnx, LlamaForCausalLM\) is not supported")
    (genai / "model.safetensors").write_bytes(b"")
    assert parse_spec(f"{genai}/").kind == "hf"
    assert parse_spec(f"{genai}/").generates


def test_task_overrides_that_make_sense_and_those_that_do_not(tmp_path: Path) -> None:
    ce = folder(tmp_path, {**classifier(1), "sentence_transformers": {}}, name="ce")
    refused(ce, "one label, so it scores pairs", task="classify")
    three = folder(tmp_path, classifier(3), name="three")
    refused(three, "takes a one-label classifier .* this one has 3 labels", task="score")
    assert parse_specs([f"{three}/"], tasks=["classify"])[0].task == "classify"
    emb = folder(tmp_path, name="emb")
    refused(emb, "it does embed, not classify", task="classify")
    refused(emb, "it does embed, not generate", task="generate")
    # pooling and normalize override an embedder's; they do not go with another task
    spec = parse_specs([f"{emb}/"], pooling="cls", normalize=False)[0]
    assert (spec.pooling, spec.normalize) == ("cls", False)
    with pytest.raises(InputError, match="go with the embed task"):
        parse_specs([f"{three}/"], pooling="cls")


# -- what is refused, one line each ---------------------------------------------------------


def test_an_empty_folder(tmp_path: Path) -> None:
    path = tmp_path / "empty"
    path.mkdir()
    message = refused(path, r"not a Hugging Face model folder \(no config\.json\)")
    assert "supported: a sentence-transformers folder" in message


def test_a_missing_folder(tmp_path: Path) -> None:
    refused(tmp_path / "nowhere", "no such model file or folder")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ("{not json", r"config\.json is not valid JSON"),
        ("[1, 2]", r"config\.json must hold a JSON object"),
        ("{}", "names no architecture and no model_type"),
        ('{"architectures": ["WhisperForAudioClassification"]}', "architecture .* not supported"),
        (
            '{"architectures": ["BertForSequenceClassification"], "id2label": {"0": "a", "2": 1}}',
            r"id2label ids must be 0\.\.1",
        ),
    ],
)
def test_a_config_that_cannot_be_used(tmp_path: Path, config: str, match: str) -> None:
    path = folder(tmp_path, None)
    (path / "config.json").write_text(config, encoding="utf-8")
    refused(path, match)


def test_missing_weights_and_missing_tokenizer(tmp_path: Path) -> None:
    no_weights = folder(tmp_path, weights=None, name="w")
    refused(no_weights, r"BertModel folder without weights \(looked for model\.safetensors")
    no_tok = folder(tmp_path, classifier(2), tokenizer=False, name="t")
    refused(no_tok, r"no tokenizer\.json; save the fast tokenizer")


@pytest.mark.parametrize(
    ("pooling", "dense", "extra", "match"),
    [
        ("max", None, None, "uses 'max' pooling; supported: mean, cls, lasttoken"),
        (["mean", "cls"], None, None, r"uses \['mean', 'cls'\] pooling"),
        (
            "mean",
            [{"in_features": 32, "out_features": 8, "activation_function": "x.GELU"}],
            None,
            "Dense module 2_Dense has activation 'x.GELU'",
        ),
        ("mean", None, "LayerNorm", "module 'LayerNorm' .* is not supported here"),
    ],
)
def test_sentence_transformers_modules_that_are_not_supported(
    tmp_path: Path, pooling: Any, dense: Any, extra: str | None, match: str
) -> None:
    path = st_modules(folder(tmp_path), pooling=pooling, dense=dense)
    if extra:
        modules = [
            *__import__("json").loads((path / "modules.json").read_text()),
            {"idx": 9, "path": "9_X", "type": f"sentence_transformers.models.{extra}"},
        ]
        write_json(path / "modules.json", modules)
    refused(path, match)


def test_modules_json_without_a_transformer_or_a_pooling(tmp_path: Path) -> None:
    path = folder(tmp_path, name="a")
    write_json(path / "modules.json", [{"idx": 0, "path": "p", "type": "x.StaticEmbedding"}])
    refused(path, r"without a Transformer module \(modules: StaticEmbedding\)")
    other = folder(tmp_path, name="b")
    write_json(other / "modules.json", [{"idx": 0, "path": "", "type": "x.Transformer"}])
    refused(other, "without a Pooling module")
    broken = folder(tmp_path, name="c")
    (broken / "modules.json").write_text("{", encoding="utf-8")
    refused(broken, r"modules\.json is not readable JSON")


def test_cross_encoders_that_cannot_be_used(tmp_path: Path) -> None:
    wrong = folder(tmp_path, name="a")
    write_json(wrong / "config_sentence_transformers.json", {"model_type": "CrossEncoder"})
    refused(wrong, r"a cross-encoder needs a \*ForSequenceClassification config, found 'BertModel'")
    softmax = folder(
        tmp_path,
        {**classifier(1), "sentence_transformers": {"activation_fn": "x.Softmax"}},
        name="b",
    )
    refused(softmax, "activation 'x.Softmax' is not supported")


def test_broken_weights_are_one_line_at_load(tmp_path: Path) -> None:
    """Detection reads JSON only; a weights file that is not safetensors fails the
    conversion with one line (no traceback), and nothing half-written stays in the cache."""
    from batchline._errors import ModelError
    from batchline.knobs import Knobs
    from batchline.models.loader import load_model

    path = folder(tmp_path, {**BERT, "hidden_size": 32, "num_attention_heads": 4})
    (path / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(ModelError, match=r"cannot convert it to ONNX \(") as info:
        load_model(parse_spec(f"{path}/"), Knobs())
    assert "\n" not in str(info.value)
    cache = Path(os.environ["BATCHLINE_CACHE_DIR"]) / "hf"
    assert not [p for p in cache.iterdir() if p.suffix == ".onnx" and p.name.startswith("m-")]


def test_the_cli_says_it_in_one_line(tmp_path: Path) -> None:
    """A refused folder from `batchline run`: one line on stderr, exit 2, no traceback."""
    path = tmp_path / "empty"
    path.mkdir()
    texts = tmp_path / "t.txt"
    texts.write_text("hello\n", encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-m", "batchline", "run", str(texts), "--model", f"{path}/"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "no config.json" in lines[0]


def test_detection_and_the_face_import_nothing_heavy() -> None:
    """A PATH/ spec is read with the standard library: `--help` and parse_spec need no extra."""
    code = (
        "import sys, batchline.models.hf as hf, batchline.models.specs\n"
        "assert hf.detect_folder.__module__ == 'batchline.models.common.folder'\n"
        "heavy = {'numpy', 'onnx', 'onnxruntime', 'torch', 'transformers', 'tokenizers'}\n"
        "print(sorted(heavy & set(sys.modules)))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (0, "[]"), done.stderr
