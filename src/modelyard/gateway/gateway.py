"""`Gateway`: everything one gateway instance owns, built from its config (no globals), started
and stopped with the aiohttp application."""

from __future__ import annotations

import asyncio
import random
import time

from aiohttp import web

from modelyard.balancing import Need
from modelyard.cluster import BackendLoad
from modelyard.config import GatewayConfig, ModelConfig
from modelyard.errors import ModelNotFound
from modelyard.gateway.cluster import Cluster
from modelyard.gateway.graphs import GatewayInvoker, GraphService
from modelyard.gateway.health import HealthChecker
from modelyard.gateway.metrics import GatewayMetrics
from modelyard.gateway.placement import FeedFollower, PlacedModels
from modelyard.gateway.prefix_sharing import PrefixSharing
from modelyard.gateway.proxy import Proxy
from modelyard.graph import Graph, load_config_graphs
from modelyard.state import SharedState, open_state
from modelyard.upstream import UpstreamPool
from modelyard.upstream.graph_invoker import UrlInvoker
from modelyard.upstream.http1 import Http1Client
from modelyard.upstream.scrape import ResourceScraper


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        *,
        state: SharedState | None = None,
        seed: int | None = None,
        graphs: dict[str, Graph] | None = None,
    ) -> None:
        self.config = config
        self.loads: dict[str, BackendLoad] = {}
        self.metrics = GatewayMetrics(
            lambda: self.loads.values(), max_log_streams=config.admin.max_log_streams
        )
        # Changed only by the placement feed, in place and between awaits (GatewayInvoker holds it).
        self.clusters = {m.name: self.new_cluster(m) for m in config.models}
        self.state = (
            state
            if state is not None
            else open_state(
                config.state,
                on_fallback=lambda _exc: self.metrics.state_fallbacks.inc(),
                on_writeback=self.metrics.state_writebacks.inc,
            )
        )
        self.pool = UpstreamPool(config.upstream)
        # Gateways on one Redis share prefix_aware's index; a gateway alone has nobody to tell.
        self.prefix_sharing = (
            PrefixSharing(self.state, self.clusters, self.metrics)
            if config.state.backend == "redis" and config.state.share_prefix_index
            else None
        )
        self.proxy = Proxy(
            self.pool,
            self.state,
            self.metrics,
            random.Random(seed),
            share_prefix=self.prefix_sharing.offer if self.prefix_sharing is not None else None,
        )
        self.health = HealthChecker(self.clusters.values(), self.pool)
        self.scrapers: dict[str, tuple[ResourceScraper, Http1Client]] = {}
        invoker = GatewayInvoker(
            self.clusters, self.proxy, UrlInvoker(self.pool.client), lambda name: self.placed.not_placed(name)
        )
        self.graphs = GraphService(
            load_config_graphs(config, "config") if graphs is None else graphs,
            invoker,
            config.graph_propagate_headers,
            self.metrics.graph_step,
        )
        self.created = int(time.time())
        self.placed = PlacedModels(self, config.placement)
        self.follower = (
            FeedFollower(self.placed, config.placement, random.Random(seed))
            if config.placement.scheduler
            else None
        )
        self._retiring: set[asyncio.Task[None]] = set()

    def new_cluster(self, config: ModelConfig) -> Cluster:
        return Cluster(config, self.loads, self.metrics.health_changed, self.metrics.outlier_event)

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
        in_use = {e.url for cluster in self.clusters.values() for e in cluster.endpoints}
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

    def set_strategy(self, cluster: Cluster, name: object) -> None:
        """Switch a model's strategy at runtime, starting what the new one needs."""
        cluster.set_strategy(name)
        self._serve_needs(cluster)

    async def start(self) -> None:
        await self.health.check_once()  # serve with real health from the first request
        self.health.start()
        for cluster in list(self.clusters.values()):
            self._serve_needs(cluster)
        if self.follower is not None:
            await self.follower.start()
        if self.prefix_sharing is not None:
            self.prefix_sharing.start()

    async def stop(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
        await self.health.stop()
        await self.proxy.close()
        for scraper, client in list(self.scrapers.values()):
            await self._stop_scraper(scraper, client)
        self.scrapers.clear()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await self.pool.close()
        if self.prefix_sharing is not None:
            await self.prefix_sharing.stop()
        await self.state.close()

    @staticmethod
    async def _stop_scraper(scraper: ResourceScraper, client: Http1Client) -> None:
        await scraper.stop()
        client.close()

    def _serve_needs(self, cluster: Cluster) -> None:
        """Scrape the model's endpoints' /metrics while its strategy reads their load. The scraper
        has its own small client: through the proxy's pool a scrape would queue exactly when the
        server is saturated, and its snapshot would go stale when it matters most."""
        if Need.RESOURCES not in cluster.strategy.needs or cluster.name in self.scrapers:
            return
        client = Http1Client(max_connections=2, connect_timeout=self.config.upstream.connect_timeout)
        scraper = ResourceScraper(lambda: cluster.endpoints, client, cluster.config.resource_aware)
        # Started before anything awaits, and recorded with it: a cancelled admin call can no
        # longer leave a scraper recorded but never running. Its loop scrapes at once.
        scraper.start()
        self.scrapers[cluster.name] = (scraper, client)


GATEWAY = web.AppKey("gateway", Gateway)
