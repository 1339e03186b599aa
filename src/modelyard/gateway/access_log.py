"""The access log: one line per request on the logger `modelyard.access` (logging.access_log).

A routed request's line is made from its last routing-log record (attempts.py hands over the record
the routing log just took, with what only the exchange knows: method, path, tries, bytes, trace
id), so the access log and the dashboard's routing log never disagree. A request refused before
routing, and a graph request, get a line of their own (`write_fields`). Off, nothing here runs:
the attempt loop holds None instead of an AccessLog.

Writing never raises: client text (a request id, a path) is made valid UTF-8 and quoted where it
could forge a field or a line, and a line that still cannot be made is counted and dropped. `serve`
hands the lines to a thread (`install_handler`): the event loop only appends them to a deque.
"""

from __future__ import annotations

import json
import logging
import os
import select
import sys
import threading
import time
from collections import deque
from datetime import UTC, datetime
from typing import IO

import orjson

from modelyard.config import LoggingConfig
from modelyard.gateway.routing_log import RoutingRecord
from modelyard.telemetry import safe_text

LOGGER = "modelyard.access"
QUEUE_SIZE = 10_000  # lines waiting for the writer thread; more are dropped (and counted)
FLUSH_SECONDS = 0.05  # how often the writer thread writes what is waiting
STOP_SECONDS = 5.0  # how long a stopping gateway waits for its lines to be written
_PIPE_BUF = select.PIPE_BUF  # writes up to this many bytes to a pipe are atomic (POSIX)
_LINE_BREAKS = ("\u2028", "\u2029", "\x85")  # valid raw in JSON, but line ends to many readers

log = logging.getLogger("modelyard.gateway")


class AccessLog:
    def __init__(self, config: LoggingConfig, worker: int | None = None) -> None:
        self._json = config.format == "json"
        self._worker = worker  # the `--workers` process, for lines made without a routing record
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
            tenant=record.tenant,
            fallback_for=record.fallback_for,
        )

    def refused(self, request_id: str, method: str, path: str, status: int, seconds: float) -> None:
        """The line of a request refused before routing: no model, route or backend (a routed
        request's line is the attempt loop's)."""
        self.write_fields(
            time.time(), request_id, method, path, "", "", "", "", "", 0, status, seconds * 1000, 0
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
        tenant: str = "",
        fallback_for: str = "",
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
            if tenant:  # (auth.enabled; the key's name is not logged: usage has it)
                line["tenant"] = tenant
            if fallback_for:  # a fallback model answered: the model asked for (its line is before)
                line["fallback_for"] = safe_text(fallback_for)
            line["worker"] = self._worker if worker is None else worker
            if self._json:
                text = orjson.dumps(line).decode()
                if not text.isascii():
                    for char in _LINE_BREAKS:
                        text = text.replace(char, f"\\u{ord(char):04x}")
            else:
                text = " ".join(f"{k}={_text(v)}" for k, v in line.items())
            # Logger.handle with a record made here: `info` would also look up its caller's frame
            self._log.handle(self._log.makeRecord(LOGGER, logging.INFO, __file__, 0, "%s", (text,), None))
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


class _Lines(logging.Handler):
    """Keeps each line for the writer thread: the loop appends to a deque (no lock taken, no thread
    woken); past QUEUE_SIZE lines waiting, a line is dropped and counted, never waited for."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.waiting: deque[logging.LogRecord] = deque()
        self.limit = limit
        self.dropped = 0

    def handle(self, record: logging.LogRecord) -> bool:  # no handler lock: deque appends are atomic
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        if len(self.waiting) < self.limit:
            self.waiting.append(record)
        else:
            self.dropped += 1


class AccessOutput:
    """Access lines to stdout, written by a thread of their own every FLUSH_SECONDS, each batch in
    one write: the event loop only appends to a bounded deque. (A QueueListener's thread is woken
    for every line, and each wake-up fights the loop for the GIL: it cost the loop as much as
    writing the line itself.)"""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.handler = _Lines(QUEUE_SIZE)
        self._stream = stream or sys.stdout
        self._fd = _fileno(self._stream)  # written to directly, in whole-line chunks
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
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
        self._stopping.clear()
        self._thread = threading.Thread(target=self._run, name="modelyard-access-log", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Write what is waiting, then stop the thread (blocking, for a moment: at exit)."""
        if self._thread is None:
            return
        logger = logging.getLogger(LOGGER)
        logger.removeHandler(self.handler)
        logger.setLevel(self._was[0])
        logger.propagate = self._was[1]
        self._stopping.set()
        self._thread.join(STOP_SECONDS)  # a stdout nobody reads must not keep the process alive
        self._thread = None
        self.handler.dropped += len(self.handler.waiting)  # still waiting: lost at exit
        if self.handler.dropped:
            log.warning(
                "the access log dropped %d lines (too many waited to be written)", self.handler.dropped
            )

    def _run(self) -> None:
        while not self._stopping.wait(FLUSH_SECONDS):
            self._write()
        self._write()

    def _write(self) -> None:
        """What waits, in writes of whole lines of at most PIPE_BUF bytes: the `--workers` processes
        share one stdout, and only such writes to a pipe are never torn by another's."""
        waiting = self.handler.waiting
        chunk: list[bytes] = []
        size = 0
        while waiting:
            line = waiting.popleft().getMessage().encode("utf-8", "backslashreplace") + b"\n"
            if chunk and size + len(line) > _PIPE_BUF:
                self._send(chunk)
                chunk, size = [], 0
            chunk.append(line)
            size += len(line)
        if chunk:
            self._send(chunk)

    def _send(self, lines: list[bytes]) -> None:
        try:
            data = b"".join(lines)
            if self._fd is None:
                self._stream.write(data.decode())
                self._stream.flush()
            else:
                while data:  # a blocking write of up to PIPE_BUF bytes is whole; a longer line may not be
                    data = data[os.write(self._fd, data) :]
        except Exception:  # stdout closed or broken: the lines are lost, and counted as dropped
            self.handler.dropped += len(lines)


def _fileno(stream: IO[str]) -> int | None:
    try:
        stream.flush()
        return stream.fileno()
    except (AttributeError, OSError, ValueError):  # a StringIO, a closed stream
        return None


def dropped_lines() -> int:
    """Lines the access log has dropped in this process (its writer fell behind), for /metrics."""
    return sum(h.dropped for h in logging.getLogger(LOGGER).handlers if isinstance(h, _Lines))


def install_handler() -> AccessOutput:
    """Access lines to stdout as they are (no level or logger prefix: a JSON line stays parseable),
    written off the event loop; the caller stops it when the gateway has stopped. For the CLI: a
    library user configures logging."""
    output = AccessOutput()
    output.start()
    return output
