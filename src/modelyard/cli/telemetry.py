"""The tracing flags of the roles configured by flags (graph serve, scheduler, agent): the same
`telemetry` settings a gateway's config file has (config.TelemetryConfig)."""

from __future__ import annotations

from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.config import OTEL_ENDPOINT_ENV, TelemetryConfig

OtlpEndpointOption = Annotated[
    str | None,
    typer.Option(
        "--otlp-endpoint",
        envvar=OTEL_ENDPOINT_ENV,
        help="Trace to this OTLP/HTTP endpoint (e.g. http://collector:4318; spans go to /v1/traces). "
        "Default: off.",
    ),
]
SampleRatioOption = Annotated[
    float, typer.Option("--trace-sample-ratio", help="Share of new traces recorded (parent-based).")
]


def telemetry_config(endpoint: str | None, sample_ratio: float) -> TelemetryConfig:
    """The flags as a TelemetryConfig; a bad value prints one line naming the flag and exits 1."""
    try:
        return TelemetryConfig(otlp_endpoint=endpoint, sample_ratio=sample_ratio)
    except ValidationError as exc:
        problem = exc.errors()[0]
        flag = "--otlp-endpoint" if problem["loc"] == ("otlp_endpoint",) else "--trace-sample-ratio"
        typer.echo(f"error: {flag}: {problem['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(1) from None
