"""Typed gateway configuration, validated once and passed in (DESIGN.md habit 5).

Precedence: CLI flags > `MODELYARD_*` environment variables > the YAML file > defaults.
Environment variables address nested fields with a double underscore:
`MODELYARD_LISTEN__PORT=9000`, `MODELYARD_ADMIN__TOKEN=secret`, `MODELYARD_STATE__BACKEND=redis`.
A problem names where the value came from: the flag, the variable, or the file and the field path.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from modelyard.errors import ConfigError

StrategyName = Literal[
    "round_robin", "random", "least_pending", "kv_aware", "cost_aware", "resource_aware", "prefix_aware"
]
STRATEGY_NAMES: tuple[str, ...] = StrategyName.__args__  # type: ignore[attr-defined]

ENV_PREFIX = "MODELYARD_"
MAX_WORKERS = 512  # listen.workers
AUTO_WORKERS = 8  # the most "auto" starts: a gateway rarely needs more cores, and each is a process
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


# The JSON schema says what `_parse_duration` takes (routes are PUT over HTTP; see /openapi.json).
_DURATION_SCHEMA = {
    "anyOf": [
        {"type": "number", "minimum": 0},
        {"type": "string", "pattern": r"^[ \t\n\r]*[0-9]+(\.[0-9]+)?[ \t\n\r]*(ms|s|m|h)?[ \t\n\r]*$"},
    ]
}
Seconds = Annotated[float, BeforeValidator(_parse_duration), Field(ge=0), WithJsonSchema(_DURATION_SCHEMA)]

# Control characters (HTAB aside) may not stand in a header field (aiohttp's and llhttp's rule).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")


def _header_safe(value: str) -> str:
    if _CONTROL.search(value):
        raise ValueError(
            "may not hold control characters such as CR, LF or NUL: it is sent in the X-Modelyard-* "
            "answer headers"
        )
    return value


# A name the gateway sends in its answers' headers (X-Modelyard-Backend, -Route, -Subset).
HeaderName = Annotated[str, AfterValidator(_header_safe)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


TlsVersion = Literal["1.2", "1.3"]


class TlsServerConfig(_Strict):
    """TLS on a listener: its certificate and key from files (PEM), reloaded when they change (as
    cert-manager rotates them: connections already open keep theirs), and optionally the client's
    certificate verified against `client_ca_file` (mutual TLS)."""

    cert_file: str = Field(min_length=1, description="the certificate chain, leaf first (PEM)")
    key_file: str = Field(min_length=1, description="its private key (PEM, unencrypted)")
    client_ca_file: str = Field(
        "", description="verify clients' certificates against these CAs (PEM); '' = clients need none"
    )
    client_cert: Literal["required", "optional"] = Field(
        "required", description="with client_ca_file: refuse a client without one, or only check one sent"
    )
    min_version: TlsVersion = "1.2"
    reload_interval: Seconds = Field(
        10.0, gt=0, description="how often the files are checked for a new certificate"
    )


class TlsClientConfig(_Strict):
    """TLS to a server: verified against `ca_file` (default: the system's CAs), by the URL's host
    name or `server_name` (also sent as SNI), with an optional client certificate for servers (or
    meshes) that require mutual TLS. Files are read again when they change."""

    ca_file: str = Field("", description="CAs to verify the server with (PEM); '' = the system's")
    server_name: str = Field("", description="the name to verify and send as SNI; '' = the URL's host")
    cert_file: str = Field("", description="a client certificate chain (PEM), for mutual TLS")
    key_file: str = Field("", description="its private key (PEM)")
    verify: bool = Field(True, description="false: do not verify the server at all (testing only)")
    min_version: TlsVersion = "1.2"

    @model_validator(mode="after")
    def _pair(self) -> TlsClientConfig:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together")
        return self


class ListenConfig(_Strict):
    """The client-facing listener: where it binds, how long a connection may take and idle, how many
    may be open, and how it shuts down (nginx's and Envoy's names)."""

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    grpc_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="OIP v2 over gRPC (inference.GRPCInferenceService, what tritonclient.grpc calls) on "
        "this port of `host`, routed like REST; null = off, 0 = any free port",
    )
    header_timeout: Seconds = Field(
        10.0,
        description="reading a request head, from the connection's start or a keep-alive request's "
        "first byte; past it 408 and close (nginx client_header_timeout); 0 = none",
    )
    keepalive_timeout: Seconds = Field(
        75.0, description="an idle keep-alive connection is closed after this (nginx's default); 0 = none"
    )
    max_connections: int = Field(
        10_000, ge=0, description="client connections open at once; past it 503 and close; 0 = no limit"
    )
    drain_seconds: Seconds = Field(
        5.0,
        description="after SIGTERM/SIGINT: readiness answers 503 and every request is still served "
        "(with Connection: close) this long before the listener closes",
    )
    shutdown_timeout: Seconds = Field(
        20.0, description="after the drain: how long requests in flight may take before they are cancelled"
    )
    lean: bool = Field(
        True,
        description="serve the proxied routes (OpenAI, OIP v2 and KServe v1 inference and model "
        "metadata) from a lean HTTP/1.1 connection (asyncio + httptools), 20-36% less CPU per "
        "request; a connection moves to aiohttp's server at its first other request; false = aiohttp only",
    )
    workers: Annotated[int, Field(ge=1, le=MAX_WORKERS)] | Literal["auto"] = Field(
        "auto",
        description="gateway processes serving this port (SO_REUSEPORT), sharing in-flight counts, "
        "health verdicts, ejections, affinities, the routing log, admin changes and /metrics; auto = "
        f"one per CPU the process may run on (its CPU affinity), at most {AUTO_WORKERS}, and one on a "
        "system other than Linux or with placement.scheduler",
    )
    worker_heartbeat_timeout: Seconds = Field(
        5.0,
        le=3600,
        description="listen.workers > 1: a worker's event loop proves it turns to the parent every tenth "
        "of this; a worker that serves and sends no heartbeat for this long (stopped, or its loop "
        "blocked) is killed and started again; 0 = not watched",
    )
    busy_poll: Seconds = Field(
        0.0,
        le=1.0,
        description="once a worker starts answering a request on the lean listener, and again once the "
        "answer is written, keep polling for this long instead of sleeping, while that worker answers "
        "at most one lean request (HAProxy's busy-polling): a backend's answer or the client's next "
        "request that comes within it is read at once, not after the CPU wakes (slow on virtual "
        "machines); keeps a CPU busy while requests keep coming within it; 0 = off",
    )
    tls: TlsServerConfig | None = Field(
        None, description="serve HTTPS (and gRPC over TLS on grpc_port) with these files; null = plain"
    )


def _host_and_port(url: str, schemes: tuple[str, ...]) -> bool:
    """Whether `url` is scheme://host:port and nothing more (no path, query, fragment or user)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = None
    extra = parts.path.strip("/") or parts.query or parts.fragment or "@" in parts.netloc
    return parts.scheme in schemes and bool(parts.hostname) and bool(port) and not extra


class EndpointConfig(_Strict):
    """One upstream inference server serving the model."""

    url: str
    name: HeaderName = Field("", description="label in metrics and X-Modelyard-Backend; default host:port")
    weight: int = Field(1, ge=0, le=10_000, description="relative share for round_robin and random")
    cost_per_1k_tokens: float = Field(0.0, ge=0, description="price used by cost_aware")
    subset: HeaderName = Field(
        "default", min_length=1, description="the endpoint group routes send traffic to"
    )
    metrics_url: str = Field("", description="resource_aware: where to scrape; '' = <url>/metrics")
    gpu_metrics_url: str = Field("", description="resource_aware: a DCGM exporter for this server's GPU")
    grpc_url: str = Field(
        "",
        description="the server's OIP v2 gRPC port, grpc://host:port (grpcs:// over TLS): OIP gRPC calls "
        "routed here are relayed as gRPC, their tensors never converted; '' = sent as REST to url",
    )
    tls: TlsClientConfig | None = Field(
        None,
        description="TLS to this endpoint (an https:// url, a grpcs:// grpc_url); null = the model's tls, "
        "else upstream.tls",
    )
    kv_events: str | None = Field(
        None,
        description="the server's KV-cache events (vLLM's --kv-events-config endpoint), tcp://host:port: "
        "prefix_aware routes on the blocks it says it holds (precise mode; needs prefix_aware.tokenizer)",
    )
    kv_replay: str | None = Field(
        None,
        description="the server's KV-event replay endpoint (vLLM's replay_endpoint), tcp://host:port: "
        "events missed are asked for again; null = a gap sends prefix_aware back to approximate routing for "
        "this endpoint until its index is rebuilt",
    )

    @field_validator("kv_events", "kv_replay")
    @classmethod
    def _zmq_tcp_url(cls, url: str | None) -> str | None:
        if not url:
            return url
        if not _host_and_port(url, ("tcp",)) or urlsplit(url).hostname == "*":
            raise ValueError(
                "expected tcp://host:port with the server's host (not vLLM's bind address tcp://*:port), "
                "e.g. tcp://127.0.0.1:5557"
            )
        return url.rstrip("/")

    @model_validator(mode="after")
    def _replay_needs_events(self) -> EndpointConfig:
        if self.kv_replay and not self.kv_events:
            raise ValueError("kv_replay is set without kv_events: there are no events to replay")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, url: str) -> str:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host, e.g. http://127.0.0.1:9000")
        return url.rstrip("/")

    @field_validator("grpc_url")
    @classmethod
    def _grpc_url(cls, url: str) -> str:
        if not url:
            return url
        if not _host_and_port(url, ("grpc", "grpcs")):
            raise ValueError("expected grpc://host:port (grpcs:// over TLS), e.g. grpc://127.0.0.1:8081")
        return url.rstrip("/")

    @model_validator(mode="after")
    def _tls_used(self) -> EndpointConfig:
        secure = urlsplit(self.url).scheme == "https" or urlsplit(self.grpc_url).scheme == "grpcs"
        if self.tls is not None and not secure:
            raise ValueError("tls is set, but url is not https:// and grpc_url not grpcs://: nothing uses it")
        return self

    @model_validator(mode="after")
    def _fill_defaults(self) -> EndpointConfig:
        # The values the defaults stand for, so that --print-config shows what is used.
        if not self.name:
            object.__setattr__(self, "name", _default_endpoint_name(self.url))
        if not self.metrics_url:
            object.__setattr__(self, "metrics_url", self.url + "/metrics")
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
    load_margin: int | None = Field(
        1,
        ge=0,
        description="the remembered endpoint is skipped for the least loaded one when it has more than "
        "this many requests in flight beyond it (null: always the remembered one, as InferFlow)",
    )


