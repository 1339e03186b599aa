"""Admin endpoints: strategies, routes, canaries and graphs, read and changed at runtime; the
overview and the routing log the dashboard shows.

With `admin.token` set, every /admin/* and /strategy call needs `Authorization: Bearer <token>`
(the scheme in any letter case); with `admin.protect_graph_views` too, so do the graph listing
and specs (they name the services behind each step).
A 401 says how to authenticate (`WWW-Authenticate: Bearer`, RFC 6750). Bodies are bounded by
`limits.max_admin_body_bytes`, read as JSON or YAML with bounded nesting, off the event loop.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import re
import time
from typing import Any

import orjson
from aiohttp import web

from modelyard.config import STRATEGY_NAMES
from modelyard.documents import DocumentError, parse_document, parse_documents
from modelyard.errors import BadRequest, Conflict, GraphInvalid, Unauthorized
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.gateway import DEFAULT_STRATEGY_KEY, GATEWAY, Gateway
from modelyard.gateway.inference import json_response, read_limited_body
from modelyard.gateway.overview import overview
from modelyard.gateway.routing_log import RoutingRecord
from modelyard.gateway.runtime_keys import RuntimeKeys, caller_listed, tenant_listed
from modelyard.graph import Graph
from modelyard.protocols.openai import parse_json_object
from modelyard.state.quotas import usage_day

_REALM = 'Bearer realm="modelyard admin"'
HEARTBEAT_SECONDS = 15.0  # a comment on an idle log stream, so that proxies keep it open
# A log stream writes what came in this long after its first record at once: one wakeup and one
# write per batch, not per request, keeps a followed log cheap under load.
BATCH_SECONDS = 0.1
_DAY = re.compile(r"\d{4}-\d{2}-\d{2}")
_MAX_SEQ_DIGITS = 19  # 2**63 - 1 has 19: a seq never gets longer


def check_admin(request: web.Request, *, graph_view: bool = False) -> None:
    """Refuse (401) an admin call without the configured token."""
    admin = request.app[GATEWAY].config.admin
    if admin.token is None or (graph_view and not admin.protect_graph_views):
        return
    scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
    # Header values arrive decoded with surrogateescape: encode them back the same way.
    given_bytes = given.strip().encode("utf-8", "surrogateescape")
    if scheme.lower() == "bearer" and hmac.compare_digest(given_bytes, admin.token.encode()):
        return
    challenge = _REALM if not scheme else _REALM + ', error="invalid_token"'
    raise Unauthorized(
        "admin calls need the header 'Authorization: Bearer <admin.token>'",
        headers={"WWW-Authenticate": challenge},
    )


async def _read_document(request: web.Request, *, many: bool = False) -> Any:
    """The body as JSON or YAML: bounded in size and depth, parsed in a thread so that a large
    YAML body cannot stall the requests the event loop is serving."""
    limit = request.app[GATEWAY].config.limits.max_admin_body_bytes
    body = await read_limited_body(request, limit, "limits.max_admin_body_bytes")
    try:
        return await asyncio.to_thread(parse_documents if many else parse_document, body)
    except DocumentError as exc:
        if many:
            raise GraphInvalid(f"{request.method} {request.path}", [str(exc)]) from None
        raise BadRequest(f"the body must be JSON or YAML: {exc}") from None


# --- strategies --------------------------------------------------------------------------------


def _strategies(gateway: Gateway) -> dict[str, object]:
    """Each model's strategy; the default (what models that appear later start with: the last
    switch for every model, else placement.models.strategy, or without a scheduler the configured
    models' strategy when they agree); the models that run another. `strategy` is what InferFlow's
    clients read: the one every model runs when they agree (as it was before there was a default),
    else the default."""
    per_model = {name: c.balancer.strategy.name for name, c in gateway.clusters.items()}
    running = set(per_model.values())
    default = gateway.default_strategy
    return {
        "strategy": running.pop() if len(running) == 1 else default,
        "default": default,
        "models": per_model,
        "overrides": {name: strategy for name, strategy in per_model.items() if strategy != default},
        "available": list(STRATEGY_NAMES),
    }


async def get_strategy(request: web.Request) -> web.Response:
    check_admin(request)
    return json_response(_strategies(request.app[GATEWAY]))


async def put_strategy(request: web.Request) -> web.Response:
    """Switch strategy for one model ({"model": ...}), or for every model, which also makes it the
    default of models that appear later. Counters and affinity stay."""
    check_admin(request)
    gateway = request.app[GATEWAY]
    limit = gateway.config.limits.max_admin_body_bytes
    data = parse_json_object(await read_limited_body(request, limit, "limits.max_admin_body_bytes"))
    target = data.get("model")
    if target is not None and not isinstance(target, str):
        raise BadRequest("'model' must be a string naming one model")
    name = data.get("strategy")
    if target:
        cluster = gateway.cluster(target)
        gateway.change("strategies", {cluster.name: name}, lambda: gateway.set_strategy(cluster, name))
    else:  # the other workers get each model's switch and the default (no placed models there)
        every = {model: name for model in gateway.clusters} | {DEFAULT_STRATEGY_KEY: name}
        gateway.change("strategies", every, lambda: gateway.switch_every_strategy(name))
    return json_response(_strategies(gateway))


# --- routes and canaries -----------------------------------------------------------------------


def _routes_view(cluster: Cluster) -> dict[str, object]:
    routes = [r.model_dump(mode="json", exclude_defaults=True) for r in cluster.config.routes]
    return {"model": cluster.name, "routes": routes, "subsets": cluster.subset_names}


async def get_routes(request: web.Request) -> web.Response:
    check_admin(request)
    return json_response(_routes_view(request.app[GATEWAY].cluster(request.match_info["model"])))


async def put_routes(request: web.Request) -> web.Response:
    """Replace a model's routes (e.g. move a canary 10 -> 50 -> 100): `{"routes": [...]}` or a
    list, JSON or YAML; validated first (400 with every problem), then swapped atomically."""
    check_admin(request)
    gateway = request.app[GATEWAY]
    cluster = gateway.cluster(request.match_info["model"])
    data = await _read_document(request)
    routes = data.get("routes") if isinstance(data, dict) else data
    gateway.change("routes", {cluster.name: routes}, lambda: cluster.replace_routes(routes))
    return json_response(_routes_view(cluster))


async def get_canary(request: web.Request) -> web.Response:
    """Per route with a mirror: answers compared (mean ROUGE-L, exact-match rate) and each
    subset's p50/p95 latency and error rate."""
    check_admin(request)
    cluster = request.app[GATEWAY].cluster(request.match_info["model"])
    mirrors = {r.name: r.mirror.model_dump() for r in cluster.config.routes if r.mirror is not None}
    return json_response({"model": cluster.name, "mirrors": mirrors, "routes": cluster.canary_summary()})


