"""Inference graphs inside the gateway.

A step's `serviceName` names a modelyard model and is resolved on every request through that
model's routing (strategy, health, fail-over), so graph steps are load-balanced; KServe resolves
names once, at deploy time. Not the model's `fallbacks` (gateway/fallback.py): a step calls the
model it names, and the graph says what a failed step does. `serviceUrl` steps are called
directly. Graphs are replaced atomically at runtime: a request keeps the Graph object it started
with.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import orjson
from aiohttp import web

from modelyard.errors import GraphInvalid, ModelNotPlaced, ModelyardError, NotFound
from modelyard.gateway.access_log import AccessLog
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.ledger import CLIENT_CLOSED
from modelyard.gateway.proxy import REQUEST_ID_HEADER, Proxy
from modelyard.graph import (
    Graph,
    GraphDocument,
    GraphFailure,
    InferenceStep,
    Outcome,
    RunContext,
    StepTrace,
    answer,
    parse_graph,
)
from modelyard.graph.headers import compile_patterns, propagated
from modelyard.graph.loader import graphs_in_documents
from modelyard.serving import answer_response
from modelyard.telemetry import GraphSpans, Span, Tracer, end_graph_span, start_graph_span
from modelyard.upstream.graph_invoker import UrlInvoker

TRACE_REQUEST_HEADER = "X-Modelyard-Trace"
TRACE_RESPONSE_HEADER = "X-Modelyard-Graph-Trace"
_REQUEST_ID = REQUEST_ID_HEADER.lower()


class GatewayInvoker:
    def __init__(
        self,
        clusters: dict[str, Cluster],
        proxy: Proxy,
        urls: UrlInvoker,
        not_placed: Callable[[str], ModelNotPlaced | None] = lambda name: None,
    ) -> None:
        self._clusters = clusters  # the gateway's own dict: models the scheduler places appear in it
        self._proxy = proxy
        self._urls = urls
        self._not_placed = not_placed

    async def call(self, step: InferenceStep, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome:
        if step.service_url:
            return await self._urls.post(step.service_url, body, headers)
        cluster = self._clusters.get(step.service_name)
        if cluster is None:
            not_placed = self._not_placed(step.service_name)
            if not_placed is not None:
                raise GraphFailure(500, f"serviceName {step.service_name!r}: {not_placed.message}")
            known = ", ".join(sorted(self._clusters)) or "(none)"
            raise GraphFailure(
                500, f"serviceName {step.service_name!r} is not a model of this gateway; known: {known}"
            )
        name = cluster.name
        path = f"/v1/models/{name}:predict" if cluster.config.protocol == "v1" else f"/v2/models/{name}/infer"
        sent = list(headers)
        if not any(n.lower() == "content-type" for n, _ in sent):
            sent.append(("Content-Type", "application/json"))
        try:
            answer = await self._proxy.call(cluster, "POST", path, sent, body, span_kind="internal")
        except ModelyardError as exc:
            raise GraphFailure(500, f"model {name!r}: {exc.message}") from None
        return Outcome(answer.status, answer.body)


class GraphService:
    """The gateway's graphs: run, list, replace, delete."""

    def __init__(
        self,
        graphs: dict[str, Graph],
        invoker: GatewayInvoker,
        propagate: Iterable[str],
        observe: Callable[[str, str, str, int, float], None],
        tracer: Tracer | None = None,
        access: AccessLog | None = None,
        new_request_id: Callable[[], str] = lambda: "",
    ) -> None:
        self._tracer = tracer
        self._access = access  # None: logging.access_log is off
        self._new_request_id = new_request_id
        self._graphs = dict(graphs)
        self._invoker = invoker
        self._patterns: list[re.Pattern[str]] = compile_patterns(",".join(propagate))
        self._observe = observe
        self._rng = random.SystemRandom()

    @property
    def graphs(self) -> dict[str, Graph]:
        return self._graphs

    def get(self, name: str) -> Graph:
        graph = self._graphs.get(name)
        if graph is None:
            known = ", ".join(sorted(self._graphs)) or "(none)"
            raise NotFound(f"graph {name!r} not found; known graphs: {known}")
        return graph

    def put(self, name: str, documents: list[Any]) -> tuple[Graph, list[str]]:
        """Validate a parsed body, a spec or a whole KServe manifest, and swap it in atomically:
        requests already running keep the graph they started with. Returns the warnings."""
        source = f"PUT /admin/graphs/{name}"
        if len(documents) != 1:
            raise GraphInvalid(
                source, [f"expected one document (a spec or a manifest), got {len(documents)}"]
            )
        data = documents[0]
        if isinstance(data, dict) and ("kind" in data or "apiVersion" in data):
            (document,) = graphs_in_documents(documents, source)
            if document.name != name:
                raise GraphInvalid(
                    source, [f"metadata.name: the manifest names {document.name!r}; the path names {name!r}"]
                )
            data = document.spec
        graph, report = parse_graph(GraphDocument(name, data, source))
        self._graphs = {**self._graphs, name: graph}
        return graph, [str(w) for w in report.warnings]

    def delete(self, name: str) -> None:
        self.get(name)
        self._graphs = {k: v for k, v in self._graphs.items() if k != name}

    async def run(
        self, name: str, body: bytes, headers: list[tuple[str, str]], want_trace: bool
    ) -> web.Response:
        graph = self.get(name)
        trace: list[StepTrace] | None = [] if want_trace else None

        def observe(node: str, step: str, status: int, seconds: float) -> None:
            self._observe(graph.name, node, step, status, seconds)

        # The graph's request id goes to every step, so that a step's model call is logged with it.
        request_id = next((v for k, v in headers if k.lower() == _REQUEST_ID), "") or self._new_request_id()
        sent = [(k, v) for k, v in propagated(headers, self._patterns) if k.lower() != _REQUEST_ID]
        if request_id:
            sent.append((REQUEST_ID_HEADER, request_id))
        ctx = RunContext(self._invoker, sent, self._rng, trace, observe)
        span = None
        if self._tracer is not None:  # the graph's span; each step's is its child (GraphSpans)
            span = start_graph_span(self._tracer, name, headers, f"/v1/graphs/{name}")
            ctx.spans = GraphSpans(span)
        result: Outcome | GraphFailure
        started = time.perf_counter()
        try:
            result = await graph.run(body, ctx)
        except GraphFailure as failure:
            result = failure
        except BaseException as exc:  # cancelled (the client left), or a bug (answered 500)
            self._ended(
                name, request_id, 500 if isinstance(exc, Exception) else CLIENT_CLOSED, started, 0, span
            )
            raise
        response = answer_response(answer(result))
        if request_id:
            response.headers[REQUEST_ID_HEADER] = request_id
        size = len(response.body) if isinstance(response.body, bytes) else 0
        self._ended(name, request_id, result.status, started, size, span)
        if trace is not None:
            steps = [
                {"node": t.node, "step": t.step, "target": t.target, "status": t.status, "ms": t.ms}
                for t in trace
            ]
            total_ms = round((time.perf_counter() - started) * 1000, 3)
            response.headers[TRACE_RESPONSE_HEADER] = orjson.dumps(
                {"graph": name, "ms": total_ms, "steps": steps}
            ).decode()
        return response

    def _ended(
        self, name: str, request_id: str, status: int, started: float, size: int, span: Span | None
    ) -> None:
        """The graph request's outcome, for its span and its access line (its steps' model calls
        have lines of their own)."""
        if span is not None:
            end_graph_span(span, status)
        if self._access is not None:
            duration_ms = (time.perf_counter() - started) * 1000
            trace_id = span.trace_id if span is not None else None
            self._access.write_fields(
                time.time(), request_id, "POST", f"/v1/graphs/{name}", name, "", "", "graph", "", 0, status,
                duration_ms, size, trace_id,
            )  # fmt: skip
