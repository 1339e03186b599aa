"""The gateway's routes, once: `create_app` registers every one with aiohttp, the lean HTTP/1.1
connection serves those marked `lean` (`lean_matcher`), and `GET /openapi.json` documents every one
(each by its key in openapi/paths.py). The order is the document's; no two routes' paths overlap,
so it is not an order of precedence.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

from aiohttp import web

from modelyard.gateway import admin, inference, openapi
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.inference import ProxiedRoute
from modelyard.gateway.ui import dashboard_handlers

WebHandler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@dataclass(frozen=True, slots=True)
class Route:
    method: str
    path: str  # aiohttp's pattern: `{name}` one segment, `{name:regex}` one matching the regex
    # A lean route's is a ProxiedRoute, which both connections run (inference.aiohttp_view and
    # inference.lean_handler); another's an aiohttp handler.
    handler: ProxiedRoute | WebHandler
    operation: str  # the key of its description in openapi/paths.py: the document's operationId
    lean: bool = False  # also served by the lean connection (serving/h1.py)


async def openapi_json(request: web.Request) -> web.Response:
    """This table as an OpenAPI document, for the gateway's models and graphs now."""
    gateway = request.app[GATEWAY]
    admin_config = gateway.config.admin
    body = openapi.encoded_document(
        ROUTES,
        tuple(gateway.clusters),
        tuple(sorted(gateway.graphs.graphs)),
        admin_token=admin_config.token is not None,
        graph_views_protected=admin_config.protect_graph_views,
        api_keys=gateway.config.auth.enabled,
    )
    return web.Response(body=body, content_type="application/json")


_dashboard, _dashboard_asset, _to_dashboard = dashboard_handlers()  # (its files are read here, once)

ROUTES: tuple[Route, ...] = (
    Route("POST", "/v1/chat/completions", inference.openai_route("chat"), "chatCompletions", lean=True),
    Route("POST", "/v1/completions", inference.openai_route("completions"), "completions", lean=True),
    Route("POST", "/v1/embeddings", inference.openai_route("embeddings"), "embeddings", lean=True),
    Route("GET", "/v1/models", inference.list_models, "listModels"),
    Route("POST", "/v1/models/{name}:predict", inference.oip_infer, "kservePredict", lean=True),
    # (not a name ending in :predict: that path is POST only, so GET is a 405)
    Route("GET", "/v1/models/{name:[^/]+(?<!:predict)}", inference.model_get, "kserveModel", lean=True),
    Route("GET", "/v2", inference.oip_server_metadata, "oipServer"),
    Route("GET", "/v2/health/live", inference.oip_live, "oipLive"),
    Route("GET", "/v2/health/ready", inference.oip_ready, "oipReady"),
    Route("GET", "/v2/models/{name}", inference.model_get, "oipModelMetadata", lean=True),
    Route("GET", "/v2/models/{name}/ready", inference.model_get, "oipModelReady", lean=True),
    Route("POST", "/v2/models/{name}/infer", inference.oip_infer, "oipModelInfer", lean=True),
    Route(
        "GET",
        "/v2/models/{name}/versions/{version}",
        inference.model_get,
        "oipModelVersionMetadata",
        lean=True,
    ),
    Route(
        "GET",
        "/v2/models/{name}/versions/{version}/ready",
        inference.model_get,
        "oipModelVersionReady",
        lean=True,
    ),
    Route(
        "POST",
        "/v2/models/{name}/versions/{version}/infer",
        inference.oip_infer,
        "oipModelVersionInfer",
        lean=True,
    ),
    Route("GET", "/v1/graphs", admin.list_graphs, "listGraphs"),
    Route("GET", "/v1/graphs/{name}", admin.get_graph, "getGraph"),
    Route("POST", "/v1/graphs/{name}", inference.run_graph, "runGraph"),
    Route("PUT", "/admin/graphs/{name}", admin.put_graph, "putGraph"),
    Route("DELETE", "/admin/graphs/{name}", admin.delete_graph, "deleteGraph"),
    Route("GET", "/admin/models/{model}/routes", admin.get_routes, "getRoutes"),
    Route("PUT", "/admin/models/{model}/routes", admin.put_routes, "putRoutes"),
    Route("GET", "/admin/models/{model}/canary", admin.get_canary, "getCanary"),
    Route("GET", "/admin/keys", admin.list_keys, "listKeys"),
    Route("POST", "/admin/keys", admin.create_key, "createKey"),
    Route("DELETE", "/admin/keys/{name}", admin.revoke_key, "revokeKey"),
    Route("GET", "/admin/usage", admin.get_usage, "getUsage"),
    Route("GET", "/admin/overview", admin.get_overview, "getOverview"),
    Route("GET", "/admin/log", admin.get_log, "getRoutingLog"),
    Route("GET", "/admin/log/stream", admin.stream_log, "streamRoutingLog"),
    Route("GET", "/admin/strategy", admin.get_strategy, "getStrategy"),
    Route("PUT", "/admin/strategy", admin.put_strategy, "putStrategy"),
    Route("GET", "/strategy", admin.get_strategy, "getStrategyInferFlow"),  # InferFlow's path
    Route("PUT", "/strategy", admin.put_strategy, "putStrategyInferFlow"),
    Route("GET", "/dashboard", _dashboard, "dashboard"),
    Route("GET", "/dashboard/", _to_dashboard, "dashboardSlash"),  # the address as people type it
    Route("GET", "/dashboard/{asset}", _dashboard_asset, "dashboardAsset"),
    Route("GET", "/healthz", inference.healthz, "healthz"),
    Route("GET", "/readyz", inference.readyz, "readyz"),
    Route("GET", "/metrics", inference.metrics, "metrics"),
    Route("GET", "/openapi.json", openapi_json, "openapi"),
)