# --- graphs ------------------------------------------------------------------------------------


def _graph_summary(graph: Graph) -> dict[str, object]:
    nodes = {
        name: {"routerType": node.router_type, "steps": len(node.steps)}
        for name, node in graph.spec.nodes.items()
    }
    return {"name": graph.name, "nodes": nodes, "timeout": graph.spec.timeout}


async def list_graphs(request: web.Request) -> web.Response:
    check_admin(request, graph_view=True)
    graphs = request.app[GATEWAY].graphs.graphs
    return json_response({"object": "list", "data": [_graph_summary(g) for g in graphs.values()]})


async def get_graph(request: web.Request) -> web.Response:
    check_admin(request, graph_view=True)
    graph = request.app[GATEWAY].graphs.get(request.match_info["name"])
    spec = graph.spec.model_dump(mode="json", by_alias=True, exclude_defaults=True)
    return json_response({**_graph_summary(graph), "spec": spec})


async def put_graph(request: web.Request) -> web.Response:
    check_admin(request)
    name = request.match_info["name"]
    documents = await _read_document(request, many=True)
    gateway = request.app[GATEWAY]
    graph, warnings = gateway.change("graphs", {name: documents}, lambda: gateway.graphs.put(name, documents))
    return json_response({**_graph_summary(graph), "warnings": warnings})


async def delete_graph(request: web.Request) -> web.Response:
    check_admin(request)
    name = request.match_info["name"]
    gateway = request.app[GATEWAY]
    gateway.change("graphs", {name: None}, lambda: gateway.graphs.delete(name))
    return json_response({"deleted": name})


# --- API keys and usage (auth.enabled) ----------------------------------------------------------


def _runtime_keys(gateway: Gateway) -> RuntimeKeys:
    admission = gateway.admission
    if admission is None:
        raise Conflict("API keys are off: set auth.enabled (with auth.keys_file)")
    if admission.runtime is None:
        raise Conflict(
            "runtime keys need somewhere to be kept: state.backend redis, or auth.runtime_keys_file"
        )
    return admission.runtime


async def list_keys(request: web.Request) -> web.Response:
    """Every key: the keys file's and those made at runtime (never the keys themselves); and the
    keys file's tenants, with their own limits (a key's `limits` are its own only)."""
    check_admin(request)
    gateway = request.app[GATEWAY]
    if gateway.admission is None:
        raise Conflict("API keys are off: set auth.enabled (with auth.keys_file)")
    if gateway.admission.runtime is not None:
        keys = await gateway.admission.runtime.listed()
    else:
        keys = [caller_listed(c) for c in gateway.admission.keys.table.callers()]
    tenants = [tenant_listed(t) for t in gateway.admission.keys.table.tenants.values()]
    return json_response({"keys": keys, "tenants": sorted(tenants, key=lambda t: str(t["name"]))})


