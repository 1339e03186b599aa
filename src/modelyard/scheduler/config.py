"""`SchedulerConfig`: everything `modelyard scheduler` takes, validated once.

Security (docs/placement.md, "Securing the scheduler"): `tls` serves the REST API and the agent port
over TLS; `tokens_file` (bearer tokens with the roles read and write) and `tls.client_ca_file`
(client certificates, with the role their URI SAN `spiffe://modelyard/role/read|write` names) guard
the REST API; `agent_ca_file` (mutual TLS, identities in the
certificates' URI SANs) and `agent_tokens_file` (a join token per server) guard the agent port. A
scheduler on an address other than loopback refuses to start without TLS and both kinds of
credentials unless `insecure` (`check_exposure`, at start).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, model_validator

from modelyard.config import TelemetryConfig, TlsServerConfig
from modelyard.placement.manifest import parse_quantity

DEFAULT_DB = "./modelyard-scheduler.db"
# The largest REST request body (one model spec): `modelyard model apply` sends each model of a file on its
# own and refuses, before sending any, a document larger than this (unparsed) or a spec whose JSON is.
MAX_BODY_BYTES = 1024 * 1024
# After a restart, how long the scheduler waits for the replicas it knew before placing without them.
# Agents reconnect with a backoff of at most a few seconds; a minute covers a slow pod restart too.
# The resync ends as soon as every known replica is back.
DEFAULT_RESYNC_TIMEOUT = 60.0
Bytes = Annotated[int, BeforeValidator(parse_quantity), Field(ge=0)]


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address of the REST API and the agents' gRPC service")
    port: int = Field(9004, ge=0, le=65535, description="REST API and feed; 0 picks a free port")
    agent_port: int = Field(9005, ge=0, le=65535, description="gRPC AgentService; 0 picks a free port")
    db: str = Field(DEFAULT_DB, min_length=1, description="SQLite file, or :memory:")
    resync_timeout: float = Field(
        DEFAULT_RESYNC_TIMEOUT,
        ge=0,
        description="after a restart, how long to wait for the known replicas before placing without "
        "them (the wait ends as soon as all are back)",
    )
    retry_interval: float = Field(10.0, gt=0, description="seconds between retries of failed models")
    drain_timeout: float = Field(60.0, gt=0, description="longest an AgentDrain call waits")
    feed_ping_interval: float = Field(5.0, gt=0, description="seconds between feed pings")
    feed_queue_size: int = Field(
        1024, ge=1, description="feed lines a slow reader may lag before it is dropped"
    )
    agent_queue_size: int = Field(1024, ge=1, description="operations queued per agent stream")
    max_body_bytes: int = Field(MAX_BODY_BYTES, ge=1, description="REST request bodies")
    # Model autoscaling (compat §9; placement/scaling.py): for models with min_replicas or max_replicas.
    autoscaling: bool = Field(True, description="scale models on lag and inactivity")
    scale_up_lag: float = Field(
        30.0, gt=0, description="requests in flight or queued per replica, above which a model is lagging"
    )
    scale_up_window: float = Field(5.0, ge=0, description="seconds the lag must stay high before a scale-up")
    scale_down_inactivity: float = Field(
        30.0, gt=0, description="seconds with no request before a scale-down"
    )
    scale_down_cooldown: float = Field(
        60.0, ge=0, description="seconds after any scaling before a scale-down"
    )
    scaling_interval: float = Field(1.0, gt=0, description="seconds between scaling decisions")
    stats_max_age: float = Field(
        10.0, gt=0, description="an agent's usage report older than this counts as none"
    )
    # Security: see the module's docstring and docs/placement.md.
    tls: TlsServerConfig | None = Field(
        None,
        description="serve the REST API and the agent port over TLS with these files; client_ca_file: "
        "REST clients may show a certificate it signed, whose URI SAN spiffe://modelyard/role/read or "
        "spiffe://modelyard/role/write gives its role (an agent's certificate is refused); null = plain text",
    )
    agent_ca_file: str = Field(
        "", description="agents must show a client certificate signed by these CAs (mutual TLS; needs tls)"
    )
    tokens_file: str = Field(
        "", description="REST bearer tokens, lines 'ROLE TOKEN' (read or write); '' = none"
    )
    agent_tokens_file: str = Field(
        "", description="agents' join tokens, lines 'SERVER TOKEN' (sent as 'authorization: Bearer')"
    )
    insecure: bool = Field(
        False, description="start on an address other than loopback without TLS or credentials (warned)"
    )
    credential_recheck: float = Field(
        10.0,
        gt=0,
        description="seconds between looks at the token files (a changed file is read again) and "
        "between checks of the tokens of open feeds and agent subscriptions: one whose token is gone ends",
    )
    max_replica_memory: Bytes = Field(
        0,
        description="refuse an agent that claims more memory than this for its replica; 0 = no limit (the "
        "default: no bound fits every fleet; set it to your largest replica's memory)",
    )
    agent_keepalive: float = Field(
        10.0,
        gt=0,
        description="seconds between pings on an agent's stream: one unanswered for as long again ends "
        "it, so that a replica whose agent vanished frees its slot for the agent that replaces it",
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="tracing, as the gateway's: a span per model apply and per operation sent to an agent",
    )

    @model_validator(mode="after")
    def _agent_ca_needs_tls(self) -> SchedulerConfig:
        if self.agent_ca_file and self.tls is None:
            raise ValueError("agent_ca_file needs tls (a certificate and key for the agent port)")
        return self

    @property
    def rest_credentials(self) -> bool:
        return bool(self.tokens_file) or (self.tls is not None and bool(self.tls.client_ca_file))

    @property
    def agent_credentials(self) -> bool:
        return bool(self.agent_ca_file) or bool(self.agent_tokens_file)
