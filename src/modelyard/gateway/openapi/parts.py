"""The pieces the OpenAPI document is built from: media types, envelope names, references,
response and header objects, parameters."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from modelyard.gateway.ui import ASSETS

Schema = dict[str, Any]

JSON = "application/json"
YAML = "application/yaml"
SSE = "text/event-stream"
HTML = "text/html"
OPENAI = "OpenAIError"  # {"error": {"message", "type", "param", "code"}}: OpenAI paths, the gateway's own
INFERENCE = "InferenceError"  # {"error": "<message>"}: OIP v2 and KServe v1 paths
GRAPH_FAILURE = "GraphFailure"

RELAYED = "the inference server's answer, relayed as it is (`X-Modelyard-Backend` names the server)"
STEP = "a graph step's answer, relayed as it is"


# --- building blocks ---------------------------------------------------------------------------


def ref(name: str) -> Schema:
    return {"$ref": f"#/components/schemas/{name}"}


def param(name: str) -> Schema:
    return {"$ref": f"#/components/parameters/{name}"}


def string_header(description: str, *, required: bool = False) -> Schema:
    return {"description": description, "required": required, "schema": {"type": "string"}}


def relay_headers(*, required: bool) -> Schema:
    return {
        "X-Modelyard-Backend": string_header("the endpoint that answered", required=required),
        "X-Modelyard-Strategy": string_header("the strategy that picked it", required=required),
        "X-Modelyard-Route": string_header("the route taken (`default` without routes)", required=required),
        "X-Modelyard-Subset": string_header("the subset it went to (`*`: every endpoint)", required=required),
        "X-Request-Id": string_header("the client's, or a new one, also sent upstream", required=required),
        "X-Modelyard-Fallback": string_header(
            "the model that answered, when it was one of the asked model's `fallbacks`"
        ),
        "X-Modelyard-Cache-Hit": {
            "description": "`kv_aware` only: whether the prompt prefix had an affinity",
            "schema": {"type": "string", "enum": ["true", "false"]},
        },
    }


RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again (always on the gateway's own answer)",
        "schema": {"type": "string"},
    }
}
ALLOW = {"Allow": string_header("the methods the path allows", required=True)}


def answer(description: str, schema: Schema | None = None, *media: str, **extra: Any) -> Schema:
    """A response object; `schema` for each of `media` (application/json by default)."""
    response: Schema = {"description": description, **extra}
    if schema is not None:
        response["content"] = {m: {"schema": schema} for m in media or (JSON,)}
    return response


def error_response(envelope: str, description: str, **extra: Any) -> Schema:
    return answer(description, ref(envelope), **extra)


def unauthorized() -> Schema:
    challenge = string_header(
        '`Bearer realm=...`, with `error="invalid_token"` for a wrong one', required=True
    )
    return error_response(
        OPENAI, "the bearer token is missing or wrong", headers={"WWW-Authenticate": challenge}
    )


FORWARDED = ("/v1/models/", "/v2/models/")  # paths sent upstream as the client wrote them
METHODS = frozenset({"get", "put", "post", "delete", "options", "head", "patch", "trace"})
UNSAFE_SEGMENT = (
    "a path segment decodes to `.` or `..` or holds a slash (it would escape the routed resource)"
)


def json_body(schema: Schema, example: Any = None, *, media: Sequence[str] = (JSON,)) -> Schema:
    content: Schema = {}
    for m in media:
        content[m] = {"schema": schema}
        if example is not None:
            content[m]["example"] = example
    return {"required": True, "content": content}


def add_pydantic_schema(schemas: dict[str, Schema], name: str, schema: Schema) -> None:
    """Add a pydantic JSON schema (refs already pointing at components) and its definitions."""
    for def_name, definition in schema.pop("$defs", {}).items():
        assert def_name not in schemas, f"two schemas named {def_name}"
        schemas[def_name] = definition
    schemas[name] = schema


def model_json_schema(model: type[BaseModel], *, by_alias: bool = False) -> Schema:
    return model.model_json_schema(by_alias=by_alias, ref_template="#/components/schemas/{model}")


PARAMETERS: dict[str, Schema] = {
    "ModelName": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "a model of this gateway",
        "schema": ref("ModelName"),
    },
    "AdminModelName": {
        "name": "model",
        "in": "path",
        "required": True,
        "description": "a model of this gateway",
        "schema": ref("ModelName"),
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
        "schema": ref("GraphName"),
    },
    "NewGraphName": {
        "name": "name",
        "in": "path",
        "required": True,
        "description": "the graph to add or replace (a Kubernetes name, as KServe requires)",
        "schema": {"type": "string", "pattern": "^[a-z]([-a-z0-9]*[a-z0-9])?$"},
    },
    "LastEventId": {
        "name": "Last-Event-ID",
        "in": "header",
        "required": False,
        "description": "the `seq` of the last record seen: the kept records after it come first (0: all); "
        "any other value is ignored",
        "schema": {"type": "string", "pattern": "^[0-9]+$"},
    },
    "DashboardAsset": {
        "name": "asset",
        "in": "path",
        "required": True,
        "description": "one of the dashboard's files",
        "schema": {"type": "string", "enum": list(ASSETS)},
    },
    "RequestId": {
        "name": "X-Request-Id",
        "in": "header",
        "required": False,
        "description": "kept, sent upstream and echoed; the gateway makes one when absent",
        "schema": {"type": "string"},
    },
}
