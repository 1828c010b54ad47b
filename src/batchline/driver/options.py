"""What ``batchline drive`` is asked to do: :class:`DriveOptions`, checked once, and the
endpoint URLs as the user may type them (:func:`normalize_endpoint`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, get_args
from urllib.parse import urlsplit

from batchline._errors import InputError
from batchline.datasets.selection import BadRecordMode, DatasetSelection
from batchline.driver.client import RouteName

__all__ = ["DriveOptions", "Encoding", "normalize_endpoint"]

Encoding = Literal["base64", "float"]

_ROUTE_SUFFIXES = ("/v1/embeddings", "/generate", "/ready")


@dataclass
class DriveOptions(DatasetSelection):
    """What to drive where; checked at construction (``InputError``). Units are in the names.

    The fields mirror ``batchline drive --help``; what to read and write is ``batchline run``'s
    (:class:`DatasetSelection`: ``input=None`` uses the built-in demo corpus). Knobs without a
    flag:

    - ``failures_to_set_aside``: consecutive endpoint failures that set an endpoint aside.
    - ``probe_cap_s``: the longest pause between two ``GET /ready`` probes of a set-aside one.
    - ``backoff_base_s``, ``backoff_cap_s``: a chunk's retry ``n`` waits a uniform random time
      in ``[0, min(cap, base * 2**(n-1))]``.
    - ``max_retry_after_s``: a longer ``Retry-After`` is cut to this.
    - ``affinity_slack``: with prefix affinity, how many more chunks in flight than the
      least-loaded replica a prefix's replica may hold and still take the prefix's chunks.
    """

    endpoints: Sequence[str]
    route: RouteName = "embeddings"
    model: str | None = None
    api_key: str | None = None
    chunk_size: int = 50
    output_chunk_size: int = 10_000
    concurrency: int = 10
    max_attempts: int = 8
    connect_timeout_s: float = 10.0
    read_timeout_s: float = 120.0
    give_up_after_s: float = 600.0
    failures_to_set_aside: int = 3
    probe_cap_s: float = 5.0
    backoff_base_s: float = 0.25
    backoff_cap_s: float = 30.0
    max_retry_after_s: float = 120.0
    encoding: Encoding = "base64"
    dim: int | None = None
    max_tokens: int | None = None
    #: ``--route generate``: each prompt through the model's chat template, as ``run`` does
    chat_template: bool = True
    #: a record whose text repeats one of the last 16,384 distinct texts takes that text's
    #: answer instead of being sent (``--no-dedupe``: every record is sent)
    dedupe: bool = True
    #: ``--route generate``: prompts of one long prefix go together to one replica (see
    #: ``driver/affinity.py``; ``--no-prefix-affinity``: least-loaded, in input order)
    prefix_affinity: bool = True
    affinity_slack: int = 1

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        """Raise ``InputError`` naming the first unusable setting (run again by ``drive_job``,
        as fields may have been changed since construction)."""
        if not self.endpoints:
            raise InputError("give at least one --endpoint URL")
        urls = [normalize_endpoint(u) for u in self.endpoints]
        if len(set(urls)) != len(urls):
            raise InputError(f"--endpoint repeats a URL: {urls}")
        for name in ("chunk_size", "output_chunk_size", "concurrency", "max_attempts"):
            value = getattr(self, name)
            if value < 1:
                raise InputError(f"--{_flag(name)} must be >= 1, got {value}")
        if self.failures_to_set_aside < 1:
            raise InputError(
                f"failures_to_set_aside must be >= 1, got {self.failures_to_set_aside}"
            )
        for name in ("connect_timeout_s", "read_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise InputError(f"--{_flag(name)} must be a number of seconds > 0, got {value}")
        if not (math.isfinite(self.probe_cap_s) and self.probe_cap_s >= 0.25):
            raise InputError(f"probe_cap_s must be >= 0.25 s, got {self.probe_cap_s}")
        for name in ("give_up_after_s", "backoff_base_s", "backoff_cap_s", "max_retry_after_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise InputError(f"--{_flag(name)} must be a number of seconds >= 0, got {value}")
        if self.backoff_cap_s < self.backoff_base_s:
            raise InputError("--backoff-cap-s must be >= --backoff-base-s")
        if self.dim is not None and self.dim < 1:
            raise InputError(f"--dim must be >= 1, got {self.dim}")
        if self.limit is not None and self.limit < 0:
            raise InputError(f"--limit must be >= 0, got {self.limit}")
        if self.route not in get_args(RouteName):
            raise InputError(
                f"--route must be embeddings, classify or generate, got {self.route!r}"
            )
        if self.max_tokens is not None and self.max_tokens < 1:
            raise InputError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.max_tokens is not None and self.route != "generate":
            raise InputError("--max-tokens goes with --route generate")
        if not self.chat_template and self.route != "generate":
            raise InputError("--no-chat-template goes with --route generate")
        if not self.prefix_affinity and self.route != "generate":
            raise InputError("--no-prefix-affinity goes with --route generate")
        if self.affinity_slack < 0:
            raise InputError(f"affinity_slack must be >= 0, got {self.affinity_slack}")
        if self.encoding not in get_args(Encoding):
            raise InputError(f"--encoding must be base64 or float, got {self.encoding!r}")
        if self.on_bad_record not in get_args(BadRecordMode):
            raise InputError(f"--on-bad-record must be fail or skip, got {self.on_bad_record!r}")


def _flag(name: str) -> str:
    # drive's request size is --records-per-request (--chunk-size is run's output chunk)
    return "records-per-request" if name == "chunk_size" else name.replace("_", "-")


def normalize_endpoint(url: str) -> str:
    """``http://host:port`` from what a user may type (a trailing slash or route path)."""
    text = url.strip().rstrip("/")
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise InputError(f"--endpoint {url!r} is not an http(s) URL like http://127.0.0.1:8000")
    if parts.query or parts.fragment:
        raise InputError(f"--endpoint {url!r}: give the server's base URL, without ?query or #")
    for suffix in _ROUTE_SUFFIXES:
        if text.endswith(suffix):
            text = text[: -len(suffix)]
            break
    return text
