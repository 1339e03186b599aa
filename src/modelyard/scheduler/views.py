"""Models and servers as the REST API returns them (docs/placement.md)."""

from __future__ import annotations

from typing import Any

from modelyard.placement import LIVE, ReplicaState
from modelyard.placement.manifest import spec_to_plain
from modelyard.scheduler.records import Model, Server, Version
from modelyard.scheduler.state import SchedulerState
from modelyard.upstream.download import redact

_RESERVING = frozenset({ReplicaState.LOAD_REQUESTED, ReplicaState.LOADING})


def model_view(model: Model) -> dict[str, Any]:
    latest = model.latest
    return {
        "name": model.name,
        "deleted": model.deleted,
        "version": latest.version,
        "server": latest.server,
        "state": latest.status.state.value,
        "reason": latest.status.reason,
        "available_replicas": latest.status.available,
        "unavailable_replicas": latest.status.unavailable,
        # A presigned URL's query is a credential: the agent gets it whole, views never do.
        "spec": {**spec_to_plain(model.spec), "storage_uri": redact(model.spec.storage_uri)},
        "versions": [_version_view(v) for v in model.versions],
    }


def _version_view(version: Version) -> dict[str, Any]:
    return {
        "version": version.version,
        "server": version.server,
        "state": version.status.state.value,
        "reason": version.status.reason,
        "available_replicas": version.status.available,
        "unavailable_replicas": version.status.unavailable,
        "timestamp": version.status.timestamp,
        "replicas": {
            str(index): {"state": s.state.value, "reason": s.reason, "timestamp": s.timestamp}
            for index, s in sorted(version.replicas.items())
        },
    }


def servers_view(state: SchedulerState) -> list[dict[str, Any]]:
    reserved = {
        (view.name, replica.index): replica.reserved_memory
        for view in state.server_views()
        for replica in view.replicas
    }
    loaded: dict[tuple[str, int], set[str]] = {}
    for model in state.models.values():
        for version in model.versions:
            for index, status in version.replicas.items():
                if version.server is not None and status.state in LIVE:
                    loaded.setdefault((version.server, index), set()).add(model.name)
    return [_server_view(server, reserved, loaded) for _, server in sorted(state.servers.items())]


def _server_view(
    server: Server, reserved: dict[tuple[str, int], int], loaded: dict[tuple[str, int], set[str]]
) -> dict[str, Any]:
    return {
        "name": server.name,
        "shared": server.shared,
        "replicas": [
            {
                "index": r.index,
                "inference_url": r.inference_url,
                "capabilities": list(r.capabilities),
                "total_memory": r.memory,
                "available_memory": r.available_memory,
                "reserved_memory": reserved.get(r.key, 0),
                "over_commit_percentage": r.over_commit_percentage,
                "draining": r.draining,
                "connected": r.connected,
                "loaded_models": sorted(loaded.get(r.key, ())),
            }
            for _, r in sorted(server.replicas.items())
        ],
    }
