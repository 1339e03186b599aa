"""A span per graph step, for the graph engine (graph/engine.py's `StepSpans`): the engine does no
I/O and knows nothing of tracing; it asks this for a step's span and sends the step's service call
with the span's headers, so that the service (or the gateway's model call) joins the trace."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from modelyard.telemetry.api import Span, Tracer


class StepSpan:
    __slots__ = ("_span", "headers")

    def __init__(self, span: Span, headers: Sequence[tuple[str, str]]) -> None:
        self._span = span
        self.headers = span.inject(headers)  # what the step's service call sends

    def nested(self) -> GraphSpans:
        """The spans of a step that runs another node: its steps are children of this one."""
        return GraphSpans(self._span)

    def end(self, status: int) -> None:
        self._span.answered(status)
        self._span.end()


class GraphSpans:
    """Step spans as children of `parent` (the graph request's span, or a nesting step's)."""

    __slots__ = ("_parent",)

    def __init__(self, parent: Span) -> None:
        self._parent = parent

    def start(
        self, node: str, step: str, router_type: str, target: str, headers: Sequence[tuple[str, str]]
    ) -> StepSpan:
        attributes = {
            "modelyard.graph.node": node,
            "modelyard.graph.step": step,
            "modelyard.graph.router_type": router_type,
            "modelyard.graph.target": target,
        }
        span = self._parent.child(f"step {node}/{step}", "internal", attributes)
        return StepSpan(span, headers)


def start_graph_span(tracer: Tracer, graph: str, headers: Iterable[tuple[str, str]], path: str) -> Span:
    """The span of one graph request (the gateway's /v1/graphs/NAME, or `modelyard graph serve`),
    a child of the client's traceparent; its steps' spans come from `GraphSpans(span)`."""
    attributes = {"http.request.method": "POST", "url.path": path, "modelyard.graph": graph}
    return tracer.start(f"graph {graph}", headers, "server", attributes)


def end_graph_span(span: Span, status: int | None) -> None:
    """End it with the graph's answer; None: no answer to record."""
    if status is not None:
        span.answered(status)
    span.end()
