"""``--quantize int8``: the int8 graph of an embedding model, used only past the quality gate
against its float32 graph, and refused with the figures when it misses."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime")

from batchline._errors import InputError
from batchline.jobs import quantized as gate_module
from batchline.jobs.run import RunOptions, run
from batchline.models.config import Knobs
from batchline.models.identity import model_identity
from batchline.models.onnx import GATE, Quality, measure_quality
from batchline.models.specs import parse_spec

#: a gate of fewer texts than the job's 2,000, so that the test measures in seconds
SMALL_GATE = Quality(mean_cosine=GATE.mean_cosine, top10_overlap=GATE.top10_overlap, texts=200)


class _Vectors:
    """A stand-in embedder: each text's vector from a fixed table, plus optional noise."""

    def __init__(self, table: dict[str, np.ndarray], noise: float = 0.0) -> None:
        self.table = table
        self.rng = np.random.default_rng(1)
        self.noise = noise

    def prepare(self, texts: list[str]) -> list[str]:
        return texts

    def embed_tokens(self, batch: list[str]) -> np.ndarray:
        out = np.stack([self.table[t] for t in batch])
        return out + self.noise * self.rng.standard_normal(out.shape).astype(np.float32)


def test_the_same_vectors_are_a_perfect_match_and_noise_lowers_both_figures() -> None:
    rng = np.random.default_rng(0)
    texts = [f"text {i}" for i in range(60)]
    table = {t: rng.standard_normal(16).astype(np.float32) for t in texts}
    same = measure_quality(_Vectors(table), _Vectors(table), texts, batch=7)
    assert same == Quality(mean_cosine=pytest.approx(1.0), top10_overlap=1.0, texts=60)
    assert same.shortfalls(GATE) == []
    noisy = measure_quality(_Vectors(table), _Vectors(table, noise=0.5), texts)
    assert noisy.mean_cosine < 0.99
    assert noisy.top10_overlap < 1.0
    missed = noisy.shortfalls(GATE)
    assert len(missed) == 2
    assert missed[0].startswith(f"mean cosine {noisy.mean_cosine:.4f} < 0.99 (short by ")
    with pytest.raises(InputError, match="more than 10 texts"):
        measure_quality(_Vectors(table), _Vectors(table), texts[:10])


def test_the_knob_takes_int8_only_and_applies_to_embedding_models(tmp_path: Path) -> None:
    assert Knobs(quantize="int8").quantize == "int8"
    with pytest.raises(InputError, match="quantize must be int8 or unset, got 'int4'"):
        Knobs(quantize="int4")
    from batchline.models.loader import load_model

    predictor = tmp_path / "tiny.onnx"
    _tiny_predictor(predictor)
    spec = parse_spec(str(predictor)).with_options(task="predict")
    with pytest.raises(InputError, match=r"--quantize int8 applies to embedding models"):
        load_model(spec, Knobs(quantize="int8"))


def test_int8_results_are_cached_apart_from_float32() -> None:
    spec = parse_spec("default")
    plain, quick = model_identity(spec, Knobs()), model_identity(spec, Knobs(quantize="int8"))
    assert plain is not None
    assert plain != quick


@pytest.mark.slow
def test_run_int8_passes_the_gate_says_so_and_stays_close_to_float32(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gate_module, "GATE", SMALL_GATE)
    texts = [f"Record {i}: batching keeps the device busy and loses nothing." for i in range(30)]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)))
    outputs = {}
    for name, quantize in (("fp32", None), ("int8", "int8")):
        summary = run(
            RunOptions(
                input=data, output=tmp_path / name, knobs=Knobs(sessions=1, quantize=quantize)
            )
        )
        assert summary.records == 30
        outputs[name] = summary
    rows = dict(outputs["int8"].rows())
    assert rows["quantized"].startswith("int8: mean cosine 0.9")
    assert "quantized" not in dict(outputs["fp32"].rows())

    from batchline.datasets.sinks import read_arrays

    a, b = read_arrays(tmp_path / "fp32"), read_arrays(tmp_path / "int8")
    cosine = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert cosine.min() > 0.95
    assert not np.array_equal(a, b)  # it did run the int8 graph


@pytest.mark.slow
def test_a_model_that_misses_the_gate_is_refused_with_its_figures(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    strict = Quality(mean_cosine=0.99999, top10_overlap=0.9, texts=SMALL_GATE.texts)
    monkeypatch.setattr(gate_module, "GATE", strict)
    monkeypatch.setattr("batchline.models.onnx.quantize.GATE", strict)
    data = tmp_path / "docs.jsonl"
    data.write_text(json.dumps({"id": 1, "text": "one record"}) + "\n")
    with pytest.raises(InputError) as caught:
        run(RunOptions(input=data, output=tmp_path / "out", knobs=Knobs(quantize="int8")))
    message = str(caught.value)
    assert "misses the quality gate on 200 demo-corpus texts: mean cosine 0.9" in message
    assert "< 0.99999 (short by" in message
    assert message.endswith("run it without --quantize")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _tiny_predictor(path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["y"])],
        "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))


@pytest.mark.slow
def test_serve_loads_int8_past_the_gate_and_refuses_it_below(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    pytest.importorskip("fastapi")
    from batchline.server.app import _default_loader

    monkeypatch.setattr(gate_module, "GATE", SMALL_GATE)
    load = _default_loader()
    spec = parse_spec("emb=default")
    model = load(spec, Knobs(sessions=1, quantize="int8"))
    try:
        assert Path(model.embedder.model.path).name.endswith("-int8-v1.onnx")
    finally:
        model.close()
    strict = Quality(mean_cosine=0.99999, top10_overlap=0.9, texts=SMALL_GATE.texts)
    monkeypatch.setattr(gate_module, "GATE", strict)
    with pytest.raises(InputError, match="misses the quality gate"):
        load(spec, Knobs(sessions=1, quantize="int8"))
