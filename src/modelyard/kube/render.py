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
AGENT_PORT = 9999  # an agent's data plane
REDIS_SERVICE = "modelyard-redis"
SCHEDULER_SERVICE = "modelyard-scheduler"
GATEWAY_SERVICE = "modelyard-gateway"
_NAME = "modelyard"

# Where each pod finds its Secrets: one projected volume holding only the keys the pod uses,
# updated in place when a Secret changes (the roles read certificates and tokens again).
SECRETS_DIR = "/var/run/secrets/modelyard"
TLS_CERT = f"{SECRETS_DIR}/tls/tls.crt"  # cert-manager's key names
TLS_KEY = f"{SECRETS_DIR}/tls/tls.key"
CA_CERT = f"{SECRETS_DIR}/tls/ca.crt"  # the CA of the scheduler's certificate: every pod trusts it
SCHEDULER_TOKENS = f"{SECRETS_DIR}/scheduler-tokens"  # the scheduler's REST tokens file
AGENT_TOKENS = f"{SECRETS_DIR}/agent-tokens"  # the scheduler's agents' join tokens file
FEED_TOKEN = f"{SECRETS_DIR}/scheduler-token"  # the gateways' read token
AGENT_TOKEN = f"{SECRETS_DIR}/agent-token"  # an agent's join token
API_KEYS = f"{SECRETS_DIR}/api-keys.yaml"  # the gateway's keys file (gateway.api_keys)
CA_ISSUER = "modelyard-ca"  # the render's own CA (tls.issuer.name unset)
AGENT_IDENTITY = "spiffe://modelyard/server/{server}"  # any replica of the server: see _server_context

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
        server_context = dict(context, server=_server_context(values, server))
        for template, wanted_for in _SERVER_TEMPLATES:
            if wanted_for(values, server):
                documents += fill_documents(_read(template), server_context, source=template)
    for template, wanted in _POLICIES:
        if wanted(values):
            documents += fill_documents(_read(template), context, source=template)
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


def _scheduler_tokens(values: DeployValues) -> bool:
    return values.scheduler.enabled and values.tokens.scheduler.enabled


def _agent_tokens(values: DeployValues) -> bool:
    return values.scheduler.enabled and bool(values.servers) and values.tokens.agents.enabled


def _gateway_listener_tls(values: DeployValues) -> bool:
    return values.tls.enabled and values.tls.gateway.enabled


def _scheduler_tls(values: DeployValues) -> bool:
    return values.tls.enabled and values.scheduler.enabled


def _certificates(values: DeployValues) -> list[str]:
    """The Certificates the render asks cert-manager for (those without an existing Secret)."""
    wanted = []
    existing = values.tls.existing_secrets
    if _gateway_listener_tls(values) and existing.gateway is None:
        wanted.append("gateway")
    if _scheduler_tls(values) and existing.scheduler is None:
        wanted.append("scheduler")
    if values.tls.enabled:
        wanted += [s.name for s in values.servers if s.name not in existing.servers]
    return wanted


_TEMPLATES: list[tuple[str, Callable[[DeployValues], bool]]] = [
    ("namespace.yaml", lambda v: v.create_namespace),
    ("gateway-secret.yaml", lambda v: v.gateway.admin_token.value is not None),
    ("scheduler-tokens.yaml", lambda v: _scheduler_tokens(v) and v.tokens.scheduler.read_value is not None),
    ("agent-tokens.yaml", lambda v: _agent_tokens(v) and bool(v.tokens.agents.values)),
    ("ca-issuer.yaml", lambda v: v.tls.issuer.name is None and bool(_certificates(v))),
    ("scheduler-certificate.yaml", lambda v: "scheduler" in _certificates(v)),
    ("gateway-certificate.yaml", lambda v: "gateway" in _certificates(v)),
    ("redis.yaml", lambda v: v.redis.deploy),
    ("scheduler.yaml", lambda v: v.scheduler.enabled),
    ("gateway.yaml", lambda v: True),
    ("gateway-hpa.yaml", lambda v: v.gateway.autoscaling.enabled),
]
# Each server's, filled once per entry of `servers:` (the server's context under `server`).
_SERVER_TEMPLATES: list[tuple[str, Callable[[DeployValues, ServerValues], bool]]] = [
    ("server-certificate.yaml", lambda v, server: server.name in _certificates(v)),
    ("server.yaml", lambda v, server: True),
]
_POLICIES: list[tuple[str, Callable[[DeployValues], bool]]] = [
    ("redis-policy.yaml", lambda v: v.network_policies and v.redis.deploy),
    ("scheduler-policy.yaml", lambda v: v.network_policies and v.scheduler.enabled),
    ("server-policy.yaml", lambda v: v.network_policies and bool(v.servers)),
]


