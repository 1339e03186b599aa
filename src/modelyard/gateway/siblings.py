"""The other workers of one gateway (`listen.workers` > 1), as one worker sees them.

The workers share one file of int64 slots (serving.SharedInts), laid out from the config, so every
worker finds the same slot for the same server or endpoint; each slot has one writer, so nothing
locks on the request path:
- loads: per server URL, a row per worker (in flight, outstanding tokens); a strategy reads the sum;
- probes: per (model, endpoint), the leader's (worker 0's) latest verdict and a sequence number;
  the leader alone probes, the others adopt its verdicts;
- suspicions: per (model, endpoint), a row per worker counting the connections it saw refused; the
  leader takes each new one as a refusal of its own (out, published, probed at unhealthy_interval);
- the admin generation: bumped after an admin change is written to `admin.json` (under a file
  lock, merged, replaced atomically); every worker applies what it has not applied yet;
- listener counters: per worker, for /metrics to sum, and a base the supervising process adds a
  dead worker's counters to (`worker_exited`), so that the sums never go down;
- resources: per (model, endpoint), the leader's latest scrape (resource_aware) under a seqlock: a
  sequence number, odd while the leader writes, then one slot per field (`encode_snapshot`); the
  leader alone scrapes, the others adopt each new snapshot whole (`read_snapshot`);
- model counts: per model, a row per worker (requests queued for room, active, retrying), and per
  (model, endpoint) a slot per worker (the model's requests on that endpoint), written every follow
  round, so that /admin/overview shows the sums;
- ejections: per (model, endpoint), a row per worker holding its latest outlier ejection under a
  seqlock (until when, as monotonic time, which all processes of the machine share; the ejection
  multiplier): every worker judges the answers it relays, and the others take its ejections as
  their own, so an endpoint that fails is out everywhere after `consecutive_5xx` failures in one
  worker, not in each.
"""

from __future__ import annotations

import fcntl
import logging
import math
import os
import struct
import time
from array import array
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson

from modelyard.cluster import BackendLoad, Endpoint, Load, ResourceSnapshot
from modelyard.config import GatewayConfig
from modelyard.errors import ChangeNotShared
from modelyard.gateway.cluster import Cluster
from modelyard.serving import ListenerStats
from modelyard.serving.workers import SharedInts

log = logging.getLogger("modelyard.gateway")

SHARED_FILE = "shared.bin"
ADMIN_FILE = "admin.json"
METRICS_DIR = "metrics"
_LISTENER_FIELDS = 5  # open, refused, header timeouts, heads refused 400, 431
# taken_at, queue_depth, running, kv_cache_usage, sm_utilization, memory_used, in_flight_at_scrape
SNAPSHOT_FIELDS = 7
SNAPSHOT_SLOTS = 1 + SNAPSHOT_FIELDS  # the sequence number first
EJECTION_SLOTS = 3  # the sequence number, until (float bits), the ejection multiplier
COUNT_SLOTS = 3  # queued, active, retrying
_SEQLOCK_TRIES = 3  # a read that keeps meeting a write gives up until the next round
_DOUBLE = struct.Struct("d")
_INT64 = struct.Struct("q")


def _bits(value: float) -> int:
    return int(_INT64.unpack(_DOUBLE.pack(value))[0])


def _float(bits: int) -> float:
    return float(_DOUBLE.unpack(_INT64.pack(bits))[0])


_NONE = _bits(math.nan)  # a signal the server does not export (the scraper never keeps a NaN)


def encode_snapshot(snapshot: ResourceSnapshot) -> list[int]:
    """A snapshot as SNAPSHOT_FIELDS int64s: floats as their IEEE-754 bits, None as NaN's."""
    optional = (
        snapshot.queue_depth, snapshot.running, snapshot.kv_cache_usage, snapshot.sm_utilization,
        snapshot.memory_used,
    )  # fmt: skip
    return [
        _bits(snapshot.taken_at),
        *(_NONE if value is None else _bits(value) for value in optional),
        snapshot.in_flight_at_scrape,
    ]


def decode_snapshot(fields: Sequence[int]) -> ResourceSnapshot:
    taken_at, queue_depth, running, kv_cache_usage, sm_utilization, memory_used, in_flight = fields
    return ResourceSnapshot(
        taken_at=_float(taken_at),
        queue_depth=_optional(queue_depth),
        running=_optional(running),
        kv_cache_usage=_optional(kv_cache_usage),
        sm_utilization=_optional(sm_utilization),
        memory_used=_optional(memory_used),
        in_flight_at_scrape=in_flight,
    )


def _optional(bits: int) -> float | None:
    value = _float(bits)
    return None if math.isnan(value) else value


