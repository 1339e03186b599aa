"""The gateway's OpenAPI 3.1 document: every route it serves, at `GET /openapi.json`.

The document describes one gateway as it runs. Model names (in paths, and the OpenAI `model`
field) are an `enum` of its models, and graph names one of the graphs it serves now, so that
generated clients offer the real names and fuzzers reach the proxy and the graph engine instead of
stopping at the 404 for an unknown name; any other name is a documented 404. What the gateway
answers itself is described exactly, each protocol in its own error envelope; what it relays from
an inference server, or composes from a graph's steps, loosely, since that shape is the server's:
the statuses the gateway can answer are listed, and `4XX`/`5XX` stand for the others it relays.
"""

from __future__ import annotations

import copy
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from aiohttp import web
from pydantic import BaseModel

from modelyard import __version__
from modelyard.config import STRATEGY_NAMES, RouteConfig
from modelyard.graph import GraphSpec
from modelyard.protocols import protocol_for_path
from modelyard.types import Protocol

if TYPE_CHECKING:
    from modelyard.gateway.gateway import Gateway

Schema = dict[str, Any]

_JSON = "application/json"
_YAML = "application/yaml"
_SSE = "text/event-stream"
_OPENAI = "OpenAIError"  # {"error": {"message", "type", "param", "code"}}: OpenAI paths, the gateway's own
_INFERENCE = "InferenceError"  # {"error": "<message>"}: OIP v2 and KServe v1 paths
_GRAPH_FAILURE = "GraphFailure"

_RELAYED = "the inference server's answer, relayed as it is (`X-Modelyard-Backend` names the server)"
_STEP = "a graph step's answer, relayed as it is"


def openapi_document(
    models: Sequence[str],
    graphs: Sequence[str],
    *,
    admin_token: bool = False,
    graph_views_protected: bool = False,
) -> dict[str, Any]:
    """The document for a gateway serving `models` and `graphs`; with `admin_token`, the admin
    calls require a bearer token (and may answer 401)."""
    schemas = _schemas(models, graphs)
    document: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {
            "title": "modelyard gateway",
            "version": __version__,
            "description": (
                "Routes OpenAI, Open Inference Protocol v2 and KServe v1 requests to inference "
                "servers, runs inference graphs, and is governed at runtime through /admin."
            ),
        },
        "tags": [
            {"name": name} for name in ("OpenAI", "OIP v2", "KServe v1", "Graphs", "Admin", "Operations")
        ],
        "paths": _Paths(models, admin_token, graph_views_protected).build(),
        "components": {"schemas": schemas, "parameters": _PARAMETERS},
    }
    if admin_token:
        document["components"]["securitySchemes"] = {
            "adminToken": {"type": "http", "scheme": "bearer", "description": "`admin.token`"}
        }
    return copy.deepcopy(document)  # it shares this module's fragments; the caller's to change


def openapi_handler(gateway: Gateway) -> Callable[[web.Request], Awaitable[web.Response]]:
    """`GET /openapi.json` for one gateway. Its models are fixed for its life and its graphs change
    only through /admin, so the encoded document is kept until the graph names change."""
    cached: list[tuple[tuple[str, ...], bytes]] = []

    async def handle(request: web.Request) -> web.Response:
        graphs = tuple(sorted(gateway.graphs.graphs))
        if not cached or cached[0][0] != graphs:
            admin = gateway.config.admin
            document = openapi_document(
                list(gateway.clusters),
                graphs,
                admin_token=admin.token is not None,
                graph_views_protected=admin.protect_graph_views,
            )
            cached[:] = [(graphs, orjson.dumps(document))]
        return web.Response(body=cached[0][1], content_type=_JSON)

    return handle


# --- building blocks ---------------------------------------------------------------------------


def _ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def _param(name: str) -> Schema:
    return {"$ref": f"#/components/parameters/{name}"}


def _string_header(description: str, *, required: bool = False) -> Schema:
    return {"description": description, "required": required, "schema": {"type": "string"}}


