"""Typed gateway configuration, validated once and passed in (DESIGN.md habit 5).

Precedence: CLI flags > `MODELYARD_*` environment variables > the YAML file > defaults.
Environment variables address nested fields with a double underscore:
`MODELYARD_LISTEN__PORT=9000`, `MODELYARD_ADMIN__TOKEN=secret`, `MODELYARD_STATE__BACKEND=redis`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from modelyard.errors import ConfigError

StrategyName = Literal["round_robin", "random", "least_pending", "kv_aware", "cost_aware"]
STRATEGY_NAMES: tuple[str, ...] = StrategyName.__args__  # type: ignore[attr-defined]

ENV_PREFIX = "MODELYARD_"
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def _parse_duration(value: Any) -> Any:
    """Accept Envoy-style durations ("250ms", "5s", "1m") as well as plain seconds."""
    if isinstance(value, str):
        match = _DURATION.match(value)
        if not match:
            raise ValueError("expected a duration such as 5, 0.5, '250ms', '5s' or '1m'")
        return float(match.group(1)) * _UNIT_SECONDS[match.group(2)]
    return value


Seconds = Annotated[float, BeforeValidator(_parse_duration), Field(ge=0)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenConfig(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)


class EndpointConfig(_Strict):
    """One upstream inference server serving the model."""

    url: str
    name: str = Field("", description="label in metrics and X-Modelyard-Backend; default host:port")
    weight: int = Field(1, ge=0, le=10_000, description="relative share for round_robin and random")
    cost_per_1k_tokens: float = Field(0.0, ge=0, description="price used by cost_aware")

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _default_name(self) -> EndpointConfig:
        if not self.name:
            object.__setattr__(self, "name", _default_endpoint_name(self.url))
        return self


class HealthCheckConfig(_Strict):
    """Active health checking, Envoy's names. `path` is probed with GET; 2xx is healthy."""

    path: str = "/health"
    interval: Seconds = 5.0
    unhealthy_interval: Seconds = Field(1.0, description="probe period for endpoints that are down")
    timeout: Seconds = 1.0
    unhealthy_threshold: int = Field(2, ge=1)
    healthy_threshold: int = Field(1, ge=1)


class KvAwareConfig(_Strict):
    """Prefix affinity: requests whose prompts share the first `prefix_chars` go to one endpoint."""

    prefix_chars: int = Field(512, ge=1)
    ttl: Seconds = 600.0


class ModelConfig(_Strict):
    name: str = Field(min_length=1)
    endpoints: list[EndpointConfig] = Field(min_length=1)
    strategy: StrategyName = "round_robin"
    protocol: Literal["v1", "v2"] = Field(
        "v1",
        description="how graph steps naming this model (serviceName) call it: v1 :predict or v2 /infer",
    )
    health_check: HealthCheckConfig = HealthCheckConfig()
    kv_aware: KvAwareConfig = KvAwareConfig()


class StateConfig(_Strict):
    """Where gateways keep shared routing state (kv_aware affinity)."""

    backend: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "modelyard:"
    max_entries: int = Field(100_000, ge=1, description="memory backend: bound on stored keys (LRU)")
    timeout: Seconds = Field(0.25, description="redis: per-operation deadline before falling back")


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1)


class AdminConfig(_Strict):
    token: str | None = Field(None, description="when set, /admin and PUT /strategy need this bearer token")


class UpstreamConfig(_Strict):
    connect_timeout: Seconds = 2.0
    timeout: Seconds = Field(600.0, description="whole-request deadline; 0 disables it")
    max_connections: int = Field(1024, ge=1, description="per upstream endpoint")


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    models: list[ModelConfig] = Field(default_factory=list)
    state: StateConfig = StateConfig()
    limits: LimitsConfig = LimitsConfig()
    admin: AdminConfig = AdminConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    graphs: dict[str, Any] = Field(
        default_factory=dict, description="name -> InferenceGraph spec; validated by the graph engine"
    )
    graph_files: list[str] = Field(
        default_factory=list,
        description="files or directories of graphs (KServe manifests or graphs: mappings)",
    )
    graph_propagate_headers: list[str] = Field(
        default_factory=list,
        description="regexes of request headers passed to every graph step (PROPAGATE_HEADERS)",
    )


def load_config(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> GatewayConfig:
    """Read, merge and validate a gateway config; every problem is reported in one ConfigError."""
    source = str(path) if path is not None else "<defaults>"
    return validate_config(merged_data(path, env=env, overrides=overrides), source)


def merged_data(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw config after precedence is applied, before validation."""
    data: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    data = _deep_merge(data, env_overrides(os.environ if env is None else env))
    return _deep_merge(data, dict(overrides or {}))


def validate_config(data: Any, source: str) -> GatewayConfig:
    # Uniqueness is checked on the raw data, beside pydantic's checks, so that a file with
    # several problems reports all of them (a model validator would run only on valid fields).
    problems = _duplicate_names(data)
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = [_describe(err) for err in exc.errors()] + problems
    if problems:
        raise ConfigError(source, problems)
    return config


def _duplicate_names(data: Any) -> list[str]:
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return []
    problems: list[str] = []
    seen_models: set[str] = set()
    for i, model in enumerate(models):
        if not isinstance(model, dict):
            continue
        name = model.get("name")
        if isinstance(name, str):
            if name in seen_models:
                problems.append(f"models[{i}].name: model names must be unique; {name!r} is repeated")
            seen_models.add(name)
        endpoints = model.get("endpoints")
        seen_endpoints: set[str] = set()
        for j, endpoint in enumerate(endpoints if isinstance(endpoints, list) else []):
            if not isinstance(endpoint, dict) or not isinstance(endpoint.get("url", ""), str):
                continue
            label = endpoint.get("name") or _default_endpoint_name(endpoint.get("url", ""))
            if label in seen_endpoints:
                problems.append(
                    f"models[{i}].endpoints[{j}].name: endpoint names must be unique within a model; "
                    f"{label!r} is repeated (it defaults to host:port)"
                )
            seen_endpoints.add(label)
    return problems


def _default_endpoint_name(url: str) -> str:
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return url
    return f"{parts.hostname}:{port}"


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`MODELYARD_A__B=v` becomes {"a": {"b": v}}, with v read as a YAML scalar (numbers, booleans)."""
    result: dict[str, Any] = {}
    for key, raw in env.items():
        if not key.startswith(ENV_PREFIX) or "__" not in key:
            continue
        parts = key[len(ENV_PREFIX) :].lower().split("__")
        node = result
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        try:
            node[parts[-1]] = yaml.safe_load(raw) if raw else raw
        except yaml.YAMLError:
            node[parts[-1]] = raw
    return result


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(path), [f"{where}invalid YAML: {problem}"]) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(str(path), [f"expected a mapping at the top level, got {type(data).__name__}"])
    return data


def _deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _describe(err: Mapping[str, Any]) -> str:
    path = ""
    for part in err["loc"]:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    message = err["msg"].removeprefix("Value error, ")
    if err["type"] == "literal_error":
        message = f"expected one of {err['ctx']['expected']}"
    elif err["type"] == "extra_forbidden":
        message = "unknown field"
    got = err.get("input")
    shown = (
        ""
        if err["type"] in ("missing", "extra_forbidden") or isinstance(got, dict | list)
        else f" (got {got!r})"
    )
    return f"{path or '(top level)'}: {message}{shown}"