def template_names() -> Iterator[str]:
    """Every manifest file the render may use."""
    for templates in (_TEMPLATES, _SERVER_TEMPLATES, _POLICIES):
        yield from (name for name, _ in templates)


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
    if _gateway_listener_tls(values):
        base["listen"]["tls"] = {"cert_file": TLS_CERT, "key_file": TLS_KEY}
    if values.scheduler.enabled:
        placement: dict[str, Any] = {"scheduler": f"{SCHEDULER_SERVICE}:{SCHEDULER_PORT}"}
        if _scheduler_tls(values):
            placement["scheduler"] = f"https://{SCHEDULER_SERVICE}:{SCHEDULER_PORT}"
            placement["tls"] = {"ca_file": CA_CERT}
        if _scheduler_tokens(values):
            placement["token_file"] = FEED_TOKEN
            if not _scheduler_tls(values):  # `insecure: true` asked for plain text inside the cluster
                placement["allow_plain_token"] = True
        base["placement"] = placement
        if values.tls.enabled and values.servers:
            # the agents' data planes (https:// in the feed); a model of your own config on an
            # https:// server names its own tls (models[].tls) when this CA is not its
            base["upstream"] = {"tls": {"ca_file": CA_CERT}}
    if values.gateway.api_keys.enabled:
        # the file follows its Secret: the kubelet swaps the projected volume's files, the
        # gateway sees a new file (security/tokens.py WatchedFile) and reads it again
        base["auth"] = {"enabled": True, "keys_file": API_KEYS}
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
    https = listen.tls is not None  # as the config says: gateway.config may set listen.tls itself
    scheduler_https = _scheduler_tls(values)
    return {
        "namespace": values.namespace,
        "tls": _tls_context(values),
        "tokens": _tokens_context(values),
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
            "port_name": "https" if https else "http",
            "service_port": 443 if https else 80,
            "scheme": "HTTPS" if https else "HTTP",  # probes (kubelet does not verify) and scraping
            "scrape_scheme": "https" if https else "http",
            **_secrets_volume(_gateway_secrets(values)),
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
            "port_name": "https" if scheduler_https else "http",
            "scheme": "HTTPS" if scheduler_https else "HTTP",
            "scrape_scheme": "https" if scheduler_https else "http",
            "flags": _scheduler_flags(values),
            **_secrets_volume(_scheduler_secrets(values)),
        },
    }


# --- TLS and tokens ----------------------------------------------------------------------------
#
# Every pod trusts one CA: the ca.crt of the scheduler's Secret, the CA that signed the scheduler's
# certificate and the agents' (one issuer signs them all). The gateway's own certificate, which
# clients verify, may come from elsewhere (an existing Secret from a public CA): nothing inside
# the cluster verifies it.


def gateway_secret(values: DeployValues) -> str:
    return values.tls.existing_secrets.gateway or "modelyard-gateway-tls"


def scheduler_secret(values: DeployValues) -> str:
    return values.tls.existing_secrets.scheduler or "modelyard-scheduler-tls"


def server_secret(values: DeployValues, server: str) -> str:
    return values.tls.existing_secrets.servers.get(server) or f"{server}-agent-tls"


