"""The values `modelyard deploy render` fills the Kubernetes manifests with, typed and validated once.

Names follow the gateway's own config (snake_case). `deploy/values.yaml` in the repository is this
model's defaults written out with comments; a test keeps the two equal.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from modelyard import __version__
from modelyard.config import TelemetryConfig, deep_merge, describe_problem, read_yaml
from modelyard.errors import ConfigError
from modelyard.types import quantity as kube_quantity

# Kubernetes quantities ("500m", "1.5", "512Mi", "2G"); the API server would refuse anything else.
_RESOURCE_NAME = (
    r"^(cpu|memory|ephemeral-storage|hugepages-[0-9]+(Ki|Mi|Gi)"
    r"|[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)$"
)
_STORAGE = r"^[0-9]+(Ki|Mi|Gi|Ti|M|G|T)?$"
# DNS-1123 labels. A server's name is shorter: its StatefulSet's pods add "-N" and a revision hash
# label that must stay within 63 characters.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_SERVER_NAME = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"
# A Secret's or an Issuer's name (DNS-1123 subdomain, at most 253 characters), and a name a
# certificate may hold.
_DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
_LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
_HOST_NAME = rf"^(?=.{{1,253}}$)(\*\.)?{_LABEL}(\.{_LABEL})*$"  # a wildcard first label too
# A key of a Secret's data (what `kubectl create secret --from-file=KEY=...` takes).
_SECRET_KEY = r"^[-._a-zA-Z0-9]{1,253}$"
# What the roles take as a token (security/tokens.py): printable ASCII, no spaces.
_TOKEN = r"^[\x21-\x7e]{16,}$"
# Fields holding a token: a problem with one never shows its value.
SECRET_FIELDS = frozenset({"value", "read_value", "write_value", "values"})


# Objects the render names itself: a server of the same name would replace their Services.
RESERVED_NAMES = frozenset({"modelyard-gateway", "modelyard-redis", "modelyard-scheduler"})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResourceList(BaseModel):
    """cpu, memory, ephemeral-storage, hugepages-<size>, and extended resources by their domain
    name (`nvidia.com/gpu: 1`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    cpu: str | None = None  # checked with the others below
    memory: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _names_and_amounts(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name, amount in data.items():
            if not isinstance(name, str) or re.match(_RESOURCE_NAME, name) is None:
                raise ValueError(
                    f"{name!r} is not a resource name (cpu, memory, ephemeral-storage, hugepages-2Mi, "
                    "or domain/name such as nvidia.com/gpu)"
                )
            if amount is not None and (isinstance(amount, bool) or not _is_quantity(str(amount))):
                raise ValueError(f"{name}: {amount!r} is not a quantity")
        # 2 and "2" are one quantity: kept as text, as Kubernetes writes them
        return {k: None if v is None else str(v) for k, v in data.items()}

    def amounts(self) -> dict[str, str]:
        """The resources set, by name (Kubernetes' shape)."""
        return {k: v for k, v in self.model_dump().items() if v is not None}


class Resources(_Strict):
    requests: ResourceList = ResourceList()
    limits: ResourceList = ResourceList()

    @model_validator(mode="after")
    def _requests_within_limits(self) -> Resources:
        requests, limits = self.requests.amounts(), self.limits.amounts()
        for name, wanted in requests.items():
            most = limits.get(name)
            if "/" in name or name.startswith("hugepages-"):
                # extended resources cannot be overcommitted: Kubernetes wants request == limit
                if most is None or quantity(wanted) != quantity(most):
                    raise ValueError(f"{name}: requests must equal limits (got {wanted}, limit {most})")
            elif most is not None and quantity(wanted) > quantity(most):
                raise ValueError(f"{name}: the request {wanted} is above the limit {most}")
        return self


def _is_quantity(text: str) -> bool:
    try:
        return kube_quantity(text) >= 0
    except ValueError:
        return False


def quantity(text: str) -> float:
    """A Kubernetes quantity in its base unit: "500m" -> 0.5, "1Gi" -> 1073741824.0."""
    return float(kube_quantity(text))


class Image(_Strict):
    repository: str = Field("ghcr.io/modelyard/modelyard", min_length=1)
    tag: str = Field(__version__, min_length=1, description="default: this modelyard's version")
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class Autoscaling(_Strict):
    enabled: bool = True
    min_replicas: int = Field(2, ge=1)
    max_replicas: int = Field(10, ge=1)
    cpu_utilization: int = Field(70, ge=1, le=100, description="percent of the CPU request, averaged")
    in_flight_per_pod: int | None = Field(
        None,
        ge=1,
        description="also scale on modelyard_requests_in_flight averaged over pods (a custom metric: "
        "needs prometheus-adapter, see the README); none: CPU only",
    )

    @model_validator(mode="after")
    def _ordered(self) -> Autoscaling:
        if self.max_replicas < self.min_replicas:
            raise ValueError(f"max_replicas {self.max_replicas} is below min_replicas {self.min_replicas}")
        return self


class AdminToken(_Strict):
    secret_name: str = Field("modelyard-admin", pattern=_DNS_LABEL)
    key: str = Field("token", pattern=_SECRET_KEY, description="the Secret's key")
    value: str | None = Field(
        None,
        min_length=16,
        description="when set, the render creates the Secret with it (for trying out); otherwise "
        "create the Secret yourself: kubectl create secret generic modelyard-admin --from-literal=token=...",
    )


class ApiKeys(_Strict):
    """The gateway's API keys file (auth.keys_file: tenants and their keys, read again when it
    changes) from a Secret you create, mounted in the gateway's secrets volume."""

    enabled: bool = Field(
        False,
        description="mount the Secret's key as the gateway's auth.keys_file and set auth.enabled "
        "(unless gateway.config.auth sets them): every inference call then needs an API key",
    )
    secret_name: str = Field("modelyard-api-keys", description="the Secret (you create it)")
    key: str = Field("keys.yaml", description="the Secret's key holding the keys file")

    @field_validator("secret_name")
    @classmethod
    def _secret_name(cls, name: str) -> str:
        if len(name) > 253 or re.match(_DNS_SUBDOMAIN, name) is None:
            raise ValueError(
                "expected a Secret's name (lowercase letters, digits, '-' and '.', 1 to 253 characters)"
            )
        return name

    @field_validator("key")
    @classmethod
    def _key(cls, key: str) -> str:
        if re.match(_SECRET_KEY, key) is None or key == "." or key.startswith(".."):
            raise ValueError("expected a Secret's key (letters, digits, '-', '_' and '.'; not '..')")
        return key


class GatewayValues(_Strict):
    replicas: int = Field(2, ge=1, description="used when autoscaling is off")
    config: dict[str, Any] = Field(
        default_factory=dict,
        description="the gateway's own YAML config (models, routes, ...); listen, state and placement "
        "are filled in to match the other manifests unless given here",
    )
    resources: Resources = Resources(
        requests=ResourceList(cpu="500m", memory="256Mi"), limits=ResourceList(cpu="2", memory="1Gi")
    )
    autoscaling: Autoscaling = Autoscaling()
    min_available: int = Field(1, ge=0, description="PodDisruptionBudget: gateways kept through a drain")
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    admin_token: AdminToken = AdminToken()
    api_keys: ApiKeys = ApiKeys()

    @model_validator(mode="after")
    def _drainable(self) -> GatewayValues:
        fewest = self.autoscaling.min_replicas if self.autoscaling.enabled else self.replicas
        if self.min_available and self.min_available >= fewest:
            raise ValueError(
                f"min_available {self.min_available} would block every node drain with {fewest} "
                "gateway(s): keep it below the replicas (autoscaling.min_replicas), or 0"
            )
        return self


class RedisValues(_Strict):
    deploy: bool = Field(True, description="run a Redis for the gateways' shared state")
    url: str | None = Field(
        None, description="an existing Redis instead (deploy: false): redis://host:6379/0"
    )
    image: str = "redis:7.2-alpine"
    resources: Resources = Resources(
        requests=ResourceList(cpu="100m", memory="128Mi"), limits=ResourceList(cpu="1", memory="512Mi")
    )

    @model_validator(mode="after")
    def _one_redis(self) -> RedisValues:
        if self.deploy and self.url:
            raise ValueError("set either deploy: true or url (an existing Redis), not both")
        if not self.deploy and not self.url:
            raise ValueError("deploy is false: give url, the Redis the gateways share")
        return self


class SchedulerValues(_Strict):
    enabled: bool = Field(True, description="the placement control plane; servers need it")
    storage: str = Field("1Gi", pattern=_STORAGE, description="the volume for its SQLite file")
    storage_class: str | None = Field(None, description="none: the cluster's default StorageClass")
    resources: Resources = Resources(
        requests=ResourceList(cpu="100m", memory="128Mi"), limits=ResourceList(cpu="1", memory="512Mi")
    )


class ServerValues(_Strict):
    name: str = Field(pattern=_SERVER_NAME, description="the server (group of replicas) models are placed on")
    replicas: int = Field(1, ge=1)
    image: str = "seldonio/mlserver:1.7.1"
    capabilities: list[str] = Field(
        default_factory=list, description="become pod labels capability.modelyard.io/<name>: 'true'"
    )
    overcommit_percent: int = Field(0, ge=0, le=1000)
    model_memory: str | None = Field(
        None,
        description="memory the agent offers for models; none: 3/4 of the server's memory limit "
        "(the rest is the server's own)",
    )
    resources: Resources = Field(
        Resources(requests=ResourceList(cpu="1", memory="2Gi"), limits=ResourceList(cpu="2", memory="2Gi")),
        description="the inference server's; the agent offers part of limits.memory (model_memory)",
    )
    agent_resources: Resources = Resources(
        requests=ResourceList(cpu="50m", memory="64Mi"), limits=ResourceList(cpu="500m", memory="256Mi")
    )

    @model_validator(mode="after")
    def _memory_limit(self) -> ServerValues:
        limit = self.resources.limits.memory
        if limit is None:
            raise ValueError("resources.limits.memory is needed: the agent offers part of it for models")
        if self.model_memory is not None and quantity(self.model_memory) > quantity(limit):
            raise ValueError(f"model_memory {self.model_memory} is above resources.limits.memory {limit}")
        for capability in self.capabilities:
            if re.match(_DNS_LABEL, capability) is None:
                raise ValueError(f"capability {capability!r} is not a DNS label (it becomes a pod label key)")
        return self

    def model_memory_bytes(self) -> int:
        """What the agent offers for models: model_memory, else 3/4 of the server's memory limit."""
        if self.model_memory is not None:
            return int(quantity(self.model_memory))
        return int(quantity(str(self.resources.limits.memory)) * 3 / 4)


class TelemetryValues(_Strict):
    otlp_endpoint: str | None = Field(
        None,
        description="trace every role to this OTLP/HTTP endpoint (e.g. http://otel-collector:4318); "
        "none: tracing off",
    )
    sample_ratio: float = Field(1.0, ge=0, le=1, description="share of new traces recorded")

    @field_validator("otlp_endpoint")
    @classmethod
    def _url(cls, url: str | None) -> str | None:
        try:
            return TelemetryConfig(otlp_endpoint=url).otlp_endpoint  # the gateway's own check
        except ValidationError as exc:
            raise ValueError(exc.errors()[0]["msg"].removeprefix("Value error, ")) from None


class IssuerRef(_Strict):
    """The cert-manager issuer of every certificate the render asks for."""

    name: str | None = Field(
        None,
        pattern=_DNS_SUBDOMAIN,
        max_length=253,
        description="an Issuer in the namespace or a ClusterIssuer; none: the render creates a "
        "self-signed CA for the namespace (Issuers modelyard-selfsigned and modelyard-ca)",
    )
    kind: Literal["Issuer", "ClusterIssuer"] = "Issuer"
    group: str = Field("cert-manager.io", min_length=1, description="the issuer's API group")


class GatewayTls(_Strict):
    enabled: bool = Field(
        True,
        description="the gateway's own port serves HTTPS (and gRPC over TLS); false when an ingress or "
        "a load balancer in front terminates TLS and sends plain HTTP",
    )
    dns_names: list[str] = Field(
        default_factory=list,
        description="more names in its certificate, such as the host name clients use; the Service's "
        "names are always in it",
    )

    @field_validator("dns_names")
    @classmethod
    def _names(cls, names: list[str]) -> list[str]:
        for name in names:
            if re.match(_HOST_NAME, name) is None:
                raise ValueError(f"{name!r} is not a DNS name")
        return names


class ExistingSecrets(_Strict):
    """Secrets you created in cert-manager's shape (tls.crt, tls.key, ca.crt): no Certificate is
    rendered for them."""

    gateway: str | None = Field(None, pattern=_DNS_SUBDOMAIN, max_length=253)
    scheduler: str | None = Field(None, pattern=_DNS_SUBDOMAIN, max_length=253)
    servers: dict[str, str] = Field(default_factory=dict, description="a server's name: its agents' Secret")

    @field_validator("servers")
    @classmethod
    def _names(cls, secrets: dict[str, str]) -> dict[str, str]:
        for server, name in secrets.items():
            if len(name) > 253 or re.match(_DNS_SUBDOMAIN, name) is None:
                raise ValueError(f"{server}: {name!r} is not a Secret name")
        return secrets


class TlsValues(_Strict):
    enabled: bool = Field(
        True,
        description="TLS on every hop the render makes: the scheduler's REST and agent ports, agents "
        "to the scheduler (mutual TLS), the agents' data planes, the gateway's feed and its requests "
        "to the agents; false needs insecure: true",
    )
    issuer: IssuerRef = IssuerRef()
    gateway: GatewayTls = GatewayTls()
    localhost: bool = Field(
        True,
        description="the gateway's and the scheduler's certificates also name localhost and 127.0.0.1, "
        "so that kubectl port-forward can be verified; false for an issuer that refuses them",
    )
    existing_secrets: ExistingSecrets = ExistingSecrets()


class SchedulerTokens(_Strict):
    """The scheduler's REST tokens, from one Secret: key `tokens` is its tokens file (lines
    `read TOKEN` and `write TOKEN`), key `read` the read token alone, which the gateways send."""

    enabled: bool = Field(
        True, description="false needs insecure: true: anyone reaching the REST port could place models"
    )
    secret_name: str = Field("modelyard-scheduler-tokens", pattern=_DNS_SUBDOMAIN, max_length=253)
    read_value: str | None = Field(
        None,
        pattern=_TOKEN,
        description="with write_value: the render creates the Secret (for trying out); otherwise create it",
    )
    write_value: str | None = Field(None, pattern=_TOKEN)

    @model_validator(mode="after")
    def _both(self) -> SchedulerTokens:
        if not self.enabled and self.read_value is not None:
            raise ValueError("read_value and write_value are given but enabled is false")
        if (self.read_value is None) != (self.write_value is None):
            raise ValueError("read_value and write_value go together (or neither: you create the Secret)")
        if self.read_value is not None and self.read_value == self.write_value:
            raise ValueError("read_value and write_value must differ (the scheduler refuses a token twice)")
        return self


class AgentTokens(_Strict):
    """Join tokens instead of the agents' client certificates: key `tokens` of the Secret is the
    scheduler's file (lines `SERVER TOKEN`), key `server-<name>` each server's token."""

    enabled: bool = Field(
        False,
        description="agents send a join token instead of showing a client certificate (mutual TLS)",
    )
    secret_name: str = Field("modelyard-agent-tokens", pattern=_DNS_SUBDOMAIN, max_length=253)
    values: dict[str, str] = Field(
        default_factory=dict,
        description="a server's name: its token; the render creates the Secret (for trying out)",
    )

    @model_validator(mode="after")
    def _used(self) -> AgentTokens:
        if self.values and not self.enabled:
            raise ValueError("values are given but enabled is false (agents show certificates instead)")
        return self

    @field_validator("values")
    @classmethod
    def _tokens(cls, values: dict[str, str]) -> dict[str, str]:
        for server, token in values.items():
            if not isinstance(token, str) or re.match(_TOKEN, token) is None:
                raise ValueError(f"{server}: a token is 16 or more printable ASCII characters, no spaces")
        if len(set(values.values())) != len(values):
            raise ValueError("each server its own token (the scheduler refuses a token twice)")
        return values


class TokenValues(_Strict):
    scheduler: SchedulerTokens = SchedulerTokens()
    agents: AgentTokens = AgentTokens()


class DeployValues(_Strict):
    namespace: str = Field("modelyard", pattern=_DNS_LABEL)
    create_namespace: bool = True
    network_policies: bool = Field(
        True, description="only the gateways reach Redis; gateways and labelled clients the scheduler"
    )
    image: Image = Image()
    gateway: GatewayValues = GatewayValues()
    redis: RedisValues = RedisValues()
    scheduler: SchedulerValues = SchedulerValues()
    telemetry: TelemetryValues = TelemetryValues()
    tls: TlsValues = TlsValues()
    tokens: TokenValues = TokenValues()
    insecure: bool = Field(
        False,
        description="render --insecure for the scheduler and the agents: needed, and only allowed, "
        "when TLS or a credential is off (tls.enabled, tokens.scheduler.enabled)",
    )
    servers: list[ServerValues] = Field(
        default_factory=lambda: [ServerValues(name="mlserver", capabilities=["sklearn", "xgboost"])],
    )

    @model_validator(mode="after")
    def _consistent(self) -> DeployValues:
        if self.servers and not self.scheduler.enabled:
            raise ValueError("servers need the scheduler (scheduler.enabled: true) or an empty servers list")
        names = [server.name for server in self.servers]
        taken = sorted(set(names) & RESERVED_NAMES)
        if taken:
            raise ValueError(f"server names {', '.join(taken)}: taken by modelyard's own objects")
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"server names must be unique: {', '.join(twice)}")
        unknown = sorted(set(self.tls.existing_secrets.servers) - set(names))
        if unknown:
            raise ValueError(f"tls.existing_secrets.servers: no server named {', '.join(unknown)}")
        agents = self.tokens.agents
        if agents.enabled and agents.values and set(agents.values) != set(names):
            raise ValueError(
                "tokens.agents.values: one token for each server, or none (you create the Secret): "
                f"servers {', '.join(names) or '(none)'}, tokens for {', '.join(sorted(agents.values))}"
            )
        plain = self.plain_text()
        if plain and not self.insecure:
            raise ValueError(
                f"{'; '.join(plain)}: set insecure: true to render it anyway (the scheduler and "
                "the agents then start with --insecure)"
            )
        if self.insecure and not plain:
            raise ValueError("insecure: true, but TLS and every credential are on: leave it false")
        return self

    def plain_text(self) -> list[str]:
        """What the values turn off that the scheduler and the agents need off loopback: each a
        field and why; empty when they start without --insecure."""
        if not self.scheduler.enabled:
            return []
        found = []
        if not self.tls.enabled:
            found.append(
                "tls.enabled is false: tokens, models and requests would cross the network in plain text"
            )
        if not self.tokens.scheduler.enabled:
            found.append(
                "tokens.scheduler.enabled is false: anyone reaching the scheduler could place models"
            )
        if self.servers and not self.tls.enabled and not self.tokens.agents.enabled:
            found.append("agents have no credential without TLS (tls.enabled) or join tokens (tokens.agents)")
        return found


def load_values(paths: list[Path]) -> DeployValues:
    """Defaults, then each values file over the one before (mappings merge, anything else replaces)."""
    data: dict[str, Any] = {}
    for path in paths:
        data = deep_merge(data, read_yaml(path))
    source = ", ".join(str(p) for p in paths) or "<defaults>"
    try:
        return DeployValues.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_problem(err) for err in exc.errors()]) from None


def _problem(err: Any) -> str:
    """A problem as the gateway's config says it; a token's value is never shown."""
    if SECRET_FIELDS & {str(part) for part in err["loc"]}:
        err = {**err, "input": {}}  # describe_problem shows no mapping it got
    return describe_problem(err)
