"""Inference graphs inside the gateway.

A step's `serviceName` names a modelyard model and is resolved on every request through that
model's routing (strategy, health, fail-over), so graph steps are load-balanced; KServe resolves
names once, at deploy time. `serviceUrl` steps are called directly. Graphs are replaced
atomically at runtime: a request keeps the Graph object it started with.
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Iterable, Sequence

import orjson
import yaml
from aiohttp import web

from modelyard.config import GatewayConfig
from modelyard.errors import ConfigError, GraphInvalid, ModelyardError, NotFound
from modelyard.gateway.models import ServedModel
from modelyard.gateway.proxy import Proxy
from modelyard.graph import (
    Graph,
    GraphDocument,
    GraphFailure,
    InferenceStep,
    Outcome,
    RunContext,
    StepTrace,
    answer,
    load_graph_paths,
    load_graph_text,
    parse_graph,
)
from modelyard.graph.headers import compile_patterns, propagated
from modelyard.serving import answer_response
from modelyard.upstream.graph_invoker import UrlInvoker

TRACE_REQUEST_HEADER = "X-Modelyard-Trace"
TRACE_RESPONSE_HEADER = "X-Modelyard-Graph-Trace"


def load_config_graphs(config: GatewayConfig, source: str) -> dict[str, Graph]:
    """The graphs of a gateway config (`graphs:` and `graph_files:`), each validated; every
    problem is reported in one ConfigError naming its path."""
    documents = [
        GraphDocument(name, spec, f"{source}: graphs.{name}") for name, spec in config.graphs.items()
    ]
    problems: list[str] = []
    try:
        documents += load_graph_paths(config.graph_files)
    except GraphInvalid as error:
        problems += [f"graph_files: {error.source}: {p}" for p in error.problems]
    graphs: dict[str, Graph] = {}
    for document in documents:
        try:
            graph, _report = parse_graph(document)
        except GraphInvalid as error:
            problems += [f"graphs.{document.name}.{p}" for p in error.problems]
            continue
        if graph.name in graphs:
            problems.append(f"graphs.{graph.name}: defined twice ({document.source})")
        graphs[graph.name] = graph
    if problems:
        raise ConfigError(source, problems)
    return graphs


class GatewayInvoker:
    def __init__(self, models: dict[str, ServedModel], proxy: Proxy, urls: UrlInvoker) -> None:
        self._models = models
        self._proxy = proxy
        self._urls = urls

    async def call(self, step: InferenceStep, body: bytes, headers: Sequence[tuple[str, str]]) -> Outcome:
        if step.service_url:
            return await self._urls.post(step.service_url, body, headers)
        model = self._models.get(step.service_name)
        if model is None:
            known = ", ".join(sorted(self._models)) or "(none)"
            raise GraphFailure(
                500, f"serviceName {step.service_name!r} is not a model of this gateway; known: {known}"
            )
        name = model.name
        path = f"/v1/models/{name}:predict" if model.config.protocol == "v1" else f"/v2/models/{name}/infer"
        sent = list(headers)
        if not any(n.lower() == "content-type" for n, _ in sent):
            sent.append(("Content-Type", "application/json"))
        try:
            status, data = await self._proxy.call(model, "POST", path, sent, body)
        except ModelyardError as exc:
            raise GraphFailure(500, f"model {name!r}: {exc.message}") from None
        return Outcome(status, data)


class GraphService:
    """The gateway's graphs: run, list, replace, delete."""

    def __init__(
        self,
        graphs: dict[str, Graph],
        invoker: GatewayInvoker,
        propagate: Iterable[str],
        observe: Callable[[str, str, str, int, float], None],
    ) -> None:
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

    def put(self, name: str, body: bytes) -> tuple[Graph, list[str]]:
        """Validate a spec (YAML or JSON), or a whole KServe manifest, and swap it in atomically:
        requests already running keep the graph they started with. Returns the warnings."""
        source = f"PUT /admin/graphs/{name}"
        text = body.decode("utf-8", "replace")
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise GraphInvalid(
                source, [f"invalid YAML or JSON: {getattr(exc, 'problem', None) or exc}"]
            ) from None
        if isinstance(data, dict) and ("kind" in data or "apiVersion" in data):
            (document,) = load_graph_text(text, source)
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

        ctx = RunContext(self._invoker, propagated(headers, self._patterns), self._rng, trace, observe)
        result: Outcome | GraphFailure
        started = time.perf_counter()
        try:
            result = await graph.run(body, ctx)
        except GraphFailure as failure:
            result = failure
        response = answer_response(answer(result))
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
