"""The document's paths: every route, what it takes and every status it answers.

Each operation is described here under its operationId, the key that route_table.ROUTES gives the
route: the paths and methods are the table's, written there once."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

from aiohttp import web

from modelyard.gateway.openapi.parts import (
    ALLOW,
    FORWARDED,
    GRAPH_FAILURE,
    HTML,
    INFERENCE,
    JSON,
    METHODS,
    OPENAI,
    RELAYED,
    RETRY_AFTER,
    SSE,
    STEP,
    UNSAFE_SEGMENT,
    YAML,
    Schema,
    answer,
    error_response,
    json_body,
    param,
    ref,
    relay_headers,
    string_header,
    unauthorized,
)
from modelyard.protocols import protocol_for_path
from modelyard.types import Protocol

if TYPE_CHECKING:
    from modelyard.gateway.route_table import Route


class Description(NamedTuple):
    operation: Schema
    path_parameters: Sequence[Schema] = ()  # declared on its path, for every operation there


def documented_path(pattern: str) -> str:
    """A route's path as OpenAPI writes it: aiohttp's pattern without its regular expressions."""
    return web.DynamicResource(pattern).canonical if "{" in pattern else pattern


# The operations that need an API key when auth.enabled (gateway/admission.py).
KEYED = frozenset(
    {
        "chatCompletions", "completions", "embeddings", "listModels", "kservePredict", "kserveModel",
        "oipModelMetadata", "oipModelReady", "oipModelInfer", "oipModelVersionMetadata",
        "oipModelVersionReady", "oipModelVersionInfer", "runGraph",
    }
)  # fmt: skip
API_KEY_CHALLENGE = {"WWW-Authenticate": string_header('`Bearer realm="modelyard"`', required=True)}


class Paths:
    def __init__(
        self, models: Sequence[str], admin_token: bool, graph_views_protected: bool, api_keys: bool = False
    ) -> None:
        self._model = models[0] if models else "my-model"
        self._admin_token = admin_token
        self._graph_views_protected = admin_token and graph_views_protected
        self._api_keys = api_keys

    def descriptions(self) -> dict[str, Description]:
        """Every operation's description, by its operationId."""
        described: dict[str, Description] = {}
        for description in (
            *self._openai(),
            *self._kserve(),
            *self._oip(),
            *self._graphs(),
            *self._admin(),
            *self._operations(),
        ):
            key = description.operation["operationId"]
            if key in described:
                raise ValueError(f"operationId {key!r} is described twice")
            described[key] = description
        return described

    def build(self, routes: Iterable[Route]) -> dict[str, Any]:
        """The document's paths: each route's, in the routes' order, with its description."""
        descriptions = self.descriptions()
        paths: dict[str, Any] = {}
        for route in routes:
            path = documented_path(route.path)
            description = descriptions.get(route.operation)
            if description is None:
                raise ValueError(
                    f"{route.method} {path}: no description {route.operation!r} in openapi/paths.py"
                )
            parameters = list(description.path_parameters)
            item = paths.get(path)
            if item is None:
                item = paths[path] = {"parameters": parameters} if parameters else {}
            elif item.get("parameters", []) != parameters:
                raise ValueError(f"{path}: its operations' descriptions declare different path parameters")
            item[route.method.lower()] = description.operation
        for path, operations in paths.items():
            envelope = INFERENCE if protocol_for_path(path) in (Protocol.OIP, Protocol.KSERVE_V1) else OPENAI
            for method, operation in operations.items():
                if method not in METHODS:
                    continue  # path-level parameters
                responses = operation["responses"]
                if path.startswith(FORWARDED) and "{" in path and "400" not in responses:
                    responses["400"] = error_response(envelope, UNSAFE_SEGMENT)
                if self._graph_views_protected and method == "get" and path.startswith("/v1/graphs"):
                    operation["security"] = [{"adminToken": []}]
                    responses["401"] = unauthorized()
                if self._api_keys and operation["operationId"] in KEYED:
                    operation["security"] = [{"apiKey": []}, {"azureApiKey": []}]
                    responses["401"] = error_response(
                        envelope, "no API key, or one the keys file does not hold", headers=API_KEY_CHALLENGE
                    )
                    if operation["operationId"] != "listModels":
                        responses["403"] = error_response(envelope, "the key's tenant may not use this model")
                operation["responses"] = dict(sorted(responses.items()))
        return paths

    # OpenAI -------------------------------------------------------------------------------------

    def _openai(self) -> list[Description]:
        model = self._model
        chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}]}
        return [
            Description(
                self._proxied_op(
                    "chatCompletions",
                    "OpenAI",
                    "Chat completion, routed by the body's `model`",
                    json_body(ref("ChatCompletionRequest"), chat),
                    ref("ChatCompletion"),
                    OPENAI,
                    stream=True,
                    bad_body="not JSON, not an object, `model` not a string, or `messages` not a list",
                )
            ),
            Description(
                self._proxied_op(
                    "completions",
                    "OpenAI",
                    "Text completion, routed by the body's `model`",
                    json_body(ref("CompletionRequest"), {"model": model, "prompt": "Once upon a time"}),
                    ref("Completion"),
                    OPENAI,
                    stream=True,
                    bad_body="not JSON, not an object, or `model` not a string",
                )
            ),
            Description(
                self._proxied_op(
                    "embeddings",
                    "OpenAI",
                    "Embeddings, routed by the body's `model`",
                    json_body(ref("EmbeddingRequest"), {"model": model, "input": "Hello!"}),
                    ref("Embeddings"),
                    OPENAI,
                    bad_body="not JSON, not an object, or `model` not a string",
                )
            ),
            Description(
                {
                    "operationId": "listModels",
                    "tags": ["OpenAI"],
                    "summary": "The gateway's models, in OpenAI's list shape",
                    "responses": {"200": answer("the models", ref("ModelList"))},
                }
            ),
        ]

    # KServe v1 ----------------------------------------------------------------------------------

    def _kserve(self) -> list[Description]:
        return [
            Description(
                self._proxied_op(
                    "kservePredict",
                    "KServe v1",
                    "KServe v1 prediction, routed by the path's model",
                    json_body(ref("PredictRequest"), {"instances": [[1, 2, 3]]}),
                    ref("PredictResponse"),
                    INFERENCE,
                    bad_body="not JSON or not an object",
                ),
                [param("ModelName")],
            ),
            Description(
                self._proxied_op(
                    "kserveModel",
                    "KServe v1",
                    "KServe v1 model status, from a serving endpoint",
                    None,
                    ref("KServeModel"),
                    INFERENCE,
                    not_allowed=True,
                ),
                [param("ModelName")],
            ),
        ]

    # Open Inference Protocol v2 -----------------------------------------------------------------

    def _oip(self) -> list[Description]:
        infer_example = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}
        binary_header = {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "description": "binary tensor extension: the length of the JSON header before the raw tensors",
            "schema": {"type": "integer", "minimum": 0},
        }
        described = [
            Description(self._own("oipServer", "OIP v2", "Server metadata", ref("ServerMetadata"))),
            Description(self._own("oipLive", "OIP v2", "Liveness", ref("Live"))),
            Description(
                {
                    "operationId": "oipReady",
                    "tags": ["OIP v2"],
                    "summary": "Readiness: every model has a healthy endpoint",
                    "responses": {
                        "200": answer("ready", ref("Ready")),
                        "503": answer("a model has no healthy endpoint", ref("Ready")),
                    },
                }
            ),
        ]
        for suffix, what in (("", "the model"), ("Version", "a version of the model")):
            parameters = [param("ModelName")] + ([param("ModelVersion")] if suffix else [])
            metadata = self._proxied_op(
                f"oipModel{suffix}Metadata",
                "OIP v2",
                f"Metadata of {what}, from a serving endpoint",
                None,
                ref("ModelMetadata"),
                INFERENCE,
            )
            ready = self._proxied_op(
                f"oipModel{suffix}Ready",
                "OIP v2",
                f"Readiness of {what}, from a serving endpoint",
                None,
                ref("ModelReady"),
                INFERENCE,
            )
            infer = self._proxied_op(
                f"oipModel{suffix}Infer",
                "OIP v2",
                f"Inference on {what}, JSON or the binary tensor extension",
                {
                    "required": True,
                    "description": "JSON, or (binary extension) a JSON header of "
                    "Inference-Header-Content-Length bytes followed by raw tensor data",
                    "content": {
                        JSON: {"schema": ref("InferenceRequest"), "example": infer_example},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                ref("InferenceResponse"),
                INFERENCE,
                bad_body=(
                    "the JSON (or the binary extension's JSON header) is not an object, or "
                    "Inference-Header-Content-Length is not an integer"
                ),
                binary=True,
            )
            infer["parameters"].append(binary_header)
            described += [Description(operation, parameters) for operation in (metadata, ready, infer)]
        return described

    # graphs -------------------------------------------------------------------------------------

    def _graphs(self) -> list[Description]:
        any_answer = {  # what KServe's router sends: JSON, or the type Go would sniff
            JSON: {"schema": {}},
            **{media: {"schema": {"type": "string"}} for media in ("text/plain", "text/html", "text/xml")},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        }
        return [
            Description(self._own("listGraphs", "Graphs", "The graphs served", ref("GraphList"))),
            Description(
                {
                    "operationId": "getGraph",
                    "tags": ["Graphs"],
                    "summary": "One graph and its spec",
                    "responses": {
                        "200": answer("the graph", ref("Graph")),
                        "404": error_response(OPENAI, "no such graph"),
                    },
                },
                [param("GraphName")],
            ),
            Description(
                {
                    "operationId": "runGraph",
                    "tags": ["Graphs"],
                    "summary": "Run a graph, answering as KServe's router does",
                    "parameters": [
                        {
                            "name": "X-Modelyard-Trace",
                            "in": "header",
                            "required": False,
                            "description": "anything but empty, `0` or `false`: add X-Modelyard-Graph-Trace",
                            "schema": {"type": "string"},
                        }
                    ],
                    "requestBody": {
                        "required": True,
                        "content": {JSON: {"schema": {}, "example": {"instances": [[1, 2]]}}},
                    },
                    "responses": {
                        "200": {
                            "description": "the graph's answer (its last step's, or an Ensemble's merged)",
                            "headers": {
                                "X-Modelyard-Graph-Trace": string_header(
                                    "with X-Modelyard-Trace: every step run, its node, target, status and ms"
                                )
                            },
                            "content": any_answer,
                        },
                        "404": answer(
                            "no such graph (OpenAI's envelope), or no Switch condition matched at the root",
                            {"anyOf": [ref(OPENAI), ref(GRAPH_FAILURE), {}]},
                        ),
                        "413": error_response(OPENAI, "the body is larger than limits.max_body_bytes"),
                        "500": answer(
                            f"a step failed (no answer, invalid response), or {STEP}",
                            {"anyOf": [ref(GRAPH_FAILURE), {}]},
                        ),
                        "504": answer(
                            f"the graph's timeout passed, or {STEP}", {"anyOf": [ref(GRAPH_FAILURE), {}]}
                        ),
                        "4XX": {"description": STEP, "content": any_answer},
                        "5XX": {"description": STEP, "content": any_answer},
                    },
                },
                [param("GraphName")],
            ),
            Description(
                self._admin_op(
                    "putGraph",
                    "Graphs",
                    "Add or replace a graph, validated first; requests running keep the old one",
                    [param("NewGraphName")],
                    json_body(
                        ref("GraphUpdate"),
                        {
                            "nodes": {
                                "root": {"routerType": "Sequence", "steps": [{"serviceName": self._model}]}
                            }
                        },
                        media=(JSON, YAML),
                    ),
                    answer("stored; with its validation warnings", ref("GraphStored")),
                    {
                        "400": error_response(OPENAI, "invalid: every problem is in `error.problems`"),
                        "413": error_response(OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                    },
                )
            ),
            Description(
                self._admin_op(
                    "deleteGraph",
                    "Graphs",
                    "Remove a graph",
                    [param("GraphName")],
                    None,
                    answer("removed", ref("GraphDeleted")),
                    {"404": error_response(OPENAI, "no such graph")},
                )
            ),
        ]

    # admin --------------------------------------------------------------------------------------

    def _admin(self) -> list[Description]:
        described = [
            self._admin_op(
                "getRoutes",
                "Admin",
                "A model's routes and its endpoints' subsets",
                [param("AdminModelName")],
                None,
                answer("the routes", ref("Routes")),
                {"404": error_response(OPENAI, "no such model")},
            ),
            self._admin_op(
                "putRoutes",
                "Admin",
                "Replace a model's routes, validated first, swapped atomically",
                [param("AdminModelName")],
                json_body(
                    ref("RoutesUpdate"),
                    {"routes": [{"name": "default", "destinations": [{"subset": "default"}]}]},
                    media=(JSON, YAML),
                ),
                answer("the routes now", ref("Routes")),
                {
                    "400": error_response(
                        OPENAI, "not JSON or YAML, or invalid: every problem in `error.problems`"
                    ),
                    "404": error_response(OPENAI, "no such model"),
                    "413": error_response(OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                },
            ),
            self._admin_op(
                "getCanary",
                "Admin",
                "Per mirrored route: answers compared, and each subset's latency and errors",
                [param("AdminModelName")],
                None,
                answer("the comparison", ref("Canary")),
                {"404": error_response(OPENAI, "no such model")},
            ),
            self._admin_op(
                "listKeys",
                "Tenants",
                "Every API key (the keys file's and those made at runtime): name, tenant, models, "
                "priority, its own limits; never the key. And the keys file's tenants: name, models, "
                "priority, limits",
                [],
                None,
                answer(
                    "the keys and the tenants",
                    {
                        "type": "object",
                        "properties": {"keys": {"type": "array"}, "tenants": {"type": "array"}},
                    },
                ),
                {"409": error_response(OPENAI, "auth.enabled is off")},
            ),
            self._admin_op(
                "createKey",
                "Tenants",
                "Make an API key for one of the keys file's tenants; the answer holds the key, this once",
                [],
                json_body(
                    {"type": "object", "required": ["name", "tenant"]},
                    {
                        "name": "team-a-ci",
                        "tenant": "team-a",
                        "models": ["chat"],
                        "limits": {"requests_per_minute": 60},
                    },
                    media=(JSON, YAML),
                ),
                answer("made", {"type": "object"}),
                {
                    "400": error_response(OPENAI, "invalid: the field and what was expected"),
                    "409": error_response(OPENAI, "the name is taken, or runtime keys are off"),
                },
            ),
            self._admin_op(
                "revokeKey",
                "Tenants",
                "Revoke a key made at runtime: every gateway refuses it within auth.key_refresh_interval",
                [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                None,
                answer("revoked", {"type": "object"}),
                {
                    "404": error_response(OPENAI, "no runtime key of that name"),
                    "409": error_response(OPENAI, "the key is in the keys file, or runtime keys are off"),
                },
            ),
            self._admin_op(
                "getUsage",
                "Tenants",
                "A UTC day's usage by tenant and key: requests, tokens, errors, refused, cost",
                [{"name": "day", "in": "query", "required": False, "schema": {"type": "string"}}],
                None,
                answer("the usage", {"type": "object"}),
                {
                    "400": error_response(OPENAI, "day is not YYYY-MM-DD"),
                    "409": error_response(OPENAI, "auth.enabled is off"),
                },
            ),
            self._admin_op(
                "getOverview",
                "Admin",
                "Per model: its strategy, and each endpoint's health, in-flight (the model's and its "
                "server's), ejection and circuit; every model the scheduler places, with its state",
                [],
                None,
                answer("the overview (never the token)", ref("Overview")),
                {},
            ),
            self._admin_op(
                "getRoutingLog",
                "Admin",
                "The routing log's recent records, oldest first: the last routed ones, and apart from "
                "them the last refused before routing (at most 50 a second per worker recorded)",
                [],
                None,
                answer("the records kept", ref("RoutingLog")),
                {},
            ),
            self._admin_op(
                "streamRoutingLog",
                "Admin",
                "The routing log as it happens: server-sent events until the gateway stops",
                [param("LastEventId")],
                None,
                answer(
                    "`id: <seq>` and `data: <RoutingRecord>` per record; `event: dropped` with "
                    '`data: {"dropped": n}` when the reader fell behind and lost n; a comment '
                    "line every 15 s while idle",
                    {"type": "string"},
                    SSE,
                ),
                {
                    "503": error_response(
                        OPENAI,
                        "admin.max_log_streams streams are open (`too_many_log_streams`)",
                        headers=RETRY_AFTER,
                    )
                },
            ),
        ]
        for suffix in ("", "InferFlow"):  # /admin/strategy, and InferFlow's /strategy
            described += [
                self._admin_op(
                    f"getStrategy{suffix}",
                    "Admin",
                    "The strategy every model runs (else the default), the default, each model's, and "
                    "the models that run another",
                    [],
                    None,
                    answer("the strategies", ref("Strategies")),
                    {},
                ),
                self._admin_op(
                    f"putStrategy{suffix}",
                    "Admin",
                    "Switch the strategy of one model, or of every model and the default of models that "
                    "appear later; counters and affinity stay",
                    [],
                    json_body(ref("StrategyUpdate"), {"strategy": "least_pending"}),
                    answer("the strategies now", ref("Strategies")),
                    {
                        "400": error_response(
                            OPENAI, "not a JSON object, unknown strategy, `model` not a string"
                        ),
                        "404": error_response(OPENAI, "no such model"),
                        "413": error_response(OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                    },
                ),
            ]
        return [Description(operation) for operation in described]

    # operations ---------------------------------------------------------------------------------

    def _operations(self) -> list[Description]:
        operations: list[Schema] = [
            {
                "operationId": "dashboard",
                "tags": ["Dashboard"],
                "summary": "The dashboard page (public; it asks for the admin token)",
                "responses": {"200": answer("the page", {"type": "string"}, HTML)},
            },
            {
                "operationId": "dashboardSlash",
                "tags": ["Dashboard"],
                "summary": "Sends the browser to /dashboard",
                "responses": {
                    "307": answer(
                        "to the page",
                        headers={"Location": string_header("`/dashboard`, the query kept", required=True)},
                    )
                },
            },
            {
                "operationId": "dashboardAsset",
                "tags": ["Dashboard"],
                "summary": "The dashboard's script and style",
                "parameters": [param("DashboardAsset")],
                "responses": {
                    "200": answer("the file", {"type": "string"}, HTML, "text/javascript", "text/css"),
                    "404": error_response(OPENAI, "no such file"),
                },
            },
            self._own("healthz", "Operations", "Liveness", ref("Health")),
            {
                "operationId": "readyz",
                "tags": ["Operations"],
                "summary": "Readiness: every model has a healthy endpoint",
                "responses": {
                    "200": answer("ready", ref("Readiness")),
                    "503": answer("the models without a healthy endpoint", ref("Readiness")),
                },
            },
            {
                "operationId": "metrics",
                "tags": ["Operations"],
                "summary": "Prometheus metrics",
                "responses": {"200": answer("the text exposition format", {"type": "string"}, "text/plain")},
            },
            {
                "operationId": "openapi",
                "tags": ["Operations"],
                "summary": "This document",
                "responses": {
                    "200": answer("OpenAPI 3.1", {"type": "object", "required": ["openapi", "info", "paths"]})
                },
            },
        ]
        return [Description(operation) for operation in operations]

    # operation shapes ---------------------------------------------------------------------------

    @staticmethod
    def _own(operation_id: str, tag: str, summary: str, schema: Schema) -> Schema:
        return {
            "operationId": operation_id,
            "tags": [tag],
            "summary": summary,
            "responses": {"200": answer(summary.lower(), schema)},
        }

    def _proxied_op(
        self,
        operation_id: str,
        tag: str,
        summary: str,
        body: Schema | None,
        answer: Schema,
        envelope: str,
        *,
        stream: bool = False,
        bad_body: str = "",
        not_allowed: bool = False,
        binary: bool = False,
    ) -> Schema:
        """An operation the gateway forwards to one of the model's endpoints."""
        ok: dict[str, Any] = {JSON: {"schema": answer}}
        if stream:
            ok[SSE] = {"schema": ref("ServerSentEvent")}
        if binary:
            ok["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        relayed = f"; or {RELAYED}"
        responses: dict[str, Any] = {
            "200": {"description": RELAYED, "headers": relay_headers(required=True), "content": ok},
        }
        if body is not None:
            responses["400"] = error_response(envelope, f"the body is {bad_body}{relayed}")
        responses["404"] = error_response(
            envelope,
            "unknown or missing model (the message lists the known models), or no route of the "
            f"model matches the request{relayed}",
        )
        if not_allowed:
            responses["405"] = error_response(envelope, "GET on the :predict path", headers=ALLOW)
        if body is not None:
            responses["413"] = error_response(envelope, "the body is larger than limits.max_body_bytes")
        responses["429"] = error_response(
            envelope,
            "every endpoint has `circuit_breakers.max_requests` in flight and the wait queue is full "
            f"or timed out{relayed}",
            headers=RETRY_AFTER,
        )
        responses["502"] = error_response(
            envelope, f"no answer: every endpoint tried refused, or it broke off{relayed}"
        )
        responses["503"] = error_response(envelope, f"no healthy endpoint{relayed}", headers=RETRY_AFTER)
        responses["504"] = error_response(envelope, f"the route's timeout passed{relayed}")
        responses["4XX"] = error_response(envelope, RELAYED, headers=relay_headers(required=True))
        responses["5XX"] = error_response(envelope, RELAYED, headers=relay_headers(required=True))
        operation: Schema = {
            "operationId": operation_id,
            "tags": [tag],
            "summary": summary,
            "parameters": [param("RequestId")],
            "responses": responses,
        }
        if body is not None:
            operation["requestBody"] = body
        return operation

    def _admin_op(
        self,
        operation_id: str,
        tag: str,
        summary: str,
        parameters: list[Schema],
        body: Schema | None,
        ok: Schema,
        errors: dict[str, Any],
    ) -> Schema:
        responses: dict[str, Any] = {"200": ok, **errors}
        operation: Schema = {"operationId": operation_id, "tags": [tag], "summary": summary}
        if parameters:
            operation["parameters"] = parameters
        if body is not None:
            operation["requestBody"] = body
        if self._admin_token:
            operation["security"] = [{"adminToken": []}]
            responses["401"] = unauthorized()
        operation["responses"] = dict(sorted(responses.items()))
        return operation