def _agent_mutual_tls(values: DeployValues) -> bool:
    """Agents show client certificates to the scheduler, unless join tokens replace them."""
    return values.tls.enabled and not values.tokens.agents.enabled


def _items(secret: str, paths: dict[str, str]) -> dict[str, Any]:
    """A projected volume's source: `secret`'s keys at these paths (relative to SECRETS_DIR). A key
    the Secret lacks keeps the pod from starting, with an event naming it: no silent fallback."""
    items = [{"key": key, "path": path.removeprefix(SECRETS_DIR + "/")} for key, path in paths.items()]
    return {"secret": {"name": secret, "items": items}}


def _gateway_secrets(values: DeployValues) -> list[dict[str, Any]]:
    sources = []
    if _gateway_listener_tls(values):
        sources.append(_items(gateway_secret(values), {"tls.crt": TLS_CERT, "tls.key": TLS_KEY}))
    if _scheduler_tls(values):  # the feed's scheduler and the agents' data planes
        sources.append(_items(scheduler_secret(values), {"ca.crt": CA_CERT}))
    if _scheduler_tokens(values):
        sources.append(_items(values.tokens.scheduler.secret_name, {"read": FEED_TOKEN}))
    api_keys = values.gateway.api_keys
    if api_keys.enabled:
        sources.append(_items(api_keys.secret_name, {api_keys.key: API_KEYS}))
    return sources


def _scheduler_secrets(values: DeployValues) -> list[dict[str, Any]]:
    sources = []
    if _scheduler_tls(values):
        files = {"tls.crt": TLS_CERT, "tls.key": TLS_KEY, "ca.crt": CA_CERT}
        sources.append(_items(scheduler_secret(values), files))
    if _scheduler_tokens(values):
        sources.append(_items(values.tokens.scheduler.secret_name, {"tokens": SCHEDULER_TOKENS}))
    if _agent_tokens(values):
        sources.append(_items(values.tokens.agents.secret_name, {"tokens": AGENT_TOKENS}))
    return sources


def _server_secrets(values: DeployValues, server: str) -> list[dict[str, Any]]:
    sources = []
    if values.tls.enabled:
        sources.append(_items(server_secret(values, server), {"tls.crt": TLS_CERT, "tls.key": TLS_KEY}))
        sources.append(_items(scheduler_secret(values), {"ca.crt": CA_CERT}))
    if _agent_tokens(values):
        sources.append(_items(values.tokens.agents.secret_name, {f"server-{server}": AGENT_TOKEN}))
    return sources


def _secrets_volume(sources: list[dict[str, Any]]) -> dict[str, Any]:
    """The pod's `secrets` volume and its mount, or neither (None removes them from the manifest)."""
    if not sources:
        return {"secrets_volume": None, "secrets_mount": None}
    return {
        # read by the pod's group (fsGroup) only: the containers' users are not root
        "secrets_volume": {"name": "secrets", "projected": {"defaultMode": 0o440, "sources": sources}},
        "secrets_mount": {"name": "secrets", "mountPath": SECRETS_DIR, "readOnly": True},
    }


def _flag(name: str, value: str | bool) -> str | None:
    """`--name=value` (one list item), `--name` for True; None (left out) for False or ''."""
    if value is True:
        return f"--{name}"
    return f"--{name}={value}" if value else None


def _scheduler_flags(values: DeployValues) -> dict[str, str | None]:
    tls = _scheduler_tls(values)
    return {
        "tls_cert": _flag("tls-cert", tls and TLS_CERT),
        "tls_key": _flag("tls-key", tls and TLS_KEY),
        "tokens_file": _flag("tokens-file", _scheduler_tokens(values) and SCHEDULER_TOKENS),
        "agent_ca": _flag("agent-ca", _agent_mutual_tls(values) and CA_CERT),
        "agent_tokens_file": _flag("agent-tokens-file", _agent_tokens(values) and AGENT_TOKENS),
        "insecure": _flag("insecure", values.insecure),
    }


