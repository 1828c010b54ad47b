"""Image models behind the seam, over one graph each (ONNX, or torch in bf16):
:class:`ImageClassifier` (``classify``: a label and its scores), :class:`ImageEmbedder`
(``embed``: one vector per picture) and :class:`ZeroShotClassifier` (``classify`` over label
texts embedded once, at load: CLIP and SigLIP); and :class:`PaddedTextEmbedder`, SigLIP's
text tower (CLIP's is the ONNX text embedder of ``batchline.models.onnx``).

Each is a :class:`~batchline.models.protocol.BatchModel` whose ``info.input_kind`` is
``image`` and whose ``preprocess`` (:class:`~batchline.models.image.ImagePreprocess`) makes
its prepared items: float32 ``(3, H, W)`` arrays, made in the decode worker processes
(``prepare`` does it in-process for a decoded picture). ``run_batch`` stacks them and runs
them on the model's graph (:class:`~batchline.models.onnx.sessions.Graph`): ONNX Runtime's
session pool (fp32), or torch in bf16 (:class:`~batchline.models.image.torch_image.TorchPixels`),
the same head either way.
Results are encoded as the text models' are: a float32 vector, or the classifier's
``{"label", "score", "scores"}`` (``top_k``: ``{"label", "score", "top_k"}``).

Example::

    model = ImageClassifier(onnx_model, preprocess, name="vit", labels=("cat", "dog"))
    model.run_batch([model.preprocess(picture)])   # [{"label": "cat", "score": 0.8, ...}]
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline.models.image.preprocess import ImagePreprocess
from batchline.models.onnx import Graph, SessionModel, classification, softmax
from batchline.models.protocol import ModelInfo

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchline.models.onnx import Classification, OnnxModel

__all__ = [
    "ImageClassifier",
    "ImageEmbedder",
    "PaddedTextEmbedder",
    "ZeroShotClassifier",
]

Pixels = npt.NDArray[np.float32]


class _ImageModel(SessionModel):
    """What the image models share: preparing pictures, a cost of 1 each, one batched run on
    their :class:`~batchline.models.onnx.Graph` (ONNX Runtime's sessions or torch)."""

    model: Graph
    preprocess: ImagePreprocess
    output_name: str

    def __init__(self, model: Graph, preprocess: ImagePreprocess, output_name: str) -> None:
        if preprocess.output_size is None:
            raise ModelError(
                f"{model.path.name}: the preprocessing gives pictures of varying sizes (a "
                "shortest-edge resize without a crop); a batch needs one size"
            )
        if "pixel_values" not in model.input_names or len(model.input_names) != 1:
            raise ModelError(
                f"{model.path.name} takes {list(model.input_names)}; an image model takes "
                "pixel_values alone"
            )
        if output_name not in model.output_names:
            raise ModelError(f"{model.path.name} has no output {output_name!r}")
        self.model = model
        self.preprocess = preprocess
        self.output_name = output_name
        self._shape = (3, *preprocess.output_size)

    def prepare(self, inputs: Sequence[object]) -> list[Pixels | BaseException]:
        """A decoded picture (a PIL image, any mode) preprocessed, or an already preprocessed
        ``(3, H, W)`` array checked; anything else is an ``InputError`` for that input."""
        return [self._prepare_one(x) for x in inputs]

    def _prepare_one(self, value: object) -> Pixels | BaseException:
        if isinstance(value, np.ndarray):
            if value.shape != self._shape:
                return InputError(
                    f"an image input must be preprocessed to {list(self._shape)}, "
                    f"got {list(value.shape)}"
                )
            return np.ascontiguousarray(value, dtype=np.float32)
        convert = getattr(value, "convert", None)
        if convert is None:
            return InputError(f"an image input must be a picture, got {type(value).__name__}")
        try:
            return self.preprocess(convert("RGB"))
        except (OSError, ValueError) as exc:
            return InputError(f"cannot preprocess the picture: {exc}")

    def cost(self, item: Pixels) -> int:
        return 1  # every picture is the same size once preprocessed

    def outputs(self, batch: Sequence[Pixels]) -> npt.NDArray[np.float32]:
        """One stacked batch through the graph (a free session): ``(len(batch), width)``."""
        out = self.model.run({"pixel_values": np.stack(batch)}, [self.output_name])
        rows: npt.NDArray[np.float32] = np.asarray(out[self.output_name])
        if rows.ndim != 2 or rows.shape[0] != len(batch):
            raise ModelError(
                f"{self.model.path.name} returned {self.output_name} of shape {rows.shape} for "
                f"{len(batch)} pictures"
            )
        return rows.astype(np.float32, copy=False)

    def raw(self, batch: Sequence[Pixels]) -> npt.NDArray[np.float32]:
        """What the results are computed from, a row a picture: a classifier's logits, an
        embedder's vectors before normalizing (``auto``'s gate compares them across
        precisions)."""
        return self.outputs(batch)


def _check_labels(labels: Sequence[str], width: int, what: str) -> tuple[str, ...]:
    out = tuple(str(label) for label in labels)
    if len(out) != width:
        raise ModelError(
            f"{what} returns {width} scores per picture but {len(out)} labels were given; "
            "pass one label per class, in order"
        )
    dupes = sorted({label for label in out if out.count(label) > 1})
    if dupes:
        raise ModelError(f"the labels of {what} repeat {dupes[0]!r}")
    return out


def _classify_info(name: str, labels: Sequence[str], top_k: int | None) -> ModelInfo:
    return ModelInfo(
        name=name,
        task="classify",
        input_kind="image",
        result_kind="value",
        result_column="classification",
        details={"labels": list(labels), **({"top_k": top_k} if top_k else {})},
    )


class ImageClassifier(_ImageModel):
    """An ONNX image classifier (``pixel_values`` → ``logits``) as a batch model (task
    ``classify``): softmax over its labels, the result shape of the text classifier."""

    def __init__(
        self,
        model: Graph,
        preprocess: ImagePreprocess,
        *,
        name: str,
        labels: Sequence[str],
        top_k: int | None = None,
        output_name: str = "logits",
    ) -> None:
        super().__init__(model, preprocess, output_name)
        width = model.outputs[model.output_names.index(output_name)].shape[-1]
        if not isinstance(width, int):
            width = self.outputs([np.zeros(self._shape, np.float32)]).shape[1]
        self.labels = _check_labels(labels, width, model.path.name)
        self.top_k = top_k
        self._info = _classify_info(name, self.labels, top_k)

    def run_batch(self, batch: list[Pixels]) -> list[Classification]:
        if not batch:
            return []
        probs = softmax(self.outputs(batch))
        return [classification(row, self.labels, top_k=self.top_k) for row in probs]


class ImageEmbedder(_ImageModel):
    """An ONNX image tower (``pixel_values`` → ``(batch, dim)``) as a batch model (task
    ``embed``), L2-normalized unless told not to."""

    def __init__(
        self,
        model: Graph,
        preprocess: ImagePreprocess,
        *,
        name: str,
        output_name: str,
        normalize: bool = True,
    ) -> None:
        super().__init__(model, preprocess, output_name)
        self.normalize = normalize
        dim = model.outputs[model.output_names.index(output_name)].shape[-1]
        if not isinstance(dim, int):
            dim = self.outputs([np.zeros(self._shape, np.float32)]).shape[1]
        self._info = ModelInfo(
            name=name,
            task="embed",
            input_kind="image",
            result_kind="vector",
            result_column="embedding",
            details={"dim": int(dim), "normalized": normalize},
        )

    def vectors(self, batch: Sequence[Pixels]) -> npt.NDArray[np.float32]:
        out = self.outputs(batch)
        return l2_normalize(out) if self.normalize else out

    def run_batch(self, batch: list[Pixels]) -> list[npt.NDArray[np.float32]]:
        if not batch:
            return []
        return list(self.vectors(batch))


class ZeroShotClassifier(_ImageModel):
    """CLIP's or SigLIP's image tower against label texts embedded once (task ``classify``).

    A picture's scores are ``scale * cos(picture, label)`` (plus ``bias`` for SigLIP), turned
    into probabilities with a softmax over the labels (CLIP) or a sigmoid each (SigLIP: the
    labels are judged one by one, so their scores need not add up to 1).
    """

    def __init__(
        self,
        model: Graph,
        preprocess: ImagePreprocess,
        *,
        name: str,
        labels: Sequence[str],
        label_vectors: npt.NDArray[np.float32],
        scale: float,
        bias: float = 0.0,
        activation: Literal["softmax", "sigmoid"] = "softmax",
        top_k: int | None = None,
        output_name: str = "image_embeds",
    ) -> None:
        super().__init__(model, preprocess, output_name)
        self.labels = _check_labels(labels, len(label_vectors), "the label texts")
        self.label_vectors = l2_normalize(np.asarray(label_vectors, np.float32))
        self.scale, self.bias, self.activation = scale, bias, activation
        self.top_k = top_k
        self._info = _classify_info(name, self.labels, top_k)

    def logits(self, batch: Sequence[Pixels]) -> npt.NDArray[np.float64]:
        images = l2_normalize(self.outputs(batch)).astype(np.float64)
        cos = images @ self.label_vectors.astype(np.float64).T
        result: npt.NDArray[np.float64] = cos * self.scale + self.bias
        return result

    def raw(self, batch: Sequence[Pixels]) -> npt.NDArray[np.float32]:
        """The labels' logits, a row a picture."""
        return self.logits(batch).astype(np.float32)

    def run_batch(self, batch: list[Pixels]) -> list[Classification]:
        if not batch:
            return []
        logits = self.logits(batch)
        # SigLIP judges each label alone: a sigmoid, not a softmax over them
        sigmoid = self.activation == "sigmoid"
        probs = 1.0 / (1.0 + np.exp(-logits)) if sigmoid else softmax(logits)
        return [classification(row, self.labels, top_k=self.top_k) for row in probs]


class PaddedTextEmbedder(SessionModel):
    """A text tower that reads every text padded to ``length`` tokens and pools the last
    position (SigLIP's, as it was trained: ``padding="max_length"``), task ``embed``.

    Its graph takes ``input_ids`` ``(batch, length)`` alone and returns ``(batch, dim)``;
    texts are truncated to ``length`` tokens, and each costs 1 (they are all that long).
    """

    def __init__(
        self,
        model: OnnxModel,
        tokenizer: Tokenizer,
        *,
        name: str,
        length: int,
        pad_id: int,
        output_name: str = "text_embeds",
        normalize: bool = True,
    ) -> None:
        if model.input_names != ("input_ids",):
            raise ModelError(f"{model.path.name} takes {list(model.input_names)}, not input_ids")
        self.model = model
        self.tokenizer = tokenizer
        self.length, self.pad_id = length, pad_id
        self.output_name, self.normalize = output_name, normalize
        dim = self._run([np.full(length, pad_id, np.int64)]).shape[1]
        self._info = ModelInfo(
            name=name,
            task="embed",
            input_kind="text",
            result_kind="vector",
            result_column="embedding",
            max_tokens=length,
            details={"dim": int(dim), "normalized": normalize},
        )

    def prepare(self, inputs: Sequence[object]) -> list[npt.NDArray[np.int64] | BaseException]:
        """Each text's ids, padded to ``length``; a non-text is an ``InputError`` for it."""
        assert self.tokenizer is not None
        texts = [x for x in inputs if isinstance(x, str)]
        encoded = iter(self.tokenizer.encode_batch(texts))
        out: list[npt.NDArray[np.int64] | BaseException] = []
        for x in inputs:
            if not isinstance(x, str):
                out.append(InputError(f"a text input must be a string, got {type(x).__name__}"))
                continue
            ids = np.full(self.length, self.pad_id, np.int64)
            own = next(encoded).ids[: self.length]
            ids[: len(own)] = own
            out.append(ids)
        return out

    def cost(self, item: npt.NDArray[np.int64]) -> int:
        return 1

    def _run(self, batch: Sequence[npt.NDArray[np.int64]]) -> npt.NDArray[np.float32]:
        out = self.model.run({"input_ids": np.stack(batch)}, [self.output_name])
        rows = out[self.output_name].astype(np.float32, copy=False)
        if rows.ndim != 2 or rows.shape[0] != len(batch):
            raise ModelError(f"{self.model.path.name} returned {rows.shape} for {len(batch)} texts")
        return rows

    def run_batch(self, batch: list[npt.NDArray[np.int64]]) -> list[npt.NDArray[np.float32]]:
        if not batch:
            return []
        rows = self._run(batch)
        return list(l2_normalize(rows) if self.normalize else rows)


def l2_normalize(rows: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
    """Rows scaled to unit length (a zero row stays zero)."""
    norms = np.linalg.norm(rows, axis=1, keepdims=True)
    out: npt.NDArray[np.float32] = (rows / np.maximum(norms, 1e-12)).astype(np.float32)
    return out
