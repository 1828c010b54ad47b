"""A plain ONNX image model: one float NCHW input, pictures in, a vector or a label out.

:class:`OnnxImageModel` is the :class:`~batchline.models.protocol.BatchModel` of an ``.onnx``
whose single input is ``(batch, 3, H, W)``: ``embed`` returns its output as one vector per
picture (a ``(batch, C, h, w)`` feature map averaged over ``h`` and ``w``), ``classify`` the
softmax of its logits as the other classifiers' result, ``{"label", "score", "scores"}``
(``--top-k``: ``{"label", "score", "top_k": [{"label", "score"}, ...]}``); an output that is
already probabilities, a graph ending in a softmax, is taken as it is. Its
prepared items are the float32 ``(3, H, W)`` arrays :attr:`preprocess` makes (a decode
worker makes them in a ``run`` job: :mod:`batchline.models.image.pool`); ``prepare`` also
takes pictures as bytes, :class:`~batchline.models.image.decode.ImageRef` or ready arrays,
and decodes inline.

    model = load_image_model(spec.with_options(task="classify"), knobs)
    (item,) = model.prepare([Path("cat.jpg").read_bytes()])
    (result,) = model.run_batch([item])       # {"label": "tabby", "score": 0.83, "scores": {...}}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from batchline._errors import InputError, ModelError
from batchline.models.common.image_options import ImageOptions
from batchline.models.config import Knobs
from batchline.models.image.decode import DEFAULT_MAX_PIXELS, ImageRef, decode_image
from batchline.models.image.precisions import plain_onnx_refusal
from batchline.models.image.preprocess import ImagePreprocess
from batchline.models.image.processor_config import preprocess_from_config, read_processor_config
from batchline.models.onnx import (
    OnnxModel,
    OnnxTensor,
    SessionModel,
    classification,
    labels_from_config,
    load_sessions_at,
    softmax,
)
from batchline.models.protocol import ModelInfo, Task
from batchline.models.specs import ModelSpec

__all__ = ["OnnxImageModel", "image_input", "load_image_model"]

#: How far from 1 a row's sum may be for the row to be probabilities already: more than a
#: float16 softmax's rounding (under 5e-4 a row: 2**-11 of each value), far less than logits
#: that sum to 1 by chance.
PROBABILITY_TOLERANCE = 1e-3

# the models' logger: run and serve print its INFO lines as the model's load line
logger = logging.getLogger("batchline.models")


def is_probabilities(out: np.ndarray) -> bool:
    """Whether every row of ``out`` (a row a picture) is a probability distribution already:
    no value below 0, each row summing to 1 within :data:`PROBABILITY_TOLERANCE`."""
    rows = np.asarray(out, dtype=np.float64).reshape(len(out), -1)
    if rows.size == 0 or not np.isfinite(rows).all() or (rows < 0).any():
        return False
    return bool(np.all(np.abs(rows.sum(axis=1) - 1.0) <= PROBABILITY_TOLERANCE))


def image_input(inputs: Sequence[OnnxTensor]) -> OnnxTensor | None:
    """The model's one input when it is a float NCHW picture batch of 3 channels (or an
    unknown number), else ``None``."""
    if len(inputs) != 1:
        return None
    (only,) = inputs
    if len(only.shape) != 4 or "float" not in only.type:
        return None
    channels = only.shape[1]
    return only if not isinstance(channels, int) or channels == 3 else None


class OnnxImageModel(SessionModel):
    """An ONNX model of one NCHW input as an image ``embed`` or ``classify`` model."""

    def __init__(
        self,
        model: OnnxModel,
        preprocess: ImagePreprocess,
        *,
        name: str,
        task: Task,
        labels: Sequence[str] | None = None,
        top_k: int | None = None,
        normalize: bool = False,
    ) -> None:
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        found = image_input(model.inputs)
        if found is None:
            shapes = ", ".join(f"{i.name} {list(i.shape)} {i.type}" for i in model.inputs)
            raise ModelError(
                f"{model.path.name} is not an image model: it takes {shapes}; an image model "
                "has one float input of shape (batch, 3, height, width)"
            )
        if task not in ("embed", "classify"):
            raise InputError(f"an image model embeds or classifies pictures, not {task}")
        self.model = model
        self.preprocess = preprocess
        self.normalize = normalize
        self.top_k = top_k
        self._input = found.name
        self._dtype = np.float16 if "float16" in found.type else np.float32
        outputs = {o.name: o for o in model.outputs}
        wanted = "logits" if task == "classify" and "logits" in outputs else None
        self._output: str = wanted or model.outputs[0].name
        self.labels: tuple[str, ...] = ()
        details: dict[str, object] = {"preprocess": repr(preprocess)}
        if task == "classify":
            probe = self._probe()
            width = _width(probe)
            given = [str(x) for x in labels] if labels is not None else None
            if given is not None and len(given) != width:
                raise ModelError(
                    f"{model.path.name} returns {width} logits per picture but {len(given)} "
                    "labels were given; pass one label per logit, in order"
                )
            self.labels = tuple(given or (f"LABEL_{i}" for i in range(width)))
            details["labels"] = list(self.labels)
            if top_k:
                details["top_k"] = top_k
            if is_probabilities(probe):
                logger.info(
                    "%s: %s outputs probabilities already (a softmax in the graph): its scores "
                    "are taken as they are",
                    name,
                    model.path.name,
                )
        else:
            details["dim"] = _width(self._probe())
        self._info = ModelInfo(
            name=name,
            task=task,
            input_kind="image",
            cost_kind="additive",
            result_kind="value" if task == "classify" else "vector",
            result_column="classification" if task == "classify" else "embedding",
            details=details,
        )

    def prepare(self, inputs: Sequence[object]) -> list[np.ndarray | BaseException]:
        """Each input as the model's ``(3, H, W)`` array: bytes and references are decoded
        here (a job decodes in worker processes instead); a bad picture is its own error."""
        out: list[np.ndarray | BaseException] = []
        for value in inputs:
            try:
                out.append(self._prepare_one(value))
            except InputError as exc:
                out.append(exc)
        return out

    def _prepare_one(self, value: object) -> np.ndarray:
        if isinstance(value, np.ndarray):
            if value.ndim != 3 or value.shape[0] != 3:
                raise InputError(f"a picture's array must be (3, H, W), got {list(value.shape)}")
            return value.astype(np.float32, copy=False)
        if isinstance(value, ImageRef):
            value = value.read()
        if not isinstance(value, bytes | bytearray):
            raise InputError(f"a picture is bytes or a (3, H, W) array, not {type(value).__name__}")
        draft = self.preprocess.draft_size()
        return self.preprocess(
            decode_image(bytes(value), draft=draft, max_pixels=DEFAULT_MAX_PIXELS)
        )

    def cost(self, item: np.ndarray) -> int:
        return 1

    def run_batch(self, batch: list[np.ndarray]) -> list[object]:
        if not batch:
            return []
        shapes = {item.shape for item in batch}
        if len(shapes) > 1:  # pictures of several sizes (no crop): one call per size
            by_shape = {s: [i for i, x in enumerate(batch) if x.shape == s] for s in shapes}
            results: list[object] = [None] * len(batch)
            for places in by_shape.values():
                got = self.run_batch([batch[i] for i in places])
                for place, result in zip(places, got, strict=True):
                    results[place] = result
            return results
        pixels = np.stack(batch).astype(self._dtype, copy=False)
        out = self.model.run({self._input: pixels}, [self._output])[self._output]
        if out.shape[0] != len(batch):
            raise ModelError(
                f"{self.model.path.name} returned {out.shape[0]} rows for {len(batch)} pictures"
            )
        if self.info.task == "classify":
            rows = np.asarray(out, dtype=np.float64).reshape(len(batch), -1)
            # a graph that ends in a softmax gives probabilities: a second one would flatten them
            probs = rows if is_probabilities(rows) else softmax(rows)
            return [classification(row, self.labels, top_k=self.top_k) for row in probs]
        return list(self._vectors(out))

    def _vectors(self, out: np.ndarray) -> np.ndarray:
        vectors = np.asarray(out, dtype=np.float32)
        if vectors.ndim == 4:  # a feature map: one vector per picture, averaged over h and w
            vectors = vectors.mean(axis=(2, 3))
        vectors = vectors.reshape(len(vectors), -1)
        if self.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, np.float32(1e-12))
        return vectors

    def _probe(self) -> np.ndarray:
        """The output for one blank picture."""
        side = self.preprocess.output_size or (32, 32)
        probe = np.zeros((1, 3, *side), dtype=self._dtype)
        return self.model.run({self._input: probe}, [self._output])[self._output]

    def __repr__(self) -> str:
        return f"OnnxImageModel({self.model.path.name!r}, task={self.info.task!r})"


def _width(out: np.ndarray) -> int:
    """The output's width per picture (channels, for a feature map)."""
    return int(out.shape[1]) if out.ndim == 4 else int(np.prod(out.shape[1:]))


