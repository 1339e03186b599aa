"""The access log's line formats, from a routing-log record."""

from __future__ import annotations

import io
import json
import logging
import os
import re
import subprocess
import sys
import threading

import orjson
import pytest
from prometheus_client import generate_latest

from modelyard.config import LoggingConfig
from modelyard.gateway.access_log import LOGGER, QUEUE_SIZE, AccessLog, AccessOutput
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.routing_log import RoutingLog, RoutingRecord


def record_of(log: RoutingLog, backend: str = "w0", request_id: str = "r 1"):  # type: ignore[no-untyped-def]
    return RoutingRecord(
        *log.record("m", "default", "*", backend, "round_robin", 503, 0.0125, None, request_id)
    )


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


def test_text_quotes_values_with_spaces_and_empty_ones_and_dashes_nulls(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(), backend="")
    AccessLog(LoggingConfig(access_log=True, format="text")).write(record, "GET", "/v2/models/m", 1, 10, None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert ' request_id="r 1" method=GET ' in line
    assert ' backend="" ' in line and line.endswith(" bytes=10 worker=-")
    assert "trace_id" not in line


# key=value, the value bare (no space, quote, `=` or backslash) or a JSON string
_FIELD = re.compile(r'([a-z_]+)=("(?:[^"\\]|\\.)*"|[^ "=\\]+)(?: |$)')


def text_fields(line: str) -> dict[str, str | None]:
    """A text line read back as a reader would: every field, in order, nothing left over."""
    assert len(line.splitlines()) == 1 and line.isprintable(), line
    fields: dict[str, str | None] = {}
    at = 0
    while at < len(line):
        match = _FIELD.match(line, at)
        assert match is not None, line[at:]
        key, value = match.groups()
        assert key not in fields, f"{key} twice in {line!r}"
        fields[key] = None if value == "-" else json.loads(value) if value.startswith('"') else value
        at = match.end()
    return fields


@pytest.mark.parametrize(
    "request_id",
    ["a\tstatus=500", "a status=500", "a=b", "a\x0bstatus=500", "a\x85status=500", "a\x1estatus=500",
     "a\u2028status=500", 'a"b', "a\\", "", "-", "caf\u00e9"],
)  # fmt: skip
def test_text_no_client_value_can_forge_a_field_or_a_line(
    caplog: pytest.LogCaptureFixture, request_id: str
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(), request_id=request_id)
    AccessLog(LoggingConfig(access_log=True, format="text")).write(record, "POST", "/v1/x", 1, 0, None)
    (line,) = [r.getMessage() for r in caplog.records]
    fields = text_fields(line)
    assert list(fields) == [*FIELDS[:-2], "worker"]
    assert fields["request_id"] == request_id and fields["status"] == "503" and fields["worker"] is None


FIELDS = [
    "ts", "request_id", "method", "path", "model", "route", "subset", "backend", "strategy", "attempts",
    "status", "duration_ms", "bytes", "trace_id", "worker",
]  # fmt: skip


@pytest.mark.parametrize("format", ["json", "text"])
def test_a_request_id_not_utf8_is_written_escaped(caplog: pytest.LogCaptureFixture, format: str) -> None:
    """The lean listener decodes a header's bytes 0x80-0xFF as lone surrogates: still one line."""
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(), request_id="a\udcffb")
    AccessLog(LoggingConfig(access_log=True, format=format)).write(record, "POST", "/v1/\udc80", 1, 0, None)
    (line,) = [r.getMessage() for r in caplog.records]
    fields = orjson.loads(line) if format == "json" else text_fields(line)
    assert fields["request_id"] == "a\\udcffb" and fields["path"] == "/v1/\\udc80"


