"""The access log: one line per request on the logger `modelyard.access` (logging.access_log).

A routed request's line is made from its last routing-log record (attempts.py hands over the record
the routing log just took, with what only the exchange knows: method, path, tries, bytes, trace
id), so the access log and the dashboard's routing log never disagree. A request refused before
routing, and a graph request, get a line of their own (`write_fields`). Off, nothing here runs:
the attempt loop holds None instead of an AccessLog.

Writing never raises: client text (a request id, a path) is made valid UTF-8 and quoted where it
could forge a field or a line, and a line that still cannot be made is counted and dropped. `serve`
hands the lines to a thread (`install_handler`): the event loop only queues them.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import queue
import sys
from datetime import UTC, datetime
from typing import IO

import orjson

from modelyard.config import LoggingConfig
from modelyard.gateway.routing_log import RoutingRecord
from modelyard.telemetry import safe_text

LOGGER = "modelyard.access"
QUEUE_SIZE = 10_000  # lines waiting for the writer thread; more are dropped (and counted)
_LINE_BREAKS = ("\u2028", "\u2029", "\x85")  # valid raw in JSON, but line ends to many readers

log = logging.getLogger("modelyard.gateway")


class AccessLog:
    def __init__(self, config: LoggingConfig) -> None:
        self._json = config.format == "json"
        self._log = logging.getLogger(LOGGER)
        self.failed = 0  # lines that could not be written (a bug: logged once, at debug after)

    def write(
        self,
        record: RoutingRecord,
        method: str,
        path: str,
        attempts: int,
        size: int,
        trace_id: str | None,
        duration_ms: float | None = None,
    ) -> None:
        """The line of a routed request; `duration_ms`: the whole request's (the record's latency
        is its last try's when that try failed)."""
        self.write_fields(
            record.time,
            record.request_id,
            method,
            path,
            record.model,
            record.route,
            record.subset,
            record.backend,
            record.strategy,
            attempts,
            record.status,
            record.latency_ms if duration_ms is None else duration_ms,
            size,
            trace_id,
            record.worker,
        )

    def write_fields(
        self,
        time: float,
        request_id: str,
        method: str,
        path: str,
        model: str,
        route: str,
        subset: str,
        backend: str,
        strategy: str,
        attempts: int,
        status: int,
        duration_ms: float,
        size: int,
        trace_id: str | None = None,
        worker: int | None = None,
    ) -> None:
        if not self._log.isEnabledFor(logging.INFO):
            return
        try:
            line: dict[str, object] = {
                "ts": datetime.fromtimestamp(time, UTC).isoformat(timespec="milliseconds"),
                "request_id": safe_text(request_id),
                "method": safe_text(method),
                "path": safe_text(path),
                "model": safe_text(model),
                "route": route,
                "subset": subset,
                "backend": backend,
                "strategy": strategy,
                "attempts": attempts,
                "status": status,
                "duration_ms": round(duration_ms, 3),
                "bytes": size,
            }
            if trace_id is not None:
                line["trace_id"] = trace_id
            line["worker"] = worker
            if self._json:
                text = orjson.dumps(line).decode()
                if not text.isascii():
                    for char in _LINE_BREAKS:
                        text = text.replace(char, f"\\u{ord(char):04x}")
            else:
                text = " ".join(f"{k}={_text(v)}" for k, v in line.items())
            self._log.info("%s", text)
        except Exception:  # never the request's problem: its answer is already decided
            self.failed += 1
            if self.failed == 1:
                log.exception("could not write an access log line (request %s)", safe_text(request_id))


def _text(value: object) -> str:
    """A value for `key=value`: `-` for null; quoted (JSON, ASCII only) when it is empty, is `-`, or
    holds anything that could end the value or the line (a space, a quote, `=`, a backslash, a
    character that is not printable)."""
    if value is None:
        return "-"
    text = str(value)
    if not text or text == "-" or not text.isprintable() or any(c in text for c in ' "=\\'):
        return json.dumps(text)
    return text


class _DroppingQueueHandler(logging.handlers.QueueHandler):
    """Queues a line for the writer thread; when the queue is full the line is dropped and counted,
    never waited for: the event loop must not block on a slow stdout."""

    def __init__(self, lines: queue.Queue[logging.LogRecord]) -> None:
        super().__init__(lines)
        self.dropped = 0

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record  # the message is formatted on the writer thread (the line alone: "%(message)s")

    def enqueue(self, record: logging.LogRecord) -> None:
        try:
            self.queue.put_nowait(record)
        except queue.Full:
            self.dropped += 1


class AccessOutput:
    """Access lines to stdout, written by a thread of their own: the loop only queues (bounded)."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self._queue: queue.Queue[logging.LogRecord] = queue.Queue(QUEUE_SIZE)
        self.handler = _DroppingQueueHandler(self._queue)
        writer = logging.StreamHandler(stream or sys.stdout)
        writer.setFormatter(logging.Formatter("%(message)s"))
        self._listener = logging.handlers.QueueListener(self._queue, writer)
        self._started = False
        self._was: tuple[int, bool] = (logging.NOTSET, True)  # the logger's level and propagate

    @property
    def dropped(self) -> int:
        return self.handler.dropped

    def start(self) -> None:
        logger = logging.getLogger(LOGGER)
        self._was = (logger.level, logger.propagate)
        logger.addHandler(self.handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the line alone, not also through the root logger's format
        self._listener.start()
        self._started = True

    def stop(self) -> None:
        """Write what is queued, then stop the thread (blocking, for a moment: at exit)."""
        if not self._started:
            return
        self._started = False
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(self.handler)
        logger.setLevel(self._was[0])
        logger.propagate = self._was[1]
        self._listener.stop()
        if self.handler.dropped:
            log.warning("the access log dropped %d lines (its queue was full)", self.handler.dropped)


def install_handler() -> AccessOutput:
    """Access lines to stdout as they are (no level or logger prefix: a JSON line stays parseable),
    written off the event loop; the caller stops it when the gateway has stopped. For the CLI: a
    library user configures logging."""
    output = AccessOutput()
    output.start()
    return output
