"""What the workers of one gateway (`--workers`) tell each other of their traffic, so that any
worker answers for all: each routing-log record it makes and each canary event it sees, on its
ring of the log file (state.siblings.Rings); `follow()` takes the others' into this worker's routing
log and canary accounts.

A routing-log record is an orjson array (`routing_log.encode_shared`), so it starts with "["; a
canary event is marked apart with `_CANARY` (shadow.ShadowTraffic's `share`, applied by
`shadow.apply_canary`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import orjson

from modelyard.gateway.cluster import Cluster
from modelyard.gateway.routing_log import RoutingLog, RoutingRecord, encode_shared
from modelyard.gateway.shadow import apply_canary
from modelyard.state.siblings import LOG_RING_BYTES, Rings

log = logging.getLogger("modelyard.gateway")

LOG_FILE = "log.bin"  # one ring per worker, made by the parent (gateway/workers.py)
_CANARY = b"C"


class WorkerLog:
    def __init__(self, run_dir: Path, index: int, count: int) -> None:
        self._rings = Rings(run_dir / LOG_FILE, index, count, LOG_RING_BYTES)

    def share_record(self, record: RoutingRecord) -> None:
        self._rings.send(encode_shared(record))

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
        self._rings.close()