def test_a_json_line_escapes_what_readers_take_for_line_ends(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    record = record_of(RoutingLog(), request_id="a\u2028b\u2029c\x85d")
    AccessLog(LoggingConfig(access_log=True)).write(record, "POST", "/v1/x", 1, 0, None)
    (line,) = [r.getMessage() for r in caplog.records]
    assert len(line.splitlines()) == 1
    assert orjson.loads(line)["request_id"] == "a\u2028b\u2029c\x85d"


def test_a_line_that_cannot_be_made_is_counted_not_raised(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    access = AccessLog(LoggingConfig(access_log=True))
    record = record_of(RoutingLog())
    record.time = float("nan")  # no timestamp can be made of it
    access.write(record, "POST", "/v1/x", 1, 0, None)
    access.write(record, "POST", "/v1/x", 1, 0, None)
    assert access.failed == 2
    assert not [r for r in caplog.records if r.name == LOGGER]
    assert len([r for r in caplog.records if r.levelno == logging.ERROR]) == 1  # once, not per line


def test_lines_go_to_stdout_from_a_thread_and_a_full_queue_drops(capsys: pytest.CaptureFixture[str]) -> None:
    logger = logging.getLogger(LOGGER)
    was = (logger.level, logger.propagate, list(logger.handlers))
    writers: set[str] = set()

    class Stdout(io.StringIO):  # sys.stdout (capsys's), noting which thread writes to it
        def write(self, text: str) -> int:
            writers.add(threading.current_thread().name)
            return sys.stdout.write(text)

    output = AccessOutput(Stdout())
    output.start()
    try:
        access = AccessLog(LoggingConfig(access_log=True))
        for n in range(3):
            access.write(record_of(RoutingLog(), request_id=f"r{n}"), "POST", "/v1/x", 1, 0, None)
    finally:
        output.stop()  # writes what waits
    lines = capsys.readouterr().out.splitlines()
    assert [orjson.loads(line)["request_id"] for line in lines] == ["r0", "r1", "r2"]
    assert writers == {"modelyard-access-log"}
    assert (logger.level, logger.propagate, logger.handlers) == was  # stopped: as it was
    assert AccessOutput()._stream is sys.stdout  # by default

    full = AccessOutput()  # not started: nothing takes lines away
    record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "line", None, None)
    for _ in range(QUEUE_SIZE + 5):
        full.handler.handle(record)
    assert full.dropped == 5 and len(full.handler.waiting) == QUEUE_SIZE


def test_dropped_lines_are_on_the_gateways_metrics() -> None:
    """A writer that falls behind drops lines: /metrics says how many (the answering process's)."""
    metrics = GatewayMetrics(lambda: ())
    output = AccessOutput()  # its handler on the access logger, but no thread taking lines away
    logger = logging.getLogger(LOGGER)
    logger.addHandler(output.handler)
    try:
        record = logging.LogRecord(LOGGER, logging.INFO, __file__, 1, "line", None, None)
        for _ in range(QUEUE_SIZE + 7):
            output.handler.handle(record)
        page = generate_latest(metrics.exposition).decode()
    finally:
        logger.removeHandler(output.handler)
    assert "modelyard_access_log_dropped_total 7.0" in page
    assert "modelyard_access_log_dropped_total 0.0" in generate_latest(metrics.exposition).decode()


def test_lines_a_closed_stdout_refuses_are_counted_as_dropped() -> None:
    read, write = os.pipe()
    os.close(read)  # nobody will read: writing fails (EPIPE; Python ignores SIGPIPE)
    with open(write, "w") as stream:
        output = AccessOutput(stream)
        output.start()
        try:
            access = AccessLog(LoggingConfig(access_log=True))
            for n in range(4):
                access.write(record_of(RoutingLog(), request_id=f"r{n}"), "POST", "/v1/x", 1, 0, None)
        finally:
            output.stop()
    assert output.dropped == 4


WRITER = """
import sys
from modelyard.config import LoggingConfig
from modelyard.gateway.access_log import AccessLog, install_handler
from modelyard.gateway.routing_log import RoutingLog, RoutingRecord
output = install_handler()
log, access = RoutingLog(), AccessLog(LoggingConfig(access_log=True))
for n in range(int(sys.argv[1])):
    entry = log.record("m", "default", "*", "w0", "round_robin", 200, 0.01, None, sys.argv[2] + "x" * 250)
    record = RoutingRecord(*entry)
    access.write(record, "POST", "/v1/chat/completions", 1, 0, None)
output.stop()
"""


def test_processes_sharing_one_stdout_pipe_never_tear_each_others_lines() -> None:
    """The `--workers` processes write to the parent's stdout: each write is of whole lines and at
    most PIPE_BUF bytes, so a slow reader never sees one process's line cut by another's."""
    lines = 6000
    read, write = os.pipe()
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(lines), tag], stdout=write) for tag in ("a", "b")
    ]
    os.close(write)
    received = bytearray()
    while chunk := os.read(read, 512):  # slower than the writers: the pipe is full most of the time
        received += chunk
    os.close(read)
    assert [w.wait(60) for w in writers] == [0, 0]
    ids = [orjson.loads(line)["request_id"][0] for line in received.splitlines()]  # each parses
    assert (ids.count("a"), ids.count("b")) == (lines, lines)