def write_locked(ints: memoryview, at: int, values: Sequence[int]) -> None:
    """The one writer of slot group `at`: the sequence number turns odd, `values` are written after
    it, then it turns even; a reader that saw the same even number before and after read them whole."""
    seq = (ints[at] + 1) | 1  # odd: the next, or past the one a writer that died mid-write left
    ints[at] = seq
    for offset, value in enumerate(values, start=at + 1):
        ints[offset] = value
    ints[at] = seq + 1


def read_locked(ints: memoryview, at: int, count: int) -> tuple[int, list[int]] | None:
    """(sequence number, the `count` values) of slot group `at`; None when nothing was published yet
    or every try met a write (the caller tries again next round: never a torn read)."""
    for _ in range(_SEQLOCK_TRIES):
        before = ints[at]
        if before == 0:
            return None
        if before % 2:
            continue
        values = list(ints[at + 1 : at + 1 + count])
        if ints[at] == before:
            return before, values
    return None


def write_snapshot(ints: memoryview, at: int, snapshot: ResourceSnapshot) -> None:
    write_locked(ints, at, encode_snapshot(snapshot))


def read_snapshot(ints: memoryview, at: int) -> tuple[int, ResourceSnapshot] | None:
    read = read_locked(ints, at, SNAPSHOT_FIELDS)
    return None if read is None else (read[0], decode_snapshot(read[1]))


class Layout:
    """Where each shared counter lives, the same in every worker (built from the same config)."""

    def __init__(self, config: GatewayConfig, count: int) -> None:
        self.count = count
        self.urls: dict[str, int] = {}
        self.probes: dict[tuple[str, str], int] = {}
        for model in config.models:
            for endpoint in model.endpoints:
                self.urls.setdefault(endpoint.url, len(self.urls))
                self.probes.setdefault((model.name, endpoint.name), len(self.probes))
        self.probes_at = len(self.urls) * count * 2
        self.suspects_at = self.probes_at + 2 * len(self.probes)
        self.admin_at = self.suspects_at + len(self.probes) * count
        self.listener_at = self.admin_at + 1
        self.listener_base_at = self.listener_at + count * _LISTENER_FIELDS
        self.resources_at = self.listener_base_at + _LISTENER_FIELDS
        self.models = {model.name: slot for slot, model in enumerate(config.models)}
        self.ejections_at = self.resources_at + SNAPSHOT_SLOTS * len(self.probes)
        self.counts_at = self.ejections_at + EJECTION_SLOTS * len(self.probes) * count
        self.endpoint_counts_at = self.counts_at + COUNT_SLOTS * len(self.models) * count
        self.size = self.endpoint_counts_at + len(self.probes) * count

    def load_row(self, slot: int, index: int) -> int:
        """Where worker `index`'s in-flight count for server `slot` is (its tokens follow)."""
        return slot * self.count * 2 + 2 * index

    def count_row(self, slot: int, index: int) -> int:
        """Where worker `index`'s counts for model `slot` are."""
        return self.counts_at + (slot * self.count + index) * COUNT_SLOTS

    def endpoint_count(self, slot: int, index: int) -> int:
        """Where worker `index`'s count of its model's requests on endpoint `slot` is."""
        return self.endpoint_counts_at + slot * self.count + index

    def ejection_row(self, slot: int, index: int) -> int:
        """Where worker `index`'s latest ejection of endpoint `slot` is."""
        return self.ejections_at + (slot * self.count + index) * EJECTION_SLOTS


def worker_exited(ints: memoryview, layout: Layout, index: int) -> None:
    """The supervising process reaped worker `index`: what it had in flight has ended, and its
    listener counters move to the base (the one writer of the base; the worker is gone)."""
    _clear_loads(ints, layout, index)
    for slot in layout.models.values():  # its queued, active and retrying requests ended with it
        at = layout.count_row(slot, index)
        ints[at : at + COUNT_SLOTS] = array("q", [0] * COUNT_SLOTS)
    for slot in layout.probes.values():
        ints[layout.endpoint_count(slot, index)] = 0
    row = layout.listener_at + index * _LISTENER_FIELDS
    ints[row] = 0  # open connections: closed with the process
    for field in range(1, _LISTENER_FIELDS):
        ints[layout.listener_base_at + field] += ints[row + field]
        ints[row + field] = 0


def _clear_loads(ints: memoryview, layout: Layout, index: int) -> None:
    """Worker `index`'s in-flight count and tokens on every server, back to zero."""
    for slot in range(len(layout.urls)):
        at = layout.load_row(slot, index)
        ints[at] = ints[at + 1] = 0