def _relay_headers(*, required: bool) -> Schema:
    return {
        "X-Modelyard-Backend": _string_header("the endpoint that answered", required=required),
        "X-Modelyard-Strategy": _string_header("the strategy that picked it", required=required),
        "X-Modelyard-Route": _string_header("the route taken (`default` without routes)", required=required),
        "X-Modelyard-Subset": _string_header(
            "the subset it went to (`*`: every endpoint)", required=required
        ),
        "X-Request-Id": _string_header("the client's, or a new one, also sent upstream", required=required),
        "X-Modelyard-Cache-Hit": {
            "description": "`kv_aware` only: whether the prompt prefix had an affinity",
            "schema": {"type": "string", "enum": ["true", "false"]},
        },
    }


_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again (always on the gateway's own answer)",
        "schema": {"type": "string"},
    }
}
_ALLOW = {"Allow": _string_header("the methods the path allows", required=True)}


def _answer(description: str, schema: Schema | None = None, *media: str, **extra: Any) -> Schema:
    """A response object; `schema` for each of `media` (application/json by default)."""
    response: Schema = {"description": description, **extra}
    if schema is not None:
        response["content"] = {m: {"schema": schema} for m in media or (_JSON,)}
    return response


def _error(envelope: str, description: str, **extra: Any) -> Schema:
    return _answer(description, _ref(envelope), **extra)


def _unauthorized() -> Schema:
    challenge = _string_header(
        '`Bearer realm=...`, with `error="invalid_token"` for a wrong one', required=True
    )
    return _error(_OPENAI, "the bearer token is missing or wrong", headers={"WWW-Authenticate": challenge})


_FORWARDED = ("/v1/models/", "/v2/models/")  # paths sent upstream as the client wrote them
_METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
_UNSAFE_SEGMENT = (
    "a path segment decodes to `.` or `..` or holds a slash (it would escape the routed resource)"
)


def _json_body(schema: Schema, example: Any = None, *, media: Sequence[str] = (_JSON,)) -> Schema:
    content: Schema = {}
    for m in media:
        content[m] = {"schema": schema}
        if example is not None:
            content[m]["example"] = example
    return {"required": True, "content": content}


def _pydantic(schemas: dict[str, Schema], name: str, schema: Schema) -> None:
    """Add a pydantic JSON schema (refs already pointing at components) and its definitions."""
    for def_name, definition in schema.pop("$defs", {}).items():
        assert def_name not in schemas, f"two schemas named {def_name}"
        schemas[def_name] = definition
    schemas[name] = schema


def _model_json_schema(model: type[BaseModel], *, by_alias: bool = False) -> Schema:
    return model.model_json_schema(by_alias=by_alias, ref_template="#/components/schemas/{model}")


_PARAMETERS: dict[str, Schema] = {
    "ModelName": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "a model of this gateway",
        "schema": _ref("ModelName"),
    },
    "AdminModelName": {
        "name": "model",
        "in": "path",
        "required": True,
        "description": "a model of this gateway",
        "schema": _ref("ModelName"),
    },
    "ModelVersion": {
        "name": "version",
        "in": "path",
        "required": True,
        "description": "forwarded to the inference server as it is",
        "schema": {"type": "string", "minLength": 1},
    },
    "GraphName": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "a graph this gateway serves",
        "schema": _ref("GraphName"),
    },
    "NewGraphName": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "the graph to add or replace (a Kubernetes name, as KServe requires)",
        "schema": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
    },
    "RequestId": {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "kept, sent upstream and echoed; the gateway makes one when absent",
        "schema": {"type": "string"},
    },
}


# --- schemas ---------------------------------------------------------------------------------------


