"""Tracing (OpenTelemetry): the only importer of opentelemetry, and only when a role turns it on.

`build_tracer(config.telemetry, "modelyard-gateway")` is None with tracing off; the request path
checks for None and does nothing else (api.py). With an OTLP endpoint it is a Tracer whose spans
join the caller's trace (W3C traceparent) and go to the collector over OTLP/HTTP.
"""

from __future__ import annotations

from typing import Any

from modelyard.config import TelemetryConfig
from modelyard.telemetry.api import (
    TRACEPARENT,
    TRACESTATE,
    Attributes,
    Kind,
    Span,
    Tracer,
    safe_text,
    trace_context,
    without_trace_context,
)
from modelyard.telemetry.graph import GraphSpans, end_graph_span, start_graph_span


def build_tracer(config: TelemetryConfig, service_name: str, *, exporter: Any = None) -> Tracer | None:
    """The role's tracer, or None when `config` gives no OTLP endpoint (and no `exporter`, which
    tests pass to read spans in-process). `service_name` is the role's, unless the config names one."""
    if config.otlp_endpoint is None and exporter is None:
        return None
    from modelyard.telemetry.otel import OtelTracer  # the SDK's import cost, only when tracing

    return OtelTracer(config, service_name, exporter)


__all__ = [
    "TRACEPARENT",
    "TRACESTATE",
    "Attributes",
    "GraphSpans",
    "Kind",
    "Span",
    "Tracer",
    "build_tracer",
    "end_graph_span",
    "safe_text",
    "start_graph_span",
    "trace_context",
    "without_trace_context",
]