class SharedLoad:
    """A server's load summed over the workers; this worker writes only its own row."""

    __slots__ = ("_end", "_ints", "_mine", "_start", "name", "url")

    def __init__(self, url: str, name: str, ints: memoryview, start: int, index: int, count: int) -> None:
        self.url, self.name = url, name
        self._ints = ints
        self._start, self._end = start, start + 2 * count
        self._mine = start + 2 * index

    @property
    def in_flight(self) -> int:
        return sum(self._ints[self._start : self._end : 2])

    @property
    def outstanding_tokens(self) -> int:
        return sum(self._ints[self._start + 1 : self._end : 2])

    def acquire(self, tokens: int) -> None:
        ints, mine = self._ints, self._mine
        ints[mine] += 1
        ints[mine + 1] += tokens

    def release(self, tokens: int) -> None:
        ints, mine = self._ints, self._mine
        ints[mine] -= 1
        ints[mine + 1] -= tokens


def find_endpoint(cluster: Cluster | None, name: str) -> Endpoint | None:
    """The endpoint of `cluster` named `name`; None without either."""
    return next((e for e in cluster.endpoints if e.name == name), None) if cluster is not None else None


class Siblings:
    def __init__(self, config: GatewayConfig, index: int, count: int, run_dir: Path) -> None:
        self.index, self.count = index, count
        self.leader = index == 0  # probes for every worker; a restarted worker 0 takes it up again
        self.layout = Layout(config, count)
        self.run_dir = run_dir
        self.metrics_dir = run_dir / METRICS_DIR
        self._shared = SharedInts(run_dir / SHARED_FILE, self.layout.size, create=False)
        self._ints = self._shared.ints
        self._probes_seen: dict[int, int] = {}
        self._resources_seen: dict[int, int] = {}
        # Every row unseen, its own included the first time: a worker started again adopts the
        # ejections still in force, its predecessor's too.
        self._ejections_seen: dict[int, int] = {}
        self._own_ejections_read = False
        # As configured: each worker's clusters keep a part of it (gateway/workers.py: worker_share).
        self._max_pending = {m.name: m.circuit_breakers.max_pending_requests for m in config.models}
        # Refusals reported before this worker started (a restarted leader) were dealt with then.
        self._suspects_seen = {slot: self._suspicions(slot) for slot in self.layout.probes.values()}
        self._admin_seen = 0
        # A worker started again after a crash: what its predecessor had in flight has ended.
        _clear_loads(self._ints, self.layout, index)

    # --- loads ----------------------------------------------------------------------------------

    def new_load(self, url: str, name: str) -> Load:
        slot = self.layout.urls.get(url)
        if slot is None:  # not in the config (cannot happen while placement is refused with workers)
            return BackendLoad(url, name)
        return SharedLoad(url, name, self._ints, self.layout.load_row(slot, 0), self.index, self.count)

    # --- health ---------------------------------------------------------------------------------

    def publish_probe(self, cluster: Cluster, endpoint: Endpoint) -> None:
        slot = self.layout.probes.get((cluster.name, endpoint.name))
        if slot is None:
            return
        at = self.layout.probes_at + 2 * slot
        self._ints[at + 1] = 1 if endpoint.health.healthy else 0
        self._ints[at] += 1  # after the verdict: a reader that sees the new number sees it

    def connection_refused(self, cluster: Cluster, endpoint: Endpoint) -> None:
        """This worker took `endpoint` out on a refused connection. The leader publishes that as its
        verdict; a follower tells the leader (`suspected`), which takes it out the same way: only the
        leader probes, and it probes an endpoint that is out every `unhealthy_interval`, so the
        verdict that brings it back reaches every worker as soon as in a single process."""
        slot = self.layout.probes.get((cluster.name, endpoint.name))
        if slot is None:
            return
        if self.leader:
            self.publish_probe(cluster, endpoint)
        else:
            self._ints[self.layout.suspects_at + slot * self.count + self.index] += 1

    def suspected(self) -> list[tuple[str, str]]:
        """The leader: (model, endpoint) pairs a follower saw refused since the last call."""
        found = []
        for key, slot in self.layout.probes.items():
            count = self._suspicions(slot)
            if count != self._suspects_seen[slot]:
                self._suspects_seen[slot] = count
                found.append(key)
        return found

    def _suspicions(self, slot: int) -> int:
        start = self.layout.suspects_at + slot * self.count
        return sum(self._ints[start : start + self.count])

    def verdicts_pending(self, clusters: Mapping[str, Cluster]) -> bool:
        """Whether an endpoint of a health-checked model has no verdict from the leader yet."""
        ints = self._ints
        for (model, _name), slot in self.layout.probes.items():
            cluster = clusters.get(model)
            if cluster is not None and cluster.health_checked and ints[self.layout.probes_at + 2 * slot] == 0:
                return True
        return False

    def adopt_probes(self, clusters: Mapping[str, Cluster]) -> None:
        ints, seen = self._ints, self._probes_seen
        for (model, name), slot in self.layout.probes.items():
            at = self.layout.probes_at + 2 * slot
            seq = ints[at]
            if seq == seen.get(slot, 0):
                continue
            seen[slot] = seq
            cluster = clusters.get(model)
            endpoint = find_endpoint(cluster, name)
            if cluster is not None and endpoint is not None:
                cluster.adopt_health(endpoint, bool(ints[at + 1]), "failed the health check")

    # --- resources (resource_aware) -------------------------------------------------------------

    def publish_resources(self, cluster: Cluster, endpoint: Endpoint) -> None:
        """The leader scraped `endpoint`: its snapshot for the others. Its `in_flight_at_scrape` is
        the in-flight count summed over the workers (the shared load), which is what the strategy
        reads as `in_flight` in every worker."""
        slot = self.layout.probes.get((cluster.name, endpoint.name))
        if slot is None or endpoint.resources is None:
            return
        write_snapshot(self._ints, self.layout.resources_at + SNAPSHOT_SLOTS * slot, endpoint.resources)

    def adopt_resources(self, clusters: Mapping[str, Cluster]) -> None:
        """A follower: each snapshot the leader published since the last call, as its scraper would
        have set it."""
        ints, seen = self._ints, self._resources_seen
        for (model, name), slot in self.layout.probes.items():
            at = self.layout.resources_at + SNAPSHOT_SLOTS * slot
            if ints[at] == seen.get(slot, 0):
                continue
            read = read_snapshot(ints, at)
            if read is None:  # unpublished, or being written: next round
                continue
            seen[slot], snapshot = read
            endpoint = find_endpoint(clusters.get(model), name)
            if endpoint is not None:
                endpoint.resources = snapshot

    # --- model counts (for /admin/overview) -----------------------------------------------------

    def publish_counts(self, clusters: Mapping[str, Cluster]) -> None:
        ints = self._ints
        for name, slot in self.layout.models.items():
            cluster = clusters.get(name)
            if cluster is not None:
                at = self.layout.count_row(slot, self.index)
                ints[at], ints[at + 1], ints[at + 2] = (
                    len(cluster.capacity),
                    cluster.budget.active,
                    cluster.budget.retrying,
                )
        for cluster in clusters.values():
            for endpoint in cluster.endpoints:
                probe = self.layout.probes.get((cluster.name, endpoint.name))
                if probe is not None:
                    ints[self.layout.endpoint_count(probe, self.index)] = endpoint.model_in_flight

    def endpoint_totals(self, cluster: Cluster) -> dict[str, int]:
        """What /admin/overview shows of a model's requests on each of its endpoints over every
        worker: this worker's live counts and the others' last published (at most a follow round
        old). An endpoint not in the config (none: placement is one process) has this worker's."""
        totals = {}
        for endpoint in cluster.endpoints:
            total = endpoint.model_in_flight
            slot = self.layout.probes.get((cluster.name, endpoint.name))
            if slot is not None:
                for index in range(self.count):
                    if index != self.index:
                        total += self._ints[self.layout.endpoint_count(slot, index)]
            totals[endpoint.name] = total
        return totals

    def model_totals(self, cluster: Cluster) -> dict[str, int] | None:
        """What /admin/overview shows of a model's requests over every worker: this worker's live
        counts and the others' last published (at most a follow round old), with the configured
        max_pending_requests (each worker keeps its part); None for a model not in the config."""
        slot = self.layout.models.get(cluster.name)
        if slot is None:
            return None
        totals = [len(cluster.capacity), cluster.budget.active, cluster.budget.retrying]
        for index in range(self.count):
            if index != self.index:
                at = self.layout.count_row(slot, index)
                for field in range(COUNT_SLOTS):
                    totals[field] += self._ints[at + field]
        configured = self._max_pending.get(cluster.name, cluster.capacity.config.max_pending_requests)
        queued, active, retrying = totals
        return {"queued": queued, "active_requests": active, "retries_in_flight": retrying,
                "max_pending_requests": configured}  # fmt: skip

    # --- outlier ejections -----------------------------------------------------------------------

    def publish_ejection(self, cluster: Cluster, endpoint: Endpoint) -> None:
        """This worker's outlier detection ejected `endpoint`: its row says until when."""
        slot = self.layout.probes.get((cluster.name, endpoint.name))
        state = cluster.outliers.get(endpoint.name)
        if slot is None or state is None or state.ejected_until is None:
            return
        values = (_bits(state.ejected_until), state.ejections)
        write_locked(self._ints, self.layout.ejection_row(slot, self.index), values)

    def adopt_ejections(self, clusters: Mapping[str, Cluster]) -> None:
        """Each ejection another worker published since the last call, taken here as well."""
        ints, seen, now = self._ints, self._ejections_seen, time.monotonic()
        own, self._own_ejections_read = not self._own_ejections_read, True
        for (model, name), slot in self.layout.probes.items():
            for index in range(self.count):
                if index == self.index and not own:
                    continue
                at = self.layout.ejection_row(slot, index)
                if ints[at] == seen.get(at, 0):
                    continue
                read = read_locked(ints, at, EJECTION_SLOTS - 1)
                if read is None:  # unpublished, or being written: next round
                    continue
                seq, (until, ejections) = read
                cluster = clusters.get(model)
                # Kept in by max_ejection_percent: asked again next round, while it lasts.
                if cluster is None or cluster.adopt_ejection(name, _float(until), ejections, now):
                    seen[at] = seq

    # --- admin changes --------------------------------------------------------------------------

    @contextmanager
    def admin_change(self, section: str, entries: Mapping[str, object]) -> Iterator[None]:
        """Record an admin change for every worker: `entries` (key -> value; None deletes a graph)
        for `section`. Published first, applied in the body: the merged document is serialised and
        written beside admin.json before the body runs (ChangeNotShared if it cannot be: nothing
        applied); the
        body applies the change here (an exception: nothing published); then the document replaces
        admin.json and the generation moves. Blocking file I/O on a tmpfs file, under a lock held
        for as long as the change takes to apply."""
        path = self.run_dir / ADMIN_FILE
        try:
            lock = (self.run_dir / (ADMIN_FILE + ".lock")).open("a")
        except OSError as exc:
            raise ChangeNotShared(f"the other workers cannot be given the change: {exc}") from exc
        with lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            document = self._read_admin()
            document.setdefault(section, {}).update(entries)
            temporary = path.with_suffix(f".{os.getpid()}")
            try:
                temporary.write_bytes(orjson.dumps(document))
            except (TypeError, OSError) as exc:  # orjson.JSONEncodeError is a TypeError
                temporary.unlink(missing_ok=True)
                raise ChangeNotShared(f"the other workers cannot be given the change: {exc}") from exc
            try:
                yield
            except BaseException:
                temporary.unlink(missing_ok=True)
                raise
            temporary.replace(path)
            self._ints[self.layout.admin_at] += 1  # writers take turns under the lock

    def publish_admin(self, section: str, key: str, value: object) -> None:
        """`admin_change` with nothing to apply here."""
        with self.admin_change(section, {key: value}):
            pass

    def admin_changes(self) -> dict[str, Any] | None:
        """The admin document when it changed since the last call, else None."""
        generation = self._ints[self.layout.admin_at]
        if generation == self._admin_seen:
            return None
        self._admin_seen = generation
        return self._read_admin()

    def _read_admin(self) -> dict[str, Any]:
        try:
            document = orjson.loads((self.run_dir / ADMIN_FILE).read_bytes())
        except FileNotFoundError:
            return {}
        return document if isinstance(document, dict) else {}

    # --- listener counters ----------------------------------------------------------------------

    def publish_listener(self, stats: ListenerStats) -> None:
        at = self.layout.listener_at + self.index * _LISTENER_FIELDS
        ints = self._ints
        ints[at] = stats.open_connections
        ints[at + 1] = stats.refused_connections
        ints[at + 2] = stats.header_timeouts
        ints[at + 3] = stats.refused_heads.get(400, 0)
        ints[at + 4] = stats.refused_heads.get(431, 0)

    def listener_totals(self, own: ListenerStats) -> ListenerStats:
        """Every worker's listener counters summed: this worker's live, the others' last published,
        and those of workers that exited (the base)."""
        self.publish_listener(own)
        rows = [
            self._ints[self.layout.listener_at + i * _LISTENER_FIELDS :][:_LISTENER_FIELDS]
            for i in range(self.count + 1)  # the base follows the last worker's row
        ]
        return ListenerStats(
            open_connections=sum(r[0] for r in rows),
            refused_connections=sum(r[1] for r in rows),
            header_timeouts=sum(r[2] for r in rows),
            refused_heads={400: sum(r[3] for r in rows), 431: sum(r[4] for r in rows)},
        )
