"""The cross-cutting part of a deployment's knobs, and the config file that carries them.

``batchline tune`` writes this file; ``batchline run --config F`` and
``batchline serve --config F`` read it. JSON (``.json``) or TOML (``.toml``), flat keys::

    {"batching": true, "target_batch_tokens": 512, "max_concurrent_batches": 2,
     "sessions": 2, "intra_op_threads": 1}

A deployment's settings are one flat class composed by the model layer,
:class:`batchline.models.config.Knobs`: :class:`CoreKnobs` here (how records become batches,
the :class:`~batchline.BatchPolicy` a batcher gets, and the ``device``), plus each backend's
options class beside its backend (``models/onnx/options.py``: an embedding model's sessions;
``models/generation/options.py``: text generation, the torch engine, vLLM). The core cannot
import ``models/``, so the composed class lives there; this module gives what every options
class is built from: :func:`knob` (a field's help and concern), the concerns' names, and the
file's load and dump.

Defaults come from measurements on a 2-core CPU with all-MiniLM-L6-v2 (docs/CONTRACTS.md,
FACTS): two sessions of one intra-op thread each, one batch in flight per session, about
512 padded tokens per call. ``batching=false`` is the single-shared-session baseline: one
session using every core, each record run on its own, two callers at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from batchline._config_file import (
    NOTE_KEYS,
    check_setting_names,
    parse_set_options,
    read_config_file,
    to_toml,
)
from batchline._flags import add_deprecated_flag
from batchline._fsio import replacing
from batchline._knob_checks import DEVICE_RULE, Rules, check_own_fields, check_policy_knobs, integer
from batchline._policy import POLICY_FIELDS, BatchPolicy

__all__ = [
    "BATCHING",
    "DEFAULT_BUCKET_WIDTH",
    "DEFAULT_PADDING_SLACK",
    "DEFAULT_TARGET_BATCH_TOKENS",
    "GENERATION",
    "NOTE_KEYS",
    "SESSIONS",
    "TORCH",
    "VLLM",
    "CoreKnobs",
    "Preset",
    "add_deprecated_flag",
    "check_setting_names",
    "knob",
    "machine_cores",
    "parse_set_options",
    "read_config_file",
    "to_toml",
]

# Padded tokens per model call. MiniLM-L6 on ONNX Runtime (2 sessions x 1 thread) peaks at
# about 256-1,024 padded tokens per call and falls beyond ~2k; benchmarks/bench_embeddings.py
# measures 256/512/1024 and this is the best of them on a mixed-length corpus.
DEFAULT_TARGET_BATCH_TOKENS = 512

# Length grouping for the TokenBatcher. A batch may take a text that adds at most this many
# padded tokens (about what one more model call costs on MiniLM); the core's default (16)
# let short-text batches carry ~18% padding and cost ~15% throughput in
# benchmarks/bench_embeddings.py, 4 brought padding under 5%.
DEFAULT_PADDING_SLACK = 4
DEFAULT_BUCKET_WIDTH = 2

#: The batcher's own defaults, which the knobs of the same names take (``batchline._policy``).
_POLICY = BatchPolicy()

#: The concerns the knobs fall in (``metadata["group"]``): the CLI adds each group's flags
#: where its command wants them (``batchline.models.config.knob_names``).
BATCHING, SESSIONS, GENERATION, TORCH, VLLM = "batching", "sessions", "generation", "torch", "vllm"


def knob(help: str, group: str, **more: str) -> dict[str, str]:
    """A knob field's metadata: its help and its concern, written once beside its default;
    the CLI builds the field's flag from them (``batchline._flags``)."""
    return {"help": help, "group": group, **more}