class PrefixAwareConfig(_Strict):
    """prefix_aware: an index of the prompt chunks each endpoint was sent (balancing/prefix.py)."""

    chunk_chars: int = Field(64, ge=1, description="characters per prompt chunk the index names")
    max_chunks_per_endpoint: int = Field(
        16384,
        ge=0,
        description="chunks remembered per endpoint, least recently used dropped: size it "
        "like a server's prefix cache (its tokens x about 4 characters / chunk_chars)",
    )
    load_margin: int | None = Field(
        None,
        ge=0,
        description="requests in flight an endpoint may have beyond the least loaded one and still be "
        "chosen for the prefix it holds, when it would finish the request first (0: the cache only "
        "decides among the least loaded; null: half of `slots`, at least 1)",
    )
    slots: int = Field(
        1,
        ge=1,
        description="requests a server works on at once without slowing (its request slots or "
        "batch size, as far as its latency stays flat): how many lanes the expected queue has",
    )
    tokenizer: str | None = Field(
        None,
        description="precise mode (endpoints with kv_events): the model's tokenizer.json, or a Hugging "
        "Face model directory holding it and tokenizer_config.json (its chat template), so that prompts "
        "are cut into the blocks the servers hash",
    )
    chat_template: str | None = Field(
        None, description="precise mode: a Jinja chat template file, in place of tokenizer_config.json's"
    )
    kv_max_blocks: int = Field(
        131072,
        ge=1,
        description="precise mode: blocks remembered per endpoint, the least recently stored dropped",
    )
    kv_stale_after: Seconds = Field(
        5.0,
        gt=0,
        description="precise mode: an endpoint that answered 8 requests and sent no event for this long is "
        "routed approximately until its events resume",
    )


