"""``ServerSettings``: every knob of ``batchline serve`` in one pydantic model.

The same model backs the command-line flags, the ``--config`` file (TOML or JSON, flat keys,
see :func:`load_config`) and the tuner: a file from ``batchline tune`` (``batchline.knobs``)
is a valid config, and :meth:`ServerSettings.write` writes one. Flags given on the command
line win over the file; the API key comes from ``--api-key``, the file, or the
``BATCHLINE_API_KEY`` environment variable, and is never written out or logged.

Example::

    settings = ServerSettings.from_file("serve.toml", port=9000)
    app = create_app(settings)

The defaults were chosen from ``benchmarks/bench_serve.py`` on a 2-core CPU (see the comments
next to each one).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from batchline._errors import InputError
from batchline.knobs import (
    DEFAULT_BUCKET_WIDTH,
    DEFAULT_PADDING_SLACK,
    read_config_file,
    to_toml,
)

__all__ = ["API_KEY_ENV", "ServerSettings", "load_config"]

#: Environment variable read for the API key when none is given otherwise.
API_KEY_ENV = "BATCHLINE_API_KEY"


class ServerSettings(BaseModel):
    """Everything ``batchline serve`` can be told; shared by flags, config file and tuner.

    Model:
        model: ``"default"`` (all-MiniLM-L6-v2) or the path of an ``.onnx`` encoder.
        tokenizer: its Hugging Face ``tokenizer.json`` (default: ``tokenizer.json`` next to it).
        model_name: the id clients pass as ``model`` (default: ``all-MiniLM-L6-v2`` or the
            file's stem).
        max_text_tokens: truncate or reject texts longer than this (default: the tokenizer's
            own limit, 256 for the default model).
        truncate: ``True`` (default): over-long texts are cut to ``max_text_tokens``, like
            most embedding APIs; ``False``: such a request gets 413.

    Batching:
        batching: ``False`` serves the baseline: one shared session, no queue.
        sessions, intra_op_threads: ONNX Runtime sessions (one per batch in flight) and the
            threads each uses.
        solo_intra_op_threads: threads of one extra session used by a batch that runs alone
            (``None``: none); low traffic then gets the baseline's batch-1 latency.
        model_thread_nice: how much lower the model's threads run than the event loop.
        target_batch_tokens, max_batch_size: a batch's padded-token budget and row cap.
        max_concurrent_batches: batches in flight at once (default: one per session).
        bucket_width, padding_slack: padding-aware grouping: a text joins a batch only if it
            adds at most ``padding_slack`` padded tokens.
        min_batch_size, batch_timeout_s: hold records while a slot is free until
            ``min_batch_size`` are queued, at most ``batch_timeout_s`` (default: never hold).
        max_queue_size: records queued at most; beyond it requests get 429 at once.

    Requests:
        request_timeout_s: a request not answered by then gets 504 and its queued records
            are withdrawn.
        max_inputs_per_request: more texts in one request get 413.
        max_body_bytes: larger bodies get 413 (Content-Length and the bytes actually read).
        tokenize_inline_max_chars: requests whose texts total at most this many characters are
            tokenized on the event loop (a thread hop costs more than that), longer ones in a
            worker thread.
        retry_after_s: the ``Retry-After`` sent with 429 and 503.

    Serving:
        host, port, api_key, drain_timeout_s (how long SIGTERM waits for in-flight work),
        log_level, access_log.
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # -- model ------------------------------------------------------------------------------
    model: str = "default"
    tokenizer: str | None = None
    model_name: str | None = None
    max_text_tokens: int | None = Field(default=None, ge=2)
    truncate: bool = True

    # -- batching ---------------------------------------------------------------------------
    batching: bool = True
    # Two sessions of one thread each: two batches in flight on a 2-core CPU. bench_serve.py,
    # short texts at c=32: 2x1 gave x1.15-1.19 the baseline's req/s, 1x2 x0.98.
    sessions: int = Field(default=2, ge=1, le=64)
    intra_op_threads: int = Field(default=1, ge=1, le=256)
    # A batch that starts while no other runs uses one extra session with this many threads
    # (None: no extra session). Batch-1 latency: 2 threads beat 1, so low traffic is as fast
    # as the baseline's two-thread session, and concurrent batches still get a core each.
    solo_intra_op_threads: int | None = Field(default=2, ge=1, le=256)
    spinning: bool = False
    # Where the model runs: cpu, cuda or cuda:N (batchline.knobs.Knobs.device).
    device: str = Field(default="cpu", pattern=r"^(cpu|cuda(:\d+)?)$")
    # Nice increment of the threads that run the model, so the event loop (HTTP, tokenizing,
    # forming batches) is not starved by them (Linux; 0: same priority). bench_serve.py, short
    # texts at c=32: x1.19 the baseline's req/s with p99 x1.40 at 0, x1.34 with p99 x0.83 at 5.
    model_thread_nice: int = Field(default=5, ge=0, le=19)
    # 256 padded tokens per call. bench_serve.py at c=32 (ratios to the baseline's req/s, p99):
    # 256: short x1.44 / x0.89, mixed x1.08 / x1.18; 512: x1.34 / x0.92, x1.04 / x1.32;
    # 1024: x1.25 / x1.34, x1.07 / x1.35. On this CPU a sentence costs about the same at any
    # batch size past a few, so bigger batches of long texts only add latency. Re-checked with
    # padding_slack 4 (2026-11-23, quiet machine): 128: short x1.29, mixed x0.97; 256: x1.34,
    # x1.06 / p99 x1.15; 512: x1.31, x1.06 / p99 x1.26.
    target_batch_tokens: int = Field(default=256, ge=1)
    max_batch_size: int = Field(default=64, ge=1)
    # Padding-aware grouping (see batchline._queue): lengths are bucketed this wide, and a
    # record joins a batch only if it adds at most padding_slack padded tokens. The Embedder's
    # tight groups: on this CPU a padded token costs about what a real one does, and smaller
    # batches cost little. bench_serve.py, short texts, req/s against the baseline's:
    # slack 4 / width 2: c=32 x1.33-1.37, c=64 x1.53; slack 16 / width 8: c=32 x1.21-1.27,
    # c=64 x1.40; slack 64: c=32 x1.14.
    bucket_width: int = Field(default=DEFAULT_BUCKET_WIDTH, ge=1)
    padding_slack: int = Field(default=DEFAULT_PADDING_SLACK, ge=0)
    # Batches in flight at once (default: one per session).
    max_concurrent_batches: int | None = Field(default=None, ge=1, le=256)
    # Hold records while a slot is free until this many are queued (1: never hold)...
    min_batch_size: int = Field(default=1, ge=1)
    # ...but no longer than this.
    batch_timeout_s: float = Field(default=0.05, ge=0)
    # As large as one request may be (max_inputs_per_request): a few seconds of short texts on
    # 2 cores (~300/s measured on the shared machine); more would only delay the 429.
    max_queue_size: int = Field(default=2048, ge=1)
    # The baseline (batching=False): one session with this many threads, texts run in chunks.
    baseline_intra_op_threads: int = Field(default=2, ge=1, le=256)
    baseline_batch_size: int = Field(default=32, ge=1)

    # -- requests ---------------------------------------------------------------------------
    request_timeout_s: float = Field(default=30.0, gt=0)
    max_inputs_per_request: int = Field(default=2048, ge=1)
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    # Inline tokenizing of one short text costs ~25-35 us of loop time; asyncio.to_thread
    # costs ~60-140 us (measured, see the module docstring of batchline.server.app).
    tokenize_inline_max_chars: int = Field(default=1024, ge=0)
    retry_after_s: int = Field(default=1, ge=0)

    # -- serving ----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    drain_timeout_s: float = Field(default=30.0, ge=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = False

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        for name in ("request_timeout_s", "drain_timeout_s", "batch_timeout_s"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number of seconds")
        if self.batching and self.max_inputs_per_request > self.max_queue_size:
            raise ValueError(
                f"max_inputs_per_request ({self.max_inputs_per_request}) must be <= "
                f"max_queue_size ({self.max_queue_size}), or a request that large could "
                "never be queued"
            )
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("api_key must not be empty")
        return self

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def build(cls, data: dict[str, Any] | None = None, **overrides: Any) -> ServerSettings:
        """Validate ``data`` updated with the non-``None`` ``overrides``.

        The API key falls back to ``$BATCHLINE_API_KEY``. Raises ``InputError`` with one
        line per problem.
        """
        merged = dict(data or {})
        merged.update({k: v for k, v in overrides.items() if v is not None})
        if merged.get("api_key") is None:
            env_key = os.environ.get(API_KEY_ENV)
            if env_key:
                merged["api_key"] = env_key
        try:
            return cls.model_validate(merged)
        except ValidationError as exc:
            raise InputError(_describe(exc)) from None

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], **overrides: Any) -> ServerSettings:
        """Read a TOML or JSON config file (see :func:`load_config`), then apply overrides."""
        return cls.build(load_config(path), **overrides)

    def to_dict(self) -> dict[str, Any]:
        """The settings as plain values, without the API key (it is never written out)."""
        return self.model_dump(mode="json", exclude={"api_key"}, exclude_none=True)

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the settings (minus the API key) as TOML, or JSON for a ``.json`` path."""
        p = Path(path)
        data = self.to_dict()
        if p.suffix.lower() == ".json":
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        else:
            text = to_toml(dict(sorted(data.items())))
        p.write_text(text, encoding="utf-8")
        return p

    @property
    def served_name(self) -> str:
        """The model id clients use (``model`` in requests, ``GET /v1/models``)."""
        if self.model_name:
            return self.model_name
        if self.model == "default":
            return "all-MiniLM-L6-v2"
        return Path(self.model).stem


def load_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a flat TOML or JSON config file (:func:`batchline.knobs.read_config_file`).

    TOML keys may sit at the top level or in a ``[server]`` table. Raises ``InputError`` if
    the file is missing or malformed.
    """
    data = read_config_file(path)
    if isinstance(data.get("server"), dict):
        data = {**{k: v for k, v in data.items() if k != "server"}, **data["server"]}
    return data


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        where = ".".join(str(x) for x in err["loc"]) or "settings"
        parts.append(f"{where}: {err['msg']}")
    return "invalid server settings: " + "; ".join(parts)
