"""Any ONNX model, tensors in and out: ``batchline run images.npy --model clf.onnx --task predict``.

Builds a small image-classifier-shaped model (``input``: float32 ``[batch, 3, 16, 16]`` with a
dynamic batch axis, ``logits``: ``[batch, 4]``), saves 32 images as ``images.npy``, runs the
job, and checks the outputs against ONNX Runtime called directly. Each row of the ``.npy``
file is one record; concurrent rows share batches. ``batchline serve --model clf=clf.onnx
--task clf=predict`` serves the same model over the Open Inference Protocol.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np


def build_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weight = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    graph = helper.make_graph(
        [
            # the mean of each channel, then a linear layer: (batch, 3) @ (3, 4)
            helper.make_node("ReduceMean", ["input"], ["pooled"], axes=[2, 3], keepdims=0),
            helper.make_node("MatMul", ["pooled", "weight"], ["logits"]),
        ],
        "tiny_image_classifier",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, 16, 16])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 4])],
        initializer=[numpy_helper.from_array(weight, "weight")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, str(path))
    return path


def main() -> np.ndarray:
    import onnxruntime as ort

    from batchline.__main__ import main as batchline
    from batchline.datasets.sinks import read_arrays, read_output

    with tempfile.TemporaryDirectory() as tmp:
        model = build_model(Path(tmp) / "clf.onnx")
        images = np.random.default_rng(1).normal(size=(32, 3, 16, 16)).astype(np.float32)
        np.save(Path(tmp) / "images.npy", images)
        out = Path(tmp) / "out"
        argv = ["run", str(Path(tmp) / "images.npy"), "--model", str(model), "--task", "predict"]
        assert batchline([*argv, "-o", str(out), "--quiet"]) == 0
        rows = read_output(out).to_pylist()  # one row per image, in order
        # the outputs are numbers (a struct of fixed-size lists), read back as numpy arrays
        logits = read_arrays(out)["logits"].astype(np.float32)
        (direct,) = ort.InferenceSession(str(model)).run(None, {"input": images})
        np.testing.assert_allclose(logits, direct, rtol=1e-5, atol=1e-6)
        print(f"{len(rows)} images, outputs equal to onnxruntime's")
        return logits


if __name__ == "__main__":
    main()
