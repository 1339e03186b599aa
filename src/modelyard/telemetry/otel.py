"""The OpenTelemetry SDK behind `api.Tracer`: the only module that imports opentelemetry, and only
once a role's config turns tracing on (`build_tracer` imports it then).

Each role gets its own TracerProvider (never the global one), so that two gateways, or a gateway
and a scheduler, can trace in one process, each with its service.name, and a test can read its
spans. Spans go out in batches over OTLP/HTTP (protobuf) from the SDK's exporter thread; the
request path only creates and ends spans.
"""

from __future__ import annotations

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
from modelyard.telemetry.api import (
    TRACEPARENT,
    TRACESTATE,
    Attributes,
    Kind,
    Value,
    trace_context,
    without_trace_context,
)

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
        self._span.set_attribute(key, value)

    def fail(self, description: str, error_type: str = "") -> None:
        if error_type:
            self._span.set_attribute("error.type", error_type)
        self._span.set_status(Status(StatusCode.ERROR, description))

    def child(self, name: str, kind: Kind = "internal", attributes: Attributes | None = None) -> OtelSpan:
        context = trace.set_span_in_context(self._span)
        span = self._tracer.start_span(name, context=context, kind=_KINDS[kind], attributes=attributes)
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
    ) -> OtelSpan:
        carrier = trace_context(headers)
        context = _PROPAGATOR.extract(carrier) if carrier else None
        span = self._tracer.start_span(name, context=context, kind=_KINDS[kind], attributes=attributes)
        return OtelSpan(span, self._tracer)

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def shutdown(self) -> None:
        self._provider.shutdown()