def machine_cores() -> int:
    """The CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


class Preset(int):
    """A layout knob's value that nobody gave (``max_concurrent_batches``' default): the
    runtime a model loads on may replace it with the layout measured best for it
    (:func:`batchline.jobs.precision.runtime_layout`). A value from a flag, ``--set``, a
    config file or a caller is a plain ``int``, and is kept; arithmetic on a Preset gives a
    plain ``int``."""

    __slots__ = ()


def _preset_cores() -> int:
    return Preset(machine_cores())


#: CoreKnobs' fields that are not plain numbers >= 1 (the batcher's own: ``BatchPolicy``).
_RULES: Rules = {
    "batching": (lambda v: isinstance(v, bool), "true or false"),
    "bulk_batch_tokens": (lambda v: v is None or integer(1)(v), "an integer >= 1 or unset"),
    "device": DEVICE_RULE,
}


@dataclass(frozen=True, kw_only=True)
class CoreKnobs:
    """What every layer of a deployment reads: how records become batches (the
    :class:`~batchline.BatchPolicy` a batcher gets, :meth:`policy`) and where the model runs.
    ``mix_priorities`` and ``priority_yield`` are the batcher's (see ``batchline._queue``): on a
    GPU, where a fuller batch costs little more, ``mix_priorities=True`` and
    ``priority_yield=1.0`` keep batches full. ``device``: ``cpu`` or ``cuda[:N]`` (an
    embedding model on ONNX Runtime's CUDA execution provider needs the ``onnxruntime-gpu``
    build). Each field's meaning is its ``help`` (``metadata``), which is also its flag's help.

    A backend's options class extends this one with its own concern's fields; the deployment's
    class, :class:`batchline.models.config.Knobs`, composes them all.
    """

    # -- batching: how records become batches (the BatchPolicy a batcher gets: policy()) ----
    batching: bool = field(
        default=True,
        metadata=knob(
            "batch records; false: the no-batching baseline",
            BATCHING,
            off="the baseline to compare against: one shared session, one record per call (a text "
            "generator: one sequence at a time)",
        ),
    )
    target_batch_tokens: int = field(
        default=DEFAULT_TARGET_BATCH_TOKENS,
        metadata=knob("padded tokens per model call", BATCHING),
    )
    max_batch_size: int = field(
        default=_POLICY.max_batch_size, metadata=knob("records per model call, at most", BATCHING)
    )
    max_concurrent_batches: int = field(
        default_factory=_preset_cores,
        metadata=knob("batches in flight at once (default: one per session)", BATCHING),
    )
    min_batch_size: int = field(
        default=_POLICY.min_batch_size,
        metadata=knob(
            "while a slot is free, hold records until this many are queued (1: never hold)",
            BATCHING,
        ),
    )
    batch_timeout_s: float = field(
        default=_POLICY.batch_timeout_s,
        metadata=knob(
            "hold records for --min-batch-size at most this many seconds",
            BATCHING,
        ),
    )
    max_queue_size: int = field(
        default=_POLICY.max_queue_size,
        metadata=knob(
            "records queued per model beyond the batches being formed: up to max_queue_size + "
            "(prefetch_batches + 1) x max_batch_size wait (prefetch_batches is 2); beyond, run "
            "waits and serve answers 429",
            BATCHING,
        ),
    )
    mix_priorities: bool = field(
        default=_POLICY.mix_priorities,
        metadata=knob(
            "let a batch take records of lower priority than its first (on a GPU, where a fuller "
            "batch costs little more)",
            BATCHING,
        ),
    )
    priority_yield: float = field(
        default=_POLICY.priority_yield,
        metadata=knob(
            "while higher priorities arrive, a batch takes at most this fraction of its budget, "
            "in (0, 1] (1: off)",
            BATCHING,
        ),
    )
    bulk_slots: int | None = field(
        default=_POLICY.bulk_slots,
        metadata=knob(
            "slots of their own for bulk work, the Batch API's lines (unset: bulk shares them)",
            BATCHING,
        ),
    )
    bulk_thread_nice: int = field(
        default=_POLICY.bulk_thread_nice,
        metadata=knob("bulk batches' worker threads run at nice +N (0-19)", BATCHING),
    )
    bulk_batch_tokens: int | None = field(
        default=None,
        metadata=knob(
            "bulk batches' own padded-token budget (unset: --target-batch-tokens)", BATCHING
        ),
    )
    device: str = field(
        default="cpu",
        metadata=knob(
            "cpu (default) or cuda[:N]: where the model runs",
            SESSIONS,
            metavar="DEVICE",
        ),
    )

    def __post_init__(self) -> None:
        check_own_fields(self, CoreKnobs, _RULES, skip=_POLICY_KNOBS)
        check_policy_knobs({name: getattr(self, name) for name in _POLICY_KNOBS})

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Self:
        """Read a JSON or TOML config file; unknown keys are an error (a typo must not pass)."""
        p = Path(path)
        data = read_config_file(p)
        check_setting_names(data, (f.name for f in dataclasses.fields(cls)), where=str(p))
        return cls(**data)

    def dump(self, path: str | os.PathLike[str], **notes: object) -> Path:
        """Write the knobs, plus free-form ``notes`` (e.g. what was measured), as TOML for a
        ``.toml`` path and JSON otherwise; :meth:`load` and ``serve --config`` read either."""
        p = Path(path)
        data: dict[str, object] = {
            k: v for k, v in dataclasses.asdict(self).items() if v is not None
        }
        data.update(notes)
        text = to_toml(data) if p.suffix.lower() == ".toml" else json.dumps(data, indent=2) + "\n"
        with replacing(p, "config.knobs") as f:  # whole or not at all
            f.write(text.encode("utf-8"))
        return p

    def replace(self, **changes: Any) -> Self:
        return dataclasses.replace(self, **changes)

    def policy(self, **changes: Any) -> BatchPolicy:
        """The :class:`~batchline.BatchPolicy` these knobs give a batcher: every field the two
        share by name, ``target_batch_tokens`` and ``bulk_batch_tokens`` as the budgets
        (``target_batch_cost``, ``bulk_batch_cost``), then ``changes`` (a model's own units,
        the length grouping). ``min_batch_size`` is capped at ``max_batch_size``."""
        values: dict[str, Any] = {name: getattr(self, name) for name in _POLICY_KNOBS}
        values.update(
            target_batch_cost=self.target_batch_tokens,
            bulk_batch_cost=self.bulk_batch_tokens,
            min_batch_size=min(self.min_batch_size, self.max_batch_size),
        )
        values.update(changes)
        return BatchPolicy(**values)


#: The CoreKnobs fields that are BatchPolicy fields of the same name and meaning.
_POLICY_KNOBS = tuple(f.name for f in dataclasses.fields(CoreKnobs) if f.name in POLICY_FIELDS)
