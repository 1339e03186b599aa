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
    key: str = Field("token", pattern=r"^[-._a-zA-Z0-9]{1,253}$", description="the Secret's key")
    value: str | None = Field(
        None,
        min_length=16,
        description="when set, the render creates the Secret with it (for trying out); otherwise "
        "create the Secret yourself: kubectl create secret generic modelyard-admin --from-literal=token=...",
    )


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
        return self


def load_values(paths: list[Path]) -> DeployValues:
    """Defaults, then each values file over the one before (mappings merge, anything else replaces)."""
    data: dict[str, Any] = {}
    for path in paths:
        data = deep_merge(data, read_yaml(path))
    source = ", ".join(str(p) for p in paths) or "<defaults>"
    try:
        return DeployValues.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [describe_problem(err) for err in exc.errors()]) from None
