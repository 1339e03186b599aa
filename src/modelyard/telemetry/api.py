"""What the rest of modelyard sees of tracing: two small protocols, no OpenTelemetry types.

A role that has tracing off holds `None` where it would hold a `Tracer`, and every place that
traces asks `if tracer is not None` (or `if span is not None`): an off gateway creates no span, no
context and no header copy, and never imports opentelemetry.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, Protocol

from modelyard.errors import ModelyardError

TRACEPARENT = "traceparent"  # W3C Trace Context: the headers a span's context travels in
TRACESTATE = "tracestate"

Kind = Literal["server", "client", "internal"]
Value = str | bool | int | float
Attributes = Mapping[str, Value]


class Span(Protocol):
    """One timed operation. `end` once; attributes and status may be set until then."""

    @property
    def trace_id(self) -> str:
        """The trace's id, 32 hex digits (the access log's trace_id)."""
        ...

    def set(self, key: str, value: Value) -> None: ...

    def fail(self, description: str, error_type: str = "") -> None:
        """Mark the span as failed (OTel status ERROR), with `error.type` when given."""
        ...

    def answered(self, status: int, error: ModelyardError | None = None) -> None:
        """Record an HTTP status (`http.response.status_code`); `error`, or a 5xx, fails the span."""
        ...

    def child(self, name: str, kind: Kind = "internal", attributes: Attributes | None = None) -> Span: ...

    def traceparent(self) -> str:
        """This span's context as a W3C traceparent value."""
        ...

    def inject(self, headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
        """A copy of `headers` whose traceparent (and tracestate) are this span's: the headers of
        a call this span makes. A client's own traceparent is replaced, not kept beside it."""
        ...

    def end(self) -> None: ...


class Tracer(Protocol):
    def start(
        self,
        name: str,
        headers: Iterable[tuple[str, str]] = (),
        kind: Kind = "server",
        attributes: Attributes | None = None,
        started: float | None = None,
    ) -> Span:
        """A span whose parent is the traceparent in `headers` (a client's, or a caller's
        in-process), or the root of a new trace when there is none or it is malformed. `started`:
        when the operation began (time.perf_counter()), if before now."""
        ...

    def force_flush(self, timeout_seconds: float = 10.0) -> bool:
        """Export every ended span now (blocking; for tests and shutdown)."""
        ...

    def shutdown(self) -> None:
        """Flush and stop exporting (blocking: run it off the event loop)."""
        ...


def safe_text(text: str) -> str:
    """`text` as valid UTF-8: a lone surrogate (how the lean listener decodes a header's bytes
    0x80-0xFF) becomes its backslash escape, which JSON, OTLP's protobuf and a log line can carry."""
    if text.isascii():
        return text
    try:
        text.encode()
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode()
    return text


def without_trace_context(headers: Iterable[tuple[str, str]]) -> list[tuple[str, str]]:
    """`headers` less traceparent and tracestate, whatever their case."""
    return [(k, v) for k, v in headers if k.lower() not in (TRACEPARENT, TRACESTATE)]


def trace_context(headers: Iterable[tuple[str, str]]) -> dict[str, str]:
    """The traceparent and tracestate among `headers`, keyed in lower case (first one wins)."""
    found: dict[str, str] = {}
    for key, value in headers:
        name = key.lower()
        if name in (TRACEPARENT, TRACESTATE) and name not in found:
            found[name] = value
    return found


__all__: Sequence[str] = [
    "TRACEPARENT",
    "TRACESTATE",
    "Attributes",
    "Kind",
    "Span",
    "Tracer",
    "safe_text",
    "trace_context",
    "without_trace_context",
]
