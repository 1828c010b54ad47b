"""Pictures and tiny image models for the image tests: deterministic files of each kind a
dataset may hold (and the bad ones), and ONNX models of one NCHW input built with
``onnx.helper`` (Conv, GlobalAveragePool, Gemm)."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from PIL import Image

CLASSES = 5
FEATURES = 4


def image_model(
    folder: Path,
    *,
    size: int | None = 32,
    classify: bool = True,
    seed: int = 0,
    softmax: bool = False,
) -> Path:
    """``pixels`` float32 ``[batch, 3, size, size]`` (``size=None``: any height and width) →
    ``logits`` ``[batch, 5]`` (``classify``) or ``embedding`` ``[batch, 4]``: a 3x3 Conv to 4
    channels, ReLU, GlobalAveragePool, Flatten, then a Gemm to the logits (``softmax``: then a
    Softmax, output ``probs``, as a graph that gives probabilities)."""
    rng = np.random.default_rng(seed)
    conv_w = rng.normal(size=(FEATURES, 3, 3, 3)).astype(np.float32)
    conv_b = rng.normal(size=(FEATURES,)).astype(np.float32)
    gemm_w = rng.normal(size=(CLASSES, FEATURES)).astype(np.float32)
    gemm_b = rng.normal(size=(CLASSES,)).astype(np.float32)
    nodes = [
        helper.make_node("Conv", ["pixels", "conv_w", "conv_b"], ["conv"], pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["conv"], ["relu"]),
        helper.make_node("GlobalAveragePool", ["relu"], ["pooled"]),
        helper.make_node("Flatten", ["pooled"], ["embedding" if not classify else "flat"]),
    ]
    weights = [numpy_helper.from_array(conv_w, "conv_w"), numpy_helper.from_array(conv_b, "conv_b")]
    if classify:
        nodes.append(helper.make_node("Gemm", ["flat", "gemm_w", "gemm_b"], ["logits"], transB=1))
        weights += [
            numpy_helper.from_array(gemm_w, "gemm_w"),
            numpy_helper.from_array(gemm_b, "gemm_b"),
        ]
        last = "logits"
        if softmax:
            nodes.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=1))
            last = "probs"
        output = helper.make_tensor_value_info(last, TensorProto.FLOAT, ["batch", CLASSES])
    else:
        output = helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", FEATURES])
    side: int | str = size if size is not None else "h"
    graph = helper.make_graph(
        nodes,
        "tiny_image_model",
        [
            helper.make_tensor_value_info(
                "pixels", TensorProto.FLOAT, ["batch", 3, side, size if size is not None else "w"]
            )
        ],
        [output],
        initializer=weights,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    name = "classifier" if not softmax else "probabilities"
    path = folder / (f"{name}.onnx" if classify else "embedder.onnx")
    onnx.save(model, path)
    return path


def write_labels(model: Path, labels: list[str]) -> None:
    """A ``config.json`` with ``id2label`` beside the model."""
    config = {"id2label": {str(i): label for i, label in enumerate(labels)}}
    model.with_name("config.json").write_text(json.dumps(config), encoding="utf-8")


def picture(seed: int, size: tuple[int, int] = (48, 40), mode: str = "RGB") -> Image.Image:
    """A deterministic picture: smooth gradients plus noise, ``size`` (width, height)."""
    rng = np.random.default_rng(seed)
    w, h = size
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 / max(1, w - 1), y * 255 / max(1, h - 1), (x + y) % 256], axis=-1)
    noisy = np.clip(base + rng.normal(scale=20, size=base.shape), 0, 255).astype(np.uint8)
    image = Image.fromarray(noisy, "RGB")
    return image if mode == "RGB" else image.convert(mode)


def jpeg_bytes(seed: int, size: tuple[int, int] = (48, 40), quality: int = 90) -> bytes:
    out = io.BytesIO()
    picture(seed, size).save(out, "JPEG", quality=quality)
    return out.getvalue()


def png_bytes(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()


def photo_folder(root: Path, count: int = 6) -> list[str]:
    """``count`` JPEGs and PNGs under ``root`` (some in a subfolder); their relative paths,
    sorted."""
    names = []
    for i in range(count):
        rel = f"sub/p{i:02d}.png" if i % 3 == 2 else f"p{i:02d}.jpg"
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = png_bytes(picture(i)) if rel.endswith(".png") else jpeg_bytes(i)
        path.write_bytes(data)
        names.append(rel)
    return sorted(names)