RetryOn = Literal["connect-failure", "reset", "5xx", "gateway-error", "retriable-4xx"]
DEFAULT_RETRY_ON: tuple[RetryOn, ...] = ("connect-failure", "reset", "gateway-error")
# When a model's request goes on to its `fallbacks` (gateway/fallback.py says what each one covers).
FallbackOn = Literal["saturated", "no_endpoint", "server_error", "timeout", "context_length"]
DEFAULT_FALLBACK_ON: tuple[FallbackOn, ...] = FallbackOn.__args__  # type: ignore[attr-defined]


class HeaderMatch(_Strict):
    """One request header test (Envoy's header matcher): `exact`, `prefix` or `regex` (a full
    match), or none of them to require only that the header is present."""

    name: str = Field(min_length=1)
    exact: str | None = None
    prefix: str | None = None
    regex: str | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> HeaderMatch:
        if sum(v is not None for v in (self.exact, self.prefix, self.regex)) > 1:
            raise ValueError("give at most one of exact, prefix, regex")
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"regex does not compile: {exc}") from None
        return self


class BodyMatch(_Strict):
    """A top-level or dotted field of the JSON body (`metadata.tier`) equal to `exact`."""

    field: str = Field(min_length=1)
    exact: str | int | float | bool | None = None


class RouteMatch(_Strict):
    """Every given test must hold. `model` is the model name the request asked for."""

    headers: list[HeaderMatch] = Field(default_factory=list)
    model: str | None = None
    body: list[BodyMatch] = Field(default_factory=list)


class Destination(_Strict):
    subset: HeaderName = Field(min_length=1)
    weight: int = Field(100, ge=0, le=10_000)


class RetryPolicy(_Strict):
    """Envoy's retry policy. `attempts` counts retries after the first try. A retry goes to another
    endpoint when one is available; a stream is never retried once bytes reached the client."""

    attempts: int = Field(2, ge=0, le=10)
    retry_on: list[RetryOn] = Field(default_factory=lambda: list(DEFAULT_RETRY_ON))
    retriable_status_codes: list[int] = Field(default_factory=list)
    base_interval: Seconds = 0.025
    max_interval: Seconds = 0.25


class MirrorPolicy(_Strict):
    """Copy `percent` of the route's requests to `subset`; the copy's answer is only compared."""

    subset: HeaderName = Field(min_length=1)
    percent: float = Field(100.0, ge=0, le=100)


class RouteConfig(_Strict):
    name: HeaderName = Field(min_length=1)
    match: RouteMatch | None = Field(None, description="none: the default route")
    destinations: list[Destination] = Field(min_length=1)
    hash_on: str | None = Field(None, description="a header whose value keeps a session on one subset")
    timeout: Seconds = Field(600.0, description="whole request, retries included; 0 = none")
    per_try_timeout: Seconds = Field(0.0, description="each try until its response head; 0 = none")
    stream_idle_timeout: Seconds = Field(60.0, description="a stream silent this long fails; 0 = none")
    retries: RetryPolicy = RetryPolicy()
    mirror: MirrorPolicy | None = None


class OutlierDetectionConfig(_Strict):
    """Passive ejection, Envoy's names and defaults. `consecutive_5xx` counts 5xx answers and
    connect failures; latency ejection compares each endpoint's recent median with its peers'."""

    consecutive_5xx: int = Field(5, ge=1)
    base_ejection_time: Seconds = 30.0
    max_ejection_time: Seconds = 300.0
    max_ejection_percent: float = Field(10.0, ge=0, le=100)
    latency_factor: float = Field(3.0, gt=1, description="eject above this many times the pool median")
    latency_min_requests: int = Field(
        10,
        ge=1,
        description="recent latency samples an endpoint needs to be judged (one per answer, at most "
        "256 per latency_window: one per window/256 seconds)",
    )
    latency_window: Seconds = Field(30.0, description="how far back 'recent' latency reaches")
    enabled: bool = True


class CircuitBreakerConfig(_Strict):
    """Back-pressure (Envoy's circuit breakers). 0 = unlimited."""

    max_requests: int = Field(0, ge=0, description="in flight per endpoint")
    max_pending_requests: int = Field(0, ge=0, description="waiting for an endpoint, per model")
    queue_timeout: Seconds = Field(1.0, description="how long a request may wait for an endpoint")


class RetryBudgetConfig(_Strict):
    """Envoy's retry budget: retries in flight may be at most `budget_percent` of active requests,
    with `min_retry_concurrency` allowed regardless."""

    budget_percent: float = Field(20.0, ge=0, le=100)
    min_retry_concurrency: int = Field(3, ge=0)


