"""The ONNX backend's options: an embedding model's sessions (ONNX Runtime, or torch for bf16).

:class:`SessionOptions` is the deployment's core (:class:`~batchline.knobs.CoreKnobs`: batching,
device) plus what lays out and runs the sessions; :func:`load_sessions_at` reads only these.
The deployment's flat class (``batchline.models.config.Knobs``) composes it with the other
backends' options. A new session setting is one field here (``metadata=knob(help, SESSIONS)``;
a ``Literal`` if it takes names; a rule in ``_RULES`` if it is not a plain number >= 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, get_args

from batchline._errors import InputError
from batchline._knob_checks import Rules, check_own_fields
from batchline.knobs import SESSIONS, CoreKnobs, knob, machine_cores

__all__ = ["PRECISIONS", "Precision", "SessionOptions"]

#: What an embedding model or an image folder computes in (``SessionOptions.precision``;
#: ``jobs/precision.py``).
Precision = Literal["auto", "fp32", "bf16", "int8"]
PRECISIONS: tuple[str, ...] = get_args(Precision)

_RULES: Rules = {"quantize": (lambda v: v is None or v == "int8", "int8 or unset")}


@dataclass(frozen=True, kw_only=True)
class SessionOptions(CoreKnobs):
    """An embedding model's sessions: ``sessions`` of ``intra_op_threads`` threads each
    (defaulting to one per core of this machine), on ``device`` (:attr:`providers`), in
    ``precision`` (``auto`` is resolved by ``run``, ``serve``, ``bench`` and ``tune`` by
    measuring once per model and CPU kind past a quality gate, ``jobs/precision.py``; the loader
    itself, given ``auto``, loads fp32). ``quantize = "int8"`` is the older spelling of
    ``precision = "int8"``."""

    sessions: int = field(
        default_factory=machine_cores,
        metadata=knob("model sessions, each running one batch at a time", SESSIONS),
    )
    # One thread per session or torch generation engine: on a busy core a second thread only
    # waits (benchmarks/engine_levers.md, step-level A/B).
    intra_op_threads: int = field(default=1, metadata=knob("threads per session", SESSIONS))
    solo_intra_op_threads: int | None = field(
        default=None,
        metadata=knob(
            "threads of one extra, wider session a batch may use while no other runs, so low "
            "traffic gets the baseline's single-call latency (unset: none)",
            SESSIONS,
        ),
    )
    # An embedding model's graph in int8 (ONNX Runtime's dynamic quantization), used only when
    # it passes the quality gate against its float32 graph (models/onnx/quantize.py).
    quantize: Literal["int8"] | None = field(
        default=None,
        metadata=knob(
            "int8: an embedding model's graph in int8 (ONNX Runtime's dynamic quantization), "
            "refused unless its vectors pass the quality gate against float32 on the demo corpus",
            SESSIONS,
        ),
    )
    precision: Precision = field(
        default="auto",
        metadata=knob(
            "what an embedding, classify or score model computes in: auto (measured once per "
            "model and CPU kind, past a quality gate), fp32 or int8 (ONNX Runtime), bf16 "
            "(torch, oneDNN); int8 is for embedding models only",
            SESSIONS,
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantize == "int8" and self.precision != "int8":
            if self.precision != "auto":
                raise InputError(
                    f"quantize=int8 and precision={self.precision} disagree; "
                    "set precision alone (fp32, bf16 or int8)"
                )
            object.__setattr__(self, "precision", "int8")  # one name from here on
        check_own_fields(self, SessionOptions, _RULES)

    @property
    def providers(self) -> list[str | tuple[str, dict[str, str]]]:
        """ONNX Runtime execution providers for :attr:`device` (never a silent CPU fall-back:
        ``OnnxModel.load`` refuses a provider that is missing or fails to start)."""
        if self.device == "cpu":
            return ["CPUExecutionProvider"]
        _, _, index = self.device.partition(":")
        return [("CUDAExecutionProvider", {"device_id": index or "0"})]
