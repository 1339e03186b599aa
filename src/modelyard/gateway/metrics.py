"""The gateway's Prometheus metrics, in a registry of its own so that two gateways can share a process,
and its routing log (routing_log.py), which the same outcomes feed."""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from modelyard.cluster import Load
from modelyard.gateway.access_log import dropped_lines
from modelyard.gateway.routing_log import DEFAULT_MAX_SUBSCRIBERS, RoutingLog
from modelyard.security.api_keys import Caller
from modelyard.serving import ListenerStats

if TYPE_CHECKING:
    from modelyard.balancing.kv_events import KvIndex


class _Incrementable(Protocol):
    def inc(self, amount: float, /) -> None: ...


def _counter_value(child: Counter) -> _Incrementable:
    """What a counter child's inc() increments, to increment it without the checks inc() repeats on
    every call. The child itself where that is not there."""
    value = getattr(child, "_value", None)
    return value if callable(getattr(value, "inc", None)) else child  # type: ignore[return-value]


class _Histogram:
    """A histogram child, added to a batch at a time: the samples' sum and their count per bucket
    (prometheus-client has no call for that: its `_sum` and `_buckets`, there since 0.4)."""

    __slots__ = ("_buckets", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._sum: _Incrementable = child._sum
        self._buckets: list[_Incrementable] = child._buckets
        if len(self._buckets) != len(_BOUNDS):
            raise RuntimeError(f"prometheus-client's Histogram changed: {len(self._buckets)} buckets")

    def add(self, total: float, counts: list[float]) -> None:
        self._sum.inc(total)
        for bucket, count in zip(self._buckets, counts, strict=True):
            if count:
                bucket.inc(count)


_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_BOUNDS = [*_LATENCY_BUCKETS, float("inf")]  # a histogram's buckets' upper bounds, +Inf last
_SUM, _COUNTS = 1, 2  # in a pending entry: [requests, sum of seconds, count per bucket...]


class _Flush(Collector):
    """Registered first: what the request path counted since the last flush is in what follows."""

    def __init__(self, flush: Callable[[], None]) -> None:
        self._flush = flush

    def collect(self) -> Iterable[CounterMetricFamily]:
        self._flush()
        return ()


class _InFlightCollector(Collector):
    """Reads the live counters at scrape time, so the request path pays nothing for the gauge."""

    def __init__(self, loads: Callable[[], Iterable[Load]]) -> None:
        self._loads = loads

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "modelyard_backend_in_flight",
            "Requests this gateway has in flight per backend",
            labels=["backend"],
        )
        for load in self._loads():
            family.add_metric([load.name], load.in_flight)
        yield family


class _RequestsCollector(Collector):
    """Requests each model is serving or queueing, over every worker: what the gateway's HPA scales
    on (through prometheus-adapter). Read at scrape time from the counters admission keeps."""

    def __init__(self, totals: Callable[[], Iterable[tuple[str, int]]]) -> None:
        self._totals = totals

    def collect(self) -> Iterable[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "modelyard_requests_in_flight",
            "Requests this gateway is serving or queueing now, by model (all workers)",
            labels=["model"],
        )
        for model, count in self._totals():
            family.add_metric([model], count)
        yield family


# (model, its KvIndex) for each model in precise mode
KvIndexes = Callable[[], Iterable[tuple[str, "KvIndex"]]]


