"""``ServerSettings``: every knob of ``batchline serve`` in one pydantic model.

The same model backs the command-line flags, the ``--config`` file (TOML or JSON, flat keys,
see :func:`load_config`) and the tuner. Its batching and model layout is ONE
:class:`batchline.models.config.Knobs` (:attr:`ServerSettings.knobs`): the flat keys of a file or of
the keyword arguments that are ``Knobs`` fields (``sessions``, ``max_queue_size``...) update
serve's preset (:meth:`Knobs.serving`) and are validated by ``Knobs`` itself, so a file from
``batchline tune`` is a valid config, and :meth:`ServerSettings.write` writes one (flat).
Flags given on the command line win over the file; the API key comes from ``--api-key``, the
file, or the ``BATCHLINE_API_KEY`` environment variable, and is never written out or logged.

Example::

    settings = ServerSettings.from_file("serve.toml", port=9000)
    settings.knobs            # the Knobs every served model is batched with
    app = create_app(settings)

Where serve's defaults differ from ``Knobs``', and why:
:data:`batchline.models.config.SERVE_DEFAULTS`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from batchline._errors import InputError
from batchline._fsio import replacing
from batchline._priority import batcher_priority
from batchline.knobs import (
    DEFAULT_BUCKET_WIDTH,
    DEFAULT_PADDING_SLACK,
    check_setting_names,
    read_config_file,
    to_toml,
)
from batchline.models.config import Knobs
from batchline.models.openai.images import DEFAULT_MAX_IMAGE_BYTES

if TYPE_CHECKING:
    from batchline.models.specs import ModelSpec

__all__ = [
    "API_KEY_ENV",
    "BODY_JSON_ROOM",
    "DEFAULT_MAX_BODY_BYTES",
    "KNOB_FIELDS",
    "SETTING_NAMES",
    "ServerSettings",
    "load_config",
]

#: The flat keys that are :class:`batchline.models.config.Knobs` fields (they set ``knobs``).
KNOB_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(Knobs))

#: Pixels a served picture may declare (a 50 MP photo; ``run``'s limit is higher: files are
#: the operator's own, requests are anyone's).
DEFAULT_SERVE_PIXELS = 50_000_000

#: Environment variable read for the API key when none is given otherwise.
API_KEY_ENV = "BATCHLINE_API_KEY"


#: The request body limit when ``max_body_bytes`` is unset and no served model takes pictures.
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
#: Room for the JSON around a picture (its data URI's head, the model name, the other fields)
#: in the body limit of a server whose models take pictures.
BODY_JSON_ROOM = 64 * 1024
#: The settings that are sizes in bytes: each also takes ``20MiB``, ``512MB``.
_SIZE_FIELDS = (
    "max_body_bytes",
    "max_image_bytes",
    "max_decode_bytes",
    "max_batch_file_bytes",
    "max_stored_bytes",
)


class ServerSettings(BaseModel):
    """Everything ``batchline serve`` can be told; shared by flags, config file and tuner.

    Models:
        model: one or more model specs (``batchline.models.specs``): ``default``
            (all-MiniLM-L6-v2), ``smollm2`` (text generation), ``PATH.onnx``, ``PATH/`` (a
            Hugging Face causal-LM folder), ``module:factory``, each optionally
            ``NAME=SPEC``. A single string is one model.
        task: ``NAME=TASK`` for each model whose task is not its spec's own (``TASK`` alone
            with one model): ``embed``, ``classify``, ``predict`` or ``generate``.
        tokenizer, labels, pooling, normalize: options of a single model (see ``parse_specs``).
        model_name: the id clients pass as ``model`` for a single model given without
            ``NAME=`` (default: ``all-MiniLM-L6-v2``, the file's stem or the factory's name).
        model_weights: ``{name: weight}``: the models' shares of the device when several
            models are busy at once (default 1 each).
        model_priority: ``{name: priority}``: the priority of a request to that model that
            names none (``interactive`` by default; ``batch`` or an integer, lower sooner;
            see ``batchline._priority``). A request's ``priority`` field or
            ``X-Batchline-Priority`` header wins.
        truncate: ``True`` (default): over-long texts are cut to the model's limit, like most
            embedding APIs; ``False``: such a request gets 413.

    Memory (on-demand models, :mod:`batchline.server.residency`):
        memory_budget: ``6GiB``, ``512MB``, bytes, or a fraction of RAM (``0.5``, ``50%``):
            the memory the server process may hold, its models included; with it, models
            (generate ones too) load on their first request and idle ones are evicted (least
            recently used) when a load needs room (``None``: every model loads at startup
            and stays).
        preload, pin: models loaded at startup anyway; pinned ones are never evicted.
        keep_alive_s: an idle model is unloaded this long after its last use (``None``:
            only when its room is needed); model_keep_alive_s: ``{name: seconds}``.

    Batching and text generation (``knobs``): every :class:`batchline.models.config.Knobs` field
        (documented there) may be given flat, by its own name, and is validated by ``Knobs``;
        unset ones take serve's preset, :data:`batchline.models.config.SERVE_DEFAULTS`.

    Serving the batches:
        model_thread_nice: how much lower the model's threads run than the event loop.
        bucket_width, padding_slack: padding-aware grouping: a text joins a batch only if it
            adds at most ``padding_slack`` padded tokens.
        baseline_intra_op_threads, baseline_batch_size: the baseline's one session and the
            chunks each request's texts run in.

    Requests:
        request_timeout_s: a request not answered by then gets 504 and its queued records
            are withdrawn; a generate request, one that waits that long for a new token (its
            first included), so that a long answer making progress is not cut.
        max_inputs_per_request: more inputs in one request get 413.
        max_body_bytes: larger bodies get 413 (Content-Length and the bytes actually read).
            Unset: 8 MiB, or, when a served model takes pictures, enough for one picture of
            ``max_image_bytes`` in base64 and 64 KiB of JSON around it (:meth:`body_limit`).
        tokenize_inline_max_chars: requests whose texts total at most this many characters are
            tokenized on the event loop (a thread hop costs more than that), longer ones in a
            worker thread.
        retry_after_s: the ``Retry-After`` sent with 429 and 503.

    Pictures (image models, ``batchline.server.images``):
        max_image_bytes, max_image_pixels: a larger picture gets 413 (its encoded bytes; the
            pixels its header declares, checked before decoding: decompression bombs).
        max_decode_bytes: pictures' bytes in flight in a model's decode processes at most.
        decode_workers: decode processes per image model; unset, as many as cores, of which
            as many decode at once as keep up with the model, measured on the first requests
            (as ``run`` sizes them).
        allow_url_fetch: the hosts whose ``http(s)`` image URLs are fetched (exact names);
            none by default, so only data URIs and base64 are taken.
        modality: ``[NAME=]MODALITY`` per model (``with_modality``): a two-tower folder's
            (CLIP, SigLIP) tower to serve, ``text`` (the default) or ``image``; ``image`` on a
            plain ``.onnx`` serves it on the image routes (its NCHW input).

    Serving:
        host, port, api_key, drain_timeout_s (how long SIGTERM waits for in-flight work),
        log_level, access_log.

    Who may drive the server (``docs/security.md``):
        allowed_hosts: the names a request's ``Host`` header may carry (any port), besides
            the bind address's own (``localhost``, ``127.0.0.1`` and ``[::1]`` on loopback);
            ``*.example.com`` matches its subdomains, ``*`` any name. Bound to every
            interface (``0.0.0.0``, ``::``) with none given, any name is accepted (the
            server is meant to be reached by names it cannot know). A list, or one
            comma-separated string.
        cors_origins: the browser origins sent CORS headers (``https://app.example``, ``*``);
            none by default, so a web page of another origin cannot read an answer.
        api_key may hold several keys, comma-separated; api_key_file names a file of keys, one
        per line (blank lines and ``#`` comments skipped); any of them is accepted, and the
        Batch API's files and batches belong to the key that made them (:attr:`api_keys`).

    The Batch API (``/v1/files``, ``/v1/batches``: :mod:`batchline.server.batches`):
        data_dir: its SQLite metadata and files (default: ``batch-api`` in batchline's cache
            folder, ``batchline._cache.cache_dir()``); a restart on the same folder resumes
            the batches that were running.
        max_batch_file_bytes, max_batch_file_lines: an upload beyond either gets 413 (OpenAI's
            limits: 200 MB, 50,000 requests).
        max_stored_bytes, max_stored_files: the quota of each owner (each API key, and the
            keyless owner): the bytes and the number of its files kept (uploads, and batch
            outputs, which count but are never refused); an upload past either gets 403
            ``quota_exceeded`` (:mod:`batchline.server.batches.quota`).
        max_running_batches: batches run at once (one worker each); more wait in creation
            order. batch_chunk_size: lines per committed chunk (what a resume skips).
    """

    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)

    # -- models -----------------------------------------------------------------------------
    model: list[str] = Field(default_factory=lambda: ["default"], min_length=1)
    task: list[str] = Field(default_factory=list)
    tokenizer: str | None = None
    labels: list[str] | None = None
    pooling: Literal["mean", "cls", "none"] | None = None
    normalize: bool | None = None
    model_name: str | None = None
    model_weights: dict[str, float] = Field(default_factory=dict)
    model_priority: dict[str, str | int] = Field(default_factory=dict)
    memory_budget: str | None = None
    preload: list[str] = Field(default_factory=list)
    pin: list[str] = Field(default_factory=list)
    keep_alive_s: float | None = Field(default=300.0, gt=0)
    model_keep_alive_s: dict[str, float] = Field(default_factory=dict)
    truncate: bool = True

    # -- batching: one Knobs (every Knobs field is also a flat key: see _fold_knobs) ----------
    knobs: Knobs = Field(default_factory=Knobs.serving)
    """How every model is loaded and batched: serve's preset (:meth:`Knobs.serving`) updated
    with the flat knob keys given."""

    # -- serving the batches ----------------------------------------------------------------
    # Nice increment of the threads that run the model (Linux; 0: same priority), so the event
    # loop is not starved by them: see batchline.models.batching._niced.
    model_thread_nice: int = Field(default=5, ge=0, le=19)
    # Padding-aware grouping (see batchline._queue): lengths are bucketed this wide, and a
    # record joins a batch only if it adds at most padding_slack padded tokens (why these
    # values: knobs.DEFAULT_PADDING_SLACK).
    bucket_width: int = Field(default=DEFAULT_BUCKET_WIDTH, ge=1)
    padding_slack: int = Field(default=DEFAULT_PADDING_SLACK, ge=0)
    # The baseline (batching=False): one shared session with this many threads; each
    # request's texts run on it in chunks of baseline_batch_size, no queue. This is what the
    # published ratios (bench_serve.py) were measured against.
    baseline_intra_op_threads: int = Field(default=2, ge=1, le=256)
    baseline_batch_size: int = Field(default=32, ge=1)

    # -- requests ---------------------------------------------------------------------------
    request_timeout_s: float = Field(default=30.0, gt=0)
    max_inputs_per_request: int = Field(default=2048, ge=1)
    max_body_bytes: int | None = Field(default=None, ge=1024)
    # why inline below this: the measurements in batchline.server.state's docstring
    tokenize_inline_max_chars: int = Field(default=1024, ge=0)
    retry_after_s: int = Field(default=1, ge=0)
    max_image_bytes: int = Field(default=DEFAULT_MAX_IMAGE_BYTES, ge=1)
    max_image_pixels: int = Field(default=DEFAULT_SERVE_PIXELS, ge=1)
    max_decode_bytes: int = Field(default=256 * 1024 * 1024, ge=1)
    decode_workers: int | None = Field(default=None, ge=1)
    allow_url_fetch: list[str] = Field(default_factory=list)
    modality: list[str] = Field(default_factory=list)

    # -- serving ----------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    api_key: SecretStr | None = None
    api_key_file: Path | None = None
    drain_timeout_s: float = Field(default=30.0, ge=0)
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    access_log: bool = False
    allowed_hosts: list[str] = Field(default_factory=list)
    cors_origins: list[str] = Field(default_factory=list)

    # -- the Batch API ------------------------------------------------------------------------
    data_dir: Path | None = None
    max_batch_file_bytes: int = Field(default=200 * 1024 * 1024, ge=1)
    max_batch_file_lines: int = Field(default=50_000, ge=1)
    max_stored_bytes: int = Field(default=10 * 1024**3, ge=1)
    max_stored_files: int = Field(default=1000, ge=1)
    max_running_batches: int = Field(default=2, ge=1)
    batch_chunk_size: int = Field(default=256, ge=1)

    @field_validator("model", "task", "modality", "preload", "pin", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    @field_validator(*_SIZE_FIELDS, mode="before")
    @classmethod
    def _size(cls, value: object) -> object:
        """A size as the size flags take it (``20MiB``, ``512MB``, bytes)."""
        if isinstance(value, str):
            from batchline._sizes import parse_bytes

            return parse_bytes(value)
        return value

    @field_validator("allowed_hosts", "cors_origins", "allow_url_fetch", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            return [v.strip() for v in value if not isinstance(v, str) or v.strip()]
        return value

    @model_validator(mode="before")
    @classmethod
    def _fold_knobs(cls, data: object) -> object:
        """Flat knob keys (a config file's, ``sessions=2``) into the one ``knobs``."""
        if not isinstance(data, dict):
            return data
        flat = {k: data[k] for k in KNOB_FIELDS if k in data}
        if not flat and isinstance(data.get("knobs"), Knobs | None):
            return data
        out = {k: v for k, v in data.items() if k not in KNOB_FIELDS}
        base = out.pop("knobs", None)
        if flat.get("max_concurrent_batches", 0) is None:
            del flat["max_concurrent_batches"]  # None: one per session, as unset
        try:
            if isinstance(base, Knobs):
                out["knobs"] = base.replace(**flat)
            elif base is None or isinstance(base, dict):
                out["knobs"] = Knobs.serving(**{**(base or {}), **flat})
            else:
                raise ValueError(f"knobs must be a Knobs or a table, got {type(base).__name__}")
        except InputError as exc:
            raise ValueError(str(exc)) from None
        except TypeError:
            unknown = sorted(set(base or {}) - set(KNOB_FIELDS))  # a table with a typo
            raise ValueError(f"knobs: unknown setting(s) {', '.join(unknown)}") from None
        return out

    @model_validator(mode="after")
    def _check(self) -> ServerSettings:
        for name, value in (
            ("request_timeout_s", self.request_timeout_s),
            ("drain_timeout_s", self.drain_timeout_s),
            ("batch_timeout_s", self.knobs.batch_timeout_s),
        ):
            if not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number of seconds")
        for name, weight in self.model_weights.items():
            if not (math.isfinite(weight) and weight > 0):
                raise ValueError(f"model_weights[{name!r}] must be > 0, got {weight}")
        for priority in self.model_priority.values():
            batcher_priority(priority)  # a ValueError naming the accepted forms
        if self.memory_budget is not None:
            from batchline._residency import parse_bytes

            parse_bytes(self.memory_budget, total=1)  # a ValueError naming the accepted forms
        for name, seconds in self.model_keep_alive_s.items():
            if not (math.isfinite(seconds) and seconds > 0):
                raise ValueError(f"model_keep_alive_s[{name!r}] must be > 0, got {seconds}")
        knobs = self.knobs
        if knobs.batching and self.max_inputs_per_request > knobs.max_queue_size:
            raise ValueError(
                f"max_inputs_per_request ({self.max_inputs_per_request}) must be <= "
                f"max_queue_size ({knobs.max_queue_size}), or a request that large could "
                "never be queued"
            )
        if self.api_key is not None and not self.api_key.get_secret_value():
            raise ValueError("api_key must not be empty")
        for name in self.allowed_hosts:
            if not name or any(c in name for c in "/ @?#"):
                raise ValueError(
                    f"allowed_hosts: {name!r} is not a host name; give names as clients send "
                    "them in Host, without scheme or path: api.example.com, *.example.com, *"
                )
        for origin in self.cors_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ValueError(
                    f"cors_origins: {origin!r} is not an origin; give scheme://host[:port], "
                    "e.g. https://app.example.com, or *"
                )
        if self.api_key is not None and not _split_keys(self.api_key.get_secret_value()):
            raise ValueError("api_key holds no key (only commas and spaces)")
        if self.api_key_file is not None:
            self.api_keys  # noqa: B018 (reads the file: an OSError or an empty file is refused here)
        return self

    @property
    def api_keys(self) -> tuple[str, ...]:
        """Every accepted API key: ``api_key``'s (comma-separated), then ``api_key_file``'s
        (one per line); empty when the server takes requests without one."""
        keys = list(_split_keys(self.api_key.get_secret_value())) if self.api_key else []
        if self.api_key_file is not None:
            try:
                text = self.api_key_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise ValueError(f"api_key_file {str(self.api_key_file)!r}: {exc}") from None
            found = [
                line.strip()
                for line in text.splitlines()
                if line.strip() and not line.lstrip().startswith("#")
            ]
            if not found:
                raise ValueError(f"api_key_file {str(self.api_key_file)!r} holds no key")
            keys.extend(found)
        return tuple(dict.fromkeys(keys))

    @property
    def batch_data_dir(self) -> Path:
        """Where the Batch API keeps its data: ``data_dir``, else ``batch-api`` in the cache."""
        if self.data_dir is not None:
            return self.data_dir
        from batchline._cache import cache_dir

        return cache_dir() / "batch-api"

    # -- building ---------------------------------------------------------------------------

    @classmethod
    def build(cls, data: Mapping[str, object] | None = None, **overrides: object) -> ServerSettings:
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
    def from_file(cls, path: str | os.PathLike[str], **overrides: object) -> ServerSettings:
        """Read a TOML or JSON config file (see :func:`load_config`), then apply overrides."""
        return cls.build(load_config(path), **overrides)

    def to_dict(self) -> dict[str, object]:
        """The settings as plain, flat values (the knobs by their own names, as a config file
        holds them), without the API key (it is never written out)."""
        data = self.model_dump(mode="json", exclude={"api_key", "knobs"}, exclude_none=True)
        data.update({k: v for k, v in dataclasses.asdict(self.knobs).items() if v is not None})
        return data

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the settings (minus the API key) as TOML, or JSON for a ``.json`` path."""
        p = Path(path)
        data = self.to_dict()
        if p.suffix.lower() == ".json":
            text = json.dumps(data, indent=2, sort_keys=True) + "\n"
        else:
            text = to_toml(dict(sorted(data.items())))
        with replacing(p, "config.serve") as f:  # whole or not at all
            f.write(text.encode("utf-8"))
        return p

    def body_limit(self, *, pictures: bool) -> int:
        """The largest request body served (413 beyond): ``max_body_bytes`` when set; unset,
        :data:`DEFAULT_MAX_BODY_BYTES`, or, when a served model takes ``pictures``, at least
        one picture of ``max_image_bytes`` in base64 (4/3 of its bytes) and
        :data:`BODY_JSON_ROOM` around it, so that the picture limit can be reached."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        if not pictures:
            return DEFAULT_MAX_BODY_BYTES
        base64 = -(-self.max_image_bytes * 4 // 3)
        return max(DEFAULT_MAX_BODY_BYTES, base64 + BODY_JSON_ROOM)

    @property
    def host_names(self) -> frozenset[str] | None:
        """The names (lower case, IPv6 without brackets) a request's ``Host`` may carry, with
        any port; ``*.example.com`` entries match subdomains; ``None``: any name (``*``, or
        bound to every interface with no ``allowed_hosts``)."""
        given = {h.lower().removeprefix("[").removesuffix("]") for h in self.allowed_hosts}
        bind = self.host.lower().removeprefix("[").removesuffix("]")
        wildcard = bind in _ALL_INTERFACES
        if "*" in given or (wildcard and not given):
            return None
        return frozenset(given | _LOOPBACK_NAMES | (set() if wildcard else {bind}))

    @property
    def baseline_knobs(self) -> Knobs:
        """The knobs of the baseline's layout (:meth:`Knobs.baseline`): one session of
        ``baseline_intra_op_threads`` threads that every request uses at once."""
        return self.knobs.baseline(self.baseline_intra_op_threads)

    @property
    def specs(self) -> list[ModelSpec]:
        """The served models' specs, named and with their tasks (``InputError`` when a spec
        is malformed, names a missing file, or two models share a name)."""
        from batchline.models.specs import parse_specs

        specs = parse_specs(
            list(self.model),
            tasks=list(self.task),
            tokenizer=Path(self.tokenizer) if self.tokenizer else None,
            labels=tuple(self.labels) if self.labels is not None else None,
            pooling=self.pooling,
            normalize=self.normalize,
            modalities=list(self.modality),
        )
        if self.model_name:
            if len(specs) > 1:
                raise InputError("model_name names a single model; with several, use NAME=SPEC")
            specs = [dataclasses.replace(specs[0], name=self.model_name)]
        for key, named in (
            ("model_weights", self.model_weights),
            ("model_priority", self.model_priority),
            ("model_keep_alive_s", self.model_keep_alive_s),
            ("preload", dict.fromkeys(self.preload)),
            ("pin", dict.fromkeys(self.pin)),
        ):
            unknown = sorted(set(named) - {s.name for s in specs})
            if unknown:
                raise InputError(
                    f"{key} names {', '.join(unknown)}, not served here; models: "
                    + ", ".join(s.name for s in specs)
                )
        return specs


#: The names a loopback server answers to: what a local client sends as ``Host``.
_LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
#: Bind addresses that mean every interface.
_ALL_INTERFACES = frozenset({"0.0.0.0", "::", ""})

#: Every flat key a config file (or ``ServerSettings(...)``) may hold.
SETTING_NAMES: frozenset[str] = frozenset(ServerSettings.model_fields) - {"knobs"} | frozenset(
    KNOB_FIELDS
)


def load_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a flat TOML or JSON config file (:func:`batchline.knobs.read_config_file`).

    TOML keys may sit at the top level or in a ``[server]`` table. Raises ``InputError`` if
    the file is missing or malformed.
    """
    data = read_config_file(path)
    if isinstance(data.get("server"), dict):
        data = {**{k: v for k, v in data.items() if k != "server"}, **data["server"]}
    check_setting_names(data, SETTING_NAMES, where=str(path))
    return data


def _split_keys(text: str) -> tuple[str, ...]:
    return tuple(k.strip() for k in text.split(",") if k.strip())


def _describe(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_input=False, include_url=False):
        msg = str(err["msg"]).removeprefix("Value error, ")
        where = ".".join(str(x) for x in err["loc"])
        parts.append(f"{where}: {msg}" if where else msg)
    return "invalid server settings: " + "; ".join(parts)
