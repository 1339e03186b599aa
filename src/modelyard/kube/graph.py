"""`modelyard graph deploy`: an InferenceGraph as KServe's raw deployment mode deploys it.

KServe's controller turns an InferenceGraph into a Deployment running its router image with
`--graph-json <spec>`, a Service (port 80 to the router's 8080) and a HorizontalPodAutoscaler.
These are the same objects, named, labelled and probed as KServe makes them, with the router
container running `modelyard graph serve`; a KServe user keeps their InferenceGraph manifest.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from typing import Any

from modelyard.errors import ConfigError

ROUTER_PORT = 8080  # KServe's router listens here; its Service maps port 80 to it
GRAPH_LABEL = "serving.kserve.io/inferencegraph"
# KServe's defaults for the router container (inferenceservice-config, key "router"), used when
# the graph's spec gives no resources.
DEFAULT_RESOURCES = {"requests": {"cpu": "100m", "memory": "100Mi"}, "limits": {"cpu": "1", "memory": "1Gi"}}
DEFAULT_SCALE_TARGET = 80  # percent; KServe's default for the raw-mode HPA
_SCALE_METRICS = ("cpu", "memory")  # what raw deployment mode's HPA scales on
_POD_FIELDS = ("affinity", "nodeSelector", "nodeName", "tolerations", "serviceAccountName")


def graph_manifests(
    name: str,
    spec: Mapping[str, Any],
    metadata: Mapping[str, Any],
    *,
    image: str,
    namespace: str | None = None,
    propagate_headers: list[str] | None = None,
    otlp_endpoint: str | None = None,
    source: str = "<graph>",
) -> list[dict[str, Any]]:
    """Deployment, Service and HPA for one validated graph; `metadata` is the manifest's own
    (namespace, labels and annotations carry over, as KServe's controller does)."""
    namespace = namespace or str(metadata.get("namespace") or "default")
    labels = {**_strings(metadata.get("labels")), GRAPH_LABEL: name}
    annotations = _strings(metadata.get("annotations"))
    app = {"app": f"isvc.{name}"}  # KServe's raw-mode selector label
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if annotations:
        meta["annotations"] = annotations
    container: dict[str, Any] = {
        "name": name,
        "image": image,
        "command": ["modelyard", "graph", "serve"],
        "args": ["--graph-json", json.dumps(spec, separators=(",", ":"))],
        "ports": [{"name": "http", "containerPort": ROUTER_PORT, "protocol": "TCP"}],
        "readinessProbe": {  # KServe's router probe
            "httpGet": {"path": "/readyz", "port": ROUTER_PORT, "scheme": "HTTP"},
            "initialDelaySeconds": 5,
            "timeoutSeconds": 2,
            "periodSeconds": 5,
            "successThreshold": 1,
            "failureThreshold": 3,
        },
        "livenessProbe": {
            "tcpSocket": {"port": ROUTER_PORT},
            "periodSeconds": 10,
            "timeoutSeconds": 2,
        },
        "resources": _resources(spec) or DEFAULT_RESOURCES,
        "securityContext": {
            "privileged": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "allowPrivilegeEscalation": False,
            "capabilities": {"drop": ["ALL"]},
        },
    }
    env = []
    if propagate_headers:
        env.append({"name": "PROPAGATE_HEADERS", "value": ",".join(propagate_headers)})
    if otlp_endpoint:  # graph serve traces there (the standard variable; --otlp-endpoint reads it)
        env.append({"name": "OTEL_EXPORTER_OTLP_ENDPOINT", "value": otlp_endpoint})
    if env:
        container["env"] = env
    pod_spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # the router never calls the Kubernetes API
        "securityContext": {"seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [container],
    }
    for field in _POD_FIELDS:  # what KServe copies from the graph's spec into the pod
        if spec.get(field):
            pod_spec[field] = copy.deepcopy(spec[field])
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "selector": {"matchLabels": app},
            "strategy": {
                "type": "RollingUpdate",
                "rollingUpdate": {"maxUnavailable": "25%", "maxSurge": "25%"},
            },
            "template": {"metadata": {"labels": {**labels, **app}}, "spec": pod_spec},
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "selector": dict(app),
            "ports": [{"name": name, "port": 80, "targetPort": ROUTER_PORT, "protocol": "TCP"}],
        },
    }
    return [deployment, service, _autoscaler(name, spec, meta, source)]


def _autoscaler(name: str, spec: Mapping[str, Any], meta: dict[str, Any], source: str) -> dict[str, Any]:
    metric = str(spec.get("scaleMetric") or "cpu")
    if metric not in _SCALE_METRICS:
        raise ConfigError(
            source,
            [f"graph {name!r}: spec.scaleMetric: raw deployment scales on cpu or memory, got {metric!r}"],
        )
    least = max(1, int(spec.get("minReplicas") or 1))  # raw mode has no scale to zero: KServe uses 1
    most = max(least, int(spec.get("maxReplicas") or 0))
    target = int(spec.get("scaleTarget") or DEFAULT_SCALE_TARGET)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": copy.deepcopy(meta),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": least,
            "maxReplicas": most,
            "metrics": [
                {
                    "type": "Resource",
                    "resource": {
                        "name": metric,
                        "target": {"type": "Utilization", "averageUtilization": target},
                    },
                }
            ],
        },
    }


def _resources(spec: Mapping[str, Any]) -> dict[str, Any]:
    given = spec.get("resources")
    if not isinstance(given, Mapping):
        return {}
    return {kind: dict(given[kind]) for kind in ("requests", "limits") if given.get(kind)}


def _strings(mapping: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in mapping.items()} if isinstance(mapping, Mapping) else {}


def resolve_services(
    spec: Mapping[str, Any], namespace: str, services: Mapping[str, str], protocol: str = "v1"
) -> tuple[dict[str, Any], list[str]]:
    """The spec with each step's `serviceName` given a `serviceUrl`, as KServe's controller does
    before it starts the router: from `services` (NAME -> URL), else the InferenceService's
    raw-mode predictor address in the graph's namespace. Returns the spec and the names guessed."""
    resolved = copy.deepcopy(dict(spec))
    guessed: set[str] = set()
    nodes = resolved.get("nodes")
    for node in nodes.values() if isinstance(nodes, dict) else ():
        steps = node.get("steps") if isinstance(node, dict) else None
        for step in steps if isinstance(steps, list) else ():
            name = step.get("serviceName") if isinstance(step, dict) else None
            if not name or step.get("serviceUrl"):
                continue
            if name in services:
                step["serviceUrl"] = services[name]
                continue
            host = f"http://{name}-predictor.{namespace}.svc.cluster.local"
            path = f"/v2/models/{name}/infer" if protocol == "v2" else f"/v1/models/{name}:predict"
            step["serviceUrl"] = host + path
            guessed.add(name)
    return resolved, sorted(guessed)
