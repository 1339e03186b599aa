"""One route table: aiohttp serves every route, the lean connection those marked lean (resolving as
aiohttp does), and the OpenAPI document describes every one."""

from __future__ import annotations

import itertools
import re

import pytest
from aiohttp.test_utils import make_mocked_request

from modelyard.config import GatewayConfig
from modelyard.gateway.app import create_app, lean_router
from modelyard.gateway.gateway import GATEWAY
from modelyard.gateway.openapi import openapi_document
from modelyard.gateway.openapi.paths import Paths, documented_path
from modelyard.gateway.route_table import ROUTES, Route, lean_matcher

BY_OPERATION = {(route.method, documented_path(route.path)): route for route in ROUTES}
LEAN = {(route.method, route.path): route for route in ROUTES if route.lean}
METHODS = sorted({route.method for route in ROUTES} | {"PATCH"})  # (PATCH: as any other)
PARAMETER = re.compile(r"\{[^}:]+(?::[^}]*)?\}")  # (no regex of the table's holds a brace)
# Values for a path's parameters, chosen to look like the literal segments around them.
VALUES = ["m", "m:predict", ":predict", "versions", "ready", "infer"]


def concrete_paths() -> list[str]:
    """Every route's path with its parameters filled in, and near misses of each."""
    paths: set[str] = set()
    for route in ROUTES:
        literals = PARAMETER.split(route.path)
        for values in itertools.product(VALUES, repeat=len(literals) - 1):
            path = "".join(itertools.chain.from_iterable(zip(literals, [*values, ""], strict=True)))
            trimmed = path.rsplit("/", 1)[0] or "/"
            paths |= {path, path + "/", path + "/x", path + ":predict", trimmed, trimmed + "/"}
            segments = path.split("/")
            paths |= {"/".join([*segments[:i], "", *segments[i + 1 :]]) for i in range(2, len(segments))}
            paths |= {
                path.replace("/v1/", "/v2/"),
                path.replace("/v2/", "/v1/"),
                path.replace("/v2/", "/v3/"),
            }
    return sorted(paths)


async def aiohttp_routes(app, method: str, path: str) -> tuple[Route, dict[str, str]] | None:
    """The table's route that aiohttp's router resolves (method, path) to, and its match_info."""
    match = await app.router.resolve(make_mocked_request(method, path, app=app))
    if match.http_exception is not None:
        return None
    return BY_OPERATION[match.route.method, match.route.resource.canonical], dict(match)


def test_every_route_has_a_description_and_every_description_a_route() -> None:
    described = set(Paths(["m"], admin_token=True, graph_views_protected=True).descriptions())
    keys = [route.operation for route in ROUTES]
    assert len(keys) == len(set(keys)), "two routes share an OpenAPI description"
    assert len(BY_OPERATION) == len(ROUTES), "two routes share a method and path"
    assert set(keys) - described == set(), "routes without a description in openapi/paths.py"
    assert described - set(keys) == set(), "openapi/paths.py describes routes not in the table"


def test_the_document_lists_every_route_of_the_table_under_its_description() -> None:
    document = openapi_document(ROUTES, ["m"], ["g"], admin_token=True)
    documented = {
        (method.upper(), path): operation["operationId"]
        for path, item in document["paths"].items()
        for method, operation in item.items()
        if method != "parameters"
    }
    assert documented == {key: route.operation for key, route in BY_OPERATION.items()}


async def test_the_lean_router_resolves_as_aiohttp_does_and_leaves_it_the_rest() -> None:
    config = GatewayConfig.model_validate(
        {"models": [{"name": "m", "endpoints": [{"url": "http://127.0.0.1:1"}]}]}
    )
    app = create_app(config)
    app.router.freeze()
    matcher = lean_matcher(LEAN)  # the lean router's matching, answering with the table's routes
    reached: set[Route] = set()
    for method, path in itertools.product(METHODS, concrete_paths()):
        resolved = await aiohttp_routes(app, method, path)
        expected = resolved if resolved is not None and resolved[0].lean else None
        assert matcher(method, path) == expected, (method, path)
        if resolved is not None:
            reached.add(resolved[0])
    assert reached == set(ROUTES), "no concrete path reaches these routes: add values"
    # The gateway's own: the same matching, with the lean connection's handlers.
    routed = lean_router(app[GATEWAY])("POST", "/v2/models/m/versions/3/infer")
    assert routed is not None and routed[1] == {"name": "m", "version": "3"}
    assert lean_router(app[GATEWAY])("GET", "/healthz") is None


@pytest.mark.xfail(strict=True, reason="aiohttp's {name} matches no brace; the lean matcher does")
async def test_a_name_with_a_brace_is_routed_as_aiohttp_routes_it() -> None:
    app = create_app(GatewayConfig())
    app.router.freeze()
    for method, path in (("POST", "/v2/models/a{b}/infer"), ("POST", "/v1/models/a{b}:predict")):
        assert await aiohttp_routes(app, method, path) is None
        assert lean_matcher(LEAN)(method, path) is None


@pytest.mark.parametrize("pattern", ["/v3/models/{name}", "/v2/models/{name}/a/b", "/v2/models/{name}/{x}"])
def test_a_lean_route_the_matcher_has_no_shape_for_is_refused_at_start(pattern: str) -> None:
    with pytest.raises(ValueError, match="no matcher"):
        lean_matcher({("GET", pattern): "handler"})
