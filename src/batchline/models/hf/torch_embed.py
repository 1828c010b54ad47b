"""Embedders on torch: a sentence-transformers folder whose transformer is a causal decoder
(Qwen3, Qwen2, Llama, ...: the Qwen3-Embedding layout), pooled at its last token (or mean, cls)
and normalized, as a :class:`~batchline.models.protocol.BatchModel` of task ``embed``; and an
encoder asked for in bf16 (``precision``), which otherwise goes to ONNX (:mod:`.export`). A
decoder's causal mask and rotary positions are left to transformers here; a BERT encoder on the
CPU runs :mod:`.lean_encoder`'s forward instead of transformers' (the same outputs, fewer calls).

A batch is padded on the RIGHT: each sequence keeps the positions it has alone, the causal mask
keeps padding out of every real token, and last-token pooling takes each row's own last real
token (not the batch's last column, which is padding in every row but the longest). So a text's
vector does not depend on what it is batched with.

Example::

    model = load_torch_embedder(Path("Qwen3-Embedding-0.6B/"), name="qwen3-emb",
                                pooling="lasttoken", normalize=True, max_length=None,
                                knobs=Knobs())
    vectors = model.run_batch(model.prepare(["a text", "another"]))
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline._types import Vector
from batchline.models.config import Knobs
from batchline.models.hf.export import require_torch
from batchline.models.onnx import TokenizedText, pad_sequences
from batchline.models.protocol import ModelInfo

__all__ = ["POOLINGS", "TorchEmbedder", "direct_tokenizer", "load_torch_embedder"]

#: The token poolings a torch embedder does (sentence-transformers' names).
POOLINGS = ("lasttoken", "mean", "cls")


class TorchEmbedder:
    """A transformers model's token vectors, pooled (and normalized), as an ``embed`` model.

    ``prepare`` tokenizes (special tokens as the folder's tokenizer adds them, truncated at
    ``max_length``); ``run_batch`` pads on the right and runs one forward pass under
    ``torch.inference_mode()``. Cost: a text's token count, padded.

    ``model`` is the transformers model, or a :class:`~.lean_encoder.LeanBertEncoder` built from
    it: either is called with ``(input_ids, attention_mask)`` for the last hidden state.
    """

    def __init__(
        self,
        model: Any,
        tokenizer: Any,
        *,
        device: Any,
        name: str,
        pooling: str,
        normalize: bool,
        max_length: int | None,
        pad_id: int,
        dim: int,
    ) -> None:
        if pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        import torch

        self._torch = torch
        self.model = model
        self.tokenizer = tokenizer
        self._direct = direct_tokenizer(tokenizer, max_length)
        self.pooling = pooling
        self.normalize = normalize
        self.max_length = max_length
        self.pad_id = pad_id
        self._device = device
        from batchline.models.hf.lean_encoder import LeanBertEncoder

        self._hidden = model if isinstance(model, LeanBertEncoder) else self._transformers_hidden
        self._dim = dim
        self._info = ModelInfo(
            name=name,
            task="embed",
            input_kind="text",
            cost_kind="padded",
            result_kind="vector",
            result_column="embedding",
            max_tokens=max_length,
            details={"dim": dim},
        )

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def dim(self) -> int:
        return self._dim

    def prepare(self, inputs: Sequence[object]) -> list[TokenizedText | BaseException]:
        out: dict[int, TokenizedText | BaseException] = {}
        texts: list[str] = []
        where: list[int] = []
        for i, value in enumerate(inputs):
            if isinstance(value, str):
                # lone surrogates (from JSON) would stop the tokenizer: replaced, as the ONNX
                # embedder does
                texts.append(value.encode("utf-8", "replace").decode("utf-8"))
                where.append(i)
            else:
                kind = type(value).__name__
                out[i] = TypeError(f"an embedding input must be a string, got {kind}")
        if texts:
            encoded = self._encode(texts)
            for i, ids in zip(where, encoded, strict=True):
                out[i] = (
                    TokenizedText(np.asarray(ids, dtype=np.int64))
                    if ids
                    else InputError("the text has no tokens to embed")
                )
        return [out[i] for i in range(len(inputs))]

    def _encode(self, texts: list[str]) -> list[list[int]]:
        """The token ids of ``texts``, truncated at ``max_length``: straight from the
        tokenizers library where that gives the folder's tokenizer's ids (checked at load),
        else through transformers' tokenizer (which re-applies its truncation settings on
        every call: most of a short request's tokenizing time)."""
        direct = self._direct
        if direct is not None:
            if len(texts) == 1:
                return [direct.encode(texts[0]).ids]
            return [e.ids for e in direct.encode_batch(texts)]
        truncate = self.max_length is not None
        ids: list[list[int]] = self.tokenizer(
            texts, truncation=truncate, max_length=self.max_length, padding=False
        )["input_ids"]
        return ids

    def cost(self, item: TokenizedText) -> int:
        return max(1, len(item))

    def run_batch(self, batch: list[TokenizedText]) -> list[Vector]:
        return list(self.embed_tokens(batch)) if batch else []

    def embed_tokens(self, batch: Sequence[TokenizedText]) -> npt.NDArray[np.float32]:
        """One padded batch's vectors, ``(len(batch), dim)`` float32 (as the ONNX embedder's)."""
        if not batch:
            return np.zeros((0, self._dim), dtype=np.float32)
        torch = self._torch
        ids, mask = pad_sequences([t.ids for t in batch], pad_value=self.pad_id)
        with torch.inference_mode():
            input_ids = torch.from_numpy(ids).to(self._device)
            attention = torch.from_numpy(mask).to(self._device)
            hidden = self._hidden(input_ids, attention)
            if self.pooling == "lasttoken":
                last = torch.tensor([len(t) - 1 for t in batch], device=self._device)
                pooled = hidden[torch.arange(len(batch), device=self._device), last]
            elif self.pooling == "cls":
                pooled = hidden[:, 0]
            else:
                weights = attention.unsqueeze(-1).to(hidden.dtype)
                pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            # normalized in float32: a bf16 model's vectors are then unit length to float32
            pooled = pooled.float()
            if self.normalize:
                pooled = torch.nn.functional.normalize(pooled, p=2, dim=-1)
            vectors: npt.NDArray[np.float32] = pooled.cpu().numpy()
        return vectors

    def _transformers_hidden(self, input_ids: Any, attention: Any) -> Any:
        return self.model(input_ids=input_ids, attention_mask=attention).last_hidden_state

    def encode(self, result: Vector) -> Vector:
        return result

    def close(self) -> None:
        """The weights are freed with the object."""


