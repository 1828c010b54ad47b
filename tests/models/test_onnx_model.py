from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from batchline._errors import FixedBatchAxisError, InputError, ModelError
from batchline.models.onnx.runtime import (
    OnnxModel,
    _disabled_optimizers,
    _fixed_input_from_ort_message,
    pad_sequences,
    split_rows,
    stack_equal,
)


def _save(tmp_path: Path, graph: onnx.GraphProto, name: str) -> Path:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = tmp_path / f"{name}.onnx"
    onnx.save(model, str(path))
    return path


def _doubler(tmp_path: Path, batch: int | str = "batch") -> Path:
    """y = 2 * x, x of shape (batch, 4)."""
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "two"], ["y"])],
        "doubler",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, 4])],
        initializer=[numpy_helper.from_array(np.array(2.0, dtype=np.float32), "two")],
    )
    return _save(tmp_path, graph, f"doubler_{batch}")


def _reshape_baked(tmp_path: Path, shape: list[int]) -> Path:
    """Declares a dynamic batch, but reshapes to a constant shape inside the graph."""
    graph = helper.make_graph(
        [helper.make_node("Reshape", ["x", "shape"], ["y"])],
        "baked",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["rows", "cols"])],
        initializer=[numpy_helper.from_array(np.array(shape, dtype=np.int64), "shape")],
    )
    return _save(tmp_path, graph, "baked_" + "_".join(map(str, shape)))


def _token_sum(tmp_path: Path) -> Path:
    """(input_ids * attention_mask) summed over the sequence: (batch, seq) int64 -> (batch,)."""
    axes = numpy_helper.from_array(np.array([1], dtype=np.int64), "axes")
    graph = helper.make_graph(
        [
            helper.make_node("Mul", ["input_ids", "attention_mask"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "axes"], ["total"], keepdims=0),
        ],
        "token_sum",
        [
            helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "seq"]),
            helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "seq"]),
        ],
        [helper.make_tensor_value_info("total", TensorProto.INT64, ["batch"])],
        initializer=[axes],
    )
    return _save(tmp_path, graph, "token_sum")


def test_load_and_run_dynamic_model(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), sessions=2)
    assert model.sessions == 2
    assert model.input_names == ("x",)
    assert model.output_names == ("y",)
    assert model.providers[0] == "CPUExecutionProvider"
    x = np.arange(20, dtype=np.float32).reshape(5, 4)
    out = model.run({"x": x})
    np.testing.assert_array_equal(out["y"], 2 * x)


def test_run_casts_feeds_to_declared_dtype(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), sessions=1)
    out = model.run({"x": [[1, 2, 3, 4]]})
    assert out["y"].dtype == np.float32
    np.testing.assert_array_equal(out["y"], [[2, 4, 6, 8]])


def test_run_rejects_wrong_feeds(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), sessions=1)
    with pytest.raises(InputError, match=r"missing \['x'\]; unknown \['z'\]"):
        model.run({"z": np.zeros((1, 4), np.float32)})
    with pytest.raises(InputError, match="rank 2"):
        model.run({"x": np.zeros(4, np.float32)})


def test_runtime_failure_is_model_error(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), sessions=1)
    with pytest.raises(ModelError, match="ONNX Runtime failed"):
        model.run({"x": np.zeros((2, 5), np.float32)})


def test_fixed_batch_axis_is_refused_with_the_fix(tmp_path: Path) -> None:
    with pytest.raises(FixedBatchAxisError) as info:
        OnnxModel.load(_doubler(tmp_path, batch=2))
    msg = str(info.value)
    assert "'x'" in msg
    assert "fixed batch dimension 2" in msg
    assert "dynamic_axes={'x': {0: 'batch'}}" in msg
    assert "torch.onnx.export" in msg


def test_fixed_batch_axis_can_be_allowed(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path, batch=2), check_batch_axis=False)
    assert model.run({"x": np.ones((2, 4), np.float32)})["y"].shape == (2, 4)


