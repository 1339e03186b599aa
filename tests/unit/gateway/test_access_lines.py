"""The access log's line formats, from a routing-log record."""

from __future__ import annotations

import logging

import orjson
import pytest

from modelyard.config import LoggingConfig
from modelyard.gateway.access_log import LOGGER, AccessLog
from modelyard.gateway.routing_log import RoutingLog


def record_of(log: RoutingLog, backend: str = "w0", request_id: str = "r 1"):  # type: ignore[no-untyped-def]
    return log.record("m", "default", "*", backend, "round_robin", 503, 0.0125, None, request_id)


def test_json_has_every_field_from_the_record(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(worker=3), backend="")
    AccessLog(LoggingConfig(access_log=True)).write(record, "POST", "/v1/completions", 0, 0, "ab" * 16)
    (line,) = [r.getMessage() for r in caplog.records]
    assert orjson.loads(line) == {
        "ts": line.split('"ts":"')[1].split('"')[0],
        "request_id": "r 1",
        "method": "POST",
        "path": "/v1/completions",
        "model": "m",
        "route": "default",
        "subset": "*",
        "backend": "",
        "strategy": "round_robin",
        "attempts": 0,
        "status": 503,
        "duration_ms": 12.5,
        "bytes": 0,
        "trace_id": "ab" * 16,
        "worker": 3,
    }


def test_text_quotes_values_with_spaces_and_dashes_empty_ones(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(), backend="")
    AccessLog(LoggingConfig(access_log=True, format="text")).write(record, "GET", "/v2/models/m", 1, 10, None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert ' request_id="r 1" method=GET ' in line
    assert " backend=- " in line and line.endswith(" bytes=10 worker=-")
    assert "trace_id" not in line
