"""The access log: one line per request on the logger `modelyard.access` (logging.access_log).

A line is made from the request's last routing-log record (attempts.py hands over the record the
routing log just took, with what only the exchange knows: method, path, tries, bytes, trace id),
so the access log and the dashboard's routing log never disagree. Off, nothing here runs: the
attempt loop holds None instead of an AccessLog.
"""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime

import orjson

from modelyard.config import LoggingConfig
from modelyard.gateway.routing_log import RoutingRecord

LOGGER = "modelyard.access"


class AccessLog:
    def __init__(self, config: LoggingConfig) -> None:
        self._json = config.format == "json"
        self._log = logging.getLogger(LOGGER)

    def write(
        self, record: RoutingRecord, method: str, path: str, attempts: int, size: int, trace_id: str | None
    ) -> None:
        if not self._log.isEnabledFor(logging.INFO):
            return
        line: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.time, UTC).isoformat(timespec="milliseconds"),
            "request_id": record.request_id,
            "method": method,
            "path": path,
            "model": record.model,
            "route": record.route,
            "subset": record.subset,
            "backend": record.backend,
            "strategy": record.strategy,
            "attempts": attempts,
            "status": record.status,
            "duration_ms": record.latency_ms,
            "bytes": size,
        }
        if trace_id is not None:
            line["trace_id"] = trace_id
        line["worker"] = record.worker
        if self._json:
            self._log.info("%s", orjson.dumps(line).decode())
        else:
            self._log.info("%s", " ".join(f"{k}={_text(v)}" for k, v in line.items()))


def _text(value: object) -> str:
    text = "-" if value is None or value == "" else str(value)
    return orjson.dumps(text).decode() if " " in text or '"' in text else text


def install_handler() -> None:
    """Access lines to stderr as they are (no level or logger prefix: a JSON line stays parseable),
    not also through the root logger's format. For the CLI: a library user configures logging."""
    logger = logging.getLogger(LOGGER)
    if any(getattr(h, "_modelyard_access", False) for h in logger.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler._modelyard_access = True  # type: ignore[attr-defined]
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