def test_batch_baked_in_reshape_returning_wrong_rows_is_caught(tmp_path: Path) -> None:
    # A (n, 4) input reshaped to (2, -1) runs for n = 1, 2, 3 but always returns 2 rows.
    path = _reshape_baked(tmp_path, [2, -1])
    with pytest.raises(FixedBatchAxisError, match=r"output 'y'.* 2 rows for a batch of 1"):
        OnnxModel.load(path)


def test_batch_baked_in_reshape_that_fails_for_other_sizes_is_caught(tmp_path: Path) -> None:
    # Reshape to exactly (2, 4): batch 2 runs, 1 and 3 fail inside the graph.
    path = _reshape_baked(tmp_path, [2, 4])
    with pytest.raises(FixedBatchAxisError, match="runs with a batch of 2 but fails with a batch"):
        OnnxModel.load(path)


def test_probe_builds_int_inputs_with_symbolic_lengths(tmp_path: Path) -> None:
    model = OnnxModel.load(_token_sum(tmp_path))
    ids, mask = pad_sequences([[5, 6, 7], [8]])
    np.testing.assert_array_equal(
        model.run({"input_ids": ids, "attention_mask": mask})["total"], [18, 8]
    )


def test_ort_invalid_dimension_message_names_the_input() -> None:
    msg = (
        "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions for input: "
        "input_ids for the following indices\n index: 0 Got: 3 Expected: 2\n"
    )
    assert _fixed_input_from_ort_message(msg, ["input_ids", "attention_mask"]) == "input_ids"
    other = msg.replace("index: 0", "index: 1")
    assert _fixed_input_from_ort_message(other, ["input_ids"]) is None


def test_missing_file_is_model_error(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="not found"):
        OnnxModel.load(tmp_path / "nope.onnx")


def test_invalid_file_is_model_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    with pytest.raises(ModelError, match="could not load"):
        OnnxModel.load(bad)


@pytest.mark.skipif(
    "CUDAExecutionProvider" in ort.get_available_providers(), reason="CUDA is available here"
)
def test_unavailable_provider_says_what_to_install(tmp_path: Path) -> None:
    with pytest.raises(ModelError, match="onnxruntime-gpu"):
        OnnxModel.load(_doubler(tmp_path), providers=["cuda"])


def _residual_norm(tmp_path: Path) -> Path:
    """LayerNormalization(x + bias + skip): the pattern ONNX Runtime fuses into
    SkipLayerNormalization."""
    hidden = 8
    rows = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", 3, hidden]) for n in "xs"]
    constants = [
        numpy_helper.from_array(np.full(hidden, value, dtype=np.float32), name)
        for name, value in (("bias", 0.5), ("gamma", 1.0), ("beta", 0.0))
    ]
    graph = helper.make_graph(
        [
            helper.make_node("Add", ["x", "bias"], ["biased"]),
            helper.make_node("Add", ["biased", "s"], ["summed"]),
            helper.make_node("LayerNormalization", ["summed", "gamma", "beta"], ["y"], axis=-1),
        ],
        "residual_norm",
        rows,
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3, hidden])],
        initializer=constants,
    )
    return _save(tmp_path, graph, "residual_norm")