def _folder_preprocess(spec: ModelSpec) -> ImagePreprocess | None:
    """The preprocessing of the ``preprocessor_config.json`` in the model's folder (or beside
    the ``.onnx``), unless ``--image-size``, ``--mean`` or ``--std`` say otherwise."""
    flags = spec.image
    if flags is not None and (flags.size, flags.mean, flags.std) != (None, None, None):
        return None
    folder = _folder(spec)
    if not (folder / "preprocessor_config.json").is_file():
        return None
    return preprocess_from_config(read_processor_config(folder))


#: The mean and standard deviation most ImageNet-trained models were normalized with.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: The evaluation crop's share of the resized picture (224 of 256: torchvision's and timm's).
_CROP_SHARE = 0.875


def flag_preprocess(options: ImageOptions, model_size: tuple[int, int] | None) -> ImagePreprocess:
    """What the flags say (``--image-size``, ``--mean``, ``--std``): resize the shorter side
    to ``size / 0.875``, center crop ``size`` x ``size``, rescale to [0, 1] and normalize
    (ImageNet's mean and std unless given). ``model_size``: the model's fixed ``(H, W)``,
    used when ``size`` is not given."""
    if options.size is not None:
        crop = (options.size, options.size)
    elif model_size is not None:
        crop = model_size
    else:
        raise InputError(
            "the model's input size is not fixed in its graph: pass --image-size N (the "
            "side of the square picture it was trained on, e.g. 224)"
        )
    return ImagePreprocess(
        shortest_edge=max(1, round(min(crop) / _CROP_SHARE)),
        crop_to=crop,
        resample="bilinear",
        rescale_factor=1 / 255,
        mean=options.mean or IMAGENET_MEAN,
        std=options.std or IMAGENET_STD,
    )