async def create_key(request: web.Request) -> web.Response:
    """Make a key ({name, tenant, models?, priority?, limits?}); the answer holds the key, once."""
    check_admin(request)
    runtime = _runtime_keys(request.app[GATEWAY])
    made = await runtime.create(await _read_document(request))
    return json_response(made, status=201)


async def revoke_key(request: web.Request) -> web.Response:
    check_admin(request)
    name = request.match_info["name"]
    await _runtime_keys(request.app[GATEWAY]).revoke(name)
    return json_response({"revoked": name})


async def get_usage(request: web.Request) -> web.Response:
    """A UTC day's usage (`?day=YYYY-MM-DD`, today by default) by tenant and key: every gateway's
    with Redis, else this worker's."""
    check_admin(request)
    gateway = request.app[GATEWAY]
    if gateway.quotas is None:
        raise Conflict("API keys are off: set auth.enabled (with auth.keys_file)")
    day = request.query.get("day") or usage_day(time.time())
    if not _DAY.fullmatch(day):
        raise BadRequest(f"day: expected YYYY-MM-DD, got {day[:40]!r}")
    rows, shared = await gateway.quotas.usage(day)
    tenants: dict[str, dict[str, Any]] = {}
    for row in rows:
        tenant = tenants.setdefault(
            row.tenant,
            {
                "tenant": row.tenant,
                "requests": 0,
                "tokens": 0,
                "errors": 0,
                "refused": 0,
                "cost": 0.0,
                "keys": [],
            },
        )
        for field in ("requests", "tokens", "errors", "refused", "cost"):
            tenant[field] += getattr(row, field)
        tenant["keys"].append(
            {"key": row.key, "requests": row.requests, "tokens": row.tokens, "errors": row.errors,
             "refused": row.refused, "cost": round(row.cost, 6)}
        )  # fmt: skip
    for tenant in tenants.values():
        tenant["cost"] = round(tenant["cost"], 6)
    if gateway.config.state.backend != "redis":
        scope = "this worker"
    else:
        scope = "every gateway on this Redis" if shared else "this worker (Redis does not answer)"
    return json_response({"day": day, "scope": scope, "tenants": list(tenants.values())})


# --- the overview and the routing log ----------------------------------------------------------


async def get_overview(request: web.Request) -> web.Response:
    """Per model: its strategy, and each endpoint's health, in-flight, ejection and circuit state."""
    check_admin(request)
    return json_response(overview(request.app[GATEWAY], time.monotonic(), time.time()))


async def get_log(request: web.Request) -> web.Response:
    """The routing log's recent records, oldest first."""
    check_admin(request)
    return json_response({"records": request.app[GATEWAY].metrics.routing_log.recent()})


async def stream_log(request: web.Request) -> web.StreamResponse:
    """The routing log as server-sent events, one `data:` record each with its `seq` as the `id:`.
    With `Last-Event-ID: <seq>` the records kept after it come first (0: every record kept); any
    other value is ignored, as a reconnecting EventSource expects. A reader that falls behind gets
    `event: dropped` with how many it lost. Ends when the gateway stops. With
    `admin.max_log_streams` streams open, 503 (TooManyLogStreams)."""
    check_admin(request)
    log = request.app[GATEWAY].metrics.routing_log
    after = _last_seq(request.headers.get("Last-Event-ID", ""))
    # Subscribed and the backlog read with no await between: nothing is missed or sent twice.
    subscription = log.subscribe()  # registers nothing when it raises
    try:
        backlog = log.recent(after) if after is not None else []
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        await response.write(b": modelyard routing log\n\n" + b"".join(map(_event, backlog)))
        ended = False
        while not ended:
            first = await subscription.next(HEARTBEAT_SECONDS)
            if first is None:
                await response.write(b": heartbeat\n\n")
                continue
            if isinstance(first, RoutingRecord):
                await asyncio.sleep(BATCH_SECONDS)
            events = []
            for entry in itertools.chain((first,), subscription.ready()):  # all queued, one write
                if not isinstance(entry, RoutingRecord):  # END: the gateway is stopping
                    ended = True
                    break
                events.append(_event(entry))
            dropped = subscription.take_dropped()
            if dropped:
                events.append(b"event: dropped\ndata: " + orjson.dumps({"dropped": dropped}) + b"\n\n")
            await response.write(b"".join(events))
        await response.write_eof()
    finally:
        log.unsubscribe(subscription)
    return response


def _last_seq(header: str) -> int | None:
    """A `Last-Event-ID` naming a `seq`: plain ASCII decimal digits, no more than a 64-bit count."""
    value = header.strip()
    if 0 < len(value) <= _MAX_SEQ_DIGITS and value.isascii() and value.isdigit():
        return int(value)
    return None


def _event(record: RoutingRecord) -> bytes:
    return b"id: %d\ndata: %s\n\n" % (record.seq, orjson.dumps(record))