class _KvEventsCollector(Collector):
    """prefix_aware's precise mode per endpoint: whether routing uses its KV events now, the blocks
    its index holds, and its events and faults by kind. Read at scrape time from the indexes (every
    worker subscribes to the same events, so the answering worker's are the gateway's)."""

    def __init__(self, indexes: KvIndexes) -> None:
        self._indexes = indexes

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        precise = GaugeMetricFamily(
            "modelyard_kv_events_precise",
            "1 while prefix_aware routes to this endpoint on the blocks its KV events say it holds, "
            "0 while it falls back to the approximate index (no events yet, events lost or stopped)",
            labels=["model", "backend"],
        )
        blocks = GaugeMetricFamily(
            "modelyard_kv_index_blocks",
            "Blocks the endpoint's KV events say it holds",
            labels=["model", "backend"],
        )
        events = CounterMetricFamily(
            "modelyard_kv_events",
            "KV-cache events and faults by kind: stored, removed, cleared; gaps (lost batches), garbage, "
            "unknown_parent, unknown_removed, restarts, dropped (over kv_max_blocks), other_medium",
            labels=["model", "backend", "kind"],
        )
        now = time.monotonic()
        for model, kv in self._indexes():
            for name, held in list(kv.endpoints.items()):
                precise.add_metric([model, name], 1.0 if kv.usable(name, now) is not None else 0.0)
                blocks.add_metric([model, name], len(held.held))
                for kind, count in held.counts.items():
                    events.add_metric([model, name, kind], count)
        yield precise
        yield blocks
        yield events


class _AccessLogCollector(Collector):
    """Access log lines dropped because the writer fell behind (logging.access_log), read at scrape
    time from the handler's count. With workers: the answering worker's, labelled with it."""

    def __init__(self, worker: int | None) -> None:
        self._labels = ([], []) if worker is None else (["worker"], [str(worker)])

    def collect(self) -> Iterable[CounterMetricFamily]:
        names, values = self._labels
        dropped = CounterMetricFamily(
            "modelyard_access_log_dropped",
            "Access log lines dropped: more waited to be written than the queue holds",
            labels=names,
        )
        dropped.add_metric(values, dropped_lines())
        yield dropped


class _ListenerCollector(Collector):
    """The client-facing listener's counters, read at scrape time (the listener keeps plain ints)."""

    def __init__(self, stats: Callable[[], ListenerStats]) -> None:
        self._stats = stats

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._stats()
        yield GaugeMetricFamily(
            "modelyard_connections_open", "Client connections open now", value=stats.open_connections
        )
        yield CounterMetricFamily(
            "modelyard_connections_refused",
            "Client connections answered 503 and closed because listen.max_connections were open",
            value=stats.refused_connections,
        )
        yield CounterMetricFamily(
            "modelyard_header_timeouts",
            "Client connections closed because a request head took longer than listen.header_timeout",
            value=stats.header_timeouts,
        )
        refused = CounterMetricFamily(
            "modelyard_request_heads_refused",
            "Request heads refused before routing: 400 malformed, 431 header fields too large",
            labels=["code"],
        )
        for code, count in sorted(stats.refused_heads.items()):
            refused.add_metric([str(code)], count)
        yield refused


class _RoutingLogCollector(Collector):
    """The live-log streams, read at scrape time from the routing log's own counts. With workers
    (`worker` set) each has its own streams and admin.max_log_streams: labelled with the worker that
    answered the scrape, whose counts they are."""

    def __init__(self, log: RoutingLog, worker: int | None = None) -> None:
        self._log = log
        self._labels = ([], []) if worker is None else (["worker"], [str(worker)])

    def collect(self) -> Iterable[GaugeMetricFamily | CounterMetricFamily]:
        names, values = self._labels
        open_now = GaugeMetricFamily(
            "modelyard_log_streams_open", "Live routing-log streams open now", labels=names
        )
        open_now.add_metric(values, self._log.subscribers)
        yield open_now
        refused = CounterMetricFamily(
            "modelyard_log_streams_refused",
            "Live routing-log streams answered 503 because admin.max_log_streams were open",
            labels=names,
        )
        refused.add_metric(values, self._log.refused)
        yield refused


