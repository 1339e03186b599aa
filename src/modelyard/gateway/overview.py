"""`GET /admin/overview`: each model's strategy and endpoints as the dashboard shows them, as each
cluster describes itself (`Cluster.describe`), read between two awaits (a consistent snapshot on
one event loop). With workers, a model's queued, active and retrying requests, and its requests on
each endpoint, are summed over them (gateway/siblings.py).

`now` is the gateway's clock (epoch seconds), which the routing log's `time` is read from: the
dashboard takes its own clock's offset from it, never from the records' times (replayed ones may be
minutes old).

`placement` (null without `placement.scheduler`) is what the scheduler's feed last said of each
model it places, routable or not: a model that cannot be placed has no cluster, so it is only there.
"""

from __future__ import annotations

from typing import Any

from modelyard.config import STRATEGY_NAMES
from modelyard.gateway.gateway import Gateway


def overview(gateway: Gateway, now: float, epoch: float) -> dict[str, Any]:
    """`now` is monotonic time (ejections end at a monotonic instant), `epoch` the wall clock's
    (time.time()). Never names the token."""
    admin = gateway.config.admin
    models = [cluster.describe(now) for cluster in gateway.clusters.values()]
    if gateway.siblings is not None:  # the requests of every worker, as one gateway has them
        for cluster, described in zip(gateway.clusters.values(), models, strict=True):
            described.update(gateway.siblings.model_totals(cluster) or {})
            on_endpoint = gateway.siblings.endpoint_totals(cluster)
            for endpoint in described["endpoints"]:
                endpoint["model_in_flight"] = on_endpoint.get(endpoint["name"], endpoint["model_in_flight"])
    return {
        "models": models,
        "strategies": list(STRATEGY_NAMES),
        "admin_token_required": admin.token is not None,
        "graph_views_protected": admin.token is not None and admin.protect_graph_views,
        "api_keys": gateway.config.auth.enabled,  # the tenants panel: GET /admin/keys and /admin/usage
        "placement": _placement(gateway),
        "now": epoch,
    }


def _placement(gateway: Gateway) -> dict[str, Any] | None:
    follower = gateway.follower
    if follower is None:
        return None
    models = []
    for name, model in sorted(gateway.placed.models.items()):
        ready, unready = model.available_replicas, model.unavailable_replicas
        models.append(
            {
                "name": name,
                "version": model.version,
                "state": model.state,
                "reason": model.reason,
                # As `modelyard model list` counts them; None from a scheduler that does not say.
                "ready_replicas": ready,
                "desired_replicas": None if ready is None or unready is None else ready + unready,
                "routable": name in gateway.clusters,  # it has endpoints: requests go to them
            }
        )
    return {
        "scheduler": gateway.config.placement.scheduler,
        "connected": follower.connected,
        "synced": follower.synced,
        "last_error": follower.last_error,
        "models": models,
    }
