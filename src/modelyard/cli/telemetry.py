"""The tracing flags of the roles configured by flags (graph serve, scheduler, agent): the same
`telemetry` settings a gateway's config file has (config.TelemetryConfig)."""

from __future__ import annotations

import os
from typing import Annotated

import typer
from pydantic import ValidationError

from modelyard.config import OTEL_ENDPOINT_ENV, TelemetryConfig, otel_disabled

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
    """The flags as a TelemetryConfig (tracing off with OTEL_SDK_DISABLED=true); a bad value prints
    one line naming the flag, or the variable it came from, and exits 1."""
    if otel_disabled(os.environ):
        endpoint = None
    try:
        return TelemetryConfig(otlp_endpoint=endpoint, sample_ratio=sample_ratio)
    except ValidationError as exc:
        problem = exc.errors()[0]
        flag = "--otlp-endpoint" if problem["loc"] == ("otlp_endpoint",) else "--trace-sample-ratio"
        if flag == "--otlp-endpoint" and endpoint == os.environ.get(OTEL_ENDPOINT_ENV):
            flag = OTEL_ENDPOINT_ENV  # (or the flag with the same value: either way, this names it)
        typer.echo(f"error: {flag}: {problem['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(1) from None