class ResourceMetricNames(_Strict):
    """Prometheus names to read; defaults are vLLM's and the DCGM exporter's."""

    queue_depth: str = "vllm:num_requests_waiting"
    running: str = "vllm:num_requests_running"
    kv_cache_usage: list[str] = Field(
        default_factory=lambda: ["vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"],
        description="the first name present is read: vLLM V1's, then V0's (a single name is accepted)",
    )

    @field_validator("kv_cache_usage", mode="before")
    @classmethod
    def _one_or_many(cls, value: object) -> object:
        return [value] if isinstance(value, str) else value

    sm_utilization: list[str] = Field(
        default_factory=lambda: ["DCGM_FI_PROF_SM_ACTIVE", "DCGM_FI_DEV_GPU_UTIL"]
    )
    memory_used: str = "DCGM_FI_DEV_FB_USED"
    memory_free: str = "DCGM_FI_DEV_FB_FREE"


class ResourceAwareConfig(_Strict):
    """Score = w_sm (1 - SM use) + w_mem (1 - memory used) + w_queue exp(-k queue depth)."""

    scrape_interval: Seconds = 5.0
    stale_after: Seconds = 15.0
    max_queue_depth: int = Field(64, ge=1)
    w_sm: float = Field(0.4, ge=0)
    w_mem: float = Field(0.3, ge=0)
    w_queue: float = Field(0.3, ge=0)
    k: float = Field(0.3, gt=0)
    metrics: ResourceMetricNames = ResourceMetricNames()


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
    prefix_aware: PrefixAwareConfig = PrefixAwareConfig()
    routes: list[RouteConfig] = Field(
        default_factory=list, description="tried in order; none: one default route"
    )
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    healthy_panic_threshold: float = Field(50.0, ge=0, le=100, description="below this % healthy, use all")
    circuit_breakers: CircuitBreakerConfig = CircuitBreakerConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    resource_aware: ResourceAwareConfig = ResourceAwareConfig()
    tls: TlsClientConfig | None = Field(
        None,
        description="TLS to this model's https:// and grpcs:// endpoints without their own; "
        "null = upstream.tls",
    )
    fallbacks: list[HeaderName] = Field(
        default_factory=list,
        description="models to try, in order, when this one fails as fallback_on says; only this "
        "model's list is tried, never a fallback's own",
    )
    fallback_on: list[FallbackOn] = Field(
        default_factory=lambda: list(DEFAULT_FALLBACK_ON),
        description="what sends a request on to the next fallback: saturated (429: full, queue full), "
        "no_endpoint (503: none healthy), server_error (5xx after retries, refused connections), "
        "timeout (504), context_length (the server says the prompt is too long, or context_window)",
    )
    context_window: int | None = Field(
        None,
        ge=1,
        description="tokens the model takes, prompt and max_tokens together: a request estimated "
        "longer goes straight to a fallback whose window takes it; null: only the server says",
    )

    @model_validator(mode="after")
    def _kv_events_need_a_tokenizer(self) -> ModelConfig:
        named = [i for i, e in enumerate(self.endpoints) if e.kv_events]
        if self.prefix_aware.chat_template and not self.prefix_aware.tokenizer:
            raise ValueError(
                "prefix_aware.chat_template is set but prefix_aware.tokenizer is not: it renders for it"
            )
        if named and not self.prefix_aware.tokenizer:
            raise ValueError(
                f"endpoints[{named[0]}].kv_events is set but prefix_aware.tokenizer is not: the gateway "
                "needs the model's tokenizer to match prompts against the blocks the server reports"
            )
        return self

    @model_validator(mode="after")
    def _routes_name_subsets(self) -> ModelConfig:
        subsets = {e.subset for e in self.endpoints}
        problems = []
        for i, route in enumerate(self.routes):
            named = [d.subset for d in route.destinations] + ([route.mirror.subset] if route.mirror else [])
            for subset in named:
                if subset not in subsets:
                    problems.append(f"routes[{i}] ({route.name}): no endpoint has subset {subset!r}")
        names = [r.name for r in self.routes]
        problems += [
            f"route name {n!r} is used twice" for n in sorted({n for n in names if names.count(n) > 1})
        ]
        if problems:
            raise ValueError("; ".join(problems) + f" (subsets: {', '.join(sorted(subsets))})")
        return self


class StateConfig(_Strict):
    """Where gateways keep shared routing state (kv_aware affinity, prefix_aware's index)."""

    backend: Literal["memory", "redis"] = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "modelyard:"
    max_entries: int = Field(100_000, ge=1, description="bound on in-memory keys (LRU), also redis' fallback")
    timeout: Seconds = Field(0.25, description="redis: per-operation deadline before falling back")
    share_prefix_index: bool = Field(
        True,
        description="send what prefix_aware records (which endpoint was sent which prompt chunks) to the "
        "other gateways on this Redis and key_prefix (redis), or to the other workers of this gateway "
        "(memory, listen.workers > 1), and apply theirs",
    )


class LimitsConfig(_Strict):
    max_body_bytes: int = Field(32 * 1024 * 1024, ge=1, description="inference request bodies")
    max_admin_body_bytes: int = Field(
        1024 * 1024, ge=1, description="admin bodies (routes, graphs, strategy), parsed as YAML or JSON"
    )


class AdminConfig(_Strict):
    token: str | None = Field(
        None, min_length=1, description="when set, /admin/* and /strategy need this bearer token"
    )
    protect_graph_views: bool = Field(
        False,
        description="with a token, GET /v1/graphs and /v1/graphs/{name} need it too "
        "(graph specs list service URLs)",
    )
    max_log_streams: int = Field(
        16,
        ge=1,
        description="live routing-log streams (/admin/log/stream) open at once; each costs every "
        "request a queue put, so one more is refused with 503 and Retry-After",
    )


