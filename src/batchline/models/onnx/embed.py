"""``embed``: texts to vectors through an ONNX text encoder (the built-in model is one).

:class:`TextEmbedder` is the :class:`~batchline.models.protocol.BatchModel` over the
:class:`~batchline.models.onnx.embedder.Embedder`'s two sync stages: ``tokenize`` (prepare) and
``embed_tokens`` (a batch). Cost is a text's token count, padded (``len(batch) × longest``).

With a solo session (``Knobs.solo_intra_op_threads``), a batch that starts while no other
runs takes one wider session: on a 2-core CPU two one-thread sessions give the most
throughput when two batches run at once, but a batch running alone (one request at a time)
is faster on one two-thread session, the baseline's layout. Costs one more session in memory.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Unpack

import numpy as np
import numpy.typing as npt

from batchline._types import Vector
from batchline.models.onnx.embedder import (
    DenseLayer,
    Embedder,
    EmbedderOptions,
    TokenizedText,
    tokenizer_max_length,
)
from batchline.models.onnx.options import SessionOptions
from batchline.models.onnx.sessions import SessionModel, tokenizer_path
from batchline.models.protocol import ModelInfo
from batchline.models.specs import ModelSpec

__all__ = ["TextEmbedder", "load_embedder", "load_onnx_embedder"]


class TextEmbedder(SessionModel):
    """An :class:`Embedder`'s stages as a batch model (task ``embed``)."""

    def __init__(self, embedder: Embedder, *, name: str, solo: Embedder | None = None) -> None:
        self.embedder = embedder
        self.tokenizer = embedder.tokenizer
        self.solo = solo
        self.solo_batches = 0
        self.shared_batches = 0
        self._lock = threading.Lock()
        self._running = 0
        self._info = ModelInfo(
            name=name,
            task="embed",
            input_kind="text",
            cost_kind="padded",
            result_kind="vector",
            result_column="embedding",
            max_tokens=tokenizer_max_length(embedder.tokenizer),
            details={"dim": embedder.dim},
        )

    @property
    def dim(self) -> int:
        return self.embedder.dim

    @property
    def sessions(self) -> int:
        """Sessions of the main pool: the batches that can run at once."""
        return self.embedder.model.sessions

    def prepare(self, inputs: Sequence[object]) -> list[TokenizedText | BaseException]:
        return list(self.embedder.tokenize([_text(x) for x in inputs]))

    def cost(self, item: TokenizedText) -> int:
        return max(1, len(item))

    def run_batch(self, batch: list[TokenizedText]) -> list[Vector]:
        return list(self.embed_tokens(batch))

    def embed_tokens(self, batch: Sequence[TokenizedText]) -> npt.NDArray[np.float32]:
        if self.solo is None:
            return self.embedder.embed_tokens(batch)
        with self._lock:
            alone = self._running == 0
            self._running += 1
            if alone:
                self.solo_batches += 1
            else:
                self.shared_batches += 1
        try:
            return (self.solo if alone else self.embedder).embed_tokens(batch)
        finally:
            with self._lock:
                self._running -= 1


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    raise TypeError(f"an embedding input must be a string, got {type(value).__name__}")


def load_embedder(spec: ModelSpec, knobs: SessionOptions) -> TextEmbedder:
    """Load the built-in encoder or an ``.onnx`` one laid out as ``knobs`` say (a wider solo
    session beside the batching ones when ``knobs.solo_intra_op_threads`` asks for one)."""
    from batchline.models.onnx import minilm

    options = _folder_options(spec)
    if spec.normalize is not None:
        options["normalize"] = spec.normalize
    if spec.pooling is not None:
        options["pooling"] = spec.pooling
    if spec.kind == "builtin":
        path = minilm.default_model_path()
        tok = minilm.weights_dir() / "tokenizer.json"
        max_length: int | None = minilm.MAX_LENGTH
    else:
        path, tok, max_length = spec.path, tokenizer_path(spec), None
        if spec.folder is not None and spec.folder.max_seq_length is not None:
            max_length = spec.folder.max_seq_length
    return load_onnx_embedder(
        path, tok, name=spec.name, knobs=knobs, max_length=max_length, **options
    )


def _folder_options(spec: ModelSpec) -> EmbedderOptions:
    """What a sentence-transformers layout beside a folder's ``model.onnx`` says: its Dense
    layers and normalization, and its pooling when the graph returns token vectors (a graph
    that already pools is used as it is)."""
    import onnx

    found = spec.folder
    if found is None or found.pooling is None:
        return {}
    dense = [DenseLayer.load(d) for d in found.dense]
    options: EmbedderOptions = {"normalize": found.normalize, "dense": dense}
    outputs = list(onnx.load(str(spec.path), load_external_data=False).graph.output)
    named = [o for o in outputs if o.name == "sentence_embedding"]
    out = (named or outputs)[0] if outputs else None
    if out is not None and len(out.type.tensor_type.shape.dim) == 3:
        options["pooling"] = found.pooling
    return options


def load_onnx_embedder(
    path: Path,
    tokenizer: Path,
    *,
    name: str,
    knobs: SessionOptions,
    max_length: int | None = None,
    **options: Unpack[EmbedderOptions],
) -> TextEmbedder:
    """An ONNX text encoder file and its ``tokenizer.json`` as a :class:`TextEmbedder` laid
    out as ``knobs`` say (its int8 graph with ``knobs.precision`` int8); ``options`` go to
    :class:`Embedder` (``pooling``, ``normalize``, ``dense``)."""
    if knobs.precision == "int8":
        from batchline.models.onnx.quantize import quantized_graph

        path = quantized_graph(path)

    def make(sessions: int, threads: int, *, shared: bool = False) -> Embedder:
        return Embedder.from_onnx(
            path,
            tokenizer,
            max_length=max_length,
            sessions=sessions,
            intra_op_threads=threads,
            providers=knobs.providers,
            shared=shared,
            **options,
        )

    if not knobs.batching:
        return TextEmbedder(make(1, knobs.intra_op_threads, shared=True), name=name)
    main = make(knobs.sessions, knobs.intra_op_threads)
    solo = knobs.solo_intra_op_threads
    wide = make(1, solo) if solo is not None and solo > knobs.intra_op_threads else None
    return TextEmbedder(main, name=name, solo=wide)