class GatewayMetrics:
    def __init__(
        self,
        loads: Callable[[], Iterable[Load]],
        *,
        max_log_streams: int = DEFAULT_MAX_SUBSCRIBERS,
        multiprocess_dir: str | None = None,
        worker: int | None = None,
    ) -> None:
        self.routing_log = RoutingLog(max_subscribers=max_log_streams, worker=worker)
        # Each request is counted in `_pending`, plain Python numbers, and added to the Prometheus
        # metrics in batches (`flush`): when the metrics are read (a scrape, whatever reads a
        # registry: `_Flush` is registered first), and with workers every FOLLOW_SECONDS, since the
        # others' scrapes read this worker's counts from its files. prometheus-client's own
        # calls take a lock, and with workers ask the process id (a system call) and write the
        # value into a memory-mapped file: three per request, about 7% of a worker's time
        # (benchmarks/README.md).
        self._pending: dict[tuple[str, str, str, int], list[float]] = {}
        # (tenant, code): count, tokens, cost, shed
        self._tenant_pending: dict[tuple[str, int], list[float]] = {}
        self.registry = CollectorRegistry()
        self.registry.register(_Flush(self.flush))
        # What /metrics serves. With workers (multiprocess_dir, which PROMETHEUS_MULTIPROC_DIR
        # names in every worker), prometheus-client keeps each worker's counters and histograms in
        # files there, and the exposition sums them; the collectors below read shared counters (the
        # log streams: the answering worker's, labelled with it).
        self.exposition = self.registry
        if multiprocess_dir is not None:
            self.exposition = CollectorRegistry()
            self.exposition.register(_Flush(self.flush))
            MultiProcessCollector(self.exposition, path=multiprocess_dir)  # type: ignore[no-untyped-call]
        self.requests = Counter(
            "modelyard_requests_total",
            "Requests answered, by model, backend, strategy and status code",
            ["model", "backend", "strategy", "code"],
            registry=self.registry,
        )
        self.duration = Histogram(
            "modelyard_request_duration_seconds",
            "Time from request received to response complete",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.ttft = Histogram(
            "modelyard_time_to_first_token_seconds",
            "Time from request received to the first streamed chunk relayed",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.kv_affinity = Counter(
            "modelyard_kv_affinity_total", "kv_aware lookups by result", ["result"], registry=self.registry
        )
        self.state_fallbacks = Counter(
            "modelyard_state_fallback_total",
            "Shared-state operations that failed and fell back to local state",
            registry=self.registry,
        )
        self.state_writebacks = Counter(
            "modelyard_state_writeback_total",
            "Affinities written back to shared state after it returned (a SET NX that took)",
            registry=self.registry,
        )
        self.worker_state_messages = Counter(
            "modelyard_worker_state_messages_total",
            "The workers of one gateway without Redis: routing-state messages (affinities, the prefix "
            "index) sent to the other workers, applied from them, and dropped (too large, or overwritten "
            "before they were read)",
            ["event"],
            registry=self.registry,
        )
        self.prefix_index_shared = Counter(
            "modelyard_prefix_index_shared_total",
            "prefix_aware index records shared through Redis (or between the workers of one gateway): "
            "sent to the others, received from them and applied, dropped (queue full, Redis away, or "
            "stopped while sending), or "
            "skipped (received with another prefix_aware.chunk_chars than this gateway's)",
            ["direction"],
            registry=self.registry,
        )
        self.health_transitions = Counter(
            "modelyard_endpoint_health_transitions_total",
            "Endpoints going healthy or unhealthy",
            ["model", "backend", "to"],
            registry=self.registry,
        )
        self.graph_steps = Histogram(
            "modelyard_graph_step_duration_seconds",
            "Graph steps run, by graph, node, step and status code",
            ["graph", "node", "step", "code"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.retries = Counter(
            "modelyard_retries_total",
            "Retries, by model, route and reason",
            ["model", "route", "reason"],
            registry=self.registry,
        )
        self.retry_budget_exhausted = Counter(
            "modelyard_retry_budget_exhausted_total",
            "Retries not made because the retry budget was spent",
            ["model", "route"],
            registry=self.registry,
        )
        # auth.enabled: per tenant (the keys file's tenants: a bounded set; keys are not labels:
        # runtime keys are many, GET /admin/usage has them)
        self.tenant_requests = Counter(
            "modelyard_tenant_requests_total",
            "Requests of each tenant's keys that were let in, by the status they ended with",
            ["tenant", "code"],
            registry=self.registry,
        )
        self.tenant_tokens = Counter(
            "modelyard_tenant_tokens_total",
            "Tokens (prompt + completion) the answers to each tenant's requests reported in their usage",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_cost = Counter(
            "modelyard_tenant_cost_usd_total",
            "What each tenant's tokens cost at the endpoints' cost_per_1k_tokens",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_shed = Counter(
            "modelyard_tenant_shed_total",
            "Requests of each tenant let in and then refused for room (429 overloaded): the model's "
            "queue full or timed out, or shed for a higher-priority or another tenant's request",
            ["tenant"],
            registry=self.registry,
        )
        self.tenant_refusals = Counter(
            "modelyard_tenant_refused_total",
            "Requests refused with 429 before routing because a tenant or its key was over a limit: "
            "requests, tokens, concurrent, budget",
            ["tenant", "reason"],
            registry=self.registry,
        )
        self.overloaded = Counter(
            "modelyard_overloaded_total",
            "Requests refused with 429: every endpoint at max_requests and the queue full or timed out",
            ["model"],
            registry=self.registry,
        )
        self.fallbacks = Counter(
            "modelyard_fallbacks_total",
            "Requests sent on to a fallback model, by the model asked for, the fallback and the reason "
            "(saturated, no_endpoint, server_error, timeout, context_length)",
            ["model", "fallback", "reason"],
            registry=self.registry,
        )
        self.fallbacks_skipped = Counter(
            "modelyard_fallbacks_skipped_total",
            "Fallback models passed over, by the model asked for, the fallback and why: not_allowed "
            "(the caller's key may not use it), not_served (no such model here now), context_window "
            "(the request is longer than its context_window), no_route (its routes match no such request)",
            ["model", "fallback", "why"],
            registry=self.registry,
        )
        self.stream_idle_timeouts = Counter(
            "modelyard_stream_idle_timeouts_total",
            "Streams cut because the server sent nothing for stream_idle_timeout",
            ["model"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "modelyard_stream_errors_total",
            "Streams that broke off after their status was sent, ended with a final error event, by code",
            ["model", "code"],
            registry=self.registry,
        )
        self.outlier_events = Counter(
            "modelyard_outlier_events_total",
            "Outlier detection: ejections by reason (consecutive_5xx, latency), returns, and panic mode",
            ["model", "backend", "event"],
            registry=self.registry,
        )
        self.canary_agreement = Gauge(
            "modelyard_canary_agreement",
            "Mean ROUGE-L between a route's answers and its mirror's (1 = the same words)",
            ["model", "route"],
            registry=self.registry,
            multiprocess_mode="mostrecent",
        )
        self.canary_duration = Histogram(
            "modelyard_canary_duration_seconds",
            "Latency of mirrored requests and of their primaries, by subset",
            ["model", "route", "subset"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.canary_requests = Counter(
            "modelyard_canary_requests_total",
            "Mirrored requests and their primaries, by subset and result",
            ["model", "route", "subset", "result"],
            registry=self.registry,
        )
        # Refused requests the routing log did not record (routing_log.REFUSED_PER_SECOND): taken
        # from its count at each flush, so that with workers the exposition sums them.
        self.log_refusals_unrecorded = Counter(
            "modelyard_log_refusals_unrecorded",
            "Requests refused before routing (unknown model, not placed, bad body) left out of the "
            "routing log: more came than it records per second per worker; their access lines stay",
            registry=self.registry,
        )
        self._unrecorded_counted = 0
        self.exposition.register(_InFlightCollector(loads))
        self.exposition.register(_RoutingLogCollector(self.routing_log, worker))
        self.exposition.register(_AccessLogCollector(worker))
        # prometheus-client's labels() locks and hashes per call; cache the children we use.
        self._request_children: dict[tuple[str, str, str, int], _Incrementable] = {}
        self._duration_children: dict[str, _Histogram] = {}
        self._empty = [0.0] * (_COUNTS + len(_BOUNDS))

    def watch_requests(self, totals: Callable[[], Iterable[tuple[str, int]]]) -> None:
        """Export each model's requests in flight (`totals` read at each scrape)."""
        self.exposition.register(_RequestsCollector(totals))

    def watch_kv_events(self, indexes: KvIndexes) -> None:
        """Export prefix_aware's precise-mode state (`indexes` read at each scrape)."""
        self.exposition.register(_KvEventsCollector(indexes))

    def watch_listener(self, stats: Callable[[], ListenerStats]) -> None:
        """Export the counters of the listener serving this gateway (`stats` read at each scrape)."""
        self.exposition.register(_ListenerCollector(stats))

    def graph_step(self, graph: str, node: str, step: str, code: int, seconds: float) -> None:
        self.graph_steps.labels(graph, node, step, str(code)).observe(seconds)

    def outlier_event(self, model: str, backend: str, event: str) -> None:
        self.outlier_events.labels(model, backend, event).inc()

    def health_changed(self, model: str, backend: str, healthy: bool) -> None:
        self.health_transitions.labels(model, backend, "healthy" if healthy else "unhealthy").inc()

    def observe_request(self, model: str, backend: str, strategy: str, code: int, seconds: float) -> None:
        """A request (or a try) answered: counted, and its seconds in the duration histogram, at the
        next `flush`."""
        key = (model, backend, strategy, code)
        pending = self._pending.get(key)
        if pending is None:  # (the first since the last flush)
            pending = self._pending[key] = self._empty.copy()
            if key not in self._request_children:
                self._first_seen(key)
        pending[0] += 1
        pending[_SUM] += seconds
        pending[_COUNTS + bisect_left(_BOUNDS, seconds)] += 1  # the first bound >= seconds

    def _first_seen(self, key: tuple[str, str, str, int]) -> None:
        """The metrics' children for a label set seen for the first time, made now: their
        `_created` time is the first request's, not the next flush's."""
        model, backend, strategy, code = key
        self._request_children[key] = _counter_value(
            self.requests.labels(model, backend, strategy, str(code))
        )
        if model not in self._duration_children:
            self._duration_children[model] = _Histogram(self.duration.labels(model))

    def tenant_ended(self, tenant: str, code: int, tokens: int, cost: float, shed: bool = False) -> None:
        """A keyed request ended: counted here, added to the metrics at the next flush (as the
        requests are: prometheus-client's own calls cost a lock and, with workers, file writes)."""
        counts = self._tenant_pending.get((tenant, code))
        if counts is None:
            self._tenant_pending[(tenant, code)] = [1, tokens, cost, int(shed)]
        else:
            counts[0] += 1
            counts[1] += tokens
            counts[2] += cost
            counts[3] += shed

    def tenant_refused(self, caller: Caller, reason: str) -> None:
        self.tenant_refusals.labels(caller.tenant, reason).inc()

    def flush(self) -> None:
        """Add the requests counted since the last flush to the Prometheus metrics."""
        unrecorded = self.routing_log.refusals_unrecorded
        if unrecorded != self._unrecorded_counted:
            self.log_refusals_unrecorded.inc(unrecorded - self._unrecorded_counted)
            self._unrecorded_counted = unrecorded
        if self._tenant_pending:
            tenants, self._tenant_pending = self._tenant_pending, {}
            for (tenant, code), (count, tokens, cost, shed) in tenants.items():
                self.tenant_requests.labels(tenant, str(code)).inc(count)
                if shed:
                    self.tenant_shed.labels(tenant).inc(shed)
                if tokens:
                    self.tenant_tokens.labels(tenant).inc(tokens)
                if cost:
                    self.tenant_cost.labels(tenant).inc(cost)
        if not self._pending:
            return
        pending, self._pending = self._pending, {}
        for key, (count, total, *buckets) in pending.items():
            self._request_children[key].inc(count)
            self._duration_children[key[0]].add(total, buckets)