def _schemas(models: Sequence[str], graphs: Sequence[str]) -> dict[str, Schema]:
    names = {"type": "string", "enum": list(models)} if models else {"type": "string", "minLength": 1}
    graph_names = {"type": "string", "enum": list(graphs)} if graphs else {"type": "string", "minLength": 1}
    any_object: Schema = {"type": "object"}
    strategy = {"type": "string", "enum": list(STRATEGY_NAMES)}
    schemas: dict[str, Schema] = {
        "ModelName": names,
        "GraphName": graph_names,
        "StrategyName": strategy,
        # Error envelopes. Inference servers relay theirs in the same shapes (OpenAI's for OpenAI
        # servers, OIP's for OIP and KServe servers), so each is written to admit both: the gateway
        # always fills `param` and `code`; other servers may leave them out.
        _OPENAI: {
            "type": "object",
            "required": ["error"],
            "properties": {
                "error": {
                    "type": "object",
                    "required": ["message", "type"],
                    "properties": {
                        "message": {"type": "string"},
                        "type": {"type": "string"},
                        "param": {"type": ["string", "null"]},
                        "code": {"type": ["string", "integer", "null"]},
                        "problems": {
                            "type": "array",
                            "items": {"type": "string"},
                            "description": "every problem of an invalid graph or routes update",
                        },
                    },
                }
            },
        },
        _INFERENCE: {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        _GRAPH_FAILURE: {
            "type": "object",
            "description": "KServe's router's failure answer",
            "required": ["error", "cause"],
            "properties": {"error": {"const": "Failed to process request"}, "cause": {"type": "string"}},
        },
        # OpenAI requests: the fields the gateway reads; the rest is forwarded untouched.
        "ChatCompletionRequest": {
            "type": "object",
            "required": ["model", "messages"],
            "properties": {
                "model": _ref("ModelName"),
                "messages": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["role"],
                        "properties": {
                            "role": {"type": "string"},
                            "content": {"type": ["string", "array", "null"]},
                        },
                    },
                },
                **_GENERATION,
            },
        },
        "CompletionRequest": {
            "type": "object",
            "required": ["model", "prompt"],
            "properties": {
                "model": _ref("ModelName"),
                "prompt": _TEXTS,
                **_GENERATION,
            },
        },
        "EmbeddingRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": _ref("ModelName"),
                "input": _TEXTS,
            },
        },
        "ServerSentEvent": {
            "type": "object",
            "description": "one event of a stream relayed chunk by chunk: `data` is a JSON chunk, or [DONE]",
            "required": ["data"],
            "properties": {
                "data": {"type": "string"},
                "event": {"type": "string"},
                "id": {"type": "string"},
                "retry": {"type": "integer"},
            },
        },
        "ChatCompletion": {"type": "object", "description": _RELAYED, "required": ["choices"]},
        "Completion": {"type": "object", "description": _RELAYED, "required": ["choices"]},
        "Embeddings": {"type": "object", "description": _RELAYED, "required": ["data"]},
        "ModelList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["id", "object", "created", "owned_by"],
                        "properties": {
                            "id": _ref("ModelName"),
                            "object": {"const": "model"},
                            "created": {"type": "integer"},
                            "owned_by": {"type": "string"},
                        },
                    },
                },
            },
        },
        # Open Inference Protocol v2 and KServe v1.
        "InferenceRequest": {
            "type": "object",
            "required": ["inputs"],
            "properties": {
                "id": {"type": "string"},
                "parameters": any_object,
                "inputs": {"type": "array", "items": _ref("RequestTensor")},
                "outputs": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}, "parameters": any_object},
                    },
                },
            },
        },
        "RequestTensor": {
            "type": "object",
            "required": ["name", "shape", "datatype"],
            "properties": {
                "name": {"type": "string"},
                "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
                "datatype": {"type": "string"},
                "parameters": any_object,
                "data": {"description": "the tensor's elements, flat or nested"},
            },
        },
        "InferenceResponse": {"type": "object", "description": _RELAYED, "required": ["outputs"]},
        "ModelMetadata": {"type": "object", "description": _RELAYED, "required": ["name"]},
        "ModelReady": {"type": "object", "description": _RELAYED},
        "ServerMetadata": {
            "type": "object",
            "required": ["name", "version", "extensions"],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "string"},
                "extensions": {"type": "array", "items": {"type": "string"}},
            },
        },
        "Live": {"type": "object", "required": ["live"], "properties": {"live": {"type": "boolean"}}},
        "Ready": {"type": "object", "required": ["ready"], "properties": {"ready": {"type": "boolean"}}},
        "PredictRequest": {
            "type": "object",
            "required": ["instances"],
            "properties": {"instances": {"type": "array"}},
        },
        "PredictResponse": {"type": "object", "description": _RELAYED, "required": ["predictions"]},
        "KServeModel": {"type": "object", "description": _RELAYED},
        # The gateway's own endpoints.
        "Health": {"type": "object", "required": ["status"], "properties": {"status": {"const": "ok"}}},
        "Readiness": {
            "type": "object",
            "required": ["ready", "models_without_healthy_endpoints"],
            "properties": {
                "ready": {"type": "boolean"},
                "models_without_healthy_endpoints": {"type": "array", "items": _ref("ModelName")},
            },
        },
        "Strategies": {
            "type": "object",
            "required": ["strategy", "models", "available"],
            "properties": {
                "strategy": {"type": "string", "enum": [*STRATEGY_NAMES, "mixed"]},
                "models": {"type": "object", "additionalProperties": _ref("StrategyName")},
                "available": {"type": "array", "items": _ref("StrategyName")},
            },
        },
        "StrategyUpdate": {
            "type": "object",
            "required": ["strategy"],
            "properties": {
                "strategy": _ref("StrategyName"),
                "model": {
                    "description": "one model; absent, null or empty: every model",
                    "anyOf": [_ref("ModelName"), {"const": ""}, {"type": "null"}],
                },
            },
        },
        "RoutesUpdate": {
            "description": "the model's new routes, all of them, tried in order; JSON or YAML",
            "anyOf": [
                {
                    "type": "object",
                    "required": ["routes"],
                    "properties": {"routes": {"type": "array", "items": _ref("RouteConfig")}},
                },
                {"type": "array", "items": _ref("RouteConfig")},
            ],
        },
        "Routes": {
            "type": "object",
            "required": ["model", "routes", "subsets"],
            "properties": {
                "model": _ref("ModelName"),
                "routes": {"type": "array", "items": _ref("RouteConfig")},
                "subsets": {"type": "array", "items": {"type": "string"}},
            },
        },
        "Canary": {
            "type": "object",
            "required": ["model", "mirrors", "routes"],
            "properties": {
                "model": _ref("ModelName"),
                "mirrors": {"type": "object", "additionalProperties": _ref("MirrorPolicy")},
                "routes": {"type": "object", "additionalProperties": _ref("CanarySummary")},
            },
        },
        "CanarySummary": {  # cluster.canary.CanarySummary
            "type": "object",
            "required": ["compared", "mean_rouge_l", "exact_match_rate", "subsets"],
            "properties": {
                "compared": {"type": "integer"},
                "mean_rouge_l": {"type": ["number", "null"]},
                "exact_match_rate": {"type": ["number", "null"]},
                "subsets": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "required": ["requests", "errors", "error_rate", "p50_ms", "p95_ms"],
                        "properties": {
                            "requests": {"type": "integer"},
                            "errors": {"type": "integer"},
                            "error_rate": {"type": "number"},
                            "p50_ms": {"type": ["number", "null"]},
                            "p95_ms": {"type": ["number", "null"]},
                        },
                    },
                },
            },
        },
        # Graphs.
        "GraphSummary": {
            "type": "object",
            "required": ["name", "nodes", "timeout"],
            "properties": {
                "name": {"type": "string"},
                "nodes": {
                    "type": "object",
                    "additionalProperties": {
                        "type": "object",
                        "required": ["routerType", "steps"],
                        "properties": {"routerType": {"type": "string"}, "steps": {"type": "integer"}},
                    },
                },
                "timeout": {"type": ["integer", "null"]},
            },
        },
        "GraphList": {
            "type": "object",
            "required": ["object", "data"],
            "properties": {
                "object": {"const": "list"},
                "data": {"type": "array", "items": _ref("GraphSummary")},
            },
        },
        "Graph": {
            "allOf": [_ref("GraphSummary")],
            "required": ["spec"],
            "properties": {"spec": _ref("GraphSpec")},
        },
        "GraphUpdate": {
            "description": "a graph spec, or a whole KServe InferenceGraph manifest; JSON or YAML",
            "anyOf": [
                _ref("GraphSpec"),
                {
                    "type": "object",
                    "required": ["apiVersion", "kind", "metadata", "spec"],
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"const": "InferenceGraph"},
                        "metadata": {
                            "type": "object",
                            "required": ["name"],
                            "properties": {"name": {"type": "string", "description": "the path's name"}},
                        },
                        "spec": _ref("GraphSpec"),
                    },
                },
            ],
        },
        "GraphStored": {
            "allOf": [_ref("GraphSummary")],
            "required": ["warnings"],
            "properties": {"warnings": {"type": "array", "items": {"type": "string"}}},
        },
        "GraphDeleted": {
            "type": "object",
            "required": ["deleted"],
            "properties": {"deleted": {"type": "string"}},
        },
    }
    _pydantic(schemas, "RouteConfig", _model_json_schema(RouteConfig))
    _pydantic(schemas, "GraphSpec", _model_json_schema(GraphSpec, by_alias=True))
    return schemas