@pytest.mark.parametrize("disabled", [True, False])
def test_cpu_sessions_leave_out_the_slower_skip_layer_norm(tmp_path: Path, disabled: bool) -> None:
    # the CPU kernel of SkipLayerNormalization is ~6x slower than the ops it replaces
    assert "SkipLayerNormFusion" in _disabled_optimizers(["CPUExecutionProvider"])
    assert _disabled_optimizers([("CUDAExecutionProvider", {}), "CPUExecutionProvider"]) == []
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    leave_out = _disabled_optimizers(["CPUExecutionProvider"]) if disabled else []
    ort.InferenceSession(
        str(_residual_norm(tmp_path)), opts, ["CPUExecutionProvider"], disabled_optimizers=leave_out
    )
    ops = {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert ("SkipLayerNormalization" in ops) is not disabled


def test_load_passes_the_cpu_leave_outs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[object] = []
    real = ort.InferenceSession

    def recording(*args: object, **kwargs: object) -> ort.InferenceSession:
        seen.append(kwargs.get("disabled_optimizers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(ort, "InferenceSession", recording)
    OnnxModel.load(_doubler(tmp_path), sessions=2)
    assert seen == [["SkipLayerNormFusion"]] * 2


def test_provider_aliases_and_cpu(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), providers=["cpu"], sessions=1)
    assert model.providers == ("CPUExecutionProvider",)


@pytest.mark.parametrize(
    ("kwargs", "match"), [({"sessions": 0}, "sessions"), ({"intra_op_threads": 0}, "intra_op")]
)
def test_settings_are_validated(tmp_path: Path, kwargs: dict[str, int], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        OnnxModel.load(_doubler(tmp_path), **kwargs)


def test_run_is_thread_safe_and_uses_the_pool(tmp_path: Path) -> None:
    model = OnnxModel.load(_doubler(tmp_path), sessions=2)
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for j in range(50):
                x = np.full((k + 1, 4), float(j), dtype=np.float32)
                y = model.run({"x": x})["y"]
                assert y.shape == (k + 1, 4)
                assert np.all(y == 2 * j)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    # Every session went back to the pool, and the pool holds two distinct sessions.
    with model.session() as a, model.session() as b:
        assert a is not b


def test_pad_sequences_builds_mask() -> None:
    ids, mask = pad_sequences([[101, 7, 102], [101, 102], []], pad_value=9)
    np.testing.assert_array_equal(ids, [[101, 7, 102], [101, 102, 9], [9, 9, 9]])
    np.testing.assert_array_equal(mask, [[1, 1, 1], [1, 1, 0], [0, 0, 0]])
    assert ids.dtype == np.int64
    ids, mask = pad_sequences([[1]], length=3, dtype=np.int32)
    assert ids.shape == (1, 3)
    assert ids.dtype == np.int32
    with pytest.raises(InputError, match="shorter"):
        pad_sequences([[1, 2]], length=1)


def test_stack_equal() -> None:
    assert stack_equal([np.zeros(3), np.ones(3)]).shape == (2, 3)
    with pytest.raises(InputError, match="pad_sequences"):
        stack_equal([np.zeros(3), np.ones(4)])


def test_split_rows_strips_padding() -> None:
    batch = np.arange(2 * 3 * 2).reshape(2, 3, 2)
    rows = split_rows(batch, [3, 1])
    assert rows[0].shape == (3, 2)
    assert rows[1].shape == (1, 2)
    np.testing.assert_array_equal(rows[1], batch[1, :1])
    assert [r.shape for r in split_rows(np.zeros((4, 5)))] == [(5,)] * 4
    with pytest.raises(InputError):
        split_rows(batch, [1])


def test_the_session_builder_takes_the_onnx_backends_own_options(tmp_path: Path) -> None:
    """``load_sessions_at`` reads only :class:`SessionOptions` (the core and the sessions):
    given that class alone, not the deployment's ``Knobs``, it lays the sessions out."""
    from batchline.models.onnx import SessionOptions, load_sessions_at

    path = _doubler(tmp_path)
    batched = load_sessions_at(path, SessionOptions(sessions=3, intra_op_threads=1))
    assert batched.sessions == 3
    np.testing.assert_array_equal(batched.run({"x": [[1, 2, 3, 4]]})["y"], [[2, 4, 6, 8]])
    baseline = load_sessions_at(path, SessionOptions(sessions=3, batching=False))
    assert baseline.sessions == 1  # the baseline: one session every caller shares
