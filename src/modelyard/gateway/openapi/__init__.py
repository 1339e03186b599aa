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
import functools
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import orjson

from modelyard import __version__
from modelyard.gateway.openapi.parts import PARAMETERS
from modelyard.gateway.openapi.paths import Paths
from modelyard.gateway.openapi.schemas import build_schemas

if TYPE_CHECKING:
    from modelyard.gateway.route_table import Route

__all__ = ["encoded_document", "openapi_document"]


def openapi_document(
    routes: Iterable[Route],
    models: Sequence[str],
    graphs: Sequence[str],
    *,
    admin_token: bool = False,
    graph_views_protected: bool = False,
    api_keys: bool = False,
) -> dict[str, Any]:
    """The document of `routes` (route_table.ROUTES) for a gateway serving `models` and `graphs`;
    with `admin_token`, the admin calls require a bearer token (and may answer 401); with
    `api_keys` (auth.enabled), the inference calls an API key (401, and 403 for a model not
    allowed)."""
    schemas = build_schemas(models, graphs)
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
            {"name": name}
            for name in ("OpenAI", "OIP v2", "KServe v1", "Graphs", "Admin", "Dashboard", "Operations")
        ],
        "paths": Paths(models, admin_token, graph_views_protected, api_keys).build(routes),
        "components": {"schemas": schemas, "parameters": PARAMETERS},
    }
    schemes: dict[str, Any] = {}
    if admin_token:
        schemes["adminToken"] = {"type": "http", "scheme": "bearer", "description": "`admin.token`"}
    if api_keys:
        schemes["apiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "an API key of `auth.keys_file`",
        }
        schemes["azureApiKey"] = {"type": "apiKey", "in": "header", "name": "api-key"}
    if schemes:
        document["components"]["securitySchemes"] = schemes
    return copy.deepcopy(document)  # it shares this module's fragments; the caller's to change


@functools.lru_cache(maxsize=8)
def encoded_document(
    routes: tuple[Route, ...],
    models: tuple[str, ...],
    graphs: tuple[str, ...],
    *,
    admin_token: bool,
    graph_views_protected: bool,
    api_keys: bool = False,
) -> bytes:
    """`openapi_document` as JSON, kept: a gateway's models change only through the scheduler's
    feed and its graphs only through /admin, so the same document is asked for again and again."""
    document = openapi_document(
        routes,
        models,
        graphs,
        admin_token=admin_token,
        graph_views_protected=graph_views_protected,
        api_keys=api_keys,
    )
    return orjson.dumps(document)
