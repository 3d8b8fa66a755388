"""OpenTelemetry traces: the set-up at process start, the trace context across the queue, and a
span helper (docs/tracing.md).

Configured by OpenTelemetry's own environment variables, read by the SDK itself:
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), OTEL_SERVICE_NAME,
OTEL_RESOURCE_ATTRIBUTES, OTEL_EXPORTER_OTLP_HEADERS, OTEL_TRACES_SAMPLER(_ARG), OTEL_BSP_* (the
batch's delay and sizes), OTEL_PROPAGATORS; OTEL_SDK_DISABLED=true turns it off. Spans leave over
OTLP/HTTP (protobuf), in batches, from a thread of the SDK's.

Off, at no cost, when no endpoint is set: `tracing_setup` then returns before importing the SDK,
so no provider is installed and no SDK module is loaded; `span` returns one shared object whose
methods do nothing, and creates no span object; `context_from_headers` and `trace_carrier` return
at once. The hot paths (the submit, the claim, the gateway's call) test `tracing.active`, a module
global, before anything else: while off they pay that one branch and allocate nothing.
(OpenTelemetry's API alone would still make a non-recording span per call: this module never calls
it while off.) tests/telemachus/test_tracing.py checks both in a fresh process.

Prompts and answers are never recorded, unless TELEMACHUS_TRACE_CONTENT=1 (`content_traced`).

Across the queue: a job keeps the W3C trace context of the span that submitted it in
`job.meta["trace"]` (`{"traceparent": ..., "tracestate": ...}`, from `trace_carrier`), so the
worker's spans for it, in another process, continue the caller's trace (`context_from_carrier`)."""

import os
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Any

from django.core.exceptions import ImproperlyConfigured

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.trace import Link, Span, SpanKind, Tracer

# Where a job keeps the trace context it was submitted in (Job.meta).
TRACE_META_KEY = "trace"
_tracer: "Tracer | None" = None
# Whether this process records spans: the one branch a hot path takes while tracing is off
# (read as `tracing.active`, never imported by name: it changes at set-up).
active = False


class _NoSpan:
    """What `span` gives while tracing is off: a context manager and a span whose methods do
    nothing. One instance serves every call."""

    def __enter__(self) -> "_NoSpan":
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        return None

    def set_attribute(self, key: str, value: Any) -> None:
        return None

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        return None

    def add_event(self, name: str, attributes: Mapping[str, Any] | None = None) -> None:
        return None

    def record_exception(self, exception: BaseException) -> None:
        return None

    def is_recording(self) -> bool:
        return False

    def end(self) -> None:
        return None


NO_SPAN = _NoSpan()


