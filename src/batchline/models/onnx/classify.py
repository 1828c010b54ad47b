"""``classify``: texts to a label and its scores through an ONNX sequence classifier.

:class:`OnnxClassifier` is the :class:`~batchline.models.protocol.BatchModel` for a model that
takes ``input_ids`` and ``attention_mask`` (and optionally ``token_type_ids``,
``position_ids``) and returns logits ``(batch, num_labels)``. It tokenizes as the embedder
does (same tokenizer loading, same right-padding), costs a text's token count (``padded``),
and turns each row of logits into probabilities with a softmax.

One result::

    {"label": "positive", "score": 0.91, "scores": {"negative": 0.02, "neutral": 0.07,
                                                    "positive": 0.91}}

With ``top_k`` (``--top-k``), ``scores`` gives way to the ``top_k`` likeliest labels, best
first (one shape for every record, whatever its labels)::

    {"label": "positive", "score": 0.91, "top_k": [{"label": "positive", "score": 0.91},
                                                   {"label": "neutral", "score": 0.07}]}

Labels come from ``labels=`` (``--labels``), else ``config.json``'s ``id2label`` beside the
model (as Hugging Face exports write it), else ``LABEL_0 .. LABEL_{N-1}``.

Example::

    model = load_classifier(parse_spec("sentiment.onnx").with_options(task="classify"), knobs)
    items = model.prepare(["a great film", "a dull film"])
    results = model.run_batch(items)     # [{"label": ..., "score": ..., "scores": {...}}, ...]
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NotRequired, TypedDict

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline._types import Array, Vector
from batchline.models.onnx.embedder import (
    TokenizedText,
    check_text_inputs,
    load_tokenizer,
    text_feeds,
    text_output,
    tokenize_texts,
    tokenizer_max_length,
)
from batchline.models.onnx.options import SessionOptions
from batchline.models.onnx.sessions import SessionModel, TextGraph, load_sessions_at, tokenizer_path
from batchline.models.protocol import ModelInfo
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = [
    "Classification",
    "OnnxClassifier",
    "classification",
    "labels_from_config",
    "load_classifier",
    "load_onnx_classifier",
]


class LabelScore(TypedDict):
    label: str
    score: float


class Classification(TypedDict):
    """One text's result: ``{"label": str, "score": float, "scores": {label: probability}}``,
    or with ``top_k``, ``"top_k": [{"label", "score"}, ...]`` in place of ``scores``."""

    label: str
    score: float
    scores: NotRequired[dict[str, float]]
    top_k: NotRequired[list[LabelScore]]


def classification(
    probs: npt.NDArray[np.float64], labels: Sequence[str], *, top_k: int | None = None
) -> Classification:
    """One row of probabilities (one per label, in order) as a :class:`Classification`: the
    result every classifier returns (text, image, zero-shot)."""
    best = int(np.argmax(probs))
    result: Classification = {"label": labels[best], "score": float(probs[best])}
    if top_k is None:
        result["scores"] = {label: float(p) for label, p in zip(labels, probs, strict=True)}
    else:
        # stable: ties keep the labels' order, as argmax does for the best
        order = np.argsort(-probs, kind="stable")[:top_k]
        result["top_k"] = [{"label": labels[i], "score": float(probs[i])} for i in order]
    return result


class OnnxClassifier(SessionModel):
    """An ONNX sequence classifier as a batch model (task ``classify``).

    Args:
        model: inputs among ``input_ids``, ``attention_mask``, ``token_type_ids``,
            ``position_ids``; an output of shape ``(batch, num_labels)``.
        tokenizer: a tokenizer from :func:`~batchline.models.onnx.embedder.load_tokenizer`.
        name: the model's name (outputs, listings).
        labels: one name per logit, in order; default ``LABEL_0 .. LABEL_{N-1}``.
        top_k: keep the ``top_k`` likeliest labels per result (default: all, as ``scores``).
        pad_id: the token id used for padding.
        output_name: the logits output (default: ``logits`` if present, else the first).

    Raises:
        ModelError: the inputs or the output do not fit, or ``labels`` has another length
            than the logits.
    """

    def __init__(
        self,
        model: TextGraph,
        tokenizer: Tokenizer,
        *,
        name: str,
        labels: Sequence[str] | None = None,
        top_k: int | None = None,
        pad_id: int = 0,
        output_name: str | None = None,
    ) -> None:
        if top_k is not None and top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.model = model
        self.tokenizer: Tokenizer = tokenizer
        self.pad_id = pad_id
        self._inputs = check_text_inputs(model, what="a classifier")
        spec = text_output(model, output_name, preferred="logits")
        self.output_name = output_name = spec.name
        if len(spec.shape) != 2:
            raise ModelError(
                f"output {output_name!r} of {model.path.name} has shape {list(spec.shape)}; a "
                "classifier returns logits of shape (batch, num_labels)"
            )
        width = spec.shape[1]
        num_logits = width if isinstance(width, int) and width > 0 else self._probe_width()
        if labels is None:
            labels = [f"LABEL_{i}" for i in range(num_logits)]
        labels = [str(label) for label in labels]
        if len(labels) != num_logits:
            raise ModelError(
                f"{model.path.name} returns {num_logits} logits per text but {len(labels)} "
                f"labels were given ({', '.join(labels)}); pass one label per logit, in order"
            )
        dupes = sorted({label for label in labels if labels.count(label) > 1})
        if dupes:
            raise ModelError(f"the labels of {model.path.name} repeat {dupes[0]!r}")
        self.labels: tuple[str, ...] = tuple(labels)
        self._info = ModelInfo(
            name=name,
            task="classify",
            input_kind="text",
            cost_kind="padded",
            result_kind="value",
            result_column="classification",
            max_tokens=tokenizer_max_length(tokenizer),
            details={"labels": list(self.labels), **({"top_k": top_k} if top_k else {})},
        )

    def prepare(self, inputs: Sequence[object]) -> list[TokenizedText | BaseException]:
        """Tokenize; a non-text input is an ``InputError`` for that input alone."""
        tokens = iter(tokenize_texts(self.tokenizer, [x for x in inputs if isinstance(x, str)]))
        return [
            next(tokens)
            if isinstance(x, str)
            else InputError(f"a classifier input must be a string, got {type(x).__name__}")
            for x in inputs
        ]

    def cost(self, item: TokenizedText) -> int:
        return max(1, len(item))

    def logits(self, batch: Sequence[TokenizedText]) -> Vector:
        """One padded batch through a free session: ``(len(batch), num_labels)`` logits."""
        out = self._run(batch)
        if out.ndim != 2 or out.shape[0] != len(batch):
            raise ModelError(
                f"{self.model.path.name} returned logits of shape {out.shape} for "
                f"{len(batch)} texts; expected ({len(batch)}, {len(self.labels)})"
            )
        return out.astype(np.float32, copy=False)

    def run_batch(self, batch: list[TokenizedText]) -> list[Classification]:
        if not batch:
            return []
        probs = softmax(self.logits(batch))
        return [self._result(row) for row in probs]

    def _result(self, probs: npt.NDArray[np.float64]) -> Classification:
        return classification(probs, self.labels, top_k=self.top_k)

    def _run(self, batch: Sequence[TokenizedText]) -> Array:
        feeds, _ = text_feeds(self._inputs, batch, pad_id=self.pad_id)
        return self.model.run(feeds, [self.output_name])[self.output_name]

    def _probe_width(self) -> int:
        # The width is symbolic in the file: one tiny run tells it.
        out = self._run(tokenize_texts(self.tokenizer, ["label probe"]))
        if out.ndim != 2 or out.shape[1] < 1:
            raise ModelError(
                f"output {self.output_name!r} of {self.model.path.name} has shape {out.shape} "
                "for one text; a classifier returns logits of shape (batch, num_labels)"
            )
        return int(out.shape[1])

    def __repr__(self) -> str:
        return f"OnnxClassifier({self.model.path.name!r}, labels={list(self.labels)})"


def softmax(logits: Array) -> npt.NDArray[np.float64]:
    """Row-wise softmax, in float64, stable for large logits."""
    x = np.asarray(logits, dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    e = np.exp(x)
    result: npt.NDArray[np.float64] = e / e.sum(axis=-1, keepdims=True)
    return result


def labels_from_config(path: Path) -> tuple[str, ...] | None:
    """The labels in a Hugging Face ``config.json``'s ``id2label``, ordered by id; ``None``
    when the file or the key is missing. Ids must be 0..N-1."""
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelError(f"{path}: not a readable JSON config: {exc}") from None
    id2label = config.get("id2label") if isinstance(config, dict) else None
    if id2label is None:
        return None
    if not isinstance(id2label, dict) or not id2label:
        raise ModelError(f"{path}: id2label must be an object of id -> label")
    try:
        by_id = {int(k): str(v) for k, v in id2label.items()}
    except (TypeError, ValueError):
        raise ModelError(
            f"{path}: id2label keys must be integer ids, got {list(id2label)}"
        ) from None
    if sorted(by_id) != list(range(len(by_id))):
        raise ModelError(f"{path}: id2label ids must be 0..{len(by_id) - 1}, got {sorted(by_id)}")
    return tuple(by_id[i] for i in range(len(by_id)))


def load_classifier(spec: ModelSpec, knobs: SessionOptions) -> OnnxClassifier:
    """Load an ``.onnx`` sequence classifier laid out as ``knobs`` say.

    Batching: ``knobs.sessions`` sessions of ``knobs.intra_op_threads`` threads; the baseline
    (``batching=False``): one session every caller shares. The tokenizer is the spec's or the
    ``tokenizer.json`` beside the model; labels as the module docstring says.
    """
    labels = spec.labels
    if labels is None and spec.folder is not None and spec.folder.labels:
        labels = spec.folder.labels  # a model folder's config.json, read at parse time
    if labels is None:
        labels = labels_from_config(spec.path.with_name("config.json"))
    return load_onnx_classifier(
        spec.path,
        tokenizer_path(spec),
        name=spec.name,
        knobs=knobs,
        labels=labels,
        top_k=spec.top_k,
    )


def load_onnx_classifier(
    path: Path,
    tokenizer: Path,
    *,
    name: str,
    knobs: SessionOptions,
    labels: Sequence[str] | None = None,
    max_length: int | None = None,
    top_k: int | None = None,
) -> OnnxClassifier:
    """An ONNX classifier file and its ``tokenizer.json`` as an :class:`OnnxClassifier` laid
    out as ``knobs`` say."""
    model = load_sessions_at(path, knobs)
    tok, pad_id = load_tokenizer(tokenizer, max_length=max_length)
    return OnnxClassifier(model, tok, name=name, labels=labels, top_k=top_k, pad_id=pad_id)