class AuthConfig(_Strict):
    """Who may call the inference routes: API keys of tenants (security/api_keys.py)."""

    enabled: bool = Field(
        False,
        description="every inference call (OpenAI, OIP over HTTP and gRPC, KServe v1, graphs, "
        "GET /v1/models) needs an API key from keys_file: 'Authorization: Bearer <key>' or 'api-key: "
        "<key>'; off: anyone who reaches the port may call (the demo)",
    )
    keys_file: str | None = Field(
        None,
        description="the tenants and their keys (YAML: tenants: [{name, models}], keys: [{name, "
        "tenant, key or sha256, models}]), read again when it changes; a Kubernetes Secret mounted "
        "as a file is one",
    )

    runtime_keys_file: str | None = Field(
        None,
        description="where keys made at runtime (POST /admin/keys, `modelyard key create`) are kept "
        "when state.backend is memory (a JSON file of hashes, shared by this gateway's workers); with "
        "redis they are kept in Redis, shared by every gateway on it; neither: runtime keys are off",
    )
    key_refresh_interval: Seconds = Field(
        1.0,
        gt=0,
        description="how often each worker checks whether runtime keys changed: a key revoked on one "
        "gateway is refused by all within about this long",
    )
    quota_store_down: Literal["local", "allow", "refuse"] = Field(
        "local",
        description="what quotas do while Redis does not answer (state.backend redis): local counts "
        "in each worker, with its share of each limit (limit / listen.workers); allow lets requests "
        "through uncounted; refuse answers 503",
    )

    @model_validator(mode="after")
    def _needs_keys(self) -> AuthConfig:
        if self.enabled and self.keys_file is None:
            raise ValueError("enabled needs keys_file: the file naming the tenants and their keys")
        return self


def on_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name, "" (every address), "0.0.0.0": reachable from elsewhere
        return False


MIN_EXPOSED_TOKEN = 16  # a token others may guess at must not be short


def check_admin_exposure(config: GatewayConfig, source: str) -> None:
    """A gateway others can reach must not leave its admin API (routes, strategies, graphs) open:
    ConfigError unless `admin.token` is set. Checked when serving, not in validation: a pod's token
    comes from the environment it starts in (`modelyard deploy render` wires it from a Secret)."""
    if on_loopback(config.listen.host):
        return
    where = config.listen.host or "(every address)"
    if config.admin.token is None:
        problem = (
            f"listen.host: {where} is reachable from other machines and admin.token is not set, so anyone "
            "could change routes, strategies and graphs: set admin.token (MODELYARD_ADMIN__TOKEN), or "
            "listen on 127.0.0.1"
        )
        raise ConfigError(source, [problem])
    if len(config.admin.token) < MIN_EXPOSED_TOKEN:  # (the length only: a token is never shown)
        problem = (
            f"admin.token: at least {MIN_EXPOSED_TOKEN} characters on an address others reach "
            f"(listen.host {where}); e.g. openssl rand -hex 24"
        )
        raise ConfigError(source, [problem])


class UpstreamConfig(_Strict):
    connect_timeout: Seconds = 2.0
    timeout: Seconds = Field(600.0, description="whole-request deadline; 0 disables it")
    max_connections: int = Field(1024, ge=1, description="per upstream endpoint")
    tls: TlsClientConfig | None = Field(
        None,
        description="TLS to every https:// and grpcs:// endpoint without its own (a model's or an "
        "endpoint's tls wins, as a whole); null = verified against the system's CAs, host name checked",
    )


class PlacedHealthCheckConfig(HealthCheckConfig):
    """A placed model's health check: OIP v2 servers all answer `/v2/health/live`."""

    path: str = "/v2/health/live"


class PlacedModelDefaults(_Strict):
    """The settings of every model the scheduler places (a placed model has no config entry of its
    own). The defaults differ from a configured model's where the servers differ: placed models run
    on OIP v2 servers (MLServer, Triton, the sim-worker), which all answer `/v2/health/live`, and
    replicas of one server may hold different loads, which least_pending follows without scraping
    anything (round_robin would keep feeding a replica that is slow because its neighbours share it)."""

    strategy: StrategyName = "least_pending"
    protocol: Literal["v1", "v2"] = Field("v2", description="how graph steps naming a placed model call it")
    health_check: PlacedHealthCheckConfig = PlacedHealthCheckConfig()
    kv_aware: KvAwareConfig = KvAwareConfig()
    prefix_aware: PrefixAwareConfig = PrefixAwareConfig()
    outlier_detection: OutlierDetectionConfig = OutlierDetectionConfig()
    healthy_panic_threshold: float = Field(50.0, ge=0, le=100)
    circuit_breakers: CircuitBreakerConfig = CircuitBreakerConfig()
    retry_budget: RetryBudgetConfig = RetryBudgetConfig()
    resource_aware: ResourceAwareConfig = ResourceAwareConfig()


class PlacementConfig(_Strict):
    """Follow a modelyard scheduler's feed (`GET /v1/feed`): every model it places becomes routable."""

    scheduler: str | None = Field(
        None, description="host:port or http(s)://host:port of the scheduler's REST API; none: no placement"
    )
    models: PlacedModelDefaults = PlacedModelDefaults()
    retry_after: int = Field(
        2, ge=1, description="Retry-After seconds on the 503 for a placed model that is not available yet"
    )
    connect_timeout: Seconds = 2.0
    ping_timeout: Seconds = Field(
        15.0, gt=0, description="a feed silent this long (no line, not even a ping) is dead: reconnect"
    )
    reconnect_base_interval: Seconds = Field(
        0.5, gt=0, description="first reconnect delay; doubles per failure, with jitter"
    )
    reconnect_max_interval: Seconds = Field(30.0, gt=0, description="cap on the reconnect delay")
    startup_wait: Seconds = Field(
        5.0,
        description="how long start-up waits for the first snapshot before serving without it "
        "(placed models answer 404 until it comes)",
    )
    token_file: str | None = Field(
        None,
        min_length=1,
        description="a file holding the bearer token (role read) sent to the scheduler, read again at "
        "each connection; null = none",
    )
    tls: TlsClientConfig | None = Field(
        None,
        description="an https scheduler is verified with these (a CA file, a client certificate for "
        "mutual TLS); null = against the system's CAs",
    )
    allow_plain_token: bool = Field(
        False,
        description="send token_file's token over plain http to a scheduler that is not on loopback "
        "(refused otherwise: it could be read on the way); for a network you accept as plain text",
    )

    @field_validator("scheduler")
    @classmethod
    def _scheduler_url(cls, value: str | None) -> str | None:
        return None if value is None or not value.strip() else scheduler_url(value)


