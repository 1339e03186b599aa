"""`GET /admin/overview`: each model's strategy and endpoints as the dashboard shows them, as each
cluster describes itself (`Cluster.describe`), read between two awaits (a consistent snapshot on
one event loop)."""

from __future__ import annotations

from typing import Any

from modelyard.config import STRATEGY_NAMES
from modelyard.gateway.gateway import Gateway


def overview(gateway: Gateway, now: float) -> dict[str, Any]:
    """`now` is monotonic time (ejections end at a monotonic instant). Never names the token."""
    admin = gateway.config.admin
    return {
        "models": [cluster.describe(now) for cluster in gateway.clusters.values()],
        "strategies": list(STRATEGY_NAMES),
        "admin_token_required": admin.token is not None,
        "graph_views_protected": admin.token is not None and admin.protect_graph_views,
    }
