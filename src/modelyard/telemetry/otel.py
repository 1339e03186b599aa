"""The OpenTelemetry SDK behind `api.Tracer`: the only module that imports opentelemetry, and only
once a role's config turns tracing on (`build_tracer` imports it then).

Each role gets its own TracerProvider (never the global one), so that two gateways, or a gateway
and a scheduler, can trace in one process, each with its service.name, and a test can read its
spans. Spans go out in batches over OTLP/HTTP (protobuf) from the SDK's exporter thread; the
request path only creates and ends spans.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from modelyard import __version__
from modelyard.config import TelemetryConfig
from modelyard.errors import ModelyardError
from modelyard.telemetry.api import (
    TRACEPARENT,
    TRACESTATE,
    Attributes,
    Kind,
    Value,
    safe_text,
    trace_context,
    without_trace_context,
)

# W3C Trace Context's tracestate list member (the SDK's grammar): a client's tracestate that is not a
# list of these, at most 32 and 512 characters, is dropped before the SDK sees it, which would log
# a warning echoing the client's text on every such request.
_TRACESTATE_MEMBER = re.compile(
    r"(?:[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_TRACESTATE_MAX_LENGTH = 512
_TRACESTATE_MAX_MEMBERS = 32
_TRACEPARENT_MAX_LENGTH = 512  # the SDK's: longer is dropped, with a warning per request
_KINDS = {"server": SpanKind.SERVER, "client": SpanKind.CLIENT, "internal": SpanKind.INTERNAL}
_PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent/tracestate, nothing else (no baggage)


class OtelSpan:
    __slots__ = ("_span", "_tracer")

    def __init__(self, span: trace.Span, tracer: trace.Tracer) -> None:
        self._span = span
        self._tracer = tracer

    @property
    def trace_id(self) -> str:
        return f"{self._span.get_span_context().trace_id:032x}"

    def set(self, key: str, value: Value) -> None:
        self._span.set_attribute(key, safe_text(value) if isinstance(value, str) else value)

    def fail(self, description: str, error_type: str = "") -> None:
        if error_type:
            self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, description))

    def answered(self, status: int, error: ModelyardError | None = None) -> None:
        self._span.set_attribute("http.response.status_code", status)
        if error is not None:
            self.fail(error.message, type(error).__name__)
        elif status >= 500:
            self.fail(f"answered {status}", str(status))

    def child(self, name: str, kind: Kind = "internal", attributes: Attributes | None = None) -> OtelSpan:
        context = trace.set_span_in_context(self._span)
        span = self._tracer.start_span(
            safe_text(name), context=context, kind=_KINDS[kind], attributes=_safe(attributes)
        )
        return OtelSpan(span, self._tracer)

    def traceparent(self) -> str:
        context = self._span.get_span_context()
        return f"00-{context.trace_id:032x}-{context.span_id:016x}-{int(context.trace_flags):02x}"

    def inject(self, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        sent = without_trace_context(headers)
        sent.append((TRACEPARENT, self.traceparent()))
        state = self._span.get_span_context().trace_state
        if state:
            sent.append((TRACESTATE, state.to_header()))
        return sent

    def end(self) -> None:
        self._span.end()


class OtelTracer:
    def __init__(self, config: TelemetryConfig, service_name: str, exporter: Any = None) -> None:
        """`exporter`: a SpanExporter to use instead of OTLP (tests: the SDK's InMemorySpanExporter),
        given each span as it ends."""
        resource = Resource.create(
            {"service.name": config.service_name or service_name, "service.version": __version__}
        )
        sampler = ParentBased(TraceIdRatioBased(config.sample_ratio))  # a client's sampled flag decides
        self._provider = TracerProvider(resource=resource, sampler=sampler)
        if exporter is not None:
            self._provider.add_span_processor(SimpleSpanProcessor(exporter))
        else:
            otlp: SpanExporter = OTLPSpanExporter(
                endpoint=config.traces_url, headers=dict(config.headers), timeout=config.timeout
            )
            self._provider.add_span_processor(BatchSpanProcessor(otlp))
        self._tracer = self._provider.get_tracer("modelyard", __version__)

    def start(
        self,
        name: str,
        headers: Iterable[tuple[str, str]] = (),
        kind: Kind = "server",
        attributes: Attributes | None = None,
        started: float | None = None,
    ) -> OtelSpan:
        carrier = _valid_context(trace_context(headers))
        context = _PROPAGATOR.extract(carrier) if carrier else None
        start_time = None
        if started is not None:  # the SDK's clock is the epoch's, in ns
            start_time = time.time_ns() - int((time.perf_counter() - started) * 1e9)
        span = self._tracer.start_span(
            safe_text(name),
            context=context,
            kind=_KINDS[kind],
            attributes=_safe(attributes),
            start_time=start_time,
        )
        return OtelSpan(span, self._tracer)

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()


def _safe(attributes: Attributes | None) -> Attributes | None:
    """`attributes` with their strings valid UTF-8 (OTLP's protobuf refuses the others, and with
    them the whole batch, logging an error each time)."""
    if not attributes:
        return attributes
    return {k: safe_text(v) if isinstance(v, str) else v for k, v in attributes.items()}


def _valid_context(carrier: dict[str, str]) -> dict[str, str]:
    """A client's trace context less what the SDK would log a warning about (and ignore anyway): a
    traceparent over its length, a tracestate that is not a valid list."""
    parent = carrier.get(TRACEPARENT)
    if parent is None or len(parent) > _TRACEPARENT_MAX_LENGTH:
        return {}
    state = carrier.get(TRACESTATE)
    if state is not None and not _valid_tracestate(state):
        return {TRACEPARENT: parent}
    return carrier


def _valid_tracestate(value: str) -> bool:
    if len(value) > _TRACESTATE_MAX_LENGTH:
        return False
    keys: set[str] = set()
    for member in value.split(","):
        member = member.strip(" \t")
        if not member:
            continue
        if _TRACESTATE_MEMBER.fullmatch(member) is None:
            return False
        key = member.partition("=")[0]
        if key in keys:
            return False
        keys.add(key)
    return len(keys) <= _TRACESTATE_MAX_MEMBERS
