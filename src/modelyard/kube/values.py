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

# Kubernetes quantities ("500m", "1.5", "512Mi", "2G"); the API server would refuse anything else.
_QUANTITY = r"^[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?$"
_RESOURCE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$"
_STORAGE = r"^[0-9]+(Ki|Mi|Gi|Ti|M|G|T)?$"
# DNS-1123 labels. A server's name is shorter: its StatefulSet's pods add "-N" and a revision hash
# label that must stay within 63 characters.
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_SERVER_NAME = r"^[a-z]([-a-z0-9]{0,38}[a-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ResourceList(BaseModel):
    """cpu and memory, and any extended resource by its name (`nvidia.com/gpu: 1`)."""

    model_config = ConfigDict(extra="allow", frozen=True)
    cpu: str | None = Field(None, pattern=_QUANTITY)
    memory: str | None = Field(None, pattern=_QUANTITY)

    @model_validator(mode="before")
    @classmethod
    def _extended(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, amount in data.items():
                if name in ("cpu", "memory"):
                    continue
                if not isinstance(name, str) or re.match(_RESOURCE_NAME, name) is None:
                    raise ValueError(f"{name!r} is not a resource name (domain/name, e.g. nvidia.com/gpu)")
                if re.match(_QUANTITY, str(amount)) is None:
                    raise ValueError(f"{name}: {amount!r} is not a quantity")
            return {k: (v if k in ("cpu", "memory") else str(v)) for k, v in data.items()}
        return data


class Resources(_Strict):
    requests: ResourceList = ResourceList()
    limits: ResourceList = ResourceList()


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
    key: str = Field("token", min_length=1)
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
    resources: Resources = Field(
        Resources(requests=ResourceList(cpu="1", memory="2Gi"), limits=ResourceList(cpu="2", memory="2Gi")),
        description="the inference server's; limits.memory is what the agent offers for models",
    )
    agent_resources: Resources = Resources(
        requests=ResourceList(cpu="50m", memory="64Mi"), limits=ResourceList(cpu="500m", memory="256Mi")
    )

    @model_validator(mode="after")
    def _memory_limit(self) -> ServerValues:
        if self.resources.limits.memory is None:
            raise ValueError("resources.limits.memory is needed: the agent offers it for models")
        for capability in self.capabilities:
            if re.match(_DNS_LABEL, capability) is None:
                raise ValueError(f"capability {capability!r} is not a DNS label (it becomes a pod label key)")
        return self


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
        return TelemetryConfig(otlp_endpoint=url).otlp_endpoint  # the gateway's own check


class DeployValues(_Strict):
    namespace: str = Field("modelyard", pattern=_DNS_LABEL)
    create_namespace: bool = True
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