def scheduler_url(address: str) -> str:
    """`host:port` or `http(s)://host:port[/]` -> `http(s)://host:port`; ValueError if neither (its
    message leaves the address out: whoever reports it says what it got, and from where)."""
    address = address.strip()
    url = address if "://" in address else f"http://{address}"
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        port = None
        parts = urlsplit("")
    if parts.scheme not in ("http", "https") or not parts.hostname or (port is None and "://" not in address):
        raise ValueError("expected host:port or http://host:port for the scheduler")
    return url.rstrip("/")


OTLP_TRACES_PATH = "/v1/traces"
GATEWAY_SERVICE_NAME = "modelyard-gateway"  # the gateway's spans' service.name unless the config says


class TelemetryConfig(_Strict):
    """OpenTelemetry tracing (telemetry/): off unless `otlp_endpoint` is set. Spans go over OTLP/HTTP
    (protobuf) to an OpenTelemetry collector, Jaeger (port 4318), Tempo, or any OTLP receiver."""

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP base URL (spans go to <base>/v1/traces) or a full .../v1/traces URL; "
        "null = tracing off (OTEL_EXPORTER_OTLP_ENDPOINT is read when this is not set)",
    )
    service_name: str = Field(
        "", description="the service.name of this process' spans; '' = the role's own (modelyard-gateway)"
    )
    sample_ratio: float = Field(
        1.0,
        ge=0,
        le=1,
        description="share of new traces recorded (parent-based: a request whose client sent a sampled "
        "traceparent is always recorded, an unsampled one never)",
    )
    headers: dict[str, str] = Field(
        default_factory=dict, description="sent with every export, e.g. an API key for a hosted backend"
    )
    timeout: Seconds = Field(
        5.0,
        gt=0,
        description="one export, its retries included; also the most a stopping process waits to send "
        "its last spans to a collector that does not answer",
    )

    @field_validator("otlp_endpoint")
    @classmethod
    def _otlp_url(cls, url: str | None) -> str | None:
        return otlp_url(url)

    @property
    def traces_url(self) -> str | None:
        """Where spans are posted: the endpoint as given when it names /v1/traces, else below it."""
        if self.otlp_endpoint is None:
            return None
        if self.otlp_endpoint.endswith(OTLP_TRACES_PATH):
            return self.otlp_endpoint
        return self.otlp_endpoint + OTLP_TRACES_PATH


class LoggingConfig(_Strict):
    """What the gateway logs beyond its warnings: an access log line per request."""

    access_log: bool = Field(
        False,
        description="one line per request at info on the logger modelyard.access: request id, model, "
        "route, backend, status, attempts, duration, bytes (and trace_id with tracing on)",
    )
    format: Literal["json", "text"] = Field(
        "json", description="access log lines as one JSON object, or as key=value text"
    )
    level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="the gateway's log level (serve --log-level overrides it)"
    )


class GatewayConfig(_Strict):
    listen: ListenConfig = ListenConfig()
    models: list[ModelConfig] = Field(default_factory=list)
    state: StateConfig = StateConfig()
    limits: LimitsConfig = LimitsConfig()
    admin: AdminConfig = AdminConfig()
    auth: AuthConfig = AuthConfig()
    upstream: UpstreamConfig = UpstreamConfig()
    placement: PlacementConfig = PlacementConfig()
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
    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig, validate_default=True)
    logging: LoggingConfig = LoggingConfig()

    @field_validator("telemetry")
    @classmethod
    def _gateway_service_name(cls, telemetry: TelemetryConfig) -> TelemetryConfig:
        # '' stands for the role's own name: this is the gateway's (--print-config shows it).
        if telemetry.service_name:
            return telemetry
        return telemetry.model_copy(update={"service_name": GATEWAY_SERVICE_NAME})


def load_config(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
    variables: Mapping[str, str] | None = None,
) -> GatewayConfig:
    """Read, merge and validate a gateway config: `overrides` (the CLI's flags) over the `MODELYARD_*`
    variables of `env` (default: the process environment) over the file over defaults. A problem
    names where its value came from (`Origins`): the flag (`flags` maps a field path to its flag,
    e.g. {"listen.port": "--port"}), the variable, or the file and the field path. `variables` maps
    the field path of an override that a variable gave the command (a flag's envvar) to that variable,
    e.g. {"placement.scheduler": "MODELYARD_SCHEDULER"}: it is named as the variable it is."""
    environment = os.environ if env is None else env
    data = merged_data(path, env=environment, overrides=overrides)
    source = str(path) if path is not None else "<defaults>"
    return validate_config(data, source, Origins(environment, overrides, flags, variables))