def tracing_configured() -> bool:
    """Whether the environment asks for traces: an OTLP endpoint is set, the SDK is not disabled
    and the traces exporter is not `none`."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def tracing_setup(*, service_name: str) -> bool:
    """At process start (the API server's ASGI app, the worker command): when the environment
    asks for traces, install the SDK's tracer provider with a batching OTLP/HTTP exporter, the
    process named `service_name` unless OTEL_SERVICE_NAME names it; else nothing at all. Returns
    whether tracing is on. Once per process; a later call changes nothing."""
    global _tracer, active
    if _tracer is not None:
        return True
    if not tracing_configured():
        return False
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get(
        "OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf"
    )
    if protocol.strip() != "http/protobuf":
        raise ImproperlyConfigured(f"OTEL_EXPORTER_OTLP_PROTOCOL: only http/protobuf is installed, got {protocol!r}")
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by Resource.create; attributes given
    # here would override them, so the default name is given only when neither names the service.
    named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get("OTEL_RESOURCE_ATTRIBUTES", "")
    provider = TracerProvider(resource=Resource.create({} if named else {SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
    _tracer = trace.get_tracer("telemachus")
    active = True
    return True


def tracing_enabled() -> bool:
    """Whether this process records spans: for a caller that would build costly attributes."""
    return _tracer is not None


def span(
    name: str,
    *,
    parent: "Context | None" = None,
    server: bool = False,
    client: bool = False,
    attributes: Mapping[str, Any] | None = None,
    link: Mapping[str, str] | None = None,
) -> "AbstractContextManager[Span | _NoSpan]":
    """A span around a block, as the current span inside it (`with span("job.claim") as s:
    s.set_attribute(...)`), a child of `parent` (a context from `context_from_headers` or
    `context_from_carrier`) or else of the current span; `server`: it serves a request from
    outside (kind SERVER); `client`: it calls a service outside (kind CLIENT: a model server);
    else INTERNAL; `link`: a stored context (a batch's) the span links to. Ends when the block
    does, recording an exception that leaves it. While tracing is off: NO_SPAN, and nothing else
    happens."""
    if _tracer is None:
        return NO_SPAN
    return _tracer.start_as_current_span(
        name, context=parent, kind=_kind(server, client), attributes=attributes, links=_links(link)
    )


def span_started(name: str, *, link: Mapping[str, str], attributes: Mapping[str, Any]) -> "Span | _NoSpan":
    """A span begun now, the root of a trace of its own, linked to the span whose context `link`
    carries; the caller ends it (`.end()`) and keeps its context with a job (`span_carrier`).
    For each of many pieces of work done for one span, too many to hang in its trace (the lines
    of a batch, up to 50,000): a trace each, linked back, as OpenTelemetry's messaging
    conventions link a batch and its messages. A span never ended is never exported (lines
    another feeder fed first). NO_SPAN while off."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry.context import Context

    return _tracer.start_span(name, context=Context(), links=_links(link), attributes=attributes)


def span_carrier(recorded: "Span | _NoSpan") -> dict[str, str]:
    """`recorded`'s context as `trace_carrier` gives it, for a job to keep; empty while off."""
    if _tracer is None or not recorded.is_recording():
        return {}
    from opentelemetry import trace

    return trace_carrier(trace.set_span_in_context(recorded))  # type: ignore[arg-type]


def _links(carrier: Mapping[str, str] | None) -> "list[Link] | None":
    if not carrier:
        return None
    from opentelemetry import trace

    linked = trace.get_current_span(context_from_carrier(carrier)).get_span_context()
    return [trace.Link(linked)] if linked.is_valid else None


def span_between(
    name: str,
    *,
    parent: "Context | None",
    start_ns: int,
    end_ns: int,
    attributes: Mapping[str, Any] | None = None,
) -> None:
    """A span between two moments no code runs across (a job's wait in the queue: from when it
    was queued to its claim), in nanoseconds since the epoch, a child of `parent`. An end before
    the start (two hosts' clocks) is recorded as a span of no length. Nothing while off."""
    if _tracer is None:
        return
    recorded = _tracer.start_span(name, context=parent, start_time=start_ns, attributes=attributes)
    recorded.end(end_time=max(start_ns, end_ns))


def _kind(server: bool, client: bool) -> "SpanKind":
    from opentelemetry.trace import SpanKind

    return SpanKind.SERVER if server else SpanKind.CLIENT if client else SpanKind.INTERNAL


def span_failed(recorded: "Span | _NoSpan", description: str) -> None:
    """Mark a span as failed (status ERROR) for a failure that raised nothing through it (a model
    call that answered an error, a job that ended failed)."""
    if _tracer is None or not recorded.is_recording():
        return
    from opentelemetry.trace import Status, StatusCode

    recorded.set_status(Status(StatusCode.ERROR, description))  # type: ignore[union-attr]


def content_traced() -> bool:
    """Whether spans may carry prompts and answers (TELEMACHUS_TRACE_CONTENT=1): never by default,
    since a tracing backend is seldom cleared to hold what users typed."""
    from django.conf import settings

    return _tracer is not None and bool(settings.TELEMACHUS_TRACE_CONTENT)


def context_from_headers(headers: Mapping[str, str]) -> "Context | None":
    """The caller's trace context from a request's headers (W3C `traceparent` and `tracestate`,
    or what OTEL_PROPAGATORS names), for a span that continues it; None while tracing is off.
    `headers` must answer `get` by lower-case name, as Django's `request.headers` does."""
    if _tracer is None:
        return None
    from opentelemetry import propagate

    return propagate.extract(headers)


def context_from_carrier(carrier: Mapping[str, str] | None) -> "Context | None":
    """The trace context a job kept (`job.meta["trace"]`), for the spans of its work in another
    process; None while tracing is off or when the job kept none."""
    if _tracer is None or not carrier:
        return None
    from opentelemetry import propagate

    return propagate.extract(dict(carrier))


def trace_carrier(context: "Context | None" = None) -> dict[str, str]:
    """The current span's trace context (or `context`'s) as a dict to store with a job
    (`traceparent`, and `tracestate` when there is one); empty while tracing is off or outside
    any span."""
    if _tracer is None:
        return {}
    from opentelemetry import propagate

    carrier: dict[str, str] = {}
    propagate.inject(carrier, context=context)
    return carrier


@contextmanager
def within(context: "Context") -> Iterator[None]:
    """Make `context` the current one for a block, in a thread that did not inherit it (a
    database thread, for code the event loop's span should be the parent of)."""
    from opentelemetry import context as contexts

    token = contexts.attach(context)
    try:
        yield
    finally:
        contexts.detach(token)


def current_context() -> "Context | None":
    """The current trace context, to hand to code that runs in another thread (a database
    thread does not inherit the event loop's context); None while tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import context

    return context.get_current()


def current_span() -> "Span | _NoSpan":
    """The span the code runs in (NO_SPAN while tracing is off), to add attributes to it."""
    if _tracer is None:
        return NO_SPAN
    from opentelemetry import trace

    return trace.get_current_span()
