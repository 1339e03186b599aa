"""What the workers of one gateway (`--workers`) tell each other of their traffic, so that any
worker answers for all: each routing-log record it makes and each canary event it sees, on its
ring of the log file (state.siblings.Rings); `follow()` takes the others' into this worker's routing
log and canary accounts.

Routing-log records go in batches, one message per `flush` (the gateway's follow loop, every
FOLLOW_SECONDS, or sooner once BATCH_RECORDS wait): a message per request cost each worker more
than its share of the request path (encoding and copying it in, and each other worker reading it).
A batch is an orjson array (`routing_log.encode_shared`), so it starts with "["; a canary event
is marked apart with `_CANARY` (shadow.ShadowTraffic's `share`, applied by `shadow.apply_canary`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import orjson

from modelyard.gateway.cluster import Cluster
from modelyard.gateway.routing_log import Entry, RoutingLog, encode_shared
from modelyard.gateway.shadow import apply_canary
from modelyard.state.siblings import LOG_RING_BYTES, Rings

log = logging.getLogger("modelyard.gateway")

LOG_FILE = "log.bin"  # one ring per worker, made by the parent (gateway/workers.py)
_CANARY = b"C"
BATCH_RECORDS = 512  # records waiting that are sent without waiting for the next flush


class WorkerLog:
    def __init__(self, run_dir: Path, index: int, count: int) -> None:
        self._rings = Rings(run_dir / LOG_FILE, index, count, LOG_RING_BYTES)
        self._records: list[Entry] = []

    def share_record(self, record: Entry) -> None:
        self._records.append(record)
        if len(self._records) >= BATCH_RECORDS:
            self.flush()

    def flush(self) -> None:
        """Send the records shared since the last flush."""
        if self._records:
            records, self._records = self._records, []
            self._send(records)

    def _send(self, records: list[Entry]) -> None:
        message = encode_shared(records)
        if len(message) > self._rings.max_message and len(records) > 1:  # (long request ids)
            half = len(records) // 2
            self._send(records[:half])
            self._send(records[half:])
        else:
            self._rings.send(message)  # (one record too large for a message: dropped, counted)

    def share_canary(self, event: list[object]) -> None:
        self._rings.send(_CANARY + orjson.dumps(event))

    def follow(self, routing_log: RoutingLog, clusters: Mapping[str, Cluster]) -> None:
        """What the other workers shared since the last call, taken here."""
        for shared in self._rings.receive():
            try:
                if shared.startswith(_CANARY):
                    apply_canary(clusters, orjson.loads(shared[len(_CANARY) :]))
                else:
                    routing_log.adopt(shared)
            except (ValueError, TypeError):  # one unreadable message: the rest of the round goes on
                log.warning("a routing-log message from another worker could not be read; skipped")

    def close(self) -> None:
        self.flush()
        self._rings.close()
