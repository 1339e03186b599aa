"""The document's component schemas: names, error envelopes, request and answer bodies."""

from __future__ import annotations

from collections.abc import Sequence

from modelyard.config import STRATEGY_NAMES, RouteConfig
from modelyard.gateway.openapi.parts import (
    GRAPH_FAILURE,
    INFERENCE,
    OPENAI,
    RELAYED,
    Schema,
    add_pydantic_schema,
    model_json_schema,
    ref,
)
from modelyard.graph import GraphSpec


def build_schemas(models: Sequence[str], graphs: Sequence[str]) -> dict[str, Schema]:
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
        OPENAI: {
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
        INFERENCE: {"type": "object", "required": ["error"], "properties": {"error": {"type": "string"}}},
        GRAPH_FAILURE: {
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
                "model": ref("ModelName"),
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
                "model": ref("ModelName"),
                "prompt": _TEXTS,
                **_GENERATION,
            },
        },
        "EmbeddingRequest": {
            "type": "object",
            "required": ["model", "input"],
            "properties": {
                "model": ref("ModelName"),
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
        "ChatCompletion": {"type": "object", "description": RELAYED, "required": ["choices"]},
        "Completion": {"type": "object", "description": RELAYED, "required": ["choices"]},
        "Embeddings": {"type": "object", "description": RELAYED, "required": ["data"]},
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
                            "id": ref("ModelName"),
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
                "inputs": {"type": "array", "items": ref("RequestTensor")},
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
        "InferenceResponse": {"type": "object", "description": RELAYED, "required": ["outputs"]},
        "ModelMetadata": {"type": "object", "description": RELAYED, "required": ["name"]},
        "ModelReady": {"type": "object", "description": RELAYED},
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
        "PredictResponse": {"type": "object", "description": RELAYED, "required": ["predictions"]},
        "KServeModel": {"type": "object", "description": RELAYED},
        # The gateway's own endpoints.
        "Health": {
            "type": "object",
            "required": ["status"],
            "properties": {
                "status": {"const": "ok"},
                "worker": {
                    "type": "integer",
                    "minimum": 0,
                    "description": "with listen.workers > 1: the worker that answered (0 to N-1)",
                },
                "pid": {"type": "integer", "description": "with listen.workers > 1: its process id"},
            },
        },
        "Readiness": {
            "type": "object",
            "required": ["ready", "models_without_healthy_endpoints"],
            "properties": {
                "ready": {"type": "boolean"},
                "models_without_healthy_endpoints": {"type": "array", "items": ref("ModelName")},
            },
        },
        "Strategies": {
            "type": "object",
            "required": ["strategy", "default", "models", "overrides", "available"],
            "properties": {
                "strategy": {
                    "allOf": [ref("StrategyName")],
                    "description": "the strategy every model runs when they all run the same (after a "
                    "switch for every model: that one), else the default (older gateways said `mixed`)",
                },
                "default": {
                    "allOf": [ref("StrategyName")],
                    "description": "what models that appear later (placed by the scheduler) start with: "
                    "the last switch for every model, else placement.models.strategy; without a scheduler, "
                    "until such a switch, the configured models' strategy when they all have the same",
                },
                "models": {"type": "object", "additionalProperties": ref("StrategyName")},
                "overrides": {
                    "type": "object",
                    "additionalProperties": ref("StrategyName"),
                    "description": "the models whose strategy is not the default",
                },
                "available": {"type": "array", "items": ref("StrategyName")},
            },
        },
        "StrategyUpdate": {
            "type": "object",
            "required": ["strategy"],
            "properties": {
                "strategy": ref("StrategyName"),
                "model": {
                    "description": "one model; absent, null or empty: every model, and the default "
                    "of models that appear later",
                    "anyOf": [ref("ModelName"), {"const": ""}, {"type": "null"}],
                },
            },
        },
        "RoutesUpdate": {
            "description": "the model's new routes, all of them, tried in order; JSON or YAML",
            "anyOf": [
                {
                    "type": "object",
                    "required": ["routes"],
                    "properties": {"routes": {"type": "array", "items": ref("RouteConfig")}},
                },
                {"type": "array", "items": ref("RouteConfig")},
            ],
        },
        "Routes": {
            "type": "object",
            "required": ["model", "routes", "subsets"],
            "properties": {
                "model": ref("ModelName"),
                "routes": {"type": "array", "items": ref("RouteConfig")},
                "subsets": {"type": "array", "items": {"type": "string"}},
            },
        },
        "Canary": {
            "type": "object",
            "required": ["model", "mirrors", "routes"],
            "properties": {
                "model": ref("ModelName"),
                "mirrors": {"type": "object", "additionalProperties": ref("MirrorPolicy")},
                "routes": {"type": "object", "additionalProperties": ref("CanarySummary")},
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
        "Overview": {  # gateway.overview
            "type": "object",
            "required": [
                "models",
                "strategies",
                "admin_token_required",
                "graph_views_protected",
                "api_keys",
                "placement",
                "now",
            ],
            "properties": {
                "models": {"type": "array", "items": ref("OverviewModel")},
                "strategies": {"type": "array", "items": ref("StrategyName")},
                "admin_token_required": {"type": "boolean"},
                "graph_views_protected": {"type": "boolean"},
                "api_keys": {
                    "type": "boolean",
                    "description": "auth.enabled: inference calls need an API key; GET /admin/keys and "
                    "/admin/usage answer",
                },
                "placement": {
                    "oneOf": [ref("OverviewPlacement"), {"type": "null"}],
                    "description": "what the scheduler's feed says of the models it places; null "
                    "without placement.scheduler",
                },
                "now": {
                    "type": "number",
                    "description": "the gateway's clock when it answered, in seconds since the epoch, "
                    "as the routing log's `time`",
                },
            },
        },
        "OverviewPlacement": {
            "type": "object",
            "required": ["scheduler", "connected", "synced", "last_error", "models"],
            "properties": {
                "scheduler": {"type": "string"},
                "connected": {"type": "boolean", "description": "the feed is connected now"},
                "synced": {"type": "boolean", "description": "a snapshot has been applied"},
                "last_error": {"type": "string", "description": "why the feed last broke; empty: never"},
                "models": {"type": "array", "items": ref("OverviewPlacedModel")},
            },
        },
        "OverviewPlacedModel": {
            "type": "object",
            "required": [
                "name",
                "version",
                "state",
                "reason",
                "ready_replicas",
                "desired_replicas",
                "routable",
            ],
            "properties": {
                "name": {"type": "string"},
                "version": {"type": "integer", "description": "the latest version"},
                "state": {
                    "type": "string",
                    "description": "the latest version's, e.g. ModelAvailable, ScheduleFailed",
                },
                "reason": {"type": "string", "description": "why, for the failure states; else empty"},
                "ready_replicas": {
                    "type": ["integer", "null"],
                    "description": "replicas traffic may go to; null: the scheduler does not say",
                },
                "desired_replicas": {
                    "type": ["integer", "null"],
                    "description": "ready ones and those loading, failed or not placed; null: the "
                    "scheduler does not say",
                },
                "routable": {"type": "boolean", "description": "false: requests for it get 503"},
            },
        },
        "OverviewModel": {
            "type": "object",
            "required": [
                "name",
                "strategy",
                "ready",
                "routes",
                "panic_subsets",
                "queued",
                "max_pending_requests",
                "active_requests",
                "retries_in_flight",
                "endpoints",
            ],
            "properties": {
                "name": ref("ModelName"),
                "strategy": ref("StrategyName"),
                "ready": {"type": "boolean", "description": "some endpoint passes its health checks"},
                "routes": {"type": "array", "items": {"type": "string"}},
                "panic_subsets": {"type": "array", "items": {"type": "string"}},
                "queued": {"type": "integer", "description": "requests waiting for an endpoint with room"},
                "max_pending_requests": {"type": "integer", "description": "0: no limit"},
                "active_requests": {"type": "integer"},
                "retries_in_flight": {"type": "integer"},
                "endpoints": {"type": "array", "items": ref("OverviewEndpoint")},
            },
        },
        "OverviewEndpoint": {
            "type": "object",
            "required": [
                "name",
                "url",
                "grpc_url",
                "subset",
                "weight",
                "health",
                "in_flight",
                "model_in_flight",
                "outstanding_tokens",
                "ejection",
                "circuit",
                "routable",
            ],
            "properties": {
                "name": {"type": "string"},
                "url": {"type": "string"},
                "grpc_url": {
                    "type": ["string", "null"],
                    "description": "where OIP gRPC calls are relayed as gRPC; null: they go to url as REST",
                },
                "subset": {"type": "string"},
                "weight": {"type": "integer"},
                "health": {
                    "type": "object",
                    "required": ["status", "checked", "last_error"],
                    "properties": {
                        "status": {"enum": ["healthy", "unhealthy"]},
                        "checked": {"type": "boolean", "description": "probed at least once"},
                        "last_error": {"type": "string"},
                    },
                },
                "in_flight": {
                    "type": "integer",
                    "description": "this gateway's requests to its server, for every model it serves there",
                },
                "model_in_flight": {"type": "integer", "description": "this model's requests on it"},
                "outstanding_tokens": {"type": "integer"},
                "ejection": {
                    "type": "object",
                    "required": ["ejected", "seconds_left", "ejections", "consecutive_failures"],
                    "properties": {
                        "ejected": {"type": "boolean"},
                        "seconds_left": {"type": ["number", "null"]},
                        "ejections": {"type": "integer"},
                        "consecutive_failures": {"type": "integer"},
                    },
                },
                "circuit": {
                    "type": "object",
                    "required": ["state", "max_requests"],
                    "properties": {
                        "state": {"enum": ["closed", "open"], "description": "open: max_requests in flight"},
                        "max_requests": {"type": "integer", "description": "0: no limit"},
                    },
                },
                "routable": {"type": "boolean", "description": "healthy and not ejected"},
            },
        },
        "RoutingLog": {
            "type": "object",
            "required": ["records"],
            "properties": {"records": {"type": "array", "items": ref("RoutingRecord")}},
        },
        "RoutingRecord": {  # gateway.routing_log.RoutingRecord
            "type": "object",
            "required": [
                "seq",
                "time",
                "model",
                "route",
                "subset",
                "backend",
                "strategy",
                "status",
                "latency_ms",
                "cache_hit",
                "request_id",
                "worker",
                "refused",
                "fallback_for",
            ],
            "properties": {
                "seq": {"type": "integer", "description": "increases by one per record"},
                "time": {"type": "number", "description": "seconds since the epoch"},
                "model": {"type": "string"},
                "route": {"type": "string"},
                "subset": {"type": "string"},
                "backend": {"type": "string", "description": "the endpoint; empty when none was chosen"},
                "strategy": {"type": "string"},
                "status": {"type": "integer"},
                "latency_ms": {"type": "number"},
                "cache_hit": {
                    "type": ["boolean", "null"],
                    "description": "null: the strategy reports none",
                },
                "request_id": {"type": "string"},
                "worker": {
                    "type": ["integer", "null"],
                    "description": "the worker that answered (--workers); null for one process",
                },
                "refused": {
                    "type": "boolean",
                    "description": "answered before routing (an unknown model, one not placed, a bad "
                    "body): no route, strategy or backend; model is the name asked for, if any",
                },
                "fallback_for": {
                    "type": "string",
                    "description": "the model the request asked for, when model is one of its "
                    "fallbacks; empty otherwise",
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
                "data": {"type": "array", "items": ref("GraphSummary")},
            },
        },
        "Graph": {
            "allOf": [ref("GraphSummary")],
            "required": ["spec"],
            "properties": {"spec": ref("GraphSpec")},
        },
        "GraphUpdate": {
            "description": "a graph spec, or a whole KServe InferenceGraph manifest; JSON or YAML",
            "anyOf": [
                ref("GraphSpec"),
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
                        "spec": ref("GraphSpec"),
                    },
                },
            ],
        },
        "GraphStored": {
            "allOf": [ref("GraphSummary")],
            "required": ["warnings"],
            "properties": {"warnings": {"type": "array", "items": {"type": "string"}}},
        },
        "GraphDeleted": {
            "type": "object",
            "required": ["deleted"],
            "properties": {"deleted": {"type": "string"}},
        },
    }
    add_pydantic_schema(schemas, "RouteConfig", model_json_schema(RouteConfig))
    add_pydantic_schema(schemas, "GraphSpec", model_json_schema(GraphSpec, by_alias=True))
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
