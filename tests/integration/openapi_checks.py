"""The gateway's own schemathesis check, loaded by the `schemathesis run` that test_openapi.py starts
(`SCHEMATHESIS_HOOKS=openapi_checks`)."""

from __future__ import annotations

from typing import Any

import schemathesis


@schemathesis.check
def no_gateway_5xx(ctx: Any, response: Any, case: Any) -> None:
    """A 5xx relayed from an inference server carries X-Modelyard-Backend; one without it is the
    gateway's own failure (the sim workers behind a fuzzed gateway never fail by themselves)."""
    if response.status_code >= 500 and "x-modelyard-backend" not in response.headers:
        raise AssertionError(f"the gateway itself answered {response.status_code}: {response.text[:500]!r}")
