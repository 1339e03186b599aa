"""`GET /admin/overview`: each model's strategy and endpoints as the dashboard shows them, as each
cluster describes itself (`Cluster.describe`), read between two awaits (a consistent snapshot on
one event loop). With workers, a model's queued, active and retrying requests are summed over
them (gateway/siblings.py)."""

from __future__ import annotations

from typing import Any

from modelyard.config import STRATEGY_NAMES
from modelyard.gateway.gateway import Gateway


def overview(gateway: Gateway, now: float) -> dict[str, Any]:
    """`now` is monotonic time (ejections end at a monotonic instant). Never names the token."""
    admin = gateway.config.admin
    models = [cluster.describe(now) for cluster in gateway.clusters.values()]
    if gateway.siblings is not None:  # the requests of every worker, as one gateway has them
        for cluster, described in zip(gateway.clusters.values(), models, strict=True):
            described.update(gateway.siblings.model_totals(cluster) or {})
    return {
        "models": models,
        "strategies": list(STRATEGY_NAMES),
        "admin_token_required": admin.token is not None,
        "graph_views_protected": admin.token is not None and admin.protect_graph_views,
    }
