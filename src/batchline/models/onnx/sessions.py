"""An ``.onnx`` spec's files and sessions: :func:`tokenizer_path` finds its tokenizer,
:func:`load_sessions_at` opens its ONNX Runtime sessions laid out as the knobs say. Every task
module here (``embed``, ``classify``, ``predict``) loads through them, and its model is a
:class:`SessionModel`. A task model calls its model through :class:`Graph` (a text model:
:class:`TextGraph`) only, so another runtime with that surface runs it too (torch in bf16)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeVar

from batchline._errors import InputError
from batchline._types import Array
from batchline.models.onnx.options import SessionOptions
from batchline.models.protocol import ModelInfo, check_token_ids
from batchline.models.specs import ModelSpec

if TYPE_CHECKING:
    import numpy.typing as npt
    from tokenizers import Tokenizer

    from batchline.models.onnx.runtime import OnnxModel, OnnxTensor

__all__ = ["Graph", "SessionModel", "Shaped", "TextGraph", "load_sessions_at", "tokenizer_path"]

T = TypeVar("T")


class Shaped(Protocol):
    """A graph output's shape, as ONNX Runtime gives it (ints, or names for free axes)."""

    @property
    def shape(self) -> Sequence[int | str | None]: ...


class Graph(Protocol):
    """What a task model runs its batches on: the graph's file or folder, its input and output
    names, its outputs' shapes, how many batches it runs at once, and one thread-safe run.
    :class:`~batchline.models.onnx.OnnxModel` is one (ONNX Runtime); torch in bf16 gives
    others (:class:`~batchline.models.image.torch_image.TorchPixels` for pictures,
    :class:`~batchline.models.hf.torch_logits.TorchLogits` for texts)."""

    @property
    def path(self) -> Path: ...

    @property
    def input_names(self) -> tuple[str, ...]: ...

    @property
    def output_names(self) -> tuple[str, ...]: ...

    @property
    def outputs(self) -> Sequence[Shaped]: ...

    @property
    def sessions(self) -> int: ...

    def run(
        self, feeds: Mapping[str, npt.ArrayLike], output_names: Sequence[str] | None = None
    ) -> Mapping[str, Array]: ...


class TextGraph(Graph, Protocol):
    """A :class:`Graph` a text task model feeds token ids: its inputs' names and element types,
    and its outputs', as ONNX Runtime describes them."""

    @property
    def inputs(self) -> tuple[OnnxTensor, ...]: ...

    @property
    def outputs(self) -> tuple[OnnxTensor, ...]: ...


class SessionModel:
    """What the ONNX task models share: their ``info`` (set once, as ``_info``), the size of
    their session pool (``model``), results that are already what outputs store, and nothing
    to close (sessions are freed with the object)."""

    model: Graph
    _info: ModelInfo
    #: the model's ``tokenizers.Tokenizer`` (text models; ``None`` for tensor models)
    tokenizer: Tokenizer | None = None

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def sessions(self) -> int:
        """Sessions of the pool: the batches that can run at once."""
        return self.model.sessions

    def encode(self, result: T) -> T:
        # vectors as float32 arrays, tensors as arrays in the model's dtypes, classifications
        # as mappings: each output (batchline.datasets.columns) and route takes them as they are
        return result

    def close(self) -> None:
        """Sessions are freed with the object; nothing to close explicitly."""

    def token_ids(self, text: str, *, special_tokens: bool = True) -> list[int]:
        """The ids the model is fed for ``text`` (truncated as it is): see
        :class:`~batchline.models.protocol.Tokenizing`."""
        if self.tokenizer is None:
            raise InputError(f"model {self.info.name!r} takes tensors, not text: no tokenizer")
        return list(self.tokenizer.encode(text, add_special_tokens=special_tokens).ids)

    def token_text(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens dropped."""
        if self.tokenizer is None:
            raise InputError(f"model {self.info.name!r} takes tensors, not text: no tokenizer")
        check_token_ids(ids, self.tokenizer.get_vocab_size(with_added_tokens=True))
        text: str = self.tokenizer.decode(list(ids), skip_special_tokens=True)
        return text


def tokenizer_path(spec: ModelSpec) -> Path:
    """The tokenizer of an ``.onnx`` text model: the spec's, or ``tokenizer.json`` beside it."""
    if spec.tokenizer is not None:
        if not spec.tokenizer.is_file():
            raise InputError(f"{spec.tokenizer}: no such tokenizer file")
        return spec.tokenizer
    guess = spec.path.with_name("tokenizer.json")
    if not guess.is_file():
        raise InputError(
            f"no tokenizer for {spec.path}: pass a tokenizer.json (--tokenizer PATH) or put one "
            f"beside the model (looked for {guess})"
        )
    return guess


def load_sessions_at(path: Path, knobs: SessionOptions) -> OnnxModel:
    """The ``OnnxModel`` of the ONNX file ``path`` in the knobs' layout: ``knobs.sessions``
    sessions for batching, or one session every caller shares for the baseline;
    ``knobs.intra_op_threads`` threads each, on ``knobs.providers``; its batch axis checked."""
    from batchline.models.onnx.runtime import OnnxModel

    return OnnxModel.load(
        path,
        sessions=knobs.sessions if knobs.batching else 1,
        intra_op_threads=knobs.intra_op_threads,
        providers=knobs.providers,
        shared=not knobs.batching,
    )
