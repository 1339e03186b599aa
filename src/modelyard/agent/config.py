"""`AgentConfig`: one agent's settings, validated once (DESIGN.md habit 5).

Defaults follow Seldon's agent (compat §7.8) where they mean the same: 5 load attempts, 1 unload
attempt, a 2 s unload grace, overcommit 0 %. Capabilities default to none (Seldon: sklearn,xgboost):
a model that names requirements should only land on a replica that says it has them.

Security (docs/placement.md, "Securing agents"): `scheduler_tls` makes the connection to the
scheduler TLS (its CA, the name to verify, the agent's client certificate for mutual TLS);
`scheduler_token` or `scheduler_token_file` is the join token sent with every call; `tls` serves
the data plane over TLS. Plain text only on loopback: `check_exposure` refuses an agent whose data
plane listens on another address without TLS, or that reaches a scheduler elsewhere without TLS and
a credential, unless `insecure`.
"""

from __future__ import annotations

import ipaddress
from ipaddress import IPv4Network, IPv6Network
from pathlib import Path
from typing import Annotated

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SecretStr,
    field_validator,
    model_validator,
)

from modelyard.config import TelemetryConfig, TlsClientConfig, TlsServerConfig, on_loopback
from modelyard.errors import ConfigError
from modelyard.placement.manifest import parse_quantity

Bytes = Annotated[int, BeforeValidator(parse_quantity), Field(ge=0)]

# 4 GiB: well above any classical model (scikit-learn, XGBoost, ONNX, a BERT: megabytes to ~1 GiB),
# low enough that a storageUri of /dev/zero or an endless body cannot fill a node's disk. LLM
# weights need more: say so per agent (`--max-artefact-bytes 40Gi`).
DEFAULT_MAX_ARTEFACT_BYTES = 4 * 2**30


