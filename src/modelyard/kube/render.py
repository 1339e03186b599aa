"""`modelyard deploy render`: the manifests of `manifests/` filled from typed values.

Why plain manifests and our own renderer rather than Helm or kustomize: neither installs from the
package registries this project builds from, and the tests must render and validate every manifest.
The manifests are ordinary YAML with `${...}` placeholders (see template.py); the context they are
filled from is computed here, once, so the wiring between the roles (the gateway's Redis URL and
scheduler address, ports, probe paths) lives in one place a test can check.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from importlib import resources
from typing import Any

import yaml

from modelyard import __version__
from modelyard.config import AUTO_WORKERS, GatewayConfig, deep_merge, validate_config
from modelyard.errors import ConfigError
from modelyard.kube.podinfo import CAPABILITY_LABEL
from modelyard.kube.template import fill_documents
from modelyard.kube.values import DeployValues, Resources, ServerValues, quantity

SCHEDULER_PORT = 9004  # REST API and the gateways' feed
SCHEDULER_AGENT_PORT = 9005  # gRPC AgentService
REDIS_SERVICE = "modelyard-redis"
SCHEDULER_SERVICE = "modelyard-scheduler"
_NAME = "modelyard"

# Security settings every container of ours gets: non-root, nothing writable but its volumes.
_POD_SECURITY = {
    "runAsNonRoot": True,
    "runAsUser": 10001,
    "runAsGroup": 10001,
    "fsGroup": 10001,
    "seccompProfile": {"type": "RuntimeDefault"},
}
_CONTAINER_SECURITY = {
    "allowPrivilegeEscalation": False,
    "readOnlyRootFilesystem": True,
    "privileged": False,
    "capabilities": {"drop": ["ALL"]},
}


def render(values: DeployValues, source: str = "<values>") -> list[dict[str, Any]]:
    """Every manifest for these values, in the order `kubectl apply` should create them."""
    gateway = _gateway_config(values, source)
    context = _context(values, gateway)
    documents: list[dict[str, Any]] = []
    for template, wanted in _TEMPLATES:
        if wanted(values):
            documents += fill_documents(_read(template), context, source=template)
    for server in values.servers:
        server_context = dict(context, server=_server_context(server))
        documents += fill_documents(_read("server.yaml"), server_context, source="server.yaml")
    return documents


def dump(documents: list[dict[str, Any]]) -> str:
    """Documents as one multi-document YAML stream, keys in the manifests' order; a text of several
    lines (the gateway's config in its ConfigMap) as a literal block a reader can follow."""
    return yaml.dump_all(documents, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


class _Dumper(yaml.SafeDumper):
    pass


def _text(dumper: yaml.SafeDumper, text: str) -> yaml.ScalarNode:
    style = "|" if "\n" in text else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=style)


_Dumper.add_representer(str, _text)


_TEMPLATES: list[tuple[str, Callable[[DeployValues], bool]]] = [
    ("namespace.yaml", lambda v: v.create_namespace),
    ("gateway-secret.yaml", lambda v: v.gateway.admin_token.value is not None),
    ("redis.yaml", lambda v: v.redis.deploy),
    ("scheduler.yaml", lambda v: v.scheduler.enabled),
    ("gateway.yaml", lambda v: True),
    ("gateway-hpa.yaml", lambda v: v.gateway.autoscaling.enabled),
    ("redis-policy.yaml", lambda v: v.network_policies and v.redis.deploy),
    ("scheduler-policy.yaml", lambda v: v.network_policies and v.scheduler.enabled),
]


def template_names() -> Iterator[str]:
    """Every manifest file the render may use."""
    yield from (name for name, _ in _TEMPLATES)
    yield "server.yaml"


def _read(name: str) -> str:
    return resources.files("modelyard.kube").joinpath("manifests", name).read_text()


def redis_url(values: DeployValues) -> str:
    return f"redis://{REDIS_SERVICE}:6379/0" if values.redis.deploy else str(values.redis.url)


def _gateway_config(values: DeployValues, source: str) -> tuple[dict[str, Any], GatewayConfig]:
    """The gateway's config: what the other manifests need filled in, under what the values give.
    Validated here, so a mistake is reported at render time with its path in the values file."""
    base: dict[str, Any] = {
        # drain_seconds: time for kube-proxy and load balancers to see the pod unready on SIGTERM
        "listen": {"host": "0.0.0.0", "port": 8000, "workers": _workers(values), "drain_seconds": 10},
        "state": {"backend": "redis", "url": redis_url(values)},
    }
    if values.scheduler.enabled:
        base["placement"] = {"scheduler": f"{SCHEDULER_SERVICE}:{SCHEDULER_PORT}"}
    if values.telemetry.otlp_endpoint is not None:
        base["telemetry"] = {
            "otlp_endpoint": values.telemetry.otlp_endpoint,
            "sample_ratio": values.telemetry.sample_ratio,
        }
    data = deep_merge(base, values.gateway.config)
    try:
        config = validate_config(data, source)
    except ConfigError as error:
        raise ConfigError(source, [f"gateway.config.{p}" for p in error.problems]) from None
    problems = []
    if config.listen.host not in _WILDCARDS:  # probes and the Service come from outside the pod
        problems.append(
            f"gateway.config.listen.host: a pod listens on 0.0.0.0 or ::, got {config.listen.host!r}"
        )
    workers = config.listen.workers
    if config.placement.scheduler and isinstance(workers, int) and workers > 1:
        problems.append(
            "gateway.config.listen.workers: placement.scheduler (placed models) works with one worker "
            f"only for now (got {workers})"
        )
    if problems:
        raise ConfigError(source, problems)
    return data, config


_WILDCARDS = ("0.0.0.0", "::", "")


def _workers(values: DeployValues) -> int | str:
    """One worker per CPU of the limit: "auto" would count the node's CPUs, not the pod's share.
    With the scheduler, "auto" is one process (placement follows one feed per gateway)."""
    cpu = values.gateway.resources.limits.cpu
    if values.scheduler.enabled or cpu is None:
        return "auto"
    return max(1, min(AUTO_WORKERS, math.ceil(quantity(cpu))))


def _context(values: DeployValues, gateway: tuple[dict[str, Any], GatewayConfig]) -> dict[str, Any]:
    data, config = gateway
    config_yaml = yaml.safe_dump(data, sort_keys=False)
    listen = config.listen
    autoscaling = values.gateway.autoscaling
    in_flight = None
    if autoscaling.enabled and autoscaling.in_flight_per_pod is not None:
        in_flight = {
            "type": "Pods",
            "pods": {
                "metric": {"name": "modelyard_requests_in_flight"},
                "target": {"type": "AverageValue", "averageValue": str(autoscaling.in_flight_per_pod)},
            },
        }
    grpc = listen.grpc_port
    token = values.gateway.admin_token
    tracing = values.telemetry
    return {
        "namespace": values.namespace,
        "image": f"{values.image.repository}:{values.image.tag}",
        "pull_policy": values.image.pull_policy,
        "pod_security": _POD_SECURITY,
        # The scheduler and the agents trace with flags (the gateway: its config's telemetry).
        "tracing_endpoint": tracing.otlp_endpoint and f"--otlp-endpoint={tracing.otlp_endpoint}",
        "tracing_ratio": tracing.otlp_endpoint and f"--trace-sample-ratio={tracing.sample_ratio:g}",
        "container_security": _CONTAINER_SECURITY,
        "gateway": {
            "labels": _labels("gateway"),
            "selector": _selector("gateway"),
            # with the HPA on, it owns the count: a re-apply must not reset it
            "replicas": None if autoscaling.enabled else values.gateway.replicas,
            "config_yaml": config_yaml,
            "config_sha256": hashlib.sha256(config_yaml.encode()).hexdigest()[:16],
            "port": listen.port,
            "port_text": str(listen.port),
            "grpc_container_port": None
            if grpc is None
            else {"name": "grpc", "containerPort": grpc, "protocol": "TCP"},
            "grpc_service_port": None
            if grpc is None
            else {"name": "grpc", "port": grpc, "targetPort": "grpc", "protocol": "TCP"},
            # the drain and the shutdown, with slack for the process' own stop
            "termination_grace_seconds": math.ceil(listen.drain_seconds + listen.shutdown_timeout) + 15,
            "shm_size": f"{_shm_mib(listen.workers)}Mi",
            "resources": _resources(values.gateway.resources),
            "autoscaling": autoscaling.model_dump(),
            "in_flight_metric": in_flight,
            "min_available": values.gateway.min_available,
            "service_type": values.gateway.service_type,
            "admin_secret": token.secret_name,
            "admin_secret_key": token.key,
            "admin_token": token.value,
        },
        "redis": {
            "labels": _labels("redis"),
            "selector": _selector("redis"),
            "image": values.redis.image,
            "resources": _resources(values.redis.resources),
            "args": [
                *("--save", "", "--appendonly", "no", "--protected-mode", "no", "--dir", "/data"),
                *_redis_memory(values),
            ],
        },
        "scheduler": {
            "labels": _labels("scheduler"),
            "selector": _selector("scheduler"),
            "port": SCHEDULER_PORT,
            "port_text": str(SCHEDULER_PORT),
            "agent_port": SCHEDULER_AGENT_PORT,
            "agent_port_text": str(SCHEDULER_AGENT_PORT),
            "agent_address": f"{SCHEDULER_SERVICE}:{SCHEDULER_AGENT_PORT}",
            "agents_selector": _selector("server"),
            "storage": values.scheduler.storage,
            "storage_class": values.scheduler.storage_class,
            "resources": _resources(values.scheduler.resources),
        },
    }


def _server_context(server: ServerValues) -> dict[str, Any]:
    selector = _selector("server") | {"app.kubernetes.io/instance": server.name}
    labels = _labels("server") | selector
    capabilities = {f"{CAPABILITY_LABEL}{c}": "true" for c in server.capabilities}
    return {
        "name": server.name,
        "model_memory_text": str(server.model_memory_bytes()),
        "labels": labels,
        "selector": selector,
        "pod_labels": labels | capabilities,
        "replicas": server.replicas,
        "image": server.image,
        "overcommit_percent_text": str(server.overcommit_percent),
        "resources": _resources(server.resources),
        "agent_resources": _resources(server.agent_resources),
    }


def _shm_mib(workers: int | str) -> int:
    """The workers' shared files (listen.workers): N x 5 MiB + 16 MiB, with room to spare."""
    count = workers if isinstance(workers, int) else AUTO_WORKERS
    return max(64, count * 5 + 32)


def _redis_memory(values: DeployValues) -> list[str]:
    """Redis evicts least recently used keys at 3/4 of its limit rather than being OOM-killed:
    everything in it is routing state the gateways rebuild."""
    limit = values.redis.resources.limits.memory
    if limit is None:
        return []
    return ["--maxmemory", str(int(quantity(limit) * 3 / 4)), "--maxmemory-policy", "allkeys-lru"]


def _selector(component: str) -> dict[str, str]:
    return {"app.kubernetes.io/name": _NAME, "app.kubernetes.io/component": component}


def _labels(component: str) -> dict[str, str]:
    return _selector(component) | {
        "app.kubernetes.io/version": __version__,
        "app.kubernetes.io/part-of": _NAME,
    }


def _resources(resources_: Resources) -> dict[str, dict[str, str]]:
    """Kubernetes' shape, leaving out what is not set."""
    shaped = {}
    for kind in ("requests", "limits"):
        quantities = {k: v for k, v in getattr(resources_, kind).model_dump().items() if v is not None}
        if quantities:
            shaped[kind] = quantities
    return shaped