def _folder(spec: ModelSpec) -> Path:
    """The model's folder: the one its spec named (the graph may sit in its ``onnx/``), else
    the one holding the ``.onnx``."""
    return spec.folder.folder if spec.folder is not None else spec.path.parent


def load_image_model(spec: ModelSpec, knobs: Knobs) -> OnnxImageModel:
    """An ``.onnx`` with one NCHW input as an image model (task ``embed`` or ``classify``),
    preprocessed as the ``preprocessor_config.json`` of its folder says, else as
    ``spec.image`` says (:class:`ImageOptions`: ``--image-size``, ``--mean`` and ``--std``,
    which also win over the folder's); labels from ``--labels`` or a ``config.json``'s
    ``id2label`` beside it. It runs as exported: precision bf16 or int8 is an ``InputError``."""
    if knobs.precision in ("bf16", "int8"):
        raise InputError(plain_onnx_refusal(spec, knobs.precision))
    model = load_sessions_at(spec.path, knobs)
    found = image_input(model.inputs)
    if found is None:
        raise ModelError(
            f"{spec.path}: not an image model (it needs one float input of shape "
            "(batch, 3, height, width)); run it with --task predict on tensors"
        )
    height, width = found.shape[2], found.shape[3]
    fixed = (height, width) if isinstance(height, int) and isinstance(width, int) else None
    preprocess = _folder_preprocess(spec) or flag_preprocess(spec.image or ImageOptions(), fixed)
    task: Task = spec.task if spec.task in ("embed", "classify") else "embed"
    labels = spec.labels
    if labels is None and task == "classify":
        labels = labels_from_config(_folder(spec) / "config.json")
    return OnnxImageModel(
        model,
        preprocess,
        name=spec.name,
        task=task,
        labels=labels,
        top_k=spec.top_k,
        normalize=bool(spec.normalize),
    )
