"""Opt-in OpenTelemetry traces: whether the standard ``OTEL_*`` variables ask for them, and the
tracer the server and ``drive`` then use (``batchline[trace]``).

Off by default, and free when off: this module imports only the standard library, and
:func:`tracing_from_env` returns ``None`` without importing anything of OpenTelemetry unless
the environment asks for traces. Each caller keeps that ``None`` and tests it once per request
or per batch, so the hot path never pays for the feature it does not use.

Tracing is on when ``OTEL_TRACES_EXPORTER`` names an exporter (``otlp``, ``console``, or any
installed ``opentelemetry_traces_exporter`` entry point; ``none`` keeps it off), or, when that
is unset, when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` is set;
never when ``OTEL_SDK_DISABLED`` is true. Everything else is the SDK's own reading of its
variables: the OTLP exporter its endpoint, headers and timeouts, the ``BatchSpanProcessor`` its
queue and delays, the provider its sampler (``OTEL_TRACES_SAMPLER``) and resource
(``OTEL_RESOURCE_ATTRIBUTES``); ``OTEL_SERVICE_NAME`` defaults to ``batchline``. Incoming and
outgoing trace context uses the globally configured propagator (``OTEL_PROPAGATORS``; W3C
``traceparent`` by default).

>>> tracing_requested({"OTEL_TRACES_EXPORTER": "otlp"})
True
>>> tracing_requested({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318", "OTEL_SDK_DISABLED": "true"})
False
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, cast

from batchline._commands import install_command
from batchline._errors import InputError

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

__all__ = ["Tracing", "tracing_for", "tracing_from_env", "tracing_requested"]


def tracing_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the ``OTEL_*`` variables in ``environ`` (default: the process's) ask for traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporters = env.get("OTEL_TRACES_EXPORTER")
    if exporters is not None and exporters.strip():
        return any(_names(exporters))
    return bool(
        env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
        or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    )


def _names(exporters: str) -> list[str]:
    return [n for n in (x.strip().lower() for x in exporters.split(",")) if n and n != "none"]


class Tracing:
    """A tracer and the few OpenTelemetry calls batchline makes, bound once.

    Built only when tracing is on (:func:`tracing_from_env`, :func:`tracing_for`); callers hold
    ``Tracing | None``. ``wall_ns`` turns a ``time.perf_counter()`` reading (what the batcher's
    and the server's timestamps are) into the epoch nanoseconds spans are stamped with.
    """

    def __init__(self, provider: TracerProvider, *, owned: bool) -> None:
        from opentelemetry import context, propagate, trace

        self.provider = provider
        self.tracer = provider.get_tracer("batchline")
        self._owned = owned
        self.attach = context.attach
        self.detach = context.detach
        self.in_context = trace.set_span_in_context
        self.current_span = trace.get_current_span
        self.extract = propagate.extract
        self.inject = propagate.inject
        self.propagator_fields: frozenset[str] = frozenset(propagate.get_global_textmap().fields)
        self.SERVER = trace.SpanKind.SERVER
        self.CLIENT = trace.SpanKind.CLIENT
        self.error = trace.Status(trace.StatusCode.ERROR)
        self._offset_ns = time.time_ns() - time.perf_counter_ns()

    def wall_ns(self, perf_s: float) -> int:
        """Epoch nanoseconds of a ``time.perf_counter()`` reading."""
        return self._offset_ns + int(perf_s * 1e9)

    def shutdown(self) -> None:
        """Flush and close the provider, when this object made it (a provider passed in is the
        caller's to close)."""
        if self._owned:
            self.provider.shutdown()


def tracing_for(provider: TracerProvider) -> Tracing:
    """Trace with ``provider`` (an OpenTelemetry ``TracerProvider``: tests, benchmarks, or an
    application that configured its own); the caller shuts it down."""
    return Tracing(provider, owned=False)


def tracing_from_env(environ: Mapping[str, str] | None = None) -> Tracing | None:
    """The tracer the ``OTEL_*`` variables ask for, or ``None`` (nothing imported) when they
    ask for none. Raises ``InputError`` (one line: what to install, which variable to fix)
    when the extra is missing or an exporter is unknown."""
    env = os.environ if environ is None else environ
    if not tracing_requested(env):
        return None
    names = _names(env.get("OTEL_TRACES_EXPORTER", "") or "otlp")
    try:
        from opentelemetry.sdk.resources import SERVICE_NAME, Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError as exc:
        raise InputError(_missing(exc)) from None
    protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", ""
    )
    exporters = [_exporter(name, grpc=protocol.strip().lower() == "grpc") for name in names]
    # Resource.create reads OTEL_RESOURCE_ATTRIBUTES and OTEL_SERVICE_NAME; ours is the default
    attributes = {} if env.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: "batchline"}
    provider = TracerProvider(resource=Resource.create(attributes))
    for exporter in exporters:
        provider.add_span_processor(BatchSpanProcessor(exporter))
    return Tracing(provider, owned=True)


def _exporter(name: str, *, grpc: bool = False) -> SpanExporter:
    """A span exporter by its ``OTEL_TRACES_EXPORTER`` name, configured from its own variables
    (``otlp``: over HTTP, the extra's, unless the protocol variable says ``grpc``)."""
    if name == "otlp" and grpc:
        name = "otlp_proto_grpc"
    try:
        if name == "otlp_proto_grpc":
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (  # type: ignore[import-not-found, unused-ignore]
                    OTLPSpanExporter as GrpcExporter,
                )
            except ImportError:
                raise InputError(
                    "OTLP over gRPC asked for (OTEL_EXPORTER_OTLP_PROTOCOL=grpc) but its exporter "
                    "is not installed: pip install opentelemetry-exporter-otlp-proto-grpc, or "
                    "use http/protobuf (the trace extra's)"
                ) from None
            return cast("SpanExporter", GrpcExporter())
        if name in ("otlp", "otlp_proto_http"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            return OTLPSpanExporter()
        if name == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            return ConsoleSpanExporter()
        from importlib.metadata import entry_points
    except ImportError as exc:
        raise InputError(_missing(exc)) from None
    found = list(entry_points(group="opentelemetry_traces_exporter", name=name))
    if not found:
        known = sorted({"otlp", "console", *_entry_point_names()})
        raise InputError(
            f"OTEL_TRACES_EXPORTER={name!r} is not an installed trace exporter; "
            f"use one of {', '.join(known)} (or none)"
        )
    return cast("SpanExporter", found[0].load()())


def _entry_point_names() -> Iterable[str]:
    from importlib.metadata import entry_points

    return (ep.name for ep in entry_points(group="opentelemetry_traces_exporter"))


def _missing(exc: ImportError) -> str:
    what = getattr(exc, "name", None) or "opentelemetry"
    return (
        f"tracing is on (OTEL_* variables) but {what} is not installed: "
        f"{install_command('trace')} "
        "(or unset OTEL_TRACES_EXPORTER / OTEL_EXPORTER_OTLP_ENDPOINT)"
    )