class FetchCredential(BaseModel):
    """A credential the agent sends, over https only, to one host (`name` or `name:port`) when it
    downloads from it: a file holding a bearer token, or `user:password` for basic auth. Read at
    each download (rotation is picked up); never taken from a model."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field(min_length=1)
    bearer_token_file: Path | None = None
    basic_auth_file: Path | None = None

    @model_validator(mode="after")
    def _one(self) -> FetchCredential:
        if (self.bearer_token_file is None) == (self.basic_auth_file is None):
            raise ValueError(f"{self.host}: give exactly one of bearer_token_file and basic_auth_file")
        return self


class AgentConfig(BaseModel):
    # Errors never quote what was given: it may be the join token (messages say what is expected).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, hide_input_in_errors=True)

    scheduler: str = Field(description="the scheduler's agent port, host:port")
    server_name: str = Field(min_length=1, description="the server (a group of replicas) this one belongs to")
    replica_idx: int = Field(default=0, ge=0)
    inference_url: str = Field(description="the inference server, http://host:port")
    memory_bytes: Bytes = Field(default=1_000_000, description="memory this replica offers for models")
    capabilities: tuple[str, ...] = ()
    overcommit_percent: int = Field(default=0, ge=0, le=1000)
    repository: Path | None = Field(
        default=None, description="the server's model repository dir; storageUri is fetched into it"
    )
    unload_grace: float = Field(default=2.0, ge=0, description="seconds before an unload (lets routes drain)")
    keep_existing: bool = Field(default=False, description="leave models the server already serves at start")
    load_attempts: int = Field(default=5, ge=1, le=100)
    load_backoff: float = Field(default=0.5, gt=0, description="first wait between load attempts, s")
    load_backoff_max: float = Field(default=30.0, gt=0)
    reconnect_backoff: float = Field(default=0.1, gt=0, description="first wait before resubscribing, s")
    reconnect_backoff_max: float = Field(
        default=2.0,
        gt=0,
        description="longest wait between subscribe attempts, s: an agent is back within about this "
        "long of its scheduler's return (the scheduler's resync waits for it)",
    )
    connect_timeout: float = Field(default=5.0, gt=0, description="wait for the scheduler's channel, s")
    server_live_timeout: float = Field(default=120.0, gt=0, description="wait at start for the server, s")
    request_timeout: float = Field(default=300.0, gt=0, description="one repository call (a load), s")
    # Fetching storageUri (artefacts.py, upstream/download.py): what a model may make the agent read.
    max_artefact_bytes: Bytes = Field(
        default=DEFAULT_MAX_ARTEFACT_BYTES,
        description="bound on one model's files (downloaded, copied or unpacked), counted as they arrive",
    )
    fetch_timeout: float = Field(default=1800.0, gt=0, description="one model's fetch in all, s")
    fetch_schemes: tuple[str, ...] = Field(
        default=("file", "http", "https", "s3", "gs"),
        description="storageUri schemes fetched (file: local paths too); others are refused",
    )
    fetch_roots: tuple[Path, ...] = Field(
        default=(), description="local directories a storageUri may name, beside the repository"
    )
    allow_private_fetch: bool = Field(
        default=False,
        description="let downloads reach loopback, private and link-local addresses (not cloud metadata)",
    )
    fetch_networks: tuple[IPv4Network | IPv6Network, ...] = Field(
        default=(), description="networks downloads may reach although not global (metadata included)"
    )
    fetch_ca_file: Path | None = Field(
        default=None, description="CAs https downloads are verified with, instead of the system's"
    )
    fetch_credentials: tuple[FetchCredential, ...] = Field(
        default=(), description="credential files for https downloads, one per host"
    )
    event_attempts: int = Field(default=3, ge=1, le=100, description="tries to send one event")
    # The data plane (dataplane.py): the gateway sends requests here and the agent forwards them.
    host: str = Field(default="127.0.0.1", description="where the data plane listens")
    port: int | None = Field(
        default=0, ge=0, le=65535, description="the data plane's port (0: any free one; None: no data plane)"
    )
    advertise_url: str | None = Field(
        default=None,
        description="the data plane's URL as the gateway reaches it (default: http://host:port as bound)",
    )
    room_timeout: float = Field(
        default=60.0, gt=0, description="how long a load or reload waits for busy models to free memory, s"
    )
    stats_interval: float = Field(
        default=1.0, gt=0, description="seconds between usage reports to the scheduler (autoscaling)"
    )
    proxy_timeout: float = Field(default=600.0, gt=0, description="one request through the data plane, s")
    max_server_connections: int = Field(
        default=1024, ge=1, description="connections the data plane may open to the server"
    )
    max_body_bytes: Bytes = Field(
        default=100 * 2**20, description="largest request body the data plane takes"
    )
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="tracing, as the gateway's: a span per load or unload, a child of the scheduler's",
    )
    # Security: TLS and credentials to the scheduler, TLS on the data plane, plain text's bounds.
    tls: TlsServerConfig | None = Field(
        default=None, description="serve the data plane over TLS (client certificates optional)"
    )
    scheduler_tls: TlsClientConfig | None = Field(
        default=None,
        description="connect to the scheduler over TLS: its CA, the name to verify, a client certificate",
    )
    scheduler_token: SecretStr | None = Field(
        default=None, description="the join token sent to the scheduler (authorization: Bearer)"
    )
    scheduler_token_file: Path | None = Field(
        default=None, description="a file holding the join token, read again when it changes"
    )
    insecure: bool = Field(
        default=False,
        description="start without TLS or credentials on addresses other than loopback (warned)",
    )

    @field_validator("scheduler")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"expected host:port, got {value!r}")
        return value

    @field_validator("inference_url", "advertise_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"expected an http:// or https:// URL, got {value!r}")
        return value.rstrip("/")

    @field_validator("scheduler_token")
    @classmethod
    def _token(cls, value: SecretStr | None) -> SecretStr | None:
        # Its errors say what is wrong and never quote it (and the model hides inputs in errors).
        if value is None:
            return None
        token = value.get_secret_value().strip()
        if not token:
            return None
        if not all(0x21 <= ord(c) <= 0x7E for c in token):
            raise ValueError("the token must be printable ASCII without spaces")
        return SecretStr(token)

    @field_validator("fetch_schemes", mode="before")
    @classmethod
    def _schemes(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            return tuple(
                s.strip().lower().removesuffix("://") for s in value if isinstance(s, str) and s.strip()
            )
        return value

    @field_validator("fetch_networks", mode="before")
    @classmethod
    def _networks(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            networks = []
            for item in value:
                if isinstance(item, str):
                    try:
                        item = ipaddress.ip_network(item.strip())
                    except ValueError as error:
                        raise ValueError(f"{item.strip()!r}: {error}") from None
                networks.append(item)
            return tuple(networks)
        return value

    @field_validator("capabilities", mode="before")
    @classmethod
    def _split(cls, value: object) -> object:
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list | tuple):
            return tuple(s.strip() for s in value if isinstance(s, str) and s.strip())
        return value

    @model_validator(mode="after")
    def _backoffs(self) -> AgentConfig:
        # Checked here, once, so a bad pair is a startup error rather than a ValueError from
        # Backoff in the middle of a load or of the subscribe loop.
        pairs = (("load_backoff", "load_backoff_max"), ("reconnect_backoff", "reconnect_backoff_max"))
        for first, most in pairs:
            if getattr(self, first) > getattr(self, most):
                raise ValueError(
                    f"{first} ({getattr(self, first):g}s) must not exceed {most} ({getattr(self, most):g}s)"
                )
        if self.scheduler_token is not None and self.scheduler_token_file is not None:
            raise ValueError("give scheduler_token or scheduler_token_file, not both")
        if self.tls is not None and self.advertise_url is not None and self.advertise_url.startswith("http:"):
            raise ValueError("advertise_url: the data plane serves TLS, expected an https:// URL")
        if self.overcommit_percent > 0 and self.port is None:
            # Evicted models are reloaded by the requests for them, which only the data plane sees.
            raise ValueError(
                "overcommit_percent needs the data plane (a port): evicted models reload on request"
            )
        return self


def scheduler_host(config: AgentConfig) -> str:
    """The host of `config.scheduler` (`host:port`, an IPv6 host in brackets)."""
    return config.scheduler.rpartition(":")[0].strip("[]")


def exposure(config: AgentConfig) -> list[str]:
    """What an agent others can reach, or that reaches a scheduler elsewhere, lacks: one phrase
    each (none on loopback, where only this machine sees the bytes)."""
    missing = []
    if config.port is not None and config.tls is None and not on_loopback(config.host):
        where = config.host or "every address"
        missing.append(f"its data plane listens on {where} without TLS (--tls-cert, --tls-key)")
    if not on_loopback(scheduler_host(config)):
        lacks = []
        if config.scheduler_tls is None:
            lacks.append("TLS (--scheduler-ca)")
        credential = config.scheduler_token is not None or config.scheduler_token_file is not None
        if not credential and not (config.scheduler_tls is not None and config.scheduler_tls.cert_file):
            lacks.append("a credential (--cert and --key, --token-file or MODELYARD_AGENT_TOKEN)")
        if lacks:
            missing.append(f"it reaches the scheduler {config.scheduler} without {' or '.join(lacks)}")
    return missing


def check_exposure(config: AgentConfig) -> None:
    """ConfigError (one problem, one line) when `exposure` finds something, unless `insecure`."""
    missing = exposure(config)
    if missing and not config.insecure:
        raise ConfigError(
            "agent",
            [
                f"not on loopback: {'; '.join(missing)}: anyone on the network could read or forge its "
                "traffic; give them, use 127.0.0.1, or pass --insecure"
            ],
        )
