"""`Gateway`: everything one gateway instance owns, built from its config (no globals), started
and stopped with the aiohttp application."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from aiohttp import web

from modelyard.balancing import Need, check_strategy_name
from modelyard.balancing.kv_events import KvIndex
from modelyard.cluster import Load
from modelyard.config import GATEWAY_SERVICE_NAME, GatewayConfig, ModelConfig
from modelyard.errors import ModelNotFound, ModelyardError, Overloaded
from modelyard.gateway.access_log import AccessLog
from modelyard.gateway.admission import Admission
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.graphs import GatewayInvoker, GraphService
from modelyard.gateway.health import HealthChecker
from modelyard.gateway.kv_subscriber import KvSubscriptions
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.placement import FeedFollower, PlacedModels
from modelyard.gateway.prefix_sharing import PrefixSharing
from modelyard.gateway.proxy import NOT_RELAYED, Proxy
from modelyard.gateway.quotas import Quotas
from modelyard.gateway.runtime_keys import RuntimeKeys
from modelyard.gateway.siblings import Siblings, find_endpoint
from modelyard.gateway.worker_log import WorkerLog
from modelyard.graph import Graph, load_config_graphs
from modelyard.rpc import OipChannels
from modelyard.security.api_keys import Caller
from modelyard.serving import ListenerStats
from modelyard.state import MemoryState, SharedState, open_state
from modelyard.state.key_store import FileKeyStore, KeyStore, RedisKeyStore
from modelyard.state.quotas import MemoryQuotas, RedisQuotas
from modelyard.state.siblings import RINGS_FILE, Rings, SiblingState
from modelyard.telemetry import Tracer, build_tracer
from modelyard.upstream import UpstreamPool
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client
from modelyard.upstream.scrape import ResourceScraper

FOLLOW_SECONDS = 0.05
VERDICT_GRACE = 1.0  # seconds past the probe timeout a follower waits for the leader's first verdicts
_NOTHING = object()
# The default strategy's key among the "strategies" admin changes the workers share: beside each
# model's, so that any order of applying them ends the same; no model is named "" (names are not empty).
DEFAULT_STRATEGY_KEY = ""
T = TypeVar("T")
log = logging.getLogger("modelyard.gateway")


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        state: SharedState | None = None,
        seed: int | None = None,
        graphs: dict[str, Graph] | None = None,
        siblings: Siblings | None = None,
        tracer: Tracer | None = None,
    ) -> None:
        """`tracer`: instead of the one telemetry's config builds (tests read spans in-process)."""
        self.config = config
        self.tracer = tracer if tracer is not None else build_tracer(config.telemetry, GATEWAY_SERVICE_NAME)
        self.siblings = siblings  # the other workers of this gateway (listen.workers > 1)
        self.loads: dict[str, Load] = {}
        # Before the clusters: their endpoints' TLS settings are the pool's (files checked now).
        self.pool = UpstreamPool(config.upstream, relay_drop=NOT_RELAYED)
        self.metrics = GatewayMetrics(
            lambda: self.loads.values(),
            max_log_streams=config.admin.max_log_streams,
            multiprocess_dir=str(siblings.metrics_dir) if siblings is not None else None,
            worker=siblings.index if siblings is not None else None,
        )
        # Changed only by the placement feed, in place and between awaits (GatewayInvoker holds it).
        self.clusters = {m.name: self.new_cluster(m) for m in config.models}
        # What models that appear later (placed by the scheduler) start with; a switch for every
        # model sets it. Without a scheduler none appear: the models' own strategy when they agree.
        configured = {m.strategy for m in config.models}
        self.default_strategy: str = (
            configured.pop()
            if config.placement.scheduler is None and len(configured) == 1
            else config.placement.models.strategy
        )
        self.metrics.watch_requests(self._requests_in_flight)
        # prefix_aware's precise mode: a subscription per endpoint with KV events, in every worker
        self.kv_subscriptions = KvSubscriptions(self._kv_endpoints)
        self.metrics.watch_kv_events(
            lambda: [
                (c.name, c.balancer.kv) for c in list(self.clusters.values()) if c.balancer.kv is not None
            ]
        )
        # The workers of one gateway show each other's requests in their routing logs and canaries.
        self._worker_log = (
            WorkerLog(siblings.run_dir, siblings.index, siblings.count) if siblings is not None else None
        )
        if self._worker_log is not None:
            self.metrics.routing_log.share = self._worker_log.share_record
        # The workers of one gateway without Redis keep each other's state in step (state.siblings).
        self._sibling_state = (
            SiblingState(
                MemoryState(max_entries=config.state.max_entries),
                Rings(siblings.run_dir / RINGS_FILE, siblings.index, siblings.count),
                lambda event, count: self.metrics.worker_state_messages.labels(event).inc(count),
            )
            if state is None and siblings is not None and config.state.backend == "memory"
            else None
        )
        self.state: SharedState = (
            state
            if state is not None
            else self._sibling_state
            if self._sibling_state is not None
            else open_state(
                config.state,
                on_fallback=lambda _exc: self.metrics.state_fallbacks.inc(),
                on_writeback=self.metrics.state_writebacks.inc,
            )
        )
        # To endpoints with a grpc_url; no channel until a call.
        self.grpc_channels = OipChannels(self.pool.tls.default)
        # Gateways on one Redis, or the workers of one gateway, share prefix_aware's index; a gateway
        # alone has nobody to tell.
        shared = config.state.backend == "redis" or self._sibling_state is not None
        self.prefix_sharing = (
            PrefixSharing(self.state, self.clusters, self.metrics)
            if shared and config.state.share_prefix_index
            else None
        )
        self.access = (
            AccessLog(config.logging, siblings.index if siblings is not None else None)
            if config.logging.access_log
            else None
        )
        # auth.enabled: tenants' limits, counted in Redis with the redis backend, else here
        self.quotas = self._open_quotas(config, siblings) if config.auth.enabled else None
        self.proxy = Proxy(
            self.pool,
            self.grpc_channels,
            self.state,
            self.metrics,
            random.Random(seed),
            clusters=self.clusters,
            share_prefix=self.prefix_sharing.offer if self.prefix_sharing is not None else None,
            share_canary=self._worker_log.share_canary if self._worker_log is not None else None,
            tracer=self.tracer,
            access=self.access,
            drop_credentials=config.auth.enabled,
        )
        # Alone, or the workers' leader: probes and scrapes; the other workers adopt its results.
        self._leader = siblings is None or siblings.leader
        self.health = HealthChecker(
            self.clusters.values(),
            self.pool,
            on_probe=siblings.publish_probe if siblings is not None and self._leader else None,
        )
        self._applied: dict[tuple[str, str], object] = {}  # (section, key) -> the admin change applied
        self._following: asyncio.Task[None] | None = None
        self._listener: ListenerStats | None = None
        self.scrapers: dict[str, tuple[ResourceScraper, Http1Client]] = {}
        invoker = GatewayInvoker(
            self.clusters, self.proxy, UrlInvoker(self.pool.client), lambda name: self.placed.not_placed(name)
        )
        self.graphs = GraphService(
            load_config_graphs(config, "config") if graphs is None else graphs,
            invoker,
            config.graph_propagate_headers,
            self.metrics.graph_step,
            self.tracer,
            self.access,
            self.proxy.new_request_id,
        )
        # auth.enabled: who may call which model (the keys file's names checked against the models
        # and graphs, unless a scheduler places models not known yet)
        known = None if config.placement.scheduler else [*self.clusters, *self.graphs.graphs]
        self.admission = Admission(config.auth, known) if config.auth.enabled else None
        if self.admission is not None:
            self.admission.quotas = self.quotas
            store = self._open_key_store(config)
            if store is not None:
                keys = self.admission.keys
                self.admission.runtime = RuntimeKeys(
                    store, lambda: keys.table, known, config.auth.key_refresh_interval
                )
        self.created = int(time.time())
        self.placed = PlacedModels(self, config.placement)
        self.follower = (
            FeedFollower(self.placed, config.placement, random.Random(seed))
            if config.placement.scheduler
            else None
        )
        self._retiring: set[asyncio.Task[None]] = set()

    def _open_quotas(self, config: GatewayConfig, siblings: Siblings | None) -> Quotas:
        workers = siblings.count if siblings is not None else 1
        shared = (
            RedisQuotas(config.state.url, key_prefix=config.state.key_prefix, timeout=config.state.timeout)
            if config.state.backend == "redis"
            else None
        )
        return Quotas(
            shared,
            MemoryQuotas(share=workers),
            config.auth.quota_store_down,
            self.metrics.tenant_refused,
            self.metrics.tenant_ended,
        )

    @staticmethod
    def _open_key_store(config: GatewayConfig) -> KeyStore | None:
        """Where runtime keys are kept: Redis, else auth.runtime_keys_file, else nowhere (off)."""
        if config.state.backend == "redis":
            return RedisKeyStore(
                config.state.url, key_prefix=config.state.key_prefix, timeout=config.state.timeout
            )
        if config.auth.runtime_keys_file is not None:
            return FileKeyStore(config.auth.runtime_keys_file)
        return None

    def _requests_in_flight(self) -> Iterator[tuple[str, int]]:
        """Per model: requests being served or waiting for an endpoint, summed over the workers."""
        for cluster in list(self.clusters.values()):
            totals = self.siblings.model_totals(cluster) if self.siblings is not None else None
            if totals is None:  # one process, or a placed model (the feed: one process)
                yield cluster.name, cluster.budget.active + len(cluster.capacity)
            else:
                yield cluster.name, totals["active_requests"] + totals["queued"]

    def _kv_endpoints(self) -> Iterator[tuple[str, KvIndex | None, list[tuple[str, str | None, str | None]]]]:
        for cluster in list(self.clusters.values()):
            endpoints = [(e.name, e.kv_events, e.kv_replay) for e in cluster.config.endpoints]
            yield cluster.name, cluster.balancer.kv, endpoints

    def new_cluster(self, config: ModelConfig) -> Cluster:
        siblings = self.siblings
        if siblings is None:
            return Cluster(
                config, self.loads, self.metrics.health_changed, self.metrics.outlier_event,
                tls_url=self.pool.tls.url,
            )  # fmt: skip
        return Cluster(
            config, self.loads, self.metrics.health_changed, self.metrics.outlier_event, siblings.new_load,
            on_refused=siblings.connection_refused, on_ejected=siblings.publish_ejection,
            tls_url=self.pool.tls.url,
        )  # fmt: skip

    def install(self, cluster: Cluster) -> None:
        """Route to a cluster added at runtime (placed by the scheduler): health checks and the
        strategy's scraper start for it as for a configured one."""
        self.clusters[cluster.name] = cluster
        self.health.add(cluster)
        self._serve_needs(cluster)

    def withdraw(self, name: str) -> None:
        """Stop routing to a cluster; requests that hold it finish. Its scraper stops in the
        background (the caller applies a snapshot in one step and cannot wait)."""
        self.clusters.pop(name, None)
        self.health.remove(name)
        scraper = self.scrapers.pop(name, None)
        if scraper is not None:
            task = asyncio.create_task(self._stop_scraper(*scraper), name=f"scraper-stop:{name}")
            self._retiring.add(task)
            task.add_done_callback(self._retiring.discard)

    def forget_unused_loads(self) -> None:
        """Drop the per-server load of URLs no endpoint uses any more (a replica that left, or came
        back at a new address), so placed models coming and going do not grow it without end or
        leave stale in-flight series in /metrics. Requests still running on a dropped one release
        onto the object their endpoint holds."""
        # str(): an endpoint's URL with TLS settings of its own (a TlsUrl) equals no plain string.
        in_use = {str(e.url) for cluster in self.clusters.values() for e in cluster.endpoints}
        for url in [url for url in self.loads if url not in in_use]:
            del self.loads[url]

    def cluster(self, name: str | None) -> Cluster:
        cluster = self.clusters.get(name or "")
        if cluster is None:
            not_placed = self.placed.not_placed(name or "")
            if not_placed is not None:
                raise not_placed
            raise ModelNotFound(name, {*self.clusters, *self.placed.models})
        return cluster

    def admit(self, name: str | None, caller: Caller | None = None) -> Cluster:
        """The model's cluster, if a request for it could be taken now: ModelNotFound (or the
        placement error) for an unknown model, Overloaded (counted) when every endpoint is full
        (and the queue holds no request that `caller`'s may shed). Lets a server refuse before
        reading (or converting) a body."""

        cluster = self.cluster(name)
        if cluster.config.fallbacks:  # a full model's requests may go to a fallback (gateway/fallback.py)
            return cluster
        try:
            if caller is None:
                cluster.capacity.refuse_if_full(cluster.endpoints)
            else:
                cluster.capacity.refuse_if_full(cluster.endpoints, caller.tenant, caller.priority)
        except Overloaded:
            self.metrics.overloaded.labels(cluster.name).inc()
            raise
        return cluster

    def set_strategy(self, cluster: Cluster, name: object) -> None:
        """Switch a model's strategy at runtime, starting what the new one needs."""
        cluster.set_strategy(name)
        self._serve_needs(cluster)

    def set_default_strategy(self, name: object) -> None:
        """The strategy models that appear later start with (UnknownStrategy if none)."""
        self.default_strategy = check_strategy_name(name)

    def switch_every_strategy(self, name: object) -> None:
        """Switch every model, placed ones waiting for endpoints too, and make `name` the default
        of models that appear later. A bad name changes nothing."""
        self.set_default_strategy(name)
        for cluster in self.clusters.values():
            self.set_strategy(cluster, name)
        for cluster in self.placed.parked():
            cluster.set_strategy(name)  # what it needs starts when it is installed again

    def watch_listener(self, stats: ListenerStats) -> None:
        """Export the listener's counters (with workers, summed over them)."""
        siblings = self.siblings
        if siblings is None:
            self.metrics.watch_listener(lambda: stats)
        else:
            self.metrics.watch_listener(lambda: siblings.listener_totals(stats))
            self._listener = stats

    def change(self, section: str, entries: dict[str, object], apply: Callable[[], T]) -> T:
        """Apply an admin change (`apply`) and give it to the other workers as `entries` for
        `section`, which they apply in turn: published first, so that a change the others cannot
        be given (ChangeNotShared, 503) is applied nowhere, and one that fails here is not given."""
        if self.siblings is None:
            return apply()
        with self.siblings.admin_change(section, entries):
            result = apply()
        self._applied.update({(section, key): value for key, value in entries.items()})
        return result

    async def start(self) -> None:
        if self._leader:
            await self.health.check_once()  # serve with real health from the first request
            self.health.start()
        if self.siblings is not None:
            if not self._leader:
                await self._await_verdicts(self.siblings)
            self._follow_once(self.siblings)  # what the others decided so far, before serving
            self._following = asyncio.create_task(self._follow(self.siblings), name="siblings")
        for cluster in list(self.clusters.values()):
            self._serve_needs(cluster)
        if self.follower is not None:
            await self.follower.start()
        if self._sibling_state is not None:
            self._sibling_state.start()
        if self.prefix_sharing is not None:
            self.prefix_sharing.start()
        self.kv_subscriptions.start()
        if self.admission is not None and self.admission.runtime is not None:
            await self.admission.runtime.start()

    async def stop(self) -> None:
        if self.admission is not None and self.admission.runtime is not None:
            await self.admission.runtime.stop()
        if self._following is not None:
            self._following.cancel()
            await asyncio.gather(self._following, return_exceptions=True)
        if self.follower is not None:
            await self.follower.stop()
        await self.health.stop()
        await self.kv_subscriptions.stop()
        await self.proxy.close()
        if self.quotas is not None:
            await self.quotas.close()
        for scraper, client in list(self.scrapers.values()):
            await self._stop_scraper(scraper, client)
        self.scrapers.clear()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.pool.close()
        await self.grpc_channels.close()
        if self.prefix_sharing is not None:
            await self.prefix_sharing.stop()
        await self.state.close()
        self.metrics.flush()  # (with workers: into this worker's files, which the others read)
        if self._worker_log is not None:
            self._worker_log.close()
        if self.tracer is not None:  # the spans still batched go out (blocking: off the loop)
            await asyncio.to_thread(self.tracer.shutdown)

    @staticmethod
    async def _stop_scraper(scraper: ResourceScraper, client: Http1Client) -> None:
        await scraper.stop()
        client.close()

    def _serve_needs(self, cluster: Cluster) -> None:
        """Scrape the model's endpoints' /metrics while its strategy reads their load. The scraper
        has its own small client: through the proxy's pool a scrape would queue exactly when the
        server is saturated, and its snapshot would go stale when it matters most. With workers the
        leader alone scrapes and publishes each snapshot; the others adopt them (`_follow_once`)."""
        if Need.RESOURCES not in cluster.balancer.strategy.needs or cluster.name in self.scrapers:
            return
        if not self._leader:
            return  # the leader scrapes for every worker; this one adopts its snapshots (_follow)
        siblings = self.siblings
        client = Http1Client(
            max_connections=2, connect_timeout=self.config.upstream.connect_timeout, tls=self.pool.tls.default
        )
        scraper = ResourceScraper(
            lambda: cluster.endpoints, client, cluster.config.resource_aware,
            on_snapshot=(lambda e: siblings.publish_resources(cluster, e)) if siblings is not None else None,
        )  # fmt: skip
        # Started before anything awaits, and recorded with it: a cancelled admin call can no
        # longer leave a scraper recorded but never running. Its loop scrapes at once.
        scraper.start()
        self.scrapers[cluster.name] = (scraper, client)

    async def _follow(self, siblings: Siblings) -> None:
        """Every FOLLOW_SECONDS: hand this worker's requests since the last round to the others (its
        metrics files, which any worker's scrape sums, and its routing-log records), adopt the
        leader's health verdicts and scrapes and the other workers' routing-log records, outlier
        ejections and admin changes, publish this worker's listener counters, and let requests
        queued for room (circuit_breakers) look again, since the others' releases do not wake them."""
        while True:
            try:
                self._follow_once(siblings)
            except Exception:  # one bad round must not stop the following ones
                log.exception("following the other workers failed; trying again")
            await asyncio.sleep(FOLLOW_SECONDS)

    async def _await_verdicts(self, siblings: Siblings) -> None:
        """Serve with real health from the first request, as the leader does: wait (bounded by the
        probe timeout and a grace) for the leader's first verdict on each health-checked endpoint."""
        timeouts = [c.config.health_check.timeout for c in self.clusters.values() if c.health_checked]
        if not timeouts:
            return
        deadline = time.monotonic() + max(timeouts) + VERDICT_GRACE
        # Another process writes the verdicts: nothing here to wait on but the clock.
        while siblings.verdicts_pending(self.clusters) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(FOLLOW_SECONDS)

    def _follow_once(self, siblings: Siblings) -> None:
        # This worker's requests since the last round, for the others' scrapes and routing logs
        # (metrics first: once the others hold a request's record, they count it too).
        self.metrics.flush()
        if self._worker_log is not None:
            self._worker_log.flush()
            self._worker_log.follow(self.metrics.routing_log, self.clusters)
        if not self._leader:
            siblings.adopt_probes(self.clusters)
            siblings.adopt_resources(self.clusters)
        else:  # a connection another worker saw refused: out here and published, probed soon
            for model, name in siblings.suspected():
                cluster = self.clusters.get(model)
                endpoint = find_endpoint(cluster, name)
                if cluster is not None and endpoint is not None:
                    cluster.record_connection_failure(endpoint, "connection refused (seen by another worker)")
        siblings.adopt_ejections(self.clusters)
        siblings.publish_counts(self.clusters)
        changes = siblings.admin_changes()
        if changes is not None:
            self._apply_changes(changes)
        if self._listener is not None:
            siblings.publish_listener(self._listener)
        for cluster in self.clusters.values():
            if len(cluster.capacity):  # room another worker freed wakes nobody here: look again
                cluster.capacity.wake_all()

    def _apply_changes(self, changes: dict[str, Any]) -> None:
        """Apply what this worker has not applied yet (its own changes are applied already)."""
        for section, entries in changes.items():
            for key, value in entries.items() if isinstance(entries, dict) else ():
                if self._applied.get((section, key), _NOTHING) == value:
                    continue
                self._applied[(section, key)] = value
                if section == "strategies" and key == DEFAULT_STRATEGY_KEY:
                    self._try("default strategy", lambda v=value: self.set_default_strategy(v))
                elif section == "strategies" and (cluster := self.clusters.get(key)) is not None:
                    self._try(f"strategy of {key}", lambda c=cluster, v=value: self.set_strategy(c, v))
                elif section == "routes" and (cluster := self.clusters.get(key)) is not None:
                    self._try(f"routes of {key}", lambda c=cluster, v=value: c.replace_routes(v))
                elif section == "graphs" and value is None:
                    if key in self.graphs.graphs:
                        self._try(f"graph {key}", lambda k=key: self.graphs.delete(k))
                elif section == "graphs":
                    self._try(f"graph {key}", lambda k=key, v=value: self.graphs.put(k, v))

    @staticmethod
    def _try(what: str, change: Any) -> None:
        try:
            change()
        except ModelyardError as exc:
            log.warning("could not apply another worker's change to the %s: %s", what, exc)


GATEWAY = web.AppKey("gateway", Gateway)
