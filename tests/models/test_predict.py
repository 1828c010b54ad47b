"""OnnxPredictor: any ONNX model, rows of tensors in and out, checked row by row."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest

from batchline._errors import FixedBatchAxisError, InputError
from batchline.models.batching import ModelBatcher
from batchline.models.config import Knobs
from batchline.models.onnx.predict import OnnxPredictor, TensorRow, load_predictor
from batchline.models.protocol import BatchModel
from batchline.models.specs import parse_spec

from .onnx_builders import IMAGE_SHAPE, image_classifier, sequence_scorer

Array = np.ndarray[Any, Any]
KNOBS = Knobs(sessions=2, intra_op_threads=1, max_concurrent_batches=2)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("predict")


@pytest.fixture(scope="module")
def image_model(folder: Path) -> Path:
    return image_classifier(folder)


@pytest.fixture(scope="module")
def images() -> Array:
    return np.random.default_rng(3).normal(size=(7, *IMAGE_SHAPE)).astype(np.float32)


@pytest.fixture(scope="module")
def predictor(image_model: Path) -> OnnxPredictor:
    return load_predictor(parse_spec(str(image_model)), KNOBS)


def direct(path: Path, feeds: dict[str, Array]) -> dict[str, Array]:
    """What ONNX Runtime itself returns for ``feeds`` (no batchline in between)."""
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    return dict(zip(names, sess.run(names, feeds), strict=True))


def ok(prepared: list[TensorRow | BaseException]) -> list[TensorRow]:
    assert all(isinstance(p, TensorRow) for p in prepared), prepared
    return [p for p in prepared if isinstance(p, TensorRow)]


def test_info_and_details(predictor: OnnxPredictor) -> None:
    info = predictor.info
    assert isinstance(predictor, BatchModel)
    assert (info.name, info.task, info.input_kind) == ("image_classifier", "predict", "tensors")
    assert (info.cost_kind, info.result_kind, info.result_column) == (
        "additive",
        "tensors",
        "outputs",
    )
    assert info.details == {
        "inputs": [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 8, 8]}],
        "outputs": [{"name": "logits", "datatype": "FP32", "shape": [-1, 5]}],
    }
    json.dumps(info.details)
    assert predictor.sessions == 2


def test_outputs_equal_onnxruntime_batched_and_one_by_one(
    predictor: OnnxPredictor, image_model: Path, images: Array
) -> None:
    want = direct(image_model, {"input": images})["logits"]
    rows = ok(predictor.prepare([{"input": im} for im in images]))
    assert all(predictor.cost(r) == 1 for r in rows)
    batched = predictor.run_batch(rows)
    assert len(batched) == len(images)
    for got, row in zip(batched, want, strict=True):
        assert list(got) == ["logits"]
        np.testing.assert_allclose(got["logits"], row, rtol=1e-5, atol=1e-5)
    for i, row in enumerate(rows):
        (alone,) = predictor.run_batch([row])
        one = direct(image_model, {"input": images[i : i + 1]})["logits"][0]
        np.testing.assert_allclose(alone["logits"], one, rtol=1e-5, atol=1e-5)


def test_a_single_input_model_takes_a_bare_array(predictor: OnnxPredictor, images: Array) -> None:
    bare, named = ok(predictor.prepare([images[0], {"input": images[0]}]))
    a, b = predictor.run_batch([bare, named])
    np.testing.assert_array_equal(a["logits"], b["logits"])


def test_encode_keeps_the_models_arrays_and_dtype(predictor: OnnxPredictor, images: Array) -> None:
    """No Python lists on the way out: the sink writes the arrays in their own dtype (JSON
    numbers only where JSON is written: tests/jobs/test_run_models.py)."""
    (result,) = predictor.run_batch(ok(predictor.prepare([images[0]])))
    encoded = predictor.encode(result)
    logits = encoded["logits"]
    assert isinstance(logits, np.ndarray)
    assert logits.dtype == np.float32
    assert logits.shape == (5,)
    want = direct(predictor.model.path, {"input": images[:1]})["logits"][0]
    np.testing.assert_array_equal(logits, want)


def test_json_lists_and_ints_are_cast_to_float32(predictor: OnnxPredictor, images: Array) -> None:
    as_lists = images[0].astype(np.float64).tolist()
    ints = np.ones(IMAGE_SHAPE, dtype=np.int64)
    a, b = ok(predictor.prepare([{"input": as_lists}, {"input": ints}]))
    assert a.arrays["input"].dtype == np.float32
    assert b.arrays["input"].dtype == np.float32
    np.testing.assert_allclose(a.arrays["input"], images[0], rtol=1e-6)


def test_bad_rows_fail_alone_with_a_clear_error(predictor: OnnxPredictor, images: Array) -> None:
    good = {"input": images[0]}
    prepared = predictor.prepare(
        [
            good,
            {"pixels": images[0]},  # wrong name
            {"input": images[0][:, :4]},  # wrong shape
            {"input": images[0][None]},  # batch axis kept
            {"input": np.full(IMAGE_SHAPE, "x")},  # wrong dtype
            {"input": [[1, 2], [3]]},  # ragged
            "a string",
            good,
        ]
    )
    errors = [p for p in prepared if isinstance(p, BaseException)]
    assert len(errors) == 6
    assert all(isinstance(e, InputError) for e in errors)
    messages = [str(e) for e in errors]
    assert "missing ['input']; unknown ['pixels']" in messages[0]
    assert "takes rows of shape [3, 8, 8] (the batch axis left out), got [3, 4, 8]" in messages[1]
    assert "a row leaves the batch axis out" in messages[2]
    assert "input 'input' takes float32 values, got str" in messages[3]
    assert "not a rectangular array" in messages[4]
    assert "pass each row as a mapping" in messages[5]
    rows = [p for p in prepared if isinstance(p, TensorRow)]
    assert len(rows) == 2
    assert len(predictor.run_batch(rows)) == 2


def test_fixed_batch_axis_is_refused_with_how_to_re_export(folder: Path) -> None:
    fixed = image_classifier(folder, batch=2)
    with pytest.raises(FixedBatchAxisError, match=r"fixed batch dimension 2.*dynamic_axes"):
        load_predictor(parse_spec(str(fixed)), KNOBS)


def test_baseline_layout_is_one_shared_session(image_model: Path) -> None:
    knobs = Knobs(batching=False, sessions=1, intra_op_threads=2)
    model = load_predictor(parse_spec(str(image_model)), knobs)
    assert model.sessions == 1
    assert model.model.shared


def test_a_tokenizer_does_not_go_with_predict(image_model: Path, folder: Path) -> None:
    tok = folder / "tokenizer.json"
    tok.write_text("{}")
    spec = parse_spec(str(image_model)).with_options(task="predict", tokenizer=tok)
    with pytest.raises(InputError, match="tokenizer goes with the embed and classify"):
        load_predictor(spec, KNOBS)


# -- several inputs, dynamic dimensions, element types --------------------------------------------


@pytest.fixture(scope="module")
def scorer_path(folder: Path) -> Path:
    return sequence_scorer(folder)


@pytest.fixture(scope="module")
def scorer(scorer_path: Path) -> OnnxPredictor:
    return load_predictor(parse_spec(str(scorer_path)), KNOBS)


def test_scorer_details_mark_dynamic_dims(scorer: OnnxPredictor) -> None:
    assert scorer.info.details == {
        "inputs": [
            {"name": "values", "datatype": "FP32", "shape": [-1, -1]},
            {"name": "weight", "datatype": "INT64", "shape": [-1]},
        ],
        "outputs": [
            {"name": "total", "datatype": "FP32", "shape": [-1]},
            {"name": "doubled", "datatype": "FP32", "shape": [-1, -1]},
        ],
    }


def test_rows_of_different_lengths_run_apart_and_keep_order(
    scorer: OnnxPredictor, scorer_path: Path
) -> None:
    rng = np.random.default_rng(5)
    lengths = [3, 5, 3, 1, 5, 3, 0]
    rows = [
        {"values": rng.normal(size=n).astype(np.float32), "weight": np.int64(i + 1)}
        for i, n in enumerate(lengths)
    ]
    calls: list[dict[str, tuple[int, ...]]] = []
    real_run = scorer.model.run

    def spy(feeds: Any, output_names: Any = None) -> dict[str, Array]:
        calls.append({k: np.shape(v) for k, v in feeds.items()})
        return real_run(feeds, output_names)

    scorer.model.run = spy  # type: ignore[method-assign]
    try:
        results = scorer.run_batch(ok(scorer.prepare(rows)))
    finally:
        del scorer.model.run
    # one call per distinct length, never a padded mix
    assert sorted(c["values"] for c in calls) == [(1, 0), (1, 1), (2, 5), (3, 3)]
    for row, got in zip(rows, results, strict=True):
        want = direct(
            scorer_path, {"values": row["values"][None], "weight": np.array([row["weight"]])}
        )
        assert got["doubled"].shape == row["values"].shape
        np.testing.assert_allclose(got["doubled"], want["doubled"][0], rtol=1e-6)
        np.testing.assert_allclose(got["total"], want["total"][0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("weight", "accepted"),
    [
        (np.int32(3), True),
        (3.0, True),  # a whole number from JSON
        (True, True),
        (2.5, False),  # a fraction would be lost
        (float("nan"), False),
        (2**70, False),  # beyond int64
        ("3", False),
    ],
)
def test_int_inputs_take_only_values_that_survive_the_cast(
    scorer: OnnxPredictor, weight: object, accepted: bool
) -> None:
    (prepared,) = scorer.prepare([{"values": [1.0, 2.0], "weight": weight}])
    if accepted:
        assert isinstance(prepared, TensorRow)
        assert prepared.arrays["weight"].dtype == np.int64
    else:
        assert isinstance(prepared, InputError)
        assert "input 'weight' takes int64 values" in str(prepared)


def test_float_inputs_refuse_an_overflow(scorer: OnnxPredictor) -> None:
    (prepared,) = scorer.prepare([{"values": np.array([1e300]), "weight": 1}])
    assert isinstance(prepared, InputError)
    assert "input 'values' takes float32 values, got float64 values that would change" in str(
        prepared
    )


def test_a_multi_input_model_needs_a_mapping(scorer: OnnxPredictor) -> None:
    (prepared,) = scorer.prepare([np.zeros(3)])
    assert isinstance(prepared, InputError)
    assert "takes the inputs ['values', 'weight']" in str(prepared)


@pytest.mark.anyio
async def test_engine_batches_predictor_rows(predictor: OnnxPredictor, images: Array) -> None:
    rows = ok(predictor.prepare([{"input": im} for im in images]))
    knobs = KNOBS.replace(batch_timeout_s=0.0, max_batch_size=4)
    async with ModelBatcher(predictor, knobs) as engine:
        futures = [await engine.submit(r) for r in rows]
        results = [await f for f in futures]
        stats = engine.stats
    want = predictor.run_batch(rows)
    for got, exp in zip(results, want, strict=True):
        np.testing.assert_allclose(got["logits"], exp["logits"], rtol=1e-6)
    assert stats.total_completed == len(rows)