def _agent_flags(values: DeployValues) -> dict[str, str | None]:
    tls, mutual = values.tls.enabled, _agent_mutual_tls(values)
    return {
        "scheduler_ca": _flag("scheduler-ca", tls and CA_CERT),
        "cert": _flag("cert", mutual and TLS_CERT),
        "key": _flag("key", mutual and TLS_KEY),
        "token_file": _flag("token-file", _agent_tokens(values) and AGENT_TOKEN),
        "tls_cert": _flag("tls-cert", tls and TLS_CERT),
        "tls_key": _flag("tls-key", tls and TLS_KEY),
        "insecure": _flag("insecure", values.insecure),
    }


def _service_names(service: str, namespace: str) -> list[str]:
    """The names a Service is reached by, short to fully qualified."""
    return [
        service,
        f"{service}.{namespace}",
        f"{service}.{namespace}.svc",
        f"{service}.{namespace}.svc.cluster.local",
    ]


def _tls_context(values: DeployValues) -> dict[str, Any]:
    tls, namespace = values.tls, values.namespace
    issuer = tls.issuer
    local = {"names": ["localhost"], "ips": ["127.0.0.1"]} if tls.localhost else {"names": [], "ips": []}
    return {
        "issuer": {
            "name": issuer.name or CA_ISSUER,
            "kind": issuer.kind if issuer.name else "Issuer",
            "group": issuer.group if issuer.name else "cert-manager.io",
        },
        "ca_issuer": CA_ISSUER,
        "ca_common_name": f"modelyard CA ({namespace})"[:64],  # cert-manager's limit
        "gateway_secret": gateway_secret(values),
        "gateway_dns_names": _service_names(GATEWAY_SERVICE, namespace)
        + local["names"]
        + tls.gateway.dns_names,
        "scheduler_secret": scheduler_secret(values),
        "scheduler_dns_names": _service_names(SCHEDULER_SERVICE, namespace) + local["names"],
        "ip_addresses": local["ips"] or None,
    }


def _tokens_context(values: DeployValues) -> dict[str, Any]:
    scheduler, agents = values.tokens.scheduler, values.tokens.agents
    read, write = scheduler.read_value, scheduler.write_value
    return {
        "scheduler_secret": scheduler.secret_name,
        # the scheduler's tokens file; the gateways mount `read`, `write` is yours (modelyard model)
        "scheduler_data": None
        if read is None
        else {"tokens": f"read {read}\nwrite {write}\n", "read": read, "write": write},
        "agents_secret": agents.secret_name,
        "agents_data": None
        if not agents.values
        else {
            "tokens": "".join(f"{server} {token}\n" for server, token in agents.values.items()),
            **{f"server-{server}": token for server, token in agents.values.items()},
        },
    }


def _server_context(values: DeployValues, server: ServerValues) -> dict[str, Any]:
    selector = _selector("server") | {"app.kubernetes.io/instance": server.name}
    labels = _labels("server") | selector
    capabilities = {f"{CAPABILITY_LABEL}{c}": "true" for c in server.capabilities}
    scheme = "https" if values.tls.enabled else "http"
    service = f"{server.name}.{values.namespace}.svc"
    return {
        "name": server.name,
        "scheme": scheme,
        "probe_scheme": scheme.upper(),
        "livez_url": f"{scheme}://127.0.0.1:{AGENT_PORT}/agent/livez",
        "flags": _agent_flags(values),
        **_secrets_volume(_server_secrets(values, server.name)),
        # One certificate for every pod of the server: cert-manager's Certificate cannot name a pod's
        # ordinal, so the identity is the server's (any replica; the scheduler still gives a
        # connected replica's slot to no one else), and the data plane's names are the wildcard
        # under the server's headless Service (POD.SERVER.NAMESPACE.svc).
        "certificate": server.name + "-agent",
        "secret": server_secret(values, server.name),
        "dns_names": [f"*.{service}", f"*.{service}.cluster.local"],
        "identity": AGENT_IDENTITY.format(server=server.name),
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
