"""`SchedulerConfig`: everything `modelyard scheduler` takes, validated once."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from modelyard.config import TelemetryConfig

DEFAULT_DB = "./modelyard-scheduler.db"
# The largest REST request body (one model spec): `modelyard model apply` sends each model of a file on its
# own and refuses, before sending any, a document larger than this (unparsed) or a spec whose JSON is.
MAX_BODY_BYTES = 1024 * 1024


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    host: str = Field("127.0.0.1", description="address of the REST API and the agents' gRPC service")
    port: int = Field(9004, ge=0, le=65535, description="REST API and feed; 0 picks a free port")
    agent_port: int = Field(9005, ge=0, le=65535, description="gRPC AgentService; 0 picks a free port")
    db: str = Field(DEFAULT_DB, min_length=1, description="SQLite file, or :memory:")
    resync_timeout: float = Field(
        15.0, ge=0, description="after a restart, how long to wait for known replicas before placing"
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
    telemetry: TelemetryConfig = Field(
        default_factory=TelemetryConfig,
        description="tracing, as the gateway's: a span per model apply and per operation sent to an agent",
    )
