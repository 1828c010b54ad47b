"""``score``: (query, document) pairs to one relevance score through an ONNX cross-encoder.

:class:`OnnxScorer` is the :class:`~batchline.models.protocol.BatchModel` for a model that
takes ``input_ids`` and ``attention_mask`` (and ``token_type_ids``, which tell the query's
tokens from the document's) and returns one logit per pair, ``(batch, 1)``. Each input is a
mapping with string ``"query"`` and ``"document"`` (or a 2-item list ``[query, document]``),
tokenized as a pair with the tokenizer's pair template, truncating the longer text first.
Cost is the pair's token count, padded as embeddings are. The score is ``sigmoid(logit)``
(sentence-transformers' CrossEncoder default for one label) or the raw logit
(``activation="identity"``).

Example::

    model = load_scorer(parse_spec("reranker/"), knobs)
    items = model.prepare([{"query": "capital of France", "document": "Paris is ..."}])
    model.run_batch(items)     # [0.97]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline._types import Vector
from batchline.models.onnx.embedder import (
    TokenizedText,
    check_text_inputs,
    load_tokenizer,
    text_feeds,
    text_output,
    tokenizer_max_length,
)
from batchline.models.onnx.options import SessionOptions
from batchline.models.onnx.sessions import SessionModel, TextGraph, load_sessions_at, tokenizer_path
from batchline.models.protocol import ModelInfo
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    from tokenizers import Tokenizer

__all__ = ["OnnxScorer", "TokenizedPair", "load_onnx_scorer", "load_scorer", "pair_of"]

Activation = Literal["sigmoid", "identity"]


@dataclass(frozen=True, slots=True, eq=False)
class TokenizedPair(TokenizedText):
    """One (query, document) pair as token ids and their segment (type) ids."""

    type_ids: npt.NDArray[np.int64]


def pair_of(value: object) -> tuple[str, str]:
    """``(query, document)`` of one score input; ``InputError`` saying what is wrong."""
    if isinstance(value, Mapping):
        query, document = value.get("query"), value.get("document")
        if not isinstance(query, str) or not isinstance(document, str):
            raise InputError(
                "a score input needs string 'query' and 'document' fields, got "
                f"query={type(query).__name__}, document={type(document).__name__}"
            )
        return query, document
    if isinstance(value, list | tuple):
        if len(value) != 2:
            raise InputError(
                f"a score input as a list must be [query, document], got {len(value)} items"
            )
        bad = next((v for v in value if not isinstance(v, str)), None)
        if bad is not None:
            raise InputError(
                "a score input as a list must be [query, document] (two strings), "
                f"got {type(bad).__name__}"
            )
        return value[0], value[1]
    raise InputError(
        f"a score input is {{'query': ..., 'document': ...}} or [query, document], "
        f"got {type(value).__name__}"
    )


class OnnxScorer(SessionModel):
    """An ONNX cross-encoder as a batch model (task ``score``); see the module docstring.

    Raises:
        ModelError: the inputs do not fit, or the model returns more than one logit per pair.
    """

    def __init__(
        self,
        model: TextGraph,
        tokenizer: Tokenizer,
        *,
        name: str,
        pad_id: int = 0,
        activation: Activation = "sigmoid",
        output_name: str | None = None,
    ) -> None:
        if activation not in ("sigmoid", "identity"):
            raise ValueError(f"activation must be sigmoid or identity, got {activation!r}")
        self.model = model
        self.tokenizer: Tokenizer = tokenizer
        self.pad_id = pad_id
        self.activation = activation
        self._inputs = check_text_inputs(model, what="a cross-encoder")
        out = text_output(model, output_name, preferred="logits")
        self.output_name = out.name
        width = out.shape[-1] if len(out.shape) == 2 else None
        if len(out.shape) not in (1, 2) or (isinstance(width, int) and width != 1):
            raise ModelError(
                f"output {out.name!r} of {model.path.name} has shape {list(out.shape)}; a "
                "cross-encoder returns one logit per pair, (batch, 1): a classifier with "
                "several labels takes the classify task"
            )
        self._info = ModelInfo(
            name=name,
            task="score",
            input_kind="record",
            cost_kind="padded",
            result_kind="value",
            result_column="score",
            max_tokens=tokenizer_max_length(tokenizer),
            details={"activation": activation},
        )

    def prepare(self, inputs: Sequence[object]) -> list[TokenizedPair | BaseException]:
        """Tokenize each pair; a bad input is an ``InputError`` for that input alone."""
        pairs: list[tuple[str, str] | BaseException] = []
        for x in inputs:
            try:
                pairs.append(pair_of(x))
            except InputError as exc:
                pairs.append(exc)
        good = [p for p in pairs if isinstance(p, tuple)]
        encodings = iter(self._encode(good) if good else [])
        return [p if isinstance(p, BaseException) else next(encodings) for p in pairs]

    def _encode(self, pairs: list[tuple[str, str]]) -> list[TokenizedPair]:
        try:
            encodings = self.tokenizer.encode_batch(pairs)
        except TypeError:  # lone surrogates: replace them, as embeddings do
            pairs = [(_clean(q), _clean(d)) for q, d in pairs]
            encodings = self.tokenizer.encode_batch(pairs)
        return [
            TokenizedPair(np.asarray(e.ids, np.int64), np.asarray(e.type_ids, np.int64))
            for e in encodings
        ]

    def cost(self, item: TokenizedPair) -> int:
        return max(1, len(item))

    def logits(self, batch: Sequence[TokenizedPair]) -> Vector:
        """One padded batch through a free session: ``(len(batch),)`` logits."""
        types = [p.type_ids for p in batch]
        feeds, _ = text_feeds(self._inputs, batch, pad_id=self.pad_id, type_ids=types)
        out = self.model.run(feeds, [self.output_name])[self.output_name]
        if out.shape[0] != len(batch) or out.size != len(batch):
            raise ModelError(
                f"{self.model.path.name} returned logits of shape {out.shape} for "
                f"{len(batch)} pairs; expected ({len(batch)}, 1)"
            )
        return np.asarray(out, dtype=np.float32).reshape(len(batch))

    def run_batch(self, batch: list[TokenizedPair]) -> list[float]:
        if not batch:
            return []
        x = self.logits(batch).astype(np.float64)
        if self.activation == "sigmoid":
            x = 1.0 / (1.0 + np.exp(-x))
        return [float(v) for v in x]

    def __repr__(self) -> str:
        return f"OnnxScorer({self.model.path.name!r}, activation={self.activation!r})"


def _clean(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8")


def load_scorer(spec: ModelSpec, knobs: SessionOptions) -> OnnxScorer:
    """Load an ``.onnx`` cross-encoder (a spec with task ``score``) laid out as ``knobs``
    say; the tokenizer is the spec's or the ``tokenizer.json`` beside the model."""
    activation: Activation = spec.folder.activation if spec.folder is not None else "sigmoid"
    return load_onnx_scorer(
        spec.path, tokenizer_path(spec), name=spec.name, knobs=knobs, activation=activation
    )


def load_onnx_scorer(
    path: Path,
    tokenizer: Path,
    *,
    name: str,
    knobs: SessionOptions,
    activation: Activation = "sigmoid",
    max_length: int | None = None,
) -> OnnxScorer:
    """An ONNX cross-encoder file and its ``tokenizer.json`` as an :class:`OnnxScorer`."""
    model = load_sessions_at(path, knobs)
    tok, pad_id = load_tokenizer(tokenizer, max_length=max_length)
    return OnnxScorer(model, tok, name=name, pad_id=pad_id, activation=activation)