def merged_data(
    path: str | Path | None,
    *,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """The raw config after precedence is applied, before validation."""
    data: dict[str, Any] = read_yaml(Path(path)) if path is not None else {}
    environment = os.environ if env is None else env
    data = deep_merge(data, env_overrides(environment))
    data = deep_merge(data, dict(overrides or {}))
    return with_otel_endpoint(data, environment)


FLAGS_SOURCE = "command line"
ENV_SOURCE = "environment"
Loc = tuple[str | int, ...]


class Origins:
    """Which layer above the file set each value of a merged config, so that a problem names what the
    user wrote: `--port` or `MODELYARD_LISTEN__PORT` rather than a file that never said it."""

    def __init__(
        self,
        env: Mapping[str, str],
        overrides: Mapping[str, Any] | None = None,
        flags: Mapping[str, str] | None = None,
        variables: Mapping[str, str] | None = None,
    ) -> None:
        names = flags or {}
        by_variable = variables or {}  # overrides a variable gave the command, not a flag
        set_by_flags: list[tuple[Loc, str, Any]] = []
        set_by_env: list[tuple[Loc, str, Any]] = []
        for leaf, value in _leaves(dict(overrides or {})):
            dotted = ".".join(map(str, leaf))
            if dotted in by_variable:  # it overrides the MODELYARD_<SECTION>__<FIELD> ones: first
                set_by_env.append((leaf, by_variable[dotted], value))
            else:
                set_by_flags.append((leaf, names.get(dotted, _path_text(leaf)), value))
        tree = env_overrides(env)
        for key in sorted(env):
            path = _env_path(key)
            if path is not None:
                set_by_env.append((path, key, _at(tree, path)))
        # Highest precedence first: a flag replaced whatever a variable said about the same field.
        self._layers: list[tuple[str, list[tuple[Loc, str, Any]]]] = [
            (FLAGS_SOURCE, set_by_flags),
            (ENV_SOURCE, set_by_env),
        ]

    def locate(self, loc: Loc) -> tuple[str, str] | None:
        """(source, name) of the flag or variable that set the value at `loc`: `("environment",
        "MODELYARD_X__Y[0].name")`; None when the file (or a default) did."""
        for source, settings in self._layers:
            for path, name, value in settings:
                if loc[: len(path)] == path and _holds(value, loc[len(path) :]):
                    return source, name + _path_text(loc[len(path) :], nested=True)
                if path[: len(loc)] == loc and loc:  # it set a field inside loc's (an unknown one, say)
                    return source, f"{name} ({_path_text(loc)})"
        return None


def _leaves(data: dict[str, Any], prefix: Loc = ()) -> list[tuple[Loc, Any]]:
    found: list[tuple[Loc, Any]] = []
    for key, value in data.items():
        if isinstance(value, dict) and value:
            found += _leaves(value, (*prefix, key))
        else:
            found.append(((*prefix, key), value))
    return found


def _at(tree: Any, path: Loc) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def _holds(value: Any, rest: Loc) -> bool:
    """Whether `value`, set by one layer, holds the field `rest` below it. Mappings are merged key by
    key with the layers below, so a key it lacks came from them; a list replaces theirs whole."""
    for part in rest:
        if isinstance(value, list):
            return True
        if not isinstance(value, dict) or part not in value:
            return False
        value = value[part]
    return True


OTEL_ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
OTEL_DISABLED_ENV = "OTEL_SDK_DISABLED"


def otlp_url(url: str | None) -> str | None:
    """An OTLP endpoint as given (None or blank: tracing off); ValueError when it is not a URL."""
    if url is None or not url.strip():
        return None
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("expected an http:// or https:// URL, e.g. http://collector:4318")
    return url.strip().rstrip("/")


def otel_disabled(env: Mapping[str, str]) -> bool:
    """OpenTelemetry's standard OTEL_SDK_DISABLED=true: tracing off, whatever else turns it on."""
    return env.get(OTEL_DISABLED_ENV, "").strip().lower() == "true"


def with_otel_endpoint(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """OpenTelemetry's standard OTEL_EXPORTER_OTLP_ENDPOINT turns tracing on when the config gives
    no telemetry.otlp_endpoint (set in any of the file, MODELYARD_* or flags: ours wins); a bad one
    is reported naming the variable. OTEL_SDK_DISABLED=true turns tracing off."""
    telemetry = data.get("telemetry")
    if telemetry is not None and not isinstance(telemetry, dict):
        return data  # not a mapping: validation names the problem
    if otel_disabled(env):
        return {**data, "telemetry": {**(telemetry or {}), "otlp_endpoint": None}}
    endpoint = env.get(OTEL_ENDPOINT_ENV, "").strip()
    if not endpoint or (telemetry is not None and telemetry.get("otlp_endpoint") is not None):
        return data
    try:
        otlp_url(endpoint)
    except ValueError as exc:
        raise ConfigError(OTEL_ENDPOINT_ENV, [f"{exc} (got {endpoint!r})"]) from None
    return {**data, "telemetry": {**(telemetry or {}), "otlp_endpoint": endpoint}}


def validate_config(data: Any, source: str, origins: Origins | None = None) -> GatewayConfig:
    """A GatewayConfig from merged data; ConfigError naming `source` and each field path. With
    `origins`, a problem with a value a flag or a variable set names that flag or variable instead
    (source "command line" or "environment"): every problem of one source in one ConfigError, the
    flags' first, then the variables', then the file's."""
    # Uniqueness and the models fallbacks name are checked on the raw data, beside pydantic's
    # checks, so that a file with several problems reports all of them (a model validator would
    # run only on valid fields).
    problems = _duplicate_names(data) + _fallback_problems(data)
    try:
        config = GatewayConfig.model_validate(data)
    except ValidationError as exc:
        problems = [(err["loc"], describe_problem(err)) for err in exc.errors()] + problems
    if not problems:
        return config
    by_source: dict[str, list[str]] = {FLAGS_SOURCE: [], ENV_SOURCE: [], source: []}
    for loc, problem in problems:
        found = origins.locate(loc) if origins is not None else None
        if found is None:
            by_source[source].append(problem)
        else:
            where, name = found
            by_source[where].append(name + problem.removeprefix(_path_text(loc) or "(top level)"))
    where, listed = next((where, listed) for where, listed in by_source.items() if listed)
    raise ConfigError(where, listed)


def _duplicate_names(data: Any) -> list[tuple[Loc, str]]:
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return []
    problems: list[tuple[Loc, str]] = []
    seen_models: set[str] = set()
    for i, model in enumerate(models):
        if not isinstance(model, dict):
            continue
        name = model.get("name")
        if isinstance(name, str):
            if name in seen_models:
                problem = f"models[{i}].name: model names must be unique; {name!r} is repeated"
                problems.append((("models", i, "name"), problem))
            seen_models.add(name)
        endpoints = model.get("endpoints")
        seen_endpoints: set[str] = set()
        for j, endpoint in enumerate(endpoints if isinstance(endpoints, list) else []):
            if not isinstance(endpoint, dict) or not isinstance(endpoint.get("url", ""), str):
                continue
            label = endpoint.get("name") or _default_endpoint_name(endpoint.get("url", ""))
            if not isinstance(label, str):
                continue  # pydantic reports the wrong type
            if label in seen_endpoints:
                problem = (
                    f"models[{i}].endpoints[{j}].name: endpoint names must be unique within a model; "
                    f"{label!r} is repeated (it defaults to host:port)"
                )
                problems.append((("models", i, "endpoints", j, "name"), problem))
            seen_endpoints.add(label)
    return problems


def _fallback_problems(data: Any) -> list[tuple[Loc, str]]:
    """Each model's `fallbacks` name other models of this gateway, once each. Only the asked model's
    list is ever tried (not a fallback's own), so lists that name each other make no loop. With a
    scheduler, a name no config entry holds may be a model it places later: allowed (a fallback not
    served when a request needs it is skipped)."""
    models = data.get("models") if isinstance(data, dict) else None
    if not isinstance(models, list):
        return []
    placement = data.get("placement")
    follows = isinstance(placement, dict) and bool(placement.get("scheduler"))
    names = [m.get("name") for m in models if isinstance(m, dict)]
    known = {name for name in names if isinstance(name, str)}
    problems: list[tuple[Loc, str]] = []
    for i, model in enumerate(models):
        if not isinstance(model, dict) or not isinstance(model.get("fallbacks"), list):
            continue
        seen: set[str] = set()
        for j, name in enumerate(model["fallbacks"]):
            if not isinstance(name, str):
                continue  # pydantic reports the wrong type
            loc: Loc = ("models", i, "fallbacks", j)
            where = _path_text(loc)
            if name == model.get("name"):
                problems.append((loc, f"{where}: a model cannot fall back to itself ({name!r})"))
            elif name in seen:
                problems.append((loc, f"{where}: {name!r} is named twice"))
            elif name not in known and not follows:
                listed = ", ".join(sorted(known)) or "none"
                problems.append((loc, f"{where}: {name!r} is not a model of this gateway (models: {listed})"))
            seen.add(name)
    return problems


def _default_endpoint_name(url: str) -> str:
    try:
        parts = urlsplit(url)
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:  # a malformed URL: the url field's own check reports it
        return url
    return f"{parts.hostname}:{port}"


def _env_path(key: str) -> tuple[str, ...] | None:
    """The field path `MODELYARD_A__B` names, ("a", "b"); None for a variable that names none."""
    if not key.startswith(ENV_PREFIX) or "__" not in key:
        return None
    return tuple(key[len(ENV_PREFIX) :].lower().split("__"))


def env_overrides(env: Mapping[str, str]) -> dict[str, Any]:
    """`MODELYARD_A__B=v` becomes {"a": {"b": "v"}}. Values stay strings (pydantic turns "9000"
    into a port and "true" into a flag, and a token stays "0123" rather than becoming 83); only a
    value written as a JSON/YAML list or mapping (`[...]`, `{...}`) is parsed."""
    result: dict[str, Any] = {}
    for key in sorted(env):  # a stable order, whatever the environment's
        parts = _env_path(key)
        if parts is None:
            continue
        raw = env[key]
        node = result
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError("environment", [f"{key}: {'.'.join(parts[:-1])} is also set as a value"])
            node = child
        value: Any = raw
        if raw.lstrip()[:1] in ("[", "{"):
            try:
                value = yaml.safe_load(raw)
            except yaml.YAMLError:
                value = raw
        if isinstance(node.get(parts[-1]), dict):
            raise ConfigError("environment", [f"{key}: {'.'.join(parts)} also has fields set"])
        node[parts[-1]] = value
    return result


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML file's top-level mapping ({} when empty); a ConfigError naming the file otherwise."""
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


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`: mappings merge key by key, anything else replaces."""
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


# What a value of the wrong type should have been, in the words a config file uses.
_EXPECTED = {
    "int_parsing": "expected an integer",
    "int_type": "expected an integer",
    "int_from_float": "expected an integer",
    "float_parsing": "expected a number",
    "float_type": "expected a number",
    "bool_parsing": "expected true or false",
    "bool_type": "expected true or false",
}


def describe_problem(err: Mapping[str, Any]) -> str:
    """One pydantic error as `field.path[0].name: what was expected (got ...)`."""
    message = _EXPECTED.get(err["type"]) or err["msg"].removeprefix("Value error, ")
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
    return f"{_path_text(err['loc']) or '(top level)'}: {message}{shown}"


def _path_text(loc: Loc, *, nested: bool = False) -> str:
    """("models", 0, "name") as `models[0].name`; `nested`: as it follows a name (`.port`, `[0]`)."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path or nested else str(part))
    return path