_TOKENS: Schema = {"type": "array", "minItems": 1, "items": {"type": "integer"}}
_TEXTS: Schema = {  # OpenAI's prompt and input: text or tokens, one or many
    "anyOf": [
        {"type": "string"},
        {"type": "array", "minItems": 1, "items": {"type": "string"}},
        _TOKENS,
        {"type": "array", "minItems": 1, "items": _TOKENS},
    ]
}
_GENERATION: Schema = {
    "stream": {"type": "boolean", "description": "true: the answer is relayed as server-sent events"},
    "max_tokens": {"type": ["integer", "null"], "minimum": 0},
    "max_completion_tokens": {"type": ["integer", "null"], "minimum": 0},
}


# --- paths -----------------------------------------------------------------------------------------


class _Paths:
    def __init__(self, models: Sequence[str], admin_token: bool, graph_views_protected: bool) -> None:
        self._model = models[0] if models else "my-model"
        self._admin_token = admin_token
        self._graph_views_protected = admin_token and graph_views_protected

    def build(self) -> dict[str, Any]:
        paths: dict[str, Any] = {}
        paths.update(self._openai())
        paths.update(self._kserve())
        paths.update(self._oip())
        paths.update(self._graphs())
        paths.update(self._admin())
        paths.update(self._operations())
        for path, operations in paths.items():
            envelope = (
                _INFERENCE if protocol_for_path(path) in (Protocol.OIP, Protocol.KSERVE_V1) else _OPENAI
            )
            for method, operation in operations.items():
                if method not in _METHODS:
                    continue  # path-level parameters
                responses = operation["responses"]
                if path.startswith(_FORWARDED) and "{" in path and "400" not in responses:
                    responses["400"] = _error(envelope, _UNSAFE_SEGMENT)
                if self._graph_views_protected and method == "get" and path.startswith("/v1/graphs"):
                    operation["security"] = [{"adminToken": []}]
                    responses["401"] = _unauthorized()
                operation["responses"] = dict(sorted(responses.items()))
        return paths

    # OpenAI -------------------------------------------------------------------------------------

    def _openai(self) -> dict[str, Any]:
        model = self._model
        chat = {"model": model, "messages": [{"role": "user", "content": "Hello!"}]}
        return {
            "/v1/chat/completions": {
                "post": self._proxied_op(
                    "chatCompletions",
                    "OpenAI",
                    "Chat completion, routed by the body's `model`",
                    _json_body(_ref("ChatCompletionRequest"), chat),
                    _ref("ChatCompletion"),
                    _OPENAI,
                    stream=True,
                    bad_body="not JSON, not an object, `model` not a string, or `messages` not a list",
                )
            },
            "/v1/completions": {
                "post": self._proxied_op(
                    "completions",
                    "OpenAI",
                    "Text completion, routed by the body's `model`",
                    _json_body(_ref("CompletionRequest"), {"model": model, "prompt": "Once upon a time"}),
                    _ref("Completion"),
                    _OPENAI,
                    stream=True,
                    bad_body="not JSON, not an object, or `model` not a string",
                )
            },
            "/v1/embeddings": {
                "post": self._proxied_op(
                    "embeddings",
                    "OpenAI",
                    "Embeddings, routed by the body's `model`",
                    _json_body(_ref("EmbeddingRequest"), {"model": model, "input": "Hello!"}),
                    _ref("Embeddings"),
                    _OPENAI,
                    bad_body="not JSON, not an object, or `model` not a string",
                )
            },
            "/v1/models": {
                "get": {
                    "operationId": "listModels",
                    "tags": ["OpenAI"],
                    "summary": "The gateway's models, in OpenAI's list shape",
                    "responses": {"200": _answer("the models", _ref("ModelList"))},
                }
            },
        }

    # KServe v1 ----------------------------------------------------------------------------------

    def _kserve(self) -> dict[str, Any]:
        return {
            "/v1/models/{name}:predict": {
                "parameters": [_param("ModelName")],
                "post": self._proxied_op(
                    "kservePredict",
                    "KServe v1",
                    "KServe v1 prediction, routed by the path's model",
                    _json_body(_ref("PredictRequest"), {"instances": [[1, 2, 3]]}),
                    _ref("PredictResponse"),
                    _INFERENCE,
                    bad_body="not JSON or not an object",
                ),
            },
            "/v1/models/{name}": {
                "parameters": [_param("ModelName")],
                "get": self._proxied_op(
                    "kserveModel",
                    "KServe v1",
                    "KServe v1 model status, from a serving endpoint",
                    None,
                    _ref("KServeModel"),
                    _INFERENCE,
                    not_allowed=True,
                ),
            },
        }

    # Open Inference Protocol v2 -----------------------------------------------------------------

    def _oip(self) -> dict[str, Any]:
        infer_example = {"inputs": [{"name": "x", "shape": [3], "datatype": "FP32", "data": [1, 2, 3]}]}
        binary_header = {
            "name": "Inference-Header-Content-Length",
            "in": "header",
            "required": False,
            "description": "binary tensor extension: the length of the JSON header before the raw tensors",
            "schema": {"type": "integer", "minimum": 0},
        }
        paths: dict[str, Any] = {
            "/v2": {"get": self._own("oipServer", "OIP v2", "Server metadata", _ref("ServerMetadata"))},
            "/v2/health/live": {"get": self._own("oipLive", "OIP v2", "Liveness", _ref("Live"))},
            "/v2/health/ready": {
                "get": {
                    "operationId": "oipReady",
                    "tags": ["OIP v2"],
                    "summary": "Readiness: every model has a healthy endpoint",
                    "responses": {
                        "200": _answer("ready", _ref("Ready")),
                        "503": _answer("a model has no healthy endpoint", _ref("Ready")),
                    },
                }
            },
        }
        for prefix, suffix, what in (
            ("/v2/models/{name}", "", "the model"),
            ("/v2/models/{name}/versions/{version}", "Version", "a version of the model"),
        ):
            parameters = [_param("ModelName")] + ([_param("ModelVersion")] if suffix else [])
            paths[prefix] = {
                "parameters": parameters,
                "get": self._proxied_op(
                    f"oipModel{suffix}Metadata",
                    "OIP v2",
                    f"Metadata of {what}, from a serving endpoint",
                    None,
                    _ref("ModelMetadata"),
                    _INFERENCE,
                ),
            }
            paths[prefix + "/ready"] = {
                "parameters": parameters,
                "get": self._proxied_op(
                    f"oipModel{suffix}Ready",
                    "OIP v2",
                    f"Readiness of {what}, from a serving endpoint",
                    None,
                    _ref("ModelReady"),
                    _INFERENCE,
                ),
            }
            infer = self._proxied_op(
                f"oipModel{suffix}Infer",
                "OIP v2",
                f"Inference on {what}, JSON or the binary tensor extension",
                {
                    "required": True,
                    "description": "JSON, or (binary extension) a JSON header of "
                    "Inference-Header-Content-Length bytes followed by raw tensor data",
                    "content": {
                        _JSON: {"schema": _ref("InferenceRequest"), "example": infer_example},
                        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
                    },
                },
                _ref("InferenceResponse"),
                _INFERENCE,
                bad_body=(
                    "the JSON (or the binary extension's JSON header) is not an object, or "
                    "Inference-Header-Content-Length is not an integer"
                ),
                binary=True,
            )
            infer["parameters"].append(binary_header)
            paths[prefix + "/infer"] = {"parameters": parameters, "post": infer}
        return paths

    # graphs -------------------------------------------------------------------------------------

    def _graphs(self) -> dict[str, Any]:
        any_answer = {  # what KServe's router sends: JSON, or the type Go would sniff
            _JSON: {"schema": {}},
            **{media: {"schema": {"type": "string"}} for media in ("text/plain", "text/html", "text/xml")},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        }
        return {
            "/v1/graphs": {"get": self._own("listGraphs", "Graphs", "The graphs served", _ref("GraphList"))},
            "/v1/graphs/{name}": {
                "parameters": [_param("GraphName")],
                "get": {
                    "operationId": "getGraph",
                    "tags": ["Graphs"],
                    "summary": "One graph and its spec",
                    "responses": {
                        "200": _answer("the graph", _ref("Graph")),
                        "404": _error(_OPENAI, "no such graph"),
                    },
                },
                "post": {
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
                        "content": {_JSON: {"schema": {}, "example": {"instances": [[1, 2]]}}},
                    },
                    "responses": {
                        "200": {
                            "description": "the graph's answer (its last step's, or an Ensemble's merged)",
                            "headers": {
                                "X-Modelyard-Graph-Trace": _string_header(
                                    "with X-Modelyard-Trace: every step run, its node, target, status and ms"
                                )
                            },
                            "content": any_answer,
                        },
                        "404": _answer(
                            "no such graph (OpenAI's envelope), or no Switch condition matched at the root",
                            {"anyOf": [_ref(_OPENAI), _ref(_GRAPH_FAILURE), {}]},
                        ),
                        "413": _error(_OPENAI, "the body is larger than limits.max_body_bytes"),
                        "500": _answer(
                            f"a step failed (no answer, invalid response), or {_STEP}",
                            {"anyOf": [_ref(_GRAPH_FAILURE), {}]},
                        ),
                        "504": _answer(
                            f"the graph's timeout passed, or {_STEP}", {"anyOf": [_ref(_GRAPH_FAILURE), {}]}
                        ),
                        "4XX": {"description": _STEP, "content": any_answer},
                        "5XX": {"description": _STEP, "content": any_answer},
                    },
                },
            },
            "/admin/graphs/{name}": {
                "put": self._admin_op(
                    "putGraph",
                    "Graphs",
                    "Add or replace a graph, validated first; requests running keep the old one",
                    [_param("NewGraphName")],
                    _json_body(
                        _ref("GraphUpdate"),
                        {
                            "nodes": {
                                "root": {"routerType": "Sequence", "steps": [{"serviceName": self._model}]}
                            }
                        },
                        media=(_JSON, _YAML),
                    ),
                    _answer("stored; with its validation warnings", _ref("GraphStored")),
                    {
                        "400": _error(_OPENAI, "invalid: every problem is in `error.problems`"),
                        "413": _error(_OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                    },
                ),
                "delete": self._admin_op(
                    "deleteGraph",
                    "Graphs",
                    "Remove a graph",
                    [_param("GraphName")],
                    None,
                    _answer("removed", _ref("GraphDeleted")),
                    {"404": _error(_OPENAI, "no such graph")},
                ),
            },
        }

    # admin --------------------------------------------------------------------------------------

    def _admin(self) -> dict[str, Any]:
        paths: dict[str, Any] = {
            "/admin/models/{model}/routes": {
                "get": self._admin_op(
                    "getRoutes",
                    "Admin",
                    "A model's routes and its endpoints' subsets",
                    [_param("AdminModelName")],
                    None,
                    _answer("the routes", _ref("Routes")),
                    {"404": _error(_OPENAI, "no such model")},
                ),
                "put": self._admin_op(
                    "putRoutes",
                    "Admin",
                    "Replace a model's routes, validated first, swapped atomically",
                    [_param("AdminModelName")],
                    _json_body(
                        _ref("RoutesUpdate"),
                        {"routes": [{"name": "default", "destinations": [{"subset": "default"}]}]},
                        media=(_JSON, _YAML),
                    ),
                    _answer("the routes now", _ref("Routes")),
                    {
                        "400": _error(
                            _OPENAI, "not JSON or YAML, or invalid: every problem in `error.problems`"
                        ),
                        "404": _error(_OPENAI, "no such model"),
                        "413": _error(_OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                    },
                ),
            },
            "/admin/models/{model}/canary": {
                "get": self._admin_op(
                    "getCanary",
                    "Admin",
                    "Per mirrored route: answers compared, and each subset's latency and errors",
                    [_param("AdminModelName")],
                    None,
                    _answer("the comparison", _ref("Canary")),
                    {"404": _error(_OPENAI, "no such model")},
                ),
            },
        }
        for path, suffix in (("/admin/strategy", ""), ("/strategy", "InferFlow")):
            paths[path] = {
                "get": self._admin_op(
                    f"getStrategy{suffix}",
                    "Admin",
                    "Each model's strategy",
                    [],
                    None,
                    _answer("the strategies", _ref("Strategies")),
                    {},
                ),
                "put": self._admin_op(
                    f"putStrategy{suffix}",
                    "Admin",
                    "Switch the strategy of every model, or of one; counters and affinity stay",
                    [],
                    _json_body(_ref("StrategyUpdate"), {"strategy": "least_pending"}),
                    _answer("the strategies now", _ref("Strategies")),
                    {
                        "400": _error(_OPENAI, "not a JSON object, unknown strategy, `model` not a string"),
                        "404": _error(_OPENAI, "no such model"),
                        "413": _error(_OPENAI, "the body is larger than limits.max_admin_body_bytes"),
                    },
                ),
            }
        return paths

    # operations ---------------------------------------------------------------------------------

    def _operations(self) -> dict[str, Any]:
        return {
            "/healthz": {"get": self._own("healthz", "Operations", "Liveness", _ref("Health"))},
            "/readyz": {
                "get": {
                    "operationId": "readyz",
                    "tags": ["Operations"],
                    "summary": "Readiness: every model has a healthy endpoint",
                    "responses": {
                        "200": _answer("ready", _ref("Readiness")),
                        "503": _answer("the models without a healthy endpoint", _ref("Readiness")),
                    },
                }
            },
            "/metrics": {
                "get": {
                    "operationId": "metrics",
                    "tags": ["Operations"],
                    "summary": "Prometheus metrics",
                    "responses": {
                        "200": _answer("the text exposition format", {"type": "string"}, "text/plain")
                    },
                }
            },
            "/openapi.json": {
                "get": {
                    "operationId": "openapi",
                    "tags": ["Operations"],
                    "summary": "This document",
                    "responses": {
                        "200": _answer(
                            "OpenAPI 3.1",
                            {"type": "object", "required": ["openapi", "info", "paths"]},
                        )
                    },
                }
            },
        }

    # operation shapes ---------------------------------------------------------------------------

    @staticmethod
    def _own(operation_id: str, tag: str, summary: str, schema: Schema) -> Schema:
        return {
            "operationId": operation_id,
            "tags": [tag],
            "summary": summary,
            "responses": {"200": _answer(summary.lower(), schema)},
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
        ok: dict[str, Any] = {_JSON: {"schema": answer}}
        if stream:
            ok[_SSE] = {"schema": _ref("ServerSentEvent")}
        if binary:
            ok["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
        relayed = f"; or {_RELAYED}"
        responses: dict[str, Any] = {
            "200": {"description": _RELAYED, "headers": _relay_headers(required=True), "content": ok},
        }
        if body is not None:
            responses["400"] = _error(envelope, f"the body is {bad_body}{relayed}")
        responses["404"] = _error(
            envelope,
            "unknown or missing model (the message lists the known models), or no route of the "
            f"model matches the request{relayed}",
        )
        if not_allowed:
            responses["405"] = _error(envelope, "GET on the :predict path", headers=_ALLOW)
        if body is not None:
            responses["413"] = _error(envelope, "the body is larger than limits.max_body_bytes")
        responses["429"] = _error(
            envelope,
            "every endpoint has `circuit_breakers.max_requests` in flight and the wait queue is full "
            f"or timed out{relayed}",
            headers=_RETRY_AFTER,
        )
        responses["502"] = _error(
            envelope, f"no answer: every endpoint tried refused, or it broke off{relayed}"
        )
        responses["503"] = _error(envelope, f"no healthy endpoint{relayed}", headers=_RETRY_AFTER)
        responses["504"] = _error(envelope, f"the route's timeout passed{relayed}")
        responses["4XX"] = _error(envelope, _RELAYED, headers=_relay_headers(required=True))
        responses["5XX"] = _error(envelope, _RELAYED, headers=_relay_headers(required=True))
        operation: Schema = {
            "operationId": operation_id,
            "tags": [tag],
            "summary": summary,
            "parameters": [_param("RequestId")],
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
            responses["401"] = _unauthorized()
        operation["responses"] = dict(sorted(responses.items()))
        return operation
