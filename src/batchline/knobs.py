"""The batching knobs of a model deployment, and the config file that carries them.

``batchline tune`` writes this file; ``batchline run --config F`` and
``batchline serve --config F`` read it. JSON (``.json``) or TOML (``.toml``), flat keys::

    {"batching": true, "target_batch_tokens": 512, "max_concurrent_batches": 2,
     "sessions": 2, "intra_op_threads": 1}

Defaults come from measurements on a 2-core CPU with all-MiniLM-L6-v2 (docs/CONTRACTS.md,
FACTS): two sessions of one intra-op thread each, one batch in flight per session, about
512 padded tokens per call. ``batching=false`` is the single-shared-session baseline: one
session using every core, each record run on its own, two callers at once.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batchline._errors import InputError

__all__ = ["BASELINE", "Knobs"]


@dataclass(frozen=True)
class Knobs:
    """How one model replica batches. See the module docstring for the file format."""

    batching: bool = True
    target_batch_tokens: int = 512
    max_batch_size: int = 256
    max_concurrent_batches: int = 2
    sessions: int = 2
    intra_op_threads: int = 1
    min_batch_size: int = 1
    batch_timeout_s: float = 0.05
    max_queue_size: int = 5_000

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "batching":
                if not isinstance(value, bool):
                    raise InputError(f"batching must be true or false, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise InputError(f"{f.name} must be a number, got {value!r}")
            least = 0 if f.name == "batch_timeout_s" else 1
            if value < least:
                raise InputError(f"{f.name} must be >= {least}, got {value!r}")

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Knobs:
        """Read a JSON or TOML config file; unknown keys are an error (a typo must not pass)."""
        p = Path(path)
        try:
            raw = p.read_bytes()
        except OSError as exc:
            raise InputError(f"{p}: cannot read config file: {exc.strerror}") from None
        try:
            if p.suffix.lower() == ".toml":
                data: Any = tomllib.loads(raw.decode())
            else:
                data = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise InputError(f"{p}: not a valid config file: {exc}") from None
        if not isinstance(data, dict):
            raise InputError(f"{p}: a config file holds one object of settings")
        data.pop("comment", None)
        data.pop("measured", None)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InputError(
                f"{p}: unknown setting(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        return cls(**data)

    def dump(self, path: str | os.PathLike[str], **notes: Any) -> None:
        """Write the knobs as JSON (plus free-form ``notes``, e.g. what was measured)."""
        data: dict[str, Any] = dataclasses.asdict(self)
        data.update(notes)
        Path(path).write_text(json.dumps(data, indent=2) + "\n")

    def replace(self, **changes: Any) -> Knobs:
        return dataclasses.replace(self, **changes)

    def embedder_options(self) -> dict[str, Any]:
        """Keyword arguments for ``Embedder.default`` / ``Embedder.from_onnx``."""
        return {
            "sessions": self.sessions,
            "intra_op_threads": self.intra_op_threads,
            "target_batch_tokens": self.target_batch_tokens,
            "max_batch_size": self.max_batch_size,
            "max_concurrent_batches": self.max_concurrent_batches,
            "min_batch_size": self.min_batch_size,
            "batch_timeout_s": self.batch_timeout_s,
            "max_queue_size": self.max_queue_size,
            # the baseline's callers all run on its one session at once
            "shared": not self.batching and self.sessions == 1,
        }


#: The no-batching baseline: one shared session with every core, records one at a time.
BASELINE = Knobs(batching=False, sessions=1, intra_op_threads=2, max_concurrent_batches=2)