# --- the lean connection's matcher ----------------------------------------------------------------

H = TypeVar("H")
LeanMatcher = Callable[[str, str], tuple[H, dict[str, str]] | None]

_KSERVE_PREDICT = "/v1/models/{name}:predict"
_KSERVE_MODEL = "/v1/models/{name:[^/]+(?<!:predict)}"
_OIP_MODEL = "/v2/models/{name}"
_OIP_VERSION = "/v2/models/{name}/versions/{version}"


def lean_matcher(handlers: Mapping[tuple[str, str], H]) -> LeanMatcher[H]:
    """(method, path) -> the handler of the route that aiohttp would match, and the path's
    parameters; None for any other. `handlers`: by the lean routes' (method, pattern).

    The lean routes are the hot path, so this is no generic matcher: a fixed path is one lookup,
    and a model's path is split once and compared, as aiohttp's regular expressions for the
    patterns below decide (tests/unit/gateway/test_route_table.py holds it to aiohttp's answers).
    A pattern of another shape is refused here, when the gateway starts."""
    none: dict[str, str] = {}
    fixed: dict[str, dict[str, H]] = {}  # by path, then method
    kserve_predict: dict[str, H] = {}  # by method
    kserve_model: dict[str, H] = {}
    oip_model: dict[str, H] = {}
    oip_version: dict[str, H] = {}
    oip_model_tail: dict[tuple[str, str], H] = {}  # by method and the literal segment after
    oip_version_tail: dict[tuple[str, str], H] = {}
    for (method, pattern), handler in handlers.items():
        if "{" not in pattern:
            fixed.setdefault(pattern, {})[method] = handler
        elif pattern == _KSERVE_PREDICT:
            kserve_predict[method] = handler
        elif pattern == _KSERVE_MODEL:
            kserve_model[method] = handler
        elif pattern == _OIP_MODEL:
            oip_model[method] = handler
        elif pattern == _OIP_VERSION:
            oip_version[method] = handler
        elif _is_segment(tail := pattern.removeprefix(_OIP_VERSION + "/")) and tail != pattern:
            oip_version_tail[method, tail] = handler
        elif _is_segment(tail := pattern.removeprefix(_OIP_MODEL + "/")) and tail != pattern:
            oip_model_tail[method, tail] = handler
        else:
            raise ValueError(f"the lean connection has no matcher for {method} {pattern} (route_table.py)")

    def match(method: str, path: str) -> tuple[H, dict[str, str]] | None:
        at = fixed.get(path)
        if at is not None:
            handler = at.get(method)
            return None if handler is None else (handler, none)
        parts = path.split("/")  # "", "v1", "models", name or "", "v2", "models", name, ...
        if len(parts) < 4 or parts[2] != "models" or not parts[3]:
            return None
        name = parts[3]
        if parts[1] == "v1" and len(parts) == 4:
            if name.endswith(":predict"):
                handler = kserve_predict.get(method)
                if handler is None or name == ":predict":
                    return None
                return handler, {"name": name[:-8]}  # (8: len(":predict"))
            handler = kserve_model.get(method)
            return None if handler is None else (handler, {"name": name})
        if parts[1] != "v2":
            return None
        n = len(parts)
        if n == 5:
            handler = oip_model_tail.get((method, parts[4]))
        elif n == 4:
            handler = oip_model.get(method)
        elif parts[4] != "versions" or not parts[5] or n > 7:
            return None
        elif n == 7:
            handler = oip_version_tail.get((method, parts[6]))
        else:
            handler = oip_version.get(method)
        if handler is None:
            return None
        return handler, ({"name": name} if n < 6 else {"name": name, "version": parts[5]})

    return match


def _is_segment(text: str) -> bool:
    """Whether `text` is one literal path segment (no parameter in it)."""
    return bool(text) and "/" not in text and "{" not in text
