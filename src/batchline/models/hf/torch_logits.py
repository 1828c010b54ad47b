"""A text classifier's or a cross-encoder's folder on torch in bf16, as the
:class:`~batchline.models.onnx.sessions.Graph` the ONNX task models call
(:class:`~batchline.models.onnx.OnnxClassifier`, :class:`~batchline.models.onnx.OnnxScorer`):
the same inputs and ``logits`` output as the folder's converted ONNX graph, so labels, scores,
top-k and pairs are computed by the same code in either precision.

A ``BertForSequenceClassification`` on the CPU runs :mod:`.lean_encoder`'s forward under its
own pooler and classifier; another architecture runs transformers' forward with its linears
packed for oneDNN. Outputs are float32, as ONNX Runtime's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from batchline._errors import InputError, ModelError
from batchline._types import Array
from batchline.models.config import Knobs
from batchline.models.hf.export import require_torch
from batchline.models.onnx import OnnxTensor

__all__ = ["TorchLogits", "load_torch_logits"]

_INT64 = "tensor(int64)"


class TorchLogits:
    """``model`` (a transformers ``*ForSequenceClassification``) as a thread-safe graph with
    the inputs ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where the model has
    more than one type) and one output, ``logits`` ``(batch, labels)``."""

    def __init__(self, model: Any, *, path: Path, sessions: int) -> None:
        import torch

        from batchline.models.hf.lean_encoder import lean_encoder

        self._torch = torch
        self.path = path
        self._sessions = sessions
        config = model.config
        names = ["input_ids", "attention_mask"]
        if int(getattr(config, "type_vocab_size", 1) or 1) > 1:
            names.append("token_type_ids")
        self.inputs = tuple(OnnxTensor(n, ("batch", "sequence"), _INT64) for n in names)
        labels = int(config.num_labels)
        self.outputs = (OnnxTensor("logits", ("batch", labels), "tensor(float)"),)
        self._model = model
        bert = getattr(model, "bert", None)
        self._encoder = (
            lean_encoder(bert)
            if type(model).__name__ == "BertForSequenceClassification"
            and getattr(bert, "pooler", None) is not None
            else None
        )
        from batchline.models.common.torch_weights import pack_linear_weights

        if self._encoder is not None:
            # the encoder's weights live in the lean forward now; the pooler and classifier
            # stay transformers'
            model.bert.encoder = None
            pack_linear_weights(model.bert.pooler)
            pack_linear_weights(model.classifier)
        else:
            pack_linear_weights(model)

    @property
    def sessions(self) -> int:
        """Batches run at once: the knobs' ``sessions`` (torch's calls are thread-safe)."""
        return self._sessions

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return ("logits",)

    def run(
        self, feeds: Mapping[str, npt.ArrayLike], output_names: Sequence[str] | None = None
    ) -> dict[str, Array]:
        """``{"logits": (batch, labels) float32}`` of one padded batch."""
        unknown = [n for n in (output_names or ()) if n != "logits"]
        if unknown:
            raise InputError(f"{self.path.name} has no output {unknown[0]!r}; it has ['logits']")
        torch = self._torch
        with torch.inference_mode():
            tensors = {
                n: torch.from_numpy(np.asarray(feeds[n], np.int64)) for n in self.input_names
            }
            ids, mask = tensors["input_ids"], tensors["attention_mask"]
            types = tensors.get("token_type_ids")
            if self._encoder is not None:
                hidden = self._encoder(ids, mask, types)
                logits = self._model.classifier(self._model.bert.pooler(hidden))
            else:
                logits = self._model(
                    input_ids=ids, attention_mask=mask, token_type_ids=types
                ).logits
            out: Array = logits.float().numpy()
        return {"logits": out}

    def __repr__(self) -> str:
        return f"TorchLogits({self.path.name!r}, bf16)"


def load_torch_logits(folder: Path, knobs: Knobs, *, what: str) -> TorchLogits:
    """The sequence classifier in ``folder`` in bf16 on the CPU as a :class:`TorchLogits`
    laid out as ``knobs`` say (``intra_op_threads`` torch threads a batch, ``sessions``
    batches at once). ``ModelError`` naming ``what`` when torch is missing or the folder does
    not load."""
    torch, transformers = require_torch(what)
    if knobs.is_gpu:
        raise InputError(
            f"{what}: precision bf16 runs on the CPU here; on {knobs.device} use precision fp32"
        )
    torch.set_num_threads(knobs.intra_op_threads)
    from batchline.models.common.torch_weights import quiet_transformers

    try:
        with quiet_transformers():
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                folder, dtype=torch.bfloat16, local_files_only=True
            )
    except (OSError, ValueError, KeyError) as exc:
        raise ModelError(f"cannot load {what} from {folder}: {exc}") from exc
    model.eval()
    return TorchLogits(model, path=Path(folder), sessions=knobs.sessions)