def load_torch_embedder(
    folder: Path,
    *,
    name: str,
    pooling: str,
    normalize: bool,
    max_length: int | None,
    knobs: Knobs,
    bf16: bool = False,
    lean: bool = True,
) -> TorchEmbedder:
    """Load the transformer in ``folder`` (its ``config.json``, weights and tokenizer) in fp32
    (``bf16``: bfloat16) on ``knobs.device`` as an ``embed`` model that pools with ``pooling``
    (``lasttoken``, ``mean`` or ``cls``) and L2-normalizes when ``normalize``. ``max_length``
    truncates inputs (default: the tokenizer's limit, within the model's positions). On the
    CPU torch runs ``knobs.intra_op_threads`` threads per batch; a BERT encoder runs
    :mod:`.lean_encoder`'s forward (``lean=False``: transformers'), and another bf16 model's
    linear weights are packed once for oneDNN (its AMX or AVX512-BF16 kernels; the same
    outputs).

    Raises ``ModelError`` when torch or transformers is missing (with the install) or the
    folder does not load; ``ValueError`` for an unknown pooling.
    """
    if pooling not in POOLINGS:
        raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
    folder = Path(folder)
    torch, transformers = require_torch(f"the decoder embedder in {folder}")
    device = torch.device(knobs.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ModelError(
            f"device {knobs.device!r} asked for, but torch sees no CUDA device; "
            "use device = 'cpu' or a CUDA build of torch"
        )
    if device.type == "cpu":
        torch.set_num_threads(knobs.intra_op_threads)
    from batchline.models.common.torch_weights import quiet_transformers

    try:
        with quiet_transformers():
            tokenizer = transformers.AutoTokenizer.from_pretrained(folder, local_files_only=True)
            model = transformers.AutoModel.from_pretrained(
                folder, dtype=torch.bfloat16 if bf16 else torch.float32, local_files_only=True
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load the embedder in {folder}: {exc}") from exc
    model.to(device).eval()
    config = model.config.get_text_config(decoder=True)
    runner = _runner(model, bf16=bf16, lean=lean, cpu=device.type == "cpu")
    limit = _max_length(max_length, tokenizer, config)
    pad_id = tokenizer.pad_token_id
    if pad_id is None:  # right padding never reaches a real token: any id in the vocabulary
        pad_id = tokenizer.eos_token_id if tokenizer.eos_token_id is not None else 0
    return TorchEmbedder(
        runner,
        tokenizer,
        device=device,
        name=name,
        pooling=pooling,
        normalize=normalize,
        max_length=limit,
        pad_id=int(pad_id),
        dim=int(config.hidden_size),
    )


def _runner(model: Any, *, bf16: bool, lean: bool, cpu: bool) -> Any:
    """What computes ``model``'s hidden states: on the CPU, its lean forward where there is
    one (the transformers model is then dropped), else the model, in bf16 with its linears
    packed."""
    if not cpu:
        return model
    if lean:
        from batchline.models.hf.lean_encoder import lean_encoder

        encoder = lean_encoder(model)
        if encoder is not None:
            return encoder
    if bf16:
        from batchline.models.common.torch_weights import pack_linear_weights

        pack_linear_weights(model)
    return model


def _max_length(asked: int | None, tokenizer: object, config: object) -> int | None:
    """``asked``, else the tokenizer's ``model_max_length`` where it is real (transformers sets
    a huge sentinel when the folder names none), capped by the model's positions."""
    positions = getattr(config, "max_position_embeddings", None)
    if asked is not None:
        if asked < 1:
            raise ValueError(f"max_length must be >= 1, got {asked}")
        return asked
    own = getattr(tokenizer, "model_max_length", None)
    candidates = [int(x) for x in (own, positions) if isinstance(x, int) and 0 < x < 10**7]
    return min(candidates) if candidates else None


#: Texts a direct tokenizer must encode as the folder's tokenizer does before it is used:
#: plain, accented and CJK text, markup, spaces alone, special-token spellings, and one
#: longer than any limit (truncation).
_PROBES = (
    "a text",
    "  Leading and trailing spaces, punctuation: (yes!) -- 3.14  ",
    "naïve café, Straße, 東京都, emoji \U0001f600",
    "<s> [CLS] </s> [SEP] <|endoftext|> <pad> [MASK]",
    " ",
    "word " * 2100,
)


def direct_tokenizer(tokenizer: Any, max_length: int | None) -> Any | None:
    """A copy of ``tokenizer``'s own ``tokenizers.Tokenizer`` with truncation at
    ``max_length`` set once, when it encodes every probe text to exactly the ids that
    ``tokenizer`` gives; ``None`` otherwise (a slow tokenizer, or one whose transformers
    class adds tokens of its own), and the caller keeps ``tokenizer``."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        from tokenizers import Tokenizer

        direct = Tokenizer.from_str(backend.to_str())
        direct.no_padding()
        if max_length is None:
            direct.no_truncation()
        else:
            direct.enable_truncation(max_length)
        probes = list(_PROBES)
        want = tokenizer(
            probes, truncation=max_length is not None, max_length=max_length, padding=False
        )["input_ids"]
        got = [e.ids for e in direct.encode_batch(probes)]
        single = direct.encode(probes[0]).ids
    except Exception:  # any difference in kind: keep the folder's tokenizer
        return None
    if got != [list(ids) for ids in want] or single != list(want[0]):
        return None
    return direct
